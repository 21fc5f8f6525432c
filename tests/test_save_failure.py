"""A checkpoint save that fails: one line with the path and the cause, the previous checkpoint intact.

- the engine (MPI, in process): RINGZERO_FAULT_SAVE makes one rank's write
  fail half-way with ENOSPC, or its open fail with EACCES; every rank raises
  the same CheckpointError, no temporary directory is left, and the previous
  checkpoint loads into a fresh engine equal to the master state saved
  (the reference: ``full_state("master")`` gathered before the failure).
- a save directory that cannot be made (its parent is a file): a real error,
  not an injected one.
- the trainer (serial, a real mpirun at 2 ranks): every rank exits 3, stderr
  has one line naming the file, the cause and the checkpoint still in place,
  and a run resumes from that checkpoint.
"""
import os

import numpy as np
import pytest
import trainer_cli as cli
from conftest import assert_all
from test_checkpoint import batches, engine, shared_dir, train


@pytest.mark.mpi
@pytest.mark.parametrize("mode, cause", [("enospc", "No space left on device"), ("eacces", "Permission denied")])
def test_injected_failure_keeps_previous_checkpoint(comm, tmp_path_factory, monkeypatch, mode, cause):
    from ringzero.runtime import checkpoint as ck
    d = shared_dir(comm, tmp_path_factory)
    e = engine(comm, "3")
    data = batches(comm.rank, comm.size)
    train(e, data, 0, 2)
    ck.save(e, d, 2)
    ref = e.full_state("master")
    train(e, data, 2, 3)
    victim = comm.size - 1
    monkeypatch.setenv(ck.FAULT_ENV, f"{mode}:{victim}")
    try:
        ck.save(e, d, 3)
        err = None
    except ck.CheckpointError as x:
        err = str(x)
    monkeypatch.delenv(ck.FAULT_ENV)
    comm.Barrier()
    left = sorted(os.listdir(d))
    ok = err is not None and "\n" not in err and cause in err
    ok &= f"rank {victim}: writing into {os.path.join(d, '.tmp-step-000003-')}" in err
    ok &= f"master-r{victim:05d}.bin" in err            # the file it could not write
    ok &= left == ["step-000002"]                        # no .tmp- left for anyone to trip on
    fresh = engine(comm, "3", seed=99)
    m = ck.load(fresh, "latest", d)
    ok &= m["step"] == 2 and np.array_equal(fresh.full_state("master"), ref)
    assert_all(comm, ok, f"error {err!r}, directory {left}")


def test_save_dir_that_cannot_be_made(tmp_path):
    from mpi4py import MPI

    from ringzero.runtime import checkpoint as ck
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    d = str(blocker / "ck")
    e = engine(MPI.COMM_SELF, "1")
    with pytest.raises(ck.CheckpointError) as x:
        ck.save(e, d, 1)
    assert repr(d) in str(x.value) and "Not a directory" in str(x.value), str(x.value)


def test_trainer_save_failure_exits_3_with_one_line(tmp_path):
    data = cli.corpus(tmp_path / "corpus.txt")
    ck = str(tmp_path / "ck")
    base = cli.TINY + ["--data", data, "--save-dir", ck, "--save-every", "2"]
    rcs, out, err = cli.run(base + ["--steps", "2"], tmp_path)
    assert rcs == {0: 0, 1: 0}, cli.tail(out, err)
    rcs, out, err = cli.run(base + ["--steps", "4", "--resume", "latest"], tmp_path,
                            env={"RINGZERO_FAULT_SAVE": "enospc:1"})
    assert rcs == {0: 3, 1: 3}, cli.tail(out, err)
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith(("---", " ", "prterun", "thus"))]
    prev = os.path.join(ck, "step-000002")
    assert len(lines) == 1 and lines[0].startswith("ringzero.train: error: checkpoint step-000004 not saved: "
                                                   "rank 1: writing into "), cli.tail(out, err)
    assert "No space left on device" in lines[0] and "master-r00001.bin" in lines[0], lines[0]
    assert lines[0].endswith(f"the newest complete checkpoint is {prev}"), lines[0]
    assert "Traceback" not in err and "MPI_ABORT" not in err, cli.tail(out, err)
    assert sorted(os.listdir(ck)) == ["step-000002"]
    # and a run resumes from it
    rcs, out, err = cli.run(base + ["--steps", "3", "--resume", "latest"], tmp_path)
    assert rcs == {0: 0, 1: 0} and f"resumed from {prev} at step 2" in out, cli.tail(out, err)
