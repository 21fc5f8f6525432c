"""ZeRO++'s quantized collectives: qwZ's all-gather of int8 codes and qgZ's two-hop quantized reduce-scatter.

What it is
    ``QuantizedComm(ring, weights=Quant(8, 2048), grads=Quant(4, 2048))`` runs over the ranks and
    node map of a Ring (collective: it Dups the Ring's communicator, so its messages never meet
    the Ring's). Its buffers are 1-D contiguous float32, float16 or bfloat16 (ml_dtypes), NumPy or
    CuPy, the same length on every rank:

        qc.all_gather(send, recv)               # len(recv) == n * len(send)         (qwZ)
        qc.reduce_scatter(send, recv, op="sum", residual=None)   # len(send) == n * len(recv)  (qgZ)
        qc.all_gather_start(send, recv).wait()  # the nonblocking forms (NumPy buffers): a Pending
        qc.reduce_scatter_start(send, recv, op="sum", residual=None)
        qc.ledger["q_all_gather"]               # bytes sent, codes and scales apart, intra / inter

    The nonblocking forms check their arguments on the caller's thread, then run the very same
    call on the Ring's progress thread (Ring.submit, comm/progress.py), in one order with the
    Ring's own started calls: the quantizing (C kernels, the GIL released), the messages and the
    sums run there while the caller computes. A blocking call made while started calls are in
    flight waits its turn (its scratch is theirs until then). Until ``wait`` returns, the call
    owns send, recv and the residual; ``ring.owner`` names it.

    all_gather (qwZ): each rank quantizes its block ONCE (``weights``), and the codes and scales
    of every block travel as one wire buffer per block (quant.wire_layout: codes, then the fp32
    scales). Every rank, the owner included, dequantizes every block into recv, so every rank
    holds the same bits: a rank's own block is dequant(quant(send)), not send. Across a uniform
    node map (N nodes x P ranks, P > 1) it is hierarchical: phase 1 gathers the blocks of the
    ranks with this rank's local index across the nodes, phase 2 passes those N blocks inside the
    node, so a block crosses the network N - 1 times, not n - P times. Full precision inside the
    node would leave ranks of one node with other bits than the rest: the weights must agree.

    reduce_scatter (qgZ): recv = block `rank` of the sum over ranks of send, summed in float32 at
    every hop from quantized operands (``grads``), never along a ring:
      - one node (or a map that is not uniform): one hop. Each rank quantizes chunk b of send
        (elements [b*m, (b+1)*m)) for rank b, its own chunk included, sends it to b, and b sums
        dequant(chunk from rank 0), + dequant(chunk from rank 1), ... in rank order;
      - N nodes x P ranks: hop 1 inside the node: rank (node k, local l) sends to each node peer
        j the N chunks of the ranks with local index j, one message; each rank sums, for each
        node k', the dequantized chunks of its node's ranks in local order (float32 partials);
        hop 2 across the nodes: each partial is requantized and sent to its owner (node k',
        local l), who sums their dequantized values in node order.
    A sum's first term is taken as is, then each next one added in float32; "avg" divides the
    finished sum by n in float32; the result is cast to recv's dtype (round to nearest even).
    ``residual`` (float32, len(send), kept by the caller between calls): error feedback on hop 1:
    send + residual is quantized, and residual becomes (send + residual) - dequant(quant(...)).

    The engine (--zeropp, runtime/zeropp.py) does this: qwZ calls ``all_gather`` where runtime/gather.py
    calls ``Ring.all_gather`` on a unit's flat shard (one QuantizedComm per shard Ring, kept as
    long as the Ring); qgZ calls ``reduce_scatter`` where runtime/reduce.py calls the Ring's,
    with one residual per unit if error feedback is on; hpZ needs no new collective: a plain
    Ring over the node's ranks (``Ring(ring.node_group.comm)``) all-gathers the backward's weights
    from a secondary shard of 1/P that each rank keeps after the forward's gather. The trainer sums ``ledger``
    with the rings' (QLedger has the Ring ledger's keys, plus codes / scales, intra / inter).

    Errors: bad arguments raise one line before any message. A peer whose message does not come
    within the Ring's stall warning (RINGZERO_STALL_WARN) gets one line to stderr, worded as the stall
    inspector's; within its timeout (RINGZERO_TIMEOUT), TimeoutError naming the op and the peers;
    a message of another length than expected raises ValueError on the rank that sees it. After
    an error the object refuses further calls (its messages are out of step).

What it is not
    The engine integration, the stall inspector (its waits are this module's own), or a pipeline:
    each call posts all its messages and waits (on the progress thread, for a started one); no nonblocking form for
    CuPy buffers (Ring.submit keeps no stream order). CuPy buffers are quantized and summed on the device and
    the wire buffers staged through pinned host memory (small: a quarter or an eighth of fp32).
    The arithmetic is quant.py's (C kernels on the host, CUDA kernels for CuPy).
"""
from __future__ import annotations

