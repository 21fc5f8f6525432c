"""Preemption: a stop signal saves a checkpoint at an agreed step, and the resumed run is bit-exact.

- real jobs (serial tests driving mpirun at 2 ranks): SIGTERM sent to every
  rank mid-run, as Slurm does; the job saves, every rank exits 143, and a
  ``--resume latest`` run repeats the uninterrupted run's losses bit for bit
  (the reference is that uninterrupted run's metrics file). SIGUSR1 sent to
  mpirun itself (Open MPI forwards it) does the same with 138.
- the agreement (MPI, in process): only the last rank "receives" the signal,
  at step 3; every rank stops after the same step, all or none save.
- ``./launch/train`` as users type it: SIGTERM to the script, or Ctrl-C to its process group, saves
  a checkpoint and exits 138 (the script passes SIGUSR1 through mpirun, which forwards it).
- the handler (serial): a process blocked inside MPI (a Recv never
  matched) records the first signal and exits 143 at the second.
"""
import os
import signal
import subprocess
import sys
import time

import pytest
import trainer_cli as cli
from conftest import assert_all


def _wait_for(path, p, timeout=120):
    t0 = time.monotonic()
    while not os.path.exists(path):
        assert p.poll() is None, "the job ended before it saved: " + cli.tail(*p.communicate())
        assert time.monotonic() - t0 < timeout, f"no {path} after {timeout} s"
        time.sleep(0.05)


END = 120      # the reference run's length; the stopped run must stop before it


def test_sigterm_to_every_rank_saves_and_resumes_bitwise(tmp_path):
    data = cli.corpus(tmp_path / "corpus.txt")
    ck = str(tmp_path / "ck")
    base = cli.TINY + ["--data", data, "--stage", "3"]
    # the reference: one run that is never stopped
    rcs, out, err = cli.run(base + ["--steps", str(END), "--metrics", "a.jsonl"], tmp_path)
    assert rcs == {0: 0, 1: 0}, cli.tail(out, err)
    # stopped: a run meant to go on for 100k steps, signalled once step 3 is saved
    p = cli.start(base + ["--steps", "100000", "--save-every", "3", "--save-dir", ck,
                          "--metrics", "b.jsonl"], tmp_path)
    pids = []
    while len(pids) < 2 and p.poll() is None:      # found first, so the signal follows the save closely
        pids = cli.rank_pids(p.pid)
        time.sleep(0.02)
    _wait_for(os.path.join(ck, "step-000003", "manifest.json"), p)
    assert len(pids) == 2, pids
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    rcs, out, err = cli.finish(p)
    assert rcs == {0: 143, 1: 143}, cli.tail(out, err)
    b = cli.losses(tmp_path / "b.jsonl")
    stopped = len(b)                      # steps 0 .. stopped-1 ran
    line = f"ringzero | SIGTERM at step {stopped}: saved {os.path.join(ck, f'step-{stopped:06d}')}; exiting 143"
    assert line in out, cli.tail(out, err)
    assert "Traceback" not in err and "MPI_ABORT" not in err, cli.tail(out, err)
    assert 3 <= stopped < END, f"stopped at step {stopped}: the reference run is too short"
    from ringzero.runtime.checkpoint import latest
    assert latest(ck) == os.path.join(ck, f"step-{stopped:06d}")
    # resumed from that checkpoint to the reference's end
    rcs, out, err = cli.run(base + ["--steps", str(END), "--resume", "latest", "--save-dir", ck,
                                    "--metrics", "c.jsonl"], tmp_path)
    assert rcs == {0: 0, 1: 0}, cli.tail(out, err)
    a, c = cli.losses(tmp_path / "a.jsonl"), cli.losses(tmp_path / "c.jsonl")
    assert sorted(c) == list(range(stopped, END))
    assert {**b, **c} == a, f"stopped at {stopped}: reference {a}\nstopped {b}\nresumed {c}"


