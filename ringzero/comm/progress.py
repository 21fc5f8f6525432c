"""Nonblocking collectives: a Ring's calls run on one background thread, in call order, while the caller computes.

What it is
    ``ring.all_gather_start(send, recv)`` (and ``reduce_scatter_start``,
    ``all_reduce_start``) checks its arguments and compiles its plan on the
    caller's thread, exactly as the blocking call does, then hands the plan to
    the Ring's ``Progress`` thread and returns a ``Pending``;
    ``pending.wait()`` returns recv once the collective is done.

    Why a thread: Open MPI makes no asynchronous progress by default, so a
    rendezvous message (above 4 KiB on shared memory, 64 KiB on TCP) moves
    only while some thread of the process is inside MPI. The progress thread
    is: it runs the plan's steps (executor.py), blocking inside MPI's waits
    with the GIL released, while the caller's NumPy/BLAS work (which releases
    the GIL too) goes on. One thread per Ring, started on first use.
    ``StartedCalls`` is the Ring's side of it (``progress``, ``owner``,
    ``drain``, ``in_order``, and ``submit``: a job from a collective on a
    communicator of its own, ZeRO++'s quantized calls, run in the Ring's order).

    Promises kept from the blocking forms:
      - order: every call on a Ring, blocking or not, runs in the order made
        (a blocking call made while started ones are in flight waits its turn),
        so every rank's message stream stays in step;
      - bits and ledger: the same plans run, counted when started;
      - errors: bad arguments raise at the start, before any message; an error
        in the background (a bad count, a timeout naming op, context and peer)
        is raised by ``wait`` on the caller's thread, and the Ring is then
        unusable as after any error;
      - device buffers (CuPy): the call runs on the Ring's own stream and device
        (backend.StreamOrder), after an event that marks what the caller's
        stream had queued at the start, and ``wait`` makes the caller's
        stream wait for the call's last kernels: the caller's kernels queued
        after the start run beside it, never under it;
      - ownership: until ``wait`` returns, the collective owns its buffers
        (it reads send and writes recv). Calls on one Ring run in order, like
        work on one CUDA stream, so a later call may read what an earlier one
        writes (a reduce-scatter started, then the all-gather of its result).
        Code outside the Ring must not touch an owned buffer:
        ``ring.owner(send, recv)`` names the started call that would race an
        access reading ``send`` and writing ``recv`` (the engine checks every
        buffer it touches against it when RINGZERO_CHECK_OWNERSHIP=1).

What it is not
    A scheduler: when to start and wait is the caller's (the engine's plan).
"""
from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections import deque

import numpy as np

from ringzero.comm.trace import RECORDER

_LIVE = weakref.WeakSet()       # every Progress of this process, drained before MPI finalizes


@atexit.register                # registered after mpi4py's own finalize hook, so it runs first
def _drain_all():
    for pr in list(_LIVE):
        pr.drain(timeout=60.0)


def _span(x):
    """(first byte, end) of an array's memory, host or device."""
    a = x.ctypes.data if hasattr(x, "ctypes") else x.data.ptr
    return a, a + x.nbytes


class Pending:
    """A started collective. ``wait()`` returns its recv or raises what the background run raised."""

    __slots__ = ("name", "recv", "reads", "writes", "ran", "cpu", "_done", "_error", "_progress",
                 "order", "finished", "flow")

    def __init__(self, name, send, recv, progress=None, order=None):
        self.name, self.recv = name, recv
        self.flow = 0                # the trace's flow id (comm/trace.py, set by submit): 0 when not traced
        self._progress = progress   # the Progress that runs it (told when the caller waits)
        self.order = order          # device buffers: the Ring's backend.StreamOrder (None on the host)
        self.finished = None        # ... and the event after the job's device work (set by the job)
        self.reads, self.writes = _span(send), _span(recv)
        self.ran = 0.0       # seconds it ran on the progress thread (0 until done)
        self.cpu = 0.0       # of which the progress thread was on a core (MPI, the sockets, the adds)
        self._done = threading.Event()
        self._error = None

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self):
        if self.flow or RECORDER.active:   # traced: the wait is a span (that ends the start's flow)
            t0 = time.perf_counter()
            try:
                return self._wait()
            finally:
                fid, self.flow = self.flow, 0
                RECORDER.waited(self.name, fid, t0, time.perf_counter(), self.recv.nbytes)
        return self._wait()

    def _wait(self):
        pr = self._progress
        if pr is not None and not self._done.is_set():
            # the caller is idle until this is done: the progress thread stops napping and waits
            # inside MPI (spinning costs nothing now) until this one is done
            pr.awaited = self
            pr.hurry.set()
            try:
                self._done.wait()
            finally:
                pr.awaited = None
                pr.hurry.clear()
        self._done.wait()
        if self.finished is not None:       # what the caller queues next runs after the job's kernels
            ev, self.finished = self.finished, None
            self.order.join(ev)
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        return self.recv

    def conflicts(self, send, recv) -> bool:
        """Would a call reading `send` and writing `recv` race this one?"""
        def meet(p, q):
            return p[0] < p[1] and q[0] < q[1] and p[0] < q[1] and q[0] < p[1]
        w, r = _span(recv), _span(send)
        return meet(w, self.reads) or meet(w, self.writes) or meet(r, self.writes)


