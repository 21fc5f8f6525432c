"""The model's elementwise passes on a GPU: fused.c's kernels, as CuPy ElementwiseKernels.

What it is
    The device twin of ``ringzero/nn/csrc/fused.c``: GELU forward/backward
    (with the bias add before it and the bias gradient), the bias + residual
    add, LayerNorm forward/backward (with its weight and bias gradients), the
    attention softmax with its scale and causal mask and its backward, and
    softmax + cross-entropy. ``ringzero.nn.fused`` calls these for CuPy arrays
    (``takes``), as it calls the C kernels for NumPy ones; one call per pass
    instead of the 5-12 ufunc launches and full-size temporaries of the ``xp``
    formulas.

    Each kernel is written in fused.c's order of operations: the same Cephes
    ``expf`` polynomial, the same 8-lane row sums combined in the same tree,
    column sums over rows in row order, and ``--fmad=false`` (NVRTC contracts
    ``a * b + c`` into one FMA by default; fused.c is built with
    ``-ffp-contract=off``). So for float32 a kernel computes what the host's C
    kernel computes, bit for bit, wherever both use only + - * / and sqrt (IEEE
    on both). ``logf`` (the cross-entropy) and float64's ``exp``/``log`` come
    from each side's libm, which may differ in the last bit.

    Layout: elementwise passes (GELU, bias + residual) run one thread per
    element. Row passes (LayerNorm, softmax, cross-entropy) run one thread per
    row over the whole row, and column sums one thread per column, so the
    reduction order is the host's. float16 arrays compute in float32 and round
    once per stored value.

What it is not
    Warp-per-row kernels with shuffle reductions (faster on long rows, but in
    another summation order), or anything measured on a device yet. The CuPy
    stand-in (tests/cupy_standin) compiles these same sources with the host's
    C++ compiler, which checks their source and arithmetic, not their speed.
"""
from __future__ import annotations

import numpy as np

_FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))

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

