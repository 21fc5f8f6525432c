"""The Llama model against transformers, its presets, checkpointing and the sharded runtime.

References, independent of the code under test:
- transformers' ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` (random weights, float64, torch
  autograd; GQA with 2 query heads per KV head; tied and untied; with and without q/k/v
  bias; llama3 rope scaling on and off): logits, loss and EVERY gradient, elementwise.
  The weights are copied by the mapping written in tests/hf_llama.py.
- the published config.json values typed here, and Ψ from transformers' own model built
  on the meta device (no memory) for each preset.
- activation checkpointing: bitwise the gradients without it.
- MPI: the first step's loss at stages 0-3 and hybrid, Nd = 1, 2, 4, equals transformers';
  the model-state bytes measured at every stage equal the formula, written out here.
"""
import importlib.util
import os
import sys

import numpy as np
import pytest

from ringzero.nn import families
from ringzero.nn.llama import PRESETS, Llama, LlamaConfig, RopeScaling, llama_units, model_config
from ringzero.runtime.flat import Layout

sys.path.insert(0, os.path.dirname(__file__))
import hf_llama as H  # noqa: E402

HAVE_HF = bool(importlib.util.find_spec("torch") and importlib.util.find_spec("transformers"))
needs_hf = pytest.mark.skipif(not HAVE_HF, reason="needs torch and transformers (setup.cfg's peer extra)")

# config.json of each preset on the Hugging Face hub: (layers, width, heads, kv heads, intermediate, vocab,
# max_position_embeddings, rope_theta, rms_norm_eps, tie_word_embeddings, q/k/v bias)
PUBLISHED = {
    "smollm2-135m": (30, 576, 9, 3, 1536, 49152, 8192, 100000.0, 1e-5, True, False),
    "smollm2-360m": (32, 960, 15, 5, 2560, 49152, 8192, 100000.0, 1e-5, True, False),
    "qwen2.5-0.5b": (24, 896, 14, 2, 4864, 151936, 32768, 1000000.0, 1e-6, True, True),
    "tinyllama-1.1b": (22, 2048, 32, 4, 5632, 32000, 2048, 10000.0, 1e-5, False, False),
    "llama-3.2-1b": (16, 2048, 32, 8, 8192, 128256, 131072, 500000.0, 1e-5, True, False),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_are_the_published_configs(name):
    c = PRESETS[name]
    got = (c.n_layer, c.n_embd, c.n_head, c.n_kv_head, c.ffn, c.vocab, c.block_size, c.rope_theta, c.rms_eps,
           c.tied, c.qkv_bias)
    assert got == PUBLISHED[name]
    assert c.head_dim == 64
    assert (c.rope_scaling is not None) == (name == "llama-3.2-1b")
    if name == "llama-3.2-1b":
        assert c.rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192)


@needs_hf
@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_psi_is_transformers_count(name):
    """Ψ of the layout table == parameters of transformers' model at the same config (built on 'meta')."""
    import torch
    import transformers
    c = PRESETS[name]
    kw = dict(vocab_size=c.vocab, hidden_size=c.n_embd, intermediate_size=c.ffn, num_hidden_layers=c.n_layer,
              num_attention_heads=c.n_head, num_key_value_heads=c.n_kv_head, tie_word_embeddings=c.tied)
    cls = (transformers.Qwen2ForCausalLM, transformers.Qwen2Config) if c.qkv_bias else \
        (transformers.LlamaForCausalLM, transformers.LlamaConfig)
    with torch.device("meta"):
        m = cls[0](cls[1](**kw))
    assert Layout(llama_units(c)).numel == m.num_parameters()


def closed_form(c):
    """Ψ of a Llama counted by hand: per block 2 norms (2C), q|k|v (C·(H+2K)·D, + (H+2K)·D with bias),
    proj (H·D·C), gate|up and down (3·C·F); plus wte (V·C), lnf (C) and an untied head (V·C)."""
    C, D, W = c.n_embd, c.head_dim, (c.n_head + 2 * c.n_kv_head) * c.head_dim
    block = 2 * C + C * W + (W if c.qkv_bias else 0) + c.n_head * D * C + 3 * C * c.ffn
    return c.n_layer * block + c.vocab * C + C + (0 if c.tied else c.vocab * C)


