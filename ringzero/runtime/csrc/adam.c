/* ringzero.runtime._adam: AdamW in one pass over memory, for the offloaded update.
 *
 * What it is: adamw(master, m, v, grads, params, coef, b1, c1, b2, c2, shrink,
 * inv_bc2, eps, step) updates n fp32 elements of master, m and v in place from
 * the storage-dtype gradient (fp32, fp16 or bf16, widened here and scaled by
 * coef), and writes the new master, cast to the params' storage dtype, into
 * params (or nothing when params is None). ringzero/runtime/optim.py's
 * AdamW.update_tile calls it on each tile of the stream (stream.py), and holds
 * the NumPy path it must equal.
 *
 * Bitwise equal to the NumPy update: every operation is an IEEE float32
 * operation in the NumPy path's order, on the float32 constants it uses
 * (the caller passes them already rounded to float32):
 *     g  = widen(grad) * coef
 *     m  = m * b1 + g * c1                 (m *= b1; tmp = g * c1; m += tmp)
 *     v  = v * b2 + (g * g) * c2
 *     p  = p * shrink                      (decayed runs only; shrink = 1 - lr*wd)
 *     p  = p - (m / (sqrt(v * inv_bc2) + eps)) * step      (step = lr / bc1)
 * The file is built with -ffp-contract=off and no fast-math, so the compiler
 * vectorizes the loop but never fuses a multiply into an add nor reorders one;
 * sqrtf and the division are correctly rounded, as NumPy's are. The casts are
 * round-to-nearest-even: fp16 as NumPy's astype (F16C where the CPU has it,
 * the scalar rule of comm/csrc/f16.c otherwise, NaN payloads kept), bf16 as
 * ml_dtypes' (a NaN becomes the quiet NaN of its sign).
 *
 * Work goes in blocks of BLK elements: the gradient is widened into a stack
 * block, the block updated, the new master narrowed into params, while the
 * block is still in L1. One thread; the GIL is released.
 *
 * What it is not: a multi-threaded or general optimizer. No strides.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#define RZ_X86 1
#include <immintrin.h>
#endif
#if defined(RZ_X86) && !defined(__clang__) && defined(__linux__)
#define RZ_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define RZ_CLONES
#endif

#define BLK 512
enum { K_F32 = 0, K_F16 = 1, K_BF16 = 2, K_NONE = 3 };

/* ---- fp16 <-> fp32, NumPy's rules: the Ring's own conversions ------------- */
#include "../../comm/csrc/f16_bits.h"

/* ---- bf16: widen is a shift; narrow rounds to nearest even (ml_dtypes) ------- */
static inline uint16_t f2bf_bits(uint32_t f)
{
    /* branch-free, so the loop vectorizes: a NaN picks the quiet NaN of its sign */
    uint32_t r = (f + 0x7fffu + ((f >> 16) & 1u)) >> 16;
    uint32_t q = (f & 0x80000000u) ? 0xffc0u : 0x7fc0u;
    return (uint16_t)((f & 0x7fffffffu) > 0x7f800000u ? q : r);
}

RZ_CLONES static void f2bf_block(const float *restrict s, uint16_t *restrict o, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) o[i] = f2bf_bits(f32_to_bits(s[i]));
}

RZ_CLONES static void bf2f_block(const uint16_t *restrict s, float *restrict o, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) o[i] = bits_to_f32((uint32_t)s[i] << 16);
}

#ifdef RZ_X86
#define RZ_F16C __attribute__((target("avx,f16c")))
RZ_F16C static void h2f_f16c(const uint16_t *s, float *o, Py_ssize_t n)
{
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i mag = _mm_and_si128(h, _mm_set1_epi16(0x7fff));
        if (_mm_movemask_epi8(_mm_cmpgt_epi16(mag, _mm_set1_epi16(0x7c00)))) break;   /* NaN: scalar */
        _mm256_storeu_ps(o + i, _mm256_cvtph_ps(h));
    }
    for (; i < n; i++) o[i] = bits_to_f32(h2f_bits(s[i]));
}

RZ_F16C static void f2h_f16c(const float *s, uint16_t *o, Py_ssize_t n)
{
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(s + i);
        if (_mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q))) break;
        _mm_storeu_si128((__m128i *)(o + i), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    for (; i < n; i++) o[i] = f2h_bits(f32_to_bits(s[i]));
}
#endif

static int have_f16c = 0;

static void widen(const void *src, int kind, float *o, Py_ssize_t n)
{
    if (kind == K_F32) { memcpy(o, src, (size_t)n * 4); return; }
    const uint16_t *s = (const uint16_t *)src;
    if (kind == K_BF16) { bf2f_block(s, o, n); return; }
#ifdef RZ_X86
    if (have_f16c) { h2f_f16c(s, o, n); return; }
#endif
    for (Py_ssize_t i = 0; i < n; i++) o[i] = bits_to_f32(h2f_bits(s[i]));
}

static void narrow(const float *s, int kind, void *dst, Py_ssize_t n)
{
    if (kind == K_NONE) return;
    if (kind == K_F32) { memcpy(dst, s, (size_t)n * 4); return; }
    uint16_t *o = (uint16_t *)dst;
    if (kind == K_BF16) { f2bf_block(s, o, n); return; }
#ifdef RZ_X86
    if (have_f16c) { f2h_f16c(s, o, n); return; }
#endif
    for (Py_ssize_t i = 0; i < n; i++) o[i] = f2h_bits(f32_to_bits(s[i]));
}

