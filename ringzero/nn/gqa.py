"""Grouped-query causal self-attention with rotary positions (Llama, Qwen2): forward and backward by hand.

What it is
    ``GroupedQueryAttention(n_head, n_kv_head, head_dim, rotary)``: the
    attention block of a Llama layer: one GEMM to [q | k | v] (H query heads,
    K key/value heads, D each; an optional bias, Qwen2's), rotary on q and k
    in place, causal softmax(q k^T / sqrt(D)) v, one GEMM out (no bias)::

        p: attn.w (C, (H+2K)·D), attn.b ((H+2K)·D,) or absent, proj.w (H·D, C)
        forward(p, x)  x (B, T, C) -> y (B, T, C)
        backward(dy, cache, g) -> dx; adds into g["attn.w"], g["attn.b"], g["proj.w"]

    No copy of K or V per query head, forward or backward: query head
    h = k·G + j (G = H/K) belongs to KV head k, so the queries are viewed as
    (B, K, G, T, D) against K's (B, K, 1, T, D) and the batched products
    broadcast over G. In backward, dK and dV sum over the group: the G
    query heads' rows are laid end to end, (B, K, G·T, ·), one contiguous
    workspace copy of dY (then of q), so each KV head's gradient is ONE
    product with inner dimension G·T: the sum over the group happens inside
    the GEMM. The scale, mask and softmax are the GPT's one-pass kernels
    (``ringzero.nn.fused.softmax_causal_`` and its backward).

What it is not
    No flash attention (the (B, H, T, T) scores are materialized), no KV
    cache, no sliding window, no attention mask but the causal one, no
    dropout. No device-specific path yet: the products are ``xp.matmul``.
"""
from __future__ import annotations

import math

from ringzero.nn import fused
from ringzero.nn.base import Layer, Linear, Pool
from ringzero.nn.ops import array_module


def _t(a):
    """The last two axes swapped, a view (CuPy's transpose; its stand-in has no swapaxes)."""
    return a.transpose(tuple(range(a.ndim - 2)) + (a.ndim - 1, a.ndim - 2))