@pytest.mark.parametrize("stage", ["0", "1", "2", "3"])
@pytest.mark.parametrize("name", ["smollm2-135m", "tinyllama-1.1b"])
def test_bytes_model_state_at_nd2(name, stage):
    """Formula on the padded Ψ == the bytes a rank holds, counted from the Layout's shards (byte vocab)."""
    from ringzero.runtime import accounting as acc
    c = model_config(name, 256)
    lay = Layout(llama_units(c), shards=2)
    full, shard = lay.padded, lay.shard_numel
    held = {"0": dict(p=full, g=full, o=full), "1": dict(p=full, g=full, o=shard),
            "2": dict(p=full, g=shard, o=shard), "3": dict(p=shard, g=shard, o=shard)}[stage]
    assert acc.model_state_total(stage, lay.padded, 2) == 2 * held["p"] + 2 * held["g"] + 12 * held["o"]
    assert lay.numel == closed_form(c) and closed_form(PRESETS[name]) == Layout(llama_units(PRESETS[name])).numel


def test_model_config_and_registry():
    c = model_config("smollm2-135m", 256, n_layer=2)
    assert (c.n_layer, c.vocab, c.n_embd, c.head_dim, c.tied) == (2, 256, 576, 64, True)
    assert model_config("smollm2-135m", None, n_embd=96, n_head=3, n_kv_head=1).head_dim == 32
    with pytest.raises(ValueError, match="unknown Llama model"):
        model_config("llama-9")
    with pytest.raises(ValueError, match="multiple of n_kv_head"):
        model_config("smollm2-135m", 256, n_head=4)
    with pytest.raises(ValueError, match="head_dim must be even"):
        LlamaConfig(n_embd=12, n_head=4, n_kv_head=2)
    for name in families.preset_names():
        cfg = families.model_config(name)
        assert families.from_dict(families.to_dict(cfg)) == cfg
        assert families.units_of(cfg) == (llama_units(cfg) if name in PRESETS else families.gpt.gpt_units(cfg))
    assert families.family_of("qwen2.5-0.5b") == "llama" and families.family_of("gpt2") == "gpt2"
    assert families.model_class(PRESETS["tinyllama-1.1b"]) is Llama
    # an older manifest: a GPT's fields without a family
    assert families.from_dict({"n_layer": 2, "n_head": 2, "n_embd": 8, "block_size": 8, "vocab": 16}).n_layer == 2
    with pytest.raises(ValueError, match="unknown field"):
        families.from_dict({"family": "llama", "n_layers": 2})


def test_untied_head_layout():
    tied, untied = (llama_units(LlamaConfig(tied=t, qkv_bias=not t)) for t in (True, False))
    assert tied[-1].needs == ("embed",) and [p.name for p in tied[-1].params] == ["lnf.w"]
    assert untied[-1].needs == () and [p.name for p in untied[-1].params] == ["lnf.w", "head.w"]
    assert "h0.attn.b" in {p.name for p in untied[1].params} and "h0.attn.b" not in {p.name for p in tied[1].params}


@needs_hf
@pytest.mark.parametrize("case", H.CASES, ids=[c[0] for c in H.CASES])
def test_logits_loss_and_every_gradient_equal_transformers(case):
    m, cfg = H.tiny(case)
    L = Layout(llama_units(cfg))
    buf, gbuf = np.zeros(L.padded), np.zeros(L.padded)
    P, G = L.views(buf), L.views(gbuf)
    H.fill(P, m)
    x, y = H.batch(1, H.B)
    model = Llama(cfg)
    loss = model.loss_and_grad(P, G, x, y)
    logits, tl = H.hf_loss(m, x, y)
    tl.backward()
    ref = logits.detach().numpy()
    lg = model.logits(P, x)
    assert np.abs(lg - ref).max() <= 1e-6 * max(1.0, np.abs(ref).max())
    assert abs(loss - tl.item()) <= 1e-7 * abs(tl.item())     # cos/sin: float32 tables (numpy vs torch ulps)
    grads = {n: p.grad for n, p in m.named_parameters()}
    bad = {}
    for n in L.slots:
        r = H.hf_tensor(grads, n).numpy()
        err = np.abs(G[n] - r).max() / max(np.abs(r).max(), 1e-12)
        if not err <= 1e-6:
            bad[n] = err
    assert not bad, f"gradients differ from torch autograd: {bad}"


