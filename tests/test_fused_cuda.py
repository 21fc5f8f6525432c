"""ringzero.nn.fused_cuda: the device kernels against the host's C kernels.

Every test runs twice: under the CuPy stand-in (``standin``: it pastes each
ElementwiseKernel's operation string into a host C++ loop built with
``-ffp-contract=off``, so the kernels' own source runs), and on a real GPU
(``gpu``: skipped without one; launch/gpu-check runs it). Each kernel is
checked three ways:

- float32 and float64, bit for bit against the host C extension (fused.c),
  an independent implementation of the same order of operations. On a GPU,
  the values that pass through CUDA's libm (float64 exp/log, float32 logf)
  are compared to 4 ulp instead;
- float16, against the float64 formulas of the host to float16 rounding;
- the dispatch: CuPy arrays that are strided, mixed in dtype or overlapping
  fall back to the xp formulas, and the kernels are the ones that ran.
"""
import math

import cupy_standin
import numpy as np
import pytest
from conftest import have_cupy
from cupy_standin import _kernel

from ringzero.comm import backend
from ringzero.nn import fused, fused_cuda


@pytest.fixture(params=[pytest.param("standin", marks=pytest.mark.standin),
                        pytest.param("gpu", marks=pytest.mark.gpu)])
def cp(request, monkeypatch):
    if request.param == "gpu":
        if not have_cupy():
            pytest.skip(f"CuPy with a GPU is not available ({backend.cupy_missing_reason()})")
        import cupy
        monkeypatch.setattr(fused_cuda, "_KERNELS", {})
        return cupy
    if not _kernel.have_compiler():
        pytest.skip("the stand-in's ElementwiseKernel needs a C++ compiler")
    return cupy_standin.install(monkeypatch)


def on_gpu(cp):
    return not getattr(cp, "_standin", False)


@pytest.fixture
def rng():
    return np.random.default_rng(31)


def need_c():
    if not fused.HAVE_C:
        pytest.skip("ringzero.nn._fused was not built: no host kernels to compare with")


def ran(*names):
    return all(n in fused_cuda._KERNELS for n in names)


def bits(a):
    a = np.ascontiguousarray(a)
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.itemsize])


def same(cp, dev, host, what, libm=False):
    """Bit for bit; values through CUDA's libm (``libm`` and a real GPU) to 4 ulp of the largest."""
    got = dev.get()
    if libm and on_gpu(cp):
        ulp = np.spacing(np.abs(host).max())                       # of the largest value (nll cancels)
        err = np.abs(got.astype(np.float64) - host).max() / ulp
        assert err <= 4, f"{what}: {err:.1f} ulp (of the largest value) from the host kernel"
        return
    assert np.array_equal(bits(got), bits(host)), (
        f"{what}: {np.count_nonzero(bits(got) != bits(host))} of {host.size} values differ")


