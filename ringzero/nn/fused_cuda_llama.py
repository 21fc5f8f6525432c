"""The Llama family's elementwise passes on a GPU: fused.c's RMSNorm, SwiGLU and rotary, as CuPy ElementwiseKernels.

What it is
    The device twin of fused.c's ``rms_fwd`` / ``rms_bwd`` / ``swiglu_fwd`` /
    ``swiglu_bwd``, written as ``fused_cuda.py`` writes the GPT's: the same
    Cephes ``expf``, the same roundings, ``--fmad=false``, and the sums laid
    out on threads in fused.c's order (a row sum on 8 threads, thread l taking
    elements l, l + 8, ... and the partials added in fused.c's tree; dw's
    column sum on 64 threads, thread g taking rows g, g + 64, ... and the 64
    partials added in order). So for float32 a device computes the host
    kernels' bits; float64's ``exp`` is each side's libm; float16 computes in
    float32 and rounds once per stored value (RMSNorm's x̂ rounded before the
    weight multiplies it, as transformers' ``LlamaRMSNorm`` does).

    Rotary (``rope``) works in place on the strided q|k heads of the q|k|v
    buffer: its two halves are the kernel's outputs, (B, T, n, D/2) views
    that CuPy indexes by their strides, and cos / sin (T, 1, D/2) broadcast
    over them. Each product is rounded to T before its sum, as fused.c's
    ``rope`` and the xp passes of nn/rotary.py round them: the same bits for
    every dtype (float16 through float32, once per product and once per sum,
    as NumPy computes float16).

    ``SOURCES`` joins ``fused_cuda._SOURCES`` on import (one table of kernels, one
    compiler cache, one NVRTC check in tests/gpu_api); ``rms_fwd``,
    ``rms_bwd``, ``swiglu_fwd`` and ``swiglu_bwd`` are the calls
    ``nn/rmsnorm.py`` and ``nn/swiglu.py`` make for CuPy arrays that
    ``fused.use_gpu`` takes, with the C path's arguments; ``rope`` is
    nn/rotary.py's, for the arrays ``rope_takes`` accepts.

What it is not
    Anything measured on a device yet: the CuPy stand-in runs these sources
    on the host (tests/test_fused_cuda_llama.py), launch/gpu-check on a GPU.
"""
from __future__ import annotations

from ringzero.nn import fused_cuda
from ringzero.nn.fused_cuda import LANES, ROWLANES
from ringzero.nn.ops import acc_dtype

# name: (in_params, out_params, operation), in fused_cuda.py's notation: T the arrays' dtype, Q the
# sums' (float32 under float16), R rstd's, A what T computes in; a "lane kernel" runs 8 threads per
# row (i = row * 8 + lane), a "column kernel" 64 threads per column (i = g * m + j).
SOURCES = {
    # RMSNorm forward, x (N, m). Lanes: sums of x^2 -> part (N*8,)
    "rz_rms_fwd_sum": ("raw T x, int64 m", "raw Q part", """
        long long r = i / 8, l = i % 8;
        const T *xr = &x[r * m];
        Q acc = (Q)0;
        for (long long j = l; j < m; j += 8) acc += (Q)xr[j] * (Q)xr[j];
        part[i] = acc"""),
    # per row: rstd = 1 / sqrt(mean(x^2) + eps)
    "rz_rms_fwd_rstd": ("raw Q part, int64 m, float64 eps", "raw R rstd", """
        rstd[i] = (R)((Q)1 / rz_sqrt(rz_tree8<Q>(&part[i * 8]) / (Q)m + (Q)eps))"""),
    # per element of (N, m): xhat = x rstd (rounded to T), y = xhat w
    "rz_rms_fwd_affine": ("T x, T w, raw R rstd, int64 m", "T xhat, T y", """
        typedef rz_acc<T>::type A;
        T h = (T)((A)x * (A)rstd[i / m]);
        xhat = h;
        y = (T)((A)h * (A)w)"""),
    # RMSNorm backward, lanes: dx = dy w (stored), lane sums of dx xhat -> part
    "rz_rms_bwd_sums": ("raw T dy, raw T xhat, raw T w, int64 m", "raw T dx, raw Q part", """
        long long r = i / 8, l = i % 8;
        const T *gr = &dy[r * m], *hr = &xhat[r * m];
        T *dr = &dx[r * m];
        Q acc = (Q)0;
        for (long long j = l; j < m; j += 8) {
            T d = (T)((Q)gr[j] * (Q)w[j]);
            dr[j] = d;
            acc += (Q)d * (Q)hr[j];
        }
        part[i] = acc"""),
    # per element: dx = (dx - xhat mean(dx xhat)) rstd
    "rz_rms_bwd_dx": ("T xhat, raw R rstd, raw Q part, int64 m", "T dx", """
        long long r = i / m;
        Q m2 = rz_tree8<Q>(&part[r * 8]) / (Q)m;
        dx = (T)(((Q)dx - (Q)xhat * m2) * (Q)rstd[r])"""),
    # column kernel: dw's partials, cw = sum over rows g, g + 64, ... of dy xhat
    "rz_rms_wgrad_part": ("raw T dy, raw T xhat, int64 rows, int64 m", "raw Q cw", """
        long long g = i / m, j = i % m;
        Q acc = (Q)0;
        for (long long r = g; r < rows; r += 64) acc += (Q)dy[r * m + j] * (Q)xhat[r * m + j];
        cw[i] = acc"""),
    # SwiGLU over gu (N, 2f) = [gate | up]: y (N, f) = (g s) u, s = 1 / (1 + exp(-g))
    "rz_swiglu_fwd": ("raw T gu, int64 f", "T y", """
        typedef rz_acc<T>::type A;
        long long r = i / f, j = i % f;
        A g = (A)gu[r * 2 * f + j], u = (A)gu[r * 2 * f + f + j];
        A s = (A)1 / ((A)1 + rz_exp(-g));
        y = (T)((g * s) * u)"""),
    # dgu (N, 2f) = [dg | du]: du = (g s) dy, dg = ((((1 - s) g) + 1) s) u dy; i over (N, f)
    "rz_swiglu_bwd": ("raw T gu, raw T dy, int64 f", "raw T dgu", """
        typedef rz_acc<T>::type A;
        long long r = i / f, j = i % f, o = r * 2 * f + j;
        A g = (A)gu[o], u = (A)gu[o + f], d = (A)dy[i];
        A s = (A)1 / ((A)1 + rz_exp(-g));
        dgu[o + f] = (T)((g * s) * d);
        dgu[o] = (T)(((((((A)1 - s) * g) + (A)1) * s) * u) * d)"""),
    # rotary in place on x1, x2 (B, T, n, D/2), the two halves of each head (strided views); c, s
    # (T, 1, D/2) broadcast. sign > 0: y1 = x1 c - x2 s, y2 = x2 c + x1 s; else the transpose
    # (s -> -s). Every product rounded to T before its sum, as fused.c's rope and the xp passes
    "rz_rope": ("T c, T s, int64 sign", "T x1, T x2", """
        typedef rz_acc<T>::type A;
        A a = (A)x1, b = (A)x2;
        A ac = (A)(T)(a * (A)c), bs = (A)(T)(b * (A)s), bc = (A)(T)(b * (A)c), as_ = (A)(T)(a * (A)s);
        if (sign > 0) { x1 = (T)(ac - bs); x2 = (T)(bc + as_); }
        else          { x1 = (T)(ac + bs); x2 = (T)(bc - as_); }"""),
}
fused_cuda._SOURCES.update(SOURCES)         # one table: fused_cuda._k builds them, tests/gpu_api compiles them
_k = fused_cuda._k