/* sum of (Acc) u[j] * v[j] (or of u[j] when v is null), j < n: element j to lane j % 8, fixed tree */
template <class Acc, class E, class F>
__device__ Acc rz_sum8(const E *u, const F *v, long long n) {
    Acc a[8];
    for (int l = 0; l < 8; l++) a[l] = (Acc)0;
    long long j = 0;
    for (; j + 8 <= n; j += 8)
        for (int l = 0; l < 8; l++) a[l] += v ? (Acc)u[j + l] * (Acc)v[j + l] : (Acc)u[j + l];
    for (int l = 0; j < n; j++, l++) a[l] += v ? (Acc)u[j] * (Acc)v[j] : (Acc)u[j];
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

/* max of u[j], j < n (n >= 1), in 8 lanes like the host (max is exact in any order) */
template <class Acc, class E>
__device__ Acc rz_max8(const E *u, long long n) {
    Acc a[8];
    for (int l = 0; l < 8; l++) a[l] = (Acc)u[0];
    long long j = 0;
    for (; j + 8 <= n; j += 8)
        for (int l = 0; l < 8; l++) a[l] = (Acc)u[j + l] > a[l] ? (Acc)u[j + l] : a[l];
    for (int l = 0; j < n; j++, l++) a[l] = (Acc)u[j] > a[l] ? (Acc)u[j] : a[l];
    Acc mx = a[0];
    for (int l = 1; l < 8; l++) mx = a[l] > mx ? a[l] : mx;
    return mx;
}
"""

_NOV = "(const float *)0"        # rz_sum8's v when it is a plain sum

# name: (in_params, out_params, operation). T: the arrays' dtype; A: what they compute in.
_SOURCES = {
    # y = v s, s = sigmoid(2u), v = x + b, u = k (v + a v^3)        (element i of (N, M); b broadcast (M,))
    "rz_gelu_fwd_bias": ("T x, T b", "T y, T s", """
        typedef rz_acc<T>::type A;
        A v = (A)x + (A)b;
        A m2u = ((((v * v) * (A)RZ_GELU_A + (A)1) * v) * (A)(-2.0 * RZ_GELU_K));
        A sg = (A)1 / ((A)1 + rz_exp(m2u));
        s = (T)sg;
        y = (T)(v * sg)"""),
    "rz_gelu_fwd": ("T x", "T y, T s", """
        typedef rz_acc<T>::type A;
        A v = (A)x;
        A m2u = ((((v * v) * (A)RZ_GELU_A + (A)1) * v) * (A)(-2.0 * RZ_GELU_K));
        A sg = (A)1 / ((A)1 + rz_exp(m2u));
        s = (T)sg;
        y = (T)(v * sg)"""),
    # dx = dy (s + s (1 - s) 2k v (1 + 3a v^2))
    "rz_gelu_bwd_bias": ("T dy, T x, T b, T s", "T dx", """
        typedef rz_acc<T>::type A;
        A v = (A)x + (A)b, sv = (A)s;
        A d = (((v * v) * (A)(3.0 * RZ_GELU_A) + (A)1) * v) * (A)(2.0 * RZ_GELU_K);
        d = ((d * sv) * ((A)1 - sv)) + sv;
        dx = (T)(d * (A)dy)"""),
    "rz_gelu_bwd": ("T dy, T x, T s", "T dx", """
        typedef rz_acc<T>::type A;
        A v = (A)x, sv = (A)s;
        A d = (((v * v) * (A)(3.0 * RZ_GELU_A) + (A)1) * v) * (A)(2.0 * RZ_GELU_K);
        d = ((d * sv) * ((A)1 - sv)) + sv;
        dx = (T)(d * (A)dy)"""),
    # colsum[i] = sum over rows r (in order) of d[r, i]; one thread per column     (d (rows, M), colsum (M,))
    "rz_colsum": ("raw T d, int64 rows", "S colsum", """
        typedef rz_acc<S>::type A;
        long long M = _ind.size();
        A acc = (A)0;
        for (long long r = 0; r < rows; r++) acc += (A)d[r * M + i];
        colsum = (S)acc"""),
    # y = (y + b) + x                                                 (element i of (N, M); b broadcast (M,))
    "rz_bias_residual": ("T b, T x", "T y", """
        typedef rz_acc<T>::type A;
        y = (T)((((A)y + (A)b)) + (A)x)"""),
    # row i of x (N, m): xhat = (x - mean) rstd, rstd = 1/sqrt(var + eps); y = xhat w + b
    "rz_ln_fwd": ("raw T x, raw T w, raw T b, int64 m, float64 eps", "raw T y, raw T xhat, raw R rstd", """
        typedef rz_acc<T>::type A;
        const T *xr = &x[i * m];
        T *hr = &xhat[i * m], *yr = &y[i * m];
        A mean = rz_sum8<A>(xr, """ + _NOV + """, m) / (A)m;
        for (long long j = 0; j < m; j++) hr[j] = (T)((A)xr[j] - mean);
        A var = rz_sum8<A>(hr, hr, m) / (A)m;
        A rs = (A)1 / rz_sqrt(var + (A)eps);
        rstd[i] = (R)rs;
        for (long long j = 0; j < m; j++) {
            A h = (A)hr[j] * rs;
            hr[j] = (T)h;
            yr[j] = (T)(h * (A)w[j] + (A)b[j]);
        }"""),
    # row i: dx = rstd ((dy w - xhat mean(dy w xhat)) - mean(dy w))
    "rz_ln_bwd": ("raw T dy, raw T xhat, raw R rstd, raw T w, int64 m", "raw T dx", """
        typedef rz_acc<T>::type A;
        const T *gr = &dy[i * m], *hr = &xhat[i * m];
        T *dr = &dx[i * m];
        for (long long j = 0; j < m; j++) dr[j] = (T)((A)gr[j] * (A)w[j]);
        A m1 = rz_sum8<A>(dr, """ + _NOV + """, m) / (A)m, m2 = rz_sum8<A>(dr, hr, m) / (A)m, rs = (A)rstd[i];
        for (long long j = 0; j < m; j++) dr[j] = (T)((((A)dr[j] - (A)hr[j] * m2) - m1) * rs);"""),
    # column i: db = sum dy, dw = sum dy xhat over rows in order
    "rz_ln_wgrad": ("raw T dy, raw T xhat, int64 rows", "W dw, W db", """
        typedef rz_acc<W>::type A;
        long long M = _ind.size();
        A sw = (A)0, sb = (A)0;
        for (long long r = 0; r < rows; r++) {
            A g = (A)dy[r * M + i];
            sb += g;
            sw += g * (A)xhat[r * M + i];
        }
        dw = (W)sw;
        db = (W)sb"""),
    # row i of att (R*tn, tn), t = i % tn: j <= t softmax(att * scale), j > t: 0
    "rz_softmax_causal": ("int64 tn, float64 scale", "raw T att", """
        typedef rz_acc<T>::type A;
        T *a = &att[i * tn];
        long long k = i % tn + 1;
        A sc = (A)scale;
        for (long long j = 0; j < k; j++) a[j] = (T)((A)a[j] * sc);
        A mx = rz_max8<A>(a, k);
        for (long long j = 0; j < k; j++) a[j] = (T)rz_exp((A)a[j] - mx);
        A s = rz_sum8<A>(a, """ + _NOV + """, k);
        for (long long j = 0; j < k; j++) a[j] = (T)((A)a[j] / s);
        for (long long j = k; j < tn; j++) a[j] = (T)(A)0;"""),
    # row i: datt = ((datt - sum(datt att)) att) scale on j <= t, 0 above
    "rz_softmax_causal_bwd": ("raw T att, int64 tn, float64 scale", "raw T datt", """
        typedef rz_acc<T>::type A;
        T *d = &datt[i * tn];
        const T *a = &att[i * tn];
        long long k = i % tn + 1;
        A sc = (A)scale;
        A s = rz_sum8<A>(d, a, k);
        for (long long j = 0; j < k; j++) d[j] = (T)((((A)d[j] - s) * (A)a[j]) * sc);
        for (long long j = k; j < tn; j++) d[j] = (T)(A)0;"""),
    # row i of logits (N, V): probs = softmax, nll = log(sum exp(l - max)) - (l[tgt] - max)
    "rz_ce_fwd": ("raw T logits, raw I tgt, int64 V", "raw P probs, raw P nll", """
        const T *l = &logits[i * V];
        P *p = &probs[i * V];
        P mx = rz_max8<P>(l, V);
        P picked = (P)l[(long long)tgt[i]] - mx;
        for (long long j = 0; j < V; j++) p[j] = rz_exp((P)l[j] - mx);
        P s = rz_sum8<P>(p, """ + _NOV + """, V);
        nll[i] = rz_log(s) - picked;
        for (long long j = 0; j < V; j++) p[j] = p[j] / s;"""),
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

    ``arrays`` share one dtype (the kernels' T); ``free`` arrays (float
    statistics and gradients: rstd, dw, probs) may have another. None entries
    (optional arguments) are skipped; the last ``outs`` of ``arrays + free``
    are written.
    """
    allv = arrays + tuple(free)
    given = [(k >= len(allv) - outs, a) for k, a in enumerate(allv) if a is not None]
    if not given or type(given[0][1]).__module__.split(".")[0] != "cupy":
        return False
    dt = next((a.dtype for a in arrays if a is not None), None)
    for _, a in given:
        if type(a).__module__.split(".")[0] != "cupy" or a.dtype not in _FLOATS or not a.flags.c_contiguous:
            return False
    if any(a is not None and a.dtype != dt for a in arrays):
        return False
    spans = [(w, _span(a)) for w, a in given]
    for k, (w, (lo, hi)) in enumerate(spans):
        if w and any(lo < h2 and lo2 < hi for j, (_, (lo2, h2)) in enumerate(spans) if j != k):
            return False
    return True


# ---- the calls fused.py makes (same arguments as its C path) ----------------------------

def gelu_fwd(x, b, y, s):
    if b is None:
        _k("rz_gelu_fwd")(x, y, s)
    else:
        _k("rz_gelu_fwd_bias")(x, b, y, s)


def gelu_bwd(dy, x, b, s, dx, colsum):
    if b is None:
        _k("rz_gelu_bwd")(dy, x, s, dx)
    else:
        _k("rz_gelu_bwd_bias")(dy, x, b, s, dx)
    if colsum is not None:
        _k("rz_colsum")(dx, dx.shape[0], colsum)


def bias_residual(y, b, x):
    _k("rz_bias_residual")(b, x, y)


def ln_fwd(x, w, b, y, xhat, rstd, eps):
    N, C = x.shape
    _k("rz_ln_fwd")(x, w, b, C, float(eps), y, xhat, rstd, size=N)


def ln_bwd(dy, xhat, rstd, w, dx, dw, db):
    N, C = dy.shape
    _k("rz_ln_bwd")(dy, xhat, rstd, w, C, dx, size=N)
    _k("rz_ln_wgrad")(dy, xhat, N, dw, db)


def softmax_causal(att, scale):
    R, T, _ = att.shape
    _k("rz_softmax_causal")(T, float(scale), att, size=R * T)


def softmax_causal_bwd(datt, att, scale):
    R, T, _ = att.shape
    _k("rz_softmax_causal_bwd")(att, T, float(scale), datt, size=R * T)


def ce_fwd(logits, targets, probs, nll):
    N, V = logits.shape
    _k("rz_ce_fwd")(logits, targets, V, probs, nll, size=N)