class GroupedQueryAttention(Layer):
    """Causal GQA with rotary positions over a fused [q | k | v] projection; see the module docstring."""

    def __init__(self, n_head: int, n_kv_head: int, head_dim: int, rotary, pool: Pool | None = None,
                 tag: str = "", btag: str | None = None):
        super().__init__(pool, tag, btag)
        if n_head % n_kv_head:
            raise ValueError(f"n_head ({n_head}) must be a multiple of n_kv_head ({n_kv_head})")
        self.H, self.K, self.D = int(n_head), int(n_kv_head), int(head_dim)
        self.rotary = rotary
        self.qkv = Linear(self.pool, tag + ".qkv", self.btag + ".qkv")
        self.proj = Linear(self.pool, tag + ".proj", self.btag + ".proj")

    def _views(self, qkv, B, T):
        """(B, T, (H+2K)·D) -> q (B, T, H, D), k, v (B, T, K, D): views of the columns."""
        H, K, D = self.H, self.K, self.D
        a = qkv.reshape(B, T, H + 2 * K, D)
        return a[:, :, :H], a[:, :, H:H + K], a[:, :, H + K:]

    def _qk(self, qkv, B, T):
        """(B, T, (H+2K)·D) -> q|k (B, T, H+K, D): the heads rotary turns, side by side in each row."""
        return qkv.reshape(B, T, self.H + 2 * self.K, self.D)[:, :, :self.H + self.K]

    def _grouped(self, q4, B, T):
        """q (B, T, H, D) -> (B, K, G, T, D) view: query head k·G + j is group k's j-th."""
        return q4.reshape(B, T, self.K, self.H // self.K, self.D).transpose(0, 2, 3, 1, 4)

    def _ws(self, xp):
        return lambda name, shape, dtype: self.bbuf(name, shape, dtype, xp)

    def forward(self, p, x):
        B, T, C = x.shape
        H, K, D = self.H, self.K, self.D
        G = H // K
        xp = array_module(x)
        qkv, _ = self.qkv.forward({"w": p["attn.w"], "b": p.get("attn.b")}, x)    # (B, T, (H+2K)·D)
        q4, k4, v4 = self._views(qkv, B, T)
        self.rotary.forward(self._qk(qkv, B, T))                # in place: the cache keeps the rotated q, k
        q5 = self._grouped(q4, B, T)                            # (B, K, G, T, D)
        k5 = k4.transpose(0, 2, 1, 3)[:, :, None]               # (B, K, 1, T, D): broadcast over the group
        v5 = v4.transpose(0, 2, 1, 3)[:, :, None]
        att = self.buf("att", (B, H, T, T), x.dtype, xp)
        xp.matmul(q5, _t(k5), out=att.reshape(B, K, G, T, T))
        fused.softmax_causal_(att.reshape(B * H, T, T), 1.0 / math.sqrt(D), self._ws(xp))
        yh = self.buf("yh", (B, T, H * D), x.dtype, xp)         # heads side by side, proj's input
        xp.matmul(att.reshape(B, K, G, T, T), v5, out=self._grouped(yh.reshape(B, T, H, D), B, T))
        y, _ = self.proj.forward({"w": p["proj.w"]}, yh)
        return y, (p, x, qkv, att, yh)

    def backward(self, dy, cache, g):                           # dy (B, T, C)
        p, x, qkv, att, yh = cache          # p read now: it may hold re-gathered views
        B, T, C = dy.shape
        H, K, D = self.H, self.K, self.D
        G = H // K
        xp = array_module(dy)
        dyh = self.proj.backward(dy, ({"w": p["proj.w"]}, yh), {"w": g["proj.w"]})  # (B, T, H·D)
        q4, k4, v4 = self._views(qkv, B, T)
        k5 = k4.transpose(0, 2, 1, 3)[:, :, None]
        v5 = v4.transpose(0, 2, 1, 3)[:, :, None]
        dqkv = self.bbuf("dqkv", qkv.shape, dy.dtype, xp)
        dq4, dk4, dv4 = self._views(dqkv, B, T)
        att_g = att.reshape(B, K, G * T, T)                     # the group's score rows end to end
        c5 = self.bbuf("c5", (B, K, G, T, D), dy.dtype, xp)     # a contiguous (B, K, G·T, D) operand
        xp.copyto(c5, self._grouped(dyh.reshape(B, T, H, D), B, T))
        # dV (B, K, T, D) = sum over the group of att^T dY: one product, inner dimension G·T
        xp.matmul(_t(att_g), c5.reshape(B, K, G * T, D), out=dv4.transpose(0, 2, 1, 3))
        datt = self.bbuf("datt", att.shape, dy.dtype, xp)
        xp.matmul(c5, _t(v5), out=datt.reshape(B, K, G, T, T))       # dA = dY v^T
        fused.softmax_causal_backward_(datt.reshape(B * H, T, T), att.reshape(B * H, T, T), 1.0 / math.sqrt(D),
                                       self._ws(xp))            # dS, the scale folded in
        xp.matmul(datt.reshape(B, K, G, T, T), k5, out=self._grouped(dq4, B, T))   # dQ = dS k
        xp.copyto(c5, self._grouped(q4, B, T))
        # dK (B, K, T, D) = sum over the group of dS^T q
        xp.matmul(_t(datt.reshape(B, K, G * T, T)), c5.reshape(B, K, G * T, D),
                  out=dk4.transpose(0, 2, 1, 3))
        self.rotary.backward(self._qk(dqkv, B, T))              # the gradient before the rotation
        return self.qkv.backward(dqkv, ({"w": p["attn.w"], "b": p.get("attn.b")}, x),
                                 {"w": g["attn.w"], "b": g.get("attn.b")})
