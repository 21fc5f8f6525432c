/* ringzero.nn._fused: single-pass kernels for the model's elementwise layers.
 *
 * What it is: GELU forward (with the bias add of the GEMM before it) and
 * backward (with that bias's gradient), LayerNorm forward and backward (with
 * its weight and bias gradients), RMSNorm, SwiGLU and rotary forward and backward
 * (the Llama family's), the bias add fused with the residual add,
 * the attention softmax with its causal mask and scale, its backward, and
 * softmax + cross-entropy. Each walks its rows once; a row (<= a few KiB)
 * stays in L1 between the kernel's inner loops. ringzero/nn/fused.py checks
 * dtypes, shapes and contiguity before calling in here, and holds the NumPy
 * formulas used when this extension is absent.
 *
 * Determinism: one thread, and every reduction has a fixed order: row sums
 * go to 8 lanes (element j to lane j % 8) combined in a fixed tree; column
 * sums go to 64 row lanes (row i to partial i % 64, in row order), then the
 * 64 partials are added in order. The CuPy twins of these kernels
 * (ringzero/nn/fused_cuda.py) spread a row over 8 threads and a column over
 * 64 in exactly these orders, so a device computes the same sums. The file
 * is built with -ffp-contract=off and no fast-math, so the compiler may
 * vectorize the loops but never reorders or fuses a rounding; the AVX2 and
 * the baseline clones of each kernel
 * (target_clones, chosen at load time) give the same bits. float32 uses the
 * exp below (Cephes' polynomial, a few ulp, vectorizable); float64 uses
 * libm's exp/log. GELU's tanh is taken as a logistic sigmoid,
 * 0.5 (1 + tanh u) = 1 / (1 + exp(-2u)): one exp and one division.
 *
 * Buffers passed to one call never overlap (fused.py hands in distinct pool
 * buffers; the pointers are declared restrict where the loops need it).
 *
 * What it is not: a general ufunc. No strides (but rotary's rows of heads, the
 * columns of the q|k|v buffer), no broadcasting beyond a
 * bias row, no float16 (the fallback handles every other dtype).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#define RZ_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define RZ_CLONES
#endif

#define GELU_K 0.7978845608028654   /* sqrt(2/pi) */
#define GELU_A 0.044715
#define LANES 8
#define ROWLANES 64
/* -2u of GELU's tanh argument u = k (v + a v^3), in this order of roundings */
#define GELU_M2U(T, v) (((((v) * (v)) * (T)GELU_A + (T)1) * (v)) * (T)(-2.0 * GELU_K))

typedef Py_ssize_t ix;

/* ---- float32 exp (Cephes expf, branch-free) ------------------------------------ */

static inline float rz_expf(float x)
{
    x = x > 88.0f ? 88.0f : x;
    x = x < -87.0f ? -87.0f : x;
    float fx = x * 1.44269504088896341f + 12582912.0f;   /* round(x / ln 2) via 1.5 * 2^23 */
    fx = fx - 12582912.0f;
    float r = x - fx * 0.693359375f;
    r = r - fx * -2.12194440e-4f;
    float z = r * r;
    /* 1 + r + r^2 (c5 + c4 r + ... + c0 r^5), the polynomial by Estrin's scheme:
     * three independent pairs, so the dependency chain is short and the
     * out-of-order core overlaps more elements (measured 2x on GELU) */
    float a = 5.0000001201e-1f + 1.6666665459e-1f * r;
    float b = 4.1665795894e-2f + 8.3334519073e-3f * r;
    float c = 1.3981999507e-3f + 1.9875691500e-4f * r;
    float p = (a + b * z) + c * (z * z);
    p = p * z + r;
    p = p + 1.0f;
    int32_t n = (int32_t)fx;
    uint32_t bits = (uint32_t)(n + 127) << 23;
    float s;
    memcpy(&s, &bits, 4);
    return p * s;
}

static inline double rz_exp(double x) { return exp(x); }
static inline float rz_logf(float x) { return logf(x); }
static inline double rz_log(double x) { return log(x); }
static inline float rz_sqrtf(float x) { return sqrtf(x); }
static inline double rz_sqrt(double x) { return sqrt(x); }

/* ---- the kernels, written once for float (f) and double (d) --------------- */

#define DEFINE_KERNELS(T, S, EXP, LOG, SQRT)                                              \
                                                                                                \
/* sum of v[0..n) in 8 lanes, combined in a fixed tree */                                       \
static inline T lane_sum_##S(const T *v, ix n)                                                  \
{                                                                                               \
    T a[LANES] = {0};                                                                           \
    ix j = 0;                                                                                   \
    for (; j + LANES <= n; j += LANES)                                                          \
        for (int l = 0; l < LANES; l++) a[l] += v[j + l];                                       \
    for (int l = 0; j < n; j++, l++) a[l] += v[j];                                              \
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));                   \
}                                                                                               \
                                                                                                \
/* max of v[0..n), n >= 1, in 8 lanes (so it vectorizes without fast-math; max is exact in any order) */ \
static inline T lane_max_##S(const T *v, ix n)                                                  \
{                                                                                               \
    T a[LANES];                                                                                 \
    for (int l = 0; l < LANES; l++) a[l] = v[0];                                                \
    ix j = 0;                                                                                   \
    for (; j + LANES <= n; j += LANES)                                                          \
        for (int l = 0; l < LANES; l++) a[l] = v[j + l] > a[l] ? v[j + l] : a[l];               \
    for (int l = 0; j < n; j++, l++) a[l] = v[j] > a[l] ? v[j] : a[l];                          \
    T mx = a[0];                                                                                \
    for (int l = 1; l < LANES; l++) mx = a[l] > mx ? a[l] : mx;                                 \
    return mx;                                                                                  \
}                                                                                               \
                                                                                                \
/* y = v s, s = sigmoid(2u), v = x + b (b (m,) optional), u = k (v + a v^3): 0.5 v (1 + tanh u).   \
 * Two passes over each row (in L1): -2u into s, then s = 1 / (1 + exp(-2u)) and y. x is only   \
 * read (v is formed on the fly, here and in backward). Each loop comes with and without b, so   \
 * that each one vectorizes. */                                                                 \
