/* The causal attention of one GPT layer, one (batch row, head) at a time, on the host.
 *
 * Included by fused.c (one extension module: these kernels call its causal softmax rows and
 * use its vector types and Python glue); not a header of its own API.
 *
 * What it is: the two products of each direction of causal self-attention, with the softmax
 * between them, per (b, h), reading q, k, v straight out of the fused qkv buffer (B, T, 3C) and
 * writing the heads side by side into (B, T, C):
 *
 *   forward   att = softmax(q k^T * scale, causal)     (T, T), kept for the backward
 *             y   = att v                              (T, D)
 *   backward  dv  = att^T dy
 *             ds  = softmax_backward(dy v^T, att) * scale    (T, T) scratch, one head
 *             dq  = ds k,  dk = ds^T q
 *
 * Why: at T = 128, D = 32 each product is 32 small GEMMs per layer and direction. Through
 * numpy.matmul every head is a BLAS call on 64-row blocks (~1,500 calls per step at width
 * 128); here one call does them all, a head's (T, T) block stays in L2 between its three
 * passes, and the products skip the tiles above the diagonal in 4-row blocks, not 64.
 *
 * The products are three register-blocked forms over GCC vector extensions (V: W lanes, 8
 * floats or 4 doubles; 16 floats where the CPU has AVX-512), 4 rows x 2 vectors of
 * accumulators, one accumulator per output element summed over the contraction index in
 * ascending order: so every element is the same sequential sum whatever the blocking or the
 * vector width, the clones (avx512f at W = 16; avx2, default at W = 8) give the same bits, and a
 * run gives the same bits at every stage. (Multiplies and adds stay separate: the file is built
 * with -ffp-contract=off.)
 *
 *   scores  s[t, j]  = sum_d x[t, d] y[j, d]          j < the row block's end, rounded up to W
 *   rowmix  o[t, :]  = sum_{j < t0 + 4} p[t, j] z[j, :]     (p is 0 above the diagonal)
 *   colmix  o[j, :]  = sum_{t >= j0} p[t, j] z[t, :]        (likewise)
 *
 * The softmax rows read only j <= t of the scores and write 0 above the diagonal, so the
 * entries never computed are never read; rowmix and colmix add exact zeros past the diagonal
 * of their block. Requires T % W == 0 and D % W == 0 (fused.py checks W = 8 for float32, 4 for
 * float64; other shapes take the NumPy products). At (B, T, H, D) = (8, 128, 4, 32) on a Zen 4
 * core: forward 0.84 ms, backward 1.2 ms per layer, against 0.98 and 1.9 ms at W = 8 (the
 * softmax 0.3 ms of the forward).
 */

typedef double v4d __attribute__((vector_size(32)));
typedef float v16f __attribute__((vector_size(64)));

#define DEFINE_ATTN(T, S, V, W, SOFTMAX, SOFTMAX_BWD, TARGET)                                             \
static inline __attribute__((always_inline)) V ldv_##S(const T *p) { V v; memcpy(&v, p, sizeof v); return v; } \
static inline __attribute__((always_inline)) void stv_##S(T *p, V v) { memcpy(p, &v, sizeof v); }           \
                                                                                                \
/* s (Tn, Tn), rows t0..t0+3 together: s[t, j] = sum_d x[t, d] y[j, d] for j < ceil_W(t0 + 4); \
 * x, y rows at strides sx, sy; kt (D, Tn) scratch: y transposed, so 2 vectors of keys load at once */ \
static inline __attribute__((always_inline)) void att_scores_##S(                               \
    const T *restrict x, ix sx, const T *restrict y, ix sy, T *restrict kt, T *restrict s, ix Tn, ix D) \
{                                                                                               \
    for (ix j = 0; j < Tn; j++)                                                                 \
        for (ix d = 0; d < D; d++) kt[d * Tn + j] = y[j * sy + d];                              \
    for (ix t0 = 0; t0 < Tn; t0 += 4) {                                                         \
        const T *x0 = x + t0 * sx, *x1 = x0 + sx, *x2 = x1 + sx, *x3 = x2 + sx;                 \
        T *s0 = s + t0 * Tn, *s1 = s0 + Tn, *s2 = s1 + Tn, *s3 = s2 + Tn;                       \
        ix ne = (t0 + 4 + W - 1) / W * W, j = 0;                                                \
        for (; j + 2 * W <= ne; j += 2 * W) {                                                   \
            V a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};   \
            for (ix d = 0; d < D; d++) {                                                        \
                V k0 = ldv_##S(kt + d * Tn + j), k1 = ldv_##S(kt + d * Tn + j + W);             \
                T q0 = x0[d], q1 = x1[d], q2 = x2[d], q3 = x3[d];                               \
                a0 += q0 * k0; a1 += q1 * k0; a2 += q2 * k0; a3 += q3 * k0;                     \
                b0 += q0 * k1; b1 += q1 * k1; b2 += q2 * k1; b3 += q3 * k1;                     \
            }                                                                                   \
            stv_##S(s0 + j, a0); stv_##S(s1 + j, a1); stv_##S(s2 + j, a2); stv_##S(s3 + j, a3); \
            stv_##S(s0 + j + W, b0); stv_##S(s1 + j + W, b1);                                   \
            stv_##S(s2 + j + W, b2); stv_##S(s3 + j + W, b3);                                   \
        }                                                                                       \
        for (; j < ne; j += W) {                                                                \
            V a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};                                           \
            for (ix d = 0; d < D; d++) {                                                        \
                V k0 = ldv_##S(kt + d * Tn + j);                                                \
                a0 += x0[d] * k0; a1 += x1[d] * k0; a2 += x2[d] * k0; a3 += x3[d] * k0;         \
            }                                                                                   \
            stv_##S(s0 + j, a0); stv_##S(s1 + j, a1); stv_##S(s2 + j, a2); stv_##S(s3 + j, a3); \
        }                                                                                       \
    }                                                                                           \
}                                                                                               \
                                                                                                \