typedef struct { float coef, b1, c1, b2, c2, shrink, inv_bc2, eps, step; int decay; } Consts;

RZ_CLONES static void adam_block(float *restrict p, float *restrict m, float *restrict v,
                                 const float *restrict g0, Py_ssize_t n, const Consts *k)
{
    const float coef = k->coef, b1 = k->b1, c1 = k->c1, b2 = k->b2, c2 = k->c2;
    const float shrink = k->shrink, ib2 = k->inv_bc2, eps = k->eps, step = k->step;
    if (k->decay)
        for (Py_ssize_t i = 0; i < n; i++) p[i] = p[i] * shrink;
    for (Py_ssize_t i = 0; i < n; i++) {
        float g = g0[i] * coef;
        float mi = m[i] * b1;
        mi = mi + g * c1;
        float gg = g * g;
        float vi = v[i] * b2;
        vi = vi + gg * c2;
        m[i] = mi;
        v[i] = vi;
        float d = sqrtf(vi * ib2);
        d = d + eps;
        d = mi / d;
        d = d * step;
        p[i] = p[i] - d;
    }
}

/* ---- Python glue ------------------------------------------------------------ */
static int get_buf(PyObject *o, Py_buffer *v, int writable, Py_ssize_t nbytes, const char *what)
{
    if (PyObject_GetBuffer(o, v, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) {
        PyErr_Format(PyExc_TypeError, "adamw: expected %s to be a C-contiguous%s buffer", what,
                     writable ? " writable" : "");
        return -1;
    }
    if (nbytes >= 0 && v->len != nbytes) {
        PyErr_Format(PyExc_ValueError, "adamw: expected %s of %zd bytes, got %zd", what, nbytes, v->len);
        PyBuffer_Release(v);
        return -1;
    }
    return 0;
}

static PyObject *py_adamw(PyObject *self, PyObject *args)
{
    PyObject *po, *mo, *vo, *go, *oo;
    int gk, ok, decay;
    Consts k;
    if (!PyArg_ParseTuple(args, "OOOOOiifffffffffp", &po, &mo, &vo, &go, &oo, &gk, &ok, &k.coef, &k.b1,
                          &k.c1, &k.b2, &k.c2, &k.shrink, &k.inv_bc2, &k.eps, &k.step, &decay))
        return NULL;
    k.decay = decay;
    if (gk < K_F32 || gk > K_BF16 || ok < K_F32 || ok > K_NONE) {
        PyErr_Format(PyExc_ValueError, "adamw: expected dtype kinds in 0..2 (grads), 0..3 (params), got %d, %d", gk, ok);
        return NULL;
    }
    Py_buffer b[5];
    int got = 0;
    PyObject *res = NULL;
    if (get_buf(po, &b[0], 1, -1, "master") < 0) return NULL;
    got = 1;
    Py_ssize_t n = b[0].len / 4;
    if (get_buf(mo, &b[1], 1, n * 4, "m") < 0) goto done;
    got = 2;
    if (get_buf(vo, &b[2], 1, n * 4, "v") < 0) goto done;
    got = 3;
    if (get_buf(go, &b[3], 0, n * (gk == K_F32 ? 4 : 2), "grads") < 0) goto done;
    got = 4;
    if (ok != K_NONE) {
        if (get_buf(oo, &b[4], 1, n * (ok == K_F32 ? 4 : 2), "params") < 0) goto done;
        got = 5;
    }
    Py_BEGIN_ALLOW_THREADS
    float g[BLK];
    float *p = b[0].buf, *m = b[1].buf, *v = b[2].buf;
    const char *gs = b[3].buf;
    char *os_ = ok != K_NONE ? b[4].buf : NULL;
    Py_ssize_t gi = gk == K_F32 ? 4 : 2, oi = ok == K_F32 ? 4 : 2;
    for (Py_ssize_t i = 0; i < n; i += BLK) {
        Py_ssize_t c = n - i < BLK ? n - i : BLK;
        widen(gs + i * gi, gk, g, c);
        adam_block(p + i, m + i, v + i, g, c, &k);
        if (os_) narrow(p + i, ok, os_ + i * oi, c);
    }
    Py_END_ALLOW_THREADS
    res = Py_None;
    Py_INCREF(res);
done:
    for (int i = 0; i < got; i++) PyBuffer_Release(&b[i]);
    return res;
}

static PyObject *py_set_simd(PyObject *self, PyObject *arg)
{
    int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
#ifdef RZ_X86
    have_f16c = on && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
#endif
    return PyBool_FromLong(have_f16c);
}

static PyMethodDef methods[] = {
    {"adamw", py_adamw, METH_VARARGS, "adamw(master, m, v, grads, params|None, gkind, pkind, coef, b1, c1, b2, "
                                      "c2, shrink, inv_bc2, eps, step, decay): one fused AdamW pass"},
    {"set_simd", py_set_simd, METH_O, "use the F16C casts where the CPU has them (True) or the scalar ones"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_adam", NULL, -1, methods};

PyMODINIT_FUNC PyInit__adam(void)
{
#ifdef RZ_X86
    __builtin_cpu_init();
    have_f16c = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
#endif
    return PyModule_Create(&moddef);
}
