"""The model's elementwise passes on a GPU: fused.c's kernels, as CuPy ElementwiseKernels.

What it is
    The device twin of ``ringzero/nn/csrc/fused.c``: GELU forward/backward
    (with the bias add before it and the bias gradient), the bias + residual
    add, LayerNorm forward/backward (with its weight and bias gradients), the
    attention softmax with its scale and causal mask and its backward, and
    softmax + cross-entropy; the Llama family's RMSNorm and SwiGLU join the
    same table when fused_cuda_llama.py is imported. ``ringzero.nn.fused`` calls these for
    CuPy arrays (``takes``), as it calls the C kernels for NumPy ones.

    Each kernel is written in fused.c's order of operations: the same Cephes
    ``expf`` polynomial, the same roundings, and ``--fmad=false`` (NVRTC
    contracts ``a * b + c`` into one FMA by default; fused.c is built with
    ``-ffp-contract=off``). The sums are laid out on threads in fused.c's own
    order, so a device sums what the host sums:

    - a row sum (LayerNorm's mean and variance, the softmax's max and sum)
      runs on 8 threads per row, thread l taking elements l, l + 8, ... in
      order (fused.c's 8 lanes), the 8 partials then added in fused.c's tree
      by the next kernel. Adjacent threads read adjacent elements: a warp
      reads 4 rows x 32 contiguous bytes per step;
    - a column sum (the bias and LayerNorm weight gradients) runs on 64
      threads per column, thread g taking rows g, g + 64, ... in order
      (fused.c's 64 row lanes), the 64 partials then added in order;
    - the elementwise passes (GELU, bias + residual, LayerNorm's affine and
      dx) run one thread per element.

    So for float32 a kernel computes the host C kernel's bits wherever both
    use only + - * / and sqrt (IEEE on both). ``logf`` (the cross-entropy)
    and float64's ``exp``/``log`` come from each side's libm, which may differ
    in the last bit. float16 arrays compute in float32 and round once per
    stored value. A pass is 1-5 launches (a partials kernel, then the ones
    that use them) against the ``xp`` formulas' 5-12 ufuncs and full-size
    temporaries; the partials live in the caller's pool.

What it is not
    Block-per-row kernels with shared-memory trees (fewer launches, but
    another summation order than the host's), or anything measured on a
    device yet. The CuPy stand-in (tests/cupy_standin) compiles these same
    sources with the host's C++ compiler, which checks their source and
    arithmetic, not their speed; the gpu-api group compiles them with NVRTC.
"""
from __future__ import annotations

import numpy as np

from ringzero.nn.ops import acc_dtype

_FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
LANES, ROWLANES = 8, 64     # fused.c's lanes per row sum, and row lanes per column sum

# Shared device code. Template parameters are not named T: CuPy puts its
# placeholder typedefs (typedef float T;) above the preamble.
_PREAMBLE = r"""
#define RZ_GELU_K 0.7978845608028654
#define RZ_GELU_A 0.044715
template <class E> struct rz_acc { typedef E type; };
template <> struct rz_acc<float16> { typedef float type; };

/* fused.c's rz_expf: Cephes' polynomial, clamped, the same roundings in the same order */
__device__ __forceinline__ float rz_exp(float x) {
    x = x > 88.0f ? 88.0f : x;
    x = x < -87.0f ? -87.0f : x;
    float fx = x * 1.44269504088896341f + 12582912.0f;
    fx = fx - 12582912.0f;
    float r = x - fx * 0.693359375f;
    r = r - fx * -2.12194440e-4f;
    float z = r * r;
    float a = 5.0000001201e-1f + 1.6666665459e-1f * r;
    float b = 4.1665795894e-2f + 8.3334519073e-3f * r;
    float c = 1.3981999507e-3f + 1.9875691500e-4f * r;
    float p = (a + b * z) + c * (z * z);
    p = p * z + r;
    p = p + 1.0f;
    int n = (int)fx;
    return p * __int_as_float((int)((unsigned int)(n + 127) << 23));
}
__device__ __forceinline__ double rz_exp(double x) { return exp(x); }
__device__ __forceinline__ float rz_log(float x) { return logf(x); }
__device__ __forceinline__ double rz_log(double x) { return log(x); }
__device__ __forceinline__ float rz_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double rz_sqrt(double x) { return sqrt(x); }

/* fused.c's tree over one row's 8 lane partials p[0..7] */
template <class Acc>
__device__ __forceinline__ Acc rz_tree8(const Acc *p) {
    return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
}

/* the largest of the lane maxima of lanes 0..min(8, k)-1 (the others saw no element) */
template <class Acc>
__device__ __forceinline__ Acc rz_max8(const Acc *p, long long k) {
    Acc mx = p[0];
    for (int q = 1; q < 8 && q < k; q++) mx = p[q] > mx ? p[q] : mx;
    return mx;
}
"""

