"""SwiGLU (Shazeer 2020; Llama's MLP activation): y = silu(gate) * up, forward and backward by hand.

What it is
    ``SwiGLU``: the elementwise step between the MLP's two GEMMs. The first
    GEMM writes gate and up side by side, ``gu`` (..., 2F) with columns
    [gate | up] (the layout of ``h{i}.mlp.w``), and this layer reads both
    halves as views::

        forward(None, gu)        gu (..., 2F) -> y (..., F) = silu(g) * u, silu(g) = g * sigmoid(g)
        backward(dy, cache, g)   -> dgu (..., 2F): dg = dy * u * s * (1 + g (1 - s)), du = dy * silu(g)

    The cache is gu itself (the GEMM's output buffer); backward recomputes
    s = sigmoid(g) rather than keeping an F-wide buffer per block.

    On C-contiguous float32/float64 host arrays the C extension's kernels do
    each direction in one pass over a row (fused.c's swiglu_fwd / swiglu_bwd,
    the same formulas in the same order, its own expf: agreeing with these
    passes to float32 rounding, as fused.py's kernels do); on CuPy arrays
    ``fused.use_gpu`` takes, fused_cuda_llama.py's twins of them; elsewhere the
    xp passes below.

What it is not
    No parameters.
"""
from __future__ import annotations

from ringzero.nn import fused_cuda_llama
from ringzero.nn.base import Layer
from ringzero.nn.fused import _c, use_c, use_gpu
from ringzero.nn.ops import array_module


class SwiGLU(Layer):
    """y = silu(gate) * up over gu = [gate | up] (..., 2F)."""

    def _sigmoid(self, g, xp, name):
        s = self.bbuf(name, g.shape, g.dtype, xp)
        xp.negative(g, out=s)
        xp.exp(s, out=s)
        s += 1
        xp.divide(1.0, s, out=s)                                # 1 / (1 + e^-g)
        return s

    def forward(self, p, gu):
        xp = array_module(gu)
        F2 = gu.shape[-1]
        if F2 % 2:
            raise ValueError(f"swiglu expects [gate | up] of even width, got {tuple(gu.shape)}")
        F = F2 // 2
        y = self.buf("y", gu.shape[:-1] + (F,), gu.dtype, xp)
        if use_c(gu, y, outs=1):
            _c.swiglu_fwd(gu, y, gu.size // F2, F, gu.dtype.itemsize == 8)
            return y, (gu,)
        if use_gpu(gu, y, outs=1):
            fused_cuda_llama.swiglu_fwd(gu, y)
            return y, (gu,)
        g, u = gu[..., :F], gu[..., F:]
        s = self._sigmoid(g, xp, "s")
        xp.multiply(g, s, out=y)                                # silu(g)
        y *= u
        return y, (gu,)

    def backward(self, dy, cache, g_unused=None):              # dy (..., F)
        (gu,) = cache
        xp = array_module(dy)
        F = gu.shape[-1] // 2
        dgu = self.bbuf("dgu", gu.shape, gu.dtype, xp)
        if use_c(gu, dy, dgu, outs=1):
            _c.swiglu_bwd(gu, dy, dgu, dy.size // F, F, gu.dtype.itemsize == 8)
            return dgu
        if use_gpu(gu, dy, dgu, outs=1):
            fused_cuda_llama.swiglu_bwd(gu, dy, dgu)
            return dgu
        g, u = gu[..., :F], gu[..., F:]
        s = self._sigmoid(g, xp, "s")
        dg, du = dgu[..., :F], dgu[..., F:]
        xp.multiply(g, s, out=du)                               # silu(g)
        du *= dy                                                # du = dy * silu(g)
        # dsilu/dg = s + g s (1 - s) = s (1 + g (1 - s))
        xp.subtract(1, s, out=dg)
        dg *= g
        dg += 1
        dg *= s
        dg *= u
        dg *= dy
        return dgu
