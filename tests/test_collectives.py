"""Ring collectives against independent references.

References: every rank regenerates every other rank's data from its seed and
sums it with NumPy (in float64 for integer-valued data, exact), the MPI
library's own Allreduce / Reduce_scatter_block / Allgather, and for float16 a
NumPy replay of the documented summation order. Run under mpirun at 1, 2, 3,
4 and 8 ranks (launch/test); the unmarked tests run serially.
"""
import os

import numpy as np
import pytest
from conftest import assert_all, have_cupy

from ringzero.comm.ring import DTYPES, Ring, blocks

FLOATS = ("float16", "float32", "float64")
ALL_DT = [d.name for d in DTYPES]
try:
    import ml_dtypes  # noqa: F401  (registers "bfloat16" with NumPy; the Ring takes it too)
    ALL_DT.append("bfloat16")
except ImportError:
    pass


def data(rank, L, dtype, seed=0, ints=True):
    """Rank `rank`'s data, reproducible anywhere. Integers in [-8, 8] are exact in every dtype's sums."""
    rng = np.random.default_rng(1000 * seed + rank)
    if ints:
        return rng.integers(-8, 9, L).astype(dtype)
    return (rng.standard_normal(L) * 3).astype(dtype)


def exact_sum(n, L, dtype, seed=0):
    return np.sum([data(r, L, dtype, seed).astype(np.float64) for r in range(n)], axis=0)


def lengths(n):
    return sorted({0, 1, max(n - 1, 0), n, n + 1, 7, 13, 31, 97, 4099})


# (small_bytes, tree_bytes, direct_bytes, latency_bytes) forcing each schedule: the ring;
# recursive doubling all-reduce with halving RS / doubling AG; Rabenseifner all-reduce
# (halving + doubling); direct RS and AG (3 <= n <= 16; n = 2 falls back to the tree), with
# the all-reduce direct too where n is not a power of two and Rabenseifner where it is
SCHEDULES = {"ring": (0, 0, 0, 0), "latency": (1 << 40, 1 << 40, 0, 0), "tree": (0, 1 << 40, 0, 0),
             "direct": (0, 1 << 40, 1 << 40, 0)}


def tree_order(schedule, n):
    """Does `schedule` (forced as above) add in the halving tree's order at n ranks?"""
    return schedule != "ring" and n & (n - 1) == 0


def force(ring, schedule):
    ring.small_bytes, ring.tree_bytes, ring.direct_bytes, ring.latency_bytes = SCHEDULES[schedule]
    return ring


@pytest.fixture(params=list(SCHEDULES))
def ring(request, comm):
    r = force(Ring(comm), request.param)
    yield r
    r.free()


# ---- results against NumPy and MPI ---------------------------------------

