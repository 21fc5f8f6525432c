"""ringzero.nn.gemm: the model's 2-D products against float64 NumPy, the library choice, MKL's bits."""
import numpy as np
import pytest

from ringzero.nn import gemm


def _layouts(a, b):
    """(a, b) as row-major arrays and as transposed views of row-major arrays (x.T, w.T)."""
    at = np.ascontiguousarray(a.T).T
    bt = np.ascontiguousarray(b.T).T
    return {"nn": (a, b), "tn": (at, b), "nt": (a, bt), "tt": (at, bt)}


@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-5), (np.float64, 1e-12)])
@pytest.mark.parametrize("shape", [(1024, 128, 384), (7, 5, 3), (1, 9, 1)])
def test_matmul_matches_float64_numpy_in_every_layout(dtype, tol, shape):
    M, K, N = shape
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((M, K)).astype(dtype), rng.standard_normal((K, N)).astype(dtype)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    for name, (x, y) in _layouts(a, b).items():
        out = np.full((M, N), np.nan, dtype)
        assert gemm.matmul(x, y, out) is out
        err = np.abs(out - ref).max() / max(1.0, np.abs(ref).max())
        assert err < tol, f"{gemm.library()} {name}: relative error {err:.2e}"


def test_matmul_takes_what_blas_cannot_through_numpy():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((12, 10)).astype(np.float32)[::2, ::2]    # strided both ways
    b = rng.standard_normal((5, 4)).astype(np.float32)
    out = np.empty((6, 4), np.float32)
    gemm.matmul(a, b, out)
    np.testing.assert_allclose(out, a.astype(np.float64) @ b, rtol=1e-5, atol=1e-6)
    h = np.ones((3, 2), np.float16)
    o16 = np.empty((3, 3), np.float16)
    gemm.matmul(h, h.T, o16)
    assert (o16 == 2).all()


def test_matmul_shape_mismatch_is_one_line():
    with pytest.raises(ValueError, match=r"expected a \(M, K\) @ b \(K, N\) -> out \(M, N\), got"):
        a = np.ones((4, 3), np.float32)
        lib, _ = gemm.choose("auto")
        if lib is None:
            pytest.skip("numpy.matmul checks shapes itself (no MKL here)")
        gemm._state.update(lib=lib, name="mkl")
        try:
            gemm.matmul(a, np.ones((3, 2), np.float32), np.empty((4, 5), np.float32))
        finally:
            gemm._state.clear()


def test_choose_follows_the_setting_and_the_vendor(monkeypatch):
    assert gemm.choose("numpy") == (None, "numpy")
    assert gemm.choose("auto", vendor="AuthenticAMD") == (None, "numpy")     # MKL measured slower there
    with pytest.raises(gemm.BlasError, match=r"^RINGZERO_BLAS must be one of auto, numpy, mkl, got 'openblas'$"):
        gemm.choose("openblas")
    monkeypatch.setattr(gemm, "_mkl_paths", lambda: [])
    assert gemm.choose("auto", vendor="GenuineIntel") == (None, "numpy")      # no wheel: numpy, silently
    unmet = r"^RINGZERO_BLAS=mkl: MKL cannot be loaded: no libmkl_rt under .*pip install mkl"
    with pytest.raises(gemm.BlasError, match=unmet):
        gemm.choose("mkl")


def test_mkl_bits_do_not_depend_on_where_the_buffers_sit():
    lib, name = gemm.choose("mkl") if gemm._mkl_paths() else (None, "")
    if lib is None:
        pytest.skip("the mkl wheel is not installed (pip install mkl)")
    rng = np.random.default_rng(2)
    M, K, N = 1024, 256, 768
    a, b = rng.standard_normal((M, K)).astype(np.float32), rng.standard_normal((K, N)).astype(np.float32)
    gemm._state.update(lib=lib, name=name)
    try:
        outs = []
        for off in (0, 1, 3, 16):                      # operands and result at other 4-byte offsets
            pa = np.empty(M * K + off, np.float32)[off:].reshape(M, K)
            pb = np.empty(K * N + off, np.float32)[off:].reshape(K, N)
            po = np.empty(M * N + off, np.float32)[off:].reshape(M, N)
            pa[...], pb[...] = a, b
            outs.append(gemm.matmul(pa, pb, po).copy())
        ref = a.astype(np.float64) @ b.astype(np.float64)
        assert np.abs(outs[0] - ref).max() < 1e-3
        for o in outs[1:]:
            assert np.array_equal(o, outs[0])
    finally:
        gemm._state.clear()


def test_check_setting_names_a_bad_or_unmet_setting_without_loading(monkeypatch):
    gemm.check_setting("numpy")
    gemm.check_setting("auto")
    with pytest.raises(gemm.BlasError, match=r"^RINGZERO_BLAS must be one of auto, numpy, mkl, got 'openblas'$"):
        gemm.check_setting("openblas")
    monkeypatch.setattr(gemm, "_mkl_paths", lambda: [])
    with pytest.raises(gemm.BlasError, match=r"^RINGZERO_BLAS=mkl: MKL cannot be loaded: no libmkl_rt"):
        gemm.check_setting("mkl")


def test_trainer_check_gives_one_line_for_a_bad_blas_setting():
    import os
    import subprocess
    import sys
    env = {**os.environ, "RINGZERO_BLAS": "openblas"}
    r = subprocess.run([sys.executable, "-m", "ringzero.train", "--check", "2", "--steps", "1"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip() == ("ringzero.train: error: RINGZERO_BLAS must be one of auto, numpy, mkl, "
                                "got 'openblas'")
