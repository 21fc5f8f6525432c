# ruff: noqa: F811 (path is test_fused's fixture, imported so that pytest finds it)
"""The Llama layers' hand-written backward against float64 central finite differences.

RMSNorm, rotary (plain and with Llama 3's scaling), SwiGLU and grouped-query
attention (2 query heads per KV head, with and without the q/k/v bias). The
reference only calls forward at perturbed inputs (``test_layers.check_layer``:
the probe sum(y * R) for a fixed random R). The rotary frequencies are also
compared with transformers' own (its rope init functions), when it is installed.
"""
import importlib.util
import os
import sys

import numpy as np
import pytest

from ringzero.nn import fused
from ringzero.nn.gqa import GroupedQueryAttention
from ringzero.nn.llama_config import RopeScaling
from ringzero.nn.rmsnorm import RMSNorm
from ringzero.nn.rotary import Rotary, inv_freq
from ringzero.nn.swiglu import SwiGLU

sys.path.insert(0, os.path.dirname(__file__))
from test_fused import path  # noqa: E402, F401 (RMSNorm and SwiGLU on both paths: fused.c's kernels, xp's passes)
from test_layers import check_layer  # noqa: E402


@pytest.fixture
def rng():
    return np.random.default_rng(11)


class _RotaryLayer:
    """Rotary as a forward(p, x)/backward(dy, cache, g) layer: on copies (it works in place)."""

    def __init__(self, rot):
        self.rot = rot

    def forward(self, p, x):
        return self.rot.forward(x.copy()), None

    def backward(self, dy, cache, g):
        return self.rot.backward(dy.copy())


def test_rmsnorm(rng, path):
    p = {"w": rng.standard_normal(6)}
    check_layer(RMSNorm(1e-5), p, rng.standard_normal((2, 3, 6)), rng)


def test_rmsnorm_is_the_formula(rng, path):
    x, w = rng.standard_normal((4, 8)), rng.standard_normal(8)
    y, _ = RMSNorm(1e-6).forward({"w": w}, x)
    ref = w * x / np.sqrt((x * x).mean(axis=1, keepdims=True) + 1e-6)
    assert np.abs(y - ref).max() <= 1e-14


@pytest.mark.parametrize("scaling", [None, RopeScaling(8.0, 1.0, 4.0, 16)])
def test_rotary(rng, scaling, path):
    check_layer(_RotaryLayer(Rotary(8, 100.0, scaling)), {}, rng.standard_normal((2, 5, 3, 8)), rng)


def test_rotary_is_a_rotation_by_position(rng, path):
    """q_t . k_s after the rotation depends on t - s only (the property rotary exists for)."""
    rot = Rotary(8, 10000.0)
    q, k = rng.standard_normal(8), rng.standard_normal(8)
    qs = rot.forward(np.broadcast_to(q, (1, 12, 1, 8)).copy())[0, :, 0]
    ks = rot.forward(np.broadcast_to(k, (1, 12, 1, 8)).copy())[0, :, 0]
    assert abs(qs[7] @ ks[3] - qs[5] @ ks[1]) <= 1e-6 * abs(qs[7] @ ks[3]) + 1e-6
    assert abs(np.linalg.norm(qs[9]) - np.linalg.norm(q)) <= 1e-6


def test_swiglu(rng, path):
    check_layer(SwiGLU(), {}, rng.standard_normal((2, 3, 10)), rng)


def test_swiglu_is_the_formula(rng, path):
    gu = rng.standard_normal((3, 8))
    y, _ = SwiGLU().forward(None, gu)
    g, u = gu[:, :4], gu[:, 4:]
    assert np.abs(y - g / (1 + np.exp(-g)) * u).max() <= 1e-15


