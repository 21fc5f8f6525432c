"""The trainer with --offload, as users start it (real mpirun jobs, 2 ranks, a tiny GPT).

- a run with --offload optimizer,params at stage 3 prints each class's tier and the
  offload I/O beside its formula, and its losses are those of the same run in RAM
  (the metrics files, compared line by line);
- a disk that fills in the middle of an update (RINGZERO_FAULT_OFFLOAD=enospc:1, the
  writer's second tile) ends the run with exit code 4 and one line on every rank,
  no traceback, no hang; the checkpoint saved before it verifies and a run resumes from it;
  the same when rank 1 is killed there (RINGZERO_FAULT_OFFLOAD=crash:1);
- every other kind of failure on one rank (a short read, a ValueError, a generic exception), in
  the update, in the params cast at start and in the cast after a resume: exit 4, the same one
  line on every rank, within seconds (not the watchdog's 600 s), no traceback;
- bad flags: --offload params at stage 2, an --offload-dir that cannot be made (under a file),
  a disk too small (one line, exit 2, nothing written);
- a missing --offload-dir is made (mkdir -p, as DeepSpeed makes its swap folder): the README's
  command works as typed.
"""
import json
import os
import re
import time

import pytest
import trainer_cli as cli

from ringzero.runtime import checkpoint as ck

OFF = ["--stage", "3", "--offload", "optimizer,params"]


def lines_of(err):
    return [ln for ln in err.splitlines() if ln.strip() and not ln.startswith(("---", " ", "prterun", "thus"))]


def test_offloaded_run_reports_tiers_and_io_and_equals_ram(tmp_path):
    data = cli.corpus(tmp_path / "corpus.txt")
    base = cli.TINY + ["--data", data, "--steps", "3", "--stage", "3"]
    off_dir = tmp_path / "off"
    off_dir.mkdir()
    rcs, out, err = cli.run(base + ["--offload", "optimizer,params", "--offload-dir", str(off_dir),
                                    "--metrics", str(tmp_path / "off.jsonl")], tmp_path)
    assert rcs == {0: 0, 1: 0}, cli.tail(out, err)
    assert "tier" in out and "disk" in out and "offload optimizer+params in" in out, cli.tail(out, err)
    io = [ln for ln in out.splitlines() if ln.startswith("offload I/O per step per rank")]
    assert io, cli.tail(out, err)
    # measured == the plan's figure (the last number in the parentheses), both ways
    m = re.search(r"read ([\d,]+) B \(formula [^)]*?([\d,]+) B\)\s+written ([\d,]+) B \(formula [^)]*?([\d,]+) B\)",
                  io[0])
    assert m and m[1] == m[2] and m[3] == m[4], io[0]
    assert os.listdir(off_dir) == []                  # the files were anonymous, and are gone
    rcs, out, err = cli.run(base + ["--metrics", str(tmp_path / "ram.jsonl")], tmp_path)
    assert rcs == {0: 0, 1: 0}, cli.tail(out, err)
    assert cli.losses(tmp_path / "off.jsonl") == cli.losses(tmp_path / "ram.jsonl")
    for name in ("off", "ram"):          # fp16: an update ran before the last step, so its loss compared one
        assert updates_ran(tmp_path / f"{name}.jsonl"), name


def updates_ran(path) -> bool:
    """A step before the last one was not skipped by the fp16 loss scaler (the metrics file's own
    ``skipped`` and ``loss_scale``): a later loss was computed from updated weights."""
    recs = [json.loads(ln) for ln in open(path)]
    steps = [r for r in recs if "step" in r and not r.get("summary")]
    return (len(steps) >= 2 and any(not r["skipped"] for r in steps[:-1])
            and all(r["loss_scale"] > 0 for r in steps) and len({r["loss"] for r in steps}) > 1)


