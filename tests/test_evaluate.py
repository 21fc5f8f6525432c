"""``python -m ringzero.evaluate`` (tools/evaluate.py) against transformers' own loss with labels = input_ids.

Reference: transformers' GPT2LMHeadModel (random weights, saved with save_pretrained) scoring the same
windows as one batch, ``model(input_ids=w, labels=w).loss``: the mean over every window's T-1 shifted
predictions. Checked from a Hugging Face folder and from a ringzero checkpoint of the same weights
(``--init-from --steps 0``), in one process and under mpirun -n 2, from uint16 and uint32 token files.
"""
import json
import subprocess
import sys

import numpy as np
import pytest
from test_hf_interop import T, V, tiny_hf

from ringzero.interop.token_files import TokenWriter

pytest.importorskip("transformers")


def token_file(path, ids, vocab):
    w = TokenWriter(str(path), vocab)
    w.write(ids)
    w.close()
    return str(path)


def hf_windows_loss(m, ids, t, n):
    import torch
    w = torch.from_numpy(np.asarray(ids[:n * t], np.int64).reshape(n, t))
    with torch.no_grad():
        return m(input_ids=w, labels=w).loss.item()


def evaluate(*args, mpi=0):
    cmd = [sys.executable, "-m", "ringzero.evaluate", *args]
    if mpi:
        from test_checkpoint import _clean_env, _mpirun
        return subprocess.run(["timeout", "300"] + _mpirun() + ["-n", str(mpi)] + cmd, capture_output=True,
                              text=True, timeout=300, env=_clean_env())
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_loss_equals_transformers(tmp_path):
    m = tiny_hf(tmp_path / "hf")
    ids = np.random.default_rng(0).integers(0, V, 5 * T + 7)       # 5 whole windows and a partial one
    f16 = token_file(tmp_path / "a.bin", ids, V)
    f32 = token_file(tmp_path / "b.bin", ids, 70000)                 # the same ids as uint32
    t = 16
    cases = [((str(tmp_path / "hf"), "--data", f16, "--seq-len", str(t), "--json", str(tmp_path / "o.json")), 0,
              (ids.size // t)),
             ((str(tmp_path / "hf"), "--data", f32, "--seq-len", str(T), "--batches", "2", "--batch", "2"), 0, 4),
             ((str(tmp_path / "hf"), "--data", f32, "--seq-len", str(T), "--batch", "3"), 2, 5)]
    for args, mpi, n in cases:
        r = evaluate(*args, mpi=mpi)
        assert r.returncode == 0, r.stdout + r.stderr
        tt = int(args[args.index("--seq-len") + 1])
        want = hf_windows_loss(m, ids, tt, n)
        got = float(r.stdout.split()[1])
        assert abs(got - want) <= 1e-5 * want and f"{n:,} windows of {tt} tokens" in r.stdout, (args, r.stdout, want)
    res = json.loads((tmp_path / "o.json").read_text())
    want = hf_windows_loss(m, ids, 16, ids.size // 16)
    assert set(res) == {"loss", "perplexity", "tokens", "windows"} and res["windows"] == ids.size // 16
    assert res["tokens"] == res["windows"] * 15 and abs(res["loss"] - want) <= 1e-5 * want
    assert abs(res["perplexity"] - np.exp(res["loss"])) <= 1e-9 * res["perplexity"]


def test_a_ringzero_checkpoint_scores_as_its_source(tmp_path):
    from test_checkpoint import _clean_env, _mpirun
    m = tiny_hf(tmp_path / "hf", seed=3)
    cmd = ["timeout", "300"] + _mpirun() + ["-n", "2", sys.executable, "-m", "mpi4py", "-m", "ringzero.train",
                                            "--init-from", str(tmp_path / "hf"), "--steps", "0", "--quiet",
                                            "--save-dir", str(tmp_path / "ck")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_clean_env())
    assert r.returncode == 0, r.stdout + r.stderr
    ids = np.random.default_rng(1).integers(0, V, 3 * T)
    f = token_file(tmp_path / "a.bin", ids, V)
    r = evaluate(str(tmp_path / "ck"), "--data", f, "--seq-len", str(T))
    assert r.returncode == 0 and "step-000000" in r.stderr, r.stdout + r.stderr
    want = hf_windows_loss(m, ids, T, 3)
    assert abs(float(r.stdout.split()[1]) - want) <= 1e-5 * want


def test_refusals_are_one_line(tmp_path):
    tiny_hf(tmp_path / "hf")
    ok = token_file(tmp_path / "a.bin", np.arange(100) % V, V)
    big = token_file(tmp_path / "big.bin", np.full(100, V), 70000)
    hf = str(tmp_path / "hf")
    for args, want in [((hf, "--data", ok, "--seq-len", str(T + 1)), f"expected <= {T}, got {T + 1}"),
                       ((hf, "--data", ok, "--seq-len", "1"), "--seq-len must be >= 2"),
                       ((hf, "--data", big, "--seq-len", "8"), f"holds token {V}: expected ids < the model's"),
                       ((hf, "--data", str(tmp_path / "no.bin"), "--seq-len", "8"), "does not exist"),
                       ((str(tmp_path / "nope"), "--data", ok, "--seq-len", "8"), "does not exist"),
                       ((hf, "--data", ok, "--seq-len", "8", "--batches", "0"), "must be >= 1"),
                       ((hf, "--data", ok, "--seq-len", "8", "--json", str(tmp_path / "x" / "o.json")),
                        "does not exist")]:
        r = evaluate(*args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and want in lines[0], (args, r.stderr)
    tiny = token_file(tmp_path / "t.bin", np.arange(5), V)
    r = evaluate(hf, "--data", tiny, "--seq-len", "8")
    assert r.returncode == 2 and "expected at least one window" in r.stderr, r.stderr


@pytest.mark.parametrize("name", ["llama-untied-scaled", "qwen2-tied"])
def test_llama_family_loss_equals_transformers(tmp_path, name):
    """The Llama family: from the Hugging Face folder (one process) and from a ringzero checkpoint of it
    (mpirun -n 2), the loss equals LlamaForCausalLM's / Qwen2ForCausalLM's with labels = input_ids."""
    from hf_llama import CASES
    from hf_llama import V as LV
    from test_llama_interop import run, save
    m = save(tmp_path / "hf", dict((c[0], c) for c in CASES)[name])
    ids = np.random.default_rng(4).integers(0, LV, 7 * 16 + 3)
    f = token_file(tmp_path / "a.bin", ids, LV)
    run(["mpi4py", "-m", "ringzero.train", "--init-from", str(tmp_path / "hf"), "--steps", "0", "--quiet",
         "--save-dir", str(tmp_path / "ck")], mpi=2)
    want = hf_windows_loss(m, ids, 16, 7)
    for src, mpi in ((tmp_path / "hf", 0), (tmp_path / "ck", 2)):
        r = evaluate(str(src), "--data", f, "--seq-len", "16", mpi=mpi)
        assert r.returncode == 0 and "Llama" in r.stderr, r.stdout + r.stderr
        assert abs(float(r.stdout.split()[1]) - want) <= 1e-5 * want, (src, r.stdout, want)
