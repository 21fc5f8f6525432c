"""Ring collectives against independent references.

References: every rank regenerates every other rank's data from its seed and
sums it with NumPy (in float64 for integer-valued data, exact), the MPI
library's own Allreduce / Reduce_scatter_block / Allgather, and for float16 a
NumPy replay of the documented summation order. Run under mpirun at 1, 2, 3,
4 and 8 ranks (launch/test); the unmarked tests run serially.
"""
import os
import tracemalloc

import numpy as np
import pytest
from conftest import assert_all, have_cupy

from ringzero.comm.ring import DTYPES, Ring, blocks

FLOATS = ("float16", "float32", "float64")
ALL_DT = [d.name for d in DTYPES]


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


# ---- the ledger -----------------------------------------------------------

@pytest.mark.mpi
@pytest.mark.parametrize("L", [0, 1, 7, 1000, 4099])
def test_ledger_ring_formula(comm, L):
    n, r = comm.size, comm.rank
    ring = force(Ring(comm), "ring")
    x = np.ones(L, np.float32)
    ring.all_reduce(x)
    off = blocks(L, n)
    size = [off[i + 1] - off[i] for i in range(n)]
    want = 0 if n == 1 else 4 * (2 * L - size[r] - size[(r + 1) % n])
    got = ring.ledger["all_reduce"]
    ok = got["bytes_sent"] == want and got["calls"] == 1
    m = L // n
    ring.ledger.reset()
    ring.reduce_scatter(np.ones(n * m, np.float32), np.empty(m, np.float32))
    ring.all_gather(np.ones(m, np.float32), np.empty(n * m, np.float32))
    pass_bytes = 4 * (n - 1) * m
    ok = ok and ring.ledger["reduce_scatter"]["bytes_sent"] == pass_bytes \
        and ring.ledger["all_gather"]["bytes_sent"] == pass_bytes \
        and ring.ledger.total_sent() == 2 * pass_bytes
    sent = comm.allreduce(got["bytes_sent"])
    recv = comm.allreduce(got["bytes_recv"])
    ring.free()
    assert_all(comm, ok and sent == recv == (0 if n == 1 else 4 * 2 * (n - 1) * L),
               f"L={L}: sent {got['bytes_sent']} want {want}; totals sent {sent} recv {recv}")


