"""Forward+backward of ringzero's GPT against the same model in torch, in one run.

What it is
    One process, one BLAS thread. Times a full training step's compute
    (zero the gradients, forward through every unit, backward through every
    unit) of ``ringzero.nn.gpt.GPT`` in float32 NumPy, and the same step of
    ``benchmarks/torch_gpt.TorchGPT`` (same weights) with
    ``torch.set_num_threads(1)``. Repeats are interleaved (ours, torch, ours,
    ...) so machine noise hits both alike; the medians and their ratio are
    printed. It also counts the buffers the pool makes in a steady-state step
    and, with --allocs, the bytes of transient NumPy temporaries (tracemalloc).

What it is not
    A training benchmark (no optimizer, no communication): that is
    ringzero's bench/train. Torch is only a peer here, never a dependency.

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 .venv/bin/python benchmarks/bench_model.py
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

from ringzero.flat import Layout
from ringzero.nn.gpt import GPT, GPTConfig, gpt_units


def blas_info() -> str:
    try:
        import threadpoolctl
        infos = threadpoolctl.threadpool_info()
        return "; ".join(f"{i.get('internal_api')} {i.get('version')} core={i.get('architecture')} "
                         f"threads={i.get('num_threads')}" for i in infos if i.get("user_api") == "blas")
    except ImportError:
        return "threadpoolctl not installed (core unknown)"


def transient_numpy_bytes(model, P, G, gbuf, idx, tgt) -> int:
    """Peak bytes NumPy allocated beyond what was live, over one steady-state step."""
    import tracemalloc
    tracemalloc.start()
    try:
        gbuf[...] = 0
        model.loss_and_grad(P, G, idx, tgt)
        base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        gbuf[...] = 0
        model.loss_and_grad(P, G, idx, tgt)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak - base


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--checkpoint", action="store_true", help="activation checkpointing on")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--allocs", action="store_true", help="also measure transient NumPy bytes (tracemalloc)")
    ap.add_argument("--backend", choices=("numpy", "cupy"), default="numpy",
                    help="cupy: time on the GPU (torch peer on cuda)")
    ap.add_argument("--dtype", choices=("float32", "float16"), default="float32",
                    help="compute/storage dtype (float16 is for the GPU)")
    a = ap.parse_args(argv)
    if a.backend == "cupy":
        import cupy as xp
        sync = xp.cuda.Device().synchronize
    else:
        xp, sync = np, (lambda: None)
    dtype = np.dtype(a.dtype)

    cfg = GPTConfig()
    if a.seq > cfg.block_size:
        raise SystemExit(f"--seq must be <= block_size {cfg.block_size}, got {a.seq}")
    layout = Layout(gpt_units(cfg), 1)
    host = np.zeros(layout.padded, np.float32)
    layout.init_full(host, seed=0)
    buf = xp.asarray(host.astype(dtype))
    gbuf = xp.zeros_like(buf)
    P, G = layout.views(buf), layout.views(gbuf)
    model = GPT(cfg, checkpoint=a.checkpoint)
    rng = np.random.default_rng(0)
    idx_h = rng.integers(0, cfg.vocab, (a.batch, a.seq))
    tgt_h = rng.integers(0, cfg.vocab, (a.batch, a.seq))
    idx, tgt = xp.asarray(idx_h), xp.asarray(tgt_h)

    def ours():
        gbuf[...] = 0
        loss = model.loss_and_grad(P, G, idx, tgt)
        sync()
        return loss

    tm = None
    if not a.no_torch:
        try:
            import torch
        except ImportError:
            print("torch not installed: timing ringzero only")
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            from torch_gpt import TorchGPT, load_from_flat
            torch.set_num_threads(1)
            dev = "cuda" if a.backend == "cupy" else "cpu"
            tm = load_from_flat(TorchGPT(cfg), layout.views(host)).to(dev, getattr(torch, a.dtype))
            ti, tt = torch.from_numpy(idx_h).to(dev), torch.from_numpy(tgt_h).to(dev)
            tsync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

            def theirs():
                tm.zero_grad(set_to_none=False)
                _, loss = tm(ti, tt)
                loss.backward()
                tsync()
                return loss.item()

    print(f"GPT {cfg}: {layout.numel:,} params, batch {a.batch} x T {a.seq}, {a.backend} {a.dtype}, "
          f"checkpoint={a.checkpoint}, OMP={os.environ.get('OMP_NUM_THREADS')} "
          f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS')} "
          f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')}")
    print(f"numpy BLAS: {blas_info()}")
    for _ in range(a.warmup):
        ours()
        if tm is not None:
            theirs()
    allocs0 = model.pool.allocs
    t_ours, t_torch = [], []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        lo = ours()
        t_ours.append(time.perf_counter() - t0)
        if tm is not None:
            t0 = time.perf_counter()
            lt = theirs()
            t_torch.append(time.perf_counter() - t0)
    new_bufs = model.pool.allocs - allocs0
    mo = statistics.median(t_ours)
    tok = a.batch * a.seq
    print(f"ringzero fwd+bwd: median {mo * 1e3:8.1f} ms  ({tok / mo:7.0f} tokens/s)  loss {lo:.4f}")
    if t_torch:
        mt = statistics.median(t_torch)
        print(f"torch    fwd+bwd: median {mt * 1e3:8.1f} ms  ({tok / mt:7.0f} tokens/s)  loss {lt:.4f}")
        print(f"ratio ringzero/torch: {mo / mt:.2f}x  (target <= 1.5x)")
    print(f"pool: {model.pool.allocs} buffers made, {new_bufs} in the {a.repeats} timed steps, "
          f"{model.pool.nbytes / 2**20:.1f} MiB held")
    if a.allocs and xp is np:
        print(f"transient numpy bytes in a steady-state step (tracemalloc peak above live): "
              f"{transient_numpy_bytes(model, P, G, gbuf, idx, tgt) / 2**10:.1f} KiB")


if __name__ == "__main__":
    main()
