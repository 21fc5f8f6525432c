/* ringzero._f16: float16 <-> float32 conversion and float16 addition.
 *
 * What it is: three loops over contiguous buffers, used by ringzero/comm/kernels.py
 * (which checks dtypes and lengths before calling in here). A float16 sum is
 * done as "widen both operands to float32, add once in float32, round once to
 * float16 (round-to-nearest-even)", which is what NumPy's own float16 add does,
 * so the results are bitwise equal to the NumPy fallback, NaN payloads included.
 *
 * What it is not: a general ufunc. No strides, no broadcasting, no dtype
 * dispatch. Built optionally by setup.py; without a compiler, kernels.py uses
 * NumPy and the answers stay the same (only slower).
 *
 * Two paths, chosen at run time: F16C+AVX (8 lanes per instruction) when the
 * CPU has them, portable scalar C otherwise. The vector path hands any group of
 * 8 that holds a NaN to the scalar path, because the hardware conversion
 * quiets signalling NaNs and NumPy keeps them as they are.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#if defined(__GNUC__) || defined(__clang__)
#define RZ_X86 1
#include <immintrin.h>
#endif
#endif

/* ---- scalar conversions (bit-exact with NumPy's float16 rules) ---------- */

#include "f16_bits.h"

static void h2f_scalar(const uint16_t *s, float *o, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) o[i] = bits_to_f32(h2f_bits(s[i]));
}

static void f2h_scalar(const float *s, uint16_t *o, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) o[i] = f2h_bits(f32_to_bits(s[i]));
}

static void addh_scalar(const uint16_t *a, const uint16_t *b, uint16_t *o, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        /* A NaN operand decides the result explicitly (the second one if both
         * are NaN, quietened), as NumPy's float16 add gives on this platform;
         * left to the compiler, the payload would depend on operand order. */
        if ((b[i] & 0x7fffu) > 0x7c00u) { o[i] = b[i] | 0x200u; continue; }
        if ((a[i] & 0x7fffu) > 0x7c00u) { o[i] = a[i] | 0x200u; continue; }
        float x = bits_to_f32(h2f_bits(a[i])), y = bits_to_f32(h2f_bits(b[i]));
        o[i] = f2h_bits(f32_to_bits(x + y));
    }
}

/* ---- F16C + AVX path ----------------------------------------------------- */
#ifdef RZ_X86
#define RZ_TARGET __attribute__((target("avx,f16c")))

/* lanes whose float16 is a NaN: exponent all ones, mantissa non-zero */
RZ_TARGET static inline int h_nan_mask(__m128i h)
{
    __m128i mag = _mm_and_si128(h, _mm_set1_epi16(0x7fff));
    return _mm_movemask_epi8(_mm_cmpgt_epi16(mag, _mm_set1_epi16(0x7c00)));
}

RZ_TARGET static void h2f_f16c(const uint16_t *s, float *o, Py_ssize_t n)
{
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm_loadu_si128((const __m128i *)(s + i));
        if (h_nan_mask(h)) { h2f_scalar(s + i, o + i, 8); continue; }
        _mm256_storeu_ps(o + i, _mm256_cvtph_ps(h));
    }
    h2f_scalar(s + i, o + i, n - i);
}

RZ_TARGET static void f2h_f16c(const float *s, uint16_t *o, Py_ssize_t n)
{
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(s + i);
        if (_mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q))) { f2h_scalar(s + i, o + i, 8); continue; }
        _mm_storeu_si128((__m128i *)(o + i), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    f2h_scalar(s + i, o + i, n - i);
}

RZ_TARGET static void addh_f16c(const uint16_t *a, const uint16_t *b, uint16_t *o, Py_ssize_t n)
{
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i ha = _mm_loadu_si128((const __m128i *)(a + i));
        __m128i hb = _mm_loadu_si128((const __m128i *)(b + i));
        __m256 s = _mm256_add_ps(_mm256_cvtph_ps(ha), _mm256_cvtph_ps(hb));
        if (h_nan_mask(ha) | h_nan_mask(hb) | _mm256_movemask_ps(_mm256_cmp_ps(s, s, _CMP_UNORD_Q))) {
            addh_scalar(a + i, b + i, o + i, 8);   /* o may alias a: per-lane read-before-write */
            continue;
        }
        _mm_storeu_si128((__m128i *)(o + i), _mm256_cvtps_ph(s, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    addh_scalar(a + i, b + i, o + i, n - i);
}

static int have_f16c(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
}
#else
static int have_f16c(void) { return 0; }
#endif

static int use_simd = 0;

/* ---- Python glue --------------------------------------------------------- */

/* Borrow a C-contiguous buffer of exactly `nbytes` bytes (writable if asked). */
static int get_buf(PyObject *obj, Py_buffer *v, int writable, const char *what)
{
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, v, flags) < 0) {
        PyErr_Format(PyExc_TypeError, "%s: expected a C-contiguous%s buffer", what, writable ? " writable" : "");
        return -1;
    }
    return 0;
}

