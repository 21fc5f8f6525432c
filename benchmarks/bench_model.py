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

    The GEMM floor (NumPy backend): every matrix product of the step (the
    Linears' forward and both backward products, the attention's six batched
    products over strided head views, the tied head's three) with the same
    shapes and operand layouts, on preallocated arrays, in the library the
    model runs each in (ringzero.nn.gemm for the 2-D ones), timed as one more
    interleaved variant. The attention products are counted dense (T x T),
    as the issue's 21 GFLOP are; the model's host path skips the tiles above
    the causal diagonal (about 0.4 GFLOP fewer at the default shapes). Its median is the time the step would take if
    everything but the BLAS calls were free; the step's GEMM FLOPs over it is
    the sgemm rate of this run. The header prints which elementwise path ran
    (the C kernels of ringzero.nn._fused, or NumPy) and the load average.

What it is not
    A training benchmark (no optimizer, no communication): that is
    ringzero's bench/train. Torch is only a peer here, never a dependency.

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 .venv/bin/python benchmarks/bench_model.py \
        [--checkpoint] [--allocs] [--profile] [--backend cupy --dtype float16]
        [--model gpt2|gpt2-medium|gpt2-large|gpt2-xl] [--n-layer L --n-head H --n-embd C] [--vocab N]

    ``--model`` takes GPT-2's shapes from ringzero.nn.gpt.PRESETS (context
    1024) with the byte vocabulary unless ``--vocab N``; the dimension flags
    override a preset's. The float32 weights are held once (about 2.8 GB at
    gpt2-large's shapes, the gradients as much again; torch's copy doubles
    that, so ``--no-torch`` there).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

from ringzero.nn.gpt import GPT, PRESETS, GPTConfig, gpt_units, model_config, vocab_for
from ringzero.runtime.flat import Layout


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


def activation_bytes(model, P, idx, tgt) -> int:
    """Bytes the units' caches hold at the end of forward (the activation peak)."""
    x, tot = idx, 0
    for u in range(model.last + 1):
        x, c = model.forward_unit(u, P, x, tgt if u == model.last else None)
        tot += model.cache_nbytes(c)
    return tot


def layer_profile(model, P, G, gbuf, idx, tgt, steps=3) -> dict:
    """Milliseconds per step spent in each layer class's forward/backward,
    exclusive of the layers nested inside it (attention's two Linears)."""
    from ringzero.nn import layers as Lr
    spent, stack, saved = {}, [], []
    for cls in (Lr.Embedding, Lr.Linear, Lr.Unembed, Lr.LayerNorm, Lr.GELU,
                Lr.CausalSelfAttention, Lr.SoftmaxCrossEntropy):
        for meth in ("forward", "backward"):
            f = cls.__dict__[meth]
            saved.append((cls, meth, f))

            def timed(*args, _f=f, _k=f"{cls.__name__}.{meth}", **kw):
                stack.append(0.0)
                t0 = time.perf_counter()
                r = _f(*args, **kw)
                dt = time.perf_counter() - t0
                inner = stack.pop()
                spent[_k] = spent.get(_k, 0.0) + dt - inner
                if stack:
                    stack[-1] += dt
                return r
            setattr(cls, meth, timed)
    try:
        t0 = time.perf_counter()
        for _ in range(steps):
            gbuf[...] = 0
            model.loss_and_grad(P, G, idx, tgt)
        total = time.perf_counter() - t0
    finally:
        for cls, meth, f in saved:
            setattr(cls, meth, f)
    out = {k: v / steps * 1e3 for k, v in spent.items()}
    out["(model glue)"] = total / steps * 1e3 - sum(out.values())
    return out


