"""ringzero against transformers' GPT2LMHeadModel: the independent check of the GPT-2 import and export.

References: transformers' GPT2LMHeadModel, built offline from a GPT2Config with random
weights (biases and norms too) and saved with save_pretrained, run under torch autograd;
and its own from_pretrained reading what ringzero exports. The vocabulary (300) is not a
multiple of 64, so ringzero pads it (320) and the export strips the padding.

    serial    logits, loss and every gradient at one shard equal torch's (float32 tolerance)
    mpi       at stages 0-3 and hybrid, at Nd = 1, 2 and 4: the first step's loss equals
              transformers' on the same global batch within 1e-5 relative; then the
              imported weights saved and exported at that Nd reload in transformers
              bitwise equal to what it saved, with no missing or unexpected key, and generate runs
"""
import importlib.util
import os
import shutil
import tempfile

import numpy as np
import pytest

from ringzero.interop.gpt2 import hf_name
from ringzero.interop.hf_import import HFSource, load_full
from ringzero.nn.gpt import GPT

# torch and transformers are imported only where a test needs them (rank 0 of an MPI test):
# eight ranks each importing torch at collection would cost a gigabyte and seconds of CPU
pytestmark = pytest.mark.skipif(
    not (importlib.util.find_spec("torch") and importlib.util.find_spec("transformers")),
    reason="the transformers interop tests need torch and transformers: RINGZERO_PEER=1 ./launch/test "
           "(setup.cfg's peer extra)")
V, T, B = 300, 32, 2


def _hf():
    import torch
    import transformers
    return torch, transformers


def tiny_hf(folder, seed=0, **kw):
    """A random GPT2LMHeadModel (every parameter random, not only the matrices), saved with save_pretrained."""
    torch, transformers = _hf()
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=T, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, **kw)
    m = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    m.save_pretrained(folder)
    return m


def hf_loss(m, x, y):
    """transformers' logits and the mean cross-entropy against y (no shift: y are the targets of x)."""
    torch, _ = _hf()
    out = m(torch.from_numpy(x)).logits                        # (B, T, V)
    return out, torch.nn.functional.cross_entropy(out.reshape(-1, V), torch.from_numpy(y).reshape(-1))


def test_logits_loss_and_every_gradient_equal_transformers(tmp_path):
    hm = tiny_hf(tmp_path)
    cfg, L, buf, _ = load_full(str(tmp_path))
    model, P = GPT(cfg), L.views(buf)
    gbuf = np.zeros_like(buf)
    G = L.views(gbuf)
    rng = np.random.default_rng(1)
    x, y = rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))
    loss = model.loss_and_grad(P, G, x, y)
    logits, tl = hf_loss(hm, x, y)
    tl.backward()
    lg = model.logits(P, x)
    assert lg.shape == (B, T, V)                               # the head scores the real rows only
    ref = logits.detach().numpy()
    assert np.abs(lg - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max())
    assert abs(loss - tl.item()) <= 1e-5 * abs(tl.item())
    params = dict(hm.transformer.named_parameters())
    bad = {}
    for name in L.slots:
        r = params[hf_name(name)].grad.numpy()
        g = G[name][:V] if name == "wte" else G[name]
        e = np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-12)
        if not e <= 1e-4:
            bad[name] = e
    assert not bad, bad
    assert not G["wte"][V:].any(), "the padding rows get no gradient"


