"""The ranks of ``benchmarks/train_peer.py``: one torch rank, or one ringzero rank.

What it is
    The code that runs on every rank of one train_peer launch, started by the
    driver under mpirun, never by hand:
      torch     ``python benchmarks/train_peer_worker.py torch --mode ddp --out DIR --port P ...``
                builds the mode (benchmarks/peer_engines.py: DDP, FSDP, FSDP2, DeepSpeed ZeRO) on gloo,
                trains, and
                writes ``DIR/rank-R.json`` (step times, losses, peak RSS)
      ringzero  ``python -m mpi4py benchmarks/train_peer_worker.py ringzero --out DIR -- FLAGS``
                runs ``python -m ringzero.train FLAGS`` as ``__main__`` on this rank
                (through runpy, as ``python -m`` does), then writes its peak RSS

    The torch rank computes what the trainer computes (tests/test_peer_trajectory.py
    holds it to that): the same GPT, or Llama-family model (``--model``: transformers'
    own, benchmarks/torch_llama.py), and vocabulary (``vocab_for`` on the same
    data), ringzero's initial weights for the seed (``Layout.init_param``, one
    parameter at a time: ``torch_gpt.RingzeroInit``, ``torch_llama.LlamaInit``), the same batches
    (``Batches``), AdamW with the
    trainer's betas, eps and weight decay on exactly the parameters the layout
    marks (not on biases and norms), global-norm clipping over the whole
    gradient, the trainer's learning-rate schedule (``ringzero.app.config.lr_at``),
    and the loss recorded as the mean over the ranks, as the trainer's metrics
    record it.

    Where the step goes: each step's forward+backward is timed apart from its
    clipping and update. After the timed steps (``--compute-steps``) the
    wrapped model is freed and a plain TorchGPT (TorchLlama) of the same shapes runs
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
PEER_MODES = ("ddp", "fsdp-grad-op", "fsdp-full", "fsdp2-full", "ds-zero1", "ds-zero2", "ds-zero3")  # peer_engines
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
    """(cfg, corpus, model): the model the driver resolved (a GPT: --n-layer ... --block; a Llama-family
    --model: the preset with the dimension flags over it), the vocabulary the data needs (``vocab_for``,
    as the trainer), with ringzero's initial weights for --seed (``init``; else a draw of its own). The
    compute probe's plain model (TorchGPT, or TorchLlama: transformers' own); the modes build theirs in
    peer_engines."""
    from peer_engines import torch_model_class
    cfg, corpus, rz = model_init(a, own_draw=not init)
    model = torch_model_class(cfg)(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(rz.value(n))
    return cfg, corpus, model


def is_llama(a) -> bool:
    """Whether --model names a Llama-family preset (ringzero.nn.families)."""
    from ringzero.nn.families import LLAMA, family_of, preset_names
    return a.model in preset_names() and family_of(a.model) == LLAMA


def model_init(a, own_draw=False):
    """(cfg, corpus, init): the shapes, the data and the initial values, one parameter at a time
    (torch_gpt.RingzeroInit, or torch_llama.LlamaInit through ringzero/interop's name map)."""
    from ringzero.app.data import load_corpus
    from ringzero.nn.families import model_config, units_of
    from ringzero.nn.gpt import GPTConfig, vocab_for
    from ringzero.runtime.flat import Layout
    corpus = load_corpus(a.data or None, a.seq_len)
    vocab = vocab_for(corpus.vocab - 1, byte_level=corpus.byte_level)
    if is_llama(a):
        from torch_llama import LlamaInit
        cfg = model_config(a.model, vocab, n_layer=a.n_layer, n_head=a.n_head, n_embd=a.n_embd,
                           n_kv_head=a.n_kv_head)
        return cfg, corpus, LlamaInit(Layout(units_of(cfg)), a.seed, cfg, own_draw)
    from torch_gpt import RingzeroInit
    cfg = GPTConfig(a.n_layer, a.n_head, a.n_embd, a.block, vocab)
    return cfg, corpus, RingzeroInit(Layout(units_of(cfg)), a.seed, cfg.n_layer, own_draw)


def torch_decays(cfg) -> dict:
    """{torch parameter name: decayed?} by the layout's own flags (ringzero.nn.gpt.gpt_units, or
    llama_config.llama_units through interop's name map): decay on the 2-D weights only."""
    from ringzero.nn.families import LLAMA, family_of, units_of
    from ringzero.runtime.flat import Layout
    if family_of(cfg) == LLAMA:
        from torch_llama import LlamaInit
        layout = Layout(units_of(cfg))
        return {tn: layout.slots[n].spec.decay for tn, (n, *_) in LlamaInit(layout, 0, cfg).names.items()}
    from torch_gpt import torch_name
    return {torch_name(s.name)[0]: s.decay for u in units_of(cfg) for s in u.params}


def decay_groups(model, cfg, wd):
    """AdamW's two groups, by the layout's own decay flags (``torch_decays``): weight decay
    on what the trainer decays, none on biases and norms. By name, since FSDP's views are flat."""
    decays = torch_decays(cfg)
    groups = ([], [])
    for name, p in model.named_parameters():
        for pre in FSDP_PREFIXES:
            name = name.replace(pre, "")
        if name not in decays:
            raise KeyError(f"train_peer_worker: torch parameter {name!r} is not in ringzero's layout")
        groups[0 if decays[name] else 1].append(p)
    return [{"params": groups[0], "weight_decay": wd}, {"params": groups[1], "weight_decay": 0.0}]


def build(a, torch, own_draw=False):
    """(cfg, corpus, peer_engines.Peer, parameters) of a torch rank; the process group is up."""
    import peer_engines

    from ringzero.nn.families import units_of
    from ringzero.runtime.flat import Layout
    from ringzero.runtime.optim import AdamConfig
    cfg, corpus, rz = model_init(a, own_draw)
    n_params = Layout(units_of(cfg)).numel      # the tied head counted once, as torch counts it
    peer = peer_engines.build(a, torch, cfg, rz, lambda m: decay_groups(m, cfg, a.weight_decay),
                              AdamConfig())      # the trainer's betas and eps
    return cfg, corpus, peer, n_params


def train(a, peer, batches, torch):
    """a.steps steps on this rank's batches: (step seconds, forward+backward seconds, local losses)."""
    from ringzero.app.config import Config, lr_at
    sched = Config(lr=a.lr, warmup=a.lr_warmup, min_lr_frac=a.min_lr_frac, steps=a.steps)
    times, fwd_bwd, losses = [], [], []
    for step in range(a.steps):
        t0 = time.perf_counter()
        x, y = batches.get(step)                                  # (B, T) int64, reused
        _, loss = peer.model(torch.from_numpy(x), torch.from_numpy(y))
        peer.backward(loss)
        t1 = time.perf_counter()
        peer.update(lr_at(sched, step))                           # clip, AdamW, zero the gradients
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
    from ringzero.nn.families import units_of
    from ringzero.runtime.flat import Layout

    torch.set_num_threads(1)
    rank, world = env_rank_world()
    os.environ["GLOO_SOCKET_IFNAME"] = a.ifname      # the node's interface (lo on one host)
    init = dict(init_method=f"tcp://{a.master}:{a.port}", rank=rank, world_size=world,
                timeout=datetime.timedelta(seconds=a.timeout))
    if a.mode.startswith("ds-"):         # DeepSpeed's own entry, on the same rendezvous as the torch modes
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, **init)
    else:
        dist.init_process_group("gloo", **init)
    rss_start = rss_now_bytes()          # libraries and process group, before any model
    cfg, corpus, peer, n_params = build(a, torch)
    batches = Batches(corpus.train, a.batch, a.seq_len, rank, world, a.seed)
    dist.barrier()
    times, fwd_bwd, losses = train(a, peer, batches, torch)
    # the logged loss: the mean over ranks, as the trainer's (one reduction after the timed steps)
    mean_loss = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(mean_loss)
    optimizer = peer.optimizer
    del peer
    compute = compute_probe(a, torch, dist, batches) if a.compute_steps else []
    res = {"rank": rank, "world": world, "step_time_s": times, "fwd_bwd_s": fwd_bwd,
           "loss": (mean_loss / world).tolist(), "compute_s": compute,
           "peak_rss_bytes": peak_rss_bytes(), "rss_start_bytes": rss_start, "params": n_params,
           "layout_params": Layout(units_of(cfg)).numel, "torch": torch.__version__,
           "optimizer": optimizer, "deepspeed": ds_version()}
    with open(os.path.join(a.out, f"rank-{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


def ds_version():
    """DeepSpeed's version where it is imported (a ds-* mode), else None."""
    ds = sys.modules.get("deepspeed")
    return getattr(ds, "__version__", None)


def compute_probe(a, torch, dist, batches):
    """Seconds of forward+backward of a plain TorchGPT or TorchLlama (no wrapper, no collective) on this rank's
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
    ap.add_argument("--mode", default="ddp", choices=PEER_MODES)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--master", default="127.0.0.1", help="rank 0's address (the rendezvous)")
    ap.add_argument("--ifname", default="lo", help="the interface gloo binds to")
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--ds-offload", default="", choices=("", "cpu", "nvme"),
                    help="ds-zero*: DeepSpeed's own offload of the optimizer state (and at stage 3 the parameters)")
    ap.add_argument("--ds-buckets", default="deepspeed", choices=("deepspeed", "hf"),
                    help="ds-zero*: DeepSpeed's default bucket sizes (5e8 elements) or Transformers' auto (width^2)")
    ap.add_argument("--ds-nvme-dir", default="", help="--ds-offload nvme: the folder DeepSpeed swaps to")
    ap.add_argument("--rz-module", default="ringzero.train")
    ap.add_argument("--data", default="", help="the trainer's --data ('' = the default corpus)")
    ap.add_argument("--model", default="", help="a Llama-family preset (transformers' model as the peer); "
                    "else the GPT of the dimension flags")
    ap.add_argument("--n-kv-head", type=int, default=None, help="a Llama preset's KV heads (default: its own)")
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