def gemm_floor(cfg, B, T, dtype=np.float32):
    """(run, flops): one call runs every GEMM of a fwd+bwd step, shaped and laid out as the model's."""
    rng = np.random.default_rng(1)
    C, H, V, N = cfg.n_embd, cfg.n_head, cfg.vocab, B * T
    D = C // H
    r = lambda *s: (rng.standard_normal(s) * 0.1).astype(dtype)        # noqa: E731
    calls, flops = [], 0

    def mm(a, b, out):
        nonlocal flops
        flops += 2 * out.size * a.shape[-1]
        calls.append((a, b, out))
    for n_in, n_out in ((C, 3 * C), (C, C), (C, 4 * C), (4 * C, C)):     # qkv, proj, fc, fc2
        x, w, y, dy = r(N, n_in), r(n_in, n_out), r(N, n_out), r(N, n_out)
        mm(x, w, y)                                                       # y = x w
        mm(x.T, dy, r(n_in, n_out))                                       # dw = x^T dy
        mm(dy, w.T, r(N, n_in))                                           # dx = dy w^T
    heads = lambda a: a.reshape(B, T, 3, H, D)                            # noqa: E731
    qkv, dqkv = heads(r(B, T, 3 * C)), heads(r(B, T, 3 * C))
    q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))     # (B, H, T, D) strided views
    dq, dk, dv = (dqkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    att, datt = r(B, H, T, T), r(B, H, T, T)
    yh4 = r(B, T, C).reshape(B, T, H, D).transpose(0, 2, 1, 3)
    dyh4 = r(B, T, C).reshape(B, T, H, D).transpose(0, 2, 1, 3)
    mm(q, k.transpose(0, 1, 3, 2), att)
    mm(att, v, yh4)
    mm(att.transpose(0, 1, 3, 2), dyh4, dv)
    mm(dyh4, v.transpose(0, 1, 3, 2), datt)
    mm(datt, k, dq)
    mm(datt.transpose(0, 1, 3, 2), q, dk)
    calls *= cfg.n_layer
    flops *= cfg.n_layer
    x, w, dl = r(N, C), r(V, C), r(N, V)
    mm(x, w.T, r(N, V))                                                   # logits = x wte^T
    mm(dl.T, x, r(V, C))                                                  # dwte = dl^T x
    mm(dl, w, r(N, C))                                                    # dx = dl wte

    try:                        # as the model: 2-D products in ringzero.nn.gemm's library, the rest numpy.matmul
        from ringzero.nn.gemm import matmul
    except ImportError:         # a ringzero from before it: numpy.matmul for all
        matmul = lambda a, b, out: np.matmul(a, b, out=out)              # noqa: E731

    def run():
        for a, b, out in calls:
            matmul(a, b, out)
    return run, flops


def torch_step(cfg, layout, host, idx_h, tgt_h, backend, dtype):
    """The same step in torch (same weights, one thread), or None without torch."""
    try:
        import torch
    except ImportError:
        print("torch not installed: timing ringzero only")
        return None
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from torch_gpt import TorchGPT, load_from_flat
    torch.set_num_threads(1)
    dev = "cuda" if backend == "cupy" else "cpu"
    tm = load_from_flat(TorchGPT(cfg), layout.views(host)).to(dev, getattr(torch, dtype))
    ti, tt = torch.from_numpy(idx_h).to(dev), torch.from_numpy(tgt_h).to(dev)
    tsync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

    def theirs():
        tm.zero_grad(set_to_none=False)
        _, loss = tm(ti, tt)
        loss.backward()
        tsync()
        return loss.item()
    return theirs


def print_medians(med, losses, models, tok, floor_flops):
    """One line per variant, then each model's ratios to torch and to the GEMM floor."""
    for n in med:
        if n == "gemm-floor":
            print(f"{n:14s} fwd+bwd: median {med[n] * 1e3:8.1f} ms  ({floor_flops / 1e9:.2f} GFLOP at "
                  f"{floor_flops / med[n] / 1e9:.1f} GFLOP/s: the step's GEMMs alone, this run's sgemm rate)")
            continue
        print(f"{n:14s} fwd+bwd: median {med[n] * 1e3:8.1f} ms  ({tok / med[n]:7.0f} tokens/s)  "
              f"loss {losses[n]:.4f}")
    for n in models:
        if "torch" in med:
            print(f"ratio {n}/torch: {med[n] / med['torch']:.2f}x  (target <= 0.9x)")
        if "gemm-floor" in med:
            print(f"ratio {n}/gemm-floor: {med[n] / med['gemm-floor']:.2f}x  (target <= 1.25x)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--model", default="", choices=("",) + tuple(PRESETS),
                    help="GPT-2 shapes (layers, heads, width, context 1024) with the byte vocabulary unless "
                         "--vocab; the dimension flags override the preset's")
    ap.add_argument("--n-layer", type=int, default=None, help="blocks (default 4, or the preset's)")
    ap.add_argument("--n-head", type=int, default=None, help="heads (default 4, or the preset's)")
    ap.add_argument("--n-embd", type=int, default=None,
                    help="model width C (default 256, or the preset's; the trainer's default run uses 128)")
    ap.add_argument("--vocab", type=int, default=256, help="a vocabulary of N ids (default 256, bytes), padded "
                    "to a multiple of 64 as the trainer pads a token file's (vocab_for): 50257 -> 50304")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--checkpoint", action="store_true",
                    help="also time the model with activation checkpointing (interleaved)")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--allocs", action="store_true", help="also measure transient NumPy bytes (tracemalloc)")
    ap.add_argument("--profile", action="store_true", help="also print time per layer class")
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

    try:        # the presets' one source (ringzero.nn.gpt); the small default's context grows to --seq
        vocab = 256 if a.vocab == 256 else vocab_for(a.vocab - 1)
        cfg = model_config(a.model or None, vocab, n_layer=a.n_layer, n_head=a.n_head, n_embd=a.n_embd,
                           block_size=None if a.model else max(GPTConfig.block_size, a.seq))
    except ValueError as e:
        raise SystemExit(f"bench_model: {e}") from None
    if a.seq > cfg.block_size or min(a.batch, a.seq, a.repeats) < 1:
        raise SystemExit(f"bench_model: need 1 <= --seq <= block_size {cfg.block_size}, --batch >= 1 and "
                         f"--repeats >= 1; got --seq {a.seq}, --batch {a.batch}, --repeats {a.repeats}")
    layout = Layout(gpt_units(cfg), 1)
    host = np.zeros(layout.padded, np.float32)
    layout.init_full(host, seed=0)
    # the host float32 buffer itself where it is the compute buffer (no second copy at gpt2-large's 2.8 GB)
    buf = host if (xp is np and dtype == np.float32) else xp.asarray(host.astype(dtype))
    gbuf = xp.zeros_like(buf)
    P, G = layout.views(buf), layout.views(gbuf)
    models = {"ringzero": GPT(cfg)}
    if a.checkpoint:
        models["ringzero-ckpt"] = GPT(cfg, checkpoint=True)
    rng = np.random.default_rng(0)
    idx_h = rng.integers(0, cfg.vocab, (a.batch, a.seq))
    tgt_h = rng.integers(0, cfg.vocab, (a.batch, a.seq))
    idx, tgt = xp.asarray(idx_h), xp.asarray(tgt_h)

    def step_of(model):
        def ours():
            gbuf[...] = 0
            loss = model.loss_and_grad(P, G, idx, tgt)
            sync()
            return loss
        return ours
    steps = {name: step_of(m) for name, m in models.items()}
    floor_flops = None
    if xp is np:
        steps["gemm-floor"], floor_flops = gemm_floor(cfg, a.batch, a.seq, dtype)

    if not a.no_torch:
        theirs = torch_step(cfg, layout, host, idx_h, tgt_h, a.backend, a.dtype)
        if theirs is not None:
            steps["torch"] = theirs

    print(f"GPT {cfg}: {layout.numel:,} params, batch {a.batch} x T {a.seq}, {a.backend} {a.dtype}, "
          f"OMP={os.environ.get('OMP_NUM_THREADS')} "
          f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS')} "
          f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')}")
    try:
        from ringzero.nn.fused import HAVE_C
    except ImportError:     # a ringzero from before the fused kernels
        HAVE_C = False
    try:
        from ringzero.nn.gemm import library as gemm_library
        gemms = gemm_library()
    except ImportError:     # a ringzero from before ringzero.nn.gemm
        gemms = "numpy"
    print(f"numpy BLAS: {blas_info()}; the Linears' and head's GEMMs: {gemms}; "
          f"elementwise: {'C kernels' if HAVE_C else 'NumPy (no C)'}; "
          f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    for _ in range(a.warmup):
        for f in steps.values():
            f()
    allocs0 = {n: m.pool.allocs for n, m in models.items()}
    times, cpu, losses = {n: [] for n in steps}, {n: [] for n in steps}, {}
    for _ in range(a.repeats):             # interleaved: noise hits every variant alike
        for n, f in steps.items():
            t0, c0 = time.perf_counter(), time.process_time()
            losses[n] = f()
            times[n].append(time.perf_counter() - t0)
            cpu[n].append(time.process_time() - c0)
    med = {n: statistics.median(t) for n, t in times.items()}
    print_medians(med, losses, models, a.batch * a.seq, floor_flops)
    if xp is np:    # CPU seconds leave out the time the process waited for a core (a loaded machine)
        mc = {n: statistics.median(t) for n, t in cpu.items()}
        print("cpu-time medians (process_time): " + ", ".join(f"{n} {v * 1e3:.1f} ms" for n, v in mc.items())
              + "".join(f"; {m}/{o} {mc[m] / mc[o]:.2f}x" for m in models for o in ("torch", "gemm-floor") if o in mc))
    for n, m in models.items():
        print(f"{n}: activations held by caches after forward "
              f"{activation_bytes(m, P, idx, tgt) / 2**20:.1f} MiB; pool {m.pool.allocs} buffers, "
              f"{m.pool.allocs - allocs0[n]} made in the {a.repeats} timed steps, {m.pool.nbytes / 2**20:.1f} MiB")
    model = models["ringzero"]
    if a.profile:
        prof = layer_profile(model, P, G, gbuf, idx, tgt)
        tot = sum(prof.values())
        print(f"profile (ringzero, ms per step, exclusive; total {tot:.1f}):")
        for k, v in sorted(prof.items(), key=lambda kv: -kv[1]):
            print(f"  {k:32s} {v:8.1f}  {100 * v / tot:5.1f} %")
    if a.allocs and xp is np:
        print(f"transient numpy bytes in a steady-state step (tracemalloc peak above live): "
              f"{transient_numpy_bytes(model, P, G, gbuf, idx, tgt) / 2**10:.1f} KiB")


if __name__ == "__main__":
    main()
