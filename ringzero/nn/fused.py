"""The model's elementwise passes, one call each: the C kernels, or the same math in ``xp``.

What it is
    ``gelu_forward`` / ``gelu_backward`` (with the bias add of the GEMM before
    GELU, and that bias's gradient), ``bias_residual`` (y = (y + b) + x),
    ``layernorm_forward`` / ``layernorm_backward``, ``softmax_causal_`` /
    ``softmax_causal_backward_`` (the attention softmax with its scale and
    causal mask), ``cross_entropy_forward``, ``rows_add_at`` (the embedding
    gradient, ``np.add.at``'s sums in its order), ``rope_`` (rotary in place
    on heads that are columns of a larger buffer; the layer is rotary.py). Arrays are 2-D (rows, width)
    or, for the softmax, (R, T, T); every output is a buffer the caller owns.

    On NumPy float32/float64 arrays that are C-contiguous, the work is done by
    the optional C extension ``ringzero.nn._fused`` (ringzero/nn/csrc/fused.c):
    one pass over each row, reductions in a fixed order, single-threaded, so a
    run gives the same bits at every ZeRO stage and on every rank. On CuPy
    float16/32/64 arrays that are C-contiguous, the same kernels written as
    CuPy ElementwiseKernels do it (fused_cuda.py: for float32 the host's bits
    wherever no libm call differs). Everything else (float16 on the host,
    strided views, no compiler at install time, or ``RINGZERO_NO_C=1``) takes
    the ``xp`` formulas below, which keep their statistics in float32 under
    float16. The kernels and the formulas agree to float32 rounding, not
    bitwise: a run uses one of them throughout.

What it is not
    Layers (no caches, no parameter dicts: those are layers.py, norm.py and
    attention.py), and no GEMMs.
"""
from __future__ import annotations

import math
import os

import numpy as np

from ringzero.nn import fused_cuda
from ringzero.nn.ops import _take, acc_dtype, array_module

try:  # the optional C extension (setup.py, optional=True)
    from ringzero.nn import _fused as _c
except ImportError:  # no compiler at install time: the xp formulas do the work
    _c = None

_cuda = fused_cuda      # the device kernels (CuPy imported only when a CuPy array comes)

# RINGZERO_NO_C=1 forces the xp path on host and device (to compare, or to rule the kernels out).
if os.environ.get("RINGZERO_NO_C", "0") == "1":
    _c = _cuda = None

HAVE_C = _c is not None
ROWLANES = 64       # column sums: row i into partial i % 64, then the partials in order (fused.c)
GELU_K = math.sqrt(2.0 / math.pi)
GELU_A = 0.044715
_C_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def use_c(*arrays, outs=0) -> bool:
    """True when the C kernels take these arrays: host, one float32/float64 dtype, C-contiguous.

    The last ``outs`` arrays are written: each must not overlap any other
    (the kernels' pointers are ``restrict``); the NumPy path handles overlap.
    """
    if _c is None:
        return False
    n_in = len(arrays) - outs
    ins = [a for a in arrays[:n_in] if a is not None]
    ws = [a for a in arrays[n_in:] if a is not None]
    dt = (ins + ws)[0].dtype
    if not (dt in _C_DTYPES and all(type(a) is np.ndarray and a.dtype == dt and a.flags.c_contiguous
                                    for a in ins + ws)):
        return False
    return not any(np.may_share_memory(o, a) for i, o in enumerate(ws) for a in ins + ws[i + 1:])


def use_gpu(*arrays, outs=0, free=()) -> bool:
    """True when the CuPy kernels take these arrays (fused_cuda.takes)."""
    return _cuda is not None and _cuda.takes(*arrays, outs=outs, free=free)


def _dbl(a) -> bool:
    return a.dtype == np.float64


def _scratch(ws, name, shape, dtype, xp):
    return ws(name, shape, dtype) if ws is not None else xp.empty(shape, dtype)


def _gws(ws, a):
    """The device kernels' scratch (lane and column partials) from the caller's pool."""
    xp = array_module(a)
    return lambda name, shape, dtype: _scratch(ws, name, shape, dtype, xp)


# ---- GELU ----------------------------------------------------------------------
# 0.5 v (1 + tanh u) = v sigmoid(2u), u = k (v + a v^3): one exp and one division,
# and the backward needs only s = sigmoid(2u), which forward keeps:
#     d/dv = s + s (1 - s) 2k v (1 + 3a v^2)

