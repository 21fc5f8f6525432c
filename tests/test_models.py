"""Whole-model checks of the GPT and the MLP over the unit contract.

References: float64 central finite differences of the loss, torch autograd
on the same weights (skipped without torch), and plain arithmetic facts
(checkpointing and loss scaling by a power of two must not change a bit).
"""
import os
import sys
import tracemalloc

import numpy as np
import pytest

from ringzero.nn import GPT, MLP, GPTConfig, gpt_units
from ringzero.runtime.flat import Layout

TINY = GPTConfig(n_layer=2, n_head=2, n_embd=8, block_size=6, vocab=11)


def make(units, dtype, seed=0):
    lay = Layout(units, 1)
    buf = np.zeros(lay.padded, dtype)
    lay.init_full(buf, seed)
    gbuf = np.zeros_like(buf)
    return lay, buf, gbuf


def fd_check(model, lay, buf, gbuf, x, t, per_param=None, seed=0):
    """Worst per-parameter relative error of the analytic gradient vs central
    differences of model.loss (per_param: coordinates sampled per parameter)."""
    P, G = lay.views(buf), lay.views(gbuf)
    gbuf[...] = 0
    model.loss_and_grad(P, G, x, t)
    rng = np.random.default_rng(seed)
    worst = {}
    for name, s in lay.slots.items():
        coords = np.arange(s.offset, s.offset + s.spec.numel)
        if per_param is not None and per_param < coords.size:
            coords = rng.choice(coords, per_param, replace=False)
        num = np.empty(coords.size)
        eps = 1e-6
        for j, i in enumerate(coords):
            old = buf[i]
            buf[i] = old + eps
            fp = model.loss(P, x, t)
            buf[i] = old - eps
            fm = model.loss(P, x, t)
            buf[i] = old
            num[j] = (fp - fm) / (2 * eps)
        ana = gbuf[coords]
        worst[name] = np.linalg.norm(ana - num) / max(np.linalg.norm(num), 1e-30)
    return max(worst.values()), worst


def test_mlp_gradcheck():
    m = MLP((5, 7, 6, 3))
    lay, buf, gbuf = make(m.units, np.float64)
    rng = np.random.default_rng(1)
    x, t = rng.standard_normal((4, 5)), rng.integers(0, 3, 4)
    err, per = fd_check(m, lay, buf, gbuf, x, t)
    assert err <= 1e-6, per


def test_gpt_gradcheck_two_layers():
    m = GPT(TINY)
    lay, buf, gbuf = make(m.units, np.float64)
    buf *= 4.0    # larger weights than init, so attention is far from uniform
    rng = np.random.default_rng(2)
    idx, t = rng.integers(0, TINY.vocab, (2, 5)), rng.integers(0, TINY.vocab, (2, 5))
    # every one of the 28 parameters, up to 24 random coordinates of each
    err, per = fd_check(m, lay, buf, gbuf, idx, t, per_param=24)
    assert err <= 1e-6, {k: v for k, v in per.items() if v > 1e-6}


def step_grads(cfg, checkpoint, idx, t, steps=2, scale=1.0):
    m = GPT(cfg, checkpoint=checkpoint)
    lay, buf, gbuf = make(m.units, np.float32)
    P, G = lay.views(buf), lay.views(gbuf)
    for _ in range(steps):            # the second step runs on reused buffers
        gbuf[...] = 0
        loss = m.loss_and_grad(P, G, idx, t, scale=scale)
    return m, loss, gbuf


def test_checkpointing_bitwise_and_smaller():
    cfg = GPTConfig(n_layer=3, n_head=2, n_embd=32, block_size=16, vocab=40)
    rng = np.random.default_rng(3)
    idx, t = rng.integers(0, 40, (3, 16)), rng.integers(0, 40, (3, 16))
    m0, l0, g0 = step_grads(cfg, False, idx, t)
    m1, l1, g1 = step_grads(cfg, True, idx, t)
    assert l0 == l1
    assert np.array_equal(g0, g1), f"max diff {np.abs(g0 - g1).max()}"
    # activation bytes held by the caches of one forward pass, summed over units
    lay = Layout(m0.units, 1)
    buf = np.zeros(lay.padded, np.float32)
    lay.init_full(buf, 0)

    def held(m):
        x, tot = idx, 0
        for u in range(m.last + 1):
            x, c = m.forward_unit(u, lay.views(buf), x, t if u == m.last else None)
            tot += m.cache_nbytes(c)
        return tot
    full, ckpt = held(m0), held(m1)
    # checkpointed blocks hold only their input (B, T, C)
    assert ckpt < full / 3, (ckpt, full)
    assert m1.pool.nbytes < m0.pool.nbytes, (m1.pool.nbytes, m0.pool.nbytes)


