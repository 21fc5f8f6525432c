"""Preemption: a stop signal becomes a request the ranks agree on at a step boundary.

What it is
    ``StopRequest`` catches SIGTERM (what Slurm and most schedulers send
    before they kill a job), SIGINT (Ctrl-C) and SIGUSR1 (what Open MPI's
    mpirun forwards to the ranks without ending the job) and only records
    the signal number. The trainer hands that number to the engine before
    each step; the engine carries it as a third scalar in the per-step
    Allgather it already makes ([loss, sumsq, stop]), and every rank reads
    the same maximum after the step. So the ranks stop at the same step
    boundary with no extra collective, even when only one rank was
    signalled. The trainer then saves a checkpoint and ends with
    ``128 + signal`` (SIGINT 130, SIGUSR1 138, SIGTERM 143).

    The first signal also puts the default action back for all three
    signals, so a second one ends the process at once (at the C level: it
    works even while a rank is blocked inside MPI, where a Python handler
    would never run).

What it is not
    No MPI and no I/O beyond one line on stderr: the agreement is the
    engine's scalar exchange, the save is checkpoint.py's, the exit is
    train.main's.
"""
from __future__ import annotations

import os
import signal
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def exit_code(signum: int) -> int:
    """The shell's convention for "ended by signal N": 128 + N."""
    return 128 + int(signum)


def name(signum: int) -> str:
    return signal.Signals(signum).name


class Stopped(Exception):
    """Raised by the training loop once every rank agreed to stop (and saved)."""

    def __init__(self, signum: int, step: int, path: str | None):
        self.signum, self.step, self.path = int(signum), int(step), path
        self.code = exit_code(signum)
        super().__init__(f"{name(signum)} at step {step}")


class StopRequest:
    """Records the first stop signal; ``signum`` is 0 until one arrives.

        with StopRequest(announce=rank == 0) as stop:
            run(cfg, comm, stop=stop)

    Handlers can only be installed from the main thread; elsewhere this is
    a request that never fires (``installed`` is False).
    """

    def __init__(self, announce: bool = False):
        self.signum = 0
        self.announce = announce
        self.installed = False
        self._old = {}

    def install(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._old[s] = signal.signal(s, self._handler)
            self.installed = True
        return self

    def _handler(self, signum, frame):
        if not self.signum:
            self.signum = signum
        for s in SIGNALS:              # the next signal takes the default action: exit now
            signal.signal(s, signal.SIG_DFL)
        if self.announce:              # os.write: print() is not safe inside a handler
            os.write(2, f"ringzero | {name(signum)}: stopping at the next step boundary "
                        f"(a second signal ends the run at once)\n".encode())

    def restore(self):
        """Put back the handlers found at install, unless a signal came (then
        the default action stays, so a late second signal still ends the run)."""
        if self.installed and not self.signum:
            for s, h in self._old.items():
                signal.signal(s, h)
        self.installed = False

    def __enter__(self):
        return self.install()

    def __exit__(self, *exc):
        self.restore()
        return False
