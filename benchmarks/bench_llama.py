"""Forward+backward of ringzero's Llama against transformers' LlamaForCausalLM, one thread each.

What it is
    One process, one BLAS thread. Times a full training step's compute (zero
    the gradients, forward through every unit, backward through every unit) of
    ``ringzero.nn.llama.Llama`` in float32 NumPy, the same shapes in
    transformers' ``LlamaForCausalLM`` (``Qwen2ForCausalLM`` for qwen2.5-0.5b; eager
    attention, ``torch.set_num_threads(1)``, loss = cross-entropy over the same targets, ``backward()``), and the GEMM
    floor: every matrix product of the step with the model's shapes on
    preallocated arrays (the Linears' forward and two backward products, the
    attention's products counted dense, the head's three). Repeats are
    interleaved (ours, torch, floor, ours, ...) so machine noise hits all alike;
    medians and the two ratios are printed. The weights are random and not
    shared: timing needs the shapes only (tests/test_llama.py checks the values).

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 python benchmarks/bench_llama.py \
        --model smollm2-135m --batch 1 --seq 256 [--n-layer L] [--vocab N] [--checkpoint] [--no-torch]

    The vocabulary is the preset's (49,152 for smollm2-135m) unless --vocab.

What it is not
    A training benchmark (no optimizer, no communication), nor a figure: the
    issue's numbers are measured on a quiet machine (../shared/quiet).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from ringzero.nn.gemm import matmul
from ringzero.nn.llama import PRESETS, Llama, model_config
from ringzero.runtime.flat import Layout


def gemm_floor(cfg, B, T):
    """(run, flops): one call runs every GEMM of the step, with the model's shapes."""
    rng = np.random.default_rng(1)
    r = lambda *s: (rng.standard_normal(s) * 0.1).astype(np.float32)    # noqa: E731
    C, F, V, N = cfg.n_embd, cfg.ffn, cfg.n_tokens, B * T
    H, K, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    calls, flops = [], [0]

    def mm(a, b, out):
        flops[0] += 2 * out.size * a.shape[-1]
        calls.append((a, b, out))
    for n_in, n_out in ((C, cfg.qkv_width), (H * D, C), (C, 2 * F), (F, C)):     # qkv, proj, gate|up, down
        x, w, dy = r(N, n_in), r(n_in, n_out), r(N, n_out)
        mm(x, w, r(N, n_out))
        mm(x.T, dy, r(n_in, n_out))
        mm(dy, w.T, r(N, n_in))
    G = H // K
    q, k, v, dy = r(B, K, G, T, D), r(B, K, 1, T, D), r(B, K, 1, T, D), r(B, K, G, T, D)
    att = r(B, K, G, T, T)
    for a, b, o in ((q, k.swapaxes(-1, -2), att), (att, v, r(B, K, G, T, D)), (dy, v.swapaxes(-1, -2), r(*att.shape)),
                    (att, k, r(B, K, G, T, D))):
        mm(a, b, o)
    mm(att.reshape(B, K, G * T, T).swapaxes(-1, -2), dy.reshape(B, K, G * T, D), r(B, K, T, D))     # dV
    mm(att.reshape(B, K, G * T, T).swapaxes(-1, -2), q.reshape(B, K, G * T, D), r(B, K, T, D))      # dK
    calls *= cfg.n_layer
    flops[0] *= cfg.n_layer
    x, w, dl = r(N, C), r(V, C), r(N, V)
    mm(x, w.T, r(N, V))
    mm(dl.T, x, r(V, C))
    mm(dl, w, r(N, C))

    def run():
        for a, b, o in calls:
            if a.ndim == 2:
                matmul(a, b, o)
            else:
                np.matmul(a, b, out=o)
    return run, flops[0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", choices=sorted(PRESETS))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--n-layer", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=None, help="default: the preset's")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--checkpoint", action="store_true")
    ap.add_argument("--no-torch", action="store_true")
    a = ap.parse_args(argv)
    cfg = model_config(a.model, a.vocab, n_layer=a.n_layer)
    B, T = a.batch, a.seq
    L = Layout(Llama(cfg).units)
    buf = np.zeros(L.padded, np.float32)
    L.init_full(buf, seed=1)
    gbuf = np.zeros_like(buf)
    P, G = L.views(buf), L.views(gbuf)
    model = Llama(cfg, checkpoint=a.checkpoint)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, cfg.n_tokens, (B, T)), rng.integers(0, cfg.n_tokens, (B, T))

    def ours():
        gbuf[:] = 0
        model.loss_and_grad(P, G, x, y)
    variants = {"ringzero": ours}
    floor, flops = gemm_floor(cfg, B, T)
    variants["gemm floor"] = floor
    try:
        if a.no_torch:
            raise ImportError("--no-torch")
        import torch
        import transformers
    except ImportError as e:
        print(f"transformers' row skipped: {e}")
    else:
        torch.set_num_threads(1)
        hc = dict(vocab_size=cfg.vocab, hidden_size=cfg.n_embd, intermediate_size=cfg.ffn,
                  num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head,
                  max_position_embeddings=cfg.block_size, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_eps,
                  tie_word_embeddings=cfg.tied)
        # q/k/v bias alone is Qwen2's (Llama's attention_bias would put one on o_proj too)
        cls = (transformers.Qwen2ForCausalLM, transformers.Qwen2Config) if cfg.qkv_bias else \
            (transformers.LlamaForCausalLM, transformers.LlamaConfig)
        tm = cls[0](cls[1](**hc, attn_implementation="eager"))
        tx, ty = torch.from_numpy(x), torch.from_numpy(y)

        def theirs():
            tm.zero_grad(set_to_none=False)
            lg = tm(tx).logits
            torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), ty.reshape(-1)).backward()
        variants["transformers"] = theirs
    times = {k: [] for k in variants}
    for f in variants.values():          # warm-up: buffers made, libraries loaded
        f()
    for _ in range(a.repeats):
        for k, f in variants.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{a.model}: {cfg.n_layer}L {cfg.n_head}H {cfg.n_kv_head}KV {cfg.n_embd}C F={cfg.ffn} V={cfg.vocab}, "
          f"batch {B} x seq {T}, float32, one thread, load {os.getloadavg()[0]:.2f}, {a.repeats} repeats")
    for k, v in med.items():
        print(f"  {k:<14} median {v * 1e3:9.1f} ms")
    print(f"  GEMM FLOPs of the step {flops / 1e9:.2f} G: {flops / med['gemm floor'] / 1e9:.1f} GFLOP/s in the floor")
    print(f"  ringzero / gemm floor = {med['ringzero'] / med['gemm floor']:.3f}")
    if "transformers" in med:
        print(f"  ringzero / transformers = {med['ringzero'] / med['transformers']:.3f}")


if __name__ == "__main__":
    main()
