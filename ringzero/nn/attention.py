"""Causal multi-head self-attention, with its two projections, forward and backward by hand.

What it is
    ``CausalSelfAttention(n_head)``: the attention block of a GPT layer, built
    on the ``Layer`` plumbing of ``ringzero.nn.base`` (its pool, its buffer
    tags) and two ``Linear`` layers (qkv, proj). One object, two paths: on
    NumPy, batched matmuls over strided head views of the fused qkv buffer; on
    CuPy, contiguous head workspaces and cuBLAS strided-batched GEMMs
    (``ringzero.nn.ops.bmm``), with float32 accumulation. Between the two
    products of each direction there is one elementwise pass: the scale, the
    causal mask and the softmax in one (``ringzero.nn.fused.softmax_causal_``,
    a C kernel on the host), and the softmax's backward with the scale in one.
    Their row sums stay in float32 under float16 compute.
    ``from ringzero.nn.layers import CausalSelfAttention`` gives the same class.

What it is not
    No flash attention (the (B, H, T, T) scores are materialized), no KV cache, no dropout, no attention mask
    other than the causal one; no parameter allocation (``p``/``g`` are views
    into the flat buffers, as for every layer).
"""
from __future__ import annotations

import math

import numpy as np

from ringzero.nn import fused
from ringzero.nn.base import Layer, Linear, Pool
from ringzero.nn.ops import array_module, bmm