RZ_CLONES static void gelu_fwd_##S(const T *restrict x, const T *restrict b, T *restrict y,      \
                                   T *restrict sg, ix n, ix m)                                  \
{                                                                                               \
    for (ix i = 0; i < n; i++) {                                                                \
        const T *xr = x + i * m;                                                                \
        T *yr = y + i * m, *sr = sg + i * m;                                                    \
        if (b) for (ix j = 0; j < m; j++) sr[j] = GELU_M2U(T, xr[j] + b[j]);                    \
        else for (ix j = 0; j < m; j++) sr[j] = GELU_M2U(T, xr[j]);                             \
        for (ix j = 0; j < m; j++) sr[j] = (T)1 / ((T)1 + EXP(sr[j]));                          \
        if (b) for (ix j = 0; j < m; j++) yr[j] = (xr[j] + b[j]) * sr[j];                       \
        else for (ix j = 0; j < m; j++) yr[j] = xr[j] * sr[j];                                  \
    }                                                                                           \
}                                                                                               \
                                                                                                \
/* column sums of the (ROWLANES, m) partials, in partial order */                               \
static inline void fold_rows_##S(const T *restrict cols, T *restrict out, ix m)                 \
{                                                                                               \
    for (ix j = 0; j < m; j++) out[j] = 0;                                                      \
    for (int g = 0; g < ROWLANES; g++)                                                          \
        for (ix j = 0; j < m; j++) out[j] += cols[g * m + j];                                   \
}                                                                                               \
                                                                                                \
/* dx = dy (s + s (1 - s) 2k v (1 + 3a v^2)), v = x + b, s from forward;                        \
 * colsum (m,) = dx summed over rows (row lanes; cols: (ROWLANES, m) scratch), if given */     \
RZ_CLONES static void gelu_bwd_##S(const T *restrict dy, const T *restrict x, const T *restrict b, \
                                   const T *restrict sg, T *restrict dx, T *restrict colsum,    \
                                   T *restrict cols, ix n, ix m)                                \
{                                                                                               \
    if (colsum) for (ix k = 0; k < ROWLANES * m; k++) cols[k] = 0;                              \
    for (ix i = 0; i < n; i++) {                                                                \
        const T *xr = x + i * m, *gr = dy + i * m, *sr = sg + i * m;                            \
        T *dr = dx + i * m;                                                                     \
        if (b) for (ix j = 0; j < m; j++) dr[j] = xr[j] + b[j];        /* v, then the rest */   \
        else for (ix j = 0; j < m; j++) dr[j] = xr[j];                                          \
        for (ix j = 0; j < m; j++) {                                                            \
            T v = dr[j], sv = sr[j];                                                            \
            T d = (((v * v) * (T)(3.0 * GELU_A) + (T)1) * v) * (T)(2.0 * GELU_K);               \
            d = ((d * sv) * ((T)1 - sv)) + sv;                                                  \
            dr[j] = d * gr[j];                                                                  \
        }                                                                                       \
        if (colsum) {                                                                           \
            T *c = cols + (i % ROWLANES) * m;                                                   \
            for (ix j = 0; j < m; j++) c[j] += dr[j];                                           \
        }                                                                                       \
    }                                                                                           \
    if (colsum) fold_rows_##S(cols, colsum, m);                                                 \
}                                                                                               \
                                                                                                \
/* y (n, m) = (y + b) + x */                                                                    \
RZ_CLONES static void bias_residual_##S(T *y, const T *b, const T *x, ix n, ix m)               \
{                                                                                               \
    for (ix i = 0; i < n; i++) {                                                                \
        T *yr = y + i * m;                                                                      \
        const T *xr = x + i * m;                                                                \
        for (ix j = 0; j < m; j++) yr[j] = (yr[j] + b[j]) + xr[j];                              \
    }                                                                                           \
}                                                                                               \
                                                                                                \
/* per row: xhat = (x - mean) * rstd, rstd = 1/sqrt(var + eps); y = xhat * w + b */             \
RZ_CLONES static void ln_fwd_##S(const T *restrict x, const T *restrict w, const T *restrict b,  \
                                 T *restrict y, T *restrict xhat, T *restrict rstd, ix n, ix m, T eps) \
{                                                                                               \
    for (ix i = 0; i < n; i++) {                                                                \
        const T *xr = x + i * m;                                                                \
        T *hr = xhat + i * m, *yr = y + i * m;                                                  \
        T mean = lane_sum_##S(xr, m) / (T)m;                                                    \
        for (ix j = 0; j < m; j++) hr[j] = xr[j] - mean;                                        \
        for (ix j = 0; j < m; j++) yr[j] = hr[j] * hr[j];       /* squares, y as scratch */     \
        T var = lane_sum_##S(yr, m) / (T)m;                                                     \
        T rs = (T)1 / SQRT(var + eps);                                                          \
        rstd[i] = rs;                                                                           \
        for (ix j = 0; j < m; j++) {                                                            \
            T h = hr[j] * rs;                                                                   \
            hr[j] = h;                                                                          \
            yr[j] = h * w[j] + b[j];                                                            \
        }                                                                                       \
    }                                                                                           \
}                                                                                               \
                                                                                                \
/* dx = rstd ((dy w - xhat mean(dy w xhat)) - mean(dy w)); dw = sum dy xhat, db = sum dy        \
 * (row lanes; cols: (2 ROWLANES, m) scratch) */                                                \
