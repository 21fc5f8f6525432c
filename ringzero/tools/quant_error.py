"""What ZeRO++'s int8 / int4 wire formats do to a real gradient and real weights, beside fp16's rounding.

What it is
    ``quant_errors(steps, block)`` trains the small GPT (2 x 128, byte-level, on the text of a
    Python standard library module) for a few Adam steps in float32, then takes its weights and
    its last gradient and sends each through every format the collectives can use: fp16 and bf16
    (the cast the seed teaches), and int8 / int4 with one fp32 scale per ``block`` elements of
    the weights and ``grad_block`` of the gradient (ringzero.comm.quant, the formats of qwZ and
    qgZ; the gradient's int4 once more at the weights' block). For each it gives the relative RMS error,
    the worst element's error relative to the largest magnitude, the share of nonzero elements
    that came back 0, and the wire bytes per element. ``print_quant`` prints the table
    (``python -m ringzero.explain quantized``), then ``print_volume``: stage 3's bytes across
    nodes per step for each ZeRO++ switch, the seed's 3Ψ down to about 0.75Ψ (comm.qledger).

    What it teaches: fp16's error is relative (about 2^-12 of each value) until it underflows
    tiny gradients; blockwise int's error is absolute (half a step, max|block| / 127 or / 7), so
    it is small for the block's large values and wipes out its small ones. That is why ZeRO++
    sends int8 weights and int4 gradients only with fp32 sums at each hop, and why the block
    size matters: int4 in blocks of 2048 sends about half of a gradient's elements as 0, and a
    training run with it ends 4-6 % above the unquantized held-out loss (docs/quantized.md);
    in blocks of 256, as the trainer's qgZ does, 0.17-0.32 % above (at 4 x 256; 0.47-1.09 % at 6 x 384).

What it is not
    A convergence test: one step's tensors, not a training run (that is issue 49's measurement).
"""
from __future__ import annotations

import inspect
import json
import sys

import numpy as np

from ringzero.comm.qledger import zeropp_volume
from ringzero.comm.quant import Quant, Quantizer
from ringzero.nn import GPT, GPTConfig
from ringzero.runtime.flat import Layout

SMALL = GPTConfig(n_layer=2, n_head=4, n_embd=128, block_size=64, vocab=256)


def _text_tokens() -> np.ndarray:
    """Bytes of a standard library module's source: real text, on every machine, no download."""
    return np.frombuffer(inspect.getsource(json.decoder).encode(), np.uint8).astype(np.int64)


def weights_and_grad(steps: int = 3, seed: int = 0, batch: int = 4, cfg: GPTConfig = SMALL) -> tuple:
    """(weights, gradient) of the small GPT after `steps` Adam steps (float32, flat, the padding dropped)."""
    m = GPT(cfg)
    lay = Layout(m.units, 1)
    buf = np.zeros(lay.padded, np.float32)
    lay.init_full(buf, seed)
    gbuf = np.zeros_like(buf)
    P, G = lay.views(buf), lay.views(gbuf)
    tok, T = _text_tokens(), cfg.block_size
    rng = np.random.default_rng(seed)
    mom, var = np.zeros_like(buf), np.zeros_like(buf)
    for step in range(1, steps + 1):
        at = rng.integers(0, len(tok) - T - 1, batch)
        x = np.stack([tok[a:a + T] for a in at])
        y = np.stack([tok[a + 1:a + T + 1] for a in at])
        gbuf[...] = 0
        m.loss_and_grad(P, G, x, y)
        if step < steps:                     # the last gradient is the one shown, before its update
            mom[...] = 0.9 * mom + 0.1 * gbuf
            var[...] = 0.999 * var + 0.001 * gbuf * gbuf
            buf -= 1e-3 * (mom / (1 - 0.9 ** step)) / (np.sqrt(var / (1 - 0.999 ** step)) + 1e-8)
    keep = np.concatenate([np.arange(o, o + n) for o, n in zip(lay.unit_offset, lay.unit_numel)])
    return buf[keep].copy(), gbuf[keep].copy()


def errors(x: np.ndarray, fmt: str, block: int = 2048) -> dict:
    """x (float32) through format fmt ("fp16", "bf16", "int8", "int4"): its error figures."""
    if fmt in ("fp16", "bf16"):
        if fmt == "bf16":
            import ml_dtypes
            back = x.astype(ml_dtypes.bfloat16).astype(np.float32)
        else:
            with np.errstate(over="ignore"):
                back = x.astype(np.float16).astype(np.float32)
        wire = 2.0
    else:
        spec = Quant(8 if fmt == "int8" else 4, block)
        q = Quantizer(spec)
        codes, scales = np.empty(spec.code_bytes(len(x)), spec.codes_dtype()), np.empty(spec.nblocks(len(x)),
                                                                                        np.float32)
        q.quantize(x, codes, scales)
        back = q.dequantize(codes, scales, np.empty_like(x))
        wire = spec.wire_bytes(len(x)) / len(x)
    err = (back - x).astype(np.float64)
    nz = x != 0
    return {"rel_rms": float(np.sqrt(np.sum(err ** 2) / np.sum(x.astype(np.float64) ** 2))),
            "max_rel_to_absmax": float(np.max(np.abs(err)) / np.max(np.abs(x))),
            "zeroed": float(np.mean(back[nz] == 0)) if nz.any() else 0.0,
            "wire_bytes": wire}