def rms_fwd(x, w, y, xhat, rstd, eps, ws):
    """x, y, xhat (N, C); w (C,); rstd (N, 1) in the sums' dtype; ws(name, shape, dtype): scratch."""
    N, C = x.shape
    part = ws("g_part", (N * LANES,), acc_dtype(x.dtype))
    _k("rz_rms_fwd_sum")(x, C, part, size=N * LANES)
    _k("rz_rms_fwd_rstd")(part, C, float(eps), rstd, size=N)
    _k("rz_rms_fwd_affine")(x, w, rstd, C, xhat, y)


def rms_bwd(dy, xhat, rstd, w, dx, dw, ws):
    """dx (N, C) from dy; dw (C,) = the column sums of dy xhat (written, not added)."""
    N, C = dy.shape
    q = acc_dtype(dy.dtype)
    part = ws("g_part", (N * LANES,), q)
    _k("rz_rms_bwd_sums")(dy, xhat, w, C, dx, part, size=N * LANES)
    _k("rz_rms_bwd_dx")(xhat, rstd, part, C, dx)
    cw = ws("g_cw", (ROWLANES, C), q)
    _k("rz_rms_wgrad_part")(dy, xhat, N, C, cw, size=ROWLANES * C)
    _k("rz_fold_rows")(cw, dw)


def swiglu_fwd(gu, y):
    """y (..., F) = silu(gate) * up of gu (..., 2F)."""
    _k("rz_swiglu_fwd")(gu, y.shape[-1], y)


def swiglu_bwd(gu, dy, dgu):
    """dgu (..., 2F) = [dgate | dup] from dy (..., F)."""
    _k("rz_swiglu_bwd")(gu, dy, dy.shape[-1], dgu, size=dy.size)


def rope_takes(x, cos, sin) -> bool:
    """True when ``rope`` takes x (B, T, n, D), a CuPy view in float16/32/64, and its tables cos, sin
    (T, 1, D/2), C-contiguous in x's dtype. The tables are the layer's own arrays: they never share
    x's memory. x may be strided (the q|k columns of q|k|v): CuPy indexes each output by its strides."""
    if type(x).__module__.split(".")[0] != "cupy" or x.ndim != 4 or x.dtype not in fused_cuda._FLOATS:
        return False
    B, T, n, D = x.shape
    return all(type(t) is type(x) and t.dtype == x.dtype and t.flags.c_contiguous
               and t.shape == (T, 1, D // 2) for t in (cos, sin))


def rope(x, cos, sin, sign):
    """x (B, T, n, D) rotated in place by position (sign > 0) or back (sign < 0); see rz_rope."""
    h = x.shape[-1] // 2
    _k("rz_rope")(cos, sin, int(sign), x[..., :h], x[..., h:])
