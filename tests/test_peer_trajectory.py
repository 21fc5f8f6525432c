"""The torch-side peers of ``benchmarks/train_peer.py`` against ringzero's engine, step by step, at GPT-2's width.

What it is
    At the MPI group's world size (1 to 4), every peer mode as benchmarked (``train_peer_worker.build``
    and ``train``, benchmarks/peer_engines.py: DDP; FSDP SHARD_GRAD_OP and FULL_SHARD and FSDP2, all
    built on the meta device; DeepSpeed ZeRO-1, 2 and 3, stage 3 under zero.Init, its CPU Adam) and
    ringzero's engine at stage 2, fp32, built as the trainer builds it, train the same GPT (n_embd 768,
    12 heads, 2 layers, T = 32, the byte vocabulary) for STEPS steps on the same batches of the default
    corpus, with a warm-up and a cosine decay of the learning rate, weight decay and global-norm
    clipping that acts. Every step's loss (the mean over ranks on both sides) must agree within the
    trajectory tolerance of tests/test_step_reference.py (relative 1e-5), and so must the final weights
    (relative L2 error per tensor 1e-4, the attention's key bias left out, as there: its gradient is
    rounding noise). ringzero runs once per world size; every mode is compared with that run.

    The Llama family the same way (``test_llama_peer_follows_ringzero``): transformers' own
    LlamaForCausalLM (smollm2-135m's preset at 2 layers, width 64, 4 heads, 2 KV heads) and
    Qwen2ForCausalLM (qwen2.5-0.5b's: q/k/v bias, θ 1e6) under DDP, FSDP FULL_SHARD, FSDP2 and
    DeepSpeed ZeRO-2 and ZeRO-3 (zero.Init), loaded
    from ringzero's initial weights through ringzero/interop's name map, against ringzero's Llama at
    stage 2, within the same tolerances; a peer with 10 x the rotary θ or with decay on the norms fails
    (``test_llama_comparison_catches_a_different_peer``).

    The comparison can fail (``test_comparison_catches_a_different_peer``): a peer with its own initial
    draw (the loss off by 3 % to 6 %), with weight decay on every parameter (torch's default: the final
    layernorm's gain off by about 4 x the weights' tolerance), with a constant lr (the schedule not
    applied) or with no clipping (both: the loss off by 7 % to 14 %) ends outside those tolerances.
What it is not
    A speed test, or a check of ringzero against an independent optimizer
    (tests/test_step_reference.py is that): here the torch peer is what is
    under test, ringzero the reference it must follow. Skipped without torch
    (RINGZERO_PEER=1 installs it) and above 4 ranks (every rank imports torch); the DeepSpeed modes
    skip without deepspeed, except under RINGZERO_PEER=1, where its absence fails them.
    Across emulated nodes, tests/cluster/test_cluster_peer.py runs this module with
    RINGZERO_PEER_MASTER and RINGZERO_PEER_IFNAME naming rank 0's node and the nodes' interface.
"""
import argparse
import datetime
import importlib.util
import os
import socket
import sys

import numpy as np
import pytest
from conftest import assert_all

pytestmark = pytest.mark.mpi
HAVE_TORCH = importlib.util.find_spec("torch") is not None
BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
# GPT-2's width and heads, two blocks (so the residual projections' init is 0.02 / sqrt(4)), a short T
FLAGS = ["--n-layer", "2", "--n-head", "12", "--n-embd", "768", "--block", "32", "--seq-len", "32",
         "--batch", "2", "--steps", "6", "--seed", "7", "--lr", "1e-3", "--lr-warmup", "2",
         "--min-lr-frac", "0.1", "--weight-decay", "0.1", "--grad-clip", "1.0", "--compute-steps", "0"]
TOL_LOSS, TOL_W = 1e-5, 1e-4          # tests/test_step_reference.py's


