"""Hand-written reduce-scatter, all-gather and all-reduce on MPI point-to-point.

What it is
    ``Ring(comm)`` over any mpi4py intracommunicator:

        ring.all_reduce(buf, op="sum")             # in place, any len >= 0
        ring.reduce_scatter(send, recv, op="sum")  # len(send) == n*len(recv)
        ring.all_gather(send, recv)                # len(recv) == n*len(send)
        ring.ledger["all_reduce"]["bytes_sent"]    # what this rank put on the wire

    Only Isend/Irecv move data (a Ring never calls an MPI collective after its
    constructor's Dup). The schedule is chosen by S = the whole array in bytes
    (len(buf), len(send) for RS, len(recv) for AG, times the itemsize):

    ring (n not a power of two, or S > tree_bytes)
        The buffer is cut into n blocks; block i holds L//n elements, plus one
        for i < L % n. Reduce-scatter: at step s = 0..n-2 rank r sends block
        (r-s-1) % n to its right and adds what it gets from its left into block
        (r-s-2) % n, so rank r ends owning block r. All-gather: at step s rank r
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
        all-reduce is the two in place (Rabenseifner) when n divides L, and,
        when S <= small_bytes too, recursive doubling over the whole buffer in
        the halving order (r ^ n/2 first): log2 n steps, S * log2 n bytes sent.
        An all-reduce whose L is not a multiple of n and S > small_bytes takes
        the ring.

    Composition contract: for L divisible by n, all_reduce is bitwise equal to
    reduce_scatter followed by all_gather. The ring all-reduce *is* the ring RS
    then the ring AG, Rabenseifner *is* halving then doubling, and recursive
    doubling pairs ranks in the halving order, so every element is summed over
    the same tree in all three; the choice depends only on S, which is the
    same for both calls. Sums are deterministic and bitwise equal on every
    rank: each element is reduced in a fixed order (adds commute bitwise).
    float16 hops add in float32 and round once (ringzero.comm.kernels.add_f16).
    "avg" divides the finished sum by n (float16: in float32, one rounding).

    Errors: bad arguments raise before any message. A received count that
    differs from the expected one raises ValueError on the rank that sees it;
    a peer that does not arrive within ``timeout`` (RINGZERO_TIMEOUT) raises
    TimeoutError naming the op and the peer. After either, the Ring refuses
    further calls (its message stream is out of step): make a new one.

What it is not
    A general MPI: no other ops, no strides, no datatypes but the ones listed.
    CuPy arrays go straight to MPI when it is CUDA-aware (backend.cuda_aware()),
    otherwise through grow-only pinned host buffers with the reduction on host.
"""
from __future__ import annotations

import os
import time

import numpy as np
from mpi4py import MPI

from ringzero.comm import kernels
from ringzero.comm.backend import Staging, cuda_aware, get_array_module, sync

DTYPES = [np.dtype(t) for t in ("float16", "float32", "float64", "int32", "int64")]
try:  # bfloat16 where ml_dtypes provides it
    import ml_dtypes
    DTYPES.append(np.dtype(ml_dtypes.bfloat16))
except ImportError:
    pass

OPS = ("all_reduce", "reduce_scatter", "all_gather")
# Measured with `python -m ringzero.bench`, see docs/collectives.md.
SMALL_BYTES = 256 * 1024   # all_reduce at or below: recursive doubling (power-of-two n)
TREE_BYTES = 16 << 20      # at or below: halving/doubling (power-of-two n); above: the ring
SEG_BYTES = 1 << 20
_F16 = np.dtype(np.float16)
# Tests before the poll loop starts yielding (tens of µs): a short spin catches a
# peer that is about to answer without handing the core to another process for a
# whole time slice; after it, sched_yield lets the rank with work run.
_SPIN = int(os.environ.get("RINGZERO_SPIN", 100))


