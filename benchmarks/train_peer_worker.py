"""The ranks of ``benchmarks/train_peer.py``: one torch rank, or one ringzero rank.

What it is
    The code that runs on every rank of one train_peer launch, started by the
    driver under mpirun, never by hand:
      torch     ``python benchmarks/train_peer_worker.py torch --mode ddp --out DIR --port P ...``
                wraps ``torch_gpt.TorchGPT`` in DDP or FSDP on gloo, trains, and
                writes ``DIR/rank-R.json`` (step times, losses, peak RSS)
      ringzero  ``python -m mpi4py benchmarks/train_peer_worker.py ringzero --out DIR -- FLAGS``
                runs ``python -m ringzero.train FLAGS`` as ``__main__`` on this rank
                (through runpy, as ``python -m`` does), then writes its peak RSS

    The torch rank computes what the trainer computes (tests/test_peer_trajectory.py
    holds it to that): the same GPT and vocabulary (``vocab_for`` on the same
    data), ringzero's initial weights for the seed (``Layout.init_full``, loaded
    with ``load_from_flat``), the same batches (``Batches``), AdamW with the
    trainer's betas, eps and weight decay on exactly the parameters the layout
    marks (not on biases and norms), global-norm clipping over the whole
    gradient, the trainer's learning-rate schedule (``ringzero.app.config.lr_at``),
    and the loss recorded as the mean over the ranks, as the trainer's metrics
    record it.

    Where the step goes: each step's forward+backward is timed apart from its
    clipping and update. After the timed steps (``--compute-steps``) the
    wrapped model is freed and a plain TorchGPT of the same shapes runs
    forward+backward on the same batch on every rank at once, with no wrapper
    and no collective: that is the step's compute. The wrapped forward+backward
    less that is the communication the wrapper left exposed (with its hooks'
    and copies' own time).
What it is not
    A benchmark of its own (the driver times, compares and prints), or a
    ringzero dependency: torch is imported only inside the torch worker.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
FSDP_PREFIXES = ("_fsdp_wrapped_module.", "module.")     # what DDP and FSDP put before a parameter's name


def env_rank_world():
    """Rank and size from the launcher's environment (Open MPI, MPICH/PMI)."""
    for r, w in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE")):
        if r in os.environ:
            return int(os.environ[r]), int(os.environ[w])
    return 0, 1


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def rss_now_bytes() -> int:
    """Resident set size now (Linux /proc); 0 where that is not available."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# ---- the torch side --------------------------------------------------------------

def torch_model(a, torch, init=True):
    """(cfg, corpus, TorchGPT): the GPT the driver resolved (--n-layer ... --block), the vocabulary the
    data needs (``vocab_for``, as the trainer), with ringzero's initial weights for --seed (``init``)."""
    import numpy as np
    from torch_gpt import TorchGPT, load_from_flat

    from ringzero.app.data import load_corpus
    from ringzero.nn.gpt import GPTConfig, gpt_units, vocab_for
    from ringzero.runtime.flat import Layout
    corpus = load_corpus(a.data or None, a.seq_len)
    cfg = GPTConfig(a.n_layer, a.n_head, a.n_embd, a.block,
                    vocab_for(corpus.vocab - 1, byte_level=corpus.byte_level))
    torch.manual_seed(a.seed)
    model = TorchGPT(cfg)           # torch's own draw by GPT-2's rules, replaced by ringzero's below
    if init:
        layout = Layout(gpt_units(cfg))
        load_from_flat(model, layout.views(layout.init_full(np.empty(layout.padded, np.float32), a.seed)))
    return cfg, corpus, model


def decay_groups(model, cfg, wd):
    """AdamW's two groups, by the layout's own decay flags (ringzero.nn.gpt.gpt_units): weight decay
    on what the trainer decays, none on biases and norms. By name, since FSDP's views are flat."""
    from torch_gpt import torch_name

    from ringzero.nn.gpt import gpt_units
    decays = {torch_name(s.name)[0]: s.decay for u in gpt_units(cfg) for s in u.params}
    groups = ([], [])
    for name, p in model.named_parameters():
        for pre in FSDP_PREFIXES:
            name = name.replace(pre, "")
        if name not in decays:
            raise KeyError(f"train_peer_worker: torch parameter {name!r} is not in ringzero's layout")
        groups[0 if decays[name] else 1].append(p)
    return [{"params": groups[0], "weight_decay": wd}, {"params": groups[1], "weight_decay": 0.0}]


def wrap(model, mode, torch):
    if mode == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from torch_gpt import Block
    strategy = {"fsdp-grad-op": ShardingStrategy.SHARD_GRAD_OP, "fsdp-full": ShardingStrategy.FULL_SHARD}[mode]
    # device_id=cpu: without it FSDP looks for an accelerator and refuses to start;
    # use_orig_params: the optimizer sees each parameter (by name) for its decay group
    return FSDP(model, sharding_strategy=strategy, auto_wrap_policy=ModuleWrapPolicy({Block}),
                device_id=torch.device("cpu"), use_orig_params=True)


def build(a, torch):
    """(cfg, corpus, wrapped model, optimizer, clip, parameters) of a torch rank; the process group is up."""
    from ringzero.runtime.optim import AdamConfig
    cfg, corpus, model = torch_model(a, torch)
    n_params = sum(p.numel() for p in model.parameters())   # tied head counted once; before FSDP shards it
    model = wrap(model, a.mode, torch)
    adam = AdamConfig()                   # the trainer's betas and eps
    opt = torch.optim.AdamW(decay_groups(model, cfg, a.weight_decay), lr=a.lr, betas=(adam.beta1, adam.beta2),
                            eps=adam.eps)
    # the whole gradient's norm: DDP's grads are the reduced ones; FSDP's method reduces over the shards
    clip = ((lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)) if a.mode == "ddp"
            else (lambda: model.clip_grad_norm_(a.grad_clip)))
    return cfg, corpus, model, opt, clip, n_params