class CausalSelfAttention(Layer):
    """Multi-head causal self-attention with its projections.

    p: attn.w (C, 3C), attn.b (3C,), proj.w (C, C), proj.b (C,); x (B, T, C) -> (B, T, C).

    NumPy: heads are batched matmuls over strided (B, H, T, D) views of the
    fused qkv buffer (no per-head loop, no transposing copies), taken per
    causal block of query rows on the C path (``_row_blocks``). CuPy: its
    matmul on more than 2 dims copies float16 operands to float32 and lands
    the result in a temporary (cupy/_core/_routines_linalg.pyx), so q, k, v
    are copied once into contiguous (B*H, T, D) workspaces and every product
    is one cuBLAS strided-batched GEMM with float32 accumulation into
    preallocated outputs (``bmm``). The softmax statistics go to pool
    buffers too.
    """

    def __init__(self, n_head: int, pool: Pool | None = None, tag: str = "", btag: str | None = None):
        super().__init__(pool, tag, btag)
        self.n_head = n_head
        self.qkv = Linear(self.pool, tag + ".qkv", self.btag + ".qkv")
        self.proj = Linear(self.pool, tag + ".proj", self.btag + ".proj")

    def _split(self, qkv, B, T, C):
        """(B, T, 3C) -> three (B, H, T, D) strided views."""
        H = self.n_head
        v5 = qkv.reshape(B, T, 3, H, C // H)
        return (v5[:, :, i].transpose(0, 2, 1, 3) for i in range(3))

    def _heads(self, xp, views, names, B, T, D):
        """Contiguous (B*H, T, D) copies of (B, H, T, D) views (device path only)."""
        out = []
        for v, n in zip(views, names):
            c = self.bbuf(n, (B * self.n_head, T, D), v.dtype, xp)
            c.reshape(v.shape)[...] = v
            out.append(c)
        return out

    ROW_BLOCK = 64      # causal row blocks of the host products (see _row_blocks)

    def _row_blocks(self, T, att):
        """Row ranges [r0, r1) whose products need only keys [0, r1).

        On the host C path the products are taken per block of 64 query rows
        against the keys up to the block's end, skipping the tiles above the
        diagonal (for T = 128: 3/4 of the FLOPs, measured 15-25 % faster):
        the softmax kernels read only j <= t and write the zeros above it, so
        the tiles never computed are never read. Elsewhere: one full block.
        """
        b = self.ROW_BLOCK
        if not fused.use_c(att) or T <= b:
            return ((0, T),)
        return tuple((r, min(r + b, T)) for r in range(0, T, b))

    def _ws(self, xp):
        return lambda name, shape, dtype: self.bbuf(name, shape, dtype, xp)

    def forward(self, p, x, out=None, bias=True):
        """y = proj(attention(qkv(x))); bias=False leaves proj's bias out of y (the caller's next pass adds it)."""
        B, T, C = x.shape
        H = self.n_head
        if C % H:
            raise ValueError(f"width C={C} must be divisible by n_head={H}")
        D = C // H
        xp = array_module(x)
        qkv, _ = self.qkv.forward({"w": p["attn.w"], "b": p["attn.b"]}, x)     # (B, T, 3C)
        q, k, v = self._split(qkv, B, T, C)                     # (B, H, T, D) views
        att = self.buf("att", (B, H, T, T), x.dtype, xp)
        yh = self.buf("yh", (B, T, C), x.dtype, xp)             # heads side by side
        yh4 = yh.reshape(B, T, H, D).transpose(0, 2, 1, 3)     # (B, H, T, D) view
        blocks = self._row_blocks(T, att) if xp is np else None
        if xp is np:
            for r0, r1 in blocks:                               # att (B, H, T, T) = q k^T, lower tiles
                xp.matmul(q[:, :, r0:r1], k[:, :, :r1].transpose(0, 1, 3, 2), out=att[:, :, r0:r1, :r1])
        else:
            qc, kc, vc = self._heads(xp, (q, k, v), ("qc", "kc", "vc"), B, T, D)
            bmm(qc, kc, att.reshape(B * H, T, T), tb=True)
        fused.softmax_causal_(att.reshape(B * H, T, T), 1.0 / math.sqrt(D), self._ws(xp))   # one pass
        if xp is np:
            for r0, r1 in blocks:
                xp.matmul(att[:, :, r0:r1, :r1], v[:, :, :r1], out=yh4[:, :, r0:r1])
        else:
            yc = self.bbuf("yc", (B * H, T, D), x.dtype, xp)
            bmm(att.reshape(B * H, T, T), vc, yc)
            yh4[...] = yc.reshape(B, H, T, D)
        y, _ = self.proj.forward({"w": p["proj.w"], "b": p["proj.b"]}, yh, out=out, bias=bias)
        return y, (p, x, qkv, att, yh)

    def backward(self, dy, cache, g):                           # dy (B, T, C)
        p, x, qkv, att, yh = cache          # p read now: it may hold re-gathered views
        B, T, C = dy.shape
        H, D = self.n_head, C // self.n_head
        xp = array_module(dy)
        dyh = self.proj.backward(dy, ({"w": p["proj.w"], "b": p["proj.b"]}, yh),
                                 {"w": g["proj.w"], "b": g["proj.b"]})            # (B, T, C)
        dyh4 = dyh.reshape(B, T, H, D).transpose(0, 2, 1, 3)    # (B, H, T, D)
        q, k, v = self._split(qkv, B, T, C)
        dqkv = self.bbuf("dqkv", (B, T, 3 * C), dy.dtype, xp)
        dq, dk, dv = self._split(dqkv, B, T, C)
        datt = self.bbuf("datt", att.shape, dy.dtype, xp)
        blocks = self._row_blocks(T, att) if xp is np else None
        if xp is np:
            for c0, c1 in blocks:       # dv = att^T dY; key columns [c0, c1) are non-zero in rows >= c0 only
                xp.matmul(att[:, :, c0:, c0:c1].transpose(0, 1, 3, 2), dyh4[:, :, c0:], out=dv[:, :, c0:c1])
            for r0, r1 in blocks:       # datt = dY v^T, lower tiles
                xp.matmul(dyh4[:, :, r0:r1], v[:, :, :r1].transpose(0, 1, 3, 2), out=datt[:, :, r0:r1, :r1])
        else:
            qc, kc, vc, dyc = self._heads(xp, (q, k, v, dyh4), ("qc", "kc", "vc", "dyc"), B, T, D)
            att3, datt3 = att.reshape(B * H, T, T), datt.reshape(B * H, T, T)
            dc = self.bbuf("dc", (B * H, T, D), dy.dtype, xp)
            bmm(att3, dyc, dc, ta=True)
            dv[...] = dc.reshape(B, H, T, D)
            bmm(dyc, vc, datt3, tb=True)
        # softmax backward with the 1/sqrt(D) scale, one pass: ds = att * (datt - sum(datt * att)) / sqrt(D)
        fused.softmax_causal_backward_(datt.reshape(B * H, T, T), att.reshape(B * H, T, T), 1.0 / math.sqrt(D),
                                       self._ws(xp))
        if xp is np:
            for r0, r1 in blocks:                               # dq = ds k
                xp.matmul(datt[:, :, r0:r1, :r1], k[:, :, :r1], out=dq[:, :, r0:r1])
            for c0, c1 in blocks:                               # dk = ds^T q
                xp.matmul(datt[:, :, c0:, c0:c1].transpose(0, 1, 3, 2), q[:, :, c0:], out=dk[:, :, c0:c1])
        else:
            bmm(datt3, kc, dc)
            dq[...] = dc.reshape(B, H, T, D)
            bmm(datt3, qc, dc, ta=True)
            dk[...] = dc.reshape(B, H, T, D)
        return self.qkv.backward(dqkv, ({"w": p["attn.w"], "b": p["attn.b"]}, x),
                                 {"w": g["attn.w"], "b": g["attn.b"]})
