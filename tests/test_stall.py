"""The stall inspector and the timeout on a real job: one rank stopped with SIGSTOP.

Runs the trainer as users do (``mpirun -n 4 python -m mpi4py -m
ringzero.train``, a tiny model at stage 3, many steps), stops rank 2 once
training is under way, and checks, with RINGZERO_STALL_WARN=2 and
RINGZERO_TIMEOUT=6:

- a waiting rank prints the stall line, naming the op, the training step and
  the rank it waits for;
- a waiting rank raises TimeoutError naming the op and the rank it waits for
  (or, when MPI cannot cancel its wait, prints that message and aborts the
  job); the first rank to time out ends the job, and the rank it names may
  itself be waiting on the stopped one, which the stall lines name;
- the job exits non-zero, every rank's process is gone afterwards, and it
  took about the timeout (not the 600 s default, not forever).

The trainer's per-step ``comm.Barrier`` sits outside the Ring: a rank stopped
exactly between two steps leaves its peers in that Barrier, which the Ring
cannot see. So if no stall line comes within the warning time and a margin,
the test resumes the rank and stops it again (at most 3 tries) and says so.
"""
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from test_train import TINY, _text
from trainer_cli import descendants

RANKS, STOPPED, WARN, TIMEOUT = 4, 2, 2, 6


