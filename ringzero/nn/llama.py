"""The Llama-family decoder (Llama, Qwen2, SmolLM2, TinyLlama): forward and backward per unit, by hand.

What it is
    ``Llama(cfg)``, a ``Decoder`` (nn/units.py) over ``llama_units(cfg)`` (the declaration,
    ``ringzero.nn.llama_config``, re-exported here with ``LlamaConfig``,
    ``RopeScaling``, ``PRESETS`` and ``model_config``). Unit 0 embeds
    (no position table: positions are rotary), units 1..n_layer are blocks,
    the last unit is the final RMSNorm, the head (tied to ``wte`` or its own
    ``head.w``) and the loss. A block, pre-norm as in transformers'
    ``LlamaDecoderLayer``::

        x2 = x + proj(attn(rope(q), rope(k), v))     q, k, v = rmsnorm1(x) @ attn.w (+ attn.b)
        y  = x2 + down(silu(gate) * up)              [gate | up] = rmsnorm2(x2) @ mlp.w

    The layers are their own files: ``rmsnorm``, ``rotary``, ``swiglu``,
    ``gqa`` (grouped-query attention); the embedding, the unembedding and the
    cross-entropy are the GPT's (``ringzero.nn.layers``). Activations come
    from the pool (made once, reused step to step); a unit's cache stays
    valid until that unit's next forward.

    checkpoint=True: a block's cache is only its input; backward recomputes
    the block (into buffers all blocks share) and runs its backward, so the
    gradients are bitwise those of checkpoint=False.

What it is not
    A parameter owner (``P``/``G`` are views the runtime hands in), a KV cache
    for fast generation (``generate`` recomputes the window), or the
    Hugging Face names (the interop modules map them onto ``llama_units``).
"""
from __future__ import annotations

from ringzero.nn.gqa import GroupedQueryAttention
from ringzero.nn.layers import Embedding, Linear, Pool, SoftmaxCrossEntropy, Unembed, array_module
from ringzero.nn.llama_config import PRESETS, LlamaConfig, RopeScaling, llama_units, model_config
from ringzero.nn.rmsnorm import RMSNorm
from ringzero.nn.rotary import Rotary
from ringzero.nn.swiglu import SwiGLU
from ringzero.nn.units import Decoder

__all__ = ["Llama", "LlamaConfig", "RopeScaling", "PRESETS", "llama_units", "model_config"]


