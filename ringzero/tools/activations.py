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



def training_bytes(cfg, batch: int, seq: int, checkpointing: bool = False, compute_bytes: int = 4) -> int:
    """What ringzero's GPT (nn/gpt.py) keeps in its buffer pool for one micro-batch of training, per rank,
    in the compute dtype (fp32 on a CPU run): the trainer's start-up memory check counts this (runtime/budget.py).

    Counted from the model's own buffers, in elements (bsh = b·s·h, att = a·s²·b):

        per block, kept      21·bsh + att   layer norms' x̂ and output (2 x 2), qkv (3), the attention
                                            probabilities (att), the heads' output, proj (1 each), fc's
                                            output, GELU's input and output (4 each)
        per block, always     2·bsh         the block's output and its input gradient (pool "unit{u}")
        one block's backward 16·bsh + att + 12·h² + 512·h   input gradients, dqkv, the attention's
                                            gradient, three weight gradients' staging, the layer norms'
                                            and GELU's column-sum blocks (128 and 64 rows; shared by every block)
        the ends              5·bsh + 3·b·s·V + V·h + s·h + 192·h   embedding, final norm, the logits,
                                            their probabilities and gradient, the head's weight gradient

    With checkpointing a block keeps only the 2·bsh; one block's 21·bsh + att is recomputed into shared
    buffers. Korthikanti's count (above) is the same tensors in fp16 with dropout masks; this one is this
    model's. Plus one block's 21·bsh + att of temporaries outside the pool (the heap keeps what they
    freed). tests/test_budget.py holds it against the pool's bytes after a real step.

    A Llama-family config (``n_kv_head``) is counted by ``ringzero.tools.llama_activations``.
    """
    if hasattr(cfg, "n_kv_head"):
        from ringzero.tools.llama_activations import training_bytes as llama_bytes
        return llama_bytes(cfg, batch, seq, checkpointing, compute_bytes)
    b, s, h, L, a, V = batch, seq, cfg.n_embd, cfg.n_layer, cfg.n_head, cfg.vocab
    bsh, att = b * s * h, a * s * s * b
    layer = 21 * bsh + att
    kept = L * 2 * bsh + (layer if checkpointing else L * layer)
    backward = 16 * bsh + att + 12 * h * h + 512 * h
    ends = 5 * bsh + 3 * b * s * V + V * h + s * h + 192 * h
    # and one block's worth of temporaries outside the pool (matmul results, softmax rows), freed after each
    # block but kept by the C allocator's heap (measured: the data segment grows by about this much more)
    return compute_bytes * (kept + backward + ends + layer)