@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ALL_DT)
def test_all_reduce_sum_and_avg(comm, ring, dtype):
    n, r = comm.size, comm.rank
    bad = []
    for L in lengths(n):
        x = data(r, L, dtype)
        ring.all_reduce(x)
        want = exact_sum(n, L, dtype)
        if not np.array_equal(x.astype(np.float64), want):
            bad.append(f"sum L={L}")
        if dtype in FLOATS + ("bfloat16",):
            y = data(r, L, dtype)
            ring.all_reduce(y, op="avg")
            ref = (exact_sum(n, L, dtype).astype(dtype) / np.asarray(n, dtype)).astype(dtype)
            if not np.array_equal(y, ref):
                bad.append(f"avg L={L}")
    assert_all(comm, not bad, f"{dtype}: {bad}")


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64"])
def test_against_mpi_library(comm, ring, dtype):
    from mpi4py import MPI
    n, r = comm.size, comm.rank
    bad = []
    for m in (0, 1, 5, 1031):
        x = data(r, n * m, dtype, seed=3)
        a, b = x.copy(), x.copy()
        ring.all_reduce(a)
        comm.Allreduce(MPI.IN_PLACE, b, MPI.SUM)
        rs_a, rs_b = np.empty(m, dtype), np.empty(m, dtype)
        ring.reduce_scatter(x, rs_a)
        comm.Reduce_scatter_block(x, rs_b, MPI.SUM)
        ag_a, ag_b = np.empty(n * m, dtype), np.empty(n * m, dtype)
        ring.all_gather(x[:m], ag_a)
        comm.Allgather(x[:m], ag_b)
        for what, u, v in (("AR", a, b), ("RS", rs_a, rs_b), ("AG", ag_a, ag_b)):
            if not np.array_equal(u, v):
                bad.append(f"{what} m={m}")
    assert_all(comm, not bad, f"{dtype}: {bad}")


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ALL_DT)
def test_reduce_scatter_and_all_gather(comm, ring, dtype):
    n, r = comm.size, comm.rank
    bad = []
    for m in (0, 1, 2, 3, 17, 1025):
        L = n * m
        send = data(r, L, dtype, seed=1)
        keep = send.copy()
        recv = np.full(m, 99, dtype)
        ring.reduce_scatter(send, recv)
        if not np.array_equal(recv.astype(np.float64), exact_sum(n, L, dtype, seed=1)[r * m:(r + 1) * m]):
            bad.append(f"RS m={m}")
        if not np.array_equal(send, keep):
            bad.append(f"RS changed send m={m}")
        # in place: recv is block `rank` of send
        ip = send.copy()
        ring.reduce_scatter(ip, ip[r * m:(r + 1) * m])
        if not np.array_equal(ip[r * m:(r + 1) * m], recv):
            bad.append(f"RS in place m={m}")
        # all-gather, separate and in place
        mine = data(r, m, dtype, seed=2)
        want = np.concatenate([data(k, m, dtype, seed=2) for k in range(n)])
        out = np.zeros(L, dtype)
        ring.all_gather(mine, out)
        if not np.array_equal(out, want):
            bad.append(f"AG m={m}")
        full = np.zeros(L, dtype)
        full[r * m:(r + 1) * m] = mine
        ring.all_gather(full[r * m:(r + 1) * m], full)
        if not np.array_equal(full, want):
            bad.append(f"AG in place m={m}")
    assert_all(comm, not bad, f"{dtype}: {bad}")


@pytest.mark.mpi
def test_large_and_pipelined(comm):
    """A large length with several segments per step (seg_bytes made small)."""
    n, r = comm.size, comm.rank
    ring = Ring(comm)
    ring.seg_bytes = 4096
    L = n * 20011 + 3
    x = data(r, L, "float32", seed=5)
    ring.all_reduce(x)
    ok = np.array_equal(x.astype(np.float64), exact_sum(n, L, "float32", seed=5))
    ring.free()
    assert_all(comm, ok, "large all_reduce differs from the NumPy sum")


def _replay_f16(n, L, seed, schedule):
    """The float16 sum as documented: one float32 add and one rounding per hop (NumPy's float16 add)."""
    xs = [data(k, L, "float16", seed, ints=False) for k in range(n)]
    if tree_order(schedule, n):  # recursive doubling, halving, direct at 2^k: the same pairing, r^(n/2) first
        vals = list(xs)
        d = n >> 1
        while d:
            vals = [vals[k] + vals[k ^ d] for k in range(n)]
            d >>= 1
        return vals[0]
    out = np.empty(L, np.float16)
    off = blocks(L, n)
    for b in range(n):  # block b is summed from rank b+1 round to rank b
        acc = xs[(b + 1) % n][off[b]:off[b + 1]].copy()
        for k in range(2, n + 1):
            acc = acc + xs[(b + k) % n][off[b]:off[b + 1]]
        out[off[b]:off[b + 1]] = acc
    return out


@pytest.mark.mpi
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_float16_order_and_determinism(comm, schedule):
    n, r = comm.size, comm.rank
    if schedule not in ("ring", "direct") and n & (n - 1):
        pytest.skip(f"latency schedule needs a power-of-two size, have {n}")
    ring = force(Ring(comm), schedule)
    L = {"ring": 3001, "latency": 8 * n + 5, "tree": 375 * n, "direct": 1001 * n}[schedule]
    x = data(r, L, "float16", 7, ints=False)
    ring.all_reduce(x)
    want = _replay_f16(n, L, 7, schedule)
    ok = np.array_equal(x.view(np.uint16), want.view(np.uint16))
    same = len(set(comm.allgather(x.tobytes()))) == 1
    ring.free()
    assert_all(comm, ok and same, f"float16 {schedule}: equal to replay {ok}, same on all ranks {same}")