def train(a, model, opt, clip, batches, torch):
    """a.steps steps on this rank's batches: (step seconds, forward+backward seconds, local losses)."""
    from ringzero.app.config import Config, lr_at
    sched = Config(lr=a.lr, warmup=a.lr_warmup, min_lr_frac=a.min_lr_frac, steps=a.steps)
    times, fwd_bwd, losses = [], [], []
    for step in range(a.steps):
        t0 = time.perf_counter()
        x, y = batches.get(step)                                  # (B, T) int64, reused
        _, loss = model(torch.from_numpy(x), torch.from_numpy(y))
        loss.backward()
        t1 = time.perf_counter()
        if a.grad_clip > 0:
            clip()
        for g in opt.param_groups:
            g["lr"] = lr_at(sched, step)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
        fwd_bwd.append(t1 - t0)
    return times, fwd_bwd, losses


def torch_worker(a):
    """One torch rank: wrap the model for ``a.mode``, train, time its compute, write rank-R.json."""
    import warnings
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    sys.path.insert(0, HERE)

    from ringzero.app.data import Batches
    from ringzero.nn.gpt import gpt_units
    from ringzero.runtime.flat import Layout

    torch.set_num_threads(1)
    rank, world = env_rank_world()
    os.environ["GLOO_SOCKET_IFNAME"] = a.ifname      # the node's interface (lo on one host)
    dist.init_process_group("gloo", init_method=f"tcp://{a.master}:{a.port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=a.timeout))
    rss_start = rss_now_bytes()          # libraries and process group, before any model
    cfg, corpus, model, opt, clip, n_params = build(a, torch)
    batches = Batches(corpus.train, a.batch, a.seq_len, rank, world, a.seed)
    dist.barrier()
    times, fwd_bwd, losses = train(a, model, opt, clip, batches, torch)
    # the logged loss: the mean over ranks, as the trainer's (one reduction after the timed steps)
    mean_loss = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(mean_loss)
    del model, opt, clip
    compute = compute_probe(a, torch, dist, batches) if a.compute_steps else []
    res = {"rank": rank, "world": world, "step_time_s": times, "fwd_bwd_s": fwd_bwd,
           "loss": (mean_loss / world).tolist(), "compute_s": compute,
           "peak_rss_bytes": peak_rss_bytes(), "rss_start_bytes": rss_start, "params": n_params,
           "layout_params": Layout(gpt_units(cfg)).numel, "torch": torch.__version__}
    with open(os.path.join(a.out, f"rank-{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


def compute_probe(a, torch, dist, batches):
    """Seconds of forward+backward of a plain TorchGPT (no wrapper, no collective) on this rank's
    first batch, --compute-steps times, every rank at once (the cores shared as in the run)."""
    import gc
    gc.collect()
    _, _, plain = torch_model(a, torch, init=False)
    x, y = (torch.from_numpy(v) for v in batches.get(0))
    out = []
    dist.barrier()
    for _ in range(a.compute_steps + 1):          # the first is a warm-up
        t0 = time.perf_counter()
        _, loss = plain(x, y)
        loss.backward()
        plain.zero_grad(set_to_none=True)
        out.append(time.perf_counter() - t0)
    dist.barrier()
    return out[1:]


# ---- the ringzero side -----------------------------------------------------------

def ringzero_worker(a, train_argv):
    """Run the ringzero trainer as ``__main__`` on this rank, then record peak RSS."""
    import importlib
    import runpy

    from mpi4py import MPI
    importlib.import_module(a.rz_module)   # its imports only (no __main__): the libraries'
    rss_start = rss_now_bytes()            # share of RSS, as measured on the torch side
    sys.argv = [a.rz_module] + train_argv
    code = 0
    try:
        runpy.run_module(a.rz_module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    rank = MPI.COMM_WORLD.rank
    with open(os.path.join(a.out, f"rank-{rank}.json"), "w") as f:
        json.dump({"rank": rank, "peak_rss_bytes": peak_rss_bytes(), "rss_start_bytes": rss_start}, f)
    sys.exit(code)


def parser():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("side", choices=("torch", "ringzero"))
    ap.add_argument("--out", required=True, help="folder for rank-R.json")
    ap.add_argument("--mode", default="ddp", choices=("ddp", "fsdp-grad-op", "fsdp-full"))
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--master", default="127.0.0.1", help="rank 0's address (the rendezvous)")
    ap.add_argument("--ifname", default="lo", help="the interface gloo binds to")
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--rz-module", default="ringzero.train")
    ap.add_argument("--data", default="", help="the trainer's --data ('' = the default corpus)")
    for flag, typ, default in (("--steps", int, 15), ("--batch", int, 8), ("--seq-len", int, 128),
                               ("--n-layer", int, 4), ("--n-head", int, 4), ("--n-embd", int, 256),
                               ("--block", int, 128), ("--seed", int, 0), ("--lr", float, 3e-4),
                               ("--lr-warmup", int, 0), ("--min-lr-frac", float, 1.0),
                               ("--weight-decay", float, 0.1), ("--grad-clip", float, 1.0),
                               ("--compute-steps", int, 2)):
        ap.add_argument(flag, type=typ, default=default)
    return ap


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    rest = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1:]
    a = parser().parse_args(argv)
    if a.side == "torch":
        return torch_worker(a)
    return ringzero_worker(a, rest)


if __name__ == "__main__":
    sys.exit(main())