# GELU's bodies, written once; %s is v, the input with or without the bias
_GELU_FWD = """
        typedef rz_acc<T>::type A;
        A v = %s;
        A m2u = ((((v * v) * (A)RZ_GELU_A + (A)1) * v) * (A)(-2.0 * RZ_GELU_K));
        A sg = (A)1 / ((A)1 + rz_exp(m2u));
        s = (T)sg;
        y = (T)(v * sg)"""
_GELU_BWD = """
        typedef rz_acc<T>::type A;
        A v = %s, sv = (A)s;
        A d = (((v * v) * (A)(3.0 * RZ_GELU_A) + (A)1) * v) * (A)(2.0 * RZ_GELU_K);
        d = ((d * sv) * ((A)1 - sv)) + sv;
        dx = (T)(d * (A)dy)"""

# name: (in_params, out_params, operation). T: the arrays' dtype; Q, R, W, P: float32 under float16,
# else T (partials, statistics, gradients); A: what T computes in. A "lane kernel" runs 8 threads
# per row, i = row * 8 + lane, lane l taking the elements j = l, l + 8, ... in order (fused.c's
# lane_sum); a "column kernel" 64 threads per column, i = g * m + j, taking rows g, g + 64, ...
_SOURCES = {
    # y = v s, s = sigmoid(2u), v = x + b, u = k (v + a v^3)        (element i of (N, M); b broadcast (M,))
    "rz_gelu_fwd_bias": ("T x, T b", "T y, T s", _GELU_FWD % "(A)x + (A)b"),
    "rz_gelu_fwd": ("T x", "T y, T s", _GELU_FWD % "(A)x"),
    # dx = dy (s + s (1 - s) 2k v (1 + 3a v^2))
    "rz_gelu_bwd_bias": ("T dy, T x, T b, T s", "T dx", _GELU_BWD % "(A)x + (A)b"),
    "rz_gelu_bwd": ("T dy, T x, T s", "T dx", _GELU_BWD % "(A)x"),
    # column kernel: cols[g, j] = sum of d[r, j] over rows r = g, g + 64, ...      (d (rows, m), cols (64, m))
    "rz_colsum_part": ("raw T d, int64 rows, int64 m", "raw Q cols", """
        long long g = i / m, j = i % m;
        Q acc = (Q)0;
        for (long long r = g; r < rows; r += 64) acc += (Q)d[r * m + j];
        cols[i] = acc"""),
    # out[j] = the 64 partials of column j added in order                          (cols (64, m), out (m,))
    "rz_fold_rows": ("raw Q cols", "W out", """
        long long m = _ind.size();
        Q acc = (Q)0;
        for (int g = 0; g < 64; g++) acc += cols[g * m + i];
        out = (W)acc"""),
    # y = (y + b) + x                                                 (element i of (N, M); b broadcast (M,))
    "rz_bias_residual": ("T b, T x", "T y", """
        typedef rz_acc<T>::type A;
        y = (T)((((A)y + (A)b)) + (A)x)"""),
    # LayerNorm forward, x (N, m): lane sums of x -> part (N*8,)
    "rz_ln_fwd_sum": ("raw T x, int64 m", "raw Q part", """
        long long r = i / 8, l = i % 8;
        const T *xr = &x[r * m];
        Q acc = (Q)0;
        for (long long j = l; j < m; j += 8) acc += (Q)xr[j];
        part[i] = acc"""),
    # lanes: xhat = x - mean (stored), lane sums of its squares -> part2
    "rz_ln_fwd_center": ("raw T x, raw Q part, int64 m", "raw T xhat, raw Q part2", """
        long long r = i / 8, l = i % 8;
        const T *xr = &x[r * m];
        T *hr = &xhat[r * m];
        Q mean = rz_tree8<Q>(&part[r * 8]) / (Q)m, acc = (Q)0;
        for (long long j = l; j < m; j += 8) {
            T h = (T)((Q)xr[j] - mean);
            hr[j] = h;
            acc += (Q)h * (Q)h;
        }
        part2[i] = acc"""),
    # per row: rstd = 1 / sqrt(var + eps)
    "rz_ln_fwd_rstd": ("raw Q part2, int64 m, float64 eps", "raw R rstd", """
        Q var = rz_tree8<Q>(&part2[i * 8]) / (Q)m;
        rstd[i] = (R)((Q)1 / rz_sqrt(var + (Q)eps))"""),
    # per element of (N, m): xhat *= rstd, y = xhat w + b
    "rz_ln_fwd_affine": ("T w, T b, raw R rstd, int64 m", "T xhat, T y", """
        typedef rz_acc<T>::type A;
        A h = (A)xhat * (A)rstd[i / m];
        xhat = (T)h;
        y = (T)(h * (A)w + (A)b)"""),
    # LayerNorm backward, lanes: dx = dy w (stored), lane sums of dx and of dx xhat -> part, part2
    "rz_ln_bwd_sums": ("raw T dy, raw T xhat, raw T w, int64 m", "raw T dx, raw Q part, raw Q part2", """
        long long r = i / 8, l = i % 8;
        const T *gr = &dy[r * m], *hr = &xhat[r * m];
        T *dr = &dx[r * m];
        Q s1 = (Q)0, s2 = (Q)0;
        for (long long j = l; j < m; j += 8) {
            T d = (T)((Q)gr[j] * (Q)w[j]);
            dr[j] = d;
            s1 += (Q)d;
            s2 += (Q)d * (Q)hr[j];
        }
        part[i] = s1;
        part2[i] = s2"""),
    # per element: dx = ((dx - xhat m2) - m1) rstd, m1 = mean(dx), m2 = mean(dx xhat) of its row
    "rz_ln_bwd_dx": ("T xhat, raw R rstd, raw Q part, raw Q part2, int64 m", "T dx", """
        long long r = i / m;
        Q m1 = rz_tree8<Q>(&part[r * 8]) / (Q)m, m2 = rz_tree8<Q>(&part2[r * 8]) / (Q)m;
        dx = (T)((((Q)dx - (Q)xhat * m2) - m1) * (Q)rstd[r])"""),
    # column kernel: the weight and bias gradients' partials, cw = sum dy xhat, cb = sum dy
    "rz_ln_wgrad_part": ("raw T dy, raw T xhat, int64 rows, int64 m", "raw Q cw, raw Q cb", """
        long long g = i / m, j = i % m;
        Q sw = (Q)0, sb = (Q)0;
        for (long long r = g; r < rows; r += 64) {
            Q d = (Q)dy[r * m + j];
            sb += d;
            sw += d * (Q)xhat[r * m + j];
        }
        cw[i] = sw;
        cb[i] = sb"""),
    # causal softmax, att (R*tn, tn), row t = r % tn keeps j <= t. Lanes: max of (att * scale)
    "rz_softmax_max": ("raw T att, int64 tn, float64 scale", "raw Q part", """
        long long r = i / 8, l = i % 8, k = r % tn + 1;
        const T *a = &att[r * tn];
        Q sc = (Q)scale, mx = (Q)0;
        for (long long j = l; j < k; j += 8) {
            Q v = (Q)(T)((Q)a[j] * sc);
            mx = (j == l || v > mx) ? v : mx;
        }
        part[i] = mx"""),
    # lanes: att = exp(att * scale - max) on j <= t (stored), 0 above; lane sums -> part2
    "rz_softmax_exp": ("raw Q part, int64 tn, float64 scale", "raw T att, raw Q part2", """
        long long r = i / 8, l = i % 8, k = r % tn + 1;
        T *a = &att[r * tn];
        Q sc = (Q)scale, mx = rz_max8<Q>(&part[r * 8], k), acc = (Q)0;
        for (long long j = l; j < tn; j += 8) {
            if (j < k) {
                T e = (T)rz_exp((Q)(T)((Q)a[j] * sc) - mx);
                a[j] = e;
                acc += (Q)e;
            } else {
                a[j] = (T)(Q)0;
            }
        }
        part2[i] = acc"""),
    # lanes: att /= the row's sum on j <= t
    "rz_softmax_div": ("raw Q part2, int64 tn", "raw T att", """
        long long r = i / 8, l = i % 8, k = r % tn + 1;
        T *a = &att[r * tn];
        Q s = rz_tree8<Q>(&part2[r * 8]);
        for (long long j = l; j < k; j += 8) a[j] = (T)((Q)a[j] / s)"""),
    # softmax backward, lanes: sums of datt att on j <= t -> part
    "rz_softmax_bwd_sum": ("raw T att, raw T datt, int64 tn", "raw Q part", """
        long long r = i / 8, l = i % 8, k = r % tn + 1;
        const T *a = &att[r * tn], *d = &datt[r * tn];
        Q acc = (Q)0;
        for (long long j = l; j < k; j += 8) acc += (Q)d[j] * (Q)a[j];
        part[i] = acc"""),
    # lanes: datt = ((datt - sum) att) scale on j <= t, 0 above
    "rz_softmax_bwd": ("raw T att, raw Q part, int64 tn, float64 scale", "raw T datt", """
        long long r = i / 8, l = i % 8, k = r % tn + 1;
        const T *a = &att[r * tn];
        T *d = &datt[r * tn];
        Q s = rz_tree8<Q>(&part[r * 8]), sc = (Q)scale;
        for (long long j = l; j < tn; j += 8) d[j] = j < k ? (T)((((Q)d[j] - s) * (Q)a[j]) * sc) : (T)(Q)0"""),
    # softmax + cross-entropy, logits (N, V). Lanes: max of the logits
    "rz_ce_max": ("raw T logits, int64 V", "raw P part", """
        long long r = i / 8, l = i % 8;
        const T *lr = &logits[r * V];
        P mx = (P)0;
        for (long long j = l; j < V; j += 8) {
            P v = (P)lr[j];
            mx = (j == l || v > mx) ? v : mx;
        }
        part[i] = mx"""),
    # lanes: probs = exp(l - max) (stored), lane sums -> part2
    "rz_ce_exp": ("raw T logits, raw P part, int64 V", "raw P probs, raw P part2", """
        long long r = i / 8, l = i % 8;
        const T *lr = &logits[r * V];
        P *pr = &probs[r * V];
        P mx = rz_max8<P>(&part[r * 8], V), acc = (P)0;
        for (long long j = l; j < V; j += 8) {
            P e = rz_exp((P)lr[j] - mx);
            pr[j] = e;
            acc += e;
        }
        part2[i] = acc"""),
    # lanes: probs /= sum; lane 0: nll = log(sum) - (l[target] - max)
    "rz_ce_norm": ("raw T logits, raw I tgt, raw P part, raw P part2, int64 V", "raw P probs, raw P nll", """
        long long r = i / 8, l = i % 8;
        P *pr = &probs[r * V];
        P s = rz_tree8<P>(&part2[r * 8]);
        for (long long j = l; j < V; j += 8) pr[j] = pr[j] / s;
        if (l == 0) {
            P mx = rz_max8<P>(&part[r * 8], V);
            nll[r] = rz_log(s) - ((P)logits[r * V + (long long)tgt[r]] - mx);
        }"""),
}