/* o[t, :] = sum_{j < t0 + 4} p[t, j] z[j, :], rows t0..t0+3 together; p (Tn, Tn), z and o rows \
 * at strides sz, so */                                                                         \
static inline __attribute__((always_inline)) void att_rowmix_##S(                               \
    const T *restrict p, const T *restrict z, ix sz, T *restrict o, ix so, ix Tn, ix D)        \
{                                                                                               \
    for (ix t0 = 0; t0 < Tn; t0 += 4) {                                                         \
        const T *p0 = p + t0 * Tn, *p1 = p0 + Tn, *p2 = p1 + Tn, *p3 = p2 + Tn;                 \
        T *o0 = o + t0 * so, *o1 = o0 + so, *o2 = o1 + so, *o3 = o2 + so;                       \
        ix ne = t0 + 4, c = 0;                                                                  \
        for (; c + 2 * W <= D; c += 2 * W) {                                                    \
            V a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};   \
            for (ix j = 0; j < ne; j++) {                                                       \
                V z0 = ldv_##S(z + j * sz + c), z1 = ldv_##S(z + j * sz + c + W);               \
                T w0 = p0[j], w1 = p1[j], w2 = p2[j], w3 = p3[j];                               \
                a0 += w0 * z0; a1 += w1 * z0; a2 += w2 * z0; a3 += w3 * z0;                     \
                b0 += w0 * z1; b1 += w1 * z1; b2 += w2 * z1; b3 += w3 * z1;                     \
            }                                                                                   \
            stv_##S(o0 + c, a0); stv_##S(o1 + c, a1); stv_##S(o2 + c, a2); stv_##S(o3 + c, a3); \
            stv_##S(o0 + c + W, b0); stv_##S(o1 + c + W, b1);                                   \
            stv_##S(o2 + c + W, b2); stv_##S(o3 + c + W, b3);                                   \
        }                                                                                       \
        for (; c < D; c += W) {                                                                 \
            V a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};                                           \
            for (ix j = 0; j < ne; j++) {                                                       \
                V z0 = ldv_##S(z + j * sz + c);                                                 \
                a0 += p0[j] * z0; a1 += p1[j] * z0; a2 += p2[j] * z0; a3 += p3[j] * z0;         \
            }                                                                                   \
            stv_##S(o0 + c, a0); stv_##S(o1 + c, a1); stv_##S(o2 + c, a2); stv_##S(o3 + c, a3); \
        }                                                                                       \
    }                                                                                           \
}                                                                                               \
                                                                                                \
/* o[j, :] = sum_{t >= j0} p[t, j] z[t, :], rows j0..j0+3 of o together (p^T z) */             \
static inline __attribute__((always_inline)) void att_colmix_##S(                               \
    const T *restrict p, const T *restrict z, ix sz, T *restrict o, ix so, ix Tn, ix D)        \
{                                                                                               \
    for (ix j0 = 0; j0 < Tn; j0 += 4) {                                                         \
        T *o0 = o + j0 * so, *o1 = o0 + so, *o2 = o1 + so, *o3 = o2 + so;                       \
        ix c = 0;                                                                               \
        for (; c + 2 * W <= D; c += 2 * W) {                                                    \
            V a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};   \
            for (ix t = j0; t < Tn; t++) {                                                      \
                const T *pr = p + t * Tn + j0;                                                  \
                V z0 = ldv_##S(z + t * sz + c), z1 = ldv_##S(z + t * sz + c + W);               \
                T w0 = pr[0], w1 = pr[1], w2 = pr[2], w3 = pr[3];                               \
                a0 += w0 * z0; a1 += w1 * z0; a2 += w2 * z0; a3 += w3 * z0;                     \
                b0 += w0 * z1; b1 += w1 * z1; b2 += w2 * z1; b3 += w3 * z1;                     \
            }                                                                                   \
            stv_##S(o0 + c, a0); stv_##S(o1 + c, a1); stv_##S(o2 + c, a2); stv_##S(o3 + c, a3); \
            stv_##S(o0 + c + W, b0); stv_##S(o1 + c + W, b1);                                   \
            stv_##S(o2 + c + W, b2); stv_##S(o3 + c + W, b3);                                   \
        }                                                                                       \
        for (; c < D; c += W) {                                                                 \
            V a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};                                           \
            for (ix t = j0; t < Tn; t++) {                                                      \
                const T *pr = p + t * Tn + j0;                                                  \
                V z0 = ldv_##S(z + t * sz + c);                                                 \
                a0 += pr[0] * z0; a1 += pr[1] * z0; a2 += pr[2] * z0; a3 += pr[3] * z0;         \
            }                                                                                   \
            stv_##S(o0 + c, a0); stv_##S(o1 + c, a1); stv_##S(o2 + c, a2); stv_##S(o3 + c, a3); \
        }                                                                                       \
    }                                                                                           \
}                                                                                               \
                                                                                                \
