"""Layers with hand-written forward and backward, written once against ``xp``.

What it is
    The building blocks of ringzero's models (token+position embedding,
    linear, layernorm, GELU (tanh), causal multi-head self-attention (its own
    module, ``ringzero.nn.attention``, re-exported here), residual, tied
    unembedding, fused softmax cross-entropy), each a small object with

        forward(p, x)        -> (y, cache)
        backward(dy, cache, g) -> dx

    ``p`` and ``g`` are dicts of named views (for a Linear: {"w", "b"}) into the
    flat parameter and gradient buffers. Backward ADDS weight gradients into
    ``g`` (the runtime zeroes the gradient buffer once per step) and returns the
    gradient of the input. A cache holds the ``p`` dict it was made with; a
    model that may be handed fresh parameter views before backward (stage 3
    frees and re-gathers them) refills that same dict in place.

    The arithmetic is the same for NumPy and CuPy: ``xp = array_module(x)``;
    the few device-specific routes (embedding gradient, attention products)
    call helpers in ``ringzero.nn.ops``. The elementwise passes are single
    C kernels on the host (``ringzero.nn.fused``, NumPy formulas without it).
    Statistics (layernorm mean/var, softmax sums, the loss) accumulate in
    float32 even when the compute dtype is float16 (float64 stays float64).

Where each lives
    This module is the one name for all of them. It holds the embedding and
    the tied head; ``base`` the ``Pool`` (activations and workspaces reused
    from step to step), ``Layer`` and ``Linear``; ``pointwise`` layernorm,
    GELU, residual and cross-entropy; ``attention`` the attention block.
    Nothing here imports this module back.

What it is not
    No autograd, no parameter allocation, no loss scaling (the caller passes
    the scale as ``dy`` of the loss), no communication.
"""
from __future__ import annotations

import numpy as np

from ringzero.nn import fused, gemm
from ringzero.nn.attention import CausalSelfAttention
from ringzero.nn.base import Layer, Linear, Pool, cache_nbytes
from ringzero.nn.ops import _same_module, _take, acc_dtype, array_module, bmm, check_ids, segment_sum_rows  # noqa: F401
from ringzero.nn.pointwise import GELU, GELU_A, GELU_K, LN_EPS, LayerNorm, Residual, SoftmaxCrossEntropy  # noqa: F401

__all__ = ["Pool", "cache_nbytes", "Layer", "Embedding", "Linear", "Unembed", "LayerNorm", "GELU", "Residual",
           "SoftmaxCrossEntropy", "CausalSelfAttention"]


class Embedding(Layer):
    """Token + position embedding. p: wte (V, C), wpe (Tmax, C) or no "wpe" (rotary models); x: idx int (B, T).

    Token ids are range-checked here only when they are host (NumPy) arrays:
    on a device the check would be a blocking reduction every step, so the
    caller checks the tokens on the host, where they start
    (``ringzero.nn.gpt.check_tokens``; CuPy's take would wrap a bad id).

    The gradient of ``wte`` is a sum over repeated token ids. ``grad_sum``
    picks how: "add_at" (NumPy's np.add.at: rows added one by one in token
    order, the CPU default; a C loop with the same sums when built) or "segmented" (``segment_sum_rows``: ids sorted
    stably, each row's sum accumulated in float64 in that order and rounded
    once; no atomics, so bitwise the same on every run; the device default).
    None means the default for the array module.
    """
    grad_sum = None

    def forward(self, p, idx):
        wte, wpe = p["wte"], p.get("wpe")
        xp = array_module(wte)
        _same_module(xp, idx, *(() if wpe is None else (wpe,)))
        if idx.ndim != 2 or idx.dtype.kind not in "iu":
            raise TypeError(f"embedding expects integer idx of shape (B, T), got {idx.dtype} {tuple(idx.shape)}")
        B, T = idx.shape
        V, C = wte.shape
        if wpe is not None and T > wpe.shape[0]:
            raise ValueError(f"sequence length T={T} exceeds block_size={wpe.shape[0]}")
        if xp is np:
            check_ids(idx, V, "token ids")
        ids = self.buf("idx", (B * T,), np.intp, xp)            # own copy: the caller may reuse idx
        xp.copyto(ids, idx.reshape(-1), casting="unsafe")
        y = self.buf("y", (B, T, C), wte.dtype, xp)             # (B, T, C)
        if xp is np:   # range checked above; mode="raise" would buffer the whole output
            np.take(wte, ids, axis=0, out=y.reshape(B * T, C), mode="clip")
        else:
            xp.take(wte, ids, axis=0, out=y.reshape(B * T, C))
        if wpe is not None:
            y += wpe[:T]
        return y, (p, ids)

    def backward(self, dy, cache, g):                           # dy (B, T, C)
        p, idx = cache
        xp = array_module(dy)
        B, T, C = dy.shape
        ad = acc_dtype(dy.dtype)
        if g.get("wpe") is not None:
            g["wpe"][:T] += dy.sum(axis=0, dtype=ad, out=self.bbuf("dwpe", (T, C), ad, xp))
        how = self.grad_sum or ("add_at" if xp is np else "segmented")
        if how == "add_at":
            fused.rows_add_at(g["wte"], idx, dy.reshape(B * T, C))     # np.add.at's order and sums
        else:
            segment_sum_rows(g["wte"], idx, dy.reshape(B * T, C), self)
        return None




class Unembed(Layer):
    """Tied head: logits = x @ w.T. p: w (V, C) (the token embedding); x (N, C) -> (N, V)."""

    def forward(self, p, x):
        w = p["w"]
        xp = array_module(w)
        _same_module(xp, x)
        if x.shape[-1] != w.shape[1]:
            raise ValueError(f"unembed expects input width {w.shape[1]}, got x of shape {tuple(x.shape)}")
        y = self.buf("y", x.shape[:-1] + (w.shape[0],), w.dtype, xp)
        gemm.matmul(x.reshape(-1, w.shape[1]), w.T, y.reshape(-1, w.shape[0]))
        return y, (p, x)

    def backward(self, dy, cache, g):                           # dy (N, V)
        p, x = cache
        w = p["w"]
        xp = array_module(dy)
        V, C = w.shape
        x2, dy2 = x.reshape(-1, C), dy.reshape(-1, V)
        dw = self.bbuf("dw", w.shape, w.dtype, xp)
        gemm.matmul(dy2.T, x2, dw)                            # (V, C)
        g["w"] += dw
        dx = self.bbuf("dx", x.shape, x.dtype, xp)
        gemm.matmul(dy2, w, dx.reshape(-1, C))
        return dx


