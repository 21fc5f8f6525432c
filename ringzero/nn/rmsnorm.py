"""RMSNorm (Zhang & Sennrich 2019; Llama's and Qwen2's norm), forward and backward by hand.

What it is
    ``RMSNorm(eps)``: y = w * xhat, xhat = x / sqrt(mean(x^2) + eps) over the
    last axis, as transformers' ``LlamaRMSNorm`` computes it: the mean square
    and the reciprocal root in float32 (or float64 for float64 arrays), xhat
    rounded to x's dtype before the weight multiplies it. Written once
    against ``xp``; every buffer comes from the layer's pool.

        forward(p, x)           p: {"w": (C,)}; x (..., C) -> y (..., C)
        backward(dy, cache, g)  adds dL/dw into g["w"]; returns dx

    Backward: with gh = dy * w, dx = rstd * (gh - xhat * mean(gh * xhat)),
    dw = sum over rows of dy * xhat.

    On C-contiguous float32/float64 host arrays the C extension does each
    direction in one pass over a row (fused.c's rms_fwd / rms_bwd: the row
    sums in 8 lanes, dw's column sums in fused.py's 64 row lanes), agreeing
    with the xp passes below to float32 rounding, as fused.py's kernels do.

    On CuPy arrays ``fused.use_gpu`` takes, fused_cuda_llama.py's kernels
    (the same sums on threads in the same order).

What it is not
    No bias, no mean subtraction (that is LayerNorm, ``ringzero.nn.pointwise``).
"""
from __future__ import annotations

from ringzero.nn import fused_cuda_llama
from ringzero.nn.base import Layer
from ringzero.nn.fused import ROWLANES, _c, use_c, use_gpu
from ringzero.nn.ops import _same_module, acc_dtype, array_module


class RMSNorm(Layer):
    """y = w * x / sqrt(mean(x^2) + eps). p: w (C,); x (..., C)."""

    def __init__(self, eps: float, pool=None, tag: str = "", btag: str | None = None):
        super().__init__(pool, tag, btag)
        self.eps = float(eps)

    def _ws(self, xp):
        """The device kernels' scratch (lane and column partials), from the backward pool."""
        return lambda name, shape, dtype: self.bbuf(name, shape, dtype, xp)

    def forward(self, p, x):
        w = p["w"]
        xp = array_module(w)
        _same_module(xp, x)
        C = w.shape[0]
        if x.shape[-1] != C:
            raise ValueError(f"rmsnorm expects input width {C}, got x of shape {tuple(x.shape)}")
        x2 = x.reshape(-1, C)                                   # (N, C)
        N, ad = x2.shape[0], acc_dtype(x.dtype)
        xhat = self.buf("xhat", (N, C), x.dtype, xp)            # x * rstd, rounded to x's dtype (HF)
        rstd = self.buf("rstd", (N, 1), ad, xp)                 # (N, 1) kept for backward
        y = self.buf("y", x.shape, x.dtype, xp)
        if use_c(x2, w, outs=0) and ad == x.dtype:
            _c.rms_fwd(x2, w, y, xhat, rstd, N, C, x.dtype.itemsize == 8, self.eps)
            return y, (p, xhat, rstd)
        if use_gpu(x2, w, y.reshape(N, C), xhat, rstd, outs=3, free=(rstd,)):
            fused_cuda_llama.rms_fwd(x2, w, y.reshape(N, C), xhat, rstd, self.eps, self._ws(xp))
            return y, (p, xhat, rstd)
        sq = self.bbuf("sq", (N, C), ad, xp)                    # x^2 in the accumulation dtype
        xp.copyto(sq, x2, casting="unsafe")
        sq *= sq
        sq.mean(axis=1, keepdims=True, out=rstd)
        rstd += self.eps
        xp.sqrt(rstd, out=rstd)
        xp.divide(1.0, rstd, out=rstd)
        xp.multiply(x2, rstd, out=xhat, casting="unsafe")
        xp.multiply(xhat, w, out=y.reshape(N, C))
        return y, (p, xhat, rstd)

    def backward(self, dy, cache, g):                           # dy (..., C)
        p, xhat, rstd = cache
        w = p["w"]
        xp = array_module(dy)
        N, C = xhat.shape
        ad = acc_dtype(dy.dtype)
        dy2 = dy.reshape(N, C)
        dx = self.bbuf("dx", dy.shape, dy.dtype, xp)
        dw = self.bbuf("dw", (C,), ad, xp)
        if use_c(dy2, xhat, rstd, w, outs=0) and ad == dy.dtype:
            cols = self.bbuf("cols", (ROWLANES, C), ad, xp)
            _c.rms_bwd(dy2, xhat, rstd, w, dx, dw, self.bbuf("tmp", (C,), ad, xp), cols, N, C,
                       dy.dtype.itemsize == 8)
            g["w"] += dw
            return dx
        if use_gpu(dy2, xhat, rstd, w, dx.reshape(N, C), dw, outs=2, free=(rstd, dw)):
            fused_cuda_llama.rms_bwd(dy2, xhat, rstd, w, dx.reshape(N, C), dw, self._ws(xp))
            g["w"] += dw
            return dx
        t = self.bbuf("t", (N, C), ad, xp)
        xp.multiply(dy2, xhat, out=t, casting="unsafe")         # dy * xhat
        t.sum(axis=0, out=dw)
        g["w"] += dw
        gh = self.bbuf("gh", (N, C), ad, xp)
        xp.multiply(dy2, w, out=gh, casting="unsafe")           # gh = dy * w
        xp.multiply(gh, xhat, out=t, casting="unsafe")
        m = self.bbuf("m", (N, 1), ad, xp)
        t.mean(axis=1, keepdims=True, out=m)                    # mean(gh * xhat) per row
        xp.multiply(xhat, m, out=t, casting="unsafe")
        gh -= t
        gh *= rstd
        xp.copyto(dx.reshape(N, C), gh, casting="unsafe")
        return dx