_KERNELS = {}


def _k(name):
    """The named kernel, built once per process (CuPy compiles it per dtype combination and caches that)."""
    if name not in _KERNELS:
        import cupy
        ins, outs, op = _SOURCES[name]
        _KERNELS[name] = cupy.ElementwiseKernel(ins, outs, op, name, preamble=_PREAMBLE,
                                                options=("--fmad=false",))
    return _KERNELS[name]


def _span(a):
    p = a.data.ptr
    return p, p + a.nbytes


def takes(*arrays, outs=0, free=()) -> bool:
    """True when these kernels take the arrays: CuPy, float16/32/64, C-contiguous, outputs overlapping nothing.

    The arrays share one dtype (the kernels' T), except those also listed in
    ``free`` (float statistics and gradients: rstd, dw, probs). None entries
    (optional arguments) are skipped; the last ``outs`` arrays are written.
    """
    given = [(k >= len(arrays) - outs, a) for k, a in enumerate(arrays) if a is not None]
    if not given or type(given[0][1]).__module__.split(".")[0] != "cupy":
        return False
    loose = {id(a) for a in free}
    dt = next((a.dtype for _, a in given if id(a) not in loose), None)
    for _, a in given:
        if type(a).__module__.split(".")[0] != "cupy" or a.dtype not in _FLOATS or not a.flags.c_contiguous:
            return False
        if id(a) not in loose and a.dtype != dt:
            return False
    spans = [(w, _span(a)) for w, a in given]
    for k, (w, (lo, hi)) in enumerate(spans):
        if w and any(lo < h2 and lo2 < hi for j, (_, (lo2, h2)) in enumerate(spans) if j != k):
            return False
    return True


