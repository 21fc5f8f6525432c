"""Objects over a Ring (comm/objects.py) against MPI's own object collectives."""
import pytest
from conftest import assert_all

from ringzero.comm.objects import allgather_obj, bcast_obj
from ringzero.comm.ring import Ring


@pytest.mark.mpi
def test_objects_match_mpis_own(comm):
    r = comm.rank
    ring = Ring(comm)
    cases = [None, r, f"rank {r}", {"rank": r, "files": ["x" * (r * 100)]}, ("err" if r == comm.size - 1 else None)]
    ok = all(allgather_obj(ring, c) == comm.allgather(c) for c in cases)
    ok = ok and all(bcast_obj(ring, c, root=q) == comm.bcast(c, root=q) for c in cases for q in range(comm.size))
    ring.free()
    assert_all(comm, ok, "an object exchange differs from MPI's allgather/bcast")


@pytest.mark.mpi
def test_a_missing_rank_times_out_naming_it(comm):
    n, r = comm.size, comm.rank
    if n < 2:
        pytest.skip("needs world size >= 2")
    ring = Ring(comm, timeout=1.5)
    err = None
    if r != n - 1:
        try:
            allgather_obj(ring, "verdict")
        except TimeoutError as e:
            err = str(e)
    comm.Barrier()
    ok = r == n - 1 or (err is not None and "all_gather" in err and "rank" in err)
    assert_all(comm, ok, f"got {err!r}")