RZ_CLONES static void ln_bwd_##S(const T *restrict dy, const T *restrict xhat, const T *restrict rstd, \
                                 const T *restrict w, T *restrict dx, T *restrict dw, T *restrict db, \
                                 T *restrict tmp, T *restrict cols, ix n, ix m)                 \
{                                                                                               \
    for (ix k = 0; k < 2 * ROWLANES * m; k++) cols[k] = 0;                                      \
    for (ix i = 0; i < n; i++) {                                                                \
        const T *gr = dy + i * m, *hr = xhat + i * m;                                           \
        T *dr = dx + i * m;                                                                     \
        T *cw = cols + (i % ROWLANES) * m, *cb = cols + (ROWLANES + i % ROWLANES) * m;          \
        for (ix j = 0; j < m; j++) {                                                            \
            cb[j] += gr[j];                                                                     \
            cw[j] += gr[j] * hr[j];                                                             \
            dr[j] = gr[j] * w[j];                                                               \
            tmp[j] = dr[j] * hr[j];                                                             \
        }                                                                                       \
        T m1 = lane_sum_##S(dr, m) / (T)m, m2 = lane_sum_##S(tmp, m) / (T)m, rs = rstd[i];      \
        for (ix j = 0; j < m; j++) dr[j] = ((dr[j] - hr[j] * m2) - m1) * rs;                    \
    }                                                                                           \
    fold_rows_##S(cols, dw, m);                                                                 \
    fold_rows_##S(cols + ROWLANES * m, db, m);                                                  \
}                                                                                               \
                                                                                                \
/* att (R*T, T) rows: row t of each (T, T) block, j <= t: softmax(att * scale); j > t: 0 */     \
RZ_CLONES static void softmax_causal_##S(T *att, ix R, ix Tn, T scale)                          \
{                                                                                               \
    for (ix r = 0; r < R; r++)                                                                  \
        for (ix t = 0; t < Tn; t++) {                                                           \
            T *a = att + (r * Tn + t) * Tn;                                                     \
            ix k = t + 1;                                                                       \
            for (ix j = 0; j < k; j++) a[j] = a[j] * scale;                                     \
            T mx = lane_max_##S(a, k);                                                          \
            for (ix j = 0; j < k; j++) a[j] = EXP(a[j] - mx);                                   \
            T s = lane_sum_##S(a, k);                                                           \
            for (ix j = 0; j < k; j++) a[j] = a[j] / s;                                         \
            for (ix j = k; j < Tn; j++) a[j] = 0;                                               \
        }                                                                                       \
}                                                                                               \
                                                                                                \
/* datt = (datt - sum(datt * att)) * att * scale on j <= t, 0 above; tmp: (T,) scratch */       \
RZ_CLONES static void softmax_causal_bwd_##S(T *restrict datt, const T *restrict att, T *restrict tmp, \
                                             ix R, ix Tn, T sc)                                 \
{                                                                                               \
    for (ix r = 0; r < R; r++)                                                                  \
        for (ix t = 0; t < Tn; t++) {                                                           \
            T *d = datt + (r * Tn + t) * Tn;                                                    \
            const T *a = att + (r * Tn + t) * Tn;                                               \
            ix k = t + 1;                                                                       \
            for (ix j = 0; j < k; j++) tmp[j] = d[j] * a[j];                                    \
            T s = lane_sum_##S(tmp, k);                                                         \
            for (ix j = 0; j < k; j++) d[j] = ((d[j] - s) * a[j]) * sc;                         \
            for (ix j = k; j < Tn; j++) d[j] = 0;                                               \
        }                                                                                       \
}                                                                                               \
                                                                                                \
/* g[ids[i]] += d[i] for i in order: np.add.at's sums, row by row (ids range-checked by the caller) */    \
RZ_CLONES static void rows_add_at_##S(T *g, const int64_t *ids, const T *d, ix n, ix m)           \
{                                                                                               \
    for (ix i = 0; i < n; i++) {                                                                \
        T *gr = g + ids[i] * m;                                                                 \
        const T *dr = d + i * m;                                                                \
        for (ix j = 0; j < m; j++) gr[j] = gr[j] + dr[j];                                       \
    }                                                                                           \
}                                                                                               \
                                                                                                \
/* RMSNorm, per row: rstd = 1/sqrt(mean(x^2) + eps), xhat = x rstd, y = xhat w (y is the squares' scratch) */ \
RZ_CLONES static void rms_fwd_##S(const T *restrict x, const T *restrict w, T *restrict y,       \
                                  T *restrict xhat, T *restrict rstd, ix n, ix m, T eps)       \
{                                                                                               \
    for (ix i = 0; i < n; i++) {                                                                \
        const T *xr = x + i * m;                                                                \
        T *hr = xhat + i * m, *yr = y + i * m;                                                  \
        for (ix j = 0; j < m; j++) yr[j] = xr[j] * xr[j];                                       \
        T rs = (T)1 / SQRT(lane_sum_##S(yr, m) / (T)m + eps);                                   \
        rstd[i] = rs;                                                                           \
        for (ix j = 0; j < m; j++) {                                                            \
            T h = xr[j] * rs;                                                                   \
            hr[j] = h;                                                                          \
            yr[j] = h * w[j];                                                                   \
        }                                                                                       \
    }                                                                                           \
}                                                                                               \
                                                                                                \
/* gh = dy w; dx = (gh - xhat mean(gh xhat)) rstd; dw = sum over rows of dy xhat                \
 * (row lanes; cols: (ROWLANES, m) scratch; tmp: (m,) scratch) */                               \
RZ_CLONES static void rms_bwd_##S(const T *restrict dy, const T *restrict xhat, const T *restrict rstd, \
                                  const T *restrict w, T *restrict dx, T *restrict dw,          \
                                  T *restrict tmp, T *restrict cols, ix n, ix m)                \
{                                                                                               \
    for (ix k = 0; k < ROWLANES * m; k++) cols[k] = 0;                                          \
    for (ix i = 0; i < n; i++) {                                                                \
        const T *gr = dy + i * m, *hr = xhat + i * m;                                           \
        T *dr = dx + i * m, *cw = cols + (i % ROWLANES) * m;                                    \
        for (ix j = 0; j < m; j++) {                                                            \
            cw[j] += gr[j] * hr[j];                                                             \
            dr[j] = gr[j] * w[j];                                                               \
            tmp[j] = dr[j] * hr[j];                                                             \
        }                                                                                       \
        T m2 = lane_sum_##S(tmp, m) / (T)m, rs = rstd[i];                                       \
        for (ix j = 0; j < m; j++) dr[j] = (dr[j] - hr[j] * m2) * rs;                           \
    }                                                                                           \
    fold_rows_##S(cols, dw, m);                                                                 \
}                                                                                               \
                                                                                                \
