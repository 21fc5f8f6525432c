"""Runs a compiled collective: one pass over its steps, waiting inside MPI, checking every count.

What it is
    ``Executor(comm, limits, diag, on_fail)`` runs a ``CollectivePlan``
    (steps.py): ``Startall`` for a Start, one blocking wait for a Wait or an
    Exchange (inside MPI, the GIL released; ``RINGZERO_WAIT=poll`` spins on
    Testall with sched_yield instead, for cores shared with other work), a
    Waitsome loop for a MultiWait, the add, the copy. Before each wait it
    publishes what it waits for (``waiting``, a steps.Waiting) and bumps
    ``progress``; the stall inspector (watchdog.py) samples both, warns, and at
    the timeout sets ``hit`` and cancels the wait, so the wait returns here and
    this thread raises.

    Errors, all raised on the caller's thread after the plan's requests in
    flight are cancelled and ``on_fail(plan)`` told the Ring: ValueError for a
    received count other than expected (or a message MPI truncated),
    TimeoutError naming op, context and peer.

What it is not
    It builds nothing and keeps nothing: the Ring's cache owns the plans.
"""
from __future__ import annotations

import functools
import os

import numpy as np
from mpi4py import MPI

from ringzero.comm.backend import sync
from ringzero.comm.steps import STARTS, WAITS, Add, Exchange, MultiWait, Start, Wait

_startall, _waitall, _testall = MPI.Prequest.Startall, MPI.Request.Waitall, MPI.Request.Testall
_waitsome, _testsome, _BYTE = MPI.Request.Waitsome, MPI.Request.Testsome, MPI.BYTE


def _poll(reqs, statuses):
    """Waitall by Testall and sched_yield (RINGZERO_WAIT=poll)."""
    while not _testall(reqs, statuses):
        os.sched_yield()


def _poll_some(reqs, statuses):
    """Waitsome by Testsome and sched_yield (RINGZERO_WAIT=poll)."""
    while True:
        idx = _testsome(reqs, statuses)
        if idx is None or idx:
            return idx
        os.sched_yield()


# The progress thread's waits (progress.py). Its caller is computing on the same cores, and MPI's
# own Waitall spins at full speed: so test, then nap, doubling the nap from NAP_MIN to NAP_MAX
# seconds. Each test moves what MPI can move (a TCP socket takes megabytes per call), and a nap
# releases the core (and the GIL) to the compute thread. Once the caller waits for the result
# (Progress.hurry), nothing is left to share the core with: the rest of the wait is MPI's own.
# (Naps of 20 us doubling to 500 us, with a
# few sched_yields first, slowed the compute beside them more: docs/overlap.md.)
NAP_MIN, NAP_MAX = 200e-6, 2e-3


def _naps():
    nap = NAP_MIN
    while True:
        yield nap
        nap = min(2 * nap, NAP_MAX)


def _nap(reqs, statuses, hurry, block):
    """Test and nap; once the caller waits for the result (``hurry``), wait inside MPI instead."""
    for nap in _naps():
        if _testall(reqs, statuses):
            return
        if hurry.wait(nap):          # a nap, cut short when the caller starts to wait
            return block(reqs, statuses)


def _nap_some(reqs, statuses, hurry, block):
    for nap in _naps():
        idx = _testsome(reqs, statuses)
        if idx is None or idx:
            return idx
        if hurry.wait(nap):
            return block(reqs, statuses)