def test_refuses_what_transformers_computes_otherwise(tmp_path):
    """Configs transformers builds and ringzero does not compute are refused, naming the field."""
    from ringzero.interop.gpt2 import HFConfigError
    for i, (kw, field) in enumerate([({"activation_function": "gelu"}, "activation_function"),
                                     ({"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon"),
                                     ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
                                     ({"reorder_and_upcast_attn": True}, "reorder_and_upcast_attn")]):
        tiny_hf(tmp_path / str(i), **kw)
        with pytest.raises(HFConfigError, match=field):
            HFSource(str(tmp_path / str(i)))


# ------------------------------------------------------------------------------ MPI
STAGES = ["0", "1", "2", "3", "hybrid"]
_SHARED = {}


@pytest.fixture(scope="module", autouse=True)
def _remove_shared():
    """The shared model folders go when the module's tests are done (rank 0 made them)."""
    yield
    for folder, *_ in _SHARED.values():
        if folder and os.path.isdir(folder) and os.path.basename(folder).startswith("rz-hf-"):
            from mpi4py import MPI
            MPI.COMM_WORLD.Barrier()
            if MPI.COMM_WORLD.rank == 0:
                shutil.rmtree(folder, ignore_errors=True)


def shared_model(comm):
    """(folder, transformers' loss on the global batch, global x, y), made once per world size on rank 0."""
    if comm.size not in _SHARED:
        folder = ref = None
        rng = np.random.default_rng(7)
        x, y = rng.integers(0, V, (B * comm.size, T)), rng.integers(0, V, (B * comm.size, T))
        if comm.rank == 0:
            try:               # a failure here is every rank's, not a hang in the bcast below
                torch, _ = _hf()
                folder = tempfile.mkdtemp(prefix="rz-hf-")
                hm = tiny_hf(folder, seed=3)
                with torch.no_grad():
                    ref = hf_loss(hm, x, y)[1].item()
            except Exception as e:
                ref = f"rank 0 could not build the transformers model: {type(e).__name__}: {e}"
        folder, ref = comm.bcast((folder, ref), root=0)
        _SHARED[comm.size] = (folder, ref, x, y)
    folder, ref, x, y = _SHARED[comm.size]
    if isinstance(ref, str):
        pytest.fail(ref)
    return folder, ref, x, y


def engine_from(comm, folder, stage):
    from ringzero.runtime.zero import Zero
    src = HFSource(folder)
    rpn = max([d for d in range(1, comm.size) if comm.size % d == 0] or [1]) if stage == "hybrid" else None
    eng = Zero(GPT(src.cfg), comm, stage, precision="fp32", init=src.fill_master, timeout=60, ranks_per_node=rpn)
    src.close()
    return eng, src.error


@pytest.mark.mpi
@pytest.mark.parametrize("stage", STAGES)
def test_first_step_loss_equals_transformers(comm, stage):
    from conftest import assert_all
    if comm.size not in (1, 2, 4):
        pytest.skip("the interop step runs at Nd = 1, 2 and 4")
    folder, ref, x, y = shared_model(comm)
    eng, err = engine_from(comm, folder, stage)
    r = slice(comm.rank * B, (comm.rank + 1) * B)
    res = eng.step(x[r].copy(), y[r].copy(), lr=1e-3)
    rel = abs(res.loss - ref) / abs(ref)
    assert_all(comm, err is None and rel <= 1e-5,
               f"stage {stage}, Nd {comm.size}: loss {res.loss!r} vs transformers {ref!r} (rel {rel:.2e}); read: {err}")


@pytest.mark.mpi
def test_export_reloads_bitwise_in_transformers(comm):
    from conftest import assert_all

    from ringzero.interop.hf_export import export_hf
    from ringzero.runtime import checkpoint as ck
    if comm.size not in (1, 2, 4):
        pytest.skip("the interop round trip runs at Nd = 1, 2 and 4")
    folder, _, _, _ = shared_model(comm)
    eng, err = engine_from(comm, folder, "3")
    save = comm.bcast(tempfile.mkdtemp(prefix="rz-ck-") if comm.rank == 0 else None, root=0)
    try:
        path = ck.save(eng, save, 0, config={"gpt": eng.model.cfg.__dict__})
        msg = None
        if comm.rank == 0:
            msg = _reload_and_compare(folder, path, export_hf)
        msg = comm.bcast(msg, root=0)
        assert_all(comm, err is None and msg is None, f"{err or ''} {msg or ''}")
    finally:
        comm.Barrier()
        if comm.rank == 0:
            shutil.rmtree(save, ignore_errors=True)


def _reload_and_compare(folder, path, export_hf):
    """None if the export reloads bitwise, with no missing or unexpected key, and generates; else why."""
    from safetensors.numpy import load_file
    torch, transformers = _hf()
    out = os.path.join(os.path.dirname(path), "hf")
    r = export_hf(path, out)
    if r["vocab"] != V:
        return f"exported vocab {r['vocab']}, expected {V}"
    saved, got = load_file(os.path.join(folder, "model.safetensors")), load_file(os.path.join(out, "model.safetensors"))
    if set(saved) != set(got):
        return f"keys differ: {sorted(set(saved) ^ set(got))[:4]}"
    diff = [k for k in saved if saved[k].dtype != got[k].dtype or not np.array_equal(saved[k], got[k])]
    if diff:
        return f"not bitwise: {diff[:4]}"
    m, info = transformers.GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    ref = transformers.GPT2LMHeadModel.from_pretrained(folder)
    if info["missing_keys"] or info["unexpected_keys"]:
        return f"from_pretrained: missing {info['missing_keys']}, unexpected {info['unexpected_keys']}"
    a, b = m.state_dict(), ref.state_dict()
    if set(a) != set(b) or any(not torch.equal(a[k], b[k]) for k in a):
        return "transformers' state dicts differ after the round trip"
    if m.lm_head.weight.data_ptr() != m.transformer.wte.weight.data_ptr():
        return "the reloaded head is not tied to wte"
    g = m.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=5, do_sample=False, pad_token_id=0)
    g_ref = ref.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=5, do_sample=False, pad_token_id=0)
    if g.shape != (1, 8) or not torch.equal(g, g_ref):
        return f"generate: {g.tolist()} vs the original's {g_ref.tolist()}"
    return None