/* Rotary in place (HF's rotate_half layout): R rows of nh heads of D, row r at x + r ld, position r % Tn;   \
 * dimension j of a head pairs with j + D/2. cs, sn: (Tn, D/2). sign > 0: y1 = x1 c - x2 s,        \
 * y2 = x2 c + x1 s; sign < 0 (the transpose): y1 = x1 c + x2 s, y2 = x2 c - x1 s. Each product    \
 * rounded before the sum, as the xp path's multiply-then-add: the same bits. */                  \
RZ_CLONES static void rope_##S(T *restrict x, const T *restrict cs, const T *restrict sn,        \
                               ix R, ix Tn, ix ld, ix nh, ix D, int sign)                       \
{                                                                                               \
    ix h = D / 2;                                                                               \
    for (ix r = 0; r < R; r++) {                                                                \
        const T *c = cs + (r % Tn) * h, *s = sn + (r % Tn) * h;                                 \
        for (ix k = 0; k < nh; k++) {                                                           \
            T *a = x + r * ld + k * D, *b = a + h;                                              \
            if (sign > 0)                                                                       \
                for (ix j = 0; j < h; j++) {                                                    \
                    T a1 = a[j], b1 = b[j];                                                     \
                    a[j] = a1 * c[j] - b1 * s[j];                                               \
                    b[j] = b1 * c[j] + a1 * s[j];                                               \
                }                                                                               \
            else                                                                                \
                for (ix j = 0; j < h; j++) {                                                    \
                    T a1 = a[j], b1 = b[j];                                                     \
                    a[j] = a1 * c[j] + b1 * s[j];                                               \
                    b[j] = b1 * c[j] - a1 * s[j];                                               \
                }                                                                               \
        }                                                                                       \
    }                                                                                           \
}                                                                                               \
                                                                                                \
/* SwiGLU over gu (n, 2f) = [gate | up] per row: y (n, f) = (g s) u, s = 1 / (1 + exp(-g)) */     \
RZ_CLONES static void swiglu_fwd_##S(const T *restrict gu, T *restrict y, ix n, ix f)            \
{                                                                                               \
    for (ix i = 0; i < n; i++) {                                                                \
        const T *g = gu + i * 2 * f, *u = g + f;                                                \
        T *yr = y + i * f;                                                                      \
        for (ix j = 0; j < f; j++) yr[j] = (T)1 / ((T)1 + EXP(-g[j]));                          \
        for (ix j = 0; j < f; j++) yr[j] = (g[j] * yr[j]) * u[j];                               \
    }                                                                                           \
}                                                                                               \
                                                                                                \
/* dgu (n, 2f) = [dg | du]: du = (g s) dy, dg = ((((1 - s) g) + 1) s) u dy (s recomputed) */       \
RZ_CLONES static void swiglu_bwd_##S(const T *restrict gu, const T *restrict dy, T *restrict dgu, \
                                     ix n, ix f)                                                \
{                                                                                               \
    for (ix i = 0; i < n; i++) {                                                                \
        const T *g = gu + i * 2 * f, *u = g + f, *d = dy + i * f;                               \
        T *dg = dgu + i * 2 * f, *du = dg + f;                                                  \
        for (ix j = 0; j < f; j++) dg[j] = (T)1 / ((T)1 + EXP(-g[j]));          /* s */          \
        for (ix j = 0; j < f; j++) {                                                            \
            T sv = dg[j];                                                                       \
            du[j] = (g[j] * sv) * d[j];                                                         \
            dg[j] = ((((((T)1 - sv) * g[j]) + (T)1) * sv) * u[j]) * d[j];                       \
        }                                                                                       \
    }                                                                                           \
}                                                                                               \
                                                                                                \
/* probs (n, V) = softmax(logits); nll[i] = log(sum exp(l - max)) - (l[tgt] - max) */           \
RZ_CLONES static void ce_fwd_##S(const T *lg, const int64_t *tgt, T *pr, T *nll, ix n, ix V)    \
{                                                                                               \
    for (ix i = 0; i < n; i++) {                                                                \
        const T *l = lg + i * V;                                                                \
        T *p = pr + i * V;                                                                      \
        T mx = lane_max_##S(l, V);                                                              \
        T picked = l[tgt[i]] - mx;                                                              \
        for (ix j = 0; j < V; j++) p[j] = EXP(l[j] - mx);                                       \
        T s = lane_sum_##S(p, V);                                                               \
        nll[i] = LOG(s) - picked;                                                               \
        for (ix j = 0; j < V; j++) p[j] = p[j] / s;                                             \
    }                                                                                           \
}

DEFINE_KERNELS(float, f, rz_expf, rz_logf, rz_sqrtf)
DEFINE_KERNELS(double, d, rz_exp, rz_log, rz_sqrt)

/* ---- the float32 causal softmax, 8 lanes as one vector ------------------------------
 *
 * softmax_causal_f above, with each row's loops over whole 8-float vectors (GCC vector
 * extensions; the compiler leaves the scalar version's lane max and its short rows' tails
 * scalar): 0.47 -> 0.35 ms for (32, 128, 128), one thread, AMD EPYC (Zen 4). Same bits
 * (tests/test_fused.py checks them against the scalar rows): vector lane l holds the elements
 * j = l (mod 8) that lane_max_f / lane_sum_f give to lane l, in the same order; the row's tail
 * past t is masked to -inf for the max and to 0 for the sum (x + 0 = x); rz_expf8 is rz_expf's
 * operations in its order. Used when T is a multiple of 8 (otherwise softmax_causal_f). */