class Executor:
    def __init__(self, comm, limits, diag, on_fail):
        self.size, self.limits, self.diag, self.on_fail = comm.size, limits, diag, on_fail
        mode = os.environ.get("RINGZERO_WAIT", "block")
        if mode not in ("block", "poll"):
            raise ValueError(f"expected RINGZERO_WAIT=block or poll, got {mode!r}")
        self._wait = _waitall if mode == "block" else _poll           # block: inside MPI, GIL released
        self._waitsome = _waitsome if mode == "block" else _poll_some
        self.waiting = None    # the Waiting of the wait in progress (read by the stall inspector)
        self.progress = 0      # bumped before every wait: the inspector's "same wait as before?"
        self.hit = None        # (Waiting, stalled s): set by the inspector at the timeout
        self.done = None       # the done flags of the MultiWait in progress, for resolve()
        self._bg = False       # the run in progress is the progress thread's
        self._bg_wait = self._bg_waitsome = None    # the progress thread's waits (set_hurry)

    def set_hurry(self, hurry):
        """The Ring's progress thread exists: its waits nap until ``hurry`` (a threading.Event) is set."""
        self._bg_wait = functools.partial(_nap, hurry=hurry, block=self._wait)
        self._bg_waitsome = functools.partial(_nap_some, hurry=hurry, block=self._waitsome)

    def resolve(self, w):
        """What the inspector names: a MultiWait narrowed to its requests still open."""
        return self.diag.resolve(w, self.done)

    def run(self, plan, background: bool = False):
        """Run a plan's steps once (the caller counted the run in plan.runs).

        background: on the progress thread, beside the caller's compute: wait by test-and-nap."""
        xp = plan.xp
        if xp is not np:
            sync(plan.keep[-1])  # a CuPy producer must be done before MPI reads the buffer
        wait = self._bg_wait if background else self._wait
        self._bg = background
        # the hot loop: each record is unpacked as the tuple it is (no attribute lookups per step)
        for st in plan.steps:
            kind = type(st)
            if kind is Exchange or kind is Wait:
                reqs, statuses, checks, waiting = st
                if kind is Exchange:
                    _startall(reqs)
                self.waiting = waiting
                self.progress += 1
                try:
                    wait(reqs, statuses)
                except MPI.Exception as e:  # e.g. MPI_ERR_TRUNCATE: the peer sent more than we expect
                    self.waiting = None
                    self._fail(plan, st)
                    raise ValueError(self.diag.truncated(plan.name, [nb for _, nb in checks], waiting, e)) from None
                self.waiting = None
                if self.hit is not None:
                    self._fail(plan, st)
                    raise TimeoutError(self.diag.timeout_message(*self.hit))
                for status, nb in checks:
                    if status.Get_count(_BYTE) != nb:
                        self._fail(plan, st)
                        raise ValueError(self.diag.count_mismatch(plan.name, nb, status.Get_source(),
                                                                  status.Get_count(_BYTE)))
            elif kind is Add:
                a, b, out, fn = st
                fn(a, b, out)
            elif kind is MultiWait:
                self._multi_wait(plan, st)
            elif kind is Start:
                _startall(st[0])
            else:  # Copy
                dst, src = st
                dst[...] = src
                if xp is not np:
                    sync(dst)
        if plan.post:
            self._avg(xp, plan.keep[-1])

    def _multi_wait(self, plan, st):
        """Waitsome until every request of a MultiWait is done, marking each in st.done."""
        reqs, sts, expect, waiting, done = st
        left = len(reqs)
        for i in range(left):
            done[i] = 0
        self.done = done
        self.waiting = waiting
        waitsome = self._bg_waitsome if self._bg else self._waitsome
        while left:
            self.progress += 1
            try:
                idx = waitsome(reqs, sts)
            except MPI.Exception as e:
                self.waiting = None
                self._fail(plan, st)
                raise ValueError(self.diag.truncated(plan.name, expect, st.waiting, e)) from None
            if self.hit is not None:
                self.waiting = None
                self._fail(plan, st)
                raise TimeoutError(self.diag.timeout_message(*self.hit))
            if idx is None:  # nothing active left
                break
            for k, i in enumerate(idx):  # sts[k] is the status of reqs[i]
                done[i] = 1
                nb = expect[i]
                if nb is not None and sts[k].Get_count(_BYTE) != nb:
                    self.waiting = None
                    self._fail(plan, st)
                    raise ValueError(self.diag.count_mismatch(plan.name, nb, st.waiting.peer[i],
                                                              sts[k].Get_count(_BYTE)))
            left -= len(idx)
        self.waiting = None

    def _avg(self, xp, x):
        if len(x):
            with np.errstate(over="ignore", invalid="ignore"):
                xp.divide(x, self.size, out=x)  # float16: NumPy divides in float32, rounds once
            sync(x)

    def _fail(self, plan, step):
        """Cancel what `plan` left in flight up to `step` (the failing wait is done or cancelled); tell the Ring."""
        i = next(k for k, st in enumerate(plan.steps) if st is step)
        active = []
        for st in plan.steps[:i + 1]:
            if isinstance(st, STARTS):
                active += st.reqs
            if isinstance(st, WAITS):
                active = [q for q in active if all(q is not d for d in st.reqs)]
        for q in active:
            try:
                q.Cancel()
            except MPI.Exception:
                pass
        self.on_fail(plan)
