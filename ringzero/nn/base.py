"""The layer plumbing every model layer builds on: the buffer ``Pool``, ``Layer``, ``Linear``.

What it is
    ``Pool``: activations and workspaces, one buffer per (tag, name, shape,
    dtype), made on first use and reused every step after, filled with
    ``out=`` forms. A cache therefore stays valid until the same layer's next
    forward. ``Pool(reuse=False)`` hands out fresh arrays (inference at
    varying shapes, tests). ``pool.allocs`` counts the buffers made.
    ``cache_nbytes``: the activation bytes a cache holds. ``Layer``: a pool
    and the tags naming a layer's buffers. ``Linear``: y = x @ w + b, the
    layer the others (attention, the MLP) are built from, so it lives here
    beside the base class rather than with the elementwise layers.

What it is not
    The rest of the layers: ``ringzero.nn.layers`` names them all (and
    re-exports these), ``ringzero.nn.pointwise`` holds the elementwise ones,
    ``ringzero.nn.attention`` the attention block.
"""
from __future__ import annotations

import numpy as np

from ringzero.nn import gemm
from ringzero.nn.ops import _same_module, acc_dtype, array_module


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
    todo = [cache]          # a stack, not a recursive closure: a closure naming itself is a reference
    while todo:             # cycle, garbage left for the cyclic collector at every unit of every step
        c = todo.pop()
        if c is None or isinstance(c, (dict, int, float, str)):
            continue                     # dicts are parameter views, not activations
        if isinstance(c, (tuple, list)):
            todo.extend(c)
        elif hasattr(c, "nbytes") and hasattr(c, "shape"):
            ptr = c.data.ptr if hasattr(c.data, "ptr") else c.__array_interface__["data"][0]
            seen[(ptr, c.nbytes)] = c.nbytes
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


class Linear(Layer):
    """y = x @ w + b. p: w (in, out), b (out,) or no "b" (no bias: Llama's); x (..., in) -> y (..., out).

    ``forward(..., bias=False)`` leaves the bias out of y for the caller to add
    in the next pass over y (GELU's, the residual's); ``backward(..., db=...)``
    takes the bias gradient that such a pass already summed (GELU's backward).
    """

    def forward(self, p, x, out=None, bias=True):
        w, b = p["w"], p.get("b")
        xp = array_module(w)
        _same_module(xp, x, *(() if b is None else (b,)))
        if x.shape[-1] != w.shape[0]:
            raise ValueError(f"linear expects input width {w.shape[0]}, got x of shape {tuple(x.shape)}")
        lead = x.shape[:-1]
        y = out if out is not None else self.buf("y", lead + (w.shape[1],), w.dtype, xp)
        y2 = y.reshape(-1, w.shape[1])                          # (N, out)
        gemm.matmul(x.reshape(-1, w.shape[0]), w, y2)
        if bias and b is not None:
            y2 += b
        return y, (p, x)

    def backward(self, dy, cache, g, db=None):                  # dy (..., out); db (out,) if summed already
        p, x = cache
        w = p["w"]
        xp = array_module(dy)
        n_in, n_out = w.shape
        x2, dy2 = x.reshape(-1, n_in), dy.reshape(-1, n_out)    # (N, in), (N, out)
        dw = self.bbuf("dw", w.shape, w.dtype, xp)
        gemm.matmul(x2.T, dy2, dw)
        g["w"] += dw
        if g.get("b") is not None:
            if db is None:
                ad = acc_dtype(dy.dtype)
                db = dy2.sum(axis=0, dtype=ad, out=self.bbuf("db", (n_out,), ad, xp))
            g["b"] += db
        dx = self.bbuf("dx", x.shape, x.dtype, xp)
        gemm.matmul(dy2, w.T, dx.reshape(-1, n_in))
        return dx