def test_loss_scale_is_exact():
    """Scaling by 2**16 multiplies every gradient exactly (power of two, no overflow)."""
    rng = np.random.default_rng(4)
    idx, t = rng.integers(0, TINY.vocab, (2, 6)), rng.integers(0, TINY.vocab, (2, 6))
    _, _, g1 = step_grads(TINY, False, idx, t, steps=1)
    _, _, gs = step_grads(TINY, False, idx, t, steps=1, scale=65536.0)
    assert np.array_equal(gs, g1 * np.float32(65536.0))


def test_backward_reads_views_given_to_backward():
    """Stage 3 frees a unit's gathered params after forward and re-gathers them
    (into another buffer) for backward: backward must use the views it is given."""
    rng = np.random.default_rng(5)
    idx, t = rng.integers(0, TINY.vocab, (2, 6)), rng.integers(0, TINY.vocab, (2, 6))
    _, _, ref = step_grads(TINY, False, idx, t, steps=1)
    for ck in (False, True):
        m = GPT(TINY, checkpoint=ck)
        lay, buf, gbuf = make(m.units, np.float32)
        first = buf.copy()
        P1, P2, G = lay.views(first), lay.views(buf), lay.views(gbuf)
        x, caches = idx, []
        for u in range(m.last + 1):
            x, c = m.forward_unit(u, P1, x, t if u == m.last else None)
            caches.append(c)
        first[...] = np.nan          # the forward's gather buffer is reused for something else
        dy = 1.0
        for u in range(m.last, -1, -1):
            dy = m.backward_unit(u, dy, caches[u], P2, G)
        assert np.array_equal(gbuf, ref), f"checkpoint={ck}"


def test_overfit_adam():
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab=16)
    m = GPT(cfg)
    lay, buf, gbuf = make(m.units, np.float32, seed=1)
    P, G = lay.views(buf), lay.views(gbuf)
    rng = np.random.default_rng(6)
    idx, t = rng.integers(0, 16, (4, 16)), rng.integers(0, 16, (4, 16))
    mom, var = np.zeros_like(buf), np.zeros_like(buf)
    lr, b1, b2 = 1e-2, 0.9, 0.999
    losses = []
    for step in range(1, 51):
        gbuf[...] = 0
        losses.append(m.loss_and_grad(P, G, idx, t))
        mom[...] = b1 * mom + (1 - b1) * gbuf
        var[...] = b2 * var + (1 - b2) * gbuf * gbuf
        buf -= lr * (mom / (1 - b1 ** step)) / (np.sqrt(var / (1 - b2 ** step)) + 1e-8)
    assert losses[-1] <= 0.1 * losses[0], f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"


def test_steady_state_allocations():
    """After the first step no pool buffer is made, and NumPy temporaries are small."""
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab=64)
    m = GPT(cfg)
    lay, buf, gbuf = make(m.units, np.float32)
    P, G = lay.views(buf), lay.views(gbuf)
    rng = np.random.default_rng(7)
    idx, t = rng.integers(0, 64, (4, 32)), rng.integers(0, 64, (4, 32))
    m.loss_and_grad(P, G, idx, t)
    made = m.pool.allocs
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        gbuf[...] = 0
        m.loss_and_grad(P, G, idx, t)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert m.pool.allocs == made, f"{m.pool.allocs - made} buffers made in steady state"
    # what is left: reductions to (N, 1)/(C,) statistics and Python objects,
    # a small fraction of the activation and workspace bytes the pool holds
    assert peak - base < 0.05 * m.pool.nbytes, f"transient bytes {peak - base} vs pool {m.pool.nbytes}"


def test_generate_shapes_and_range():
    m = GPT(TINY)
    lay, buf, _ = make(m.units, np.float32)
    idx = np.array([[1, 2, 3], [4, 5, 6]])
    out = m.generate(lay.views(buf), idx, 8, temperature=1.0, rng=np.random.default_rng(0))
    assert out.shape == (2, 11) and np.array_equal(out[:, :3], idx)
    assert out.min() >= 0 and out.max() < TINY.vocab


def test_unit_errors():
    m = GPT(TINY)
    lay, buf, _ = make(m.units, np.float32)
    with pytest.raises(ValueError, match=r"\[0, 3\], got 4"):
        m.forward_unit(4, lay.views(buf), None)
    with pytest.raises(KeyError, match="h0.ln1.w"):
        m.forward_unit(1, {}, np.zeros((1, 2, 8), np.float32))
    with pytest.raises(ValueError, match=r"targets must have shape \(1, 2\)"):
        m.forward_unit(3, lay.views(buf), np.zeros((1, 2, 8), np.float32), np.zeros((2, 1), np.int64))


def _torch():
    torch = pytest.importorskip("torch")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import torch_gpt
    return torch, torch_gpt