def test_sigusr1_to_mpirun_is_forwarded_and_saves(tmp_path):
    """Open MPI's mpirun ends the job on SIGTERM within a second (measured: no
    time to save), but forwards SIGUSR1 to every rank and keeps running."""
    ver = subprocess.run(cli._mpirun()[:1] + ["--version"], capture_output=True, text=True).stdout
    if "Open MPI" not in ver:
        pytest.skip("checks Open MPI's mpirun signal forwarding")
    data = cli.corpus(tmp_path / "corpus.txt")
    ck = str(tmp_path / "ck")
    p = cli.start(cli.TINY + ["--data", data, "--steps", "100000", "--save-every", "2", "--save-dir", ck],
                  tmp_path, wrap=False)
    _wait_for(os.path.join(ck, "step-000002", "manifest.json"), p)
    mpirun = [pid for pid in _children(p.pid)]      # timeout -> mpirun
    assert len(mpirun) == 1, mpirun
    os.kill(mpirun[0], signal.SIGUSR1)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 138, cli.tail(out, err)       # mpirun: its ranks' code
    assert "SIGUSR1 at step" in out and "exiting 138" in out, cli.tail(out, err)


@pytest.mark.parametrize("how", ["SIGTERM", "Ctrl-C"])
def test_launch_train_turns_sigterm_and_ctrl_c_into_a_save(tmp_path, how):
    """./launch/train as users type it, stopped after its first steps by SIGTERM to the script, or by
    Ctrl-C (SIGINT to its process group, as a terminal sends it): the script passes SIGUSR1 through
    mpirun, every rank saves at the same step boundary, and the job exits 138 with its line."""
    from ringzero.runtime import checkpoint as cp
    if not os.path.exists(os.path.join(sys.prefix, ".ringzero-stamp")):
        pytest.skip(f"{sys.prefix} was not made by launch/_env.sh (launch/train would make another venv)")
    data = cli.corpus(tmp_path / "corpus.txt")
    ck, metrics = str(tmp_path / "ck"), tmp_path / "m.jsonl"
    env = dict(cli._clean_env(), RINGZERO_VENV=sys.prefix)
    train = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch", "train")
    # SIGTERM: through `timeout`, as a scheduler's wrapper would pass it on; Ctrl-C: the script alone in
    # its process group, as a terminal's foreground job
    wrap = ["timeout", "300"] if how == "SIGTERM" else []
    p = subprocess.Popen([*wrap, train, "-n", "2", *cli.TINY, "--data", data, "--steps", "100000",
                          "--save-dir", ck, "--metrics", str(metrics)], cwd=tmp_path, env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    t0 = time.monotonic()
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):    # its first steps ran
        assert p.poll() is None, "the job ended before its first steps: " + cli.tail(*p.communicate())
        assert time.monotonic() - t0 < 120, "no first steps after 120 s"
        time.sleep(0.05)
    if how == "SIGTERM":
        os.kill(p.pid, signal.SIGTERM)                # timeout passes it to launch/train
    else:
        os.killpg(p.pid, signal.SIGINT)               # the terminal's foreground group: the script
    try:
        out, err = p.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        raise
    assert p.returncode == 138, cli.tail(out, err)
    n = len(cli.losses(metrics))
    path = os.path.join(ck, f"step-{n:06d}")
    assert f"ringzero | SIGUSR1 at step {n}: saved {path}; exiting 138" in out, cli.tail(out, err)
    sig = "SIGTERM" if how == "SIGTERM" else "SIGINT"
    assert f"ringzero | launch/train: {sig}: passed to the ranks as SIGUSR1 through mpirun" in err, cli.tail(out, err)
    assert cp.latest(ck) == path and cp.verify(path, cp.read_manifest(path)) is None
    assert "Traceback" not in err, cli.tail(out, err)


def _children(pid):
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


BLOCKED = r"""
import numpy as np
from mpi4py import MPI
from ringzero.app.preempt import StopRequest
with StopRequest(announce=True):
    print("ready", flush=True)
    MPI.COMM_SELF.Recv(np.zeros(1), source=0, tag=7)     # never sent: blocked inside MPI for good
    print("SURVIVED", flush=True)
"""