class Ledger:
    """Cumulative per-op counters of this rank: bytes_sent, bytes_recv, messages, calls."""

    def __init__(self):
        self.reset()

    def reset(self):
        self._d = {op: dict(bytes_sent=0, bytes_recv=0, messages=0, calls=0) for op in OPS}

    def __getitem__(self, op):
        return self._d[op]

    def total_sent(self) -> int:
        return sum(v["bytes_sent"] for v in self._d.values())

    def as_dict(self) -> dict:
        return {op: dict(v) for op, v in self._d.items()}


def _addr(x) -> int:
    return x.ctypes.data if isinstance(x, np.ndarray) else x.data.ptr


def blocks(length: int, n: int) -> list:
    """Block offsets (n+1 of them) of a length-L buffer cut for the ring."""
    q, rem = divmod(length, n)
    return [i * q + min(i, rem) for i in range(n + 1)]


class Ring:
    """Ring and latency-optimal collectives over `comm` (see the module docstring)."""

    def __init__(self, comm, timeout: float | None = None):
        self.comm = comm.Dup()  # our own message space: user traffic can't match ours
        self.rank, self.size = self.comm.rank, self.comm.size
        self.left, self.right = (self.rank - 1) % self.size, (self.rank + 1) % self.size
        self.timeout = float(os.environ.get("RINGZERO_TIMEOUT", 600)) if timeout is None else float(timeout)
        self.small_bytes = int(os.environ.get("RINGZERO_SMALL_BYTES", SMALL_BYTES))
        self.tree_bytes = int(os.environ.get("RINGZERO_TREE_BYTES", TREE_BYTES))
        self.seg_bytes = max(64, int(os.environ.get("RINGZERO_SEG_BYTES", SEG_BYTES)))
        self.pow2 = self.size & (self.size - 1) == 0
        self.ledger = Ledger()
        self.scratch_growths = 0
        self._scratch = {}       # module name -> [uint8 array, uint8 array], grow-only
        self.staging = Staging()
        self._cuda_aware = None
        self._status = MPI.Status()
        self._seq = 0            # call counter: in every tag, so ranks out of step never match
        self._broken = None
        self._orphans = []       # requests abandoned after an error (kept alive with their buffers)
        self._led = None

    def free(self):
        self.comm.Free()

    # ---- public ops ------------------------------------------------------
    def all_reduce(self, buf, op: str = "sum"):
        xp = self._check("all_reduce", buf, buf, op)
        if xp is not np and not self._device_direct():
            return self._staged("all_reduce", buf, buf, op)
        self._begin("all_reduce", buf)
        L, n = len(buf), self.size
        if n > 1 and L > 0:
            tree = self._tree(buf.nbytes)
            if tree and buf.nbytes <= self.small_bytes:
                self._rd_allreduce(xp, buf)
            elif tree and L % n == 0:  # Rabenseifner: halving RS then doubling AG, in place
                m = L // n
                self._halving_rs(xp, buf, buf[self.rank * m:(self.rank + 1) * m])
                self._doubling_ag(buf, m)
            else:
                off = blocks(L, n)
                mine = buf[off[self.rank]:off[self.rank + 1]]
                self._ring_rs(xp, buf, mine, off, 0)
                self._ring_ag(buf, off, 1)
        if op == "avg":
            self._avg(xp, buf)
        return buf

    def reduce_scatter(self, send, recv, op: str = "sum"):
        xp = self._check("reduce_scatter", send, recv, op)
        if xp is not np and not self._device_direct():
            return self._staged("reduce_scatter", send, recv, op)
        self._begin("reduce_scatter", send)
        m, n = len(recv), self.size
        if n == 1 or m == 0:
            if _addr(send) != _addr(recv) and m:
                recv[...] = send
        elif self._tree(send.nbytes):
            self._halving_rs(xp, send, recv)
        else:
            self._ring_rs(xp, send, recv, blocks(len(send), n), 0)
        if op == "avg":
            self._avg(xp, recv)
        return recv

    def all_gather(self, send, recv):
        xp = self._check("all_gather", send, recv, "sum")
        if xp is not np and not self._device_direct():
            return self._staged("all_gather", send, recv, "sum")
        self._begin("all_gather", send)
        m, n = len(send), self.size
        mine = recv[self.rank * m:(self.rank + 1) * m]
        if m and _addr(send) != _addr(mine):  # not in place: one local copy
            mine[...] = send
            sync(mine)
        if n > 1 and m:
            if self._tree(recv.nbytes):
                self._doubling_ag(recv, m)
            else:
                self._ring_ag(recv, blocks(len(recv), n), 0)
        return recv

    # ---- checks (all before any message) ---------------------------------
    def _check(self, name, send, recv, op):
        if self._broken:
            raise RuntimeError(f"ring {name}: this Ring is unusable after an earlier error ({self._broken}); "
                               "HINT: make a new Ring")
        for what, a in (("send", send), ("recv", recv)):
            if not (hasattr(a, "dtype") and hasattr(a, "flags") and hasattr(a, "ndim")):
                raise TypeError(f"ring {name}: expected {what} to be a NumPy or CuPy array, got {type(a).__name__}")
        xp = get_array_module(send, recv)
        for what, a in (("send", send), ("recv", recv)):
            if a.ndim != 1:
                raise ValueError(f"ring {name}: expected 1-D {what}, got shape {a.shape}")
            if not a.flags.c_contiguous:
                raise ValueError(f"ring {name}: expected contiguous {what}, got strides {a.strides} "
                                 f"(itemsize {a.itemsize}); HINT: pass a slice of a flat buffer")
        if send.dtype != recv.dtype:
            raise TypeError(f"ring {name}: expected send and recv of one dtype, got {send.dtype} and {recv.dtype}")
        if send.dtype not in DTYPES:
            raise TypeError(f"ring {name}: expected dtype in {[str(d) for d in DTYPES]}, got {send.dtype}")
        if isinstance(recv, np.ndarray) and not recv.flags.writeable:   # CuPy's flags have no writeable
            raise ValueError(f"ring {name}: expected a writeable {'buf' if send is recv else 'recv'}")
        if op not in ("sum", "avg"):
            raise ValueError(f"ring {name}: expected op 'sum' or 'avg', got {op!r}")
        if op == "avg" and send.dtype.kind in "iu":
            raise TypeError(f"ring {name}: op 'avg' needs a floating dtype, got {send.dtype}")
        n = self.size
        if name == "reduce_scatter":
            big, small, bigname = send, recv, "send"
        elif name == "all_gather":
            big, small, bigname = recv, send, "recv"
        else:
            return xp
        if len(big) != n * len(small):
            other = "recv" if bigname == "send" else "send"
            raise ValueError(f"ring {name}: expected len({bigname}) == {n}*len({other}) = {n * len(small)}, "
                             f"got {len(big)}")
        # recv may alias send only as block `rank` of the big one (in place).
        b0, s0 = _addr(big), _addr(small)
        if len(small) and s0 < b0 + big.nbytes and b0 < s0 + small.nbytes \
                and s0 != b0 + self.rank * small.nbytes:
            raise ValueError(f"ring {name}: send and recv overlap other than in place; expected the small one at "
                             f"byte {self.rank * small.nbytes} of the big one, got byte {s0 - b0}")
        return xp

    # ---- plumbing ----------------------------------------------------------
    def _begin(self, name, x):
        sync(x)  # a CuPy producer must be done before MPI reads the buffer
        self._seq = (self._seq + 1) & 0x1FFF
        self._led = self.ledger[name]
        self._led["calls"] += 1
        self._name = name

    def _tree(self, nbytes):
        """Halving/doubling (log2 n steps) rather than the ring (n-1 steps)?"""
        return self.pow2 and nbytes <= self.tree_bytes

    def _tag(self, phase):
        return (self._seq << 2) | phase

    def _scr(self, xp, nbytes):
        """Two grow-only scratch buffers of >= nbytes each (uint8)."""
        key = xp.__name__
        have = self._scratch.get(key)
        if have is None or have[0].nbytes < nbytes:
            cap = -(-max(nbytes, 2 * have[0].nbytes if have else 0, 4096) // 64) * 64  # any itemsize divides it
            self._scratch[key] = have = [xp.empty(cap, xp.uint8), xp.empty(cap, xp.uint8)]
            self.scratch_growths += 1
        return have

    def _isend(self, x, peer, tag):
        self._led["bytes_sent"] += x.nbytes
        self._led["messages"] += 1
        return self.comm.Isend([x, MPI.BYTE], peer, tag)

    def _irecv(self, x, peer, tag):
        self._led["bytes_recv"] += x.nbytes
        return self.comm.Irecv([x, MPI.BYTE], peer, tag)

    def _wait(self, req, peer, nbytes=-1, pending=()):
        """Poll `req` to completion, yielding the CPU; raise on timeout or a wrong count."""
        st = self._status
        try:
            done = req.Test(st)
            i, deadline = 0, None
            while not done:
                if i >= _SPIN:
                    os.sched_yield()  # ranks share cores: let the one with work run
                i += 1
                if not i & 127:
                    now = time.monotonic()
                    if deadline is None:
                        deadline = now + self.timeout
                    elif now > deadline:
                        self._fail(pending, req)
                        what = "a message from" if nbytes >= 0 else "a send to be taken by"
                        raise TimeoutError(f"ring {self._name}: rank {self.rank} waited {self.timeout:g} s for "
                                           f"{what} rank {peer}; is rank {peer} in the same call? "
                                           "(RINGZERO_TIMEOUT sets the limit)")
                done = req.Test(st)
        except MPI.Exception as e:  # e.g. MPI_ERR_TRUNCATE: the peer sent more than we expect
            self._fail(pending, req)
            raise ValueError(f"ring {self._name}: rank {self.rank} expected {nbytes} bytes from rank {peer}, "
                             f"got more ({e.Get_error_string()}); HINT: do all ranks pass the same length?") from None
        if nbytes >= 0:
            got = st.Get_count(MPI.BYTE)
            if got != nbytes:
                self._fail(pending, None)
                raise ValueError(f"ring {self._name}: rank {self.rank} expected {nbytes} bytes from rank {peer}, "
                                 f"got {got}; HINT: do all ranks pass the same length?")

    def _fail(self, pending, req):
        self._broken = f"{self._name} failed on rank {self.rank}"
        for r in [q for group in pending for q in group] + [req]:
            if r is not None and r != MPI.REQUEST_NULL:
                try:
                    r.Cancel()
                except MPI.Exception:
                    pass
                self._orphans.append(r)

    def _waitall(self, reqs, peer):
        for q in reqs:
            self._wait(q, peer, -1, (reqs,))

    def _add(self, xp, a, b, out):
        """out = a + b; float16 widened to float32 and rounded once."""
        if a.dtype == _F16:
            if xp is np and kernels._c is not None:
                kernels._c.add_f16(a, b, out)
            else:
                kernels.add_f16(a, b, out)
        else:
            xp.add(a, b, out=out)
        if xp is not np:
            sync(out)  # the next thing done with `out` may be MPI

    def _avg(self, xp, x):
        if len(x):
            with np.errstate(over="ignore", invalid="ignore"):
                xp.divide(x, self.size, out=x)  # float16: NumPy divides in float32, rounds once
            sync(x)

    def _segs(self, length, itemsize):
        seg = max(1, self.seg_bytes // itemsize)
        return [(a, min(a + seg, length)) for a in range(0, length, seg)]

    # ---- ring schedule -----------------------------------------------------
    def _ring_rs(self, xp, src, out, off, phase):
        """Block `rank` of the sum over ranks of src (cut at `off`) into out."""
        n, r, tag = self.size, self.rank, self._tag(phase)
        isz = src.itemsize
        bmax = max(off[i + 1] - off[i] for i in range(n))
        t0, t1 = self._scr(xp, bmax * isz)
        tmp = (t0.view(src.dtype), t1.view(src.dtype))
        b = (r - 1) % n
        sends = [self._isend(src[off[b] + a:off[b] + e], self.right, tag) for a, e in self._segs(off[b + 1] - off[b], isz)]
        for s in range(n - 1):
            bi = (r - s - 2) % n
            lo, length = off[bi], off[bi + 1] - off[bi]
            buf = tmp[s & 1][:length]
            last = s == n - 2
            dst = out if last else buf
            segs = self._segs(length, isz)
            recvs = [self._irecv(buf[a:e], self.left, tag) for a, e in segs]
            nxt = []
            for (a, e), q in zip(segs, recvs):
                self._wait(q, self.left, (e - a) * isz, (recvs, sends, nxt))
                self._add(xp, buf[a:e], src[lo + a:lo + e], dst[a:e])
                if not last:  # forward this segment now: it overlaps the next add
                    nxt.append(self._isend(dst[a:e], self.right, tag))
            self._waitall(sends, self.right)
            sends = nxt

    def _ring_ag(self, buf, off, phase):
        """Every block of buf from its owner (block i from rank i), in place."""
        n, r, tag, isz = self.size, self.rank, self._tag(phase), buf.itemsize
        lo, hi = off[r], off[r + 1]
        sends = [self._isend(buf[lo + a:lo + e], self.right, tag) for a, e in self._segs(hi - lo, isz)]
        for s in range(n - 1):
            bi = (r - s - 1) % n
            lo, length = off[bi], off[bi + 1] - off[bi]
            segs = self._segs(length, isz)
            recvs = [self._irecv(buf[lo + a:lo + e], self.left, tag) for a, e in segs]
            nxt = []
            for (a, e), q in zip(segs, recvs):
                self._wait(q, self.left, (e - a) * isz, (recvs, sends, nxt))
                if s < n - 2:
                    nxt.append(self._isend(buf[lo + a:lo + e], self.right, tag))
            self._waitall(sends, self.right)
            sends = nxt

    # ---- latency schedule (n a power of two) --------------------------------
    def _exchange(self, sendbuf, recvbuf, peer, tag):
        rq = self._irecv(recvbuf, peer, tag)
        sq = self._isend(sendbuf, peer, tag)
        self._wait(rq, peer, recvbuf.nbytes, ((sq,),))
        self._wait(sq, peer, -1, ())

    def _rd_allreduce(self, xp, buf):
        """Recursive doubling, partners r^(n/2), r^(n/4), ..., r^1: the halving RS's tree."""
        tag = self._tag(0)
        t0, _ = self._scr(xp, buf.nbytes)
        tmp = t0.view(buf.dtype)[:len(buf)]
        d = self.size >> 1
        while d:
            self._exchange(buf, tmp, self.rank ^ d, tag)
            self._add(xp, buf, tmp, buf)
            d >>= 1

    def _halving_rs(self, xp, send, recv):
        """Recursive halving: keep the half of the blocks whose bit d matches ours."""
        n, r, m, tag = self.size, self.rank, len(recv), self._tag(0)
        t0, t1 = self._scr(xp, send.nbytes // 2)
        acc, tmp = t0.view(send.dtype), t1.view(send.dtype)
        lo, hi, d, cur = 0, n, n >> 1, send  # cur holds blocks [lo, hi) from its offset 0
        while d:
            mid = (lo + hi) // 2
            keep, give = ((mid, hi), (lo, mid)) if r & d else ((lo, mid), (mid, hi))
            h = (hi - lo) // 2 * m
            ks, gs = (keep[0] - lo) * m, (give[0] - lo) * m  # offsets inside cur
            self._exchange(cur[gs:gs + h], tmp[:h], r ^ d, tag)
            dst = recv if d == 1 else acc[:h]
            self._add(xp, cur[ks:ks + h], tmp[:h], dst)
            cur, (lo, hi), d = dst, keep, d >> 1

    def _doubling_ag(self, recv, m):
        """Recursive doubling: swap the 2^k blocks we hold with partner r^(2^k)."""
        r, d, tag = self.rank, 1, self._tag(0)
        while d < self.size:
            mine, theirs = (r & ~(d - 1)) * m, ((r ^ d) & ~(d - 1)) * m
            self._exchange(recv[mine:mine + d * m], recv[theirs:theirs + d * m], r ^ d, tag)
            d <<= 1

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
