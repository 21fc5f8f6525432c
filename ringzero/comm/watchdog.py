"""The stall inspector: one daemon thread per process that watches every Ring's wait.

What it is
    A Ring's executor waits inside MPI (``Request.Waitall``, which releases
    the GIL), so no Python code runs on that thread until the wait ends.
    Before each wait the executor stores what it waits for in
    ``executor.waiting`` (a steps.Waiting: op, peer, "recv"|"send", requests;
    a wait on several peers has a peer and a direction per request, narrowed
    by ``executor.resolve`` to the requests still open once it stalls) and
    bumps ``executor.progress``; this thread samples both every ``period``
    seconds. The same (wait, progress) seen for

    - ``stall_warn`` seconds (RINGZERO_STALL_WARN, default 60): the rank
      prints ONE line to stderr: the op, the context (``set_context``, e.g.
      the training step) and the peer it waits for;
    - ``timeout`` seconds (RINGZERO_TIMEOUT, default 600): it marks the Ring
      timed out (``executor.hit``) and cancels the wait's requests, so
      Waitall returns and the Ring raises TimeoutError on its own thread (naming the op and the peer).
      A send that MPI cannot cancel (a large message the peer never takes)
      keeps Waitall blocked: after ``grace`` more seconds this thread prints
      the same message and calls MPI_Abort on COMM_WORLD, so the job still
      ends non-zero everywhere and mpirun leaves no process behind.

    ``set_context(text)`` / ``get_context()``: a process-wide string naming
    what the program is doing ("step 17"), quoted in the stall line.

What it is not
    A progress engine: it never touches a request that is not stalled, and
    costs the hot path two attribute writes per wait.
"""
from __future__ import annotations

import sys
import threading
import time
import weakref

_context = ""


def set_context(text: str) -> None:
    """Name what this process is doing (e.g. "step 17"); stall lines quote it."""
    global _context
    _context = str(text)


def get_context() -> str:
    return _context


class _Watchdog:
    def __init__(self):
        self.watched = weakref.WeakSet()
        self.lock = threading.Lock()
        self.thread = None
        self.wake = threading.Event()

    def add(self, ex):
        """Watch an executor (executor.py): its waiting, progress, limits and diag."""
        with self.lock:
            self.watched.add(ex)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._loop, name="ringzero-stall-inspector", daemon=True)
                self.thread.start()
            else:
                self.wake.set()  # a new Ring may need a shorter period

    def _period(self, watched):
        lim = [x for r in watched for x in (r.limits.stall_warn, r.limits.timeout) if x > 0]
        return min(1.0, max(0.01, min(lim, default=1.0) / 10))

    def discard(self, ex):
        with self.lock:
            self.watched.discard(ex)

    def _loop(self):
        seen = {}  # id(executor) -> [wait, progress, since, warned, cancelled_at]
        while True:
            with self.lock:
                watched = list(self.watched)
            self.wake.wait(self._period(watched))
            self.wake.clear()
            try:
                self._tick(watched, seen)
            except Exception as e:  # noqa: BLE001 (the inspector must outlive any surprise)
                say(f"ringzero | stall inspector: {type(e).__name__}: {e}")
            del watched

    def _tick(self, watched, seen):
        from mpi4py import MPI
        if MPI.Is_finalized():
            return
        now = time.monotonic()
        live = set()
        for ex in watched:
            w, prog = ex.waiting, ex.progress
            key = id(ex)
            live.add(key)
            st = seen.get(key)
            if w is None:
                seen.pop(key, None)
                continue
            if st is None or st[0] is not w or st[1] != prog:
                seen[key] = [w, prog, now, False, None]
                continue
            stalled, lim = now - st[2], ex.limits
            if not st[3] and 0 < lim.stall_warn <= stalled < lim.timeout:
                st[3] = True
                say(ex.diag.stall_line(ex.resolve(w), stalled))
            if stalled >= lim.timeout and st[4] is None:
                st[4] = now
                ex.hit = (ex.resolve(w), stalled)
                for q in w.reqs:
                    try:
                        q.Cancel()
                    except Exception:  # noqa: BLE001 (already complete, or MPI cannot cancel it)
                        pass
            elif st[4] is not None and now - st[4] >= lim.grace:
                say(ex.diag.timeout_message(ex.resolve(w), stalled)
                     + " (the wait could not be cancelled: aborting the job)")
                MPI.COMM_WORLD.Abort(1)
        for k in list(seen):
            if k not in live:
                del seen[k]


def say(line):
    """One line to stderr, flushed (the quantized calls' stall line too); never raises."""
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 (a closed stderr must not kill the inspector)
        pass


WATCHDOG = _Watchdog()