def _grads(cfg, checkpoint, steps=2):
    """Gradient buffer after ``steps`` loss_and_grad calls on one model (pool buffers reused)."""
    L = Layout(llama_units(cfg))
    buf = np.zeros(L.padded, np.float32)
    L.init_full(buf, seed=5)
    m = Llama(cfg, checkpoint=checkpoint)
    out = []
    for s in range(steps):
        g = np.zeros_like(buf)
        x, y = H.batch(10 + s, 3)
        loss = m.loss_and_grad(L.views(buf), L.views(g), x % cfg.vocab, y % cfg.vocab)
        out.append((loss, g))
    return out, m


@pytest.mark.parametrize("bias,tied", [(False, True), (True, False)])
def test_checkpointing_bitwise_and_smaller(bias, tied):
    cfg = LlamaConfig(n_layer=3, n_head=4, n_kv_head=2, n_embd=32, ffn=40, vocab=64, block_size=16,
                      qkv_bias=bias, tied=tied)
    ref, m0 = _grads(cfg, False)
    got, m1 = _grads(cfg, True)
    for (l0, g0), (l1, g1) in zip(ref, got):
        assert l0 == l1 and np.array_equal(g0, g1)
    # checkpointed blocks hold only their input: (B, T, C) per block
    L = Layout(llama_units(cfg))
    buf = np.zeros(L.padded, np.float32)
    L.init_full(buf, seed=5)
    x, _ = H.batch(3, 3)
    x = x % 64
    sizes = []
    for m in (m0, m1):
        h = x
        caches = []
        for u in range(m.last):
            h, c = m.forward_unit(u, L.views(buf), h)
            caches.append(c)
        sizes.append(sum(m.cache_nbytes(c) for c in caches[1:]))
    assert sizes[1] == 3 * 3 * 16 * 32 * 4 < sizes[0]


def test_pool_allocates_once():
    cfg = LlamaConfig(n_layer=2, n_head=4, n_kv_head=1, n_embd=32, ffn=40, vocab=64, block_size=16)
    _, m = _grads(cfg, False, steps=1)
    n = m.pool.allocs
    L = Layout(llama_units(cfg))
    buf = np.zeros(L.padded, np.float32)
    for s in range(2):
        x, y = H.batch(20 + s, 3)
        m.loss_and_grad(L.views(buf), L.views(np.zeros_like(buf)), x % 64, y % 64)
    assert m.pool.allocs == n, "a step after the first made new activation buffers"


def test_real_vocab_scores_real_rows_only():
    cfg = LlamaConfig(n_layer=1, n_head=2, n_kv_head=1, n_embd=16, ffn=24, vocab=64, real_vocab=50,
                      block_size=8, tied=False)
    L = Layout(llama_units(cfg))
    buf = np.zeros(L.padded)
    L.init_full(buf, seed=1)
    g = np.zeros_like(buf)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 50, (2, 8)), rng.integers(0, 50, (2, 8))
    m = Llama(cfg)
    m.loss_and_grad(L.views(buf), L.views(g), x, y)
    assert m.logits(L.views(buf), x).shape == (2, 8, 50)
    G = L.views(g)
    assert not G["head.w"][50:].any() and not G["wte"][50:].any()
    with pytest.raises(ValueError, match="token ids"):
        m.check_tokens(np.array([[50]]))


# ------------------------------------------------------------------------------ MPI
STAGES = ["0", "1", "2", "3", "hybrid"]


def _rpn(comm, stage):
    return max([d for d in range(1, comm.size) if comm.size % d == 0] or [1]) if stage == "hybrid" else None


@pytest.mark.mpi
@pytest.mark.parametrize("case", [H.CASES[1], H.CASES[2]], ids=[H.CASES[1][0], H.CASES[2][0]])
@pytest.mark.parametrize("stage", STAGES)
def test_first_step_loss_equals_transformers(comm, stage, case):
    """The sharded engine's first-step loss on the global batch == transformers' (float32)."""
    from conftest import assert_all

    from ringzero.runtime.zero import Zero
    if comm.size not in (1, 2, 4):
        pytest.skip("the Llama step runs at Nd = 1, 2 and 4")
    x, y = H.batch(7, H.B * comm.size)
    full = ref = None
    cfg = None
    if comm.rank == 0:
        try:        # a failure here is every rank's, not a hang in the bcast below
            import torch
            m, cfg = H.tiny(case, seed=3, dtype="float32")
            full = {n: H.hf_tensor(dict(m.named_parameters()), n).detach().numpy().copy()
                    for n in Layout(llama_units(cfg)).slots}
            with torch.no_grad():
                ref = H.hf_loss(m, x, y)[1].item()
        except Exception as e:
            ref = f"rank 0 could not build the transformers model: {type(e).__name__}: {e}"
    cfg, full, ref = comm.bcast((cfg, full, ref), root=0)
    if isinstance(ref, str):
        pytest.fail(ref)

    def init(state):
        L = state.layout
        buf = np.zeros(L.padded, np.float32)
        for n, v in L.views(buf).items():
            v[...] = full[n]
        for u in range(len(L.units)):
            for r in state.held_ranks("master"):
                state.piece("master", u, r)[...] = L.piece(buf, u, r)

    eng = Zero(Llama(cfg), comm, stage, precision="fp32", init=init, timeout=60, ranks_per_node=_rpn(comm, stage))
    r = slice(comm.rank * H.B, (comm.rank + 1) * H.B)
    res = eng.step(x[r].copy(), y[r].copy(), lr=1e-3)
    rel = abs(res.loss - ref) / abs(ref)
    assert_all(comm, rel <= 1e-5, f"stage {stage}, Nd {comm.size}: loss {res.loss!r} vs transformers {ref!r} "
                                  f"(rel {rel:.2e})")


