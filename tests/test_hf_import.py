"""GPT-2 files into ringzero's layout (interop/hf_import.py, interop/gpt2.py), without torch.

References: the arrays written into the files under GPT2LMHeadModel's own key names
(tests/hf_files.py spells them out, independently of ringzero's map), compared with the
named views ringzero reads them into; every refusal is one line naming its field or key.
transformers itself is tests/test_hf_interop.py's.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hf_files import CONFIG, write_gpt2

from ringzero.interop import hf_import
from ringzero.interop.gpt2 import HFConfigError
from ringzero.interop.hf_import import HFSource, fill_piece, load_full
from ringzero.nn.gpt import gpt_units
from ringzero.runtime.flat import Layout

pytest.importorskip("safetensors", reason="the GPT-2 import reads safetensors: pip install 'ringzero[hf]'")

# ringzero name -> GPT-2 key, written out by hand from modeling_gpt2's module names
BY_HAND = {"wte": "wte.weight", "wpe": "wpe.weight", "lnf.w": "ln_f.weight", "lnf.b": "ln_f.bias",
           "h1.ln1.w": "h.1.ln_1.weight", "h1.ln1.b": "h.1.ln_1.bias", "h0.attn.w": "h.0.attn.c_attn.weight",
           "h0.attn.b": "h.0.attn.c_attn.bias", "h1.proj.w": "h.1.attn.c_proj.weight",
           "h1.proj.b": "h.1.attn.c_proj.bias", "h0.ln2.w": "h.0.ln_2.weight", "h0.ln2.b": "h.0.ln_2.bias",
           "h1.fc.w": "h.1.mlp.c_fc.weight", "h1.fc.b": "h.1.mlp.c_fc.bias", "h0.fc2.w": "h.0.mlp.c_proj.weight",
           "h0.fc2.b": "h.0.mlp.c_proj.bias"}


def check_equal(tensors, cfg, L, buf):
    P = L.views(buf)
    assert cfg.real_vocab == CONFIG["vocab_size"] and cfg.vocab == 320     # 300 padded to a multiple of 64
    for name, key in BY_HAND.items():
        want = tensors[key]
        got = P[name][:want.shape[0]] if name == "wte" else P[name]
        assert got.shape == want.shape and np.array_equal(got, want), name
    assert not P["wte"][300:].any(), "the padding rows are zero"
    assert len(P) == len(tensors)


@pytest.mark.parametrize("style", ["hub", "save_pretrained", "sharded", "tied_head", "file", "index"])
def test_reads_every_layout_of_files(tmp_path, style):
    kw = {"hub": dict(buffers=True), "save_pretrained": dict(prefix=True), "sharded": dict(prefix=True, shards=3),
          "tied_head": dict(head="tied"), "file": dict(buffers=True), "index": dict(shards=2)}[style]
    tensors = write_gpt2(tmp_path, **kw)
    path = {"file": tmp_path / "model.safetensors",
            "index": tmp_path / "model.safetensors.index.json"}.get(style, tmp_path)
    cfg, L, buf, hf = load_full(str(path))
    check_equal(tensors, cfg, L, buf)
    assert hf["n_layer"] == 2


@pytest.mark.parametrize("shards", [2, 3, 4, 8])
def test_each_piece_alone_equals_the_full_read(tmp_path, monkeypatch, shards):
    """A rank's pieces read by themselves (flat ranges across rows, in small chunks) are the
    full buffer's pieces: what each rank of an Nd-way import holds."""
    write_gpt2(tmp_path, prefix=True)
    cfg, L1, full, _ = load_full(str(tmp_path))
    monkeypatch.setattr(hf_import, "CHUNK", 100)       # reads of 100 elements: partial rows everywhere
    src = HFSource(str(tmp_path))
    L = Layout(gpt_units(cfg), shards=shards)
    for u in range(len(L.units)):
        seg = np.zeros(L.unit_padded[u], np.float32)
        for r in range(shards):
            fill_piece(src, L, u, r, L.own(seg, u, r))
        ref = L1.unit_full(full, u)
        assert np.array_equal(seg[:L.unit_numel[u]], ref[:L.unit_numel[u]]) and not seg[L.unit_numel[u]:].any()
    src.close()