class Progress:
    """One daemon thread that runs a Ring's started jobs, first in, first out."""

    def __init__(self, name: str):
        self._jobs = deque()
        self._cv = threading.Condition()
        self.hurry = threading.Event()   # set while the caller waits for a Pending (Pending.wait) ...
        self.awaited = None              # ... this one
        self.inflight = []             # started Pendings, oldest first; finished ones dropped at the next submit
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        _LIVE.add(self)

    def drain(self, timeout=None):
        """Wait until every started job has finished (their errors stay for their own wait())."""
        for p in list(self.inflight):
            p._done.wait(timeout)

    def on_worker(self) -> bool:
        return threading.current_thread() is self._thread

    def _forget_finished(self):
        """Drop the finished Pendings from inflight, in place. The jobs run one at a time in order, so
        the finished ones are a prefix. Called at every submit, not only by ``busy``: a Ring whose calls
        are all started (ZeRO++'s quantized ones, through ``StartedCalls.submit``) never asks ``busy``,
        and a list pruned only there kept every Pending of the run and its Event (5.5-18 KB a step at
        n = 4 and 8: tests/test_zeropp.py::test_no_allocation_after_the_first_steps). Only the caller's
        thread changes the list (submit); the progress thread only reads it."""
        inf, k = self.inflight, 0
        while k < len(inf) and inf[k].done():
            k += 1
        del inf[:k]

    def busy(self) -> bool:
        """Anything started and not yet finished? (In order: the last one started finishes last.)"""
        inf = self.inflight
        return bool(inf) and not inf[-1].done()

    def submit(self, job, pending: Pending) -> Pending:
        if RECORDER.active:          # --trace: a start span here, a flow to the job's run and to the wait
            job = RECORDER.started(pending, job)
        self._forget_finished()
        self.inflight.append(pending)
        with self._cv:
            self._jobs.append((job, pending))
            self._cv.notify()
        return pending

    def owner(self, send, recv):
        """The started collective that a call reading send and writing recv would race, if any."""
        for p in self.inflight:
            if not p.done() and p.conflicts(send, recv):
                return p
        return None

    def _loop(self):
        while True:
            with self._cv:
                while not self._jobs:
                    self._cv.wait()
                job, pending = self._jobs.popleft()
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                job()
            except BaseException as e:  # noqa: BLE001 (raised again by pending.wait, on the caller's thread)
                pending._error = e
            pending.ran, pending.cpu = time.perf_counter() - t0, time.thread_time() - c0
            if self.awaited is pending:  # the next job naps again, while the caller computes
                self.hurry.clear()
            pending._done.set()


class StartedCalls:
    """A Ring's side of its started calls: its Progress (started on first use), the owner check, the
    drain, and ``submit`` for a collective on a communicator of its own that keeps the Ring's one order
    (ZeRO++'s quantized calls, comm/quantized.py). Ring inherits it; it needs ``_progress``, ``rank``
    and ``executor``."""

    def progress(self) -> Progress:
        """The progress thread of this Ring's started calls (started on first use)."""
        if self._progress is None:
            self._progress = Progress(f"ringzero-progress-{self.rank}")
            self.executor.set_hurry(self._progress.hurry)
        return self._progress

    def drain(self):
        """Wait until every started call is done (their errors stay for their own wait())."""
        if self._progress is not None:
            self._progress.drain()

    def in_order(self) -> bool:
        """May a blocking call run on the caller's thread now? False while started calls are in flight
        (a blocking call then waits its turn: started calls first, one order)."""
        pr = self._progress
        return pr is None or pr.on_worker() or not pr.busy()

    def submit(self, name, send, recv, job) -> Pending:
        """Run ``job()`` on this Ring's progress thread after every call started before it, and return
        its Pending (of ``recv``): how a collective on a communicator of its own (ZeRO++'s quantized
        ones, comm/quantized.py) keeps the one order and the owner checks of the Ring it runs beside.
        Host buffers only (no stream order is kept here)."""
        if not isinstance(send, np.ndarray) or not isinstance(recv, np.ndarray):
            raise TypeError(f"Ring.submit({name}): host (NumPy) buffers only, got {type(send).__name__}")
        pr = self.progress()
        return pr.submit(job, Pending(name, send, recv, pr))

    def owner(self, send, recv=None):
        """The started, unfinished call that reading `send` and writing `recv` would race (None: safe)."""
        if self._progress is None:
            return None
        return self._progress.owner(send, send if recv is None else recv)
