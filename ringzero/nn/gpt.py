"""GPT-2-style decoder: configuration and the layout table.

This file declares the parameters (``gpt_units``) once; the forward/backward
model lives below the declaration. Ψ for any config comes from here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ringzero.flat import ParamSpec as P, Unit


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int = 4        # transformer blocks
    n_head: int = 4         # attention heads; n_embd % n_head == 0
    n_embd: int = 256       # model width C
    block_size: int = 128   # longest sequence T the position table covers
    vocab: int = 256        # byte-level by default

    def __post_init__(self):
        for k in ("n_layer", "n_head", "n_embd", "block_size", "vocab"):
            if int(getattr(self, k)) < 1:
                raise ValueError(f"GPTConfig.{k} must be >= 1, got {getattr(self, k)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")


# Published GPT-2 shapes (vocab 50257, context 1024), for the estimator.
PRESETS = {
    "gpt2": GPTConfig(12, 12, 768, 1024, 50257),
    "gpt2-medium": GPTConfig(24, 16, 1024, 1024, 50257),
    "gpt2-large": GPTConfig(36, 20, 1280, 1024, 50257),
    "gpt2-xl": GPTConfig(48, 25, 1600, 1024, 50257),
}


def gpt_units(cfg: GPTConfig) -> tuple:
    """The layout table of a GPT: embeddings, one unit per block, final norm.

    Weights are stored (in, out) so that y = x @ W. The head is tied to
    ``wte``, so the last unit ``needs`` the embedding unit.
    """
    C, L = cfg.n_embd, cfg.n_layer
    proj_std = f"normal:{0.02 / math.sqrt(2 * L)}"  # GPT-2's scaled residual init
    units = [Unit("embed", (P("wte", (cfg.vocab, C)), P("wpe", (cfg.block_size, C))))]
    for i in range(L):
        h = f"h{i}."
        units.append(Unit(f"block{i}", (
            P(h + "ln1.w", (C,), "ones", False), P(h + "ln1.b", (C,), "zeros", False),
            P(h + "attn.w", (C, 3 * C)), P(h + "attn.b", (3 * C,), "zeros", False),
            P(h + "proj.w", (C, C), proj_std), P(h + "proj.b", (C,), "zeros", False),
            P(h + "ln2.w", (C,), "ones", False), P(h + "ln2.b", (C,), "zeros", False),
            P(h + "fc.w", (C, 4 * C)), P(h + "fc.b", (4 * C,), "zeros", False),
            P(h + "fc2.w", (4 * C, C), proj_std), P(h + "fc2.b", (C,), "zeros", False),
        )))
    units.append(Unit("head", (P("lnf.w", (C,), "ones", False), P("lnf.b", (C,), "zeros", False)),
                      needs=("embed",)))
    return tuple(units)
