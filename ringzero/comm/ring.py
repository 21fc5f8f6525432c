"""Hand-written reduce-scatter, all-gather and all-reduce on MPI point-to-point.

What it is
    ``Ring(comm)`` over any mpi4py intracommunicator:

        ring.all_reduce(buf, op="sum")             # in place, any len >= 0
        ring.reduce_scatter(send, recv, op="sum")  # len(send) == n*len(recv)
        ring.all_gather(send, recv)                # len(recv) == n*len(send)
        ring.ledger["all_reduce"]["bytes_sent"]    # what this rank put on the wire
        Ring.set_context("step 17")                # quoted by the stall inspector

    Only point-to-point calls move data (a Ring never calls an MPI collective
    after its constructor's Dup). The schedule is chosen by S = the whole
    array in bytes and n (schedule.py holds the rule, its thresholds and the
    rounds and bytes of each):

    direct (3 <= n <= 16 and S <= direct_bytes, 16 MiB, which caps its
            scratch; the all-gather needs none and takes it at any S; for a
            power-of-two n only the reduce-scatter and all-gather, above
            latency_bytes, 64 KiB; one round per pass)
        Reduce-scatter: rank r sends block p to rank p for every p != r and
        receives block r of every other rank, all posted at once, one wait;
        it then adds them in the halving tree's order when n is a power of
        two (below) and in the ring's otherwise. All-gather: its block to
        every peer and every peer's block, posted at once, one wait. An
        all-reduce (n | len, n not a power of two) is the two. Bytes sent:
        as the ring's.

    ring (otherwise, when not the tree)
        The buffer is cut into n blocks; block i holds L//n elements, plus one
        for i < L % n. Reduce-scatter: at step s = 0..n-2 rank r sends block
        (r-s-1) % n to its right and adds what it gets from its left into block
        (r-s-2) % n, so rank r ends owning block r, summed as
        ((x[r+1] + x[r+2]) + ...) + x[r]. All-gather: at step s rank r
        forwards block (r-s) % n. Each pass sends every block but one:
            RS sends  L - len(block r)          elements
            AG sends  L - len(block (r+1) % n)  elements
        i.e. exactly (n-1)/n of the buffer per pass when n divides L. Each
        step is cut into segments of ``seg_bytes`` and a segment is sent on as
        soon as it is reduced, so the next send overlaps the next reduction.

    tree (n a power of two and S <= tree_bytes; log2 n steps per pass)
        reduce-scatter by recursive halving (partner r ^ n/2, then r ^ n/4 ...),
        all-gather by recursive doubling (r ^ 1, r ^ 2 ...); both send (n-1)/n
        of the buffer, like the ring, in log2 n steps instead of n-1.
        all-reduce: Rabenseifner (the two, reducing in place) when n divides
        L, or, when S <= small_bytes, recursive doubling over the whole buffer
        in the halving order (r ^ n/2 first): log2 n steps, S * log2 n bytes
        sent, in messages of at most ``eager_bytes`` when S is up to 4 of them
        (a 4 KiB message would pay a rendezvous). An all-reduce whose L is not
        a multiple of n and S > small_bytes takes the ring.

    Composition contract: for L divisible by n, all_reduce is bitwise equal to
    reduce_scatter followed by all_gather. Every element is summed over one
    tree whichever schedule runs: for a power-of-two n and S <= tree_bytes
    the halving tree (recursive doubling pairs ranks in its order,
    Rabenseifner *is* halving then doubling, the direct reduce-scatter adds
    its received blocks along it), and otherwise the ring's chain (the ring
    and direct all-reduces *are* their RS then AG). The order depends only
    on S and n, the same for both calls (at n = 2 the orders coincide).
    Sums are deterministic and bitwise equal on every rank: each element is
    reduced in a fixed order (adds commute bitwise).
    float16 hops add in float32 and round once (ringzero.comm.kernels.add_f16).
    "avg" divides the finished sum by n (float16: in float32, one rounding).

    The fast path: a call compiles (plan.py, algorithms.py) to persistent
    requests (Send_init/Recv_init) and views, made once per (buffers, op,
    schedule) seen twice and kept in an LRU of ``max_plans`` (cache.py). A repeat call with the
    very same array objects finds its plan by their ids (the plan holds them)
    and checks only what an array can change in place (dtype, shape,
    writeable); fresh views of the same memory find it by their addresses.
    executor.py then runs Startall / Waitall or Waitsome (blocking inside MPI,
    the GIL released) / add per step. Arguments are checked once per key. The ledger
    counts a kept plan's runs and multiplies on reading.

    Errors: bad arguments raise before any message. A received count that
    differs from the expected one raises ValueError on the rank that sees it;
    a peer that does not arrive within ``timeout`` (RINGZERO_TIMEOUT) raises
    TimeoutError naming the op and the peer (diagnostics.py words every such
    line; watchdog.py cancels the wait;
    if MPI cannot cancel it, the job is aborted). After ``stall_warn``
    seconds (RINGZERO_STALL_WARN) without progress a waiting rank prints one
    line: op, context, peer. After an error the Ring refuses further calls
    (its message stream is out of step): make a new one.

What it is not
    A general MPI: no other ops, no strides, no datatypes but the ones listed.
    CuPy arrays go straight to MPI when it is CUDA-aware (backend.cuda_aware()),
    otherwise through grow-only pinned host buffers with the reduction on host
    (staging.py).

    The parts: ring.py (this: the public ops and the dispatcher), cache.py
    (kept plans, scratch, ledger), plan.py + algorithms.py + builder.py +
    steps.py (compiling a call), executor.py (running it), diagnostics.py
    (the words of every stall and error), staging.py (device through host).
"""
from __future__ import annotations