@pytest.fixture(scope="module")
def gloo():
    """A gloo process group over the MPI ranks (rank 0 picks the port), torch on one thread."""
    if not HAVE_TORCH:
        pytest.skip("torch is not installed (RINGZERO_PEER=1 installs it)")
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    if comm.size > 4:
        pytest.skip(f"the peer is checked at 1-4 ranks (every rank imports torch), this run has {comm.size}")
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    # one host: loopback; across emulated nodes (tests/cluster): rank 0's node address and interface
    master = os.environ.get("RINGZERO_PEER_MASTER", "127.0.0.1")
    port = None
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind((master, 0))
            port = s.getsockname()[1]
    port = comm.bcast(port, root=0)
    os.environ["GLOO_SOCKET_IFNAME"] = os.environ.get("RINGZERO_PEER_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=comm.rank,
                            world_size=comm.size, timeout=datetime.timedelta(seconds=120))
    sys.path.insert(0, BENCH)
    import train_peer_worker
    yield torch, train_peer_worker
    dist.destroy_process_group()


def peer_args(worker, mode, **change) -> argparse.Namespace:
    a = worker.parser().parse_args(["torch", "--out", ".", "--mode", mode, *FLAGS])
    for k, v in change.items():
        setattr(a, k, v)
    return a


def run_peer(torch, worker, a, comm, own_draw=False):
    """The peer's training: (per-step loss, the mean over ranks; {ringzero name: final weight})."""
    import torch.distributed as dist

    from ringzero.app.data import Batches
    cfg, corpus, peer, _ = worker.build(a, torch, own_draw=own_draw)
    batches = Batches(corpus.train, a.batch, a.seq_len, comm.rank, comm.size, a.seed)
    _, _, losses = worker.train(a, peer, batches, torch)
    mean = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(mean)
    params = peer.weights()                  # every parameter in full, gathered one at a time
    return (mean / comm.size).tolist(), as_ringzero(params, cfg), cfg, corpus


def as_ringzero(params, cfg) -> dict:
    """{ringzero name: float64 array in ringzero's (in, out) layout} from the peer's full torch tensors."""
    from ringzero.nn.families import LLAMA, family_of, units_of
    if family_of(cfg) == LLAMA:          # transformers' q/k/v and gate/up joined by interop's name map
        from torch_llama import LlamaInit, ringzero_weights

        from ringzero.runtime.flat import Layout
        return ringzero_weights(params, cfg, LlamaInit(Layout(units_of(cfg)), 0, cfg).names)
    from torch_gpt import torch_name
    weights = {}
    for s in (s for u in units_of(cfg) for s in u.params):
        tn, transpose = torch_name(s.name)
        w = params[tn].detach().numpy().astype(np.float64)
        weights[s.name] = w.T if transpose else w
    return weights


def run_ringzero(a, cfg, corpus, comm):
    """ringzero's engine as ringzero.app.train builds it, on the same batches and schedule."""
    from ringzero.app.config import Config, lr_at
    from ringzero.app.data import Batches
    from ringzero.nn.families import build
    from ringzero.runtime.optim import AdamConfig
    from ringzero.runtime.zero import Zero
    eng = Zero(build(cfg), comm, "2", precision="fp32", seed=a.seed,
               adam=AdamConfig(weight_decay=a.weight_decay, grad_clip=a.grad_clip), timeout=60)
    sched = Config(lr=a.lr, warmup=a.lr_warmup, min_lr_frac=a.min_lr_frac, steps=a.steps)
    batches = Batches(corpus.train, a.batch, a.seq_len, comm.rank, comm.size, a.seed)
    losses, norms = [], []
    for step in range(a.steps):
        res = eng.step(*batches.get(step), lr_at(sched, step))
        losses.append(res.loss)
        norms.append(res.grad_norm)
    final = {k: np.array(v, np.float64) for k, v in eng.layout.views(eng.full_state("master")).items()}
    return losses, norms, final


_REFERENCE = {}      # ringzero's run per (flags, world): every mode is compared with the same one


