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

    The fast path (plan.py): a call compiles to persistent requests
    (Send_init/Recv_init) and views, made once per (buffers, op, schedule)
    seen twice and kept in an LRU of ``max_plans``. A repeat call with the
    very same array objects finds its plan by their ids (the plan holds them)
    and checks only what an array can change in place (dtype, shape,
    writeable); fresh views of the same memory find it by their addresses.
    It then runs Startall / Waitall or Waitsome (blocking inside MPI, the GIL
    released) / add per step. Arguments are checked once per key. The ledger
    counts a kept plan's runs and multiplies on reading.

    Errors: bad arguments raise before any message. A received count that
    differs from the expected one raises ValueError on the rank that sees it;
    a peer that does not arrive within ``timeout`` (RINGZERO_TIMEOUT) raises
    TimeoutError naming the op and the peer (watchdog.py cancels the wait;
    if MPI cannot cancel it, the job is aborted). After ``stall_warn``
    seconds (RINGZERO_STALL_WARN) without progress a waiting rank prints one
    line: op, context, peer. After an error the Ring refuses further calls
    (its message stream is out of step): make a new one.

What it is not
    A general MPI: no other ops, no strides, no datatypes but the ones listed.
    CuPy arrays go straight to MPI when it is CUDA-aware (backend.cuda_aware()),
    otherwise through grow-only pinned host buffers with the reduction on host.