def test_enospc_mid_update_exits_4_one_line_per_rank(tmp_path):
    data = cli.corpus(tmp_path / "corpus.txt")
    save = str(tmp_path / "ck")
    base = cli.TINY + ["--data", data, "--save-dir", save, "--save-every", "2", *OFF,
                       "--offload-dir", str(tmp_path)]
    rcs, out, err = cli.run(base + ["--steps", "2"], tmp_path)
    assert rcs == {0: 0, 1: 0}, cli.tail(out, err)
    rcs, out, err = cli.run(base + ["--steps", "4", "--resume", "latest"], tmp_path,
                            env={"RINGZERO_FAULT_OFFLOAD": "enospc:1"})
    assert rcs == {0: 4, 1: 4}, cli.tail(out, err)
    lines = lines_of(err)
    prev = os.path.join(save, "step-000002")
    assert len(lines) == 2 and sorted(ln[:len("ringzero.train: error (rank 0)")] for ln in lines) == [
        "ringzero.train: error (rank 0)", "ringzero.train: error (rank 1)"], cli.tail(out, err)
    for ln in lines:
        assert "rank 1: the offloaded update failed: No space left on device" in ln, ln
        assert ln.endswith(f"the newest complete checkpoint is {prev}"), ln
    assert "Traceback" not in err and "MPI_ABORT" not in err, cli.tail(out, err)
    assert ck.verify(prev, ck.read_manifest(prev)) is None
    rcs, out, err = cli.run(base + ["--steps", "3", "--resume", "latest"], tmp_path)
    assert rcs == {0: 0, 1: 0} and f"resumed from {prev} at step 2" in out, cli.tail(out, err)


def test_killed_mid_update_leaves_the_checkpoint(tmp_path):
    """Rank 1 dies (os._exit) in the middle of an update's writes: the job ends, the newest checkpoint
    verifies, and a run resumes from it into fresh offload files."""
    pytest.importorskip("ml_dtypes")
    data = cli.corpus(tmp_path / "corpus.txt")
    save = str(tmp_path / "ck")
    base = cli.TINY + ["--data", data, "--save-dir", save, "--save-every", "2", *OFF,
                       "--offload-dir", str(tmp_path), "--precision", "bf16"]     # bf16: no step skipped
    rcs, out, err = cli.run(base + ["--steps", "2"], tmp_path)
    assert rcs == {0: 0, 1: 0}, cli.tail(out, err)
    rcs, out, err = cli.run(base + ["--steps", "4", "--resume", "latest"], tmp_path,
                            env={"RINGZERO_FAULT_OFFLOAD": "crash:1"})
    assert rcs.get(1) == 86, (rcs, cli.tail(out, err))
    prev = os.path.join(save, "step-000002")
    assert ck.latest(save) == prev and ck.verify(prev, ck.read_manifest(prev)) is None
    rcs, out, err = cli.run(base + ["--steps", "3", "--resume", "latest"], tmp_path)
    assert rcs == {0: 0, 1: 0} and f"resumed from {prev} at step 2" in out, cli.tail(out, err)


def test_bad_offload_flags_one_line_exit_2(tmp_path):
    data = cli.corpus(tmp_path / "corpus.txt")
    base = cli.TINY + ["--data", data, "--steps", "1"]
    cases = [
        (["--stage", "2", "--offload", "optimizer,params", "--offload-dir", str(tmp_path)],
         "needs the params sharded (stage 3 or hybrid); stage 2 holds them in full", {}),
        ([*OFF, "--offload-dir", os.path.join(data, "sub")], "does not exist and cannot be made", {}),
        ([*OFF], "give --offload-dir DIR", {}),
        ([*OFF, "--offload-dir", str(tmp_path)], "MiB free", {"RINGZERO_OFFLOAD_FREE": "1000"}),
    ]
    for args, want, env in cases:
        rcs, out, err = cli.run(base + args, tmp_path, env=env)
        lines = lines_of(err)
        assert rcs == {0: 2, 1: 2} and len(lines) == 1 and want in lines[0], (args, cli.tail(out, err))
        assert "Traceback" not in err


# (RINGZERO_FAULT_OFFLOAD on rank 1, what every rank's line says): each kind, in each stream
FAULTS = [
    ("short:1", "the offloaded update failed: offload file of master: short read at byte"),
    ("value:1", "the offloaded update failed: ValueError: injected by RINGZERO_FAULT_OFFLOAD=value"),
    ("error:1", "the offloaded update failed: RuntimeError: injected by RINGZERO_FAULT_OFFLOAD=error"),
    ("short@cast:1", "casting the params from the offloaded master (start, "),
    ("error@cast:1", "casting the params from the offloaded master (start, "),
    ("value@resume:1", "casting the params from the offloaded master (resume, "),
    ("enospc@resume:1", "casting the params from the offloaded master (resume, "),
    ("error:1 ahead", "the offloaded update failed: RuntimeError: injected by RINGZERO_FAULT_OFFLOAD=error"),
]


