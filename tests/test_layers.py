"""Every layer's hand-written backward against float64 central finite differences.

The reference is independent of the code under test: it only calls forward
(a scalar probe sum(y * R) for a fixed random R) at perturbed inputs. Shapes
are tiny so every coordinate is checked.
"""
import os
import sys

import numpy as np
import pytest

from ringzero.nn import layers as Lr

sys.path.insert(0, os.path.dirname(__file__))

EPS = 1e-6
TOL = 1e-6


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    den = max(np.linalg.norm(a), np.linalg.norm(b), 1e-30)
    return np.linalg.norm(a - b) / den


def fd_grad(f, arr):
    """Central differences of scalar f() w.r.t. every element of arr (in place)."""
    g = np.zeros(arr.shape, np.float64)
    flat, gf = arr.reshape(-1), g.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + EPS
        fp = f()
        flat[i] = old - EPS
        fm = f()
        flat[i] = old
        gf[i] = (fp - fm) / (2 * EPS)
    return g


def check_layer(layer, p, x, rng, x_is_input=True, extra=None):
    """Analytic (backward) vs numeric gradients of sum(forward(p, x) * R)."""
    y, cache = layer.forward(p, x)
    R = rng.standard_normal(np.shape(y))
    g = {k: np.zeros_like(v) for k, v in p.items()}
    dx = layer.backward(R.copy(), cache, g)

    def f():
        yy, _ = layer.forward(p, x)
        return float(np.sum(yy * R))

    errs = {}
    for k, v in p.items():
        errs[k] = rel_err(g[k], fd_grad(f, v))
    if x_is_input:
        errs["x"] = rel_err(dx, fd_grad(f, x))
    bad = {k: e for k, e in errs.items() if not e <= TOL}
    assert not bad, f"{type(layer).__name__}: relative errors above {TOL}: {bad}"
    return errs


@pytest.fixture
def rng():
    return np.random.default_rng(7)


def test_linear(rng):
    p = {"w": rng.standard_normal((5, 4)), "b": rng.standard_normal(4)}
    check_layer(Lr.Linear(), p, rng.standard_normal((2, 3, 5)), rng)