#if defined(__GNUC__)
#define RZ_VEC8 1
#pragma GCC diagnostic ignored "-Wpsabi"     /* v8f never crosses a call: every helper is inlined */
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));

static inline __attribute__((always_inline)) v8f ld8(const float *p) { v8f v; memcpy(&v, p, sizeof v); return v; }
static inline __attribute__((always_inline)) void st8(float *p, v8f v) { memcpy(p, &v, sizeof v); }
static inline __attribute__((always_inline)) v8f sel8(v8i m, v8f a, v8f b) { return (v8f)(((v8i)a & m) | ((v8i)b & ~m)); }

static inline __attribute__((always_inline)) v8f rz_expf8(v8f x)
{
    const v8f hi = {88.0f, 88.0f, 88.0f, 88.0f, 88.0f, 88.0f, 88.0f, 88.0f};
    x = sel8(x > hi, hi, x);
    x = sel8(x < -hi + 1.0f, -hi + 1.0f, x);
    v8f fx = x * 1.44269504088896341f + 12582912.0f;
    fx = fx - 12582912.0f;
    v8f r = x - fx * 0.693359375f;
    r = r - fx * -2.12194440e-4f;
    v8f z = r * r;
    v8f a = 5.0000001201e-1f + 1.6666665459e-1f * r;
    v8f b = 4.1665795894e-2f + 8.3334519073e-3f * r;
    v8f c = 1.3981999507e-3f + 1.9875691500e-4f * r;
    v8f p = (a + b * z) + c * (z * z);
    p = p * z + r;
    p = p + 1.0f;
    v8i n = __builtin_convertvector(fx, v8i);
    v8u bits = (v8u)(n + 127) << 23;
    return p * (v8f)bits;
}

RZ_CLONES static void softmax_causal_f8(float *att, ix R, ix Tn, float scale)
{
    const v8i lane = {0, 1, 2, 3, 4, 5, 6, 7};
    const v8f ninf = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    const v8f zero = {0};
    for (ix r = 0; r < R; r++)
        for (ix t = 0; t < Tn; t++) {
            float *a = att + (r * Tn + t) * Tn;
            ix k = t + 1, kk = (k + 7) / 8 * 8;
            v8f v = ld8(a) * scale;
            v8f mxv = sel8(lane < (int32_t)k, v, ninf);
            st8(a, mxv);
            for (ix j = 8; j < kk; j += 8) {
                v = ld8(a + j) * scale;
                v = sel8(lane + (int32_t)j < (int32_t)k, v, ninf);
                st8(a + j, v);
                mxv = sel8(v > mxv, v, mxv);
            }
            /* lane_max_f's lanes start at a[0] and combine lane 0, 1, ..., 7 in order */
            float m8[8];
            memcpy(m8, &mxv, sizeof m8);
            float mx = m8[0] > a[0] ? m8[0] : a[0];
            for (int l = 1; l < 8; l++) { float ml = m8[l] > a[0] ? m8[l] : a[0]; mx = ml > mx ? ml : mx; }
            v8f sv = zero;
            for (ix j = 0; j < kk; j += 8) {
                v = rz_expf8(ld8(a + j) - mx);
                v = sel8(lane + (int32_t)j < (int32_t)k, v, zero);
                st8(a + j, v);
                sv = sv + v;
            }
            float s8[8];
            memcpy(s8, &sv, sizeof s8);
            float s = ((s8[0] + s8[1]) + (s8[2] + s8[3])) + ((s8[4] + s8[5]) + (s8[6] + s8[7]));
            for (ix j = 0; j < kk; j += 8) st8(a + j, ld8(a + j) / s);
            for (ix j = kk; j < Tn; j++) a[j] = 0;
        }
}
#endif

/* ---- Python glue ------------------------------------------------------------ */