# (N, M): a row shorter than the 8 lanes, a ragged tail, the model's width, more rows than the 64 row lanes
SHAPES = [(3, 5), (17, 37), (64, 128), (130, 24)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_gelu_bitwise_equals_host_kernel(cp, rng, dtype, shape, bias):
    need_c()
    N, M = shape
    x = (rng.standard_normal(shape) * 3).astype(dtype)
    x[0, :3] = [-30, 30, 0]                                     # exp clamps and an exact zero
    b = rng.standard_normal(M).astype(dtype) if bias else None
    dy = rng.standard_normal(shape).astype(dtype)
    y, s, dx, cs = tuple(np.empty(shape, dtype) for _ in range(3)) + (np.empty(M, dtype),)
    fused.gelu_forward(x, y, s, b)
    fused.gelu_backward(dy, x, s, dx, b, cs)
    X, B, DY = cp.asarray(x), cp.asarray(b) if bias else None, cp.asarray(dy)
    Y, S, DX, CS = tuple(cp.empty(shape, dtype) for _ in range(3)) + (cp.empty(M, dtype),)
    assert fused.gelu_forward(X, Y, S, B) is False               # x is left alone, as on the host
    fused.gelu_backward(DY, X, S, DX, B, CS)
    assert ran("rz_gelu_fwd_bias" if bias else "rz_gelu_fwd", "rz_colsum_part", "rz_fold_rows")
    for dev, host, n in ((Y, y, "y"), (S, s, "s"), (DX, dx, "dx"), (CS, cs, "colsum")):
        same(cp, dev, host, n, libm=dtype == np.float64)          # float64: CUDA's exp


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_layernorm_and_residual_bitwise_equal_host_kernel(cp, rng, dtype, shape):
    need_c()
    N, C = shape
    x = (rng.standard_normal(shape) * 2 + 0.5).astype(dtype)
    w, b = rng.standard_normal(C).astype(dtype), rng.standard_normal(C).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    y, xh, dx = (np.empty(shape, dtype) for _ in range(3))
    rs, dw, db = np.empty((N, 1), dtype), np.empty(C, dtype), np.empty(C, dtype)
    fused.layernorm_forward(x, w, b, y, xh, rs, 1e-5)
    fused.layernorm_backward(dy, xh, rs, w, dx, dw, db)
    r = y.copy()
    fused.bias_residual(r, b, x)
    X, W, Bd, DY = (cp.asarray(a) for a in (x, w, b, dy))
    Y, XH, DX = (cp.empty(shape, dtype) for _ in range(3))
    RS, DW, DB = cp.empty((N, 1), dtype), cp.empty(C, dtype), cp.empty(C, dtype)
    fused.layernorm_forward(X, W, Bd, Y, XH, RS, 1e-5)
    fused.layernorm_backward(DY, XH, RS, W, DX, DW, DB)
    R = Y.copy()
    fused.bias_residual(R, Bd, X)
    assert ran("rz_ln_fwd_sum", "rz_ln_fwd_affine", "rz_ln_bwd_sums", "rz_ln_bwd_dx", "rz_ln_wgrad_part",
               "rz_bias_residual")
    for dev, host, n in ((Y, y, "y"), (XH, xh, "xhat"), (RS, rs, "rstd"), (DX, dx, "dx"), (DW, dw, "dw"),
                         (DB, db, "db"), (R, r, "bias_residual")):
        same(cp, dev, host, n)                                  # + - * / sqrt only: IEEE on both sides


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("T", [1, 7, 16, 33])
def test_softmax_causal_bitwise_equals_host_kernel(cp, rng, dtype, T):
    need_c()
    R = 3
    att = (rng.standard_normal((R, T, T)) * 4).astype(dtype)
    datt = rng.standard_normal((R, T, T)).astype(dtype)
    sc = 1.0 / math.sqrt(16)
    A, D = cp.asarray(att), cp.asarray(datt)
    fused.softmax_causal_(att, sc)
    fused.softmax_causal_backward_(datt, att, sc)
    fused.softmax_causal_(A, sc)
    fused.softmax_causal_backward_(D, A, sc)
    assert ran("rz_softmax_max", "rz_softmax_exp", "rz_softmax_div", "rz_softmax_bwd_sum", "rz_softmax_bwd")
    same(cp, A, att, "att", libm=dtype == np.float64)
    same(cp, D, datt, "datt", libm=dtype == np.float64)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("V", [5, 65])
def test_cross_entropy_bitwise_equals_host_kernel(cp, rng, dtype, V):
    need_c()
    N = 19
    lg = (rng.standard_normal((N, V)) * 5).astype(dtype)
    tg = rng.integers(0, V, N)
    at = np.arange(N) * V + tg
    pr, nll = np.empty((N, V), dtype), np.empty(N, dtype)
    fused.cross_entropy_forward(lg, tg, at, pr, nll)
    PR, NLL = cp.empty((N, V), dtype), cp.empty(N, dtype)
    fused.cross_entropy_forward(cp.asarray(lg), cp.asarray(tg), cp.asarray(at), PR, NLL)
    assert ran("rz_ce_max", "rz_ce_exp", "rz_ce_norm")
    same(cp, PR, pr, "probs", libm=dtype == np.float64)
    same(cp, NLL, nll, "nll", libm=True)                         # logf / log


def test_float16_against_float64_formulas(cp, rng, monkeypatch):
    """float16 computes in float32 and rounds once per stored value: within float16 rounding of float64."""
    N, C, T = 24, 40, 12
    x = (rng.standard_normal((N, C)) * 2).astype(np.float16)
    b, w = rng.standard_normal(C).astype(np.float16), rng.standard_normal(C).astype(np.float16)
    dy = rng.standard_normal((N, C)).astype(np.float16)
    att = (rng.standard_normal((2, T, T)) * 3).astype(np.float16)
    tg = rng.integers(0, C, N)
    dev = {k: cp.asarray(v) for k, v in dict(x=x, b=b, w=w, dy=dy, att=att, tg=tg).items()}
    out = {}
    Y, S, DX = (cp.empty((N, C), np.float16) for _ in range(3))
    CS = cp.empty(C, np.float32)
    fused.gelu_forward(dev["x"], Y, S, dev["b"])
    fused.gelu_backward(dev["dy"], dev["x"], S, DX, dev["b"], CS)
    out.update(gelu_y=Y, gelu_dx=DX, gelu_colsum=CS)
    LY, XH, LDX = (cp.empty((N, C), np.float16) for _ in range(3))
    RS, DW, DB = cp.empty((N, 1), np.float32), cp.empty(C, np.float32), cp.empty(C, np.float32)
    fused.layernorm_forward(dev["x"], dev["w"], dev["b"], LY, XH, RS, 1e-5)
    fused.layernorm_backward(dev["dy"], XH, RS, dev["w"], LDX, DW, DB)
    out.update(ln_y=LY, ln_dx=LDX, ln_dw=DW, ln_db=DB)
    A = dev["att"].copy()
    fused.softmax_causal_(A, 0.5)
    out.update(softmax=A)
    PR, NLL = cp.empty((N, C), np.float32), cp.empty(N, np.float32)
    fused.cross_entropy_forward(dev["x"], dev["tg"], None, PR, NLL)
    out.update(ce_nll=NLL)
    assert ran("rz_gelu_fwd_bias", "rz_gelu_bwd_bias", "rz_colsum_part", "rz_ln_fwd_center", "rz_ln_bwd_dx",
               "rz_ln_wgrad_part", "rz_softmax_exp", "rz_ce_norm")

    monkeypatch.setattr(fused, "_c", None)                      # the float64 xp formulas as the reference
    f = {k: v.astype(np.float64) for k, v in dict(x=x, b=b, w=w, dy=dy, att=att).items()}
    ref = {}
    y, s, dx, cs = tuple(np.empty((N, C)) for _ in range(3)) + (np.empty(C),)
    xx = f["x"].copy()
    fused.gelu_forward(xx, y, s, f["b"])
    fused.gelu_backward(f["dy"], xx, s, dx, None, cs)
    ref.update(gelu_y=y, gelu_dx=dx, gelu_colsum=cs)
    ly, xh, ldx = (np.empty((N, C)) for _ in range(3))
    rs, dw, db = np.empty((N, 1)), np.empty(C), np.empty(C)
    fused.layernorm_forward(f["x"], f["w"], f["b"], ly, xh, rs, 1e-5)
    fused.layernorm_backward(f["dy"], xh, rs, f["w"], ldx, dw, db)
    ref.update(ln_y=ly, ln_dx=ldx, ln_dw=dw, ln_db=db)
    a = f["att"].copy()
    fused.softmax_causal_(a, 0.5)
    ref.update(softmax=a)
    pr, nll = np.empty((N, C)), np.empty(N)
    fused.cross_entropy_forward(f["x"], tg, np.arange(N) * C + tg, pr, nll)
    ref.update(ce_nll=nll)
    bad = []
    for k, want in ref.items():
        got = out[k].get().astype(np.float64)
        err = np.abs(got - want).max() / np.abs(want).max()
        if not err <= 4e-3:                                     # float16: 2^-11 per rounding, a few roundings
            bad.append(f"{k} {err:.1e}")
    assert not bad, bad


def test_dispatch_falls_back_where_the_kernels_do_not_apply(cp, rng):
    x = cp.asarray(rng.standard_normal((8, 16)).astype(np.float32))
    assert fused.use_gpu(x, x[:, :4].copy(), outs=1)
    assert not fused.use_gpu(x[:, ::2], cp.empty((8, 8), np.float32), outs=1)     # strided
    assert not fused.use_gpu(x, x, outs=1)                                           # output overlaps input
    assert not fused.use_gpu(x, cp.empty((8, 16), np.float64), outs=1)              # mixed T
    f64 = cp.empty(8, np.float64)
    assert fused.use_gpu(x, f64, outs=1, free=(f64,))                               # a free statistic
    assert not fused.use_gpu(x, f64, outs=1)                                         # ... only when named
    rs, dw, db, w = cp.empty((8, 1), np.float32), cp.empty(16, np.float32), cp.empty(16, np.float32), x[0].copy()
    ln = dict(outs=3, free=(rs, dw, db))                       # layernorm_backward's call: dx, dw, db written
    assert fused.use_gpu(x, x.copy(), rs, w, cp.empty_like(x), dw, db, **ln)
    assert not fused.use_gpu(x, x.copy(), rs, w, x, dw, db, **ln)                    # dx is dy
    assert not fused.use_gpu(np.zeros(4, np.float32))                               # host arrays: fused.c's
    y, s = cp.empty((8, 8), np.float32), cp.empty((8, 8), np.float32)
    fused.gelu_forward(x[:, ::2], y, s)                          # strided: the xp formulas, same function
    assert not ran("rz_gelu_fwd")
    h = x.get()[:, ::2]
    want = 0.5 * h * (1 + np.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))
    assert np.abs(y.get() - want).max() < 1e-5


