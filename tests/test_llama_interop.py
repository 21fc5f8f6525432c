"""Llama / Qwen2 checkpoints in and out (interop/llama.py, interop/hf_import.py, interop/hf_export.py), and
GPT-2's export after training, against transformers.

References: transformers' LlamaForCausalLM / Qwen2ForCausalLM with random weights (tests/hf_llama.py: GQA with
2 query heads per KV head, tied and untied, q/k/v bias on and off, llama3 rope scaling on and off), saved with
save_pretrained (single and sharded by max_shard_size, float32 and bfloat16); its state dict mapped onto
ringzero's names by tests/hf_llama.py's own mapping; its logits; and its from_pretrained reading ringzero's
exports (no missing, no unexpected key). The trainer runs under mpirun -n 2 (each rank reads its own pieces).
"""
import glob
import importlib.util
import subprocess
import sys

import numpy as np
import pytest
from hf_llama import CASES, V, hf_tensor, tiny

from ringzero.interop.hf_import import load_full
from ringzero.nn.families import build

pytestmark = pytest.mark.skipif(
    not (importlib.util.find_spec("torch") and importlib.util.find_spec("transformers")),
    reason="the transformers interop tests need torch and transformers (setup.cfg's peer extra)")
CASE = {c[0]: c for c in CASES}


def save(folder, case, dtype="float32", shard=False, seed=0):
    """A random transformers model of ``case``, saved as ``dtype`` (sharded: several files and an index)."""
    import copy

    import torch
    m, _ = tiny(case, seed=seed, dtype="float32")
    ref = copy.deepcopy(m)                  # float32 buffers (rotary's inv_freq) and the file's weights widened
    m.to(getattr(torch, dtype)).save_pretrained(folder, max_shard_size="20KB" if shard else "5GB")
    with torch.no_grad():
        for p, q in zip(ref.parameters(), m.parameters()):
            p.copy_(q.float())
    if shard:
        assert len(glob.glob(f"{folder}/model-*.safetensors")) > 1
    return ref


def file_tensors(folder):
    from safetensors import safe_open
    out = {}
    for f in glob.glob(f"{folder}/*.safetensors"):
        with safe_open(f, "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def logits_close(model, P, hm, tol=1e-5):
    import torch
    x = np.random.default_rng(5).integers(0, V, (2, 16))
    lg = model.logits(P, x)
    with torch.no_grad():
        ref = hm.float()(torch.from_numpy(x)).logits.numpy()
    assert lg.shape == ref.shape
    err = np.abs(lg - ref).max()
    assert err <= tol * max(1.0, np.abs(ref).max()), err


def run(cmd, mpi=0):
    from test_checkpoint import _clean_env, _mpirun
    pre = ["timeout", "300"] + (_mpirun() + ["-n", str(mpi)] if mpi else [])
    r = subprocess.run(pre + [sys.executable, "-m"] + cmd, capture_output=True, text=True, timeout=300,
                       env=_clean_env())
    assert r.returncode == 0, " ".join(cmd) + "\n" + r.stdout[-2000:] + r.stderr[-2000:]
    return r


IMPORTS = [("llama-tied", "float32", False), ("llama-untied-scaled", "bfloat16", True),
           ("qwen2-tied", "bfloat16", False), ("qwen2-untied-scaled", "float32", True)]


@pytest.mark.parametrize("name,dtype,shard", IMPORTS)
def test_import_equals_transformers(tmp_path, name, dtype, shard):
    """Every parameter equals transformers' (mapped by hf_llama's own table) bitwise; the logits equal its."""
    hm = save(tmp_path / "hf", CASE[name], dtype, shard)
    cfg, L, buf, hf = load_full(str(tmp_path / "hf"))
    assert (cfg.vocab, cfg.real_vocab, cfg.qkv_bias, cfg.tied) == (64, V, name.startswith("qwen2"), "-tied" in name)
    assert (cfg.rope_scaling is not None) == name.endswith("scaled")
    P, sd = L.views(buf), dict(hm.named_parameters())
    for n, v in P.items():
        ref = hf_tensor(sd, n).detach().float().numpy()
        got = v[:V] if n in ("wte", "head.w") else v
        assert np.array_equal(got, ref), n
        if n in ("wte", "head.w"):
            assert not v[V:].any()                                 # the padding rows
    logits_close(build(cfg), P, hm)


@pytest.mark.parametrize("name,dtype,shard", [IMPORTS[0], ("qwen2-untied-scaled", "bfloat16", True)])
def test_import_export_round_trip_is_bitwise(tmp_path, name, dtype, shard):
    """--init-from --steps 0 at 2 ranks, stage 3, then export --format hf in the file's dtype: every tensor
    bitwise the file's, the same keys, and transformers opens it with no missing or unexpected key."""
    import transformers
    hm = save(tmp_path / "hf", CASE[name], dtype, shard)
    run(["mpi4py", "-m", "ringzero.train", "--init-from", str(tmp_path / "hf"), "--steps", "0", "--stage", "3",
         "--save-dir", str(tmp_path / "ck"), "--quiet"], mpi=2)
    run(["ringzero.checkpoint", "export", "--format", "hf", str(tmp_path / "ck"), str(tmp_path / "out"),
         "--dtype", {"float32": "fp32", "bfloat16": "bf16"}[dtype]])
    a, b = file_tensors(tmp_path / "hf"), file_tensors(tmp_path / "out")
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and bool((a[k] == b[k]).all()), k
    m, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), output_loading_info=True)
    assert type(m).__name__ == type(hm).__name__
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    cfg, L, buf, _ = load_full(str(tmp_path / "hf"))
    logits_close(build(cfg), L.views(buf), m.float())


