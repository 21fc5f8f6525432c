"""``python -m ringzero.sample`` against independent references.

- greedy: the tool's output (loader + ``generate``) equals an argmax decode
  written out here with the model's own forward over ``engine.full_params()``
  gathered by the engine before the save;
- one checkpoint saved at N ranks and the same state saved again at 1 rank
  (loaded on COMM_SELF, resharded by the checkpoint loader) give the same text;
- a seed gives one output; top-k keeps to the k largest logits of the
  reference forward; ``next_token``'s frequencies match a softmax computed here;
- bad input: missing directory, not a checkpoint, a prompt byte outside the
  vocabulary -> one line, exit 2.
"""
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import assert_all

TINY = dict(n_layer=2, n_head=2, n_embd=24, block_size=16, vocab=256)
TEXT = np.frombuffer(b"def f(x):\n    return x + 1\n\n" * 200, np.uint8)
PROMPT = "def "


def model(**over):
    from ringzero.nn.gpt import GPT, GPTConfig
    return GPT(GPTConfig(**dict(TINY, **over)))


def trained(comm, stage="3", steps=6, **over):
    """An engine after a few real steps on TEXT (tokens folded into the vocab)."""
    from ringzero import Zero
    from ringzero.app.data import Batches
    m = model(**over)
    eng = Zero(m, comm, stage, seed=3, timeout=60)
    data = Batches(TEXT.astype(np.int64) % m.cfg.vocab, 2, TINY["block_size"], comm.rank, comm.size, 5)
    for s in range(steps):
        eng.step(*data.get(s), 3e-3)
    return eng


def config(m):
    return {"n_head": m.cfg.n_head, "n_layer": m.cfg.n_layer}


def reference_greedy(m, P, prompt_ids, n):
    """Argmax decode with the model's own forward; the context is the last block_size ids."""
    ids = list(prompt_ids)
    for _ in range(n):
        ctx = np.array(ids[-m.cfg.block_size:], np.int64)[None, :]
        ids.append(int(np.argmax(m.logits(P, ctx)[0, -1])))
    return np.array(ids)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "ringzero.sample", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


# ------------------------------------------------------------------ MPI: N ranks vs 1 rank
@pytest.mark.mpi
def test_checkpoint_at_n_ranks_and_1_rank_sample_alike(comm, tmp_path_factory):
    from mpi4py import MPI

    from ringzero.runtime import checkpoint as ck
    from ringzero.tools import sample as sm
    d = comm.bcast(str(tmp_path_factory.mktemp("ck")) if comm.rank == 0 else None, root=0)
    eng = trained(comm, "3")
    full = eng.full_params()                                   # collective: gathered by the engine
    path_n = ck.save(eng, os.path.join(d, "n"), 6, config=config(eng.model))
    ok, msg = True, ""
    if comm.rank == 0:
        try:
            one = trained(MPI.COMM_SELF, "0", steps=0)          # other weights: the load must matter
            ck.load(one, path_n)
            path_1 = ck.save(one, os.path.join(d, "one"), 6, config=config(one.model))
            ref = reference_greedy(eng.model, eng.layout.views(full), TEXT[:4], 24)
            outs = {}
            for p in (path_n, path_1):
                m, P, man, _ = sm.load(p)
                outs[man["shards"]] = (sm.generate(m, P, TEXT[:4], 24, 0.0),
                                   sm.generate(m, P, TEXT[:4], 24, 1.0, 5, np.random.default_rng(7)))
            (gn, sn), (g1, s1) = outs[comm.size], outs[1]
            ok = np.array_equal(gn, ref) and np.array_equal(g1, ref) and np.array_equal(sn, s1)
            msg = f"greedy {gn[4:]} / {g1[4:]} vs reference {ref[4:]}; sampled {sn[4:]} vs {s1[4:]}"
        except Exception as e:          # every rank must reach assert_all
            ok, msg = False, f"{type(e).__name__}: {e}"
    assert_all(comm, ok, msg)