@pytest.mark.skipif(not fused.HAVE_C, reason="ringzero.nn._fused was not built")
def test_c_and_xp_paths_agree_in_float32_at_smollm2_shapes(rng, monkeypatch):
    """fused.c's RMSNorm and SwiGLU against the xp passes on the same float32 inputs (256 tokens, C = 576,
    F = 1536): equal to float32 rounding, not bitwise (their own expf, their own order of sums)."""
    N, C, F = 256, 576, 1536
    x, w = rng.standard_normal((N, C)).astype(np.float32), rng.standard_normal(C).astype(np.float32)
    dy = rng.standard_normal((N, C)).astype(np.float32)
    gu, dyf = (rng.standard_normal((N, 2 * F)) * 3).astype(np.float32), rng.standard_normal((N, F)).astype(np.float32)

    def run():
        out = {}
        rn, g = RMSNorm(1e-5), {"w": np.zeros(C, np.float32)}
        y, cache = rn.forward({"w": w}, x)
        out["rms"] = y.copy()
        out["drms"] = rn.backward(dy, cache, g).copy()
        out["drms_w"] = g["w"]
        sw = SwiGLU()
        y, cache = sw.forward(None, gu)
        out["swiglu"] = y.copy()
        out["dswiglu"] = sw.backward(dyf, cache).copy()
        return out
    c = run()
    monkeypatch.setattr(fused, "_c", None)
    xp = run()
    for k in c:
        err = np.abs(c[k].astype(np.float64) - xp[k]).max() / np.abs(xp[k]).max()
        assert err <= 1e-5, f"{k}: C and NumPy paths differ by {err:.2e} of the largest value"
        assert err > 0, f"{k}: the C path did not run (bitwise the NumPy passes)"


