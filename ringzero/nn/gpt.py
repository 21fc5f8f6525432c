"""GPT-2-style decoder: configuration and the layout table.

This file declares the parameters (``gpt_units``) once; the forward/backward
model lives below the declaration. Ψ for any config comes from here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ringzero.nn.layers import (
    GELU,
    CausalSelfAttention,
    Embedding,
    LayerNorm,
    Linear,
    Pool,
    Residual,
    SoftmaxCrossEntropy,
    Unembed,
    acc_dtype,
    array_module,
)
from ringzero.nn.units import Decoder
from ringzero.runtime.flat import ParamSpec as P
from ringzero.runtime.flat import Unit


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int = 4        # transformer blocks
    n_head: int = 4         # attention heads; n_embd % n_head == 0
    n_embd: int = 256       # model width C
    block_size: int = 128   # longest sequence T the position table covers
    vocab: int = 256        # byte-level by default
    # the rows of wte that are tokens (None: all of them). An imported GPT-2 has 50257 of its
    # 50304 (the table padded to whole 64-row tiles, as nanoGPT pads it): the head scores only
    # these, so its logits, loss and gradients are transformers' exactly; the padding rows stay zero
    real_vocab: int | None = None

    def __post_init__(self):
        for k in ("n_layer", "n_head", "n_embd", "block_size", "vocab"):
            if int(getattr(self, k)) < 1:
                raise ValueError(f"GPTConfig.{k} must be >= 1, got {getattr(self, k)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.real_vocab is not None and not 1 <= self.real_vocab <= self.vocab:
            raise ValueError(f"GPTConfig.real_vocab must be in [1, vocab = {self.vocab}], got {self.real_vocab}")

    @property
    def n_tokens(self) -> int:
        """Token ids the model reads and scores: [0, n_tokens)."""
        return self.vocab if self.real_vocab is None else self.real_vocab


# Published GPT-2 shapes (Radford et al. 2019; the HF `gpt2*` configs): layers,
# heads, width, context 1024, vocab 50257. Ψ of these, with the tied head, is
# 124,439,808 / 354,823,168 / 774,030,080 / 1,557,611,200 (tests/test_presets.py).
PRESETS = {
    "gpt2": GPTConfig(12, 12, 768, 1024, 50257),
    "gpt2-medium": GPTConfig(24, 16, 1024, 1024, 50257),
    "gpt2-large": GPTConfig(36, 20, 1280, 1024, 50257),
    "gpt2-xl": GPTConfig(48, 25, 1600, 1024, 50257),
}
VOCAB_MULTIPLE = 64     # nanoGPT pads 50257 to 50304: whole 64-wide tiles for the head GEMM


def vocab_for(max_id: int, byte_level: bool = False, multiple: int = VOCAB_MULTIPLE) -> int:
    """The vocabulary a model needs for data whose largest token id is ``max_id``.

    Byte-level data (text read as bytes) gets 256 whatever bytes occur, so
    any prompt byte can be fed later. Token data (a nanoGPT uint16 ``.bin``)
    gets max_id + 1 rounded up to a multiple of ``multiple``: 50256 -> 50304.
    The extra rows are never targets; their logits learn to stay low.
    """
    if isinstance(max_id, bool) or int(max_id) != max_id or max_id < 0:
        raise ValueError(f"max_id must be an int >= 0, got {max_id!r}")
    if int(multiple) != multiple or multiple < 1:
        raise ValueError(f"multiple must be an int >= 1, got {multiple!r}")
    if byte_level:
        if max_id > 255:
            raise ValueError(f"byte-level data holds ids < 256, got max_id {max_id}")
        return 256
    return -(-(int(max_id) + 1) // int(multiple)) * int(multiple)


def model_config(name: str | None = None, vocab: int | None = None, **overrides) -> GPTConfig:
    """A GPTConfig from a preset name (or the small default), the data's vocab, and overrides.

        model_config("gpt2", vocab_for(corpus_max_id, byte_level=True))   # GPT-2 shapes, vocab 256
        model_config(None, 256, n_layer=4, n_embd=128, block_size=128)    # the trainer's default model

    ``overrides`` are GPTConfig fields (n_layer, n_head, n_embd, block_size);
    a value of None means "not given" and keeps the preset's.
    """
    if name is not None and name not in PRESETS:
        raise ValueError(f"unknown model {name!r}: expected one of {', '.join(sorted(PRESETS))}")
    base = PRESETS[name] if name is not None else GPTConfig()
    fields = set(base.__dict__)
    bad = sorted(set(overrides) - fields)
    if bad:
        raise ValueError(f"unknown GPTConfig field(s) {bad}: expected some of {sorted(fields)}")
    given = {k: int(v) for k, v in overrides.items() if v is not None}
    if vocab is not None:
        given["vocab"] = int(vocab)
    return GPTConfig(**{**base.__dict__, **given})


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


# ---------------------------------------------------------------------------
# The model: forward/backward per unit, on views the runtime hands in.
# ---------------------------------------------------------------------------


class GPT(Decoder):
    """A GPT-2-style decoder over the units of ``gpt_units(cfg)``.

    Unit 0 embeds, units 1..n_layer are blocks, the last unit is the final
    layernorm, the tied head and the loss. The model owns no parameters: every
    call gets ``P``/``G`` dicts of named views (compute dtype) from the runtime.

    checkpoint=True: a block's cache is only its input; backward recomputes
    the block's forward (into buffers shared by all blocks) and then runs its
    backward, so gradients are bitwise those of checkpoint=False.

    A unit's cache stays valid until that unit's next forward_unit: the
    activation buffers are reused from step to step (``self.pool``).
    """

    def __init__(self, cfg: GPTConfig = GPTConfig(), checkpoint: bool = False, pool: Pool | None = None):
        self.cfg = cfg
        self.units = gpt_units(cfg)
        self.checkpoint = bool(checkpoint)
        self.pool = pool if pool is not None else Pool()
        self.last = cfg.n_layer + 1
        self.n_tokens = cfg.n_tokens     # the head scores wte[:n_tokens] (GPTConfig.real_vocab)
        pl = self.pool
        self.embed = Embedding(pl, "embed")
        self.blocks = []
        for i in range(cfg.n_layer):
            t = "block" if self.checkpoint else f"block{i}"   # checkpointed blocks share activations
            w = "block"                                       # workspaces are always shared
            self.blocks.append(dict(
                ln1=LayerNorm(pl, t + ".ln1", w + ".ln1"),
                attn=CausalSelfAttention(cfg.n_head, pl, t + ".attn", w + ".attn"),
                res=Residual(pl, t + ".res", w + ".res"), ln2=LayerNorm(pl, t + ".ln2", w + ".ln2"),
                fc=Linear(pl, t + ".fc", w + ".fc"), gelu=GELU(pl, t + ".gelu", w + ".gelu"),
                fc2=Linear(pl, t + ".fc2", w + ".fc2")))
        self.lnf = LayerNorm(pl, "lnf")
        self.head = Unembed(pl, "head")
        self.ce = SoftmaxCrossEntropy(pl, "ce")
        self._pd = {}   # unit -> persistent dict of per-layer param dicts, refilled on every call

    # ---- parameter dicts ----------------------------------------------------
    def _fill_params(self, u, P, d):
        """Unit u's per-layer dicts in d, filled from P by this model's names (Decoder._params)."""
        if u == 0:
            d.setdefault("embed", {}).update(wte=P["wte"], wpe=P["wpe"])
        elif u == self.last:
            d.setdefault("lnf", {}).update(w=P["lnf.w"], b=P["lnf.b"])
            d.setdefault("head", {}).update(w=P["wte"][:self.n_tokens])     # (V real, C): a view
        else:
            h = f"h{u - 1}."
            for n in ("ln1", "ln2", "fc", "fc2"):
                d.setdefault(n, {}).update(w=P[h + n + ".w"], b=P[h + n + ".b"])
            d.setdefault("attn", {}).update({k: P[h + k] for k in ("attn.w", "attn.b", "proj.w", "proj.b")})

    def _params_like(self, u, G):
        if u == 0:
            return {"embed": {"wte": G["wte"], "wpe": G["wpe"]}}
        if u == self.last:
            return {"lnf": {"w": G["lnf.w"], "b": G["lnf.b"]}, "head": {"w": G["wte"][:self.n_tokens]}}
        h = f"h{u - 1}."
        g = {n: {"w": G[h + n + ".w"], "b": G[h + n + ".b"]} for n in ("ln1", "ln2", "fc", "fc2")}
        g["attn"] = {k: G[h + k] for k in ("attn.w", "attn.b", "proj.w", "proj.b")}
        return g

    # ---- blocks --------------------------------------------------------------
    def _block_forward(self, u, pd, x, recompute=False):       # x (B, T, C)
        """Block u's forward. recompute=True (checkpointed backward) stops
        before fc2: backward needs fc2's input, not the block's output."""
        L = self.blocks[u - 1]
        # Each GEMM's bias is added in the pass that follows it: proj's and fc2's
        # with the residual, fc's with GELU (bitwise the same sums as before).
        h1, c_ln1 = L["ln1"].forward(pd["ln1"], x)
        a, c_attn = L["attn"].forward(pd["attn"], h1, bias=False)
        x2, _ = L["res"].forward(None, (a, x), out=a, bias=pd["attn"]["proj.b"])   # x2 = x + attn(ln1(x))
        h2, c_ln2 = L["ln2"].forward(pd["ln2"], x2)
        f, c_fc = L["fc"].forward(pd["fc"], h2, bias=False)    # (B, T, 4C)
        gg, c_gelu = L["gelu"].forward(None, f, bias=pd["fc"]["b"])
        if recompute:
            return None, (c_ln1, c_attn, c_ln2, c_fc, c_gelu, (pd["fc2"], gg))  # Linear's cache: (p, x)
        y = self.pool.get((f"unit{u}", "y"), x.shape, x.dtype, array_module(x))
        m, c_fc2 = L["fc2"].forward(pd["fc2"], gg, out=y, bias=False)
        L["res"].forward(None, (m, x2), out=y, bias=pd["fc2"]["b"])   # y = x2 + mlp(ln2(x2))
        return y, (c_ln1, c_attn, c_ln2, c_fc, c_gelu, c_fc2)

    def _block_backward(self, u, dy, c, gd):                   # dy (B, T, C)
        L = self.blocks[u - 1]
        c_ln1, c_attn, c_ln2, c_fc, c_gelu, c_fc2 = c
        dm, dres = L["res"].backward(dy, None, None)            # both residual branches see dy
        d = L["fc2"].backward(dm, c_fc2, gd["fc2"])             # (B, T, 4C)
        dfb = L["gelu"].bbuf("dfc.b", (d.shape[-1],), acc_dtype(d.dtype), array_module(d))
        d = L["gelu"].backward(d, c_gelu, None, colsum=dfb,    # and fc's bias gradient, same pass
                               bias=c_fc[0]["b"])               # fc's dict, refilled for backward
        d = L["fc"].backward(d, c_fc, gd["fc"], db=dfb)         # (B, T, C)
        dx2 = L["ln2"].backward(d, c_ln2, gd["ln2"])
        dx2 += dres                                             # d(loss)/d x2, in ln2's buffer
        da, dres2 = L["res"].backward(dx2, None, None)
        d = L["attn"].backward(da, c_attn, gd["attn"])
        d = L["ln1"].backward(d, c_ln1, gd["ln1"])
        xp = array_module(dy)
        dx = self.pool.get((f"unit{u}", "dx"), dy.shape, dy.dtype, xp)
        xp.add(d, dres2, out=dx)
        return dx
