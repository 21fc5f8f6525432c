"""ringzero.nn.fused.attention_forward / attention_backward: the host C attention (csrc/attention.h).

Checked against references written here from the definitions, not from the kernel's blocking:
- float64 NumPy attention (scores, masked softmax, both products; the backward by the chain
  rule), to 1e-12 in float64 and float32 rounding in float32;
- float32 bits: every product element is a sequential float32 sum over its contraction index
  in ascending order, which a loop of NumPy multiplies and adds reproduces exactly;
- float64 finite differences of the whole layer (CausalSelfAttention) on the C path;
- the NumPy path where the kernel does not apply (T or D not a multiple of the vector width,
  overlapping buffers): the kernel declines and writes nothing.
"""
import math

import numpy as np
import pytest

from ringzero.nn import fused
from ringzero.nn import layers as Lr

needs_c = pytest.mark.skipif(not (fused.HAVE_C and hasattr(fused._c, "attn_fwd")),
                             reason="ringzero.nn._fused was not built with the attention kernel")


@pytest.fixture
def rng():
    return np.random.default_rng(2025)


def heads(a, H):
    """(B, T, H*D) -> (B, H, T, D) float64."""
    B, T, C = a.shape
    return a.reshape(B, T, H, C // H).transpose(0, 2, 1, 3).astype(np.float64)


def unheads(a):
    B, H, T, D = a.shape
    return a.transpose(0, 2, 1, 3).reshape(B, T, H * D)


def reference(qkv, dy, H):
    """float64: att, y, dqkv of causal attention, from the textbook formulas."""
    C = qkv.shape[-1] // 3
    q, k, v = (heads(qkv[..., i * C:(i + 1) * C], H) for i in range(3))
    T, D = q.shape[2], q.shape[3]
    s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(D)
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    e = np.exp(s - s.max(-1, keepdims=True))
    att = e / e.sum(-1, keepdims=True)
    g = heads(dy, H)
    datt = g @ v.transpose(0, 1, 3, 2)
    ds = att * (datt - (datt * att).sum(-1, keepdims=True)) / math.sqrt(D)
    dqkv = np.concatenate([unheads(ds @ k), unheads(ds.transpose(0, 1, 3, 2) @ q),
                           unheads(att.transpose(0, 1, 3, 2) @ g)], -1)
    return att, unheads(att @ v), dqkv


def run(qkv, dy, H):
    B, T, C3 = qkv.shape
    att = np.full((B, H, T, T), np.nan, qkv.dtype)
    yh = np.full((B, T, C3 // 3), np.nan, qkv.dtype)
    dqkv = np.full_like(qkv, np.nan)
    D = C3 // 3 // H
    took = (fused.attention_forward(qkv, att, yh, H, 1 / math.sqrt(D)),
            fused.attention_backward(qkv, att, dy, dqkv, H, 1 / math.sqrt(D)))
    return took, att, yh, dqkv


SHAPES = [(2, 8, 1, 8), (3, 24, 3, 16), (2, 40, 2, 24), (8, 128, 4, 32)]   # (B, T, H, D)


@needs_c
@pytest.mark.parametrize("B,T,H,D", SHAPES)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_against_float64_attention(rng, dtype, B, T, H, D):
    qkv = rng.standard_normal((B, T, 3 * H * D)).astype(dtype)
    dy = rng.standard_normal((B, T, H * D)).astype(dtype)
    took, att, yh, dqkv = run(qkv, dy, H)
    assert took == (True, True)
    tol = 1e-12 if dtype == np.float64 else 3e-6
    for name, got, want in zip(("att", "y", "dqkv"), (att, yh, dqkv), reference(qkv, dy, H)):
        err = np.abs(got.astype(np.float64) - want).max() / np.abs(want).max()
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol}"
    assert not np.triu(att, 1).any(), "entries above the diagonal must be exact zeros"


def seq_matmul(a, b):
    """a (..., M, K) @ b (..., K, N) in float32, each element summed over K in ascending order,
    one rounding per multiply and per add: the order the kernel promises."""
    acc = np.zeros(a.shape[:-1] + b.shape[-1:], np.float32)
    for i in range(a.shape[-1]):
        acc = acc + a[..., :, i:i + 1] * b[..., i:i + 1, :]
    return acc


@needs_c
@pytest.mark.parametrize("B,T,H,D", [(2, 24, 2, 16), (1, 64, 3, 8), (2, 32, 2, 16)])   # the last: AVX-512's
def test_float32_bits_are_sums_in_index_order(rng, B, T, H, D):
    """Whatever the kernel's blocking or vector width (16 floats where the CPU has AVX-512 and
    T % 16 == D % 16 == 0, else 8), each element is the sequential sum: bit for bit a NumPy loop
    of float32 multiplies and adds, with fused.softmax_causal_(_backward_) between them."""
    C, sc = H * D, np.float32(1 / math.sqrt(D))
    qkv = rng.standard_normal((B, T, 3 * C)).astype(np.float32)
    dy = rng.standard_normal((B, T, C)).astype(np.float32)
    took, att, yh, dqkv = run(qkv, dy, H)
    assert took == (True, True)
    q, k, v = (heads(qkv[..., i * C:(i + 1) * C], H).astype(np.float32) for i in range(3))
    g = heads(dy, H).astype(np.float32)
    a = np.ascontiguousarray(seq_matmul(q, k.transpose(0, 1, 3, 2)).reshape(B * H, T, T))
    fused.softmax_causal_(a, float(sc))
    a = a.reshape(B, H, T, T)
    ds = np.ascontiguousarray(seq_matmul(g, v.transpose(0, 1, 3, 2)).reshape(B * H, T, T))
    fused.softmax_causal_backward_(ds, a.reshape(B * H, T, T), float(sc))
    ds = ds.reshape(B, H, T, T)
    want = {"att": a, "y": unheads(seq_matmul(a, v)),
            "dqkv": np.concatenate([unheads(seq_matmul(ds, k)), unheads(seq_matmul(ds.transpose(0, 1, 3, 2), q)),
                                    unheads(seq_matmul(a.transpose(0, 1, 3, 2), g))], -1)}
    for name, got in (("att", att), ("y", yh), ("dqkv", dqkv)):
        np.testing.assert_array_equal(got.view(np.uint32), want[name].view(np.uint32), err_msg=name)


@needs_c
@pytest.mark.parametrize("T,D,dtype", [(20, 8, np.float32), (24, 12, np.float32), (6, 8, np.float64)])
def test_other_shapes_decline_and_write_nothing(rng, T, D, dtype):
    """T or D not a multiple of the vector width (8 floats, 4 doubles): False, buffers untouched."""
    qkv = rng.standard_normal((2, T, 3 * 2 * D)).astype(dtype)
    took, att, yh, dqkv = run(qkv, rng.standard_normal((2, T, 2 * D)).astype(dtype), 2)
    assert took == (False, False)
    assert np.isnan(att).all() and np.isnan(yh).all() and np.isnan(dqkv).all()


@needs_c
def test_overlapping_or_strided_buffers_decline(rng):
    qkv = rng.standard_normal((2, 8, 48)).astype(np.float32)
    att, yh = np.empty((2, 2, 8, 8), np.float32), np.empty((2, 8, 16), np.float32)
    assert not fused.attention_forward(qkv, att, qkv[..., :16], 2, 0.35)       # y inside qkv
    assert not fused.attention_forward(qkv, att, np.empty((2, 8, 32), np.float32)[..., :16], 2, 0.35)  # strided y
    assert fused.attention_forward(qkv, att, yh, 2, 0.35)


@pytest.fixture(params=["c", "xp"])
def path(request, monkeypatch):
    if request.param == "c":
        if not (fused.HAVE_C and hasattr(fused._c, "attn_fwd")):
            pytest.skip("ringzero.nn._fused was not built with the attention kernel")
    else:
        monkeypatch.setattr(fused, "_c", None)
    return request.param


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


def test_layer_gradients_by_finite_differences(path, rng, monkeypatch):
    """CausalSelfAttention at a shape the kernel takes (float64, T = 8, D = 4): every gradient
    against central differences of its own forward; on the C path the kernel must be the one used."""
    C, H, T = 8, 2, 8
    p = {"attn.w": rng.standard_normal((C, 3 * C)) * 0.5, "attn.b": rng.standard_normal(3 * C) * 0.1,
         "proj.w": rng.standard_normal((C, C)) * 0.5, "proj.b": rng.standard_normal(C) * 0.1}
    x = rng.standard_normal((2, T, C))
    used = []
    real = fused.attention_backward
    monkeypatch.setattr(fused, "attention_backward", lambda *a, **k: used.append(real(*a, **k)) or used[-1])
    lay = Lr.CausalSelfAttention(H)
    y, cache = lay.forward(p, x)
    R = rng.standard_normal(y.shape)
    g = {k: np.zeros_like(v) for k, v in p.items()}
    dx = lay.backward(R, cache, g)
    assert used == [path == "c"]

    def f():
        return float((lay.forward(p, x)[0] * R).sum())
    np.testing.assert_allclose(dx, fd(f, x), rtol=1e-6, atol=1e-8)
    for k in p:
        np.testing.assert_allclose(g[k], fd(f, p[k]), rtol=1e-6, atol=1e-8, err_msg=k)
