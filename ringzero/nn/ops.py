"""Array-module helpers the layers share; each works on NumPy and on CuPy.

What it is
    ``array_module`` / ``acc_dtype``: which module an array belongs to, and
    the dtype statistics accumulate in. ``check_ids``: the host-side range
    check of token ids and targets. ``segment_sum_rows``: g[ids[i]] += d[i]
    without atomics, the same bits on every run (the embedding gradient on a
    GPU). ``bmm``: one cuBLAS strided-batched GEMM with fp32 accumulation on
    contiguous 3-D CuPy arrays (the attention products on a GPU).

What it is not
    Layers: no parameters, no caches. The forward/backward pairs are in
    layers.py and attention.py.
"""
from __future__ import annotations

import numpy as np


def array_module(x):
    """numpy, or cupy for a cupy array (without importing cupy otherwise)."""
    if type(x).__module__.split(".")[0] == "cupy":
        import cupy
        return cupy
    return np


def acc_dtype(dtype):
    """Dtype that statistics accumulate in: float64 stays, anything else float32."""
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


def _same_module(xp, *arrays):
    for a in arrays:
        if array_module(a) is not xp:
            raise TypeError(f"mixed array modules: expected {xp.__name__} arrays, got {type(a).__module__}."
                            f"{type(a).__name__}; move data with the backend's staging, not implicitly")




def check_ids(ids, n, what):
    """Host check that integer ids lie in [0, n): one line naming the range found."""
    if not isinstance(ids, np.ndarray):
        raise TypeError(f"{what}: expected a host (NumPy) array to check, got {type(ids).__module__}."
                        f"{type(ids).__name__}; HINT: check tokens before moving them to the device")
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= n):
        raise ValueError(f"{what} must lie in [0, {n}), got range [{int(ids.min())}, {int(ids.max())}]")


def segment_sum_rows(g, ids, d, layer=None):
    """g[ids[i]] += d[i] for every i, deterministically; written once for NumPy and CuPy.

    g (V, C), ids int (N,), d (N, C). Repeated ids are summed without atomics:
    the ids are sorted by the unique key id*N + i (so the order is the stable
    one whatever sort the array module uses), the rows of d are taken in that
    order and prefix-summed in float64 (one scan, a fixed order), and each
    occurrence i gets its row's total P[hi(i)] - P[lo(i)]. g's row plus that
    total is rounded to g's dtype once and written at every occurrence: the
    duplicates write identical bits, so which write lands does not matter.
    Workspaces come from ``layer``'s pool when given (no per-step allocation
    of the (N, C) buffers).
    """
    xp = array_module(g)
    _same_module(xp, ids, d)
    N, C = d.shape
    if N == 0:
        return g

    def get(name, shape, dt):
        return layer.bbuf(name, shape, dt, xp) if layer is not None else xp.empty(shape, dt)
    key = get("seg.key", (N,), np.int64)
    xp.multiply(ids, N, out=key, casting="unsafe")
    key += xp.arange(N, dtype=np.int64)                       # unique keys: one order only
    order = xp.argsort(key)                                   # (N,)
    s = get("seg.ids", (N,), ids.dtype)
    _take(xp, ids, order, s)                                  # sorted ids
    ds = get("seg.rows", (N, C), d.dtype)
    _take(xp, d, order, ds)                                   # rows of d in sorted order
    P = get("seg.prefix", (N + 1, C), np.float64)            # P[j]: sum of the first j sorted rows
    P[0] = 0
    xp.cumsum(ds, axis=0, dtype=np.float64, out=P[1:])        # one scan, float64, a fixed order
    lo = xp.searchsorted(s, s, side="left")                   # first and one-past-last position
    hi = xp.searchsorted(s, s, side="right")                  # of each position's id
    tot, tmp = get("seg.total", (N, C), np.float64), get("seg.tmp", (N, C), np.float64)
    _take(xp, P, hi, tot)
    tot -= _take(xp, P, lo, tmp)                              # each position: its id's whole sum
    tot += _take(xp, g, s, ds if g.dtype == d.dtype else get("seg.g", (N, C), g.dtype))
    out = ds if g.dtype == d.dtype else get("seg.g", (N, C), g.dtype)
    xp.copyto(out, tot, casting="unsafe")                     # rounded once
    g[s] = out                                                # duplicates write the same bits
    return g


