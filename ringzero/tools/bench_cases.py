"""The bench's cases: one op's buffers at one size, the calls that run the Ring and MPI on them, the check.

What it is
    ``Case(op, ring, comm, xp, dtype, count, mpi_staged)`` lays out the
    buffers of one op as every bench word uses them (all_reduce in place on
    ``a``; reduce_scatter ``a`` -> ``b``; all_gather ``a`` -> ``b``), with
    ``case.ring()`` and ``case.mpi()`` running the hand-written Ring and the
    MPI library's collective on them, and ``case.check`` counting the wrong
    elements after one run on integer-valued data (exact sums in any order).
    ``ring_call`` / ``mpi_call`` are the op -> call mapping written once
    (also used by the benchmarks). ``bench_dtype`` reads a dtype name,
    bfloat16 included.

What it is not
    No timing (bench_timing.py) and no printing (bench.py, bench_extra.py).
"""
from __future__ import annotations

import numpy as np

OP_NAMES = ("all_reduce", "reduce_scatter", "all_gather")


def bench_dtype(name):
    """np.dtype(name); 'bfloat16' is ml_dtypes' (the bf16 extra)."""
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def fill(xp, out, rank, seed):
    """Integer-valued data in [-6, 6], reproducible on any rank from (rank, seed)."""
    i = np.arange(len(out), dtype=np.int64)
    host = ((i * 7 + rank * 5 + seed) % 13 - 6).astype(out.dtype)
    out[...] = xp.asarray(host) if xp is not np else host


def expect(n, count, seed):
    """Sum over ranks of fill's data, in int64 (exact), for the check."""
    i = np.arange(count, dtype=np.int64)
    return sum((i * 7 + r * 5 + seed) % 13 - 6 for r in range(n))


def ring_call(op, ring, a, b):
    """fn() running `op` of `ring` on (a, b) as the bench lays them out: all_reduce in
    place on a (b is a), reduce_scatter a -> b, all_gather a -> b."""
    return {"all_reduce": lambda: ring.all_reduce(a), "reduce_scatter": lambda: ring.reduce_scatter(a, b),
            "all_gather": lambda: ring.all_gather(a, b)}[op]


def mpi_call(op, comm, a, b):
    """fn() running the MPI library's collective for `op` on the same layout as ring_call."""
    from mpi4py import MPI
    return {"all_reduce": lambda: comm.Allreduce(MPI.IN_PLACE, b, MPI.SUM),
            "reduce_scatter": lambda: comm.Reduce_scatter_block(a, b, MPI.SUM),
            "all_gather": lambda: comm.Allgather(a, b)}[op]


class Case:
    """Buffers for one op and size, and closures that run the ring / MPI on them.

    Like with like: both sides start and end with their data in ``a``/``b``
    (device arrays for --device cuda). When MPI is not CUDA-aware (staged),
    the MPI side pays what the Ring pays: device->pinned host copy, the MPI
    collective on the pinned buffers, host->device copy.
    """

    def __init__(self, op, ring, comm, xp, dtype, count, mpi_staged):
        n = comm.size
        self.op, self.count = op, count
        if op == "all_reduce":
            self.a = xp.zeros(count, dtype)
            self.b = self.a
        elif op == "reduce_scatter":
            self.a, self.b = xp.zeros(count, dtype), xp.zeros(count // n, dtype)
        else:
            self.a, self.b = xp.zeros(count // n, dtype), xp.zeros(count, dtype)
        self.ring = ring_call(op, ring, self.a, self.b)
        self.mpi = self._mpi_fn(op, comm, xp, dtype, mpi_staged)

    def _mpi_fn(self, op, comm, xp, dtype, mpi_staged):
        if mpi_staged:  # pinned host buffers, made once (grow-only, like the Ring's)
            from ringzero.comm.backend import Staging
            st = Staging()
            ma = st.host("a", self.a.nbytes).view(dtype)
            mb = ma if op == "all_reduce" else st.host("b", self.b.nbytes).view(dtype)
        else:
            ma, mb = self.a, self.b
        coll = mpi_call(op, comm, ma, mb)
        if mpi_staged:
            stream = xp.cuda.get_current_stream()

            def mpi_fn():
                self.a.get(out=ma)   # device -> pinned host (blocking)
                coll()
                self.b.set(mb)       # pinned host -> device
                stream.synchronize()
            return mpi_fn
        if xp is not np:
            stream = xp.cuda.get_current_stream()

            def mpi_fn():
                stream.synchronize()  # CUDA-aware MPI reads the device buffer: producers done
                coll()
            return mpi_fn
        return coll

    def check(self, which, comm, xp, seed):
        """Wrong elements of this rank after one run of `which` on fresh data."""
        n, r = comm.size, comm.rank
        a, b = self.a, self.b
        fill(xp, a, r, seed)
        (self.ring if which == "ring" else self.mpi)()
        got = np.asarray(b.get() if xp is not np else b).astype(np.int64)
        m = self.count // n
        if self.op == "all_reduce":
            want = expect(n, self.count, seed)
        elif self.op == "reduce_scatter":
            want = expect(n, self.count, seed)[r * m:(r + 1) * m]
        else:
            i = np.arange(m, dtype=np.int64)
            want = np.concatenate([(i * 7 + k * 5 + seed) % 13 - 6 for k in range(n)])
        wrong = int(np.count_nonzero(got != want))
        a[...] = 0  # timing runs on zeros: sums never overflow
        return wrong