def test_second_signal_exits_at_once_even_blocked_in_mpi(tmp_path):
    """A Python handler would never run here (the main thread is in C); the
    watcher thread must see both signals and end the process with 143."""
    err = open(tmp_path / "err.txt", "w+")
    p = subprocess.Popen([sys.executable, "-c", BLOCKED], stdout=subprocess.PIPE, stderr=err, text=True,
                         env=cli._clean_env())
    try:
        assert p.stdout.readline().strip() == "ready"
        time.sleep(0.5)                                # into the Recv
        os.kill(p.pid, signal.SIGTERM)
        t0 = time.monotonic()
        while "stopping at the next step boundary" not in open(tmp_path / "err.txt").read():
            assert time.monotonic() - t0 < 30 and p.poll() is None, open(tmp_path / "err.txt").read()
            time.sleep(0.05)
        assert p.poll() is None                        # the first signal only asks
        os.kill(p.pid, signal.SIGTERM)
        t0 = time.monotonic()
        rc = p.wait(timeout=30)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
    text = open(tmp_path / "err.txt").read()
    assert rc == 143 and "SURVIVED" not in p.stdout.read(), (rc, text)
    assert "second signal (SIGTERM): exiting 143 now" in text and took < 10, (took, text)


def test_handlers_restored_when_no_signal_came():
    from ringzero.app.preempt import SIGNALS, StopRequest
    before = {s: signal.getsignal(s) for s in SIGNALS}
    with StopRequest() as stop:
        assert all(signal.getsignal(s) == stop._handler for s in SIGNALS)
    assert {s: signal.getsignal(s) for s in SIGNALS} == before and stop.signum == 0
    assert signal.set_wakeup_fd(-1) == -1              # no wakeup fd left behind


# --------------------------------------------------- the agreement, in process
class OneRankSignalled:
    """Looks like a StopRequest; on ``rank`` its signal arrives before step ``at``."""

    def __init__(self, rank, at):
        self.rank, self.at, self.reads = rank, at, 0

    @property
    def signum(self):
        self.reads += 1                  # train_loop reads it once per step
        return int(signal.SIGTERM) if self.rank and self.reads > self.at else 0


@pytest.mark.mpi
@pytest.mark.parametrize("save_dir", [True, False])
def test_one_rank_signalled_all_stop_at_the_same_step(comm, tmp_path_factory, save_dir):
    from ringzero.app.preempt import Stopped
    from ringzero.app.train import parse_config, run
    from ringzero.runtime.checkpoint import complete_checkpoints
    d = comm.bcast(str(tmp_path_factory.mktemp("stop")) if comm.rank == 0 else None)
    data = comm.bcast(cli.corpus(os.path.join(d, "corpus.txt")) if comm.rank == 0 else None)
    ck = os.path.join(d, "ck")
    args = cli.TINY + ["--data", data, "--steps", "20", "--metrics", os.path.join(d, "m.jsonl")]
    cfg, _ = parse_config(args + (["--save-dir", ck] if save_dir else []))
    victim = comm.size - 1
    stop = OneRankSignalled(comm.rank == victim, at=3)
    try:
        run(cfg, comm, stop)
        got = None
    except Stopped as e:
        got = (e.step, e.signum, e.path)
    want_path = os.path.join(ck, "step-000004") if save_dir else None
    # the signal enters step 3's scalar exchange: every rank stops after step 3
    ok = got == (4, int(signal.SIGTERM), want_path)
    comm.Barrier()
    saved = [p for _, p in complete_checkpoints(ck)]
    ok &= saved == ([want_path] if save_dir else [])
    if comm.rank == 0:
        ok &= sorted(cli.losses(os.path.join(d, "m.jsonl"))) == [0, 1, 2, 3]
    assert_all(comm, ok, f"stopped {got}, checkpoints {saved}")
