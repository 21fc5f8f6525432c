"""The trainer with a Llama-family --model: presets, overrides, learning rates, bad input, a real run.

Serial (through the real command line where it is the CLI's answer): each preset's own
learning rate (GPT-3's table 2.1 by size, typed here), the shrunk preset the trainer builds
(vocab from the data, dimension flags), and one line + exit code 2 for bad input.
MPI (world sizes 2 and 3): ``smollm2-135m`` shrunk to 2 layers of width 72 learns a
generated text at stage 3 with activation checkpointing and at hybrid; its measured memory
equals the formula and the checkpoint's manifest records the family.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import assert_all

from ringzero.nn.llama import LlamaConfig

SHRUNK = ["--model", "smollm2-135m", "--n-layer", "2", "--n-embd", "72", "--seq-len", "32", "--batch", "4",
          "--eval-batches", "2", "--sample-chars", "20", "--quiet"]


def _check(args, tmp_path):
    before = set(os.listdir(tmp_path))
    r = subprocess.run([sys.executable, "-m", "ringzero.train", "--check", "2", *args],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120)
    return r.returncode, [ln for ln in r.stderr.splitlines() if ln.strip()], set(os.listdir(tmp_path)) - before


def test_preset_learning_rates():
    from ringzero.app.config import parse_config
    by_size = {"smollm2-135m": 6e-4, "smollm2-360m": 3e-4, "qwen2.5-0.5b": 3e-4, "tinyllama-1.1b": 2e-4,
               "llama-3.2-1b": 2e-4}
    for name, lr in by_size.items():
        assert parse_config(["--model", name])[0].lr == lr, name
        assert parse_config(["--model", name, "--lr", "1e-5"])[0].lr == 1e-5, name


def test_shrunk_preset_config():
    from ringzero.app.config import model_config, parse_config
    cfg, _ = parse_config(SHRUNK)
    got = model_config(cfg, 256)
    assert got == LlamaConfig(n_layer=2, n_head=9, n_kv_head=3, n_embd=72, head_dim=8, ffn=1536, vocab=256,
                              block_size=8192, rope_theta=100000.0, rms_eps=1e-5, tied=True)
    cfg, _ = parse_config(["--model", "qwen2.5-0.5b", "--n-layer", "1", "--n-head", "4", "--n-kv-head", "1",
                           "--n-embd", "64"])
    q = model_config(cfg, 320)
    assert (q.n_head, q.n_kv_head, q.head_dim, q.qkv_bias, q.vocab, q.rope_theta) == (4, 1, 16, True, 320, 1e6)


def test_preset_passes_check(tmp_path):
    rc, err, new = _check(SHRUNK + ["--steps", "3", "--stage", "3"], tmp_path)
    assert rc == 0 and not err and not new, err


@pytest.mark.parametrize("args, needle", [
    (["--model", "smollm2-135m", "--n-head", "4"], "multiple of n_kv_head"),
    (["--model", "smollm2-135m", "--n-embd", "100"], "divisible"),
    (["--model", "gpt2", "--n-kv-head", "2"], "--n-kv-head applies to a Llama-family --model"),
    (["--model", "tinyllama-1.1b", "--seq-len", "4096"], "expected <= 2048 (tinyllama-1.1b), got 4096"),
    (["--model", "llama-4"], "smollm2-135m"),
])
def test_bad_input_one_line_exit_2(tmp_path, args, needle):
    rc, err, new = _check(args, tmp_path)
    assert rc == 2 and len(err) == 1 and needle in err[0], (rc, err)
    assert err[0].startswith("ringzero.train: error:"), err
    assert not new


def summary_cfg(cfg):
    """The model config the trainer built for cfg on the byte corpus (vocab 256)."""
    from ringzero.app.config import model_config
    return model_config(cfg, 256)


def _text(path, n=60_000):
    rng = np.random.default_rng(0)
    words = ["def ", "return ", "self.", "value", "(x)", ":\n", "    ", "import ", "numpy", " = "]
    with open(path, "w") as f:
        f.write("".join(words[i] for i in rng.integers(0, len(words), n // 5)))
    return path


@pytest.mark.mpi
@pytest.mark.parametrize("stage, extra", [("3", ["--activation-checkpointing"]), ("hybrid", [])])
def test_end_to_end(comm, tmp_path_factory, stage, extra):
    if comm.size not in (2, 3):
        pytest.skip("the Llama end-to-end run is checked at world sizes 2 and 3")
    from ringzero.app.train import parse_config, run
    d = comm.bcast(str(tmp_path_factory.mktemp("llama")) if comm.rank == 0 else None)
    data = comm.bcast(_text(os.path.join(d, "corpus.txt")) if comm.rank == 0 else None)
    metrics, save = os.path.join(d, "m.jsonl"), os.path.join(d, "ck")
    cfg, _ = parse_config(SHRUNK + ["--data", data, "--stage", stage, "--steps", "30", "--lr", "3e-3",
                                    "--warmup", "5", "--eval-interval", "0", "--metrics", metrics,
                                    "--save-every", "30", "--save-dir", save] + extra)
    summary = run(cfg, comm)
    ok, msg = True, ""
    if comm.rank == 0:
        lines = [json.loads(ln) for ln in open(metrics)]
        steps, summ = lines[:-1], lines[-1]
        first, last = np.mean([s["loss"] for s in steps[:5]]), np.mean([s["loss"] for s in steps[-5:]])
        ok &= len(steps) == 30 and all(np.isfinite(s["loss"]) for s in steps) and last < 0.8 * first
        ok &= all(v["measured_bytes"] == v["formula_bytes"] for v in summ["memory"].values())
        man = json.load(open(os.path.join(save, "step-000030", "manifest.json")))
        rec = man["config"]["model_config"]
        ok &= rec["family"] == "llama" and rec["n_kv_head"] == 3 and "gpt" not in man["config"]
        # the sampler rebuilds the Llama from the manifest, and its weights score the held-out text as the run did
        from ringzero.nn.llama import Llama
        from ringzero.tools.sample import generate, load
        model, P, _, _ = load(os.path.join(save, "step-000030"), "master")
        ok &= type(model) is Llama and model.cfg == summary_cfg(cfg)
        out = generate(model, P, np.frombuffer(b"def ", np.uint8).astype(np.int64), 8, 0.0, None,
                       np.random.default_rng(0))
        ok &= out.shape == (12,) and int(out.max()) < 256
        msg = f"loss {first:.3f} -> {last:.3f}, memory {summ['memory']}, manifest model {rec}"
    assert_all(comm, ok, msg)
    assert np.isfinite(summary["eval_loss"])
