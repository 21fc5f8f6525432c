"""Preemption: a stop signal becomes a request the ranks agree on at a step boundary.

What it is
    ``StopRequest`` catches SIGTERM (what Slurm and most schedulers send
    before they kill a job), SIGINT (Ctrl-C) and SIGUSR1 (what Open MPI's
    mpirun forwards to the ranks without ending the job) and only records
    the signal number. The trainer hands that number to the engine before
    each step; the engine carries it as a third scalar in the per-step
    all-gather it already makes ([loss, sumsq, stop], on the control ring), and every rank reads
    the same maximum after the step. So the ranks stop at the same step
    boundary with no extra collective, even when only one rank was
    signalled. The trainer then saves a checkpoint and ends with
    ``128 + signal`` (SIGINT 130, SIGUSR1 138, SIGTERM 143).

    A second signal ends the process at once with ``128 + signal``, even
    while the rank is blocked inside MPI (see StopRequest for how).

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

    Why a thread: a Python signal handler runs only when the main thread is
    back in the interpreter, never while it is blocked inside an MPI call.
    So the handlers are installed with a wakeup pipe (``signal.set_wakeup_fd``):
    CPython's C-level handler writes each signal's number into it at once,
    and a daemon thread blocked on the pipe counts them. The first is the
    stop request (announced on stderr by rank 0); the second ends the
    process with ``128 + N`` right there, wherever the main thread is.

    Handlers can only be installed from the main thread; elsewhere this is
    a request that never fires (``installed`` is False).
    """

    def __init__(self, announce: bool = False):
        self.signum = 0
        self.announce = announce
        self.installed = False
        self._old, self._old_fd, self._pipe = {}, -1, None

    def install(self) -> "StopRequest":
        if threading.current_thread() is not threading.main_thread():
            return self
        r, w = os.pipe()
        os.set_blocking(w, False)               # set_wakeup_fd needs a non-blocking fd
        self._pipe = (r, w)
        self._old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        for s in SIGNALS:
            self._old[s] = signal.signal(s, self._handler)
        threading.Thread(target=self._watch, args=(r,), name="ringzero-signals", daemon=True).start()
        self.installed = True
        return self

    def _handler(self, signum, frame):
        # the main thread, once back in Python; the watcher has (or will have)
        # seen the same signal through the pipe and does the counting
        if not self.signum:
            self.signum = signum

    def _watch(self, r: int):
        seen = 0
        while True:
            try:
                b = os.read(r, 64)               # blocks without the GIL
            except OSError:
                b = b""
            if not b:                            # restore() closed the pipe
                os.close(r)
                return
            for s in b:
                if s not in SIGNALS:
                    continue
                seen += 1
                if seen == 1:
                    if not self.signum:
                        self.signum = s
                    if self.announce:
                        os.write(2, f"ringzero | {name(s)}: stopping at the next step boundary "
                                    f"(a second signal ends the run at once)\n".encode())
                else:
                    os.write(2, f"ringzero | second signal ({name(s)}): exiting {exit_code(s)} now, "
                                f"without a checkpoint\n".encode())
                    os._exit(exit_code(s))

    def restore(self):
        """Put back the handlers and wakeup fd found at install. If a signal
        came, the default action is left instead, so a late second signal
        (during the save or the exit) still ends the run at once."""
        if not self.installed:
            return
        signal.set_wakeup_fd(self._old_fd)
        for s, h in self._old.items():
            signal.signal(s, signal.SIG_DFL if self.signum else h)
        os.close(self._pipe[1])                  # the watcher reads EOF and ends
        self.installed = False

    def __enter__(self):
        return self.install()

    def __exit__(self, *exc):
        self.restore()
        return False
