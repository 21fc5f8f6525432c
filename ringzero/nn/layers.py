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
    call helpers in ``ringzero.nn.ops``.
    Statistics (layernorm mean/var, softmax sums, the loss) accumulate in
    float32 even when the compute dtype is float16 (float64 stays float64).

Hot path
    Activations and workspaces come from a ``Pool``: one buffer per (tag, name,
    shape, dtype), made on first use and reused every step after, filled with
    ``out=`` forms. A cache therefore stays valid until the same layer's next
    forward. ``Pool(reuse=False)`` hands out fresh arrays (inference at
    varying shapes, tests). ``pool.allocs`` counts the buffers made.

What it is not
    No autograd, no parameter allocation, no loss scaling (the caller passes
    the scale as ``dy`` of the loss), no communication.
"""
from __future__ import annotations

import math

import numpy as np

from ringzero.nn.ops import (_same_module, _take, acc_dtype, array_module, bmm,  # noqa: F401
                            check_ids, segment_sum_rows)

LN_EPS = 1e-5
GELU_K = math.sqrt(2.0 / math.pi)
GELU_A = 0.044715


class Pool:
    """Buffers made once per (key, shape, dtype) and handed out again after."""

    def __init__(self, reuse: bool = True):
        self.reuse = reuse
        self.bufs = {}
        self.allocs = 0        # arrays made by get(), reused or not

    def get(self, key, shape, dtype, xp=np):
        shape = tuple(int(s) for s in shape)
        if not self.reuse:
            self.allocs += 1
            return xp.empty(shape, dtype)
        k = (key, shape, np.dtype(dtype).str, xp.__name__)
        b = self.bufs.get(k)
        if b is None:
            b = self.bufs[k] = xp.empty(shape, dtype)
            self.allocs += 1
        return b

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.bufs.values())

    def clear(self):
        self.bufs.clear()


def cache_nbytes(cache) -> int:
    """Bytes of activation arrays a cache holds (parameter dicts not counted).

    Arrays are counted once each, by their data pointer, so a buffer referenced
    from two places is not double-counted.
    """
    seen = {}

    def walk(c):
        if c is None or isinstance(c, (dict, int, float, str)):
            return                       # dicts are parameter views, not activations
        if isinstance(c, (tuple, list)):
            for e in c:
                walk(e)
            return
        if hasattr(c, "nbytes") and hasattr(c, "shape"):
            ptr = c.data.ptr if hasattr(c.data, "ptr") else c.__array_interface__["data"][0]
            seen[(ptr, c.nbytes)] = c.nbytes
    walk(cache)
    return sum(seen.values())


class Layer:
    """Common plumbing: a pool, and the tags that name this layer's buffers.

    ``tag`` names buffers a cache refers to (activations). ``btag`` names
    workspaces that live only inside one call (all backward buffers, forward
    scratch), so layers at the same place in different blocks may share them.
    """

    def __init__(self, pool: Pool | None = None, tag: str = "", btag: str | None = None):
        self.pool = pool if pool is not None else Pool(reuse=False)
        self.tag = tag
        self.btag = tag if btag is None else btag

    def buf(self, name, shape, dtype, xp):
        return self.pool.get((self.tag, name), shape, dtype, xp)

    def bbuf(self, name, shape, dtype, xp):
        return self.pool.get((self.btag, name), shape, dtype, xp)


class Embedding(Layer):
    """Token + position embedding. p: wte (V, C), wpe (Tmax, C); x: idx int (B, T).

    Token ids are range-checked here only when they are host (NumPy) arrays:
    on a device the check would be a blocking reduction every step, so the
    caller checks the tokens on the host, where they start
    (``ringzero.nn.gpt.check_tokens``; CuPy's take would wrap a bad id).

    The gradient of ``wte`` is a sum over repeated token ids. ``grad_sum``
    picks how: "add_at" (NumPy's np.add.at: rows added one by one in token
    order, the CPU default) or "segmented" (``segment_sum_rows``: ids sorted
    stably, each row's sum accumulated in float64 in that order and rounded
    once; no atomics, so bitwise the same on every run; the device default).
    None means the default for the array module.
    """
    grad_sum = None

    def forward(self, p, idx):
        wte, wpe = p["wte"], p["wpe"]
        xp = array_module(wte)
        _same_module(xp, idx, wpe)
        if idx.ndim != 2 or idx.dtype.kind not in "iu":
            raise TypeError(f"embedding expects integer idx of shape (B, T), got {idx.dtype} {tuple(idx.shape)}")
        B, T = idx.shape
        V, C = wte.shape
        if T > wpe.shape[0]:
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
        y += wpe[:T]
        return y, (p, ids)

    def backward(self, dy, cache, g):                           # dy (B, T, C)
        p, idx = cache
        xp = array_module(dy)
        B, T, C = dy.shape
        g["wpe"][:T] += dy.sum(axis=0, dtype=acc_dtype(dy.dtype), out=self.bbuf("dwpe", (T, C), acc_dtype(dy.dtype), xp))
        how = self.grad_sum or ("add_at" if xp is np else "segmented")
        if how == "add_at":
            np.add.at(g["wte"], idx, dy.reshape(B * T, C))
        else:
            segment_sum_rows(g["wte"], idx, dy.reshape(B * T, C), self)
        return None


class Linear(Layer):
    """y = x @ w + b. p: w (in, out), b (out,); x (..., in) -> y (..., out)."""

    def forward(self, p, x, out=None):
        w, b = p["w"], p["b"]
        xp = array_module(w)
        _same_module(xp, x, b)
        if x.shape[-1] != w.shape[0]:
            raise ValueError(f"linear expects input width {w.shape[0]}, got x of shape {tuple(x.shape)}")
        lead = x.shape[:-1]
        y = out if out is not None else self.buf("y", lead + (w.shape[1],), w.dtype, xp)
        y2 = y.reshape(-1, w.shape[1])                          # (N, out)
        xp.matmul(x.reshape(-1, w.shape[0]), w, out=y2)
        y2 += b
        return y, (p, x)

    def backward(self, dy, cache, g):                           # dy (..., out)
        p, x = cache
        w = p["w"]
        xp = array_module(dy)
        n_in, n_out = w.shape
        x2, dy2 = x.reshape(-1, n_in), dy.reshape(-1, n_out)    # (N, in), (N, out)
        dw = self.bbuf("dw", w.shape, w.dtype, xp)
        xp.matmul(x2.T, dy2, out=dw)
        g["w"] += dw
        g["b"] += dy2.sum(axis=0, dtype=acc_dtype(dy.dtype), out=self.bbuf("db", (n_out,), acc_dtype(dy.dtype), xp))
        dx = self.bbuf("dx", x.shape, x.dtype, xp)
        xp.matmul(dy2, w.T, out=dx.reshape(-1, n_in))
        return dx


class Unembed(Layer):
    """Tied head: logits = x @ w.T. p: w (V, C) (the token embedding); x (N, C) -> (N, V)."""

    def forward(self, p, x):
        w = p["w"]
        xp = array_module(w)
        _same_module(xp, x)
        if x.shape[-1] != w.shape[1]:
            raise ValueError(f"unembed expects input width {w.shape[1]}, got x of shape {tuple(x.shape)}")
        y = self.buf("y", x.shape[:-1] + (w.shape[0],), w.dtype, xp)
        xp.matmul(x.reshape(-1, w.shape[1]), w.T, out=y.reshape(-1, w.shape[0]))
        return y, (p, x)

    def backward(self, dy, cache, g):                           # dy (N, V)
        p, x = cache
        w = p["w"]
        xp = array_module(dy)
        V, C = w.shape
        x2, dy2 = x.reshape(-1, C), dy.reshape(-1, V)
        dw = self.bbuf("dw", w.shape, w.dtype, xp)
        xp.matmul(dy2.T, x2, out=dw)                            # (V, C)
        g["w"] += dw
        dx = self.bbuf("dx", x.shape, x.dtype, xp)
        xp.matmul(dy2, w, out=dx.reshape(-1, C))
        return dx


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
        ad = acc_dtype(x.dtype)
        n1 = (x2.shape[0], 1)
        mean = x2.mean(axis=1, dtype=ad, keepdims=True, out=self.bbuf("mean", n1, ad, xp))  # (N, 1) fp32 statistics
        xhat = self.buf("xhat", x2.shape, x.dtype, xp)
        xp.subtract(x2, mean, out=xhat, casting="unsafe")
        sq = self.bbuf("sq", x2.shape, ad, xp)                  # squares in fp32: fp16 overflows at 256^2
        xp.multiply(xhat, xhat, out=sq, dtype=ad)
        var = sq.mean(axis=1, dtype=ad, keepdims=True, out=self.bbuf("var", n1, ad, xp))
        rstd = self.buf("rstd", n1, ad, xp)                     # (N, 1) 1/sqrt(var + eps), kept for backward
        xp.add(var, LN_EPS, out=rstd)
        xp.sqrt(rstd, out=rstd)
        xp.divide(1.0, rstd, out=rstd)
        xp.multiply(xhat, rstd, out=xhat, casting="unsafe")
        y = self.buf("y", x.shape, x.dtype, xp)
        y2 = y.reshape(-1, C)
        xp.multiply(xhat, w, out=y2)
        y2 += b
        return y, (p, xhat, rstd)

    def backward(self, dy, cache, g):                           # dy (..., C)
        p, xhat, rstd = cache
        w = p["w"]
        xp = array_module(dy)
        C = w.shape[0]
        dy2 = dy.reshape(-1, C)
        ad = acc_dtype(dy.dtype)
        db = self.bbuf("db", (C,), ad, xp)
        g["b"] += dy2.sum(axis=0, dtype=ad, out=db)
        t = self.bbuf("t", dy2.shape, dy.dtype, xp)
        xp.multiply(dy2, xhat, out=t)
        g["w"] += t.sum(axis=0, dtype=ad, out=db)
        dxhat = self.bbuf("dx", dy.shape, dy.dtype, xp)
        d2 = dxhat.reshape(-1, C)
        xp.multiply(dy2, w, out=d2)                             # dxhat = dy * w
        n1 = (d2.shape[0], 1)
        m1 = d2.mean(axis=1, dtype=ad, keepdims=True, out=self.bbuf("m1", n1, ad, xp))   # mean(dxhat)
        xp.multiply(d2, xhat, out=t)
        m2 = t.mean(axis=1, dtype=ad, keepdims=True, out=self.bbuf("m2", n1, ad, xp))    # mean(dxhat * xhat)
        # dx = rstd * (dxhat - m1 - xhat * m2)
        xp.multiply(xhat, m2, out=t, casting="unsafe")
        d2 -= t
        xp.subtract(d2, m1, out=d2, casting="unsafe")
        xp.multiply(d2, rstd, out=d2, casting="unsafe")
        return dxhat


class GELU(Layer):
    """y = 0.5 x (1 + tanh(k (x + a x^3))), k = sqrt(2/pi), a = 0.044715. No params."""

    def forward(self, p, x):
        xp = array_module(x)
        t = self.buf("t", x.shape, x.dtype, xp)                  # tanh(...), kept for backward
        xp.multiply(x, x, out=t)
        t *= GELU_A
        t += 1.0
        t *= x
        t *= GELU_K
        xp.tanh(t, out=t)
        y = self.buf("y", x.shape, x.dtype, xp)
        xp.add(t, 1.0, out=y)
        y *= x
        y *= 0.5
        return y, (x, t)

    def backward(self, dy, cache, g):
        x, t = cache
        xp = array_module(dy)
        # d/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) k (1 + 3a x^2)
        d = self.bbuf("dx", x.shape, x.dtype, xp)
        s = self.bbuf("s", x.shape, x.dtype, xp)
        xp.multiply(x, x, out=d)
        d *= 3.0 * GELU_A * GELU_K
        d += GELU_K
        d *= x
        xp.multiply(t, t, out=s)
        xp.subtract(1.0, s, out=s)
        d *= s
        d += t
        d += 1.0
        d *= 0.5
        d *= dy
        return d


class Residual(Layer):
    """y = x + r. With out=x (or r) the add is in place. Backward: (dy, dy)."""

    def forward(self, p, xs, out=None):
        x, r = xs
        xp = array_module(x)
        if x.shape != r.shape:
            raise ValueError(f"residual expects equal shapes, got {tuple(x.shape)} and {tuple(r.shape)}")
        y = out if out is not None else self.buf("y", x.shape, x.dtype, xp)
        xp.add(x, r, out=y)
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
        xp.copyto(pr, logits)
        pr -= pr.max(axis=1, keepdims=True, out=self.bbuf("max", (N, 1), ad, xp))
        at = self.buf("at", (N,), np.intp, xp)                  # flat index of each target: i*V + t_i
        xp.multiply(self._rows(xp, N), V, out=at)
        at += targets
        picked = _take(xp, pr.reshape(-1), at, self.bbuf("picked", (N,), ad, xp))  # (N,) shifted target logits
        xp.exp(pr, out=pr)
        s = pr.sum(axis=1, out=self.bbuf("s", (N,), ad, xp))     # (N,)
        lse = xp.log(s, out=self.bbuf("lse", (N,), ad, xp))
        lse -= picked
        loss = lse.mean()
        pr /= s[:, None]
        return loss, (pr, at, logits.dtype)

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


# Defined in its own module (the longest layer); re-exported so that
# ``ringzero.nn.layers`` still names every layer. Imported last: attention.py
# builds on Layer and Linear above.
from ringzero.nn.attention import CausalSelfAttention  # noqa: E402,F401
