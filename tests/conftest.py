"""Shared fixtures.

MPI tests are marked ``@pytest.mark.mpi`` and run by launch/test under
mpirun at sizes 1, 2, 3, 4 and 8. A test that fails on one rank while the
others wait in a collective would hang them, so tests check their results
with ``assert_all`` (every rank fails together) and the Ring's peer timeout
(RINGZERO_TIMEOUT) turns a lost peer into an error instead of a hang.
"""

import numpy as np
import pytest


@pytest.fixture
def comm():
    from mpi4py import MPI
    return MPI.COMM_WORLD


def assert_all(comm, ok: bool, msg: str = ""):
    """Fail on every rank if the check failed on any rank.

    The verdict is agreed with a scalar MPI reduction (not the code under
    test), and the message names the ranks that failed.
    """
    bad = comm.allgather(None if ok else f"rank {comm.rank}: {msg}")
    bad = [b for b in bad if b]
    assert not bad, "; ".join(bad)


def require_size(comm, *, min_size=1, divides=None):
    if comm.size < min_size:
        pytest.skip(f"needs world size >= {min_size}, have {comm.size}")


@pytest.fixture
def rng(comm):
    return np.random.default_rng(1234 + comm.rank)


def have_cupy():
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@pytest.fixture(params=["c", "xp"])
def path(request, monkeypatch):
    """(test_layers, test_models) Both arithmetic paths of ringzero.nn.fused: the C kernels, and the NumPy fallback."""
    from ringzero.nn import fused
    if request.param == "c" and not fused.HAVE_C:
        pytest.skip("ringzero.nn._fused was not built")
    if request.param == "xp":
        monkeypatch.setattr(fused, "_c", None)
    return request.param