def trained(tmp_path, source, precision):
    """Two real training steps from ``source`` at --precision, saved and exported in that dtype."""
    ids = np.random.default_rng(2).integers(0, V, 3000).astype(np.uint16)
    ids.tofile(tmp_path / "d.bin")
    run(["mpi4py", "-m", "ringzero.train", "--init-from", str(source), "--data", str(tmp_path / "d.bin"),
         "--steps", "2", "--batch", "2", "--seq-len", "16", "--lr", "1e-2", "--warmup", "1", "--precision", precision,
         "--stage", "2", "--save-dir", str(tmp_path / "ck"), "--save-every", "2", "--quiet", "--sample-chars", "0",
         "--eval-interval", "0", "--eval-batches", "1"], mpi=2)
    run(["ringzero.checkpoint", "export", "--format", "hf", str(tmp_path / "ck"), str(tmp_path / "out"),
         "--dtype", precision])
    from ringzero.tools.sample import load
    return load(str(tmp_path / "ck"), "params" if precision != "fp32" else "master")


@pytest.mark.parametrize("name,precision", [("qwen2-tied", "fp32"), ("llama-untied-scaled", "bf16"),
                                            ("qwen2-untied-scaled", "fp16")])
def test_export_after_training_reloads_in_transformers(tmp_path, name, precision):
    """After two steps the export reloads with no missing or unexpected key, in the run's dtype, holding the
    checkpoint's weights bitwise, and its logits are ringzero's on those weights."""
    import torch
    import transformers
    hm = save(tmp_path / "hf", CASE[name])
    model, P, m, _ = trained(tmp_path, tmp_path / "hf", precision)
    r, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    want = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    assert r.dtype == want
    sd = dict(r.named_parameters())
    moved = False
    for n, v in P.items():
        got = hf_tensor(sd, n).detach().float().numpy()
        assert np.array_equal(got, v[:V] if n in ("wte", "head.w") else v), n
        moved |= not np.array_equal(got, hf_tensor(dict(hm.named_parameters()), n).detach().numpy())
    assert moved, "the training steps changed no weight"
    logits_close(model, P, r)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_gpt2_export_after_training_reloads_in_transformers(tmp_path, precision):
    """The same for GPT-2: trained two steps at --precision, exported in that dtype, reloaded by transformers
    with every weight bitwise the checkpoint's and its logits ringzero's."""
    import torch
    import transformers
    from test_hf_interop import tiny_hf

    from ringzero.interop.gpt2 import hf_name
    tiny_hf(tmp_path / "hf")
    model, P, m, _ = trained(tmp_path, tmp_path / "hf", precision)
    r, info = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "out"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert r.dtype == {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    sd = dict(r.transformer.named_parameters())
    for n, v in P.items():
        got = sd[hf_name(n)].detach().float().numpy()
        assert np.array_equal(got, v[:got.shape[0]] if n == "wte" else v), n
    x = np.random.default_rng(5).integers(0, 300, (2, 16))
    with torch.no_grad():
        ref = r.float()(torch.from_numpy(x)).logits.numpy()
    assert np.abs(model.logits(P, x) - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max())


@pytest.mark.parametrize("change,want", [
    ({"attention_bias": True}, "'attention_bias' = true"),
    ({"mlp_bias": True}, "'mlp_bias' = true"),
    ({"hidden_act": "gelu"}, "'hidden_act' = 'gelu'"),
    ({"model_type": "mistral", "sliding_window": 8}, "'sliding_window' = 8 < max_position_embeddings = 16"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope_type 'yarn'"),
    ({"num_attention_heads": 3}, "n_head (3) must be a multiple of n_kv_head (2)"),
    ({"tie_word_embeddings": True}, "'lm_head.weight' differs from model.embed_tokens.weight"),
    ({"tie_word_embeddings": False}, "missing key 'lm_head.weight'"),
])
def test_refusals_name_the_field(tmp_path, change, want):
    """A config.json ringzero does not compute exactly (or weights that contradict it): one line naming it."""
    import json

    from ringzero.interop.safetensors_files import HFConfigError
    tied = change.get("tie_word_embeddings") is False           # a tied model, said to be untied
    save(tmp_path / "hf", CASE["llama-tied" if tied else "llama-untied-scaled"])
    conf = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**conf, **change}))
    with pytest.raises(HFConfigError) as e:
        load_full(str(tmp_path / "hf"))
    assert want in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("shards", [2, 3, 8])