def _rank_of(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except OSError:
        return None
    r = env.get(b"OMPI_COMM_WORLD_RANK") or env.get(b"PMIX_RANK") or env.get(b"PMI_RANK")
    return int(r) if r is not None and b"python" in open(f"/proc/{pid}/cmdline", "rb").read() else None


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigstop_one_rank_warns_then_ends_the_job(tmp_path):
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun is not on PATH (run through ./launch/test)")
    data = _text(str(tmp_path / "corpus.txt"), 200_000)
    env = dict(os.environ, RINGZERO_STALL_WARN=str(WARN), RINGZERO_TIMEOUT=str(TIMEOUT),
               OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    flags = ["--oversubscribe", "--bind-to", "none"] + (["--allow-run-as-root"] if os.getuid() == 0 else [])
    for v in ("RINGZERO_STALL_WARN", "RINGZERO_TIMEOUT", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "PYTHONUNBUFFERED"):
        flags += ["-x", v]
    cmd = [mpirun, *flags, "-n", str(RANKS), sys.executable, "-m", "mpi4py", "-m", "ringzero.train",
           *TINY, "--data", data, "--stage", "3", "--steps", "1000000", "--eval-interval", "0",
           "--metrics", str(tmp_path / "m.jsonl")]
    errf = open(tmp_path / "stderr.txt", "w+")
    job = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=errf, start_new_session=True)
    ranks = {}
    try:
        deadline = time.monotonic() + 120
        while len(ranks) < RANKS and time.monotonic() < deadline:  # find the ranks' pids
            ranks = {r: p for p in descendants(job.pid) if (r := _rank_of(p)) is not None}
            time.sleep(0.2)
        assert len(ranks) == RANKS, f"found ranks {sorted(ranks)} under mpirun"
        while time.monotonic() < deadline and job.poll() is None:  # a few steps done (metrics lines)
            if (tmp_path / "m.jsonl").exists() and len(open(tmp_path / "m.jsonl").readlines()) >= 3:
                break
            time.sleep(0.2)
        assert job.poll() is None and time.monotonic() < deadline, open(tmp_path / "stderr.txt").read()[-2000:]
        tries = 0
        while True:
            tries += 1
            t_stop = time.monotonic()
            os.kill(ranks[STOPPED], signal.SIGSTOP)
            while time.monotonic() - t_stop < WARN + 4 and job.poll() is None:
                errf.seek(0)
                if "has made no progress" in errf.read():
                    break
                time.sleep(0.1)
            errf.seek(0)
            if "has made no progress" in errf.read() or tries == 3:
                break
            os.kill(ranks[STOPPED], signal.SIGCONT)  # stopped between two steps: try again
            time.sleep(1)
        rc = job.wait(timeout=TIMEOUT + 60)
        took = time.monotonic() - t_stop
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        for p in ranks.values():
            if _alive(p):
                os.kill(p, signal.SIGCONT)
                os.kill(p, signal.SIGKILL)
    errf.seek(0)
    err = errf.read()
    stall = re.findall(r"ringzero \| rank (\d+): (all_gather|reduce_scatter|all_reduce) has made no progress "
                       r"for [\d.]+ s at step (\d+), waiting for (?:a message from|a send to be taken by) rank (\d+)",
                       err)
    # raised as TimeoutError, or, when MPI could not cancel the wait (a message
    # already half-received), printed by the inspector before MPI_Abort
    timeouts = re.findall(r"ring (all_gather|reduce_scatter|all_reduce) at step \d+: rank (\d+) waited "
                          rf"{TIMEOUT} s for (?:a message from|a send to be taken by) rank (\d+);", err)
    survivors = [r for r, p in ranks.items() if _alive(p)]
    print(f"tries {tries}, exit {rc} after {took:.1f} s; stall lines {stall}; timeouts {timeouts}")
    assert stall, f"no stall line in stderr:\n{err[-3000:]}"
    assert all(int(r) != STOPPED for r, *_ in stall), stall
    assert len({r for r, *_ in stall}) == len(stall), f"a rank printed more than one stall line: {stall}"
    assert any(int(peer) == STOPPED for *_, peer in stall), f"no stall line names rank {STOPPED}: {stall}"
    assert timeouts, f"no TimeoutError naming op and peer:\n{err[-3000:]}"
    # each rank names the peer IT waits for; the first to time out ends the job, and
    # that peer may itself be waiting on the stopped rank: the stall lines name it
    assert all(0 <= int(t[2]) < RANKS and t[2] != t[1] for t in timeouts), timeouts
    assert rc != 0 and not survivors, f"exit {rc}, ranks still alive: {survivors}"
    assert TIMEOUT <= took < TIMEOUT + 45, f"the job took {took:.1f} s to end after the stop"


# ---- the inspector inside one job (MPI, every world size) -------------------

@pytest.mark.mpi
def test_stall_line_names_op_context_and_peer(comm, capsys):
    """Rank 0 arrives 1.5 s late: every other rank prints ONE stall line, and the op still completes."""
    import numpy as np
    from conftest import assert_all

    from ringzero.comm.ring import Ring
    n, r = comm.size, comm.rank
    if n < 2:
        pytest.skip("needs world size >= 2")
    ring = Ring(comm, timeout=30, stall_warn=0.3)
    Ring.set_context("step 5")
    x = np.full(4 * n, r + 1, np.float64)
    comm.Barrier()
    if r == 0:
        time.sleep(1.5)
    ring.all_reduce(x)
    time.sleep(0.3)  # let the inspector finish any line it started
    err = capsys.readouterr().err
    Ring.set_context("")
    ring.free()
    lines = re.findall(r"ringzero \| rank (\d+): all_reduce has made no progress for [\d.]+ s at step 5, "
                       r"waiting for (?:a message from|a send to be taken by) rank (\d+)", err)
    ok = np.all(x == n * (n + 1) / 2)
    if r == 0:
        ok = ok and not lines
    else:
        ok = ok and len(lines) == 1 and int(lines[0][0]) == r and int(lines[0][1]) not in (r,) \
            and 0 <= int(lines[0][1]) < n
    assert_all(comm, ok, f"rank {r}: stderr {err!r}")


@pytest.mark.mpi
def test_timeout_message_carries_context(comm):
    """A peer that never comes: TimeoutError names op, peer and the context; a fresh Ring then works."""
    import numpy as np
    from conftest import assert_all

    from ringzero.comm.ring import Ring
    n, r = comm.size, comm.rank
    if n < 2:
        pytest.skip("needs world size >= 2")
    ring = Ring(comm, timeout=1.0, stall_warn=0)
    Ring.set_context("step 9")
    msg = ""
    if r != n - 1:  # the last rank skips the call
        try:
            ring.all_gather(np.ones(3), np.empty(3 * n))
        except TimeoutError as e:
            msg = str(e)
    Ring.set_context("")
    comm.Barrier()
    fresh = Ring(comm)
    y = np.ones(5)
    fresh.all_reduce(y)
    fresh.free()
    ok = np.all(y == n)
    if r != n - 1:
        ok = ok and re.search(r"ring all_gather at step 9: rank \d+ waited 1 s for a message from rank \d+;", msg)
    assert_all(comm, bool(ok), f"rank {r}: {msg!r}")