REFUSALS = [
    ({"activation_function": "relu"}, "activation_function"),
    ({"activation_function": "gelu"}, "activation_function"),
    ({"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings"),
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ({"reorder_and_upcast_attn": True}, "reorder_and_upcast_attn"),
    ({"scale_attn_weights": False}, "scale_attn_weights"),
    ({"n_inner": 100}, "n_inner"),
    ({"model_type": "bert"}, "model_type"),
    ({"add_cross_attention": True}, "add_cross_attention"),
    ({"n_head": 5}, "n_embd"),
    ({"n_layer": None}, "n_layer"),
]


@pytest.mark.parametrize("change,field", REFUSALS, ids=[f for _, f in REFUSALS])
def test_config_refusals_name_the_field(tmp_path, change, field):
    conf = {**CONFIG, **change}
    tensors = write_gpt2(tmp_path, conf=CONFIG)
    with open(tmp_path / "config.json", "w") as f:
        json.dump({k: v for k, v in conf.items() if v is not None}, f)
    with pytest.raises(HFConfigError) as e:
        load_full(str(tmp_path))
    msg = str(e.value)
    assert field in msg and "\n" not in msg, msg
    assert tensors


def test_file_refusals_name_the_key(tmp_path):
    from hf_files import gpt2_tensors
    t = gpt2_tensors(CONFIG)
    cases = {
        "missing": ({k: v for k, v in t.items() if k != "h.1.mlp.c_fc.bias"}, {}, "h.1.mlp.c_fc.bias"),
        "unexpected": ({**t, "h.0.attn.q_proj.weight": t["wpe.weight"]}, {}, "h.0.attn.q_proj.weight"),
        "shape": ({**t, "h.0.ln_1.bias": t["h.0.ln_1.bias"][:5]}, {}, "h.0.ln_1.bias"),
        "untied": (t, {"head": "untied"}, "lm_head.weight"),
        "dtype": ({**t, "ln_f.bias": t["ln_f.bias"].astype(np.int32)}, {}, "ln_f.bias"),
    }
    for what, (tensors, kw, name) in cases.items():
        d = tmp_path / what
        write_gpt2(d, tensors=tensors, **kw)
        with pytest.raises(HFConfigError) as e:
            load_full(str(d))
        assert name in str(e.value) and "\n" not in str(e.value), (what, str(e.value))


def test_folder_refusals(tmp_path):
    with pytest.raises(HFConfigError, match="does not exist"):
        HFSource(str(tmp_path / "nope"))
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "config.json").write_text(json.dumps(CONFIG))
    (tmp_path / "a" / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(HFConfigError, match="pytorch_model.bin: a pickle"):
        HFSource(str(tmp_path / "a"))
    write_gpt2(tmp_path / "b")
    os.remove(tmp_path / "b" / "config.json")
    with pytest.raises(HFConfigError, match="no config.json"):
        HFSource(str(tmp_path / "b" / "model.safetensors"))
    write_gpt2(tmp_path / "c")
    (tmp_path / "c" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(HFConfigError, match="not a readable safetensors file"):
        HFSource(str(tmp_path / "c"))


def trainer_check(*args):
    return subprocess.run([sys.executable, "-m", "ringzero.train", *args, "--check", "2"],
                          capture_output=True, text=True, timeout=120)


def test_trainer_check_accepts_and_refuses(tmp_path):
    """``--init-from`` through the trainer's own validation (--check: no MPI): token data within
    the model's vocabulary is accepted; each mismatch is one line and exit 2."""
    write_gpt2(tmp_path / "m")
    ids = np.random.default_rng(0).integers(0, 300, 4000).astype(np.uint16)
    ids.tofile(tmp_path / "ok.bin")
    np.concatenate([ids, [300]]).astype(np.uint16).tofile(tmp_path / "big.bin")
    (tmp_path / "t.txt").write_text("hello world\n" * 400)
    base = ["--init-from", str(tmp_path / "m"), "--seq-len", "16"]
    r = trainer_check(*base, "--data", str(tmp_path / "ok.bin"))
    assert r.returncode == 0, r.stderr
    ok = ["--data", str(tmp_path / "ok.bin")]
    for extra, want in [(["--data", str(tmp_path / "big.bin")], "holds token 300: expected tokens < vocab = 300"),
                        (["--data", str(tmp_path / "t.txt")], "--init-from needs token ids"),
                        (ok + ["--n-layer", "3"], "--n-layer 3 differs from n_layer = 2"),
                        (ok + ["--model", "gpt2"], "drop --model"),
                        (ok + ["--seq-len", "64"], "n_positions = 32")]:
        r = trainer_check(*base, *extra)      # a flag given twice: the last wins
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and want in lines[0], (extra, r.stderr)


@pytest.mark.mpi
@pytest.mark.parametrize("stage,offload", [("1", "optimizer"), ("3", "optimizer"), ("3", "optimizer,params")])
def test_import_into_offloaded_master(comm, tmp_path_factory, stage, offload):
    """--init-from with --offload: every master piece written into its file; gathered, the
    model's arrays are the file's (BY_HAND), at every world size."""
    from ringzero.nn.gpt import GPT
    from ringzero.runtime.offload import OffloadPolicy
    from ringzero.runtime.zero import Zero
    d = comm.bcast(str(tmp_path_factory.mktemp("gpt2off")) if comm.rank == 0 else None)
    tensors = write_gpt2(d) if comm.rank == 0 else None
    tensors = comm.bcast(tensors)
    off = os.path.join(d, f"off-{comm.rank}")
    os.makedirs(off)
    src = HFSource(d)
    eng = Zero(GPT(src.cfg), comm, stage, precision="fp32", init=src.fill_master, timeout=60,
               offload=OffloadPolicy.parse(offload, off))
    src.close()
    master = eng.full_state("master")
    errors = comm.allgather(src.error)
    eng.close()
    assert errors == [None] * comm.size, errors
    check_equal(tensors, src.cfg, eng.layout, master)


def test_seq_len_defaults_within_the_imported_context(tmp_path):
    """Without --seq-len an imported model of context 32 trains at 32 (the default 128 would be refused);
    one of context 1024 at the default 128; a --seq-len given is kept and checked."""
    from ringzero.app.config import parse_config
    write_gpt2(tmp_path / "m")                                              # n_positions 32
    write_gpt2(tmp_path / "big", conf={**CONFIG, "n_positions": 1024})
    np.random.default_rng(0).integers(0, 300, 4000).astype(np.uint16).tofile(tmp_path / "ok.bin")
    ok = ["--data", str(tmp_path / "ok.bin")]
    assert parse_config(["--init-from", str(tmp_path / "m")] + ok)[0].seq_len == 32
    assert parse_config(["--init-from", str(tmp_path / "big")] + ok)[0].seq_len == 128
    assert parse_config(["--init-from", str(tmp_path / "m"), "--seq-len", "8"] + ok)[0].seq_len == 8
    r = trainer_check("--init-from", str(tmp_path / "m"), *ok)
    assert r.returncode == 0, r.stderr
    r = trainer_check("--init-from", str(tmp_path / "m"), "--seq-len", "128", *ok)
    assert r.returncode == 2 and "expected <= n_positions = 32" in r.stderr and "got 128" in r.stderr, r.stderr


def test_steps_0_saves_the_imported_weights(tmp_path):
    """``mpirun -n 2 ... --init-from DIR --steps 0 --save-dir OUT`` (no --data) writes a checkpoint whose
    fp32 master equals the file's tensors (read back by the sampler's loader, at one shard)."""
    from test_checkpoint import _clean_env, _mpirun

    from ringzero.tools.sample import load
    t = write_gpt2(tmp_path / "m", shards=2)
    cmd = ["timeout", "300"] + _mpirun() + ["-n", "2", sys.executable, "-m", "mpi4py", "-m", "ringzero.train",
                                            "--init-from", str(tmp_path / "m"), "--steps", "0", "--stage", "3",
                                            "--save-dir", str(tmp_path / "out"), "--quiet"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_clean_env())
    assert r.returncode == 0 and "--steps 0: saved the imported weights" in r.stdout, r.stdout + r.stderr
    model, P, m, _ = load(str(tmp_path / "out"), "master")
    assert m["step"] == 0 and m["shards"] == 2
    assert np.array_equal(P["wte"][:300], t["wte.weight"]) and not P["wte"][300:].any()   # padding rows zero
    assert np.array_equal(P["h1.attn.w"], t["h.1.attn.c_attn.weight"])
    assert np.array_equal(P["h0.fc2.b"], t["h.0.mlp.c_proj.bias"]) and np.array_equal(P["lnf.w"], t["ln_f.weight"])
    cfg, L, buf, _ = load_full(str(tmp_path / "m"))
    assert np.array_equal(np.concatenate([P[k].ravel() for k in L.slots]),
                          np.concatenate([L.views(buf)[k].ravel() for k in L.slots]))
    r = trainer_check("--steps", "0")
    assert r.returncode == 2 and "--steps 0 saves an --init-from model" in r.stderr, r.stderr
