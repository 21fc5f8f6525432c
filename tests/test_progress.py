"""The nonblocking forms (comm/progress.py) against the blocking ones and against NumPy.

References: NumPy sums of every rank's data (regenerated from seeds), the
blocking call on the same data (bitwise: the same plans run), and MPI's own
progress rule: a rendezvous-sized message that completes while the caller
only computes was moved by the progress thread.
"""
import time

import numpy as np
import pytest
from conftest import assert_all
from test_collectives import _expect_failure, data, exact_sum

from ringzero.comm.ring import Ring


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ["float32", "float16", "int64"])
def test_started_calls_match_numpy_and_the_blocking_form(comm, dtype):
    n, r = comm.size, comm.rank
    ring, ref = Ring(comm), Ring(comm)
    bad = []
    for L in (n, 13 * n, 70000 * n):
        m = L // n
        exact = exact_sum(n, L, dtype)
        for rep in range(3):                         # the kept plans run from the second call on
            x = data(r, L, dtype)
            a = x.copy()
            rs, ag = np.empty(m, x.dtype), np.empty(L, x.dtype)
            # three in flight at once, on separate buffers, waited for in another order
            pa = ring.all_reduce_start(a)
            pr = ring.reduce_scatter_start(x, rs)
            pg = ring.all_gather_start(x[r * m:(r + 1) * m], ag)
            if pg.wait() is not ag or pr.wait() is not rs or pa.wait() is not a:
                bad.append("wait returns the wrong array")
            b = x.copy()
            ref.all_reduce(b)
            if not np.array_equal(a, b):
                bad.append(f"L={L}: started all_reduce != blocking all_reduce")
            if not np.array_equal(a.astype(np.float64), exact):
                bad.append(f"L={L}: all_reduce wrong")
            if not np.array_equal(rs.astype(np.float64), exact[r * m:(r + 1) * m]):
                bad.append(f"L={L}: reduce_scatter wrong")
            if not np.array_equal(ag, np.concatenate([data(q, L, dtype)[q * m:(q + 1) * m] for q in range(n)])):
                bad.append(f"L={L}: all_gather wrong")
    sent, want = ring.ledger.total_sent(), ref.ledger.total_sent()
    if n > 1 and sent <= want:    # ring ran RS and AG besides the same all-reduces
        bad.append(f"ledger: {sent} bytes, expected more than the all-reduces' {want}")
    ring.free()
    ref.free()
    assert_all(comm, not bad, "; ".join(sorted(set(bad))[:4]))


@pytest.mark.mpi
def test_a_started_call_progresses_while_the_caller_computes(comm):
    """A 16 MiB all-reduce (rendezvous messages) finishes while the caller only computes."""
    n = comm.size
    if n < 2:
        pytest.skip("needs world size >= 2")
    ring = Ring(comm)
    x = np.ones(4 << 20, np.float32)
    ring.all_reduce(x.copy())
    ring.all_reduce(x.copy())                      # the plan is kept from here on
    y = x.copy()
    comm.Barrier()
    p = ring.all_reduce_start(y)
    a = np.ones((128, 128), np.float32)
    t0, done = time.monotonic(), False
    while time.monotonic() - t0 < 60:              # compute only; never a call into MPI on this thread
        a = (a @ a) * (1.0 / 128)
        if p.done():
            done = True
            break
    p.wait()
    assert_all(comm, done and np.all(y == n), f"not done after {time.monotonic() - t0:.1f} s of compute alone")
    ring.free()


@pytest.mark.mpi
def test_calls_on_one_ring_run_in_order_and_own_their_buffers_until_wait(comm):
    """A reduce-scatter started, then the all-gather of its result: in order, bitwise the all-reduce."""
    n, r = comm.size, comm.rank
    ring, ref = Ring(comm), Ring(comm)
    m = 3000
    x = data(r, n * m, "float32", ints=False)
    buf = x.copy()
    own = buf[r * m:(r + 1) * m]
    p1 = ring.reduce_scatter_start(buf, own)
    p2 = ring.all_gather_start(own, buf)
    owned = [ring.owner(own) is not None or p1.done(), ring.owner(x) is None]   # x: nobody's
    held = ring.owner(buf[5:9])                     # read-write access into buf: the started calls
    p2.wait()
    p1.wait()
    after = ring.owner(buf) is None                 # waited: free
    y = x.copy()
    ref.all_reduce(y)
    ok = all(owned) and after and np.array_equal(buf, y) and (held is None or held.name in ("reduce_scatter",
                                                                                            "all_gather"))
    ring.free()
    ref.free()
    assert_all(comm, ok, f"owned {owned}, after {after}, equal {np.array_equal(buf, y)}")


@pytest.mark.mpi
def test_errors_raise_at_start_or_at_wait_on_the_callers_thread(comm):
    n, r = comm.size, comm.rank
    ring = Ring(comm, timeout=2.0)
    bad = _expect_failure(comm, lambda: ring.reduce_scatter_start(np.ones(n * 4 + 1, np.float32),
                                                                 np.empty(4, np.float32)), ValueError)
    ok = isinstance(bad, ValueError) and "expected len(send)" in str(bad)     # before any message
    if n > 1:
        L = 2 * n if r == 0 else n                                 # rank 0 disagrees: fails in the background
        p = ring.all_reduce_start(np.ones(L, np.float32))
        e = _expect_failure(comm, p.wait, (ValueError, TimeoutError))
        kinds = comm.allgather(type(e).__name__)
        ok = ok and isinstance(e, (ValueError, TimeoutError)) and "ValueError" in kinds
        again = _expect_failure(comm, lambda: ring.all_reduce(np.ones(4, np.float32)), RuntimeError)
        ok = ok and isinstance(again, RuntimeError)
        comm.Barrier()
    fresh = Ring(comm)
    y = np.ones(6, np.float32)
    fresh.all_reduce_start(y).wait()
    ok = ok and np.all(y == n)
    fresh.free()
    assert_all(comm, ok, f"{bad!r}")