import functools
import os
import time

import numpy as np
from mpi4py import MPI

from ringzero.comm.backend import Staging, get_array_module, sync
from ringzero.comm.qledger import QLedger
from ringzero.comm.quant import Quant, Quantizer, wire_views
from ringzero.comm.trace import RECORDER
from ringzero.comm.watchdog import get_context, say

_IN = ("float32", "float16", "bfloat16")


class _Call:
    """One quantized call as comm/trace.py records a Ring plan's run: its name, schedule, dtype, size S
    (the whole buffer, nccl-tests' size) and the bytes it sent, set once it ran."""
    __slots__ = ("name", "sched", "dtype", "size", "sent", "sent_net", "fn")

    def __init__(self, name, sched, dtype, size, fn):
        self.name, self.sched, self.dtype, self.size, self.fn = name, sched, str(dtype), int(size), fn
        self.sent = self.sent_net = 0


class QuantizedComm:
    """qwZ all-gather and qgZ reduce-scatter over a Ring's ranks (module docstring)."""

    def __init__(self, ring, weights: Quant = Quant(8, 2048), grads: Quant = Quant(4, 2048)):
        self.ring = ring         # its progress thread runs the nonblocking forms, in the Ring's order
        self.comm = ring.comm.Dup()
        self.rank, self.size, self.nodes = self.comm.rank, self.comm.size, ring.nodes
        self.timeout, self.stall_warn = ring.limits.timeout, ring.limits.stall_warn
        self.wq, self.gq = Quantizer(weights), Quantizer(grads)
        nm, n = self.nodes, self.size
        self.two_hop = nm.uniform
        N, P = (nm.count, nm.ppn) if self.two_hop else (1, n)
        self.N, self.P = N, P
        # slot of rank b's block in a wire area: local-index-major, so local index l's N blocks are contiguous
        self.pos = [nm.local_of[b] * N + nm.node_of[b] for b in range(n)] if self.two_hop else list(range(n))
        self.at = {(nm.node_of[b], nm.local_of[b]): b for b in range(n)}
        self.ledger = QLedger()
        self._traced = RECORDER.traced_run(self._run, ring)   # --trace: a comm span per call, as a Ring's
        hops = "two-hop" if self.two_hop else "one-hop"    # the trace's schedule arg, made once
        self._ag_sched, self._rs_sched = f"int{self.wq.spec.bits} {hops}", f"int{self.gq.spec.bits} {hops}"
        self.staging = Staging()
        self._ws = {}            # (array module, name) -> grow-only scratch
        self._broken = None

    def free(self):
        self.ring.drain()        # no started call of ours may be inside MPI when the communicator goes
        self.comm.Free()

    # ---- public ops -------------------------------------------------------
    def all_gather(self, send, recv):
        """recv = every rank's send, quantized (weights) and dequantized, in rank order; returns recv."""
        xp = self._check("all_gather", send, recv, len(send), len(recv))
        if not self.ring.in_order():                      # started calls first: one order, their scratch
            return self.all_gather_start(send, recv).wait()
        return self._traced(self._ag_call(xp, send, recv))

    def all_gather_start(self, send, recv):
        """Start all_gather(send, recv) on the Ring's progress thread; ``.wait()`` returns recv."""
        xp = self._check("all_gather", send, recv, len(send), len(recv))
        return self.ring.submit("q_all_gather", send, recv,
                                functools.partial(self._traced, self._ag_call(xp, send, recv), True))

    def reduce_scatter(self, send, recv, op: str = "sum", residual=None):
        """recv = block `rank` of the quantized sum (or mean) over ranks of send; returns recv."""
        xp = self._check_rs(send, recv, op, residual)
        if not self.ring.in_order():
            return self.reduce_scatter_start(send, recv, op, residual).wait()
        return self._traced(self._rs_call(xp, send, recv, op, residual))

    def reduce_scatter_start(self, send, recv, op: str = "sum", residual=None):
        """Start reduce_scatter(send, recv, op, residual) on the Ring's progress thread; ``.wait()`` returns
        recv. The residual is the call's until then."""
        xp = self._check_rs(send, recv, op, residual)
        return self.ring.submit("q_reduce_scatter", send, recv,
                                functools.partial(self._traced, self._rs_call(xp, send, recv, op, residual), True))

    def trace_on(self):
        """--trace was enabled after this was built: a comm span per call from now on."""
        self._traced = RECORDER.traced_run(self._run, self.ring)

    def _ag_call(self, xp, send, recv):
        return _Call("q_all_gather", self._ag_sched, send.dtype, recv.nbytes,
                     functools.partial(self._all_gather, xp, send, recv))

    def _rs_call(self, xp, send, recv, op, residual):
        return _Call("q_reduce_scatter", self._rs_sched, send.dtype, send.nbytes,
                     functools.partial(self._reduce_scatter, xp, send, recv, op, residual))

    def _run(self, call, background=False):
        """Run one call; its bytes sent (and across nodes) from the ledger, for the trace's args. Calls run
        one at a time (a blocking one only while none started is in flight), so the difference is its own."""
        s0, n0 = self.ledger.total_sent(), self.ledger.total_sent_internode()
        out = call.fn()
        call.sent, call.sent_net = self.ledger.total_sent() - s0, self.ledger.total_sent_internode() - n0
        return out

    # ---- the calls themselves (on the caller's thread or the progress thread) ----
    def _all_gather(self, xp, send, recv):
        n, r, m, spec = self.size, self.rank, len(send), self.wq.spec
        self.ledger.called("q_all_gather")
        if m == 0:
            return recv
        wb = spec.wire_bytes(m)
        area = self._buf("ag", xp, n * wb, np.uint8)
        me = self.pos[r]
        self.wq.quantize(send, *wire_views(spec, area[me * wb:(me + 1) * wb], m))
        if self.two_hop:
            cross = [self.at[k, self.nodes.local_of[r]] for k in range(self.N) if k != self.nodes.node_of[r]]
            self._exchange("q_all_gather", xp, area, [(p, me * wb, wb) for p in cross],
                           [(p, self.pos[p] * wb, wb) for p in cross], spec, m, tag=1)
            region = self.N * wb
            l_me = self.nodes.local_of[r]
            peers = [p for p in range(n) if not self.nodes.crosses(r, p) and p != r]
            self._exchange("q_all_gather", xp, area, [(p, l_me * region, region) for p in peers],
                           [(p, self.nodes.local_of[p] * region, region) for p in peers], spec, m, tag=2,
                           per_msg=self.N)
        else:
            peers = [p for p in range(n) if p != r]
            self._exchange("q_all_gather", xp, area, [(p, me * wb, wb) for p in peers],
                           [(p, self.pos[p] * wb, wb) for p in peers], spec, m, tag=1)
        for b in range(n):
            s = self.pos[b] * wb
            self.wq.dequantize(*wire_views(spec, area[s:s + wb], m), recv[b * m:(b + 1) * m])
        return recv

    def _reduce_scatter(self, xp, send, recv, op, residual):
        n, r, m, spec, q = self.size, self.rank, len(recv), self.gq.spec, self.gq
        self.ledger.called("q_reduce_scatter")
        if m == 0:
            return recv
        wb = spec.wire_bytes(m)
        out_a, in_a = self._buf("rs_out", xp, n * wb, np.uint8), self._buf("rs_in", xp, n * wb, np.uint8)
        x = send
        if residual is not None:                          # error feedback: quantize send + residual
            x = self._buf("ef", xp, n * m, np.float32)
            x[...] = send
            xp.add(x, residual, out=x)
        for b in range(n):                                # chunk b, for rank b, at slot pos[b]
            s = self.pos[b] * wb
            codes, scales = wire_views(spec, out_a[s:s + wb], m)
            q.quantize(x[b * m:(b + 1) * m], codes, scales)
            if residual is not None:
                res = residual[b * m:(b + 1) * m]
                q.dequantize(codes, scales, res)
                xp.subtract(x[b * m:(b + 1) * m], res, out=res)
        acc = self._buf("acc", xp, m, np.float32)
        if not self.two_hop:
            peers = [p for p in range(n) if p != r]
            self._exchange("q_reduce_scatter", xp, in_a, [(p, self.pos[p] * wb, wb) for p in peers],
                           [(p, self.pos[p] * wb, wb) for p in peers], spec, m, tag=3, src=out_a)
            self._sum(q, acc, [(out_a if b == r else in_a, self.pos[b] * wb) for b in range(n)], wb, m)
        else:
            N, P, nm = self.N, self.P, self.nodes
            l_me, k_me, region = nm.local_of[r], nm.node_of[r], N * wb
            peers = [p for p in range(n) if not nm.crosses(r, p) and p != r]
            # hop 1: region j (the N chunks for local index j) to node peer j; theirs for l_me into region of j
            self._exchange("q_reduce_scatter", xp, in_a, [(p, nm.local_of[p] * region, region) for p in peers],
                           [(p, nm.local_of[p] * region, region) for p in peers], spec, m, tag=3, src=out_a,
                           per_msg=N)
            part = self._buf("part", xp, N * m, np.float32)
            hop2 = self._buf("rs_hop2", xp, 2 * N * wb, np.uint8)
            h_out, h_in = hop2[:N * wb], hop2[N * wb:]
            for k in range(N):                            # partial for node k's rank of local index l_me
                terms = [(out_a if i == l_me else in_a, i * region + k * wb) for i in range(P)]
                pk = part[k * m:(k + 1) * m]
                self._sum(q, pk, terms, wb, m)
                q.quantize(pk, *wire_views(spec, h_out[k * wb:(k + 1) * wb], m))
            cross = [(k, self.at[k, l_me]) for k in range(N) if k != k_me]
            self._exchange("q_reduce_scatter", xp, h_in, [(p, k * wb, wb) for k, p in cross],
                           [(p, k * wb, wb) for k, p in cross], spec, m, tag=4, src=h_out)
            self._sum(q, acc, [(h_out if k == k_me else h_in, k * wb) for k in range(N)], wb, m)
        if op == "avg":
            xp.divide(acc, float(n), out=acc)
        with np.errstate(over="ignore"):                  # fp16 overflow: inf, as the Ring's sum; the scaler skips
            recv[...] = acc
        return recv

    # ---- the parts --------------------------------------------------------
    @staticmethod
    def _sum(q, acc, terms, wb, m):
        """acc = dequant(term 0), then += dequant(term 1), ...: float32, in the order given."""
        for i, (area, s) in enumerate(terms):
            q.dequantize(*wire_views(q.spec, area[s:s + wb], m), acc, add=i > 0)

    def _exchange(self, op, xp, area, sends, recvs, spec, m, tag, src=None, per_msg=1):
        """Post every send (peer, offset, bytes) from src (default area) and recv into area; wait for all.

        per_msg: wire buffers of m elements in each message (their codes / scales split the ledger).
        """
        src = area if src is None else src
        if xp is not np:                                 # device: through pinned host buffers
            sync(src)
            hs = self.staging.host("send", src.nbytes)
            src.get(out=hs)
            hr = self.staging.host("recv", area.nbytes)
            h_src, h_area = hs, hr
        else:
            h_src, h_area = src, area
        c, at, end = spec.wire_layout(m)
        reqs, expect = [], []
        for p, off, nb in recvs:
            reqs.append(self.comm.Irecv([h_area[off:off + nb], MPI.BYTE], p, tag))
            expect.append((p, nb))
        for p, off, nb in sends:
            reqs.append(self.comm.Isend([h_src[off:off + nb], MPI.BYTE], p, tag))
            self.ledger.sent(op, per_msg * at, per_msg * (end - at), self.nodes.crosses(self.rank, p))
        self._wait(op, reqs, expect)
        for _, nb in expect:
            self.ledger.received(op, nb)
        if xp is not np:
            for p, off, nb in recvs:                     # only what arrived: the rest of area is the caller's
                area[off:off + nb].set(h_area[off:off + nb])
            sync(area)

    def _wait(self, op, reqs, expect):
        pr = self.ring._progress
        hurry = pr.hurry if pr is not None and pr.on_worker() else None   # a started call, beside compute
        try:
            wait_messages(op, reqs, expect, self.rank, self.timeout, hurry, self.stall_warn)
        except TimeoutError:
            self._broken = f"{op} timed out on rank {self.rank}"
            raise
        except ValueError:
            self._broken = f"{op} failed on rank {self.rank}"
            raise

    def _check_rs(self, send, recv, op, residual):
        xp = self._check("reduce_scatter", recv, send, len(recv), len(send))
        if op not in ("sum", "avg"):
            raise ValueError(f"quantized reduce_scatter: expected op 'sum' or 'avg', got {op!r}")
        if residual is not None:
            self._check_residual(xp, residual, len(send))
        return xp

    def _buf(self, name, xp, k, dtype):
        """A grow-only scratch array of k elements (xp, dtype), by name (the name first: cupy_names.py reads
        f(xp, "NAME") as getattr(xp, "NAME"))."""
        key = (xp.__name__, name)
        have = self._ws.get(key)
        if have is None or len(have) < k:
            have = xp.empty(max(k, 1), dtype)
            self._ws[key] = have
        return have[:k]

    def _check(self, name, small, big, ls, lb):
        if self._broken:
            raise RuntimeError(f"quantized {name}: this QuantizedComm is out of step after '{self._broken}'; "
                               "HINT: make a new one")
        for what, a in (("send" if name == "all_gather" else "recv", small),
                        ("recv" if name == "all_gather" else "send", big)):
            if not (hasattr(a, "dtype") and hasattr(a, "ndim")):
                raise TypeError(f"quantized {name}: expected {what} to be a NumPy or CuPy array, "
                                f"got {type(a).__name__}")
            if a.dtype.name not in _IN:
                raise TypeError(f"quantized {name}: expected {what} of dtype {', '.join(_IN)}, got {a.dtype}")
            if a.ndim != 1 or not a.flags.c_contiguous:
                raise ValueError(f"quantized {name}: expected {what} 1-D contiguous, got shape {a.shape}")
        if lb != self.size * ls:
            bn, sn = ("recv", "send") if name == "all_gather" else ("send", "recv")
            raise ValueError(f"quantized {name}: expected len({bn}) == {self.size}*len({sn}) = {self.size * ls}, "
                             f"got {lb}")
        return get_array_module(small, big)

    def _check_residual(self, xp, res, L):
        if getattr(res, "dtype", None) != np.float32 or res.ndim != 1 or len(res) != L:
            raise ValueError(f"quantized reduce_scatter: expected residual float32 of shape ({L},), got "
                             f"{getattr(res, 'dtype', type(res).__name__)} shape {getattr(res, 'shape', None)}")
        if get_array_module(res) is not xp:
            raise TypeError("quantized reduce_scatter: expected residual on the same device as send "
                            f"({xp.__name__}), got {type(res).__module__}.{type(res).__name__}")