def gelu_forward(x, y, s, b=None):
    """y (N, M) = gelu(v), v = x + b (b (M,) optional); s = sigmoid(2u). Returns True if b went into x.

    The C path leaves x alone (backward forms v = x + b again); the xp path
    adds b into x in place (x is then v), and says so.
    """
    N, M = x.shape
    if use_c(x, b, y, s, outs=2):
        _c.gelu_fwd(x, b, y, s, N, M, _dbl(x))
        return False
    if use_gpu(x, b, y, s, outs=2):
        _cuda.gelu_fwd(x, b, y, s)
        return False
    xp = array_module(x)
    if b is not None:
        x += b
    xp.multiply(x, x, out=s)
    s *= GELU_A
    s += 1.0
    s *= x
    s *= -2.0 * GELU_K
    if xp is np:
        with np.errstate(over="ignore"):                       # exp(-2u) = inf for very negative v: s = 0
            np.exp(s, out=s)
    else:
        xp.exp(s, out=s)
    s += 1.0
    xp.divide(1.0, s, out=s)
    xp.multiply(x, s, out=y)
    return b is not None


def gelu_backward(dy, x, s, dx, b=None, colsum=None, ws=None):
    """dx = dy * gelu'(v), v = x + b (b: None if forward folded it into x), from forward's s.

    All (N, M); colsum (M,) = dx summed over rows (in row order), if given.
    """
    N, M = x.shape
    if use_c(dy, x, b, s, dx, colsum, outs=2):
        cols = None if colsum is None else _scratch(ws, "cols", (ROWLANES, M), x.dtype, np)
        _c.gelu_bwd(dy, x, b, s, dx, colsum, cols, N, M, _dbl(x))
        return dx
    if use_gpu(dy, x, b, s, dx, colsum, outs=2, free=(colsum,)):
        _cuda.gelu_bwd(dy, x, b, s, dx, colsum, _gws(ws, x))
        return dx
    xp = array_module(x)
    v = x
    if b is not None:
        v = _scratch(ws, "v", x.shape, x.dtype, xp)
        xp.add(x, b, out=v)
    xp.multiply(v, v, out=dx)
    dx *= 3.0 * GELU_A
    dx += 1.0
    dx *= v
    dx *= 2.0 * GELU_K
    dx *= s
    t = _scratch(ws, "t", x.shape, x.dtype, xp)
    xp.subtract(1.0, s, out=t)
    dx *= t
    dx += s
    dx *= dy
    if colsum is not None:
        dx.sum(axis=0, dtype=colsum.dtype, out=colsum)
    return dx


def bias_residual(y, b, x):
    """y (N, M) = (y + b) + x: a GEMM's bias added with the residual, in one pass."""
    N, M = y.shape
    if use_c(y, b, x):
        _c.bias_residual(y, b, x, N, M, _dbl(y))
        return y
    if use_gpu(y, b, x):                                        # y in place, x may be y
        _cuda.bias_residual(y, b, x)
        return y
    array_module(y).add(y, b, out=y)
    y += x
    return y


# ---- LayerNorm -------------------------------------------------------------------

def layernorm_forward(x, w, b, y, xhat, rstd, eps, ws=None):
    """Per row of x (N, C): xhat = (x - mean) * rstd, rstd (N, 1) = 1/sqrt(var + eps); y = xhat w + b."""
    N, C = x.shape
    if use_c(x, w, b, y, xhat, rstd, outs=3):
        _c.ln_fwd(x, w, b, y, xhat, rstd, N, C, _dbl(x), eps)
        return y
    if use_gpu(x, w, b, y, xhat, rstd, outs=3, free=(rstd,)):
        _cuda.ln_fwd(x, w, b, y, xhat, rstd, eps, _gws(ws, x))
        return y
    xp = array_module(x)
    ad = acc_dtype(x.dtype)
    n1 = (N, 1)
    mean = x.mean(axis=1, dtype=ad, keepdims=True, out=_scratch(ws, "mean", n1, ad, xp))  # fp32 statistics
    xp.subtract(x, mean, out=xhat, casting="unsafe")
    sq = _scratch(ws, "sq", x.shape, ad, xp)                  # squares in fp32: fp16 overflows at 256^2
    xp.multiply(xhat, xhat, out=sq, dtype=ad)
    var = sq.mean(axis=1, dtype=ad, keepdims=True, out=_scratch(ws, "var", n1, ad, xp))
    xp.add(var, eps, out=rstd)
    xp.sqrt(rstd, out=rstd)
    xp.divide(1.0, rstd, out=rstd)
    xp.multiply(xhat, rstd, out=xhat, casting="unsafe")
    xp.multiply(xhat, w, out=y)
    y += b
    return y


