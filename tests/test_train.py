"""The trainer end to end, and its answers to bad input.

End to end (MPI, world sizes 2 and 3): a tiny GPT on a generated text file
learns (the loss falls), the metrics file has every documented key, and the
summary's measured memory equals its formula. Bad input (serial, through the
real command line): one line on stderr and exit code 2, nothing written.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import assert_all

STEP_KEYS = {"step", "loss", "lr", "loss_scale", "grad_norm", "tokens_per_s", "step_time_s", "bytes_sent"}
SUMMARY_KEYS = {"params", "world_size", "stage", "memory", "traffic", "train_loss", "eval_loss",
                "unigram_entropy"}
TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--seq-len", "32", "--batch", "4",
        "--eval-batches", "2", "--sample-chars", "20", "--quiet"]


def _text(path, n=60_000):
    """A learnable text: short repeated phrases with variations."""
    rng = np.random.default_rng(0)
    words = ["def ", "return ", "self.", "value", "(x)", ":\n", "    ", "import ", "numpy", " = "]
    with open(path, "w") as f:
        f.write("".join(words[i] for i in rng.integers(0, len(words), n // 5)))
    return path


@pytest.mark.mpi
@pytest.mark.parametrize("stage", ["2", "3"])
def test_end_to_end(comm, tmp_path_factory, stage):
    if comm.size not in (2, 3):
        pytest.skip("the end-to-end run is checked at world sizes 2 and 3")
    from ringzero.app.train import parse_config, run
    d = comm.bcast(str(tmp_path_factory.mktemp("train")) if comm.rank == 0 else None)
    data = _text(os.path.join(d, "corpus.txt")) if comm.rank == 0 else None
    data = comm.bcast(data)
    metrics = os.path.join(d, "m.jsonl")
    cfg, _ = parse_config(TINY + ["--data", data, "--stage", stage, "--steps", "40", "--lr", "1e-2",
                                  "--warmup", "5", "--eval-interval", "20", "--metrics", metrics])
    summary = run(cfg, comm)
    ok, msg = True, ""
    if comm.rank == 0:
        lines = [json.loads(ln) for ln in open(metrics)]
        steps, summ = lines[:-1], lines[-1]
        first = np.mean([s["loss"] for s in steps[:5]])
        last = np.mean([s["loss"] for s in steps[-5:]])
        ok &= len(steps) == 40 and all(STEP_KEYS <= set(s) for s in steps)
        ok &= [s["step"] for s in steps if "eval_loss" in s] == [19]     # --eval-interval 20: after step 20
        ok &= summ.get("summary") is True and SUMMARY_KEYS <= set(summ)
        ok &= last < 0.8 * first
        ok &= all(v["measured_bytes"] == v["formula_bytes"] for v in summ["memory"].values())
        ok &= summ["world_size"] == comm.size and summ["stage"] == stage
        ok &= summ["traffic"]["measured_bytes_per_step"] > 0
        msg = f"loss {first:.3f} -> {last:.3f}, keys {sorted(summ)}, memory {summ['memory']}"
    assert_all(comm, ok, msg)
    assert summary["eval_loss"] < summary["unigram_entropy"]


@pytest.mark.mpi
def test_resume_continues_bitwise(comm, tmp_path_factory):
    """Save every 3 steps; a run resumed from step 3 repeats steps 3-5 bit for bit."""
    if comm.size != 2:
        pytest.skip("checked at world size 2")
    from ringzero.app.train import parse_config, run
    d = comm.bcast(str(tmp_path_factory.mktemp("resume")) if comm.rank == 0 else None)
    data = comm.bcast(_text(os.path.join(d, "corpus.txt")) if comm.rank == 0 else None)
    common = TINY + ["--data", data, "--stage", "3", "--steps", "6", "--eval-interval", "0",
                     "--save-dir", os.path.join(d, "ck"), "--sample-chars", "0"]
    cfg, _ = parse_config(common + ["--save-every", "3", "--metrics", os.path.join(d, "a.jsonl")])
    run(cfg, comm)
    cfg, _ = parse_config(common + ["--resume", os.path.join(d, "ck", "step-000003"),
                                    "--metrics", os.path.join(d, "b.jsonl")])
    run(cfg, comm)
    ok, msg = True, ""
    if comm.rank == 0:
        a = [json.loads(ln) for ln in open(os.path.join(d, "a.jsonl"))][3:6]
        b = [json.loads(ln) for ln in open(os.path.join(d, "b.jsonl"))][0:3]
        ok = [x["step"] for x in b] == [3, 4, 5] and [x["loss"] for x in a] == [x["loss"] for x in b]
        msg = f"uninterrupted {[x['loss'] for x in a]} vs resumed {[x['loss'] for x in b]}"
    assert_all(comm, ok, msg)


def _check(args, tmp_path):
    """Run the real CLI's validation; return (rc, stderr lines, files left)."""
    before = set(os.listdir(tmp_path))
    r = subprocess.run([sys.executable, "-m", "ringzero.train", "--check", "2", *args],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120)
    return r.returncode, [ln for ln in r.stderr.splitlines() if ln.strip()], set(os.listdir(tmp_path)) - before