def _stall_line(op, rank, stalled, expect, stall_warn, timeout):
    """The stall inspector's line (watchdog.py) for a quantized call: its own waits are not the Ring's."""
    ctx = get_context()
    peers = sorted({p for p, _ in expect})
    who = ("rank " if len(peers) == 1 else "ranks ") + ", ".join(map(str, peers))
    say(f"ringzero | rank {rank}: {op} has made no progress for {stalled:.3g} s"
        f"{' at ' + ctx if ctx else ''}, waiting for messages from {who} "
        f"(warning after RINGZERO_STALL_WARN={stall_warn:g} s; error at RINGZERO_TIMEOUT={timeout:g} s)")


def wait_messages(op, reqs, expect, rank, timeout, hurry=None, stall_warn=0.0):
    """Wait for every request of one quantized call; ``expect`` [(peer, bytes)] of its receives, in order.

    On the caller's thread: spin (yielding the core: ranks may share it), then nap. On the progress
    thread beside compute (``hurry`` not set): test and nap, cut short once the caller waits, as
    executor.py's runs do. After ``stall_warn`` s (0: never) one line to stderr, as the Ring's stall
    inspector prints for its own calls; TimeoutError after ``timeout`` s (0: none), ValueError for a
    message of another length: one line each, naming the op and the peers."""
    statuses = [MPI.Status() for _ in reqs]
    start = time.monotonic()
    deadline = start + timeout if timeout > 0 else None
    warn_at = start + stall_warn if 0 < stall_warn and (deadline is None or stall_warn < timeout) else None
    nap, spins = 5e-5, 0
    try:
        while not MPI.Request.Testall(reqs, statuses):
            now = time.monotonic()
            if warn_at is not None and now > warn_at:
                warn_at = None
                _stall_line(op, rank, now - start, expect, stall_warn, timeout)
            late = deadline is not None and now > deadline
            if hurry is not None and not hurry.is_set() and not late:
                hurry.wait(nap)
                nap = min(2 * nap, 2e-3)
                continue
            if spins < 2000 and not late:
                spins += 1
                os.sched_yield()
                continue
            if late:
                for rq in reqs:
                    rq.Cancel()
                peers = ", ".join(str(p) for p, _ in expect)
                raise TimeoutError(f"quantized {op} on rank {rank}: no message within {timeout:g} s "
                                   f"from ranks {peers}; HINT: every rank must make the same calls")
            time.sleep(nap)
            nap = min(2 * nap, 1e-3)
    except MPI.Exception as e:                        # a longer message than posted: truncated
        raise ValueError(f"quantized {op} on rank {rank}: {e.Get_error_string()}; "
                         "HINT: every rank must pass the same lengths") from None
    for (p, nb), st in zip(expect, statuses):
        got = st.Get_count(MPI.BYTE)
        if got != nb:
            raise ValueError(f"quantized {op} on rank {rank}: expected {nb} bytes from rank {p}, got {got}; "
                             "HINT: every rank must pass the same lengths")
