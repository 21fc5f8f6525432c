"""The elementwise layers: layernorm, GELU (tanh), residual, softmax cross-entropy.

What it is
    Each a ``Layer`` with ``forward(p, x) -> (y, cache)`` and
    ``backward(dy, cache, g) -> dx`` (the contract of ``ringzero.nn.layers``),
    whose arithmetic is one call into ``ringzero.nn.fused``: a single-pass C
    kernel on host float32/float64 arrays, the ``xp`` formulas otherwise.
    Two fusions reach across layers, both optional keywords:

    - ``GELU.forward(None, x, bias=b)`` takes the bias that the GEMM before it
      left out (``Linear.forward(..., bias=False)``), and
      ``GELU.backward(..., colsum=db)`` sums that bias's gradient on the way;
    - ``Residual.forward(None, (x, r), out=x, bias=b)`` is y = (x + b) + r,
      the bias of the GEMM that produced x added with the residual.

    Statistics (layernorm mean/var, softmax sums, the loss) accumulate in
    float32 even when the compute dtype is float16 (float64 stays float64).

What it is not
    No parameters of its own, no GEMMs (``ringzero.nn.base.Linear``), no
    attention (``ringzero.nn.attention``).
"""
from __future__ import annotations

import numpy as np

from ringzero.nn import fused
from ringzero.nn.base import Layer
from ringzero.nn.ops import _same_module, acc_dtype, array_module, check_ids

LN_EPS = 1e-5
GELU_K = fused.GELU_K
GELU_A = fused.GELU_A


class LayerNorm(Layer):
    """y = (x - mean) / sqrt(var + eps) * w + b over the last axis. p: w (C,), b (C,)."""

    def forward(self, p, x):
        w, b = p["w"], p["b"]
        xp = array_module(w)
        _same_module(xp, x, b)
        if x.shape[-1] != w.shape[0]:
            raise ValueError(f"layernorm expects width {w.shape[0]}, got x of shape {tuple(x.shape)}")
        C = x.shape[-1]
        x2 = x.reshape(-1, C)                                   # (N, C)
        xhat = self.buf("xhat", x2.shape, x.dtype, xp)
        rstd = self.buf("rstd", (x2.shape[0], 1), acc_dtype(x.dtype), xp)   # (N, 1) kept for backward
        y = self.buf("y", x.shape, x.dtype, xp)
        fused.layernorm_forward(x2, w, b, y.reshape(-1, C), xhat, rstd, LN_EPS, self._ws(xp))
        return y, (p, xhat, rstd)

    def backward(self, dy, cache, g):                           # dy (..., C)
        p, xhat, rstd = cache
        w = p["w"]
        xp = array_module(dy)
        C = w.shape[0]
        ad = acc_dtype(dy.dtype)
        dw, db = self.bbuf("dw", (C,), ad, xp), self.bbuf("db", (C,), ad, xp)
        dx = self.bbuf("dx", dy.shape, dy.dtype, xp)
        fused.layernorm_backward(dy.reshape(-1, C), xhat, rstd, w, dx.reshape(-1, C), dw, db, self._ws(xp))
        g["b"] += db
        g["w"] += dw
        return dx

    def _ws(self, xp):
        return lambda name, shape, dtype: self.bbuf(name, shape, dtype, xp)


