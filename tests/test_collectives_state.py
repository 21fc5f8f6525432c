"""The Ring's bookkeeping against independent references: the ledger, steady state, bad input, the plan cache.

References: byte and message counts written out here from the schedule's
definition (not read from the code under test), tracemalloc for allocations,
and errors that must come before any message or instead of a hang. The
results themselves are tests/test_collectives.py; its helpers are reused.
"""
import tracemalloc

import numpy as np
import pytest
from conftest import assert_all, have_cupy
from test_collectives import SCHEDULES, _expect_failure, data, exact_sum, force

from ringzero.comm.ring import Ring, blocks

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
        ok = ok and _fresh_ring_sums(comm, np.ones(6, np.float32))
        assert_all(comm, ok, f"{schedule}: got {e!r}; all ranks: {kinds}; reuse: {again!r}")


def _fresh_ring_sums(comm, y) -> bool:
    """Once every rank is back in step, a new Ring all-reduces y (ones) to comm.size."""
    comm.Barrier()
    fresh = Ring(comm)
    fresh.all_reduce(y)
    fresh.free()
    return bool(np.all(y == comm.size))


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
    ok = ok and _fresh_ring_sums(comm, np.ones(3, np.float64))
    assert_all(comm, ok, f"rank {r}: {e!r}")


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