@pytest.mark.mpi
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_float16_reduce_scatter_order(comm, schedule):
    """The reduce-scatter adds in the order its all-reduce does (replayed here in NumPy):
    at 2^k ranks the direct one replays the halving tree on the blocks it received."""
    n, r = comm.size, comm.rank
    if schedule != "ring" and schedule != "direct" and n & (n - 1):
        pytest.skip(f"latency schedule needs a power-of-two size, have {n}")
    ring = force(Ring(comm), schedule)
    m = 1001
    x = data(r, n * m, "float16", 9, ints=False)
    got = ring.reduce_scatter(x, np.empty(m, np.float16))
    want = _replay_f16(n, n * m, 9, schedule)[r * m:(r + 1) * m]
    ok = np.array_equal(got.view(np.uint16), want.view(np.uint16))
    ring.free()
    assert_all(comm, ok, f"float16 reduce_scatter {schedule}: differs from the replayed order")


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("m", [1, 3, 64, 2049, 70001])
@pytest.mark.parametrize("schedule", ["default"] + list(SCHEDULES))
def test_composition_contract(comm, dtype, m, schedule):
    """all_reduce == reduce_scatter then all_gather, bitwise: default choice and each forced schedule."""
    n, r = comm.size, comm.rank
    ring = Ring(comm) if schedule == "default" else force(Ring(comm), schedule)
    x = data(r, n * m, dtype, seed=11, ints=False)
    a = x.copy()
    ring.all_reduce(a)
    part = np.empty(m, dtype)
    ring.reduce_scatter(x, part)
    b = np.empty(n * m, dtype)
    ring.all_gather(part, b)
    ok = np.array_equal(a.view(np.uint8), b.view(np.uint8))
    ring.free()
    assert_all(comm, ok, f"{dtype} m={m}: all_reduce != all_gather(reduce_scatter)")


@pytest.mark.mpi
def test_split_communicator(comm):
    n, r = comm.size, comm.rank
    sub = comm.Split(color=r % 2, key=r)
    ring = Ring(sub)
    L = 3 * sub.size + 2
    x = data(r, L, "float64")
    ring.all_reduce(x)
    members = [k for k in range(n) if k % 2 == r % 2]
    want = np.sum([data(k, L, "float64") for k in members], axis=0)
    ok = np.array_equal(x, want) and ring.size == len(members)
    ring.free()
    sub.Free()
    assert_all(comm, ok, "all_reduce over a split communicator")


def _expect_failure(comm, call, want_one_of):
    try:
        call()
        return "no error"
    except want_one_of as e:
        return e
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


# ---- serial ---------------------------------------------------------------

def test_blocks_split():
    for L in range(0, 40):
        for n in range(1, 9):
            off = blocks(L, n)
            sizes = np.diff(off)
            assert off[0] == 0 and off[-1] == L
            assert sizes.max() - sizes.min() <= 1
            assert list(sizes) == sorted(sizes, reverse=True)  # the longer blocks come first


def test_comm_self_is_identity():
    from mpi4py import MPI
    ring = Ring(MPI.COMM_SELF)
    x = np.arange(5, dtype=np.float32)
    ring.all_reduce(x, op="avg")
    out = np.zeros(5, np.float32)
    ring.all_gather(x, out)
    rs = np.zeros(5, np.float32)
    ring.reduce_scatter(x, rs)
    assert np.array_equal(x, np.arange(5)) and np.array_equal(out, x) and np.array_equal(rs, x)
    assert ring.ledger.total_sent() == 0 and ring.ledger["all_reduce"]["calls"] == 1
    ring.ledger.reset()
    assert ring.ledger["all_reduce"]["calls"] == 0
    ring.free()


# ---- GPU (CuPy), several ranks may share one GPU ---------------------------