# ------------------------------------------------------------------ serial
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(checkpoint path, engine's full params, model) of a 1-rank stage-2 run."""
    from mpi4py import MPI

    from ringzero.runtime import checkpoint as ck
    eng = trained(MPI.COMM_SELF, "2")
    full = eng.full_params()
    path = ck.save(eng, str(tmp_path_factory.mktemp("ck1")), 6, config=config(eng.model))
    return path, full, eng


def test_greedy_cli_equals_reference(ckpt):
    path, full, eng = ckpt
    ref = reference_greedy(eng.model, eng.layout.views(full), np.frombuffer(PROMPT.encode(), np.uint8), 40)
    r = run_cli(os.path.dirname(path), "--prompt", PROMPT, "--tokens", 40, "--temperature", 0)
    assert r.returncode == 0, r.stderr
    assert r.stdout == bytes(ref.astype(np.uint8)).decode("utf-8", errors="replace") + "\n"
    assert "step 6" in r.stderr and "1 shard(s)" in r.stderr


def test_seed_determinism_and_top_k(ckpt):
    from ringzero.tools import sample as sm
    path, full, eng = ckpt
    m, P, _, _ = sm.load(path)
    ids = sm.encode(PROMPT, 256)
    a = sm.generate(m, P, ids, 30, 1.0, None, np.random.default_rng(11))
    b = sm.generate(m, P, ids, 30, 1.0, None, np.random.default_rng(11))
    c = sm.generate(m, P, ids, 30, 1.0, None, np.random.default_rng(12))
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert np.array_equal(sm.generate(m, P, ids, 12, 1.0, 1, np.random.default_rng(3)),
                          reference_greedy(m, P, ids, 12))           # top-1 is greedy
    k = 3
    s = sm.generate(m, P, ids, 20, 2.0, k, np.random.default_rng(5))
    Pe = eng.layout.views(full)
    for t in range(ids.size, s.size):                                # each draw is among the top k
        lg = eng.model.logits(Pe, s[max(0, t - 16):t][None, :])[0, -1]
        assert s[t] in np.argsort(lg)[-k:]
    r1 = run_cli(path, "--prompt", PROMPT, "--tokens", 30, "--temperature", 1.0, "--seed", 11)
    assert r1.returncode == 0 and r1.stdout == sm.decode(a, True) + "\n"


def test_next_token_frequencies_match_softmax():
    from ringzero.tools import sample as sm
    lg = np.array([2.0, 1.0, 0.0, -1.0, 0.5, 3.0])
    for temp, k in ((1.0, None), (0.5, None), (1.0, 3)):
        z = lg / temp
        keep = np.argsort(z)[-k:] if k else np.arange(z.size)
        p = np.zeros_like(z)
        p[keep] = np.exp(z[keep]) / np.exp(z[keep]).sum()
        rng = np.random.default_rng(0)
        n = 40000
        f = np.bincount([sm.next_token(lg, temp, k, rng) for _ in range(n)], minlength=z.size) / n
        assert np.all(np.abs(f - p) <= 4 * np.sqrt(p * (1 - p) / n) + 1e-12), (f, p)
    assert sm.next_token(lg, 0, None, None) == 5


def test_weights_master_is_close_to_params(ckpt):
    from ringzero.tools import sample as sm
    path, full, eng = ckpt
    _, Pp, _, _ = sm.load(path, "params")
    _, Pm, _, _ = sm.load(path, "master")
    master = eng.layout.views(eng.full_state("master"))
    for name, v in Pm.items():
        assert np.array_equal(v, master[name])                       # fp32 master, bit for bit
        assert np.array_equal(Pp[name], master[name].astype(np.float16).astype(np.float32))


def test_bad_input_one_line_exit_2(ckpt, tmp_path):
    from mpi4py import MPI

    from ringzero.runtime import checkpoint as ck
    path = ckpt[0]
    small = ck.save(trained(MPI.COMM_SELF, "1", steps=1, vocab=37), str(tmp_path / "v37"), 1,
                    config={"n_head": 2})
    (tmp_path / "empty").mkdir()
    cases = [((tmp_path / "nope",), "does not exist"),
             ((tmp_path / "empty",), "is not a checkpoint"),
             ((small, "--prompt", PROMPT), "prompt byte 100 at position 0 is outside"),
             ((path, "--tokens", -1), "--tokens must be >= 0"),
             ((path, "--prompt", ""), "the prompt is empty"),
             ((path, "--prompt-ids", "1,x"), "comma-separated integers"),
             ((path, "--prompt-ids", "300"), "must be in [0, 256)")]
    for args, want in cases:
        r = run_cli(*args)
        assert r.returncode == 2, (args, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and want in lines[0] and lines[0].startswith("ringzero.sample: error:"), \
            (args, r.stderr)
        assert r.stdout == ""
    r = run_cli(small, "--prompt-ids", "1,2,36", "--tokens", 5, "--temperature", 0)
    assert r.returncode == 0 and len(r.stdout.encode("utf-8", "surrogateescape")) >= 1


def test_generate_reproduces_the_trainers_current_sample(ckpt):
    """The trainer's end-of-run sample today is GPT.generate (temperature 0.8, its seed);
    sample.generate, its replacement, gives the same tokens for the same Generator."""
    from ringzero.tools import sample as sm
    path, full, eng = ckpt
    P = eng.layout.views(full)
    ids = sm.encode(PROMPT, 256)
    theirs = eng.model.generate(P, ids[None, :], 40, 0.8, np.random.default_rng(1337))[0]
    ours = sm.generate(eng.model, P, ids, 40, 0.8, None, np.random.default_rng(1337))
    assert np.array_equal(np.asarray(theirs), ours)


def test_heads_come_from_the_saved_config(ckpt):
    """Shapes come from the layout, heads from the config: the saved GPTConfig ("gpt"), then
    a preset name, then the trainer's n_head; none of them is one line, exit 2."""
    from ringzero.runtime import checkpoint as ck
    from ringzero.tools import sample as sm
    m = ck.read_manifest(ckpt[0])
    c = sm.config_from_manifest(m)
    assert (c.n_layer, c.n_embd, c.block_size, c.vocab, c.n_head) == (2, 24, 16, 256, 2)
    for conf, heads in (({"gpt": {"n_head": 3}, "model": "gpt2", "n_head": 4}, 3),
                        ({"model": "gpt2", "n_head": 4}, 12), ({"n_head": 4}, 4)):
        assert sm.config_from_manifest(dict(m, config=conf)).n_head == heads
    with pytest.raises(sm.SampleError, match="no n_head"):
        sm.config_from_manifest(dict(m, config={}))