@pytest.mark.skipif(not fused.HAVE_C, reason="ringzero.nn._fused was not built")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_c_rotary_on_the_qkv_columns_is_the_complex_rotation_and_the_xp_bits(rng, dtype, monkeypatch):
    """fused.c's rope on q|k, the first H + K heads of each row of a (B, T, (H+2K)·D) buffer (smollm2's
    9 + 3 + 3 heads of 64): (x1 + i x2) e^{i t f} in complex128 is the reference, and the xp passes give
    the same bits (each product rounded before its sum). v, the buffer's last K heads, is left alone."""
    B, T, H, K, D = 2, 256, 9, 3, 64
    rot = Rotary(D, 10000.0)
    qkv = rng.standard_normal((B, T, (H + 2 * K) * D)).astype(dtype)

    def qk(a):
        return a.reshape(B, T, H + 2 * K, D)[:, :, :H + K]
    c_fwd = qkv.copy()
    assert fused.rope_(qk(c_fwd), *rot.tables(T, dtype, np), +1), "the C kernel did not take the q|k view"
    c_bwd = qkv.copy()
    rot.backward(qk(c_bwd))
    assert np.array_equal(c_fwd[..., (H + K) * D:], qkv[..., (H + K) * D:])      # v untouched
    x = qk(qkv).astype(np.float64)
    angle = (np.arange(T, dtype=np.float32)[:, None] * rot.f)[:, None, :]    # float32, cos/sin too, as HF
    z = (x[..., :D // 2] + 1j * x[..., D // 2:]) * (np.cos(angle).astype(np.float64) + 1j * np.sin(angle))
    ref = np.concatenate([z.real, z.imag], axis=-1)
    tol = 1e-6 if dtype == np.float32 else 1e-13
    assert np.abs(qk(c_fwd) - ref).max() <= tol * np.abs(ref).max()
    monkeypatch.setattr(fused, "_c", None)
    xp_fwd, xp_bwd = qkv.copy(), qkv.copy()
    rot.forward(qk(xp_fwd))
    rot.backward(qk(xp_bwd))
    assert np.array_equal(c_fwd, xp_fwd) and np.array_equal(c_bwd, xp_bwd)


@pytest.mark.skipif(not fused.HAVE_C, reason="ringzero.nn._fused was not built")
def test_c_rotary_refuses_a_view_past_its_buffer():
    base = np.zeros((4, 8))
    cos = sin = np.ones((4, 2))
    with pytest.raises(ValueError, match="runs past"):
        fused._c.rope(base, 8, cos, sin, 4, 4, 8, 2, 4, 1, True)     # one element past the end
    fused._c.rope(base, 0, cos, sin, 4, 4, 8, 2, 4, 1, True)         # the whole buffer: in bounds


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("H,K", [(4, 2), (2, 2), (3, 1)])
def test_gqa(rng, bias, H, K):
    C, D, T = 6, 4, 5
    W = (H + 2 * K) * D
    p = {"attn.w": rng.standard_normal((C, W)) * 0.5, "proj.w": rng.standard_normal((H * D, C))}
    if bias:
        p["attn.b"] = rng.standard_normal(W) * 0.5
    att = GroupedQueryAttention(H, K, D, Rotary(D, 50.0))
    check_layer(att, p, rng.standard_normal((2, T, C)), rng)


def test_gqa_equals_attention_with_k_v_repeated(rng):
    """Independent of the grouping: repeat each KV head G times and run plain per-head attention."""
    H, K, D, T, C = 4, 2, 4, 6, 5
    p = {"attn.w": rng.standard_normal((C, (H + 2 * K) * D)), "proj.w": rng.standard_normal((H * D, C))}
    x = rng.standard_normal((1, T, C))
    y, _ = GroupedQueryAttention(H, K, D, Rotary(D, 50.0)).forward(p, x)
    qkv = (x @ p["attn.w"]).reshape(T, H + 2 * K, D)
    rot = Rotary(D, 50.0)
    q, k, v = (rot.forward(qkv[None, :, :H].copy())[0], rot.forward(qkv[None, :, H:H + K].copy())[0],
               qkv[:, H + K:])
    out = np.zeros((T, H, D))
    for h in range(H):
        kv = h // (H // K)
        s = q[:, h] @ k[:, kv].T / np.sqrt(D) + np.triu(np.full((T, T), -np.inf), 1)
        a = np.exp(s - s.max(axis=1, keepdims=True))
        out[:, h] = (a / a.sum(axis=1, keepdims=True)) @ v[:, kv]
    assert np.abs(y[0] - out.reshape(T, H * D) @ p["proj.w"]).max() <= 1e-12


@pytest.mark.skipif(not (importlib.util.find_spec("torch") and importlib.util.find_spec("transformers")),
                    reason="needs torch and transformers (setup.cfg's peer extra)")
@pytest.mark.parametrize("scaled", [False, True])
def test_inv_freq_is_transformers(scaled):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    kw = dict(hidden_size=2048, num_attention_heads=32, rope_theta=500000.0)
    if scaled:
        kw["rope_scaling"] = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                  original_max_position_embeddings=8192)
    hc = transformers.LlamaConfig(**kw)
    ref = (ROPE_INIT_FUNCTIONS["llama3"](hc)[0] if scaled else LlamaRotaryEmbedding(hc).inv_freq).numpy()
    got = inv_freq(64, 500000.0, RopeScaling(32.0, 1.0, 4.0, 8192) if scaled else None)
    assert got.dtype == ref.dtype == np.float32
    assert np.abs(got - ref).max() <= 2e-7 * np.abs(ref).max()
    if scaled:
        assert not np.allclose(got, inv_freq(64, 500000.0))      # the scaling changed the low frequencies


def test_gqa_makes_no_per_query_head_copy_of_k_or_v(rng):
    """After a first step (buffers made), forward + backward of GQA with 16 query heads on 1 KV head
    allocates less than half of ONE key tensor repeated per query head (B·T·H·D floats): K and V are
    broadcast over the group, never copied per query head. (NumPy's iteration buffers are a fixed
    8192 elements per operand, whatever the shapes.)"""
    import tracemalloc

    from ringzero.nn.base import Pool
    B, T, C, H, K, D = 2, 128, 64, 16, 1, 32
    p = {"attn.w": rng.standard_normal((C, (H + 2 * K) * D)).astype(np.float32),
         "proj.w": rng.standard_normal((H * D, C)).astype(np.float32)}
    g = {k: np.zeros_like(v) for k, v in p.items()}
    att = GroupedQueryAttention(H, K, D, Rotary(D, 1e4, pool=Pool(), tag="rope"), Pool(), "a")
    x, dy = rng.standard_normal((2, B, T, C)).astype(np.float32)
    for _ in range(2):
        tracemalloc.start()
        _, c = att.forward(p, x)
        att.backward(dy, c, g)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    repeated = B * T * H * D * 4
    assert peak < repeated // 2, f"{peak:,} B allocated in a step; one K repeated per query head is {repeated:,} B"


def test_rotary_tables_one_per_dtype_sliced_by_length(rng):
    """Shorter sequences read a prefix of the longest table (generation: one table, not one per length),
    and a prefix rotates exactly as the table made for that length would."""
    rot = Rotary(8, 100.0)
    x = rng.standard_normal((1, 20, 2, 8))
    full = rot.forward(x.copy())
    assert len(rot._tables) == 1
    short = Rotary(8, 100.0).forward(x[:, :7].copy())
    assert np.array_equal(rot.forward(x[:, :7].copy()), short) and np.array_equal(full[:, :7], short)
    assert len(rot._tables) == 1