import functools
import os

import numpy as np
from mpi4py import MPI

from ringzero.comm import kernels, schedule
from ringzero.comm import plan as planmod
from ringzero.comm.backend import Staging, StreamOrder, cuda_aware, get_array_module, sync
from ringzero.comm.cache import MAX_PLANS, PlanCache
from ringzero.comm.checks import DTYPES, check_args
from ringzero.comm.diagnostics import Diagnostics, Limits
from ringzero.comm.executor import Executor
from ringzero.comm.nodes import NodeMap, block_order, split
from ringzero.comm.progress import Pending, StartedCalls
from ringzero.comm.schedule import DIRECT_RANKS, EAGER_BYTES, NODE_BYTES, SEG_BYTES, TREE_BYTES, choose, defaults
from ringzero.comm.staging import staged_call
from ringzero.comm.steps import blocks
from ringzero.comm.trace import RECORDER
from ringzero.comm.watchdog import WATCHDOG, set_context

__all__ = ["Ring", "DTYPES", "DIRECT_RANKS", "MAX_PLANS", "blocks"]
_F16 = np.dtype(np.float16)


def _where(x):
    """(address, writeable) of an array; raises for anything MPI could not take as is."""
    if isinstance(x, np.ndarray):
        return MPI.buffer(x).address, x.flags.writeable
    return x.data.ptr, True  # CuPy: device pointer; its flags have no `writeable`