def test_each_piece_alone_equals_transformers(tmp_path, monkeypatch, shards):
    """Each rank's pieces of an Nd-way Llama import, read alone in reads of 50 elements (partial rows and
    column blocks of the transposed q/k/v and gate/up everywhere), are transformers' weights."""
    from ringzero.interop import hf_import
    from ringzero.interop.hf_import import HFSource, fill_piece
    from ringzero.nn.families import units_of
    from ringzero.runtime.flat import Layout
    hm = save(tmp_path / "hf", CASE["qwen2-untied-scaled"], "bfloat16", shard=True)
    monkeypatch.setattr(hf_import, "CHUNK", 50)
    src = HFSource(str(tmp_path / "hf"))
    L, L1 = Layout(units_of(src.cfg), shards=shards), Layout(units_of(src.cfg), shards=1)
    full = np.zeros(L1.padded, np.float32)
    for u in range(len(L.units)):
        seg = np.zeros(L.unit_padded[u], np.float32)
        for r in range(shards):
            fill_piece(src, L, u, r, L.own(seg, u, r))
        assert not seg[L.unit_numel[u]:].any()
        L1.unit_full(full, u)[:L.unit_numel[u]] = seg[:L.unit_numel[u]]
    src.close()
    sd = dict(hm.named_parameters())
    for n, v in L1.views(full).items():
        assert np.array_equal(v[:V] if n in ("wte", "head.w") else v, hf_tensor(sd, n).detach().numpy()), n


def test_mistral_reads_as_a_llama(tmp_path):
    """A MistralForCausalLM without a sliding window inside the context: the same names, no bias; logits equal."""
    import torch
    import transformers
    torch.manual_seed(0)
    c = transformers.MistralConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                   sliding_window=None, tie_word_embeddings=False)
    hm = transformers.MistralForCausalLM(c).eval()
    hm.save_pretrained(tmp_path / "m")
    cfg, L, buf, _ = load_full(str(tmp_path / "m"))
    assert not cfg.qkv_bias and not cfg.tied
    logits_close(build(cfg), L.views(buf), hm)


def test_trainer_check_of_a_llama_folder(tmp_path):
    """--init-from a Qwen2 folder through the trainer's validation (--check, no MPI): accepted with its own
    --n-kv-head and without --seq-len (min(128, context 16)); a differing flag or a too-long --seq-len is one
    line, exit 2."""
    from test_hf_import import trainer_check

    from ringzero.app.config import parse_config
    save(tmp_path / "hf", CASE["qwen2-tied"])
    np.random.default_rng(0).integers(0, V, 2000).astype(np.uint16).tofile(tmp_path / "d.bin")
    base = ["--init-from", str(tmp_path / "hf"), "--data", str(tmp_path / "d.bin")]
    assert parse_config(base)[0].seq_len == 16
    r = trainer_check(*base, "--n-kv-head", "2")
    assert r.returncode == 0, r.stderr
    for extra, want in [(["--n-kv-head", "1"], "--n-kv-head 1 differs from n_kv_head = 2"),
                        (["--seq-len", "32"], "expected <= max_position_embeddings = 16")]:
        r = trainer_check(*base, *extra)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and want in lines[0], (extra, r.stderr)


def test_sample_a_qwen2_folder_with_its_tokenizer(tmp_path):
    """``ringzero.sample DIR --tokenizer`` on a Qwen2 folder with a Qwen2-style tokenizer.json (NFC, the Split
    regex, byte-level): the greedy text equals transformers' ``generate`` decoded by the same tokenizer."""
    import torch
    import transformers
    from test_tokens import QWEN2_SPLIT, corpus_text
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([corpus_text()[:20000]], trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    torch.manual_seed(0)
    c = transformers.Qwen2Config(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    hm = transformers.Qwen2ForCausalLM(c).eval()
    hm.save_pretrained(tmp_path / "q")
    tok.save(str(tmp_path / "q" / "tokenizer.json"))
    r = subprocess.run([sys.executable, "-m", "ringzero.sample", str(tmp_path / "q"), "--tokenizer",
                        str(tmp_path / "q" / "tokenizer.json"), "--prompt", "def step(self):", "--tokens", "8",
                        "--temperature", "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "Llama L=2" in r.stderr, r.stderr
    ids = tok.encode("def step(self):").ids
    with torch.no_grad():
        out = hm.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert r.stdout.rstrip("\n") == tok.decode(out[0].tolist())