/* Borrow a C-contiguous buffer of exactly `nbytes` bytes; Py_None gives NULL when `optional`. */
static int get(PyObject *o, Py_buffer *v, int writable, ix nbytes, int optional, const char *what, void **p)
{
    v->obj = NULL;
    *p = NULL;
    if (optional && o == Py_None) return 0;
    if (PyObject_GetBuffer(o, v, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) {
        PyErr_Format(PyExc_TypeError, "%s: expected a C-contiguous%s buffer", what, writable ? " writable" : "");
        return -1;
    }
    if (v->len != nbytes) {
        PyErr_Format(PyExc_ValueError, "%s: expected %zd bytes, got %zd", what, nbytes, v->len);
        PyBuffer_Release(v);
        v->obj = NULL;
        return -1;
    }
    *p = v->buf;
    return 0;
}

#define MAXB 10
typedef struct { Py_buffer v[MAXB]; int k; } Bufs;

static void release(Bufs *b) { for (int i = 0; i < b->k; i++) if (b->v[i].obj) PyBuffer_Release(&b->v[i]); }

/* borrow into the next slot; returns -1 (and releases all) on error */
static int take(Bufs *b, PyObject *o, int writable, ix nbytes, int optional, const char *what, void **p)
{
    if (get(o, &b->v[b->k], writable, nbytes, optional, what, p) < 0) { release(b); return -1; }
    b->k++;
    return 0;
}

#define SZ(dbl) ((dbl) ? (ix)sizeof(double) : (ix)sizeof(float))

static PyObject *py_gelu_fwd(PyObject *self, PyObject *args)
{
    PyObject *x, *b, *y, *sg; ix n, m; int dbl; Bufs B = {.k = 0}; void *px, *pb, *py, *ps;
    if (!PyArg_ParseTuple(args, "OOOOnnp", &x, &b, &y, &sg, &n, &m, &dbl)) return NULL;
    ix e = SZ(dbl);
    if (take(&B, x, 0, n * m * e, 0, "gelu x", &px) || take(&B, b, 0, m * e, 1, "gelu b", &pb)
        || take(&B, y, 1, n * m * e, 0, "gelu y", &py) || take(&B, sg, 1, n * m * e, 0, "gelu s", &ps)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    if (dbl) gelu_fwd_d(px, pb, py, ps, n, m); else gelu_fwd_f(px, pb, py, ps, n, m);
    Py_END_ALLOW_THREADS
    release(&B);
    Py_RETURN_NONE;
}

static PyObject *py_gelu_bwd(PyObject *self, PyObject *args)
{
    PyObject *dy, *x, *b, *sg, *dx, *cs, *cl; ix n, m; int dbl; Bufs B = {.k = 0};
    void *pg, *px, *pb, *ps, *pd, *pc, *pl;
    if (!PyArg_ParseTuple(args, "OOOOOOOnnp", &dy, &x, &b, &sg, &dx, &cs, &cl, &n, &m, &dbl)) return NULL;
    ix e = SZ(dbl);
    if (take(&B, dy, 0, n * m * e, 0, "gelu dy", &pg) || take(&B, x, 0, n * m * e, 0, "gelu x", &px)
        || take(&B, b, 0, m * e, 1, "gelu b", &pb) || take(&B, sg, 0, n * m * e, 0, "gelu s", &ps)
        || take(&B, dx, 1, n * m * e, 0, "gelu dx", &pd) || take(&B, cs, 1, m * e, 1, "gelu colsum", &pc)
        || take(&B, cl, 1, ROWLANES * m * e, cs == Py_None, "gelu column partials", &pl))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    if (dbl) gelu_bwd_d(pg, px, pb, ps, pd, pc, pl, n, m); else gelu_bwd_f(pg, px, pb, ps, pd, pc, pl, n, m);
    Py_END_ALLOW_THREADS
    release(&B);
    Py_RETURN_NONE;
}

static PyObject *py_bias_residual(PyObject *self, PyObject *args)
{
    PyObject *y, *b, *x; ix n, m; int dbl; Bufs B = {.k = 0}; void *py, *pb, *px;
    if (!PyArg_ParseTuple(args, "OOOnnp", &y, &b, &x, &n, &m, &dbl)) return NULL;
    ix e = SZ(dbl);
    if (take(&B, y, 1, n * m * e, 0, "residual y", &py) || take(&B, b, 0, m * e, 0, "residual b", &pb)
        || take(&B, x, 0, n * m * e, 0, "residual x", &px)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    if (dbl) bias_residual_d(py, pb, px, n, m); else bias_residual_f(py, pb, px, n, m);
    Py_END_ALLOW_THREADS
    release(&B);
    Py_RETURN_NONE;
}

static PyObject *py_ln_fwd(PyObject *self, PyObject *args)
{
    PyObject *x, *w, *b, *y, *h, *r; ix n, m; int dbl; double eps; Bufs B = {.k = 0};
    void *px, *pw, *pb, *py, *ph, *pr;
    if (!PyArg_ParseTuple(args, "OOOOOOnnpd", &x, &w, &b, &y, &h, &r, &n, &m, &dbl, &eps)) return NULL;
    ix e = SZ(dbl);
    if (take(&B, x, 0, n * m * e, 0, "layernorm x", &px) || take(&B, w, 0, m * e, 0, "layernorm w", &pw)
        || take(&B, b, 0, m * e, 0, "layernorm b", &pb) || take(&B, y, 1, n * m * e, 0, "layernorm y", &py)
        || take(&B, h, 1, n * m * e, 0, "layernorm xhat", &ph) || take(&B, r, 1, n * e, 0, "layernorm rstd", &pr))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    if (dbl) ln_fwd_d(px, pw, pb, py, ph, pr, n, m, eps); else ln_fwd_f(px, pw, pb, py, ph, pr, n, m, (float)eps);
    Py_END_ALLOW_THREADS
    release(&B);
    Py_RETURN_NONE;
}

static PyObject *py_ln_bwd(PyObject *self, PyObject *args)
{
    PyObject *dy, *h, *r, *w, *dx, *dw, *db, *tmp, *cl; ix n, m; int dbl; Bufs B = {.k = 0};
    void *pg, *ph, *pr, *pw, *pd, *pdw, *pdb, *pt, *pl;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOnnp", &dy, &h, &r, &w, &dx, &dw, &db, &tmp, &cl, &n, &m, &dbl))
        return NULL;
    ix e = SZ(dbl);
    if (take(&B, dy, 0, n * m * e, 0, "layernorm dy", &pg) || take(&B, h, 0, n * m * e, 0, "layernorm xhat", &ph)
        || take(&B, r, 0, n * e, 0, "layernorm rstd", &pr) || take(&B, w, 0, m * e, 0, "layernorm w", &pw)
        || take(&B, dx, 1, n * m * e, 0, "layernorm dx", &pd) || take(&B, dw, 1, m * e, 0, "layernorm dw", &pdw)
        || take(&B, db, 1, m * e, 0, "layernorm db", &pdb) || take(&B, tmp, 1, m * e, 0, "layernorm tmp", &pt)
        || take(&B, cl, 1, 2 * ROWLANES * m * e, 0, "layernorm column partials", &pl))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    if (dbl) ln_bwd_d(pg, ph, pr, pw, pd, pdw, pdb, pt, pl, n, m);
    else ln_bwd_f(pg, ph, pr, pw, pd, pdw, pdb, pt, pl, n, m);
    Py_END_ALLOW_THREADS
    release(&B);
    Py_RETURN_NONE;
}

static PyObject *py_softmax_causal(PyObject *self, PyObject *args)
{
    PyObject *a; ix R, Tn; int dbl; double sc; Bufs B = {.k = 0}; void *pa;
    if (!PyArg_ParseTuple(args, "Onnpd", &a, &R, &Tn, &dbl, &sc)) return NULL;
    if (take(&B, a, 1, R * Tn * Tn * SZ(dbl), 0, "softmax att", &pa)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    if (dbl) softmax_causal_d(pa, R, Tn, sc);
#ifdef RZ_VEC8
    else if (Tn % 8 == 0) softmax_causal_f8(pa, R, Tn, (float)sc);
#endif
    else softmax_causal_f(pa, R, Tn, (float)sc);
    Py_END_ALLOW_THREADS
    release(&B);
    Py_RETURN_NONE;
}

static PyObject *py_softmax_causal_bwd(PyObject *self, PyObject *args)
{
    PyObject *d, *a, *tmp; ix R, Tn; int dbl; double sc; Bufs B = {.k = 0}; void *pd, *pa, *pt;
    if (!PyArg_ParseTuple(args, "OOOnnpd", &d, &a, &tmp, &R, &Tn, &dbl, &sc)) return NULL;
    ix e = SZ(dbl);
    if (take(&B, d, 1, R * Tn * Tn * e, 0, "softmax datt", &pd)
        || take(&B, a, 0, R * Tn * Tn * e, 0, "softmax att", &pa)
        || take(&B, tmp, 1, Tn * e, 0, "softmax tmp", &pt)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    if (dbl) softmax_causal_bwd_d(pd, pa, pt, R, Tn, sc); else softmax_causal_bwd_f(pd, pa, pt, R, Tn, (float)sc);
    Py_END_ALLOW_THREADS
    release(&B);
    Py_RETURN_NONE;
}

static PyObject *py_ce_fwd(PyObject *self, PyObject *args)
{
    PyObject *lg, *tg, *pr, *nl; ix n, V; int dbl; Bufs B = {.k = 0}; void *pl, *pt, *pp, *pn;
    if (!PyArg_ParseTuple(args, "OOOOnnp", &lg, &tg, &pr, &nl, &n, &V, &dbl)) return NULL;
    ix e = SZ(dbl);
    if (take(&B, lg, 0, n * V * e, 0, "ce logits", &pl) || take(&B, tg, 0, n * 8, 0, "ce targets", &pt)
        || take(&B, pr, 1, n * V * e, 0, "ce probs", &pp) || take(&B, nl, 1, n * e, 0, "ce nll", &pn)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    if (dbl) ce_fwd_d(pl, pt, pp, pn, n, V); else ce_fwd_f(pl, pt, pp, pn, n, V);
    Py_END_ALLOW_THREADS
    release(&B);
    Py_RETURN_NONE;
}

static PyObject *py_rows_add_at(PyObject *self, PyObject *args)
{
    PyObject *g, *id, *d; ix n, V, m; int dbl; Bufs B = {.k = 0}; void *pg, *pi, *pd;
    if (!PyArg_ParseTuple(args, "OOOnnnp", &g, &id, &d, &n, &V, &m, &dbl)) return NULL;
    ix e = SZ(dbl);
    if (take(&B, g, 1, V * m * e, 0, "add_at g", &pg) || take(&B, id, 0, n * 8, 0, "add_at ids", &pi)
        || take(&B, d, 0, n * m * e, 0, "add_at d", &pd)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    if (dbl) rows_add_at_d(pg, pi, pd, n, m); else rows_add_at_f(pg, pi, pd, n, m);
    Py_END_ALLOW_THREADS
    release(&B);
    Py_RETURN_NONE;
}

static PyObject *py_rms_fwd(PyObject *self, PyObject *args)
{
    PyObject *x, *w, *y, *h, *r; ix n, m; int dbl; double eps; Bufs B = {.k = 0}; void *px, *pw, *py, *ph, *pr;
    if (!PyArg_ParseTuple(args, "OOOOOnnpd", &x, &w, &y, &h, &r, &n, &m, &dbl, &eps)) return NULL;
    ix e = SZ(dbl);
    if (take(&B, x, 0, n * m * e, 0, "rmsnorm x", &px) || take(&B, w, 0, m * e, 0, "rmsnorm w", &pw)
        || take(&B, y, 1, n * m * e, 0, "rmsnorm y", &py) || take(&B, h, 1, n * m * e, 0, "rmsnorm xhat", &ph)
        || take(&B, r, 1, n * e, 0, "rmsnorm rstd", &pr)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    if (dbl) rms_fwd_d(px, pw, py, ph, pr, n, m, eps); else rms_fwd_f(px, pw, py, ph, pr, n, m, (float)eps);
    Py_END_ALLOW_THREADS
    release(&B);
    Py_RETURN_NONE;
}
static PyObject *py_rms_bwd(PyObject *self, PyObject *args)
{
    PyObject *dy, *h, *r, *w, *dx, *dw, *tmp, *cl; ix n, m; int dbl; Bufs B = {.k = 0};
    void *pg, *ph, *pr, *pw, *pd, *pdw, *pt, *pl;
    if (!PyArg_ParseTuple(args, "OOOOOOOOnnp", &dy, &h, &r, &w, &dx, &dw, &tmp, &cl, &n, &m, &dbl)) return NULL;
    ix e = SZ(dbl);
    if (take(&B, dy, 0, n * m * e, 0, "rmsnorm dy", &pg) || take(&B, h, 0, n * m * e, 0, "rmsnorm xhat", &ph)
        || take(&B, r, 0, n * e, 0, "rmsnorm rstd", &pr) || take(&B, w, 0, m * e, 0, "rmsnorm w", &pw)
        || take(&B, dx, 1, n * m * e, 0, "rmsnorm dx", &pd) || take(&B, dw, 1, m * e, 0, "rmsnorm dw", &pdw)
        || take(&B, tmp, 1, m * e, 0, "rmsnorm tmp", &pt)
        || take(&B, cl, 1, ROWLANES * m * e, 0, "rmsnorm column partials", &pl)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    if (dbl) rms_bwd_d(pg, ph, pr, pw, pd, pdw, pt, pl, n, m); else rms_bwd_f(pg, ph, pr, pw, pd, pdw, pt, pl, n, m);
    Py_END_ALLOW_THREADS
    release(&B);
    Py_RETURN_NONE;
}
static PyObject *py_swiglu_fwd(PyObject *self, PyObject *args)
{
    PyObject *gu, *y; ix n, f; int dbl; Bufs B = {.k = 0}; void *pg, *py;
    if (!PyArg_ParseTuple(args, "OOnnp", &gu, &y, &n, &f, &dbl)) return NULL;
    ix e = SZ(dbl);
    if (take(&B, gu, 0, 2 * n * f * e, 0, "swiglu gu", &pg) || take(&B, y, 1, n * f * e, 0, "swiglu y", &py))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    if (dbl) swiglu_fwd_d(pg, py, n, f); else swiglu_fwd_f(pg, py, n, f);
    Py_END_ALLOW_THREADS
    release(&B);
    Py_RETURN_NONE;
}
static PyObject *py_swiglu_bwd(PyObject *self, PyObject *args)
{
    PyObject *gu, *dy, *dgu; ix n, f; int dbl; Bufs B = {.k = 0}; void *pg, *pd, *po;
    if (!PyArg_ParseTuple(args, "OOOnnp", &gu, &dy, &dgu, &n, &f, &dbl)) return NULL;
    ix e = SZ(dbl);
    if (take(&B, gu, 0, 2 * n * f * e, 0, "swiglu gu", &pg) || take(&B, dy, 0, n * f * e, 0, "swiglu dy", &pd)
        || take(&B, dgu, 1, 2 * n * f * e, 0, "swiglu dgu", &po)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    if (dbl) swiglu_bwd_d(pg, pd, po, n, f); else swiglu_bwd_f(pg, pd, po, n, f);
    Py_END_ALLOW_THREADS
    release(&B);
    Py_RETURN_NONE;
}
/* rope(base, off, cos, sin, R, Tn, ld, nh, D, sign, dbl): x = base's bytes from `off`, a strided view of
 * R rows (ld elements apart) of nh heads of D, rotated in place. base is any C-contiguous writable buffer
 * (the view's allocation); every element the view touches is checked to lie inside it. */
static PyObject *py_rope(PyObject *self, PyObject *args)
{
    PyObject *base, *c, *sn; ix off, R, Tn, ld, nh, D; int sign, dbl; Bufs B = {.k = 0}; void *pb, *pc, *ps;
    if (!PyArg_ParseTuple(args, "OnOOnnnnnip", &base, &off, &c, &sn, &R, &Tn, &ld, &nh, &D, &sign, &dbl)) return NULL;
    ix e = SZ(dbl);
    if (R < 0 || Tn < 1 || D < 2 || D % 2 || nh < 0 || ld < nh * D || off < 0 || off % e) {
        PyErr_Format(PyExc_ValueError, "rope: bad shape (R %zd, T %zd, ld %zd, heads %zd, D %zd, offset %zd)",
                     R, Tn, ld, nh, D, off);
        return NULL;
    }
    if (PyObject_GetBuffer(base, &B.v[0], PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyErr_SetString(PyExc_TypeError, "rope base: expected a C-contiguous writable buffer");
        return NULL;
    }
    B.k = 1;
    pb = B.v[0].buf;
    if (R > 0 && off + ((R - 1) * ld + nh * D) * e > B.v[0].len) {
        PyErr_Format(PyExc_ValueError, "rope: the view (offset %zd, %zd rows of stride %zd) runs past the %zd-byte base",
                     off, R, ld, B.v[0].len);
        release(&B);
        return NULL;
    }
    if (take(&B, c, 0, Tn * (D / 2) * e, 0, "rope cos", &pc) || take(&B, sn, 0, Tn * (D / 2) * e, 0, "rope sin", &ps))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    if (dbl) rope_d((double *)((char *)pb + off), pc, ps, R, Tn, ld, nh, D, sign);
    else rope_f((float *)((char *)pb + off), pc, ps, R, Tn, ld, nh, D, sign);
    Py_END_ALLOW_THREADS
    release(&B);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"rows_add_at", py_rows_add_at, METH_VARARGS, "rows_add_at(g, ids int64, d, n, V, m, dbl): g[ids[i]] += d[i]"},
    {"gelu_fwd", py_gelu_fwd, METH_VARARGS, "gelu_fwd(x, b|None, y, s, n, m, dbl): y = gelu(x + b)"},
    {"gelu_bwd", py_gelu_bwd, METH_VARARGS, "gelu_bwd(dy, x, b|None, s, dx, colsum|None, cols|None, n, m, dbl)"},
    {"bias_residual", py_bias_residual, METH_VARARGS, "bias_residual(y, b, x, n, m, dbl): y = (y + b) + x"},
    {"ln_fwd", py_ln_fwd, METH_VARARGS, "ln_fwd(x, w, b, y, xhat, rstd, n, m, dbl, eps)"},
    {"ln_bwd", py_ln_bwd, METH_VARARGS, "ln_bwd(dy, xhat, rstd, w, dx, dw, db, tmp, cols, n, m, dbl)"},
    {"softmax_causal", py_softmax_causal, METH_VARARGS, "softmax_causal(att, R, T, dbl, scale)"},
    {"softmax_causal_bwd", py_softmax_causal_bwd, METH_VARARGS, "softmax_causal_bwd(datt, att, tmp, R, T, dbl, scale)"},
    {"rms_fwd", py_rms_fwd, METH_VARARGS, "rms_fwd(x, w, y, xhat, rstd, n, m, dbl, eps)"},
    {"rms_bwd", py_rms_bwd, METH_VARARGS, "rms_bwd(dy, xhat, rstd, w, dx, dw, tmp, cols, n, m, dbl)"},
    {"swiglu_fwd", py_swiglu_fwd, METH_VARARGS, "swiglu_fwd(gu, y, n, f, dbl): y = silu(gate) * up"},
    {"rope", py_rope, METH_VARARGS, "rope(base, off, cos, sin, R, T, ld, nh, D, sign, dbl): rotary in place"},
    {"swiglu_bwd", py_swiglu_bwd, METH_VARARGS, "swiglu_bwd(gu, dy, dgu, n, f, dbl)"},
    {"ce_fwd", py_ce_fwd, METH_VARARGS, "ce_fwd(logits, targets int64, probs, nll, n, V, dbl)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_fused", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fused(void) { return PyModule_Create(&moddef); }