# T = 16 is one causal block; T = 80 (> the 64-row block) takes the blocked attention products on the C path
@pytest.mark.parametrize("T", [16, 80])
def test_gpt_matches_torch(path, T):
    torch, tg = _torch()
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=T, vocab=50)
    m = GPT(cfg)
    lay, buf, gbuf = make(m.units, np.float32, seed=3)
    P, G = lay.views(buf), lay.views(gbuf)
    rng = np.random.default_rng(8)
    idx, t = rng.integers(0, 50, (3, T)), rng.integers(0, 50, (3, T))
    loss = m.loss_and_grad(P, G, idx, t)
    torch.manual_seed(0)
    tm = tg.load_from_flat(tg.TorchGPT(cfg), P)
    _, tl = tm(torch.from_numpy(idx), torch.from_numpy(t))
    tl.backward()
    assert abs(loss - tl.item()) <= 1e-5 * abs(tl.item())
    ref = tg.grads_as_flat_names(tm)
    assert set(ref) == set(G)
    bad = {}
    for n, r in ref.items():
        e = np.linalg.norm(G[n] - r) / max(np.linalg.norm(r), 1e-12)
        if not e <= 1e-4:
            bad[n] = e
    assert not bad, bad
    # greedy generation's first token is the argmax of torch's last-position logits
    out = m.generate(P, idx[:, :5], 1, temperature=0)
    logits, _ = tm(torch.from_numpy(idx[:, :5]))
    assert np.array_equal(out[:, 5], logits[:, -1].argmax(-1).numpy())


def test_gpt_step_c_and_numpy_paths_agree_in_float32(monkeypatch):
    """One float32 fwd+bwd of a GPT through the C kernels and through the NumPy fallback:
    the loss and every gradient agree to float32 rounding (the paths round differently)."""
    from ringzero.nn import fused
    if not fused.HAVE_C:
        pytest.skip("ringzero.nn._fused was not built")
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=72, vocab=40)
    rng = np.random.default_rng(4)
    idx, t = rng.integers(0, 40, (2, 72)), rng.integers(0, 40, (2, 72))
    out = []
    for c in (fused._c, None):
        monkeypatch.setattr(fused, "_c", c)
        m = GPT(cfg)
        lay, buf, gbuf = make(m.units, np.float32, seed=5)
        loss = m.loss_and_grad(lay.views(buf), lay.views(gbuf), idx, t)
        out.append((loss, lay.views(gbuf)))
    (l1, g1), (l2, g2) = out
    assert abs(l1 - l2) <= 1e-6 * abs(l2)
    bad = {n: float(np.linalg.norm(g1[n] - g2[n]) / np.linalg.norm(g2[n])) for n in g2
           if not np.linalg.norm(g1[n] - g2[n]) <= 1e-5 * np.linalg.norm(g2[n])}
    assert not bad, bad


@pytest.mark.gpu
def test_gpt_cupy_fp32_and_fp16_match_numpy_fp32():
    """GPU path: fp32 matches the NumPy model closely; fp16 storage = compute dtype
    (fp32 statistics), with a loss scale, matches within fp16 tolerance."""
    from conftest import have_cupy
    if not have_cupy():
        pytest.skip("needs CuPy and a CUDA device")
    import cupy as cp
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab=64)
    rng = np.random.default_rng(9)
    idx, t = rng.integers(0, 64, (4, 32)), rng.integers(0, 64, (4, 32))
    lay, buf, gbuf = make(gpt_units(cfg), np.float32, seed=2)
    ref_loss = GPT(cfg).loss_and_grad(lay.views(buf), lay.views(gbuf), idx, t)
    scale = 1024.0
    for dtype, tol in ((np.float32, 1e-4), (np.float16, 3e-2)):
        for ck in (False, True):
            m = GPT(cfg, checkpoint=ck)
            b = cp.asarray(buf.astype(dtype))
            g = cp.zeros_like(b)
            loss = m.loss_and_grad(lay.views(b), lay.views(g), cp.asarray(idx), cp.asarray(t), scale=scale)
            assert abs(loss - ref_loss) <= 10 * tol * abs(ref_loss), (dtype, ck, loss, ref_loss)
            got = cp.asnumpy(g).astype(np.float64) / scale
            for n, (a, z, _) in zip(lay.slots, [(s.offset, s.offset + s.spec.numel, 0)
                                                for s in lay.slots.values()]):
                e = np.linalg.norm(got[a:z] - gbuf[a:z]) / max(np.linalg.norm(gbuf[a:z]), 1e-12)
                assert e <= tol, (dtype, ck, n, e)


def test_check_tokens_on_the_host():
    """Token ids are checked on the host (the device layers do not check)."""
    m = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=4, vocab=10))
    m.check_tokens(np.zeros((2, 4), np.int64), np.full((2, 4), 9))
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 10\), got range \[10, 10\]"):
        m.check_tokens(np.zeros((2, 4), np.int64), np.full((2, 4), 10))
    with pytest.raises(TypeError, match="host"):
        m.check_tokens([[1, 2]])
