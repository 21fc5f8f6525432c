"""The vocabulary of a compiled collective: its steps, as named records, and the plan that holds them.

What it is
    A Ring call compiles (plan.py) into a ``CollectivePlan``: a flat list of
    steps over persistent requests (``Send_init`` / ``Recv_init``, made once)
    and precomputed views. The executor (executor.py) runs the list; the stall
    inspector (watchdog.py) reads the ``Waiting`` record of the wait in
    progress. The six steps:

        Start(reqs)                               Prequest.Startall
        Wait(reqs, statuses, checks, waiting)     Request.Waitall on ONE peer; every
                                                  receive's count checked against
                                                  checks = ((status, bytes), ...)
        Exchange(reqs, statuses, checks, waiting) Start then Wait on the same
                                                  requests (one exchange with a peer)
        MultiWait(reqs, statuses, expect, waiting, done)
                                                  Request.Waitsome until all are done;
                                                  expect[i] = the bytes reqs[i]
                                                  receives (None: a send);
                                                  done[i] = 1 once reqs[i] is
        Add(a, b, out, fn)                        fn(a, b, out): out = a + b
        Copy(dst, src)                            dst[...] = src

    A Wait waits on one peer, so a stall names the rank it waits for. A
    MultiWait (the direct schedule: every peer at once) waits by Waitsome, and
    each return marks what completed, so the inspector names the peers still
    open. (MPI_Request_get_status cannot tell it from another thread: Open MPI
    reports a request complete while a wait in another thread holds it.)

What it is not
    No MPI call is made here but ``Request.Free`` in ``free_plan``: plan.py
    builds, executor.py runs.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple


class Waiting(NamedTuple):
    """What a wait is waiting for: the stall inspector reads it, diagnostics.py words it."""
    op: str                  # "all_reduce" | "reduce_scatter" | "all_gather"
    peer: Any                # the peer's rank, or a tuple: one per request (a MultiWait)
    direction: Any           # "recv" | "send", or a tuple: one per request
    reqs: list               # the requests of the wait (cancelled at the timeout)


class Start(NamedTuple):
    reqs: list


class Wait(NamedTuple):
    reqs: list
    statuses: list | None    # None: sends only, nothing to check
    checks: tuple            # ((status, expected bytes), ...) of the receives
    waiting: Waiting


class Exchange(NamedTuple):
    reqs: list               # receives first, then sends, all with one peer
    statuses: list
    checks: tuple
    waiting: Waiting


class MultiWait(NamedTuple):
    reqs: list
    statuses: list
    expect: tuple            # bytes each request receives; None for a send
    waiting: Waiting         # peer and direction are tuples, one entry per request
    done: bytearray          # done[i] = 1 once reqs[i] completed in this run


class Add(NamedTuple):
    a: Any
    b: Any
    out: Any
    fn: Callable             # fn(a, b, out); float16 adds in float32, rounds once


class Copy(NamedTuple):
    dst: Any
    src: Any


WAITS = (Wait, Exchange, MultiWait)      # the steps that block inside MPI
STARTS = (Start, Exchange)               # the steps that start requests


class CollectivePlan:
    """One compiled call: its steps, requests, the buffers it keeps alive and its ledger figures."""

    __slots__ = ("name", "steps", "reqs", "keep", "sent", "sent_net", "recvd", "msgs", "xp", "post", "runs",
                 "hot", "guard", "sched", "dtype", "size")

    def __init__(self, name, xp):
        self.name, self.xp = name, xp
        self.steps, self.reqs, self.keep = [], [], []
        self.sent = self.recvd = self.msgs = 0   # per run: the ledger adds runs * these (Ledger.fold)
        self.sent_net = 0  # the part of `sent` that goes to ranks on other nodes
        self.runs = 0
        self.post = False  # True for op="avg": divide recv by n after the steps
        self.hot = None    # the cache's id-key for this plan's own send/recv objects, once kept
        self.guard = None  # (send.dtype, send.shape, recv.shape, on device): what the id-key cannot see
        self.sched = self.dtype = ""   # the schedule taken and the buffer dtype (the trace's args) ...
        self.size = 0                  # ... and S, nccl-tests' size: the bytes of the whole buffer


def blocks(length: int, n: int) -> list:
    """Block offsets (n+1 of them) of a length-L buffer cut for the ring: block i holds L//n (+1 for i < L % n)."""
    q, rem = divmod(length, n)
    return [i * q + min(i, rem) for i in range(n + 1)]


def free_plan(plan: CollectivePlan) -> None:
    """Free a plan's requests (all inactive: the plan finished)."""
    for q in plan.reqs:
        q.Free()
    plan.reqs = []