@pytest.mark.parametrize("args, needle", [
    (["--data", "no/such/file.txt"], "does not exist"),
    (["--stage", "4"], "unknown stage"),
    (["--mem-budget", "1KiB"], "below the smallest stage"),
    (["--mem-budget", "4X"], "--mem-budget: cannot read size '4X'"),
    (["--seq-len", "100000", "--data", "SMALL"], "seq_len"),
    (["--steps", "ten"], "--steps must be an integer"),
    (["--n-embd", "30", "--n-head", "4"], "divisible"),
    (["--no-such-flag"], "unrecognized arguments"),
    (["--grad-accum", "3"], "batch % K == 0, got 8 % 3 = 2"),
    (["--grad-accum", "0"], "--grad-accum must be >= 1"),
    (["--precision", "bf16", "--device", "cuda"], "CuPy has no bfloat16"),
    (["--precision", "int8"], "fp16, bf16 or fp32"),
    (["--model", "gpt3"], "--model must be one of gpt2"),
    (["--model", "gpt2", "--seq-len", "2048"], "expected <= 1024 (gpt2), got 2048"),
    (["--model", "gpt2", "--n-head", "5"], "768 % 5"),
])
def test_bad_input_one_line_exit_2(tmp_path, args, needle):
    small = tmp_path / "small.txt"
    small.write_text("x" * 1000)
    args = [str(small) if a == "SMALL" else a for a in args]
    args += ["--metrics", str(tmp_path / "m.jsonl")]
    rc, err, new = _check(args, tmp_path)
    assert rc == 2, (rc, err)
    assert len(err) == 1 and needle in err[0], err
    assert err[0].startswith("ringzero.train: error:"), err
    assert not new, f"bad input left files behind: {new}"


def test_good_input_passes_check(tmp_path):
    rc, err, new = _check(["--steps", "3"], tmp_path)
    assert rc == 0 and not err and not new, err


def test_model_preset_and_overrides():
    """--model takes GPT-2's shapes; a dimension flag overrides only itself;
    without --model the small default (4L 4H 128C, context = --seq-len)."""
    from ringzero.app.config import gpt_config
    from ringzero.app.train import parse_config
    cfg, _ = parse_config(["--model", "gpt2-medium", "--n-layer", "2"])
    assert gpt_config(cfg, 256).__dict__ == dict(n_layer=2, n_head=16, n_embd=1024, block_size=1024, vocab=256,
                                                   real_vocab=None)
    cfg, _ = parse_config(["--seq-len", "64", "--n-embd", "96"])
    assert gpt_config(cfg, 320).__dict__ == dict(n_layer=4, n_head=4, n_embd=96, block_size=64, vocab=320,
                                                  real_vocab=None)