/* qkv (B, Tn, 3C) -> att (B, H, Tn, Tn), yh (B, Tn, C); kt (D, Tn) scratch */                  \
TARGET static void attn_fwd_##S(const T *restrict qkv, T *restrict att, T *restrict yh,     \
                                   T *restrict kt, ix B, ix Tn, ix H, ix D, T scale)            \
{                                                                                               \
    ix C = H * D, s3 = 3 * C;                                                                   \
    for (ix b = 0; b < B; b++)                                                                  \
        for (ix h = 0; h < H; h++) {                                                            \
            const T *q = qkv + b * Tn * s3 + h * D;                                             \
            T *a = att + (b * H + h) * Tn * Tn;                                                 \
            att_scores_##S(q, s3, q + C, s3, kt, a, Tn, D);              /* q k^T */             \
            SOFTMAX(a, 1, Tn, scale);                                                           \
            att_rowmix_##S(a, q + 2 * C, s3, yh + b * Tn * C + h * D, C, Tn, D);   /* att v */   \
        }                                                                                       \
}                                                                                               \
                                                                                                \
/* dyh (B, Tn, C), qkv, att -> dqkv (B, Tn, 3C) (every element written); ds (Tn, Tn),         \
 * kt (D, Tn), tmp (Tn,) scratch */                                                            \
TARGET static void attn_bwd_##S(const T *restrict qkv, const T *restrict att, const T *restrict dyh, \
                                   T *restrict dqkv, T *restrict ds, T *restrict kt, T *restrict tmp, \
                                   ix B, ix Tn, ix H, ix D, T scale)                             \
{                                                                                               \
    ix C = H * D, s3 = 3 * C;                                                                   \
    for (ix b = 0; b < B; b++)                                                                  \
        for (ix h = 0; h < H; h++) {                                                            \
            const T *q = qkv + b * Tn * s3 + h * D, *dy = dyh + b * Tn * C + h * D;             \
            const T *a = att + (b * H + h) * Tn * Tn;                                           \
            T *dq = dqkv + b * Tn * s3 + h * D;                                                 \
            att_colmix_##S(a, dy, C, dq + 2 * C, s3, Tn, D);             /* dv = att^T dy */     \
            att_scores_##S(dy, C, q + 2 * C, s3, kt, ds, Tn, D);         /* datt = dy v^T */     \
            SOFTMAX_BWD(ds, a, tmp, 1, Tn, scale);                       /* ds, scaled */        \
            att_rowmix_##S(ds, q + C, s3, dq, s3, Tn, D);                /* dq = ds k */         \
            att_colmix_##S(ds, q, s3, dq + C, s3, Tn, D);                /* dk = ds^T q */       \
        }                                                                                       \
}

DEFINE_ATTN(float, f, v8f, 8, softmax_causal_f8, softmax_causal_bwd_f, RZ_CLONES)
DEFINE_ATTN(double, d, v4d, 4, softmax_causal_d, softmax_causal_bwd_d, RZ_CLONES)

/* float32 over 16-float vectors where the CPU has AVX-512 and T % 16 == D % 16 == 0: the same
 * sums in the same order as attn_*_f, so the same bits, in half the instructions (32 zmm
 * registers hold the 4 x 2 blocks; an AVX2 build of 16-float blocks would spill). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define RZ_AVX512 1
DEFINE_ATTN(float, f16, v16f, 16, softmax_causal_f8, softmax_causal_bwd_f, __attribute__((target("avx512f"))))
static int rz_wide(ix Tn, ix D) { return Tn % 16 == 0 && D % 16 == 0 && __builtin_cpu_supports("avx512f"); }
#else
static int rz_wide(ix Tn, ix D) { (void)Tn; (void)D; return 0; }
#endif