class Ring(StartedCalls):
    """Ring and latency-optimal collectives over `comm` (see the module docstring)."""

    set_context = staticmethod(set_context)   # Ring.set_context("step 17"): quoted in stall lines

    def __init__(self, comm, timeout: float | None = None, stall_warn: float | None = None, nodes=None):
        """Collective over comm. nodes: a node label per rank, to set the topology instead of asking MPI."""
        self.comm = comm.Dup()  # our own message space: user traffic can't match ours
        self.rank, self.size = self.comm.rank, self.comm.size
        self.left, self.right = (self.rank - 1) % self.size, (self.rank + 1) % self.size
        self.nodes = NodeMap.discover(self.comm, nodes)   # collective: which ranks share a node
        self.remote = frozenset(p for p in range(self.size) if self.nodes.crosses(self.rank, p))
        self.node_group = self.cross_group = self.node_order = self.cross_pair = self.pair_order = None
        if self.nodes.uniform:       # the node-aware schedule's groups and block orders (plan.node_aware)
            self.node_group, self.cross_group = split(self.comm, self.nodes)
            self.node_order, _ = block_order(self.nodes, self.rank, self.comm, pair=False)
            self.pair_order, self.cross_pair = block_order(self.nodes, self.rank, self.comm)
        self.limits = Limits.from_env(timeout, stall_warn)
        knobs = defaults(self.size)                      # schedule.py: the rule and its defaults
        self._small_bytes = int(os.environ.get("RINGZERO_SMALL_BYTES", knobs["small_bytes"]))
        self._eager_bytes = int(os.environ.get("RINGZERO_EAGER_BYTES", EAGER_BYTES))
        self._tree_bytes = int(os.environ.get("RINGZERO_TREE_BYTES", TREE_BYTES))
        self._seg_bytes = max(64, int(os.environ.get("RINGZERO_SEG_BYTES", SEG_BYTES)))
        self._direct_bytes = int(os.environ.get("RINGZERO_DIRECT_BYTES", knobs["direct_bytes"]))
        self._latency_bytes = int(os.environ.get("RINGZERO_LATENCY_BYTES", knobs["latency_bytes"]))
        self._node_bytes = int(os.environ.get("RINGZERO_NODE_BYTES", NODE_BYTES))
        self._pair_bytes = int(os.environ.get("RINGZERO_PAIR_BYTES", schedule.PAIR_BYTES))   # -1: never
        self._cross_ring_bytes = int(os.environ.get("RINGZERO_CROSS_RING_BYTES", schedule.CROSS_RING_BYTES))
        self._chunk_bytes = int(os.environ.get("RINGZERO_CHUNK_BYTES", schedule.CHUNK_BYTES))
        self._cross_seg_bytes = int(os.environ.get("RINGZERO_CROSS_SEG_BYTES", schedule.CROSS_SEG_BYTES))
        self.pow2 = self.size & (self.size - 1) == 0
        self.cache = PlanCache(MAX_PLANS)
        self._hot = self.cache.hot   # the hot path's one dictionary
        self.ledger = self.cache.ledger
        self.staging = Staging()
        self._cuda_aware = None
        self._broken = None
        self.diagnostics = Diagnostics(self.comm, self.limits)
        self.executor = Executor(self.comm, self.limits, self.diagnostics, self._on_fail)
        self._run = RECORDER.traced_run(self.executor.run, self)   # the run itself unless --trace
        self._progress = None        # the progress thread of the nonblocking forms, once one is started
        self._order = None           # device buffers: the progress thread's stream and device (backend.StreamOrder)
        WATCHDOG.add(self.executor)

    # ---- schedule knobs: setting one drops the id-keyed shortcut to kept plans
    def _knob(name):
        attr = "_" + name

        def set_(self, v):
            setattr(self, attr, int(v))
            self._hot.clear()
        return property(lambda self: getattr(self, attr), set_)

    small_bytes = _knob("small_bytes")    # all_reduce at or below (power-of-two n): recursive doubling
    tree_bytes = _knob("tree_bytes")      # at or below (power-of-two n): halving / doubling
    seg_bytes = _knob("seg_bytes")        # the ring's pipeline segment
    direct_bytes = _knob("direct_bytes")  # RS/AR at or below (3 <= n <= 16): direct; AG any S; 0: never
    latency_bytes = _knob("latency_bytes")  # RS/AG at or below (power-of-two n): the tree, not direct
    eager_bytes = _knob("eager_bytes")    # recursive doubling's largest message (up to 4 of them)
    node_bytes = _knob("node_bytes")      # at or above, across N > 1 nodes of P > 1 ranks: node_aware; -1: never
    pair_bytes = _knob("pair_bytes")      # at or above, node-aware across 2 nodes: the cross pass is nodes.Pair
    cross_ring_bytes = _knob("cross_ring_bytes")  # node-aware across > 2 nodes: RS's cross ring from here; -1: none
    chunk_bytes = _knob("chunk_bytes")    # node-aware: the pipeline's chunk of S; 0: one chunk
    cross_seg_bytes = _knob("cross_seg_bytes")  # node-aware: the cross ring's largest message; 0: seg_bytes
    del _knob

    timeout = property(lambda self: self.limits.timeout)
    stall_warn = property(lambda self: self.limits.stall_warn)
    max_plans = property(lambda self: self.cache.max_plans,
                         lambda self, v: setattr(self.cache, "max_plans", int(v)))   # the LRU's bound
    scratch_growths = property(lambda self: self.cache.scratch_growths)

    def free(self):
        """Release the plans' requests and the communicator."""
        if self._progress is not None:
            self._progress.drain()   # nothing of ours may be inside MPI when the requests go
        WATCHDOG.discard(self.executor)
        self.cache.clear()
        for g in (self.node_group, self.cross_group):
            if g is not None:
                g.free()
        self.comm.Free()

    # ---- public ops ------------------------------------------------------
    def all_reduce(self, buf, op: str = "sum"):
        """Sum (op="sum") or mean (op="avg") of `buf` over the ranks, in place; returns buf.

        buf: 1-D contiguous NumPy or CuPy array of a dtype in DTYPES, any length
        (the same on every rank). Bitwise equal on every rank, and for len(buf)
        divisible by n bitwise equal to reduce_scatter then all_gather.
        """
        return self._call("all_reduce", buf, buf, op)

    def reduce_scatter(self, send, recv, op: str = "sum"):
        """recv = block `rank` of the sum (or mean) over ranks of send; returns recv.

        len(send) == n * len(recv); recv may be send[rank*m:(rank+1)*m] (in
        place); send is left unchanged otherwise.
        """
        return self._call("reduce_scatter", send, recv, op)

    def all_gather(self, send, recv):
        """recv = the concatenation of every rank's send, in rank order; returns recv.

        len(recv) == n * len(send); send may be recv[rank*m:(rank+1)*m] (in
        place: no local copy).
        """
        return self._call("all_gather", send, recv, "sum")

    def schedule(self, name: str, nbytes: int, length: int) -> str:
        """The schedule a call of op `name` on S = nbytes (len(send) = length) takes here (schedule.choose)."""
        return choose(name, self.size, nbytes, length, self._small_bytes, self._tree_bytes, self._direct_bytes,
                      self._latency_bytes, nodes=self.nodes.count if self.nodes.uniform else 1,
                      node_bytes=self._node_bytes)

    def sub_schedule(self, name: str, group, big) -> str:
        """The flat schedule one pass of a node-aware call takes over `group` (big: its whole buffer)."""
        return choose(name, group.size, big.nbytes, len(big), self._small_bytes, self._tree_bytes,
                      self._direct_bytes, self._latency_bytes)

    # ---- nonblocking forms (progress.py): the same plans, run on the Ring's progress thread
    def all_reduce_start(self, buf, op: str = "sum") -> Pending:
        """Start all_reduce(buf, op); ``.wait()`` returns buf. buf belongs to the call until then."""
        return self._start("all_reduce", buf, buf, op)

    def reduce_scatter_start(self, send, recv, op: str = "sum") -> Pending:
        """Start reduce_scatter(send, recv, op); ``.wait()`` returns recv."""
        return self._start("reduce_scatter", send, recv, op)

    def all_gather_start(self, send, recv) -> Pending:
        """Start all_gather(send, recv); ``.wait()`` returns recv."""
        return self._start("all_gather", send, recv, "sum")

    # ---- the dispatcher: the kept plan, or check, build and maybe keep one
    def _call(self, name, send, recv, op):
        if self._progress is not None and not self._progress.on_worker() and self._progress.busy():
            return self._start(name, send, recv, op).wait()     # started calls first: one order
        plan = self._hot.get((id(send), id(recv), name, op))
        if plan is not None and self._guard(plan, send, recv):
            plan.runs += 1
            self._run(plan)
            return recv
        self._prepare(name, send, recv, op)()
        return recv

    def _guard(self, plan, send, recv):
        """May `plan` run for these very objects? (The hot path.)

        The objects ran before and the plan holds them, so their ids are
        theirs; the guard reads what an array can change in place (dtype,
        shape, writeable). False: take the slow path.
        """
        g = plan.guard
        return self._broken is None and send.dtype is g[0] and send.shape == g[1] and recv.shape == g[2] \
            and (g[3] or recv.flags.writeable)

    def _key(self, name, send, recv, op):
        """The cache key of a call: what the plan depends on; None for anything MPI could not take."""
        try:
            return (name, op, type(send), send.dtype, send.shape, send.strides, _where(send),
                    type(recv), recv.shape, recv.strides, _where(recv),
                    self._small_bytes, self._tree_bytes, self._seg_bytes, self._direct_bytes, self._eager_bytes,
                    self._latency_bytes, self._node_bytes, self._pair_bytes, self._cross_ring_bytes,
                    self._chunk_bytes, self._cross_seg_bytes)
        except Exception:  # noqa: BLE001 (not an array MPI takes: check_args says why)
            return None

    def _prepare(self, name, send, recv, op):
        """Everything a call does before its first message, on the caller's thread; returns what runs it.

        Arguments are checked and the plan found or built (and counted) here, so errors come before
        any message, whether the call then runs inline or on the progress thread.
        """
        if self._broken:
            raise RuntimeError(self.diagnostics.unusable(name, self._broken))
        key = self._key(name, send, recv, op)
        plan = self.cache.get(key) if key is not None else None
        if plan is not None:
            plan.runs += 1
            return lambda: self._run(plan)
        xp = check_args(name, send, recv, op, self.size, self.rank)
        if xp is not np and not self._device_direct():
            return lambda: staged_call(self, name, send, recv, op)
        if xp is not np:
            # building a plan hands the device buffers to MPI (persistent
            # requests); the producer's kernels must be done by then
            sync(send)
        big = recv if name == "all_gather" else send
        sched = self.schedule(name, big.nbytes, len(send))
        plan = planmod.build(self, name, xp, send, recv, sched,
                             lambda nb, k=2, first=0: self.cache.scratch(xp, nb, k, first))
        plan.post = op == "avg"
        plan.runs = 1
        if self.cache.offer(key, plan, send, recv, op, xp is not np):
            return lambda: self._run(plan)

        def once():                  # seen once: run, count, free its requests
            self._run(plan)
            self.cache.release(plan)
        return once

    def _start(self, name, send, recv, op) -> Pending:
        pr = self.progress()
        plan = self._hot.get((id(send), id(recv), name, op))
        if plan is None or not self._guard(plan, send, recv):
            key = None if self._broken else self._key(name, send, recv, op)
            plan = self.cache.get(key) if key is not None else None     # fresh views of kept buffers
        if plan is not None and self._broken is None:
            plan.runs += 1
            job = functools.partial(self._run, plan, True)
        else:
            # a new plan may grow the scratch, which frees the kept plans (one may be in flight):
            # let the started calls finish first (it happens on a buffer's first two calls only)
            for p in pr.inflight:
                p._done.wait()
            job = self._prepare(name, send, recv, op)
        if isinstance(send, np.ndarray):
            return pr.submit(job, Pending(name, send, recv, pr))
        if self._order is None:
            self._order = StreamOrder(get_array_module(send))
        pending = Pending(name, send, recv, pr, self._order)
        return pr.submit(self._order.wrap(job, pending), pending)

    # ---- what plans are made of --------------------------------------------
    @staticmethod
    def addr(x) -> int:
        return x.ctypes.data if isinstance(x, np.ndarray) else x.data.ptr

    @staticmethod
    def adder(xp, dtype):
        """fn(a, b, out): out = a + b; float16 widened to float32 and rounded once."""
        if xp is np:
            if dtype != _F16:
                return np.add
            return kernels._c.add_f16 if kernels._c is not None else kernels.add_f16

        def add_on_device(a, b, out):
            if dtype == _F16:
                kernels.add_f16(a, b, out)
            else:
                xp.add(a, b, out=out)
            sync(out)  # the next thing done with `out` may be MPI
        return add_on_device

    def _on_fail(self, plan):
        """The executor cancelled what `plan` left in flight: this Ring's message stream is out of step."""
        self._broken = f"{plan.name} failed on rank {self.rank}"
        self.cache.abandon(plan)

    def _device_direct(self) -> bool:
        if self._cuda_aware is None:
            self._cuda_aware = cuda_aware()
        return self._cuda_aware