def test_preset_learning_rates(tmp_path):
    """Without --lr a preset trains at GPT-3's rate for its size (table 2.1: 125M 6e-4, 350M 3e-4,
    760M 2.5e-4, 1.3B 2e-4); --lr and a TOML lr win; the small default keeps 4e-3."""
    from ringzero.app.train import parse_config
    from ringzero.nn.gpt import PRESETS
    gpt3 = {"gpt2": 6e-4, "gpt2-medium": 3e-4, "gpt2-large": 2.5e-4, "gpt2-xl": 2e-4}
    assert set(gpt3) == set(PRESETS)
    for name, lr in gpt3.items():
        assert parse_config(["--model", name])[0].lr == lr, name
        assert parse_config(["--model", name, "--lr", "1e-3"])[0].lr == 1e-3, name
    toml = tmp_path / "c.toml"
    toml.write_text('model = "gpt2-xl"\nlr = 5e-5\n')
    assert parse_config(["--config", str(toml)])[0].lr == 5e-5
    assert parse_config([])[0].lr == 4e-3


def test_gpt2_preset_passes_check(tmp_path):
    rc, err, new = _check(["--model", "gpt2", "--steps", "3", "--grad-accum", "2", "--precision", "bf16"],
                          tmp_path)
    assert rc == 0 and not err and not new, err


@pytest.mark.mpi
def test_end_to_end_bf16_grad_accum(comm, tmp_path_factory):
    """bf16 with K = 2: learns, the summary names both, every class (with the
    fp32 accumulator) measured == formula, and a checkpoint keeps the GPTConfig."""
    if comm.size != 2:
        pytest.skip("checked at world size 2")
    from ringzero.app.train import parse_config, run
    d = comm.bcast(str(tmp_path_factory.mktemp("bf16")) if comm.rank == 0 else None)
    data = comm.bcast(_text(os.path.join(d, "corpus.txt")) if comm.rank == 0 else None)
    metrics = os.path.join(d, "m.jsonl")
    cfg, _ = parse_config(TINY + ["--data", data, "--stage", "3", "--steps", "40", "--lr", "1e-2",
                                  "--warmup", "5", "--eval-interval", "0", "--metrics", metrics,
                                  "--precision", "bf16", "--grad-accum", "2", "--save-every", "40",
                                  "--save-dir", os.path.join(d, "ck")])
    summary = run(cfg, comm)
    ok, msg = True, ""
    if comm.rank == 0:
        lines = [json.loads(ln) for ln in open(metrics)]
        steps, summ = lines[:-1], lines[-1]
        first, last = np.mean([s["loss"] for s in steps[:5]]), np.mean([s["loss"] for s in steps[-5:]])
        ok &= summ["precision"] == "bf16" and summ["grad_accum"] == 2 and last < 0.8 * first
        ok &= "grad_accum_fp32" in summ["memory"] and all(
            v["measured_bytes"] == v["formula_bytes"] for v in summ["memory"].values())
        ok &= all(s["loss_scale"] == 1.0 for s in steps) and len(summ["peak_rss_bytes"]) == 2
        man = json.load(open(os.path.join(d, "ck", "step-000040", "manifest.json")))
        ok &= man["config"]["gpt"] == {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32, "vocab": 256,
                                         "real_vocab": None}
        ok &= man["classes"]["params"] == "bfloat16"
        msg = f"loss {first:.3f} -> {last:.3f}, summary {summ}"
    assert_all(comm, ok, msg)
    assert summary["eval_loss"] < summary["unigram_entropy"]


def test_toml_config_and_flags_override(tmp_path):
    from ringzero.app.train import parse_config
    f = tmp_path / "c.toml"
    f.write_text('stage = "FULL_SHARD"\nsteps = 7\nlr = 0.01\n')
    cfg, _ = parse_config(["--config", str(f), "--steps", "9"])
    assert (cfg.stage, cfg.steps, cfg.lr) == ("3", 9, 0.01)


def test_lr_schedule_warmup_then_cosine():
    from ringzero.app.train import Config, lr_at
    c = Config(lr=1.0, warmup=10, steps=110, min_lr_frac=0.1)
    assert lr_at(c, 0) == pytest.approx(0.1) and lr_at(c, 9) == pytest.approx(1.0)
    assert lr_at(c, 60) == pytest.approx(0.1 + 0.9 * 0.5)        # half-way down the cosine
    assert lr_at(c, 109) == pytest.approx(0.1, abs=1e-3)
