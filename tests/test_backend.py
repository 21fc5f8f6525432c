"""The backend module: array-module choice, CUDA-awareness hint, staging, devices."""
import numpy as np
import pytest
from conftest import assert_all, have_cupy

from ringzero.comm import backend


class FakeCupyArray:
    """Stands in for a CuPy array without importing CuPy: only its module matters."""
    __module__ = "cupy._core.core"


def test_numpy_module():
    a = np.zeros(3)
    assert backend.get_array_module(a) is np
    assert backend.get_array_module(a, np.ones(2)) is np
    assert backend.xp_for("cpu") is np
    assert backend.to_host(a) is a and backend.to_device(a, "cpu") is a


def test_mixing_numpy_and_cupy_is_type_error():
    with pytest.raises(TypeError, match="all NumPy or all CuPy"):
        backend.get_array_module(np.zeros(2), FakeCupyArray())


def test_bad_device():
    with pytest.raises(ValueError, match="expected device 'cpu' or 'cuda', got 'tpu'"):
        backend.xp_for("tpu")


def test_cuda_without_cupy_says_why():
    if have_cupy():
        pytest.skip("CuPy and a GPU are present")
    with pytest.raises(RuntimeError, match="CuPy is unusable"):
        backend.xp_for("cuda")
    assert backend.cupy_missing_reason()


def test_cuda_aware_env_override(monkeypatch):
    monkeypatch.setenv("RINGZERO_CUDA_AWARE", "1")
    assert backend.cuda_aware() is True
    monkeypatch.setenv("RINGZERO_CUDA_AWARE", "0")
    assert backend.cuda_aware() is False
    monkeypatch.setenv("RINGZERO_CUDA_AWARE", "yes")
    with pytest.raises(ValueError, match="RINGZERO_CUDA_AWARE=0 or 1, got 'yes'"):
        backend.cuda_aware()
    monkeypatch.delenv("RINGZERO_CUDA_AWARE")
    assert backend.cuda_aware() in (True, False)  # the library's hint, or False when it can't say


def test_library_hint_matches_ompi_info():
    """The run-time query agrees with what Open MPI's ompi_info says about its build (the wheel: no CUDA)."""
    from mpi4py import MPI
    if "Open MPI" not in MPI.Get_library_version():
        pytest.skip("not Open MPI")
    built = backend.ompi_info_cuda()
    if built is None:
        pytest.skip("ompi_info not on PATH")
    hint = backend._library_cuda_hint()
    assert hint is not None, f"no CUDA query found in {backend._libmpi_path()}"
    if not built:  # built without CUDA: the run time cannot support it either
        assert hint is False
    else:  # built with CUDA: the run-time answer may still be no (no GPU), but never a yes without the build
        assert hint in (True, False)


def test_cuda_support_says_how(monkeypatch):
    monkeypatch.setenv("RINGZERO_CUDA_AWARE", "1")
    assert backend.cuda_support() == (True, "RINGZERO_CUDA_AWARE=1")
    monkeypatch.delenv("RINGZERO_CUDA_AWARE")
    aware, how = backend.cuda_support()
    assert aware == backend.cuda_aware() and how
    monkeypatch.setattr(backend, "_library_cuda_hint", lambda: None)  # an MPI without the query
    monkeypatch.setattr(backend, "ompi_info_cuda", lambda: True)
    assert backend.cuda_support() == (True, "ompi_info: built with CUDA support: true")
    monkeypatch.setattr(backend, "ompi_info_cuda", lambda: None)
    assert backend.cuda_support()[0] is False


def test_staging_grows_only_when_needed():
    s = backend.Staging()
    a = s.host("x", 1000)
    assert a.nbytes == 1000 and a.dtype == np.uint8 and s.growths == 1
    s.host("x", 4096)
    s.host("x", 10)
    assert s.growths == 1  # the first buffer already had room (at least 4 KiB)
    s.host("x", 5000)
    assert s.growths == 2
    s.host("x", 8000)      # grows by doubling, so this fits
    assert s.growths == 2
    s.host("y", 10)
    assert s.growths == 3  # one buffer per slot


@pytest.mark.mpi
def test_select_device_by_local_rank(comm):
    dev = backend.select_device(comm)
    if not have_cupy():
        assert_all(comm, dev is None, f"select_device without CuPy gave {dev}")
        return
    import cupy
    from mpi4py import MPI
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    want = local.rank % cupy.cuda.runtime.getDeviceCount()
    local.Free()
    assert_all(comm, dev == want == cupy.cuda.Device().id, f"device {dev}, want {want}")


@pytest.mark.gpu
def test_gpu_roundtrip_and_pinned_staging():
    if not have_cupy():
        pytest.skip(f"CuPy with a GPU is not available ({backend.cupy_missing_reason()})")
    import cupy
    x = np.arange(10, dtype=np.float32)
    d = backend.to_device(x, "cuda")
    assert isinstance(d, cupy.ndarray) and backend.get_array_module(d) is cupy
    assert np.array_equal(backend.to_host(d), x)
    s = backend.Staging()
    h = s.host("a", 64)
    assert cupy.cuda.runtime.pointerGetAttributes(h.ctypes.data).type == cupy.cuda.runtime.memoryTypeHost


@pytest.mark.gpu
def test_gpu_add_f16_matches_numpy():
    if not have_cupy():
        pytest.skip(f"CuPy with a GPU is not available ({backend.cupy_missing_reason()})")
    import cupy

    from ringzero.comm import kernels
    rng = np.random.default_rng(0)
    a = rng.integers(0, 1 << 16, 1 << 20).astype(np.uint16).view(np.float16)
    b = rng.integers(0, 1 << 16, 1 << 20).astype(np.uint16).view(np.float16)
    with np.errstate(all="ignore"):
        want = a + b
    out = cupy.empty(len(a), cupy.float16)
    kernels.add_f16(cupy.asarray(a), cupy.asarray(b), out)
    got = out.get()
    finite = ~np.isnan(want)  # NaN payloads may differ on the GPU; NaN-ness may not
    assert np.array_equal(got.view(np.uint16)[finite], want.view(np.uint16)[finite])
    assert np.array_equal(np.isnan(got), ~finite)