def quant_errors(steps: int = 3, block: int = 2048, seed: int = 0, grad_block: int = 256) -> dict:
    """{"weights"|"gradient": {fmt: errors(...)}} for fp16, bf16, int8, int4, plus the element count: the
    weights' ints in blocks of ``block``, the gradient's in blocks of ``grad_block`` (and "int4@BLOCK": the
    gradient's int4 at the weights' block, where the two differ)."""
    Quant(8, block), Quant(8, grad_block)    # a bad block size fails here, in one line
    w, g = weights_and_grad(steps, seed)
    fmts = ["fp16", "int8", "int4"]
    try:
        import ml_dtypes  # noqa: F401
        fmts.insert(1, "bf16")
    except ImportError:
        pass
    grad = {f: errors(g, f, grad_block) for f in fmts}
    if grad_block != block:
        grad[f"int4@{block}"] = errors(g, "int4", block)
    return {"elements": len(w), "block": block, "grad_block": grad_block, "steps": steps,
            "weights": {f: errors(w, f, block) for f in fmts}, "gradient": grad}


def print_quant(steps: int = 3, block: int = 2048, f=None, grad_block: int = 256):
    p = lambda *a: print(*a, file=f or sys.stdout)  # noqa: E731
    r = quant_errors(steps, block, grad_block=grad_block)
    done = f"{steps - 1} Adam step{'' if steps == 2 else 's'}"
    p(f"== ZeRO++'s wire formats on the small GPT ({r['elements']:,} parameters, after {done}; int blocks of "
      f"{block} for the weights, {grad_block} for the gradient)")
    p("   fp16 / bf16: the cast the seed teaches (relative error); int8 / int4: one fp32 scale per block,")
    p("   codes = rint(x / scale), |error| <= scale / 2 = max|block| / 254 (int8) or / 14 (int4)")
    for what in ("weights", "gradient"):
        p(f"\n  {what:<10}{'bytes/elem':>11}{'rel. RMS error':>16}{'max err / max|x|':>18}{'nonzero -> 0':>14}")
        for fmt, e in r[what].items():
            p(f"  {fmt:<10}{e['wire_bytes']:>11.4f}{e['rel_rms']:>16.3e}{e['max_rel_to_absmax']:>18.3e}"
              f"{100 * e['zeroed']:>13.2f}%")
    p("\n  int8 weights cost qwZ half of fp16's bytes; int4 gradients a quarter (qgZ), summed in fp32 at each hop.")
    if f"int4@{block}" in r["gradient"]:
        p(f"  int4@{block}: the gradient's int4 in the weights' blocks, whose absmax leaves its small elements 0.")
    print_volume(block, f, grad_block)
    return r


SWITCHES = (("none (stage 3)", {}), ("qwZ", {"qwz": True}), ("hpZ", {"hpz": True}), ("qgZ", {"qgz": True}),
            ("qwZ + hpZ + qgZ", {"qwz": True, "hpz": True, "qgz": True}))


def print_volume(block: int = 2048, f=None, grad_block: int | None = None):
    """Stage 3's bytes across nodes per step, in Ψ fp16 elements, for each ZeRO++ switch (comm.qledger);
    grad_block: the gradient's blocks (None: ``block``)."""
    p = lambda *a: print(*a, file=f or sys.stdout)  # noqa: E731
    grad_block = grad_block or block
    p(f"\n== What crosses the nodes per step at stage 3, in units of Ψ fp16 elements (int blocks of {block}"
      + (f", the gradient's of {grad_block}" if grad_block != block else "") + "):")
    p(f"  {'switches':<18}{'fwd all-gather':>16}{'bwd all-gather':>16}{'reduce-scatter':>16}{'total':>10}")
    for name, kw in SWITCHES:
        v = zeropp_volume(**kw, weights=Quant(8, block), grads=Quant(4, grad_block))
        p(f"  {name:<18}{v['forward_all_gather']:>15.4f}Ψ{v['backward_all_gather']:>15.4f}Ψ"
          f"{v['reduce_scatter']:>15.4f}Ψ{v['total']:>9.4f}Ψ")
    p("  (ZeRO++'s 3Ψ -> 0.75Ψ leaves out the fp32 scales: 4 bytes per block)")
