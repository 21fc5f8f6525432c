"""Activation memory of a GPT per rank, by each published count: what ZeRO's 16Ψ leaves out.

What it is
    ``activations(cfg, batch, seq)``: bytes per rank for one micro-batch, as
    the ZeRO paper counts them (12·b·s·h·L fp16 elements, with and without
    per-layer checkpoints) and as Korthikanti et al. 2022 count them
    (attention scores, softmax and dropout masks included), plus the logits;
    ``ACT_FORMULAS`` writes each formula out for the printed table of
    ``python -m ringzero.estimate``.

What it is not
    A measurement: ``python -m ringzero.train`` reports the engine's measured
    activation peak. Pure integer arithmetic on the config's shape.
"""
from __future__ import annotations


def activations(cfg, batch: int, seq: int) -> dict:
    """Activation bytes per rank for a micro-batch of ``batch`` sequences of ``seq`` tokens (cfg: a GPTConfig).

    zero_paper      12·b·s·h·L elements in fp16 (ZeRO §3.2: "about 12 × hidden ×
                    batch × seq × layers"); leaves out attention scores and logits.
    ckpt_inputs     the fp16 checkpoints alone: one layer input (b·s·h) per layer.
    zero_ckpt       one fp16 checkpoint (the layer input, b·s·h) per layer, plus one
                    layer's 12·b·s·h recomputed during backward: 2·b·s·h·(L + 12).
    korthikanti     Korthikanti et al. 2022, per layer s·b·h·(34 + 5·a·s/h) bytes
                    (fp16, counts the a·s² attention scores, softmax and dropout masks).
    korthikanti_ckpt  full recompute: 2·s·b·h per layer kept, plus one layer's peak.
    logits          the fp16 (b, s, V) logits, outside every per-layer count.
    """
    b, s, h, L, a, V = batch, seq, cfg.n_embd, cfg.n_layer, cfg.n_head, cfg.vocab
    bsh = b * s * h
    per_layer_k = s * b * h * 34 + 5 * a * s * s * b   # s·b·h·(34 + 5as/h), exact in ints
    return {
        "zero_paper": 2 * 12 * bsh * L,
        "ckpt_inputs": 2 * bsh * L,
        "zero_ckpt": 2 * bsh * (L + 12),
        "korthikanti": per_layer_k * L,
        "korthikanti_ckpt": 2 * bsh * L + per_layer_k,
        "logits": 2 * b * s * V,
    }


ACT_FORMULAS = {
    "zero_paper": "2 B x 12·b·s·h·L",
    "ckpt_inputs": "2 B x b·s·h·L",
    "zero_ckpt": "2 B x b·s·h·(L + 12)",
    "korthikanti": "L·(34·s·b·h + 5·a·s²·b)",
    "korthikanti_ckpt": "2·s·b·h·L + (34·s·b·h + 5·a·s²·b)",
    "logits": "2 B x b·s·V",
}
