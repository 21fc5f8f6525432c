"""Bad input found after MPI started: one line, exit 2 on every rank, no traceback, no MPI_ABORT banner.

Each case is a real ``mpirun -n 2 python -m mpi4py -m ringzero.train`` job;
each rank's own exit code is read (trainer_cli wraps every rank in an sh
that prints it), and stderr must hold exactly one line from ringzero:
- a data file that rank 1 alone cannot read (RINGZERO_FAULT_DATA=rank:1),
  the case where the others would otherwise wait in the engine's first
  collective for a rank that has gone;
- a resume from a checkpoint with one flipped byte;
- a metrics file that cannot be created (only rank 0 opens it);
- --device cuda where CuPy has no GPU;
- a bad flag, under mpirun.
"""
import os

import pytest
import trainer_cli as cli
from conftest import have_cupy


def _one_line(rcs, out, err, *needles):
    """Every rank 2, one ringzero line on stderr (the rest is prterun's own
    "exited with non-zero status" notice), no traceback, no MPI_ABORT."""
    assert rcs == {0: 2, 1: 2}, cli.tail(out, err)
    ours = [ln for ln in err.splitlines() if ln.startswith("ringzero")]
    assert len(ours) == 1 and ours[0].startswith("ringzero.train: error: "), cli.tail(out, err)
    assert "Traceback" not in err + out and "MPI_ABORT" not in err, cli.tail(out, err)
    for n in needles:
        assert n in ours[0], ours[0]
    return ours[0]


def test_data_unreadable_on_one_rank(tmp_path):
    data = cli.corpus(tmp_path / "corpus.txt")
    res = cli.run(cli.TINY + ["--data", data, "--steps", "3"], tmp_path, env={"RINGZERO_FAULT_DATA": "rank:1"})
    _one_line(*res, "rank 1: ", "Permission denied", repr(data))


def test_resume_from_corrupted_checkpoint(tmp_path):
    data = cli.corpus(tmp_path / "corpus.txt")
    ck = str(tmp_path / "ck")
    base = cli.TINY + ["--data", data, "--save-dir", ck]
    rcs, out, err = cli.run(base + ["--steps", "2", "--save-every", "2"], tmp_path)
    assert rcs == {0: 0, 1: 0}, cli.tail(out, err)
    bad = os.path.join(ck, "step-000002", "adam_v-r00001.bin")
    with open(bad, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    res = cli.run(base + ["--steps", "4", "--resume", "latest"], tmp_path)
    _one_line(*res, bad, "corrupt: sha256")


def test_metrics_file_cannot_be_created(tmp_path):
    data = cli.corpus(tmp_path / "corpus.txt")
    m = str(tmp_path / "no" / "such" / "dir" / "m.jsonl")
    res = cli.run(cli.TINY + ["--data", data, "--steps", "3", "--metrics", m], tmp_path)
    _one_line(*res, repr(m), "No such file or directory")
    assert not os.path.exists(tmp_path / "no")


def test_cuda_without_a_gpu(tmp_path):
    if have_cupy():
        pytest.skip("a GPU is usable here")
    data = cli.corpus(tmp_path / "corpus.txt")
    res = cli.run(cli.TINY + ["--data", data, "--steps", "3", "--device", "cuda"], tmp_path)
    _one_line(*res, "--device cuda: ", "hint")


def test_bad_flag_under_mpirun(tmp_path):
    res = cli.run(["--stage", "9"], tmp_path)
    _one_line(*res, "--stage")
