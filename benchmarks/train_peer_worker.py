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


def torch_worker(a):
    """One torch rank: wrap the model for ``a.mode``, train, write rank-R.json."""
    import warnings
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    sys.path.insert(0, HERE)
    from torch_gpt import Block, TorchGPT

    from ringzero.app.data import Batches, load_corpus
    from ringzero.nn.gpt import GPTConfig, gpt_units
    from ringzero.runtime.flat import Layout

    torch.set_num_threads(1)
    rank, world = env_rank_world()
    os.environ["GLOO_SOCKET_IFNAME"] = a.ifname      # the node's interface (lo on one host)
    dist.init_process_group("gloo", init_method=f"tcp://{a.master}:{a.port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=a.timeout))
    rss_start = rss_now_bytes()          # libraries and process group, before any model
    cfg = GPTConfig(a.n_layer, a.n_head, a.n_embd, a.seq_len, 256)  # block = seq_len
    torch.manual_seed(a.seed)
    model = TorchGPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())   # tied head counted once
    if a.mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        strategy = {"fsdp-grad-op": ShardingStrategy.SHARD_GRAD_OP,
                    "fsdp-full": ShardingStrategy.FULL_SHARD}[a.mode]
        # device_id=cpu: without it FSDP looks for an accelerator and refuses to start
        model = FSDP(model, sharding_strategy=strategy, auto_wrap_policy=ModuleWrapPolicy({Block}),
                     device_id=torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    if a.mode == "ddp":
        def clip():
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
    else:
        def clip():
            model.clip_grad_norm_(a.grad_clip)      # the sharded norm
    corpus = load_corpus(None, a.seq_len)
    batches = Batches(corpus.train, a.batch, a.seq_len, rank, world, a.seed)
    times, losses = [], []
    dist.barrier()
    for step in range(a.steps):
        t0 = time.perf_counter()
        x, y = batches.get(step)                                  # (B, T) int64, reused
        _, loss = model(torch.from_numpy(x), torch.from_numpy(y))
        loss.backward()
        if a.grad_clip > 0:
            clip()
        opt.step()
        opt.zero_grad(set_to_none=True)
        lv = loss.item()
        times.append(time.perf_counter() - t0)
        losses.append(lv)
    dist.barrier()
    res = {"rank": rank, "world": world, "step_time_s": times, "loss": losses,
           "peak_rss_bytes": peak_rss_bytes(), "rss_start_bytes": rss_start, "params": n_params,
           "layout_params": Layout(gpt_units(cfg)).numel, "torch": torch.__version__}
    with open(os.path.join(a.out, f"rank-{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


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


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    rest = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("side", choices=("torch", "ringzero"))
    ap.add_argument("--out", required=True, help="folder for rank-R.json")
    ap.add_argument("--mode", default="ddp", choices=("ddp", "fsdp-grad-op", "fsdp-full"))
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--master", default="127.0.0.1", help="rank 0's address (the rendezvous)")
    ap.add_argument("--ifname", default="lo", help="the interface gloo binds to")
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--rz-module", default="ringzero.train")
    for flag, typ, default in (("--steps", int, 15), ("--batch", int, 8), ("--seq-len", int, 128),
                               ("--n-layer", int, 4), ("--n-head", int, 4), ("--n-embd", int, 256),
                               ("--seed", int, 0), ("--lr", float, 3e-4), ("--grad-clip", float, 1.0)):
        ap.add_argument(flag, type=typ, default=default)
    a = ap.parse_args(argv)
    if a.side == "torch":
        return torch_worker(a)
    return ringzero_worker(a, rest)


if __name__ == "__main__":
    sys.exit(main())