"""
from __future__ import annotations

import os
from collections import OrderedDict

import numpy as np
from mpi4py import MPI

from ringzero.comm import kernels, plan as planmod
from ringzero.comm.backend import Staging, cuda_aware, sync
from ringzero.comm.checks import DTYPES, check_args  # noqa: F401 (DTYPES is public here)
from ringzero.comm.plan import ADD, COPY, MWAIT, START, WAIT, XCHG, blocks  # noqa: F401 (blocks is public here)
from ringzero.comm.schedule import (DIRECT_BYTES, DIRECT_RANKS, EAGER_BYTES, OPS, SEG_BYTES,  # noqa: F401
                                    SMALL_BYTES, TREE_BYTES, choose, defaults)
from ringzero.comm.watchdog import WATCHDOG, get_context, set_context

MAX_PLANS = 256
_F16 = np.dtype(np.float16)
_startall, _waitall, _testall, _BYTE = MPI.Prequest.Startall, MPI.Request.Waitall, MPI.Request.Testall, MPI.BYTE
_waitsome, _testsome = MPI.Request.Waitsome, MPI.Request.Testsome


def _poll(reqs, statuses):
    """Waitall by Testall and sched_yield: for cores shared with other work (RINGZERO_WAIT=poll)."""
    while not _testall(reqs, statuses):
        os.sched_yield()


def _poll_some(reqs, statuses):
    """Waitsome by Testsome and sched_yield (RINGZERO_WAIT=poll)."""
    while True:
        idx = _testsome(reqs, statuses)
        if idx is None or idx:
            return idx
        os.sched_yield()


class Ledger:
    """Cumulative per-op counters of this rank: bytes_sent, bytes_recv, messages, calls.

    A kept plan only counts its runs (the hot path adds 1); the counters are
    base + runs * the plan's per-call figures, folded into base when a plan
    is dropped. ``live`` is the container of kept plans (the Ring's LRU).
    """

    _KEYS = ("bytes_sent", "bytes_recv", "messages", "calls")

    def __init__(self, live=()):
        self._live = live
        self.reset()

    def reset(self):
        self._d = {op: dict.fromkeys(self._KEYS, 0) for op in OPS}
        for p in self._live:
            p.runs = 0

    def fold(self, plan):
        """Move a plan's runs into the base counters (the plan is being dropped)."""
        k, plan.runs = plan.runs, 0
        if k:
            d = self._d[plan.name]
            d["bytes_sent"] += k * plan.sent
            d["bytes_recv"] += k * plan.recvd
            d["messages"] += k * plan.msgs
            d["calls"] += k

    def __getitem__(self, op):
        d = dict(self._d[op])
        for p in self._live:
            if p.name == op and p.runs:
                d["bytes_sent"] += p.runs * p.sent
                d["bytes_recv"] += p.runs * p.recvd
                d["messages"] += p.runs * p.msgs
                d["calls"] += p.runs
        return d

    def total_sent(self) -> int:
        return sum(self[op]["bytes_sent"] for op in OPS)

    def as_dict(self) -> dict:
        return {op: self[op] for op in OPS}


def _where(x):
    """(address, writeable) of an array; raises for anything MPI could not take as is."""
    if isinstance(x, np.ndarray):
        return MPI.buffer(x).address, x.flags.writeable
    return x.data.ptr, True  # CuPy: device pointer; its flags have no `writeable`


def _env_float(name, default):
    v = os.environ.get(name)
    try:
        return float(v) if v not in (None, "") else float(default)
    except ValueError:
        raise ValueError(f"expected {name} in seconds (a number), got {v!r}") from None


class Ring:
    """Ring and latency-optimal collectives over `comm` (see the module docstring)."""

    set_context = staticmethod(set_context)   # Ring.set_context("step 17"): quoted in stall lines

    def __init__(self, comm, timeout: float | None = None, stall_warn: float | None = None):
        self.comm = comm.Dup()  # our own message space: user traffic can't match ours
        self.rank, self.size = self.comm.rank, self.comm.size
        self.left, self.right = (self.rank - 1) % self.size, (self.rank + 1) % self.size
        self.timeout = _env_float("RINGZERO_TIMEOUT", 600) if timeout is None else float(timeout)
        self.stall_warn = _env_float("RINGZERO_STALL_WARN", 60) if stall_warn is None else float(stall_warn)
        self.grace = max(2.0, min(30.0, self.timeout / 4))  # then abort a wait MPI could not cancel
        self._hot = {}               # (id(send), id(recv), op name, op) -> kept Plan holding those objects
        knobs = defaults(self.size)                      # schedule.py: the rule and its defaults
        self._small_bytes = int(os.environ.get("RINGZERO_SMALL_BYTES", knobs["small_bytes"]))
        self._eager_bytes = int(os.environ.get("RINGZERO_EAGER_BYTES", EAGER_BYTES))
        self._tree_bytes = int(os.environ.get("RINGZERO_TREE_BYTES", TREE_BYTES))
        self._seg_bytes = max(64, int(os.environ.get("RINGZERO_SEG_BYTES", SEG_BYTES)))
        self._direct_bytes = int(os.environ.get("RINGZERO_DIRECT_BYTES", knobs["direct_bytes"]))
        self._latency_bytes = int(os.environ.get("RINGZERO_LATENCY_BYTES", knobs["latency_bytes"]))
        self.max_plans = MAX_PLANS
        wait = os.environ.get("RINGZERO_WAIT", "block")
        if wait not in ("block", "poll"):
            raise ValueError(f"expected RINGZERO_WAIT=block or poll, got {wait!r}")
        self._wait = _waitall if wait == "block" else _poll   # block: inside MPI, GIL released
        self._waitsome = _waitsome if wait == "block" else _poll_some
        self.pow2 = self.size & (self.size - 1) == 0
        self.scratch_growths = 0
        self._scratch = {}       # module name -> [uint8 array, ...], each grow-only
        self.staging = Staging()
        self._cuda_aware = None
        self._plans = OrderedDict()  # key -> Plan (LRU)
        self.ledger = Ledger(self._plans.values())
        self._seen = set()           # keys met once: a plan is kept from the second call on
        self._broken = None
        self._orphans = []           # plans abandoned after an error (requests may be active)
        self._w, self._progress, self._hit = None, 0, None   # read by the stall inspector
        self._wdone = None           # an MWAIT's done flags, for resolve()
        wg = MPI.COMM_WORLD.Get_group()
        self._world = MPI.Group.Translate_ranks(self.comm.Get_group(), list(range(self.size)), wg)
        WATCHDOG.add(self)

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
    del _knob

    def free(self):
        """Release the plans' requests and the communicator."""
        WATCHDOG.discard(self)
        self._drop_plans()
        self.comm.Free()

    def _drop_plans(self):
        for p in self._plans.values():
            self.ledger.fold(p)
            planmod.free_plan(p)
        self._plans.clear()
        self._hot.clear()

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

    # ---- dispatch: the cached plan, or check, build and maybe keep one ----
    def _call(self, name, send, recv, op):
        plan = self._hot.get((id(send), id(recv), name, op))
        if plan is not None and self._guard(plan, send, recv):
            return recv
        return self._call_slow(name, send, recv, op)

    def _guard(self, plan, send, recv):
        """The hot path: run `plan` if these very objects still are what it was built for.

        The objects ran before and the plan holds them, so their ids are
        theirs; the guard reads what an array can change in place (dtype,
        shape, writeable). False: nothing ran, take the slow path.
        """
        g = plan.guard
        if self._broken is None and send.dtype is g[0] and send.shape == g[1] and recv.shape == g[2] \
                and (g[3] or recv.flags.writeable):
            plan.runs += 1
            self._run(plan)
            return True
        return False

    def _call_slow(self, name, send, recv, op):
        if self._broken:
            raise RuntimeError(f"ring {name}: this Ring is unusable after an earlier error ({self._broken}); "
                               "HINT: make a new Ring")
        try:
            key = (name, op, type(send), send.dtype, send.shape, send.strides, _where(send),
                   type(recv), recv.shape, recv.strides, _where(recv),
                   self._small_bytes, self._tree_bytes, self._seg_bytes, self._direct_bytes, self._eager_bytes,
                   self._latency_bytes)
            plan = self._plans.get(key)
        except Exception:  # noqa: BLE001 (not an array MPI takes: _check says why)
            key = plan = None
        if plan is None:
            xp = self._check(name, send, recv, op)
            if xp is not np and not self._device_direct():
                return self._staged(name, send, recv, op)
            if xp is not np:
                # building a plan hands the device buffers to MPI (persistent
                # requests); the producer's kernels must be done by then
                sync(send)
            plan = planmod.build(self, name, xp, send, recv, self._schedule(name, send, recv),
                                 lambda nb, k=2: self._scr(xp, nb, k))
            plan.post = op == "avg"
            plan.runs = 1
            if key in self._seen:
                self._plans[key] = plan
                if len(self._plans) > self.max_plans:
                    self._evict(self._plans.popitem(last=False)[1])
                # the objects of this call are the plan's own (plan.keep holds them)
                plan.hot = (id(send), id(recv), name, op)
                plan.guard = (send.dtype, send.shape, recv.shape, xp is not np)
                self._hot[plan.hot] = plan
            else:
                if key is not None:
                    self._seen.add(key)
                if len(self._seen) > 16 * self.max_plans:
                    self._seen.clear()
                self._run(plan)
                self.ledger.fold(plan)
                planmod.free_plan(plan)
                return recv
        else:
            self._plans.move_to_end(key)
            plan.runs += 1
        self._run(plan)
        return recv

    def _evict(self, plan):
        self.ledger.fold(plan)
        if plan.hot is not None:
            self._hot.pop(plan.hot, None)
        planmod.free_plan(plan)

    def schedule(self, name: str, nbytes: int, length: int) -> str:
        """The schedule a call of op `name` on S = nbytes (len(send) = length) takes here (schedule.choose)."""
        return choose(name, self.size, nbytes, length, self._small_bytes, self._tree_bytes, self._direct_bytes,
                      self._latency_bytes)

    def _schedule(self, name, send, recv):
        big = recv if name == "all_gather" else send
        return self.schedule(name, big.nbytes, len(send))

    def _run(self, plan):
        """Run a plan's steps (the caller counted the run in plan.runs)."""
        xp = plan.xp
        if xp is not np:
            sync(plan.keep[-1])  # a CuPy producer must be done before MPI reads the buffer
        wait = self._wait
        for st in plan.steps:
            kind = st[0]
            if kind == XCHG or kind == WAIT:
                if kind == XCHG:
                    _startall(st[1])  # noqa: E701
                self._w = st[4]          # what we wait for, for the stall inspector
                self._progress += 1
                try:
                    wait(st[1], st[2])
                except MPI.Exception as e:  # e.g. MPI_ERR_TRUNCATE: the peer sent more than we expect
                    self._w = None
                    self._fail(plan, st)
                    raise ValueError(f"ring {plan.name}: rank {self.rank} expected {st[3][0][1] if st[3] else 0} "
                                     f"bytes from {self._who_of(st[4])}, got more ({e.Get_error_string()}); "
                                     "HINT: do all ranks pass the same length?") from None
                self._w = None
                if self._hit is not None:
                    self._fail(plan, st)
                    raise TimeoutError(self.timeout_message(self._hit[0], self._hit[1]))
                for status, nb in st[3]:
                    if status.Get_count(_BYTE) != nb:
                        self._fail(plan, st)
                        raise ValueError(f"ring {plan.name}: rank {self.rank} expected {nb} bytes from "
                                         f"{self._who(status.Get_source())}, got {status.Get_count(_BYTE)}; "
                                         "HINT: do all ranks pass the same length?")
            elif kind == ADD:
                st[4](st[1], st[2], st[3])
            elif kind == MWAIT:
                self._mwait(plan, st)
            elif kind == START:
                _startall(st[1])
            else:
                st[1][...] = st[2]
                if xp is not np:
                    sync(st[1])
        if plan.post:
            self._avg(xp, plan.keep[-1])

    def _mwait(self, plan, st):
        """Waitsome until every request of an MWAIT step is done, marking each in st[5]."""
        reqs, sts, expect, done = st[1], st[2], st[3], st[5]
        left = len(reqs)
        for i in range(left):
            done[i] = 0
        self._wdone = done
        self._w = st[4]
        waitsome = self._waitsome
        while left:
            self._progress += 1
            try:
                idx = waitsome(reqs, sts)
            except MPI.Exception as e:
                self._w = None
                self._fail(plan, st)
                peers = sorted({p for p, nb in zip(st[4][1], expect) if nb is not None})
                raise ValueError(f"ring {plan.name}: rank {self.rank} expected {max(x or 0 for x in expect)} bytes "
                                 f"from each of ranks {', '.join(map(str, peers))}, got more from one of them "
                                 f"({e.Get_error_string()}); HINT: do all ranks pass the same length?") from None
            if self._hit is not None:
                self._w = None
                self._fail(plan, st)
                raise TimeoutError(self.timeout_message(self._hit[0], self._hit[1]))
            if idx is None:  # nothing active left
                break
            for k, i in enumerate(idx):  # sts[k] is the status of reqs[i]
                done[i] = 1
                nb = expect[i]
                if nb is not None and sts[k].Get_count(_BYTE) != nb:
                    self._w = None
                    self._fail(plan, st)
                    raise ValueError(f"ring {plan.name}: rank {self.rank} expected {nb} bytes from "
                                     f"{self._who(st[4][1][i])}, got {sts[k].Get_count(_BYTE)}; "
                                     "HINT: do all ranks pass the same length?")
            left -= len(idx)
        self._w = None

    # ---- checks (all before any message): checks.py ------------------------
    def _check(self, name, send, recv, op):
        return check_args(name, send, recv, op, self.size, self.rank)

    @staticmethod
    def addr(x) -> int:
        return x.ctypes.data if isinstance(x, np.ndarray) else x.data.ptr

    # ---- plumbing ----------------------------------------------------------
    def _scr(self, xp, nbytes, k=2):
        """k grow-only scratch buffers of >= nbytes each (uint8); growing drops the kept plans."""
        have = self._scratch.setdefault(xp.__name__, [])
        grew = False
        for i in range(k):
            if i == len(have) or have[i].nbytes < nbytes:
                old = have[i].nbytes if i < len(have) else 0
                cap = -(-max(nbytes, 2 * old, 4096) // 64) * 64  # any itemsize divides it
                buf = xp.empty(cap, xp.uint8)
                have[i:i + 1] = [buf]
                grew = True
        if grew:
            self.scratch_growths += 1
            self._drop_plans()  # they hold views of the old scratch
        return have[:k]

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

    def _avg(self, xp, x):
        if len(x):
            with np.errstate(over="ignore", invalid="ignore"):
                xp.divide(x, self.size, out=x)  # float16: NumPy divides in float32, rounds once
            sync(x)

    # ---- errors and the stall inspector's words ----------------------------
    def _who(self, peer):
        w = self._world[peer]
        return f"rank {peer}" if w == peer or w == MPI.UNDEFINED else f"rank {peer} (world rank {w})"

    def _who_of(self, w):
        return self._who(w[1]) if not isinstance(w[1], tuple) else "ranks " + ", ".join(map(str, sorted(set(w[1]))))

    def resolve(self, w):
        """A wait on several peers (an MWAIT) narrowed to the requests not yet done.

        Called by the stall inspector, on its own thread, once a wait has
        stalled: the flags it reads are the ones _mwait set for this wait.
        """
        if not isinstance(w[1], tuple):
            return w
        done = self._wdone
        left = [(p, d) for i, (p, d) in enumerate(zip(w[1], w[2])) if done is None or not done[i]]
        if len({p for p, _ in left}) == 1:  # one peer: what a WAIT on it would say
            return (w[0], left[0][0], "recv" if any(d == "recv" for _, d in left) else "send", w[3])
        return (w[0], tuple(p for p, _ in left) or w[1], tuple(d for _, d in left) or w[2], w[3])

    def _waiting_for(self, w):
        if not isinstance(w[1], tuple):
            what = "a message from" if w[2] == "recv" else "a send to be taken by"
            return f"{what} {self._who(w[1])}", f"rank {w[1]}"
        parts = []
        for d, what in (("recv", "messages from"), ("send", "sends to be taken by")):
            ps = sorted({p for p, x in zip(w[1], w[2]) if x == d})
            if ps:
                parts.append(f"{what} {', '.join(self._who(p) for p in ps)}")
        peers = sorted(set(w[1]))
        return " and ".join(parts), ("rank " if len(peers) == 1 else "each of ranks ") + ", ".join(map(str, peers))

    def stall_line(self, w, stalled):
        ctx = get_context()
        waiting, _ = self._waiting_for(w)
        return (f"ringzero | rank {self._world[self.rank]}: {w[0]} has made no progress for {stalled:.3g} s"
                f"{' at ' + ctx if ctx else ''}, waiting for {waiting} "
                f"(warning after RINGZERO_STALL_WARN={self.stall_warn:g} s; error at RINGZERO_TIMEOUT="
                f"{self.timeout:g} s)")

    def timeout_message(self, w, stalled):
        ctx = get_context()
        waiting, peers = self._waiting_for(w)
        return (f"ring {w[0]}{' at ' + ctx if ctx else ''}: rank {self.rank} waited {self.timeout:g} s for "
                f"{waiting}; is {peers} in the same call? (RINGZERO_TIMEOUT sets the limit)")

    def _fail(self, plan, step):
        """Mark the Ring broken; cancel what the plan left in flight up to `step`; keep its buffers alive."""
        self._broken = f"{plan.name} failed on rank {self.rank}"
        i = next(k for k, st in enumerate(plan.steps) if st is step)
        active = []
        for st in plan.steps[:i + 1]:
            if st[0] == START or st[0] == XCHG:
                active += st[1]
            if st[0] in (WAIT, MWAIT, XCHG):  # waited for (the failing wait: done or cancelled already)
                active = [q for q in active if all(q is not d for d in st[1])]
        for q in active:
            try:
                q.Cancel()
            except MPI.Exception:
                pass
        self._orphans.append(plan)
        for p in self._plans.values():  # kept plans may share the abandoned scratch
            self.ledger.fold(p)
        self._plans.clear()
        self._hot.clear()
        self.ledger.fold(plan)

    # ---- CuPy -----------------------------------------------------------------
    def _device_direct(self) -> bool:
        if self._cuda_aware is None:
            self._cuda_aware = cuda_aware()
        return self._cuda_aware

    def _staged(self, name, send, recv, op):
        """Device buffers through grow-only pinned host buffers; the host ring does the work."""
        sync(send)
        dt = send.dtype
        if name == "all_reduce":
            h = self.staging.host("a", send.nbytes).view(dt)
            send.get(out=h)
            self.all_reduce(h, op)
            recv.set(h)
        elif name == "reduce_scatter":
            hs = self.staging.host("a", send.nbytes).view(dt)
            hr = self.staging.host("b", recv.nbytes).view(dt)
            send.get(out=hs)
            self.reduce_scatter(hs, hr, op)
            recv.set(hr)
        else:
            m = len(send)
            hr = self.staging.host("a", recv.nbytes).view(dt)
            send.get(out=hr[self.rank * m:(self.rank + 1) * m])
            self.all_gather(hr[self.rank * m:(self.rank + 1) * m], hr)
            recv.set(hr)
        sync(recv)  # the pinned buffer is reused by the next call: the copy must be done
        return recv