def _cupy_on_this_rank(comm, monkeypatch, aware):
    """cupy, with this rank on its GPU and RINGZERO_CUDA_AWARE=aware; skips without CuPy and a GPU,
    or for aware=1 where the MPI does not say it is CUDA-aware."""
    if not have_cupy():
        from ringzero.comm.backend import cupy_missing_reason
        pytest.skip(f"CuPy with a GPU is not available ({cupy_missing_reason()})")
    import cupy

    from ringzero.comm.backend import _library_cuda_hint, select_device
    if aware == "1" and not _library_cuda_hint() and os.environ.get("RINGZERO_CUDA_AWARE") != "1":
        pytest.skip("this MPI does not say it is CUDA-aware (set RINGZERO_CUDA_AWARE=1 to force)")
    monkeypatch.setenv("RINGZERO_CUDA_AWARE", aware)
    select_device(comm)
    return cupy


@pytest.mark.mpi
@pytest.mark.gpu
@pytest.mark.parametrize("aware", ["0", "1"])
@pytest.mark.parametrize("dtype", ["float16", "float32", "int64"])
def test_cupy_buffers(comm, monkeypatch, aware, dtype):
    cupy = _cupy_on_this_rank(comm, monkeypatch, aware)
    n, r = comm.size, comm.rank
    bad = []
    for small in (0, 1 << 40):
        ring = Ring(comm)
        ring.small_bytes = ring.tree_bytes = small
        for m in (1, 7, 4099):
            L = n * m
            x = cupy.asarray(data(r, L, dtype))
            ring.all_reduce(x)
            if not np.array_equal(x.get().astype(np.float64), exact_sum(n, L, dtype)):
                bad.append(f"AR m={m} small={small}")
            s = cupy.asarray(data(r, L, dtype))
            part = cupy.empty(m, dtype)
            ring.reduce_scatter(s, part)
            full = cupy.empty(L, dtype)
            ring.all_gather(part, full)
            if not np.array_equal(full.get().astype(np.float64), exact_sum(n, L, dtype)):
                bad.append(f"RS+AG m={m} small={small}")
        if dtype == "float16":  # same bits as the host ring
            h = data(r, 1001, dtype, seed=4, ints=False)
            d = cupy.asarray(h)
            ring.all_reduce(d)
            host = Ring(comm)
            host.small_bytes = host.tree_bytes = small
            host.all_reduce(h)
            host.free()
            if not np.array_equal(d.get().view(np.uint16), h.view(np.uint16)):
                bad.append("float16 device != host bits")
        ring.free()
    assert_all(comm, not bad, f"aware={aware} {dtype}: {bad}")


@pytest.mark.mpi
@pytest.mark.gpu
@pytest.mark.parametrize("aware", ["0", "1"])
def test_cupy_started_calls_keep_stream_order(comm, monkeypatch, aware):
    """On a GPU: started calls on buffers whose producing kernels are still queued on the caller's
    stream, with more kernels queued after the start (a busy loop of matmuls), give exact sums, and
    what the caller queues after wait() reads the result (backend.StreamOrder)."""
    cupy = _cupy_on_this_rank(comm, monkeypatch, aware)
    n, r = comm.size, comm.rank
    ring = Ring(comm)
    bad = []
    busy = cupy.ones((2048, 2048), cupy.float32)
    for m in (1, 4099, 1 << 20):
        L = n * m
        src = cupy.asarray(data(r, L, "float32"))
        for _ in range(3):                      # the first two calls build and keep the plans
            x = cupy.zeros(L, cupy.float32)
            s, part, full = cupy.zeros(L, cupy.float32), cupy.empty(m, cupy.float32), cupy.empty(L, cupy.float32)
            for _ in range(4):
                busy @ busy                     # the producer is late: its copies queue behind these
            x += src
            s += src
            p1, p2 = ring.all_reduce_start(x), ring.reduce_scatter_start(s, part)
            for _ in range(4):
                busy @ busy                     # the caller's compute, beside the calls
            p1.wait()
            p2.wait()
            ring.all_gather_start(part, full).wait()
            y, z = x * 1, full * 1              # queued after wait(): must read the results
            want = exact_sum(n, L, "float32")
            if not (np.array_equal(y.get().astype(np.float64), want)
                    and np.array_equal(z.get().astype(np.float64), want)):
                bad.append(f"m={m}")
    ring.free()
    assert_all(comm, not bad, f"aware={aware}: {bad}")