def compare(torch, worker, comm, a, ref=None, own_draw=False):
    """Errors of the peer (flags ``a``) against ringzero (flags ``ref``, default ``a``; the same numbers on
    every rank)."""
    ref = ref or a
    t_loss, t_w, cfg, corpus = run_peer(torch, worker, a, comm, own_draw)
    key = (tuple(sorted((k, str(v)) for k, v in vars(ref).items() if k != "mode")), comm.size)
    if key not in _REFERENCE:
        _REFERENCE[key] = run_ringzero(ref, cfg, corpus, comm)
    r_loss, norms, r_w = _REFERENCE[key]
    # the key bias's columns of attn.b (GPT: [q | k | v], C each; Qwen2: H·D query, then K·D key columns)
    k0, k1 = (cfg.n_embd, 2 * cfg.n_embd) if not hasattr(cfg, "n_kv_head") else \
        (cfg.n_head * cfg.head_dim, (cfg.n_head + cfg.n_kv_head) * cfg.head_dim)
    w_err = {}
    for k, ref in r_w.items():
        got = t_w[k].copy()
        if k.endswith("attn.b"):                  # the key bias: rounding noise (module docstring)
            got[k0:k1], ref = 0, ref.copy()
            ref[k0:k1] = 0
        w_err[k] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    worst = max(w_err, key=w_err.get)
    return {"loss": max(abs(x - y) / abs(y) for x, y in zip(t_loss, r_loss)), "worst": worst,
            "weights": w_err[worst], "clipped": sum(n > a.grad_clip for n in norms),
            "losses": (t_loss, r_loss)}


MODES = ["ddp", "fsdp-grad-op", "fsdp-full", "fsdp2-full", "ds-zero1", "ds-zero2", "ds-zero3"]


def need(mode):
    """Skip a DeepSpeed mode where DeepSpeed is absent, except under CI's peer install (RINGZERO_PEER=1)."""
    if mode.startswith("ds-") and importlib.util.find_spec("deepspeed") is None:
        if os.environ.get("RINGZERO_PEER") == "1":
            pytest.fail("RINGZERO_PEER=1 but deepspeed is not installed (setup.cfg's peer extra pins it)")
        pytest.skip("deepspeed is not installed (RINGZERO_PEER=1 installs it)")


@pytest.mark.parametrize("mode", MODES)
def test_peer_follows_ringzero(gloo, comm, mode):
    """The peer as benchmarked: every step's loss within 1e-5, every final weight within 1e-4."""
    need(mode)
    torch, worker = gloo
    e = compare(torch, worker, comm, peer_args(worker, mode))
    ok = e["loss"] <= TOL_LOSS and e["weights"] <= TOL_W and e["clipped"] >= 1
    msg = (f"{mode}, n={comm.size}: loss rel err {e['loss']:.2e} (<= {TOL_LOSS}), worst weight {e['worst']} "
           f"{e['weights']:.2e} (<= {TOL_W}), clipping acted in {e['clipped']} steps; losses torch "
           f"{[round(x, 5) for x in e['losses'][0]]} ringzero {[round(x, 5) for x in e['losses'][1]]}")
    if comm.rank == 0:
        print(msg)
    assert_all(comm, ok, msg)


def _all_decay(worker, monkeypatch):
    decay_groups = worker.decay_groups
    monkeypatch.setattr(worker, "decay_groups", lambda model, cfg, wd: [
        {"params": [p for g in decay_groups(model, cfg, wd) for p in g["params"]], "weight_decay": wd}])


# (mode, what differs in the peer): its own initial draw, decay on every parameter, a constant lr
# (the schedule not applied), no clipping; ringzero runs the flags as they are
# (the suite runs this at world sizes 1-4 inside one timeout per size: one case per kind of fault and engine)
CHANGES = [("ddp", "init=torch"), ("ddp", "decay=all"), ("fsdp2-full", "lr=constant"), ("ds-zero2", "clip=none"),
           ("ds-zero3", "lr=constant")]


@pytest.mark.parametrize("mode,change", CHANGES, ids=[f"{m}-{c}" for m, c in CHANGES])
def test_comparison_catches_a_different_peer(gloo, comm, monkeypatch, mode, change):
    """A peer with its own draw, decay on biases and norms, the wrong lr or no clipping fails the comparison."""
    need(mode)
    torch, worker = gloo
    ref = peer_args(worker, mode)
    a = {"lr=constant": peer_args(worker, mode, lr_warmup=0, min_lr_frac=1.0),
         "clip=none": peer_args(worker, mode, grad_clip=0.0)}.get(change, ref)
    if change == "decay=all":
        _all_decay(worker, monkeypatch)
    e = compare(torch, worker, comm, a, ref, own_draw=change == "init=torch")
    # decay on the norms' gains shrinks them by wd * sum(lr) = 0.1 * 4e-3: about 4 x TOL_W in lnf.w
    ok = e["weights"] > 2 * TOL_W and (change != "init=torch" or e["loss"] > 10 * TOL_LOSS)
    msg = (f"{mode} {change}, n={comm.size}: loss rel err {e['loss']:.2e}, worst weight {e['worst']} "
           f"{e['weights']:.2e}")
    if comm.rank == 0:
        print(msg)
    assert_all(comm, ok, msg)