def layernorm_backward(dy, xhat, rstd, w, dx, dw, db, ws=None):
    """dx (N, C) of a layernorm; dw, db (C,) are SET to this call's weight and bias gradients."""
    N, C = dy.shape
    if use_c(dy, xhat, rstd, w, dx, dw, db, outs=3):
        _c.ln_bwd(dy, xhat, rstd, w, dx, dw, db, _scratch(ws, "tmp", (C,), dy.dtype, np),
                  _scratch(ws, "cols", (2 * ROWLANES, C), dy.dtype, np), N, C, _dbl(dy))
        return dx
    if dw.dtype == db.dtype and use_gpu(dy, xhat, rstd, w, dx, dw, db, outs=3, free=(rstd, dw, db)):
        _cuda.ln_bwd(dy, xhat, rstd, w, dx, dw, db, _gws(ws, dy))
        return dx
    xp = array_module(dy)
    ad = acc_dtype(dy.dtype)
    dy.sum(axis=0, dtype=ad, out=db)
    t = _scratch(ws, "t", dy.shape, dy.dtype, xp)
    xp.multiply(dy, xhat, out=t)
    t.sum(axis=0, dtype=ad, out=dw)
    xp.multiply(dy, w, out=dx)                                  # dxhat = dy * w
    n1 = (N, 1)
    m1 = dx.mean(axis=1, dtype=ad, keepdims=True, out=_scratch(ws, "m1", n1, ad, xp))   # mean(dxhat)
    xp.multiply(dx, xhat, out=t)
    m2 = t.mean(axis=1, dtype=ad, keepdims=True, out=_scratch(ws, "m2", n1, ad, xp))    # mean(dxhat * xhat)
    # dx = rstd * (dxhat - m1 - xhat * m2)
    xp.multiply(xhat, m2, out=t, casting="unsafe")
    dx -= t
    xp.subtract(dx, m1, out=dx, casting="unsafe")
    xp.multiply(dx, rstd, out=dx, casting="unsafe")
    return dx


# ---- attention softmax -------------------------------------------------------------

_MASKS = {}


def _mask(T, dtype, xp):
    """(T, T): 0 on and below the diagonal, -inf above; one per (T, dtype, module)."""
    k = (T, np.dtype(dtype).str, xp.__name__)
    if k not in _MASKS:
        _MASKS[k] = xp.asarray(np.triu(np.full((T, T), -np.inf, dtype=dtype), 1))
    return _MASKS[k]


def softmax_causal_(att, scale, ws=None):
    """att (R, T, T) -> softmax(att * scale + causal mask) over the last axis, in place.

    The row sums are taken in float32 under float16 and rounded to att's dtype
    before the division. Entries above the diagonal come out as exact zeros.
    """
    R, T, _ = att.shape
    if use_c(att):
        _c.softmax_causal(att, R, T, _dbl(att), scale)
        return att
    if use_gpu(att):
        _cuda.softmax_causal(att, scale, _gws(ws, att))
        return att
    xp, dtype = array_module(att), att.dtype
    att *= scale
    att += _mask(T, dtype, xp)
    shape = (R, T, 1)
    mx = _scratch(ws, "mx", shape, dtype, xp)
    att.max(axis=-1, keepdims=True, out=mx)
    att -= mx
    xp.exp(att, out=att)
    ad = acc_dtype(dtype)
    s32 = _scratch(ws, "s32", shape, ad, xp)
    att.sum(axis=-1, dtype=ad, keepdims=True, out=s32)
    if ad != dtype:
        xp.copyto(mx, s32, casting="unsafe")                   # the sum rounded to att's dtype
        s32 = mx
    att /= s32
    return att


