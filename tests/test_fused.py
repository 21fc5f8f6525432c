"""ringzero.nn.fused: each single-pass kernel against a float64 formula written here.

Every kernel runs on both paths, the C extension ("c") and the NumPy formulas
("xp", the fallback, forced by clearing ``fused._c``): in float64 against the
reference below to 1e-12, in float32 to float32 rounding, and the two paths
against each other at the model's shapes. The references are written from
the textbook definitions (tanh GELU, masked softmax, log-sum-exp), not from
the kernels' own arrangement (sigmoid GELU, lane sums). Gradients are also
checked by central finite differences of the forward kernels.
"""
import math

import numpy as np
import pytest

from ringzero.nn import attention, fused
from ringzero.nn import layers as Lr

K, A = math.sqrt(2 / math.pi), 0.044715
PATHS = ["c", "xp"]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    if request.param == "c":
        if not fused.HAVE_C:
            pytest.skip("ringzero.nn._fused was not built (no compiler at install time, or RINGZERO_NO_C=1)")
    else:
        monkeypatch.setattr(fused, "_c", None)
    return request.param


@pytest.fixture
def rng():
    return np.random.default_rng(25)


def ref_gelu(x):
    return 0.5 * x * (1 + np.tanh(K * (x + A * x ** 3)))


def ref_dgelu(x):
    t = np.tanh(K * (x + A * x ** 3))
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * K * (1 + 3 * A * x * x)


def ref_softmax_causal(s, scale):
    T = s.shape[-1]
    z = np.where(np.tril(np.ones((T, T), bool)), s * scale, -np.inf)
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def close(got, want, dtype):
    tol = 1e-12 if dtype == np.float64 else 2e-6
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)
    assert err <= tol, f"relative error {err:.2e} > {tol}"


def fd(f, x, eps=1e-6):
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        old = x[i]
        x[i] = old + eps
        fp = f()
        x[i] = old - eps
        fm = f()
        x[i] = old
        g[i] = (fp - fm) / (2 * eps)
    return g


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_gelu_forward_backward_and_bias_sum(path, rng, dtype):
    x0 = (rng.standard_normal((9, 37)) * 3).astype(dtype)
    x0[0, :4] = [-30, -9, 9, 30]                              # the tails: exp(-2u) under- and overflows
    b = rng.standard_normal(37).astype(dtype)
    x, y, s = x0.copy(), np.empty_like(x0), np.empty_like(x0)
    folded = fused.gelu_forward(x, y, s, b)
    v = x0.astype(np.float64) + b
    np.testing.assert_array_equal(x, x0 + b if folded else x0)   # NumPy: into x; C: x left alone
    assert folded == (path == "xp")
    close(y, ref_gelu(v), dtype)
    dy = rng.standard_normal(x.shape).astype(dtype)
    dx, cs = np.empty_like(x), np.empty(37, dtype)
    fused.gelu_backward(dy, x, s, dx, None if folded else b, cs)
    close(dx, dy * ref_dgelu(v), dtype)
    close(cs, (dy * ref_dgelu(v)).sum(0), dtype)


def test_gelu_gradient_by_finite_differences(path, rng):
    x, b = rng.standard_normal((3, 8)) * 2, rng.standard_normal(8) * 0.5
    R = rng.standard_normal(x.shape)

    def f():
        y, s = np.empty_like(x), np.empty_like(x)
        fused.gelu_forward(x.copy(), y, s, b)
        return float((y * R).sum())
    xx, s = x.copy(), np.empty_like(x)
    folded = fused.gelu_forward(xx, np.empty_like(x), s, b)
    dx = fused.gelu_backward(R, xx, s, np.empty_like(x), None if folded else b)
    np.testing.assert_allclose(dx, fd(f, x), rtol=1e-7, atol=1e-8)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_bias_residual_is_the_two_adds(path, rng, dtype):
    y, x = rng.standard_normal((5, 11)).astype(dtype), rng.standard_normal((5, 11)).astype(dtype)
    b = rng.standard_normal(11).astype(dtype)
    want = (y + b) + x                                        # each add rounded once, in this order
    fused.bias_residual(y, b, x)
    np.testing.assert_array_equal(y, want)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_layernorm_forward_backward(path, rng, dtype):
    N, C = 7, 300                                             # C not a multiple of the 8 lanes
    x = (rng.standard_normal((N, C)) * 2 + 0.7).astype(dtype)
    w, b = rng.standard_normal(C).astype(dtype), rng.standard_normal(C).astype(dtype)
    y, xhat, rstd = np.empty_like(x), np.empty_like(x), np.empty((N, 1), dtype)
    fused.layernorm_forward(x, w, b, y, xhat, rstd, 1e-5)
    x64 = x.astype(np.float64)
    mu, var = x64.mean(1, keepdims=True), x64.var(1, keepdims=True)
    h = (x64 - mu) / np.sqrt(var + 1e-5)
    close(y, h * w + b, dtype)
    close(rstd, 1 / np.sqrt(var + 1e-5), dtype)
    dy = rng.standard_normal((N, C)).astype(dtype)
    dx, dw, db = np.empty_like(x), np.empty(C, dtype), np.empty(C, dtype)
    fused.layernorm_backward(dy, xhat, rstd, w, dx, dw, db)
    # d/dx of sum(dy * y) by the closed form of the normalization's Jacobian
    g = dy * w
    want = (g - g.mean(1, keepdims=True) - h * (g * h).mean(1, keepdims=True)) / np.sqrt(var + 1e-5)
    close(dx, want, dtype)
    close(dw, (dy * h).sum(0), dtype)
    close(db, dy.astype(np.float64).sum(0), dtype)