# ---- the Llama family: transformers' own LlamaForCausalLM / Qwen2ForCausalLM as the peer -----------------

# a Llama-family preset made tiny: 2 layers, width 64, 4 heads of 16, 2 KV heads (2 query heads each),
# the preset's MLP (1536), θ and ε, tied; the byte vocabulary; the same schedule, decay and clip as FLAGS
LLAMA_DIMS = ["--n-layer", "2", "--n-head", "4", "--n-kv-head", "2", "--n-embd", "64"]
LLAMA_FLAGS = LLAMA_DIMS + ["--seq-len", "32", "--batch", "2", "--steps", "6", "--seed", "7", "--lr", "1e-3",
                            "--lr-warmup", "2", "--min-lr-frac", "0.1", "--weight-decay", "0.1", "--grad-clip",
                            "1.0", "--compute-steps", "0"]
LLAMA_CASES = [("smollm2-135m", "ddp"), ("smollm2-135m", "fsdp-full"), ("smollm2-135m", "fsdp2-full"),
               ("qwen2.5-0.5b", "ddp"), ("qwen2.5-0.5b", "fsdp-full"), ("smollm2-135m", "ds-zero2"),
               ("smollm2-135m", "ds-zero3")]     # qwen2.5: q/k/v bias, θ 1e6, ε 1e-6


def llama_args(worker, preset, mode, **change) -> argparse.Namespace:
    a = worker.parser().parse_args(["torch", "--out", ".", "--mode", mode, "--model", preset, *LLAMA_FLAGS])
    for k, v in change.items():
        setattr(a, k, v)
    return a


@pytest.mark.parametrize("preset,mode", LLAMA_CASES, ids=[f"{p}-{m}" for p, m in LLAMA_CASES])
def test_llama_peer_follows_ringzero(gloo, comm, preset, mode):
    """transformers' model loaded from ringzero's initial weights (one tensor at a time, meta-device init
    for the sharded modes) follows ringzero's Llama: every step's loss within 1e-5, every weight within 1e-4."""
    need(mode)
    torch, worker = gloo
    e = compare(torch, worker, comm, llama_args(worker, preset, mode))
    ok = e["loss"] <= TOL_LOSS and e["weights"] <= TOL_W and e["clipped"] >= 1
    msg = (f"{preset} {mode}, n={comm.size}: loss rel err {e['loss']:.2e} (<= {TOL_LOSS}), worst weight "
           f"{e['worst']} {e['weights']:.2e} (<= {TOL_W}), clipping acted in {e['clipped']} steps; losses torch "
           f"{[round(x, 5) for x in e['losses'][0]]} ringzero {[round(x, 5) for x in e['losses'][1]]}")
    if comm.rank == 0:
        print(msg)
    assert_all(comm, ok, msg)


LLAMA_CHANGES = [("ddp", "rope-theta=x10"), ("fsdp-full", "decay=all")]


@pytest.mark.parametrize("mode,change", LLAMA_CHANGES, ids=[f"{m}-{c}" for m, c in LLAMA_CHANGES])
def test_llama_comparison_catches_a_different_peer(gloo, comm, monkeypatch, mode, change):
    """A peer whose rotary θ is 10 x ringzero's, or that decays the norms too, fails the comparison."""
    import dataclasses

    import torch_llama
    torch, worker = gloo
    if change == "decay=all":
        _all_decay(worker, monkeypatch)
    else:
        right = torch_llama.hf_config
        monkeypatch.setattr(torch_llama, "hf_config",
                            lambda cfg: right(dataclasses.replace(cfg, rope_theta=10 * cfg.rope_theta)))
    e = compare(torch, worker, comm, llama_args(worker, "smollm2-135m", mode))
    ok = e["loss"] > TOL_LOSS or e["weights"] > TOL_W
    msg = (f"{mode} {change}, n={comm.size}: loss rel err {e['loss']:.2e}, worst weight {e['worst']} "
           f"{e['weights']:.2e}")
    if comm.rank == 0:
        print(msg)
    assert_all(comm, ok, msg)