def softmax_causal_backward_(datt, att, scale, ws=None):
    """datt (R, T, T) <- att * (datt - sum(datt * att)) * scale: the gradient of the scores, in place."""
    R, T, _ = att.shape
    if use_c(att, datt, outs=1):
        _c.softmax_causal_bwd(datt, att, _scratch(ws, "tmp", (T,), att.dtype, np), R, T, _dbl(att), scale)
        return datt
    if use_gpu(att, datt, outs=1):
        _cuda.softmax_causal_bwd(datt, att, scale, _gws(ws, att))
        return datt
    xp, dtype = array_module(att), att.dtype
    prod = _scratch(ws, "prod", att.shape, dtype, xp)
    xp.multiply(datt, att, out=prod)
    ad = acc_dtype(dtype)
    rs = _scratch(ws, "rs", (R, T, 1), ad, xp)
    prod.sum(axis=-1, dtype=ad, keepdims=True, out=rs)
    if ad != dtype:
        r16 = _scratch(ws, "rs16", rs.shape, dtype, xp)
        xp.copyto(r16, rs, casting="unsafe")
        rs = r16
    datt -= rs
    datt *= att
    datt *= scale
    return datt


# ---- rotary ---------------------------------------------------------------------------

def _allocation(a):
    """The ndarray that owns a view's memory (a pool's flat buffer, or the array itself)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def rope_(x, cos, sin, sign) -> bool:
    """Rotary in place on the C kernel, if it takes x; returns whether it did (else the caller's xp path).

    x (B, T, n, D): heads of D side by side in rows of a larger buffer (the columns of q|k|v: strides
    (T·ld, ld, D, 1) elements), cos and sin (T, 1, D/2) C-contiguous in x's dtype. The kernel is handed
    the view's allocation and the view's byte offset in it, and checks that every row lies inside.
    """
    if _c is None or type(x) is not np.ndarray or x.dtype not in _C_DTYPES or x.ndim != 4:
        return False
    B, T, n, D = x.shape
    e = x.itemsize
    st = x.strides
    if not (x.flags.writeable and x.flags.aligned and st[3] == e and (n < 2 or st[2] == D * e)
            and st[1] % e == 0 and st[1] >= n * D * e and (B < 2 or st[0] == T * st[1])):
        return False
    if not all(type(t) is np.ndarray and t.dtype == x.dtype and t.flags.c_contiguous and t.size == T * (D // 2)
               for t in (cos, sin)):
        return False
    base = _allocation(x)
    if not (base.flags.c_contiguous and base.flags.writeable) or x.size == 0:
        return False
    off = x.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    _c.rope(base, off, cos, sin, B * T, T, st[1] // e, n, D, sign, _dbl(x))
    return True


# ---- embedding gradient ------------------------------------------------------------

def rows_add_at(g, ids, d):
    """g (V, C)[ids[i]] += d (N, C)[i] for i in order: np.add.at's result, bit for bit (host arrays).

    ids: int64 (N,), already range-checked (the embedding checks token ids on the host).
    """
    if use_c(d, g, outs=1) and ids.dtype == np.int64 and ids.flags.c_contiguous:
        _c.rows_add_at(g, ids, d, d.shape[0], g.shape[0], g.shape[1], _dbl(g))
        return g
    np.add.at(g, ids, d)
    return g


# ---- softmax cross-entropy -----------------------------------------------------------

def cross_entropy_forward(logits, targets, at, probs, nll, ws=None):
    """probs (N, V) = softmax(logits) in float32 (float64 for float64); nll (N,) per-row -log p[target].

    targets: int (N,), already range-checked; at (N,): the flat index i*V + t_i.
    """
    N, V = logits.shape
    if use_c(logits, probs, nll, outs=2) and probs.dtype == logits.dtype and at.dtype == np.int64:
        tg = _scratch(ws, "tg", (N,), np.int64, np)
        np.copyto(tg, targets, casting="unsafe")
        _c.ce_fwd(logits, tg, probs, nll, N, V, _dbl(logits))
        return nll
    if (probs.dtype == nll.dtype and targets.dtype.kind in "iu" and targets.flags.c_contiguous
            and use_gpu(logits, probs, nll, outs=2, free=(probs, nll))):
        _cuda.ce_fwd(logits, targets, probs, nll, _gws(ws, logits))
        return nll
    xp, ad = array_module(logits), probs.dtype
    xp.copyto(probs, logits)
    probs -= probs.max(axis=1, keepdims=True, out=_scratch(ws, "max", (N, 1), ad, xp))
    picked = _take(xp, probs.reshape(-1), at, _scratch(ws, "picked", (N,), ad, xp))  # shifted target logits
    xp.exp(probs, out=probs)
    s = probs.sum(axis=1, out=_scratch(ws, "s", (N,), ad, xp))
    xp.log(s, out=nll)
    nll -= picked
    probs /= s[:, None]
    return nll
