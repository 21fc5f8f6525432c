"""Rotary position embeddings in Hugging Face's layout, with Llama 3's rescaling: forward and backward by hand.

What it is
    ``inv_freq(head_dim, theta, scaling)``: the D/2 inverse frequencies,
    computed in float32 exactly as transformers computes them (the default
    rule ``theta ** (-2j/D)``, and ``rope_type: llama3``'s rescaling when
    ``scaling`` is a ``RopeScaling``). ``Rotary``: a layer that rotates the
    heads of q or k IN PLACE::

        forward(x)              x (B, T, n, D) view (e.g. columns of the qkv buffer); returns x rotated
        backward(dx)            dx (B, T, n, D) view; rotated back in place (the transpose)

    HF's layout (``rotate_half``): dimension j of a head is paired with
    j + D/2, so with x1 = x[..., :D/2], x2 = x[..., D/2:] and angle t·f_j
    at position t::

        y1 = x1 cos - x2 sin        y2 = x2 cos + x1 sin

    and the backward is the inverse rotation (sin -> -sin). On host float32/64
    heads laid side by side in rows (the q|k|v buffer's columns), fused.c's
    ``rope`` does it in one pass with no scratch, each product rounded before
    its sum as the xp passes below round them: the same bits. On CuPy arrays
    fused_cuda_llama.py's ``rz_rope`` does the same, on the strided views. The cos/sin tables
    (T, D/2) are made once per (dtype, module), and again only for a longer T: angles in float32 as
    transformers takes them (position * inv_freq), cos and sin rounded to the
    compute dtype.

What it is not
    No position offsets (no KV cache): positions are 0..T-1. No partial
    rotary factor, no other rope_type than the default and llama3.
"""
from __future__ import annotations

import math

import numpy as np

from ringzero.nn import fused, fused_cuda_llama
from ringzero.nn.base import Layer
from ringzero.nn.ops import array_module


def inv_freq(head_dim: int, theta: float, scaling=None) -> np.ndarray:
    """(D/2,) float32 inverse frequencies (transformers' _compute_default / _compute_llama3_parameters)."""
    D = int(head_dim)
    f = (1.0 / (np.float32(theta) ** (np.arange(0, D, 2, dtype=np.float32) / np.float32(D)))).astype(np.float32)
    if scaling is None:
        return f
    old = scaling.original_max_position
    lo, hi = scaling.low_freq_factor, scaling.high_freq_factor
    wavelen = (np.float32(2 * math.pi) / f).astype(np.float32)
    scaled = np.where(wavelen > old / lo, f / np.float32(scaling.factor), f).astype(np.float32)
    smooth = ((np.float32(old) / wavelen - np.float32(lo)) / np.float32(hi - lo)).astype(np.float32)
    smoothed = ((1 - smooth) * scaled / np.float32(scaling.factor) + smooth * scaled).astype(np.float32)
    medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
    return np.where(medium, smoothed, scaled).astype(np.float32)


class Rotary(Layer):
    """Rotates (B, T, n, D) head views in place by position; see the module docstring."""

    def __init__(self, head_dim: int, theta: float, scaling=None, pool=None, tag: str = "", btag: str | None = None):
        super().__init__(pool, tag, btag)
        if head_dim % 2:
            raise ValueError(f"rotary needs an even head_dim, got {head_dim}")
        self.D = int(head_dim)
        self.f = inv_freq(head_dim, theta, scaling)           # (D/2,) float32
        self._tables = {}

    def tables(self, T, dtype, xp):
        """cos, sin (T, 1, D/2) in dtype: views of one table per (dtype, module), made again only
        for a longer T (generation grows T one token at a time: one table, not one per length)."""
        key = (np.dtype(dtype).str, xp.__name__)
        have = self._tables.get(key)
        if have is None or have[0].shape[0] < T:
            ang = np.arange(T, dtype=np.float32)[:, None] * self.f[None, :]    # (T, D/2) float32, as HF
            self._tables[key] = tuple(xp.asarray(a.astype(dtype)[:, None, :]) for a in (np.cos(ang), np.sin(ang)))
        cos, sin = self._tables[key]
        return cos[:T], sin[:T]

    def _rotate(self, x, sign):
        B, T, n, D = x.shape
        if D != self.D:
            raise ValueError(f"rotary expects head_dim {self.D}, got x of shape {tuple(x.shape)}")
        xp = array_module(x)
        cos, sin = self.tables(T, x.dtype, xp)
        if fused.rope_(x, cos, sin, sign):                     # one pass, no scratch: the same bits
            return x
        if fused_cuda_llama.rope_takes(x, cos, sin):           # the device twin: the same bits
            fused_cuda_llama.rope(x, cos, sin, sign)
            return x
        h = D // 2
        x1, x2 = x[..., :h], x[..., h:]                         # (B, T, n, D/2) views
        t1 = self.bbuf("t1", (B, T, n, h), x.dtype, xp)
        t2 = self.bbuf("t2", (B, T, n, h), x.dtype, xp)
        xp.multiply(x2, sin, out=t1)                            # x2 sin
        xp.multiply(x1, sin, out=t2)                            # x1 sin
        x1 *= cos
        x2 *= cos
        if sign > 0:                # forward: y1 = x1 cos - x2 sin, y2 = x2 cos + x1 sin
            x1 -= t1
            x2 += t2
        else:                       # backward (the transpose): dx1 = d1 cos + d2 sin, dx2 = d2 cos - d1 sin
            x1 += t1
            x2 -= t2
        return x

    def forward(self, x):
        return self._rotate(x, +1)

    def backward(self, dx):
        return self._rotate(dx, -1)