@pytest.mark.parametrize("spec,want", FAULTS, ids=[f[0] for f in FAULTS])
def test_every_failure_on_one_rank_is_one_line_on_every_rank(tmp_path, spec, want):
    """" ahead": the update on its own thread beside the next forward, its error agreed at the drain."""
    pytest.importorskip("ml_dtypes")
    spec, _, ahead = spec.partition(" ")
    data = cli.corpus(tmp_path / "corpus.txt")
    save = str(tmp_path / "ck")
    base = cli.TINY + ["--data", data, "--save-dir", save, *OFF, "--offload-dir", str(tmp_path),
                       "--precision", "bf16"]             # bf16: no step skipped, the update runs at once
    base += ["--offload-ahead"] if ahead else []
    resume = "@resume" in spec
    if resume:
        rcs, out, err = cli.run(base + ["--steps", "1", "--save-every", "1"], tmp_path)
        assert rcs == {0: 0, 1: 0}, cli.tail(out, err)
    t0 = time.monotonic()
    rcs, out, err = cli.run(base + ["--steps", "2"] + (["--resume", "latest"] if resume else []), tmp_path,
                            env={"RINGZERO_FAULT_OFFLOAD": spec, "RINGZERO_TIMEOUT": "900"})
    took = time.monotonic() - t0
    assert rcs == {0: 4, 1: 4}, cli.tail(out, err)
    lines = lines_of(err)
    assert sorted(ln[:len("ringzero.train: error (rank 0)")] for ln in lines) == [
        "ringzero.train: error (rank 0)", "ringzero.train: error (rank 1)"], cli.tail(out, err)
    for ln in lines:
        assert f"rank 1: {want}" in ln, ln
    assert len({ln.split(": ", 2)[2] for ln in lines}) == 1, lines     # the same line, after "(rank N): "
    assert "Traceback" not in err and "MPI_ABORT" not in err, cli.tail(out, err)
    assert took < 120, f"{took:.0f} s: a rank waited (RINGZERO_TIMEOUT 900 s) instead of agreeing"


def test_missing_offload_dir_is_made(tmp_path):
    data = cli.corpus(tmp_path / "corpus.txt")
    d = tmp_path / "not" / "yet"
    rcs, out, err = cli.run(cli.TINY + ["--data", data, "--steps", "1", *OFF, "--offload-dir", str(d)], tmp_path)
    assert rcs == {0: 0, 1: 0}, cli.tail(out, err)
    assert f"made --offload-dir {d}" in out and d.is_dir() and os.listdir(d) == [], cli.tail(out, err)


def test_io_knobs_in_the_report_and_refused_below_one(tmp_path):
    """--offload-depth and --offload-threads: the start report says them and whether the files take
    O_DIRECT (tmp_path: a disk here); the losses are the default's; 0 is one line on every rank, exit 2."""
    data = cli.corpus(tmp_path / "corpus.txt")
    base = cli.TINY + ["--data", data, "--steps", "3", *OFF, "--offload-dir", str(tmp_path)]
    rcs, out, err = cli.run(base + ["--offload-depth", "5", "--offload-threads", "2",
                                    "--metrics", str(tmp_path / "deep.jsonl")], tmp_path)
    assert rcs == {0: 0, 1: 0}, cli.tail(out, err)
    assert re.search(r"through 7 buffers \([^)]*\), 5 read ahead, 2 requests in flight, (O_DIRECT|page cache)",
                     out), cli.tail(out, err)
    rcs, out, err = cli.run(base + ["--metrics", str(tmp_path / "default.jsonl")], tmp_path)
    assert rcs == {0: 0, 1: 0}, cli.tail(out, err)
    assert cli.losses(tmp_path / "deep.jsonl") == cli.losses(tmp_path / "default.jsonl")
    assert updates_ran(tmp_path / "deep.jsonl")
    rcs, out, err = cli.run(base + ["--offload-depth", "0"], tmp_path)
    assert rcs == {0: 2, 1: 2}, cli.tail(out, err)
    assert [ln for ln in lines_of(err) if "--offload-depth must be an integer >= 1, got 0" in ln], cli.tail(out, err)