# ---- the calls fused.py makes (the C path's arguments; ws(name, shape, dtype): scratch buffers) ------

def gelu_fwd(x, b, y, s):
    if b is None:
        _k("rz_gelu_fwd")(x, y, s)
    else:
        _k("rz_gelu_fwd_bias")(x, b, y, s)


def gelu_bwd(dy, x, b, s, dx, colsum, ws):
    if b is None:
        _k("rz_gelu_bwd")(dy, x, s, dx)
    else:
        _k("rz_gelu_bwd_bias")(dy, x, b, s, dx)
    if colsum is not None:
        N, M = dx.shape
        cols = ws("g_cols", (ROWLANES, M), acc_dtype(dx.dtype))
        _k("rz_colsum_part")(dx, N, M, cols, size=ROWLANES * M)
        _k("rz_fold_rows")(cols, colsum)


def bias_residual(y, b, x):
    _k("rz_bias_residual")(b, x, y)


def ln_fwd(x, w, b, y, xhat, rstd, eps, ws):
    N, C = x.shape
    q = acc_dtype(x.dtype)
    part, part2 = ws("g_part", (N * LANES,), q), ws("g_part2", (N * LANES,), q)
    _k("rz_ln_fwd_sum")(x, C, part, size=N * LANES)
    _k("rz_ln_fwd_center")(x, part, C, xhat, part2, size=N * LANES)
    _k("rz_ln_fwd_rstd")(part2, C, float(eps), rstd, size=N)
    _k("rz_ln_fwd_affine")(w, b, rstd, C, xhat, y)


