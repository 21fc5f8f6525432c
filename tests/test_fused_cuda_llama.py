"""ringzero.nn.fused_cuda_llama: the device RMSNorm and SwiGLU against the host's C kernels.

As tests/test_fused_cuda.py does for the GPT's kernels (its fixtures: under the CuPy stand-in,
which runs each kernel's own source on the host, and on a real GPU where one is lent):

- float32 and float64 through the layers (nn/rmsnorm.py, nn/swiglu.py), bit for bit against the
  host C kernels (fused.c), an independent implementation of the same order of operations;
  float64's exp through each side's libm to 4 ulp on a GPU;
- float16, against the float64 formulas to float16 rounding;
- the dispatch: the device kernels are the ones that ran.
"""
# ruff: noqa: F811 (cp and rng are test_fused_cuda's fixtures, imported so that pytest finds them)
import numpy as np
import pytest
from test_fused_cuda import SHAPES, cp, need_c, ran, rng, same  # noqa: F401

from ringzero.nn import fused
from ringzero.nn.rmsnorm import RMSNorm
from ringzero.nn.swiglu import SwiGLU


def _rms(x, w, dy, eps=1e-5):
    """(y, dx, dw) of one RMSNorm forward and backward on x's module."""
    layer, g = RMSNorm(eps), {"w": w * 0}
    y, cache = layer.forward({"w": w}, x)
    y = y.copy()
    dx = layer.backward(dy, cache, g)
    return y, dx.copy(), g["w"]


def _swiglu(gu, dy):
    layer = SwiGLU()
    y, cache = layer.forward(None, gu)
    y = y.copy()
    return y, layer.backward(dy, cache).copy()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rmsnorm_bitwise_equals_host_kernel(cp, rng, dtype, shape):
    need_c()
    N, C = shape
    x = (rng.standard_normal(shape) * 2 + 0.5).astype(dtype)
    w, dy = rng.standard_normal(C).astype(dtype), rng.standard_normal(shape).astype(dtype)
    host = _rms(x, w, dy)
    dev = _rms(cp.asarray(x), cp.asarray(w), cp.asarray(dy))
    assert ran("rz_rms_fwd_sum", "rz_rms_fwd_rstd", "rz_rms_fwd_affine", "rz_rms_bwd_sums", "rz_rms_bwd_dx",
               "rz_rms_wgrad_part", "rz_fold_rows")
    for d, h, n in zip(dev, host, ("y", "dx", "dw")):
        same(cp, d, h, n)                                       # + - * / sqrt only: IEEE on both sides


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_swiglu_bitwise_equals_host_kernel(cp, rng, dtype, shape):
    need_c()
    N, F = shape
    gu = (rng.standard_normal((N, 2 * F)) * 3).astype(dtype)
    gu[0, :3] = [-100, 100, 0]                                  # exp clamps and an exact zero
    dy = rng.standard_normal((N, F)).astype(dtype)
    host = _swiglu(gu, dy)
    dev = _swiglu(cp.asarray(gu), cp.asarray(dy))
    assert ran("rz_swiglu_fwd", "rz_swiglu_bwd")
    for d, h, n in zip(dev, host, ("y", "dgu")):
        same(cp, d, h, n, libm=dtype == np.float64)             # float64: CUDA's exp


def test_float16_against_float64_formulas(cp, rng, monkeypatch):
    """float16 computes in float32 and rounds once per stored value: within float16 rounding of float64."""
    N, C = 24, 40
    x = (rng.standard_normal((N, C)) * 2).astype(np.float16)
    w, dy = rng.standard_normal(C).astype(np.float16), rng.standard_normal((N, C)).astype(np.float16)
    gu, dyf = (rng.standard_normal((N, 2 * C)) * 2).astype(np.float16), dy
    out = dict(zip(("rms_y", "rms_dx", "rms_dw"), _rms(cp.asarray(x), cp.asarray(w), cp.asarray(dy))))
    out.update(zip(("swiglu_y", "swiglu_dgu"), _swiglu(cp.asarray(gu), cp.asarray(dyf))))
    assert ran("rz_rms_fwd_affine", "rz_rms_bwd_dx", "rz_swiglu_fwd", "rz_swiglu_bwd")
    monkeypatch.setattr(fused, "_c", None)                      # the float64 xp passes as the reference
    f = lambda a: a.astype(np.float64)                          # noqa: E731
    ref = dict(zip(("rms_y", "rms_dx", "rms_dw"), _rms(f(x), f(w), f(dy))))
    ref.update(zip(("swiglu_y", "swiglu_dgu"), _swiglu(f(gu), f(dyf))))
    bad = []
    for k, want in ref.items():
        got = out[k].get().astype(np.float64)
        err = np.abs(got - want).max() / np.abs(want).max()
        if not err <= 4e-3:                                     # float16: 2^-11 per rounding, a few roundings
            bad.append(f"{k} {err:.1e}")
    assert not bad, bad


def _rope(x, B, T, H, K, D):
    """x (B, T, (H+2K)·D), a q|k|v buffer: q|k rotated forward on one copy, back on another (in place)."""
    from ringzero.nn.rotary import Rotary
    rot = Rotary(D, 10000.0)
    fwd, bwd = x.copy(), x.copy()
    rot.forward(fwd.reshape(B, T, H + 2 * K, D)[:, :, :H + K])     # strided: the q|k columns of each row
    rot.backward(bwd.reshape(B, T, H + 2 * K, D)[:, :, :H + K])
    return fwd, bwd


# (B, T, H, K, D): a head of 2, a ragged T and GQA 2:1, smollm2's 9 + 3 + 3 heads of 64
ROPE_SHAPES = [(1, 3, 1, 1, 2), (2, 17, 4, 2, 8), (2, 64, 9, 3, 64)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=str)
def test_rotary_bitwise_equals_host_kernel(cp, rng, dtype, shape):
    """The device rotary on the strided q|k heads of a q|k|v buffer, forward and back, against fused.c's
    rope on the same view: the whole buffer bit for bit (v, the last K heads, untouched on both)."""
    need_c()
    B, T, H, K, D = shape
    x = (rng.standard_normal((B, T, (H + 2 * K) * D)) * 2).astype(dtype)
    host = _rope(x, B, T, H, K, D)
    assert "rz_rope" not in fused.fused_cuda._KERNELS             # the host arrays took fused.c
    dev = _rope(cp.asarray(x), B, T, H, K, D)
    assert ran("rz_rope")
    for d, h, n in zip(dev, host, ("forward", "backward")):
        same(cp, d, h, n)                                       # * + - only: IEEE on both sides
    assert np.array_equal(dev[0].get()[..., (H + K) * D:], x[..., (H + K) * D:])


def test_rotary_float16_is_the_xp_bits(cp, rng):
    """float16: each product and each sum rounded once to float16, as NumPy's float16 passes (the xp
    path; fused.c takes no float16) round them: the same bits."""
    B, T, H, K, D = 2, 17, 4, 2, 8
    x = (rng.standard_normal((B, T, (H + 2 * K) * D)) * 2).astype(np.float16)
    host = _rope(x, B, T, H, K, D)
    dev = _rope(cp.asarray(x), B, T, H, K, D)
    assert ran("rz_rope")
    for d, h, n in zip(dev, host, ("forward", "backward")):
        same(cp, d, h, n)