@pytest.mark.mpi
def test_ring_all_gather_segments_only_what_it_forwards(comm):
    """The ring all-gather cuts blocks into seg_bytes messages at n > 2 (to forward them as they
    arrive) and sends each block whole at n = 2; the gathered data is every rank's, in order."""
    n, r = comm.size, comm.rank
    if n == 1:
        pytest.skip("no messages at n = 1")
    ring = force(Ring(comm), "ring")
    ring.seg_bytes = 256                      # 64 float32 per message
    m = 1000
    out = np.empty(n * m, np.float32)
    ring.all_gather(np.full(m, r, np.float32), out)
    got = ring.ledger["all_gather"]["messages"]
    want = 1 if n == 2 else (n - 1) * -(-m // 64)   # per rank: n-1 blocks of ceil(m/64) segments
    ok = got == want and np.array_equal(out, np.repeat(np.arange(n, dtype=np.float32), m))
    ring.free()
    assert_all(comm, ok, f"n={n}: {got} messages, want {want}")


@pytest.mark.mpi
def test_ledger_latency_formula(comm):
    n = comm.size
    if n & (n - 1):
        pytest.skip(f"latency schedule needs a power-of-two size, have {n}")
    ring = force(Ring(comm), "latency")
    m = 10
    ring.all_reduce(np.ones(n * m, np.float64))
    force(ring, "tree").all_reduce(np.ones(n * m, np.float64))  # Rabenseifner: 2(n-1)/n
    force(ring, "latency")
    ring.reduce_scatter(np.ones(n * m, np.float64), np.empty(m))
    ring.all_gather(np.ones(m), np.empty(n * m))
    log2n = n.bit_length() - 1
    led = ring.ledger
    ok = (led["all_reduce"]["bytes_sent"] == 8 * n * m * log2n + 8 * 2 * (n - 1) * m
          and led["reduce_scatter"]["bytes_sent"] == 8 * (n - 1) * m
          and led["all_gather"]["bytes_sent"] == 8 * (n - 1) * m)
    ring.free()
    assert_all(comm, ok, f"latency ledger {led.as_dict()}")


# ---- steady state allocates nothing ---------------------------------------

@pytest.mark.mpi
def test_no_allocation_in_steady_state(comm):
    n = comm.size
    ring = Ring(comm)
    x = np.ones(n * 65536, np.float32)          # 256 KiB per rank and up
    part = np.empty(65536, np.float32)
    for _ in range(2):                          # warm up: scratch grows here
        ring.all_reduce(x)
        ring.reduce_scatter(x, part)
        ring.all_gather(part, x)
    growths = ring.scratch_growths
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for _ in range(3):
        ring.all_reduce(x)
        ring.reduce_scatter(x, part)
        ring.all_gather(part, x)
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    ok = ring.scratch_growths == growths and peak < 64 * 1024 < x.nbytes
    ring.free()
    assert_all(comm, ok, f"steady state: scratch growths {growths}->{ring.scratch_growths}, "
                         f"traced peak {peak} B for a {x.nbytes} B buffer")


# ---- bad input: errors before any message ----------------------------------

@pytest.mark.mpi
def test_bad_input_raises_before_sending(comm):
    n, r = comm.size, comm.rank
    ring = Ring(comm)
    f = np.zeros(2 * n, np.float32)
    cases = [
        (ValueError, lambda: ring.all_reduce(np.zeros((2, 3), np.float32))),
        (ValueError, lambda: ring.all_reduce(np.zeros(10, np.float32)[::2])),
        (TypeError, lambda: ring.all_reduce(np.zeros(4, np.uint8))),
        (TypeError, lambda: ring.all_reduce(np.zeros(4, np.complex64))),
        (TypeError, lambda: ring.all_reduce([1.0, 2.0])),
        (ValueError, lambda: ring.all_reduce(np.zeros(4, np.float32), op="max")),
        (TypeError, lambda: ring.all_reduce(np.zeros(4, np.int32), op="avg")),
        (ValueError, lambda: ring.reduce_scatter(f, np.zeros(3, np.float32))),
        (TypeError, lambda: ring.reduce_scatter(f, np.zeros(2, np.float64))),
        (ValueError, lambda: ring.all_gather(np.zeros(2, np.float32), np.zeros(2 * n + 1, np.float32))),
        (TypeError, lambda: ring.all_gather(np.zeros(2, np.int32), np.zeros(2 * n, np.int64))),
        (ValueError, lambda: ring.all_gather(f[1:3], f)),                   # overlaps, not in place
        (ValueError, lambda: ring.reduce_scatter(np.zeros(2 * n, np.float32), np.zeros(4, np.float32)[::2])),
    ]
    ro = np.zeros(4, np.float32)
    ro.flags.writeable = False
    cases.append((ValueError, lambda: ring.all_reduce(ro)))
    if n > 1:  # block `rank` is allowed; any other block is not
        other = (r + 1) % n
        cases.append((ValueError, lambda: ring.all_gather(f[2 * other:2 * other + 2], f)))
    bad = []
    for i, (exc, call) in enumerate(cases):
        try:
            call()
            bad.append(f"case {i}: no error")
        except exc as e:
            if "\n" in str(e) or not str(e):
                bad.append(f"case {i}: not one line: {e!r}")
        except Exception as e:  # noqa: BLE001
            bad.append(f"case {i}: {type(e).__name__}: {e}")
    sent = ring.ledger.total_sent()
    # the ring still works: nothing was sent, nothing is pending
    x = np.ones(5, np.float32)
    ring.all_reduce(x)
    ok = not bad and sent == 0 and np.all(x == n)
    ring.free()
    assert_all(comm, ok, f"{bad}, bytes sent before the good call: {sent}")


@pytest.mark.mpi
def test_mixed_numpy_cupy_is_type_error(comm):
    if not have_cupy():
        pytest.skip("CuPy with a GPU is not available")
    import cupy
    ring = Ring(comm)
    with pytest.raises(TypeError, match="NumPy or all CuPy"):
        ring.all_gather(np.zeros(2, np.float32), cupy.zeros(2 * comm.size, np.float32))
    ring.free()


def _expect_failure(comm, call, want_one_of):
    try:
        call()
        return "no error"
    except want_one_of as e:
        return e
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


@pytest.mark.mpi
def test_disagreeing_lengths_raise_not_hang(comm):
    n, r = comm.size, comm.rank
    if n < 2:
        pytest.skip("needs world size >= 2")
    for schedule in SCHEDULES:
        ring = force(Ring(comm, timeout=2.0), schedule)
        L = 2 * n if r == 0 else n  # rank 0 disagrees (both divisible by n: every rank picks one schedule)
        e = _expect_failure(comm, lambda: ring.all_reduce(np.ones(L, np.float32)), (ValueError, TimeoutError))
        kinds = comm.allgather(type(e).__name__)
        ok = isinstance(e, (ValueError, TimeoutError)) and "ValueError" in kinds
        if isinstance(e, ValueError):
            ok = ok and "expected" in str(e) and "got" in str(e)
        # the Ring refuses further use; a new one works once everyone is back in step
        again = _expect_failure(comm, lambda: ring.all_reduce(np.ones(4, np.float32)), RuntimeError)
        ok = ok and isinstance(again, RuntimeError)
        comm.Barrier()
        fresh = Ring(comm)
        y = np.ones(6, np.float32)
        fresh.all_reduce(y)
        ok = ok and np.all(y == n)
        fresh.free()
        assert_all(comm, ok, f"{schedule}: got {e!r}; all ranks: {kinds}; reuse: {again!r}")


@pytest.mark.mpi
@pytest.mark.parametrize("schedule,op", [("ring", "all_reduce"), ("direct", "all_reduce"),
                                         ("direct", "reduce_scatter"), ("direct", "all_gather")])
def test_missing_peer_times_out(comm, schedule, op):
    """The timeout names the rank that never came, also out of the direct schedule's one wait on all peers."""
    n, r = comm.size, comm.rank
    if n < 2:
        pytest.skip("needs world size >= 2")
    if (schedule, op) == ("direct", "all_reduce") and n & (n - 1) == 0:
        pytest.skip(f"a 2^k all-reduce is never direct (n = {n})")
    # ring: rank 0's first message comes from its left, the one that skips
    ring = force(Ring(comm, timeout=1.5), schedule)
    skipper = n - 1
    call = {"all_reduce": lambda: ring.all_reduce(np.ones(4 * n, np.float32)),
            "reduce_scatter": lambda: ring.reduce_scatter(np.ones(4 * n, np.float32), np.empty(4, np.float32)),
            "all_gather": lambda: ring.all_gather(np.ones(4, np.float32), np.empty(4 * n, np.float32))}[op]
    if r != skipper:
        e = _expect_failure(comm, call, TimeoutError)
        ok = isinstance(e, TimeoutError) and op in str(e) and "rank" in str(e)
        if r == 0:
            ok = ok and f"rank {skipper};" in str(e)
    else:
        e, ok = None, True
    comm.Barrier()  # back in step
    fresh = Ring(comm)
    y = np.ones(3, np.float64)
    fresh.all_reduce(y)
    ok = ok and np.all(y == n)
    fresh.free()
    assert_all(comm, ok, f"rank {r}: {e!r}")


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

@pytest.mark.mpi
@pytest.mark.gpu
@pytest.mark.parametrize("aware", ["0", "1"])
@pytest.mark.parametrize("dtype", ["float16", "float32", "int64"])
def test_cupy_buffers(comm, monkeypatch, aware, dtype):
    if not have_cupy():
        from ringzero.comm.backend import cupy_missing_reason
        pytest.skip(f"CuPy with a GPU is not available ({cupy_missing_reason()})")
    import cupy

    from ringzero.comm.backend import _library_cuda_hint, select_device
    if aware == "1" and not _library_cuda_hint() and os.environ.get("RINGZERO_CUDA_AWARE") != "1":
        pytest.skip("this MPI does not say it is CUDA-aware (set RINGZERO_CUDA_AWARE=1 to force)")
    monkeypatch.setenv("RINGZERO_CUDA_AWARE", aware)
    select_device(comm)
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


# ---- the plan cache ----------------------------------------------------------

@pytest.mark.mpi
def test_plan_cache_keys_on_what_the_checks_read(comm):
    """Reused buffers run a kept plan; any change the checks depend on is checked again, before any message."""
    n, r = comm.size, comm.rank
    ring = Ring(comm)
    x = np.zeros(8 * n, np.float32)
    bad = []
    for k in range(3):
        x[:] = data(r, 8 * n, "float32", seed=k)
        ring.all_reduce(x)
        if not np.array_equal(x.astype(np.float64), exact_sum(n, 8 * n, "float32", seed=k)):
            bad.append(f"call {k}")
    if n > 1 and len(ring.cache) != 1:
        bad.append(f"{len(ring.cache)} plans kept for one buffer")
    sent = ring.ledger.total_sent()
    x.flags.writeable = False          # same object, same address: must be refused now
    try:
        ring.all_reduce(x)
        bad.append("read-only buffer accepted from the cache")
    except ValueError:
        pass
    x.flags.writeable = True
    if ring.ledger.total_sent() != sent:
        bad.append("bytes sent by the refused call")
    y = x.view(np.int32)               # same bytes, another dtype: another key
    y[:] = r + 1
    ring.all_reduce(y)
    if not np.all(y == n * (n + 1) // 2):
        bad.append("int32 view of a cached float32 buffer")
    ring.max_plans = 2                 # LRU bound
    bufs = [np.ones(4 * n, np.float64) for _ in range(4)]
    for _ in range(2):
        for b in bufs:
            ring.all_reduce(b)
    if len(ring.cache) > 2:
        bad.append(f"{len(ring.cache)} plans kept, bound 2")
    ring.free()
    assert_all(comm, not bad, f"{bad}")


# ---- the direct schedule, the hot path, recursive doubling's eager cut ----------

@pytest.mark.mpi
def test_ledger_direct_formula(comm):
    """Direct: (n-1)/n of the buffer per pass, in n-1 messages per pass (one to each peer)."""
    n = comm.size
    if not 3 <= n <= 16:
        pytest.skip(f"direct runs at 3 <= n <= 16, have {n}")
    ring = force(Ring(comm), "direct")
    m = 10
    ring.all_reduce(np.ones(n * m, np.float64))
    ring.reduce_scatter(np.ones(n * m, np.float64), np.empty(m))
    ring.all_gather(np.ones(m), np.empty(n * m))
    led = ring.ledger
    ar_msgs = 2 * (n - 1) if n & (n - 1) else 2 * (n.bit_length() - 1)  # 2^k: Rabenseifner, log2 n per pass
    ok = (led["all_reduce"]["bytes_sent"] == 8 * 2 * (n - 1) * m and led["all_reduce"]["messages"] == ar_msgs
          and led["reduce_scatter"]["bytes_sent"] == 8 * (n - 1) * m
          and led["all_gather"]["bytes_sent"] == 8 * (n - 1) * m and led["all_gather"]["messages"] == n - 1)
    ring.free()
    assert_all(comm, ok, f"direct ledger {led.as_dict()}")


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ["float16", "float32", "int64"])
def test_recursive_doubling_cut_into_eager_messages(comm, dtype):
    """A buffer of up to 4 x eager_bytes goes as several messages; the sums are the NumPy sums."""
    n, r = comm.size, comm.rank
    if n & (n - 1):
        pytest.skip(f"recursive doubling needs a power-of-two size, have {n}")
    ring = force(Ring(comm), "latency")
    ring.eager_bytes = 64
    bad = []
    for L in (1, 7, 31, 97, 100):   # up to 4 pieces of 64 bytes: cut; 100 x 8 bytes: not cut
        x = data(r, L, dtype, seed=L)
        ring.ledger.reset()
        ring.all_reduce(x)
        if not np.array_equal(x.astype(np.float64), exact_sum(n, L, dtype, seed=L)):
            bad.append(f"L={L}")
        nb = L * np.dtype(dtype).itemsize
        pieces = -(-nb // 64) if 64 < nb <= 256 else 1
        log2n = n.bit_length() - 1
        got = ring.ledger["all_reduce"]
        if n > 1 and (got["messages"] != pieces * log2n or got["bytes_sent"] != nb * log2n):
            bad.append(f"L={L}: {got['messages']} messages, {got['bytes_sent']} bytes; want {pieces * log2n}, "
                       f"{nb * log2n}")
    ring.free()
    assert_all(comm, not bad, f"{dtype}: {bad}")


@pytest.mark.mpi
def test_hot_path_sees_in_place_changes_and_knobs(comm):
    """The id-keyed hot path: an in-place reshape is refused, a knob change takes effect."""
    n, r = comm.size, comm.rank
    ring = Ring(comm)
    x = np.zeros(8 * n, np.float32)
    for _ in range(3):
        x[:] = r + 1
        ring.all_reduce(x)
    bad = [] if np.all(x == n * (n + 1) // 2) else ["sums"]
    x.shape = (2, 4 * n)                 # same object, now 2-D: checked again, refused
    try:
        ring.all_reduce(x)
        bad.append("2-D reshape accepted from the hot path")
    except ValueError as e:
        if "1-D" not in str(e):
            bad.append(f"wrong error {e}")
    x.shape = (8 * n,)
    if n > 1:
        force(ring, "ring")              # a knob: the next call must take the ring
        ring.ledger.reset()
        x[:] = 1
        ring.all_reduce(x)
        ok = ring.ledger["all_reduce"]["messages"] == 2 * (n - 1) and np.all(x == n)
        if not ok:
            bad.append(f"after forcing the ring: {ring.ledger['all_reduce']}")
    ring.free()
    assert_all(comm, not bad, f"{bad}")