def ln_bwd(dy, xhat, rstd, w, dx, dw, db, ws):
    N, C = dy.shape
    q = acc_dtype(dy.dtype)
    part, part2 = ws("g_part", (N * LANES,), q), ws("g_part2", (N * LANES,), q)
    _k("rz_ln_bwd_sums")(dy, xhat, w, C, dx, part, part2, size=N * LANES)
    _k("rz_ln_bwd_dx")(xhat, rstd, part, part2, C, dx)
    cw, cb = ws("g_cw", (ROWLANES, C), q), ws("g_cb", (ROWLANES, C), q)
    _k("rz_ln_wgrad_part")(dy, xhat, N, C, cw, cb, size=ROWLANES * C)
    _k("rz_fold_rows")(cw, dw)
    _k("rz_fold_rows")(cb, db)


def softmax_causal(att, scale, ws):
    R, T, _ = att.shape
    q = acc_dtype(att.dtype)
    part, part2 = ws("g_part", (R * T * LANES,), q), ws("g_part2", (R * T * LANES,), q)
    _k("rz_softmax_max")(att, T, float(scale), part, size=R * T * LANES)
    _k("rz_softmax_exp")(part, T, float(scale), att, part2, size=R * T * LANES)
    _k("rz_softmax_div")(part2, T, att, size=R * T * LANES)


def softmax_causal_bwd(datt, att, scale, ws):
    R, T, _ = att.shape
    part = ws("g_part", (R * T * LANES,), acc_dtype(att.dtype))
    _k("rz_softmax_bwd_sum")(att, datt, T, part, size=R * T * LANES)
    _k("rz_softmax_bwd")(att, part, T, float(scale), datt, size=R * T * LANES)


def ce_fwd(logits, targets, probs, nll, ws):
    N, V = logits.shape
    part, part2 = ws("g_part", (N * LANES,), probs.dtype), ws("g_part2", (N * LANES,), probs.dtype)
    _k("rz_ce_max")(logits, V, part, size=N * LANES)
    _k("rz_ce_exp")(logits, part, V, probs, part2, size=N * LANES)
    _k("rz_ce_norm")(logits, targets, part, part2, V, probs, nll, size=N * LANES)