static PyObject *py_f16_to_f32(PyObject *self, PyObject *args)
{
    PyObject *src, *out; Py_buffer vs, vo;
    if (!PyArg_ParseTuple(args, "OO", &src, &out)) return NULL;
    if (get_buf(src, &vs, 0, "src") < 0) return NULL;
    if (get_buf(out, &vo, 1, "out") < 0) { PyBuffer_Release(&vs); return NULL; }
    Py_ssize_t n = vs.len / 2;
    if (vs.len % 2 || vo.len != 4 * n) {
        PyErr_Format(PyExc_ValueError, "f16_to_f32: expected out of %zd bytes for src of %zd bytes, got %zd", 4 * n, vs.len, vo.len);
        PyBuffer_Release(&vs); PyBuffer_Release(&vo); return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
#ifdef RZ_X86
    if (use_simd) h2f_f16c(vs.buf, vo.buf, n); else
#endif
    h2f_scalar(vs.buf, vo.buf, n);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&vs); PyBuffer_Release(&vo);
    Py_RETURN_NONE;
}

static PyObject *py_f32_to_f16(PyObject *self, PyObject *args)
{
    PyObject *src, *out; Py_buffer vs, vo;
    if (!PyArg_ParseTuple(args, "OO", &src, &out)) return NULL;
    if (get_buf(src, &vs, 0, "src") < 0) return NULL;
    if (get_buf(out, &vo, 1, "out") < 0) { PyBuffer_Release(&vs); return NULL; }
    Py_ssize_t n = vs.len / 4;
    if (vs.len % 4 || vo.len != 2 * n) {
        PyErr_Format(PyExc_ValueError, "f32_to_f16: expected out of %zd bytes for src of %zd bytes, got %zd", 2 * n, vs.len, vo.len);
        PyBuffer_Release(&vs); PyBuffer_Release(&vo); return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
#ifdef RZ_X86
    if (use_simd) f2h_f16c(vs.buf, vo.buf, n); else
#endif
    f2h_scalar(vs.buf, vo.buf, n);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&vs); PyBuffer_Release(&vo);
    Py_RETURN_NONE;
}

static PyObject *py_add_f16(PyObject *self, PyObject *args)
{
    PyObject *a, *b, *out; Py_buffer va, vb, vo;
    if (!PyArg_ParseTuple(args, "OOO", &a, &b, &out)) return NULL;
    if (get_buf(a, &va, 0, "a") < 0) return NULL;
    if (get_buf(b, &vb, 0, "b") < 0) { PyBuffer_Release(&va); return NULL; }
    if (get_buf(out, &vo, 1, "out") < 0) { PyBuffer_Release(&va); PyBuffer_Release(&vb); return NULL; }
    if (va.len % 2 || vb.len != va.len || vo.len != va.len) {
        PyErr_Format(PyExc_ValueError, "add_f16: expected a, b, out of equal even byte lengths, got %zd, %zd, %zd", va.len, vb.len, vo.len);
        PyBuffer_Release(&va); PyBuffer_Release(&vb); PyBuffer_Release(&vo); return NULL;
    }
    Py_ssize_t n = va.len / 2;
    Py_BEGIN_ALLOW_THREADS
#ifdef RZ_X86
    if (use_simd) addh_f16c(va.buf, vb.buf, vo.buf, n); else
#endif
    addh_scalar(va.buf, vb.buf, vo.buf, n);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&va); PyBuffer_Release(&vb); PyBuffer_Release(&vo);
    Py_RETURN_NONE;
}

/* set_simd(flag) -> bool: choose the path (tests run both); returns whether
 * the vector path is now on (False when the CPU lacks F16C/AVX). */
static PyObject *py_set_simd(PyObject *self, PyObject *arg)
{
    int want = PyObject_IsTrue(arg);
    if (want < 0) return NULL;
    use_simd = want && have_f16c();
    return PyBool_FromLong(use_simd);
}

static PyMethodDef methods[] = {
    {"f16_to_f32", py_f16_to_f32, METH_VARARGS, "f16_to_f32(src, out): widen float16 bytes to float32."},
    {"f32_to_f16", py_f32_to_f16, METH_VARARGS, "f32_to_f16(src, out): round float32 to float16, nearest-even."},
    {"add_f16", py_add_f16, METH_VARARGS, "add_f16(a, b, out): float16 sum via one float32 add and one rounding."},
    {"set_simd", py_set_simd, METH_O, "set_simd(flag) -> bool: use the F16C path if the CPU has it."},
    {NULL, NULL, 0, NULL}
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_f16", NULL, -1, methods};

PyMODINIT_FUNC PyInit__f16(void)
{
    PyObject *m = PyModule_Create(&moddef);
    if (!m) return NULL;
    use_simd = have_f16c();
    if (PyModule_AddIntConstant(m, "HAVE_F16C", have_f16c()) < 0) { Py_DECREF(m); return NULL; }
    return m;
}