def _take(xp, a, idx, out):
    """out[...] = a[idx] along axis 0 (NumPy: mode="clip" writes straight into out)."""
    if xp is np:
        return np.take(a, idx, axis=0, out=out, mode="clip")
    return xp.take(a, idx, axis=0, out=out)


_BLAS = {}     # dtype char -> (cuda data type, compute type, alpha=1, beta=0 as host scalars)


def bmm(a, b, out, ta=False, tb=False):
    """out[i] = op(a[i]) @ op(b[i]) for contiguous 3-D CuPy arrays, one cuBLAS call.

    op is a transpose where ta/tb say so. float16 operands are multiplied with
    float32 accumulation (CUBLAS_COMPUTE_32F), float32 in float32, float64 in
    float64; out is written in place, nothing is allocated. cuBLAS is
    column-major, and a row-major (r, c) matrix is its transpose in column
    major, so out^T = op(b)^T op(a)^T is the call with b first.
    """
    import cupy
    from cupy.cuda import cublas
    for n, t in (("a", a), ("b", b), ("out", out)):
        if t.ndim != 3 or not t.flags.c_contiguous or t.dtype != out.dtype:
            raise ValueError(f"bmm: expected {n} contiguous 3-D {out.dtype}, got {t.dtype} {t.shape} "
                             f"contiguous={t.flags.c_contiguous}")
    batch, M, N = out.shape
    K = a.shape[1] if ta else a.shape[2]
    if (a.shape[2] if ta else a.shape[1]) != M or (b.shape[2] if tb else b.shape[1]) != K \
            or (b.shape[1] if tb else b.shape[2]) != N or a.shape[0] != batch or b.shape[0] != batch:
        raise ValueError(f"bmm: shapes {a.shape}{'^T' if ta else ''} @ {b.shape}{'^T' if tb else ''} "
                         f"do not give {out.shape}")
    ch = out.dtype.char
    if ch not in _BLAS:
        # enum values from library_types.h / cublas_api.h, in case a build does not export a name
        c = lambda mod, name, v: getattr(mod, name, v)     # noqa: E731
        rt = cupy.cuda.runtime
        dt, ct, st = {"e": (c(rt, "CUDA_R_16F", 2), c(cublas, "CUBLAS_COMPUTE_32F", 68), np.float32),
                      "f": (c(rt, "CUDA_R_32F", 0), c(cublas, "CUBLAS_COMPUTE_32F", 68), np.float32),
                      "d": (c(rt, "CUDA_R_64F", 1), c(cublas, "CUBLAS_COMPUTE_64F", 70), np.float64)}[ch]
        ops = (c(cublas, "CUBLAS_OP_N", 0), c(cublas, "CUBLAS_OP_T", 1), c(cublas, "CUBLAS_GEMM_DEFAULT", -1))
        _BLAS[ch] = (dt, ct, np.ones(1, st), np.zeros(1, st), ops)   # host scalars, alive for good
    dt, ct, one, zero, (opn, opt, algo) = _BLAS[ch]
    cublas.gemmStridedBatchedEx(
        cupy.cuda.get_cublas_handle(), opt if tb else opn, opt if ta else opn, N, M, K,
        one.ctypes.data, b.data.ptr, dt, b.shape[2], b.shape[1] * b.shape[2],
        a.data.ptr, dt, a.shape[2], a.shape[1] * a.shape[2],
        zero.ctypes.data, out.data.ptr, dt, N, M * N, batch, ct, algo)
    return out