@pytest.mark.mpi
@pytest.mark.parametrize("stage", STAGES)
def test_model_state_bytes_equal_the_formula(comm, stage):
    """fp16 training: bytes per class a rank holds == the formula on the padded Ψ, at every stage."""
    from conftest import assert_all

    from ringzero.runtime.zero import Zero
    rpn = _rpn(comm, stage)
    cfg = LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn=40, vocab=64, block_size=16, tied=False,
                      qkv_bias=True)
    eng = Zero(Llama(cfg), comm, stage, precision="fp16", seed=1, timeout=60, ranks_per_node=rpn)
    P = eng.layout.padded
    g = rpn or comm.size
    sharded = {"0": (), "1": ("o",), "2": ("g", "o")}.get(stage, ("p", "g", "o"))
    n = {k: P // g if k in sharded else P for k in ("p", "g", "o")}
    want = {"params_fp16": 2 * n["p"], "grads_fp16": 2 * n["g"], "master_fp32": 4 * n["o"],
            "adam_m_fp32": 4 * n["o"], "adam_v_fp32": 4 * n["o"]}
    rep = eng.memory_report()["classes"]
    got = {c: d["measured_bytes"] for c, d in rep.items()}
    x, y = H.batch(comm.rank, 2)
    res = eng.step(x % 64, y % 64, lr=1e-3)
    ok = got == want and all(d["formula_bytes"] == want[c] for c, d in rep.items()) and np.isfinite(res.loss)
    assert_all(comm, ok, f"stage {stage}: memory {got}, expected {want}, loss {res.loss}")


# ------------------------------------------------------------------------------ the device path, on the stand-in
@pytest.mark.standin
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_device_path_on_the_cupy_standin(monkeypatch, dtype):
    """Under the strict CuPy stand-in (tests/cupy_standin/: no implicit host conversion, no NumPy
    operand in a device op), a Llama step computes what the host does: loss and gradients equal the
    float64 host step within the dtype's rounding. Proves the calls are CuPy's, not GPU numerics."""
    import cupy_standin
    cp = cupy_standin.install(monkeypatch)
    cfg = LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn=40, vocab=64, block_size=16,
                      qkv_bias=True, tied=False, rope_scaling=RopeScaling(4.0, 1.0, 4.0, 8))
    L = Layout(llama_units(cfg))
    host = np.zeros(L.padded)
    L.init_full(host, seed=2)
    x, y = (a % 64 for a in H.batch(4, 2))
    g64 = np.zeros_like(host)
    ref = Llama(cfg).loss_and_grad(L.views(host), L.views(g64), x, y)
    dev = cp.asarray(host.astype(dtype))
    gdev = cp.zeros(L.padded, dtype)
    loss = Llama(cfg).loss_and_grad(L.views(dev), L.views(gdev), cp.asarray(x), cp.asarray(y))
    got = gdev.get().astype(np.float64)
    from ringzero.nn import fused_cuda
    assert {"rz_rms_fwd_affine", "rz_rms_bwd_dx", "rz_swiglu_fwd", "rz_swiglu_bwd"} <= set(fused_cuda._KERNELS)
    tol = 1e-5 if dtype == np.float32 else 3e-2
    assert abs(loss - ref) <= tol * abs(ref)
    assert np.linalg.norm(got - g64) <= tol * np.linalg.norm(g64)