class GELU(Layer):
    """y = 0.5 x (1 + tanh(k (x + a x^3))), k = sqrt(2/pi), a = 0.044715. No params.

    Computed as y = x sigmoid(2u), u = k (x + a x^3) (the same function:
    0.5 (1 + tanh u) = sigmoid(2u)); the cache is the input and s = sigmoid(2u),
    all that backward's one pass needs.

    ``forward(None, x, bias=b)``: the input is x + b (the GEMM before left the
    bias out). The C path reads x + b on the fly and leaves x as it is, so
    ``backward`` must be handed the same bias (``bias=``; read it from the
    parameter dict at backward time: stage 3 may have re-gathered it). The
    NumPy path adds b into x in place and then ignores the bias in backward.
    """

    def forward(self, p, x, bias=None):
        xp = array_module(x)
        M = x.shape[-1]
        if bias is not None:
            _same_module(xp, bias)
            if bias.shape != (M,):
                raise ValueError(f"gelu bias must have shape ({M},), got {tuple(bias.shape)}")
        y = self.buf("y", x.shape, x.dtype, xp)
        s = self.buf("s", x.shape, x.dtype, xp)                 # sigmoid(2u), kept for backward
        folded = fused.gelu_forward(x.reshape(-1, M), y.reshape(-1, M), s.reshape(-1, M), bias)
        return y, (x, s, bias is not None and not folded)      # third: backward must add the bias

    def backward(self, dy, cache, g, colsum=None, bias=None):
        """dx; with ``colsum`` (M,) given, also sets it to dx summed over rows (the bias gradient)."""
        x, s, wants_bias = cache
        if wants_bias and bias is None:
            raise ValueError("gelu backward needs the bias its forward was given (bias=...)")
        xp = array_module(dy)
        M = x.shape[-1]
        d = self.bbuf("dx", x.shape, x.dtype, xp)
        fused.gelu_backward(dy.reshape(-1, M), x.reshape(-1, M), s.reshape(-1, M), d.reshape(-1, M),
                            bias if wants_bias else None, colsum, self._ws(xp))
        return d

    def _ws(self, xp):
        return lambda name, shape, dtype: self.bbuf(name, shape, dtype, xp)


class Residual(Layer):
    """y = x + r. With out=x (or r) the add is in place. Backward: (dy, dy).

    ``bias`` (C,): x is a GEMM's output without its bias; y = (x + bias) + r in one pass.
    """

    def forward(self, p, xs, out=None, bias=None):
        x, r = xs
        xp = array_module(x)
        if x.shape != r.shape:
            raise ValueError(f"residual expects equal shapes, got {tuple(x.shape)} and {tuple(r.shape)}")
        y = out if out is not None else self.buf("y", x.shape, x.dtype, xp)
        if bias is None:
            xp.add(x, r, out=y)
            return y, None
        C = x.shape[-1]
        if y is not x:
            xp.copyto(y, x)
        fused.bias_residual(y.reshape(-1, C), bias, r.reshape(-1, C))
        return y, None

    def backward(self, dy, cache, g):
        return dy, dy


class SoftmaxCrossEntropy(Layer):
    """Mean cross-entropy of logits (N, V) against targets int (N,), fused with softmax.

    Forward returns the loss as a 0-d array (float32 or float64); backward's
    dy is the multiplier of d(loss) (the loss scale) and it returns dlogits
    in the logits' dtype. The probabilities live in a float32 buffer.
    """

    def forward(self, p, xs):
        logits, targets = xs
        xp = array_module(logits)
        _same_module(xp, targets)
        N, V = logits.shape
        if targets.shape != (N,) or targets.dtype.kind not in "iu":
            raise ValueError(f"targets must be integers of shape ({N},), got {targets.dtype} {tuple(targets.shape)}")
        if xp is np:                    # device targets: the caller checks them on the host
            check_ids(targets, V, "targets")
        ad = acc_dtype(logits.dtype)
        pr = self.buf("probs", (N, V), ad, xp)                  # (N, V) fp32 statistics
        at = self.buf("at", (N,), np.intp, xp)                  # flat index of each target: i*V + t_i
        xp.multiply(self._rows(xp, N), V, out=at)
        at += targets
        nll = self.bbuf("lse", (N,), ad, xp)                    # (N,) -log p[target] per row
        fused.cross_entropy_forward(logits, targets, at, pr, nll,
                                    lambda name, shape, dtype: self.bbuf(name, shape, dtype, xp))
        return nll.mean(), (pr, at, logits.dtype)

    def _rows(self, xp, N):
        """0..N-1 on xp, made once per (N, module)."""
        cache = self.__dict__.setdefault("_row_ids", {})
        k = (N, xp.__name__)
        if k not in cache:
            cache[k] = xp.arange(N)
        return cache[k]

    def backward(self, dy, cache, g):
        pr, at, dtype = cache
        xp = array_module(pr)
        N = pr.shape[0]
        k = float(dy) / N
        dl = self.buf("dlogits", pr.shape, dtype, xp)
        xp.multiply(pr, k, out=dl, casting="unsafe")           # (p - onehot) * dy / N
        dl.reshape(-1)[at] -= k                                 # one distinct target per row
        return dl