def test_layernorm_gradient_by_finite_differences(path, rng):
    x, w, b = rng.standard_normal((3, 10)), rng.standard_normal(10), rng.standard_normal(10)
    R = rng.standard_normal(x.shape)

    def f():
        y, h, r = np.empty_like(x), np.empty_like(x), np.empty((3, 1))
        return float((fused.layernorm_forward(x, w, b, y, h, r, 1e-5) * R).sum())
    y, h, r = np.empty_like(x), np.empty_like(x), np.empty((3, 1))
    fused.layernorm_forward(x, w, b, y, h, r, 1e-5)
    dx, dw, db = np.empty_like(x), np.empty(10), np.empty(10)
    fused.layernorm_backward(R, h, r, w, dx, dw, db)
    np.testing.assert_allclose(dx, fd(f, x), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(dw, fd(f, w), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(db, fd(f, b), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("T", [21, 24, 128])      # 24, 128: the C kernel's whole-vector float32 rows
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_softmax_causal_forward_backward(path, rng, dtype, T):
    R, scale = 3, 0.37
    s = (rng.standard_normal((R, T, T)) * 4).astype(dtype)
    att = s.copy()
    if path == "c":     # the C kernel never reads above the diagonal (attention leaves those tiles unset there)
        att[:, np.triu_indices(T, 1)[0], np.triu_indices(T, 1)[1]] = np.nan
    fused.softmax_causal_(att, scale)
    p = ref_softmax_causal(s.astype(np.float64), scale)
    close(att, p, dtype)
    assert not np.triu(att, 1).any(), "entries above the diagonal must be exact zeros"
    g = rng.standard_normal((R, T, T)).astype(dtype)
    d = g.copy()
    fused.softmax_causal_backward_(d, att, scale)
    close(d, p * (g - (g * p).sum(-1, keepdims=True)) * scale, dtype)


@pytest.mark.parametrize("T", [8, 24, 128])
def test_softmax_causal_vector_rows_are_the_scalar_rows_bits(rng, T):
    """float32, T % 8 == 0 takes fused.c's whole-vector rows, T + 1 its scalar loops; row t reads
    only j <= t, so the first T rows of a (T+1)-wide problem are the T-wide problem's, bit for bit."""
    if not fused.HAVE_C:
        pytest.skip("ringzero.nn._fused was not built")
    s = (rng.standard_normal((2, T + 1, T + 1)) * 4).astype(np.float32)
    wide, narrow = s.copy(), np.ascontiguousarray(s[:, :T, :T])
    fused.softmax_causal_(wide, 0.37)
    fused.softmax_causal_(narrow, 0.37)
    np.testing.assert_array_equal(narrow.view(np.uint32), wide[:, :T, :T].view(np.uint32))


def test_softmax_causal_gradient_by_finite_differences(path, rng):
    s, scale = rng.standard_normal((2, 6, 6)), 0.8
    R = rng.standard_normal(s.shape)

    def f():
        return float((fused.softmax_causal_(s.copy(), scale) * R).sum())
    att = fused.softmax_causal_(s.copy(), scale)
    d = fused.softmax_causal_backward_(R.copy(), att, scale)
    np.testing.assert_allclose(d, fd(f, s), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_cross_entropy_forward(path, rng, dtype):
    N, V = 13, 50
    lg = (rng.standard_normal((N, V)) * 5).astype(dtype)
    t = rng.integers(0, V, N)
    at = np.arange(N) * V + t
    pr, nll = np.empty((N, V), dtype), np.empty(N, dtype)
    fused.cross_entropy_forward(lg, t, at, pr, nll)
    l64 = lg.astype(np.float64)
    m = l64.max(1, keepdims=True)
    lse = np.log(np.exp(l64 - m).sum(1)) + m[:, 0]
    close(nll, lse - l64[np.arange(N), t], dtype)
    close(pr, np.exp(l64 - lse[:, None]), dtype)


def test_rows_add_at_is_np_add_at_bitwise(path, rng):
    g = rng.standard_normal((9, 6)).astype(np.float32)
    ids = rng.integers(0, 9, 40)
    ids[:5] = 4                                               # repeats: summed in order
    d = rng.standard_normal((40, 6)).astype(np.float32)
    want = g.copy()
    np.add.at(want, ids, d)
    fused.rows_add_at(g, ids, d)
    np.testing.assert_array_equal(g.view(np.uint32), want.view(np.uint32))


@pytest.mark.skipif(not fused.HAVE_C, reason="ringzero.nn._fused was not built")
def test_c_and_xp_paths_agree_in_float32_at_the_models_shapes(rng, monkeypatch):
    """Both paths on the same float32 inputs: equal to float32 rounding (not bitwise)."""
    N, C, T = 256, 256, 128
    x = rng.standard_normal((N, 4 * C)).astype(np.float32)
    b = rng.standard_normal(4 * C).astype(np.float32)
    s = rng.standard_normal((8, T, T)).astype(np.float32) * 3
    lnx, w = rng.standard_normal((N, C)).astype(np.float32), rng.standard_normal(C).astype(np.float32)

    def run():
        out = {}
        xx, y, sg = x.copy(), np.empty_like(x), np.empty_like(x)
        folded = fused.gelu_forward(xx, y, sg, b)
        out["gelu"] = y.copy()
        dx, cs = np.empty_like(x), np.empty(4 * C, np.float32)
        out["dgelu"] = fused.gelu_backward(x, xx, sg, dx, None if folded else b, cs).copy()
        out["dbias"] = cs.copy()
        att = fused.softmax_causal_(s.copy(), 0.125)
        out["att"] = att.copy()
        out["datt"] = fused.softmax_causal_backward_(s.copy(), att, 0.125).copy()
        y, h, r = np.empty_like(lnx), np.empty_like(lnx), np.empty((N, 1), np.float32)
        out["ln"] = fused.layernorm_forward(lnx, w, w, y, h, r, 1e-5).copy()
        dx, dw, db = np.empty_like(lnx), np.empty(C, np.float32), np.empty(C, np.float32)
        out["dln"] = fused.layernorm_backward(lnx, h, r, w, dx, dw, db).copy()
        out["dlnw"] = dw.copy()
        return out
    c = run()
    monkeypatch.setattr(fused, "_c", None)
    xp = run()
    for k in c:
        scale = np.abs(xp[k]).max()
        err = np.abs(c[k].astype(np.float64) - xp[k]).max() / scale
        assert err <= 1e-5, f"{k}: C and NumPy paths differ by {err:.2e} of the largest value"


@pytest.mark.parametrize("H", [1, 2])
def test_attention_causal_row_blocks(path, rng, monkeypatch, H):
    """The host products taken per causal row block (tiles above the diagonal skipped): the same
    layer's float64 gradients by finite differences, and its output equal to one full block's."""
    monkeypatch.setattr(attention.CausalSelfAttention, "ROW_BLOCK", 3)   # T = 7: blocks 3, 3, 1
    C, T = 4, 7
    p = {"attn.w": rng.standard_normal((C, 3 * C)) * 0.5, "attn.b": rng.standard_normal(3 * C) * 0.1,
         "proj.w": rng.standard_normal((C, C)) * 0.5, "proj.b": rng.standard_normal(C) * 0.1}
    x = rng.standard_normal((2, T, C))
    lay = Lr.CausalSelfAttention(H)
    if path == "c":
        assert len(lay._row_blocks(T, np.empty((2, H, T, T)))) == 3
    y, cache = lay.forward(p, x)
    R = rng.standard_normal(y.shape)
    g = {k: np.zeros_like(v) for k, v in p.items()}
    dx = lay.backward(R, cache, g)

    def f():
        return float((lay.forward(p, x)[0] * R).sum())
    np.testing.assert_allclose(dx, fd(f, x), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(g["attn.w"], fd(f, p["attn.w"]), rtol=1e-6, atol=1e-8)
    monkeypatch.setattr(attention.CausalSelfAttention, "ROW_BLOCK", 1000)
    np.testing.assert_allclose(Lr.CausalSelfAttention(H).forward(p, x)[0], y, rtol=1e-13, atol=1e-13)


@pytest.mark.skipif(not fused.HAVE_C, reason="ringzero.nn._fused was not built")
def test_overlapping_buffers_take_the_numpy_path(rng):
    """The C kernels' pointers are restrict: an output that overlaps an input goes to NumPy."""
    x = rng.standard_normal((4, 6)).astype(np.float32)
    assert fused.use_c(x, np.empty_like(x), outs=1)
    assert not fused.use_c(x, x, outs=1)
    assert not fused.use_c(x, x[1:], outs=1)
    s = x.copy()
    fused.gelu_forward(x.copy(), s, s)                        # y and s the same buffer: the NumPy formulas
    want = np.empty_like(x)
    fused.gelu_forward(x.copy(), want, np.empty_like(x))
    np.testing.assert_allclose(s, want, rtol=1e-6, atol=1e-7)