class Llama(Decoder):
    """A Llama-style decoder over the units of ``llama_units(cfg)``; see the module docstring."""

    def __init__(self, cfg: LlamaConfig = LlamaConfig(), checkpoint: bool = False, pool: Pool | None = None):
        self.cfg = cfg
        self.units = llama_units(cfg)
        self.checkpoint = bool(checkpoint)
        self.pool = pl = pool if pool is not None else Pool()
        self.last = cfg.n_layer + 1
        self.n_tokens = cfg.n_tokens        # the head scores rows [0, n_tokens) (LlamaConfig.real_vocab)
        self.embed = Embedding(pl, "embed")
        rope = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, pl, "rope")   # tables shared by all blocks
        self.blocks = []
        for i in range(cfg.n_layer):
            t = "block" if self.checkpoint else f"block{i}"    # checkpointed blocks share activations
            w = "block"                                        # workspaces are always shared
            self.blocks.append(dict(
                ln1=RMSNorm(cfg.rms_eps, pl, t + ".ln1", w + ".ln1"),
                attn=GroupedQueryAttention(cfg.n_head, cfg.n_kv_head, cfg.head_dim, rope, pl, t + ".attn",
                                           w + ".attn"),
                ln2=RMSNorm(cfg.rms_eps, pl, t + ".ln2", w + ".ln2"),
                mlp=Linear(pl, t + ".mlp", w + ".mlp"), act=SwiGLU(pl, t + ".act", w + ".act"),
                down=Linear(pl, t + ".down", w + ".down")))
        self.lnf = RMSNorm(cfg.rms_eps, pl, "lnf")
        self.head = Unembed(pl, "head")
        self.ce = SoftmaxCrossEntropy(pl, "ce")
        self._head_name = "wte" if cfg.tied else "head.w"
        self._pd = {}   # unit -> persistent dict of per-layer param dicts, refilled on every call

    # ---- parameter dicts ----------------------------------------------------
    def _fill_params(self, u, P, d):
        """Unit u's per-layer dicts in d, filled from P by this model's names (Decoder._params)."""
        if u == 0:
            d.setdefault("embed", {}).update(wte=P["wte"])
        elif u == self.last:
            d.setdefault("lnf", {}).update(w=P["lnf.w"])
            d.setdefault("head", {}).update(w=P[self._head_name][:self.n_tokens])   # (V real, C): a view
        else:
            h = f"h{u - 1}."
            for n in ("ln1", "ln2", "mlp", "down"):
                d.setdefault(n, {}).update(w=P[h + n + ".w"])
            a = d.setdefault("attn", {})
            a.update({k: P[h + k] for k in ("attn.w", "proj.w")})
            if self.cfg.qkv_bias:
                a["attn.b"] = P[h + "attn.b"]

    def _params_like(self, u, G):
        if u == 0:
            return {"embed": {"wte": G["wte"]}}
        if u == self.last:
            return {"lnf": {"w": G["lnf.w"]}, "head": {"w": G[self._head_name][:self.n_tokens]}}
        h = f"h{u - 1}."
        g = {n: {"w": G[h + n + ".w"]} for n in ("ln1", "ln2", "mlp", "down")}
        g["attn"] = {k: G[h + k] for k in ("attn.w", "proj.w")}
        if self.cfg.qkv_bias:
            g["attn"]["attn.b"] = G[h + "attn.b"]
        return g

    # ---- blocks --------------------------------------------------------------
    def _block_forward(self, u, pd, x, recompute=False):       # x (B, T, C)
        """Block u's forward. recompute=True (checkpointed backward) stops
        before ``down``: backward needs down's input, not the block's output."""
        L = self.blocks[u - 1]
        xp = array_module(x)
        h1, c_ln1 = L["ln1"].forward(pd["ln1"], x)
        a, c_attn = L["attn"].forward(pd["attn"], h1)          # (B, T, C), proj's output buffer
        xp.add(a, x, out=a)                                     # x2 = x + attn(ln1(x)), in place
        x2 = a
        h2, c_ln2 = L["ln2"].forward(pd["ln2"], x2)
        gu, c_mlp = L["mlp"].forward(pd["mlp"], h2)             # (B, T, 2F): [gate | up]
        s, c_act = L["act"].forward(None, gu)                   # (B, T, F)
        if recompute:
            return None, (c_ln1, c_attn, c_ln2, c_mlp, c_act, (pd["down"], s))   # Linear's cache: (p, x)
        y = self.pool.get((f"unit{u}", "y"), x.shape, x.dtype, xp)
        m, c_down = L["down"].forward(pd["down"], s, out=y)
        y += x2                                                 # y = x2 + mlp(ln2(x2))
        return y, (c_ln1, c_attn, c_ln2, c_mlp, c_act, c_down)

    def _block_backward(self, u, dy, c, gd):                   # dy (B, T, C)
        L = self.blocks[u - 1]
        c_ln1, c_attn, c_ln2, c_mlp, c_act, c_down = c
        d = L["down"].backward(dy, c_down, gd["down"])          # (B, T, F)
        d = L["act"].backward(d, c_act)                         # (B, T, 2F)
        d = L["mlp"].backward(d, c_mlp, gd["mlp"])              # (B, T, C)
        dx2 = L["ln2"].backward(d, c_ln2, gd["ln2"])
        dx2 += dy                                               # d(loss)/d x2: both branches
        d = L["attn"].backward(dx2, c_attn, gd["attn"])
        d = L["ln1"].backward(d, c_ln1, gd["ln1"])
        xp = array_module(dy)
        dx = self.pool.get((f"unit{u}", "dx"), dy.shape, dy.dtype, xp)
        xp.add(d, dx2, out=dx)
        return dx