def test_no_c_switch_turns_the_device_kernels_off(monkeypatch, cp, rng):
    monkeypatch.setattr(fused, "_cuda", None)                    # what RINGZERO_NO_C=1 sets
    x = cp.asarray(rng.standard_normal((4, 8)).astype(np.float32))
    assert not fused.use_gpu(x)
    y, s = cp.empty((4, 8), np.float32), cp.empty((4, 8), np.float32)
    fused.gelu_forward(x, y, s)
    assert not ran("rz_gelu_fwd")


def test_elementwise_kernel_refuses_what_cupy_refuses(cp):
    """The stand-in binds parameters as CuPy does: writing a raw input does not compile, placeholders
    must agree, ``size=`` only when every array is raw (CuPy's own messages)."""
    x, y = cp.zeros(4, cp.float32), cp.zeros(4, cp.float32)
    with pytest.raises(Exception, match="rz_writes_input|error"):
        cp.ElementwiseKernel("raw T x", "T y", "x[i] = 1; y = 0", "rz_writes_input")(x, y)
    add = cp.ElementwiseKernel("T a, T b", "T c", "c = a + b", "rz_add")
    with pytest.raises(TypeError, match="Type is mismatched"):
        add(x, cp.zeros(4, cp.float64), y)
    with pytest.raises(ValueError, match="'size' can be used only"):
        add(x, x, y, size=4)
    assert np.array_equal(add(cp.ones(4, cp.float32), cp.ones(4, cp.float32), y).get(), np.full(4, 2.0))