def test_linear_adds_into_grads(rng):
    """Backward ADDS: a pre-filled gradient view keeps its old contents plus the new term."""
    lay = Lr.Linear()
    p = {"w": rng.standard_normal((3, 2)), "b": rng.standard_normal(2)}
    x, dy = rng.standard_normal((4, 3)), rng.standard_normal((4, 2))
    _, c = lay.forward(p, x)
    g0 = {"w": rng.standard_normal((3, 2)), "b": rng.standard_normal(2)}
    g = {k: v.copy() for k, v in g0.items()}
    lay.backward(dy, c, g)
    np.testing.assert_allclose(g["w"], g0["w"] + x.T @ dy, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(g["b"], g0["b"] + dy.sum(0), rtol=1e-12, atol=1e-12)


def test_unembed(rng):
    check_layer(Lr.Unembed(), {"w": rng.standard_normal((7, 4))}, rng.standard_normal((5, 4)), rng)


def test_layernorm(path, rng):
    p = {"w": 1 + 0.1 * rng.standard_normal(6), "b": rng.standard_normal(6)}
    check_layer(Lr.LayerNorm(), p, rng.standard_normal((2, 3, 6)) * 2 + 0.5, rng)


def test_layernorm_matches_formula(path, rng):
    x = rng.standard_normal((4, 8))
    p = {"w": rng.standard_normal(8), "b": rng.standard_normal(8)}
    y, _ = Lr.LayerNorm().forward(p, x)
    ref = (x - x.mean(1, keepdims=True)) / np.sqrt(x.var(1, keepdims=True) + 1e-5) * p["w"] + p["b"]
    np.testing.assert_allclose(y, ref, rtol=1e-12, atol=1e-12)


def test_gelu(path, rng):
    check_layer(Lr.GELU(), {}, rng.standard_normal((3, 7)) * 2, rng)


def test_gelu_matches_formula(path, rng):
    x = rng.standard_normal(50) * 3
    y, _ = Lr.GELU().forward({}, x)
    ref = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
    np.testing.assert_allclose(y, ref, rtol=1e-13, atol=1e-13)


def test_residual(rng):
    lay = Lr.Residual()
    x, r = rng.standard_normal((2, 3)), rng.standard_normal((2, 3))
    y, c = lay.forward(None, (x, r))
    np.testing.assert_array_equal(y, x + r)
    dy = rng.standard_normal((2, 3))
    dx, dr = lay.backward(dy, c, None)
    np.testing.assert_array_equal(dx, dy)
    np.testing.assert_array_equal(dr, dy)
    with pytest.raises(ValueError, match=r"\(2, 3\) and \(3, 2\)"):
        lay.forward(None, (x, r.T))


def test_embedding(path, rng):
    p = {"wte": rng.standard_normal((9, 4)), "wpe": rng.standard_normal((6, 4))}
    idx = rng.integers(0, 9, (3, 5))
    idx[0, :2] = 3                          # repeated tokens: the scatter-add must accumulate
    check_layer(Lr.Embedding(), p, idx, rng, x_is_input=False)


def test_embedding_errors(rng):
    p = {"wte": np.zeros((9, 4)), "wpe": np.zeros((6, 4))}
    with pytest.raises(ValueError, match="T=7 exceeds block_size=6"):
        Lr.Embedding().forward(p, np.zeros((1, 7), np.int64))
    with pytest.raises(ValueError, match=r"\[0, 9\)"):
        Lr.Embedding().forward(p, np.full((1, 2), 9))
    with pytest.raises(TypeError, match="integer idx"):
        Lr.Embedding().forward(p, np.zeros((1, 2)))


@pytest.mark.parametrize("H", [1, 2])
def test_attention(path, rng, H):
    C = 4
    p = {"attn.w": rng.standard_normal((C, 3 * C)) * 0.5, "attn.b": rng.standard_normal(3 * C) * 0.1,
         "proj.w": rng.standard_normal((C, C)) * 0.5, "proj.b": rng.standard_normal(C) * 0.1}
    check_layer(Lr.CausalSelfAttention(H), p, rng.standard_normal((2, 5, C)), rng)


def test_attention_is_causal(rng):
    """Changing a later position must not change earlier outputs."""
    C = 4
    p = {"attn.w": rng.standard_normal((C, 3 * C)), "attn.b": np.zeros(3 * C),
         "proj.w": rng.standard_normal((C, C)), "proj.b": np.zeros(C)}
    x = rng.standard_normal((1, 6, C))
    y1 = Lr.CausalSelfAttention(2).forward(p, x)[0].copy()
    x[0, 4:] += 1.0
    y2 = Lr.CausalSelfAttention(2).forward(p, x)[0]
    np.testing.assert_array_equal(y1[0, :4], y2[0, :4])
    assert not np.allclose(y1[0, 4:], y2[0, 4:])


def test_cross_entropy(path, rng):
    lay = Lr.SoftmaxCrossEntropy()
    logits = rng.standard_normal((6, 5)) * 3
    t = rng.integers(0, 5, 6)
    loss, c = lay.forward(None, (logits, t))
    # independent reference: log-sum-exp written directly
    ref = np.mean(np.log(np.exp(logits).sum(1)) - logits[np.arange(6), t])
    assert abs(float(loss) - ref) < 1e-12
    scale = 3.0
    dl = lay.backward(scale, c, None)

    def f():
        return scale * float(lay.forward(None, (logits, t))[0])
    assert rel_err(dl, fd_grad(f, logits)) <= TOL


def test_cross_entropy_stable_and_checked(path):
    lay = Lr.SoftmaxCrossEntropy()
    logits = np.array([[1000.0, 0.0], [0.0, -1000.0]])
    loss, _ = lay.forward(None, (logits, np.array([0, 0])))
    assert np.isfinite(loss) and abs(float(loss)) < 1e-12
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        lay.forward(None, (logits, np.array([0, 2])))
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        lay.forward(None, (logits, np.array([0, 1, 1])))


def test_linear_shape_error():
    with pytest.raises(ValueError, match=r"input width 5, got x of shape \(2, 4\)"):
        Lr.Linear().forward({"w": np.zeros((5, 3)), "b": np.zeros(3)}, np.zeros((2, 4)))


def test_pool_reuses_buffers():
    pool = Lr.Pool()
    a = pool.get(("t", "y"), (3, 4), np.float32)
    b = pool.get(("t", "y"), (3, 4), np.float32)
    c = pool.get(("t", "y"), (3, 5), np.float32)
    assert a is b and c is not a and pool.allocs == 2
    fresh = Lr.Pool(reuse=False)
    assert fresh.get("k", (2,), np.float32) is not fresh.get("k", (2,), np.float32)


def test_float32_stats_under_float16():
    """float16 inputs: layernorm statistics accumulate in float32 (no overflow of x^2 sums)."""
    x = (np.arange(2 * 512, dtype=np.float32).reshape(2, 512) % 97 * 9.0).astype(np.float16)  # |x - mean| > 256
    p = {"w": np.ones(512, np.float16), "b": np.zeros(512, np.float16)}
    y, _ = Lr.LayerNorm().forward(p, x)
    x64 = x.astype(np.float64)
    ref = (x64 - x64.mean(1, keepdims=True)) / np.sqrt(x64.var(1, keepdims=True) + 1e-5)
    assert y.dtype == np.float16 and np.abs(y - ref).max() < 1e-2


# ---- CuPy: the same code on the GPU gives the same numbers (skipped without CuPy) ----
def _cupy():
    from conftest import have_cupy
    if not have_cupy():
        pytest.skip("needs CuPy and a CUDA device")
    import cupy
    return cupy


def _layer_cases(rng):
    C = 8
    att = {"attn.w": rng.standard_normal((C, 3 * C)) * 0.5, "attn.b": rng.standard_normal(3 * C) * 0.1,
           "proj.w": rng.standard_normal((C, C)) * 0.5, "proj.b": rng.standard_normal(C) * 0.1}
    return [
        (Lr.Linear, {"w": rng.standard_normal((C, 5)), "b": rng.standard_normal(5)}, rng.standard_normal((2, 3, C))),
        (Lr.Unembed, {"w": rng.standard_normal((7, C))}, rng.standard_normal((6, C))),
        (Lr.LayerNorm, {"w": rng.standard_normal(C), "b": rng.standard_normal(C)}, rng.standard_normal((2, 3, C))),
        (Lr.GELU, {}, rng.standard_normal((4, C))),
        (lambda: Lr.CausalSelfAttention(2), att, rng.standard_normal((2, 5, C))),
        (Lr.Embedding, {"wte": rng.standard_normal((9, C)), "wpe": rng.standard_normal((6, C))},
         rng.integers(0, 9, (2, 6))),
    ]


@pytest.mark.gpu
def test_layers_cupy_match_numpy(rng):
    _match_numpy(_cupy(), rng)


@pytest.fixture
def standin(monkeypatch):
    import cupy_standin
    return cupy_standin.install(monkeypatch)


@pytest.mark.standin
def test_layers_standin_match_numpy(standin, rng):
    """The device code paths (strict CuPy stand-in: CuPy's API, NumPy's numbers) against NumPy."""
    _match_numpy(standin, rng)


def _match_numpy(cp, rng):
    for make, p, x in _layer_cases(rng):
        outs = []
        for xp in (np, cp):
            lay = make()
            pp = {k: xp.asarray(v) for k, v in p.items()}
            y, c = lay.forward(pp, xp.asarray(x))
            R = xp.asarray(np.linspace(-1, 1, int(np.prod(y.shape))).reshape(y.shape))
            g = {k: xp.zeros_like(v) for k, v in pp.items()}
            dx = lay.backward(R, c, g)
            res = [y] + [g[k] for k in sorted(g)] + ([] if dx is None else [dx])
            outs.append([cp.asnumpy(a) if xp is cp else a.copy() for a in res])
        for a, b in zip(*outs):
            np.testing.assert_allclose(b, a, rtol=1e-10, atol=1e-12, err_msg=str(make))
    lg = rng.standard_normal((6, 5))
    t = rng.integers(0, 5, 6)
    l_np, c_np = Lr.SoftmaxCrossEntropy().forward(None, (lg, t))
    lay = Lr.SoftmaxCrossEntropy()
    l_cp, c_cp = lay.forward(None, (cp.asarray(lg), cp.asarray(t)))
    assert abs(float(l_cp) - float(l_np)) < 1e-12
    np.testing.assert_allclose(cp.asnumpy(lay.backward(2.0, c_cp, None)),
                               Lr.SoftmaxCrossEntropy().backward(2.0, c_np, None), rtol=1e-12, atol=1e-14)


@pytest.mark.gpu
def test_mixed_modules_is_type_error(rng):
    _mixed(_cupy())


@pytest.mark.standin
def test_mixed_modules_is_type_error_standin(standin):
    _mixed(standin)


def _mixed(cp):
    with pytest.raises(TypeError, match="mixed array modules"):
        Lr.Linear().forward({"w": cp.zeros((3, 2)), "b": cp.zeros(2)}, np.zeros((1, 3)))


# ---- the embedding gradient: a deterministic segmented sum -----------------------------
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_segment_sum_rows_is_the_float64_sum_rounded_once(rng, dtype):
    """g[ids[i]] += d[i] with repeats: the exact (float64) sum rounded once,
    where np.add.at in float16 rounds after every add."""
    V, C, N = 11, 6, 500
    ids = rng.integers(0, V, N)
    ids[:40] = 3                                            # one id repeated many times
    d = rng.standard_normal((N, C)).astype(dtype)
    g0 = rng.standard_normal((V, C)).astype(dtype)
    ref = g0.astype(np.float64)
    np.add.at(ref, ids, d.astype(np.float64))               # the reference: float64 throughout
    g = g0.copy()
    Lr.segment_sum_rows(g, ids, d)
    # half a unit in the last place of the rounding, plus the float64 prefix sums' own error
    tol = 0.5 * np.spacing(np.abs(ref).astype(dtype)).astype(np.float64) + 1e-12 * np.abs(ref).max()
    err = np.abs(g.astype(np.float64) - ref)
    assert np.all(err <= tol), f"max error {err.max():.3g}, worst tolerance {tol.min():.3g}"
    if dtype == np.float16:                                 # what the fp16 add-per-occurrence loses
        naive = g0.copy()
        np.add.at(naive, ids, d)
        assert np.abs(naive - ref).mean() > 2 * np.abs(g - ref).mean()


@pytest.mark.standin
def test_segment_sum_rows_same_bits_on_device_and_every_run(standin, rng):
    """Written once with xp: the device path gives NumPy's bits, run after run."""
    V, C, N = 7, 5, 300
    ids = rng.integers(0, V, N)
    d = rng.standard_normal((N, C)).astype(np.float16)
    g0 = rng.standard_normal((V, C)).astype(np.float32)
    host = g0.copy()
    Lr.segment_sum_rows(host, ids, d.astype(np.float32))
    runs = []
    for _ in range(3):
        g = standin.asarray(g0)
        Lr.segment_sum_rows(g, standin.asarray(ids), standin.asarray(d.astype(np.float32)),
                            Lr.Layer(Lr.Pool()))
        runs.append(g.get())
    assert all(np.array_equal(r.view(np.uint32), host.view(np.uint32)) for r in runs)


def test_embedding_default_grad_sum_on_host_is_add_at(rng):
    """The CPU path is unchanged: NumPy's embedding gradient is np.add.at's, bit for bit."""
    p = {"wte": rng.standard_normal((9, 4)).astype(np.float32), "wpe": rng.standard_normal((6, 4)).astype(np.float32)}
    idx = rng.integers(0, 9, (3, 5))
    lay = Lr.Embedding()
    _, c = lay.forward(p, idx)
    dy = rng.standard_normal((3, 5, 4)).astype(np.float32)
    g = {"wte": np.ones((9, 4), np.float32), "wpe": np.zeros((6, 4), np.float32)}
    lay.backward(dy, c, g)
    want = np.ones((9, 4), np.float32)
    np.add.at(want, idx.reshape(-1), dy.reshape(-1, 4))
    assert np.array_equal(g["wte"].view(np.uint32), want.view(np.uint32))


# ---- attention on the device: contiguous heads, one strided-batched GEMM per product ----------
@pytest.mark.standin
def test_attention_device_path_no_upcast_copies_and_no_steady_allocation(standin, rng):
    """float16 attention under the stand-in: no cupy.matmul on >2-D arrays (which would copy
    fp16 operands to fp32 and land results in temporaries), no new device allocation in the
    second step beyond the softmax/bias reductions' (B, H, T, 1)-sized temporaries, and the
    result close to float64 NumPy."""
    import cupy_standin
    B, T, C, H = 2, 8, 16, 4
    p = {"attn.w": rng.standard_normal((C, 3 * C)) * 0.3, "attn.b": rng.standard_normal(3 * C) * 0.1,
         "proj.w": rng.standard_normal((C, C)) * 0.3, "proj.b": rng.standard_normal(C) * 0.1}
    x = rng.standard_normal((B, T, C))
    R = rng.standard_normal((B, T, C))
    ref = Lr.CausalSelfAttention(H)
    y64, c64 = ref.forward(p, x)
    g64 = {k: np.zeros_like(v) for k, v in p.items()}
    dx64 = ref.backward(R, c64, g64)
    lay = Lr.CausalSelfAttention(H, Lr.Pool())
    pd = {k: standin.asarray(v.astype(np.float16)) for k, v in p.items()}
    gd = {k: standin.zeros(v.shape, np.float16) for k, v in p.items()}
    xd, Rd = standin.asarray(x.astype(np.float16)), standin.asarray(R.astype(np.float16))
    for step in range(2):
        before = cupy_standin.stats()
        y, c = lay.forward(pd, xd)
        dx = lay.backward(Rd, c, gd)
        after = cupy_standin.stats()
    assert after["matmul_nd_copies"] == 0
    big = B * H * T * T * 2                                  # one (B, H, T, T) float16 buffer
    assert after["high_bytes"] == before["high_bytes"], "the device pool grew in the second step"
    assert (after["allocs"] - before["allocs"]) * 512 < big * 4, "per-step device allocations"
    for got, want in ((y, y64), (dx, dx64), (gd["attn.w"], 2 * g64["attn.w"])):
        got = got.get().astype(np.float64)
        assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max(), np.abs(got - want).max()
