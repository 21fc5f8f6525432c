/* ringzero.comm._quant: blockwise symmetric int8 / int4 quantize and dequantize(+accumulate) on the host.
 *
 * What it is: two loops over contiguous buffers for ringzero/comm/quant.py, which checks dtypes
 * and lengths before calling in here. The arithmetic is quant.py's, one IEEE float32 operation
 * at a time, so the bits are the NumPy path's:
 *     scale = absmax(block) / qmax            (NaN if the block holds one; Inf if an Inf)
 *     code  = rint(clamp(x / scale, -qmax, qmax)), or 0 where scale is 0 or not finite
 *     value = (float)code * scale;  out = value, or out = out + value (no fused multiply-add:
 *             setup.py builds with -ffp-contract=off)
 * rint rounds ties to even (RZ_MAGIC below), as NumPy's rint. int4 codes are packed two per byte,
 * element 2i in the low nibble, as (c & 15). Each block is widened once into a scratch of one
 * block (fp16, bf16) and its loops vectorize; the per-call scratch is the only allocation.
 *
 * What it is not: a dtype dispatcher or a ufunc. Inputs are float32, float16 (widened with
 * f16_bits.h, exact) or bfloat16 (the high half of a float32, exact) by a dtype code; the
 * dequantized output is float32 only (quant.py casts to fp16 / bf16 with NumPy, as its own path
 * does). Built optionally; without it quant.py uses NumPy and the answers stay the same.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "f16_bits.h"

/* rint for |q| <= qmax: adding and subtracting 1.5 * 2^23 rounds to an integer, ties to even, in
 * the default rounding mode (the same as rintf, which is a libm call without SSE4.1; this
 * vectorizes). Exact for |q| < 2^22; q is clamped to [-127, 127] first, which commutes with the
 * rounding since the bounds are integers. */
#define RZ_MAGIC 12582912.0f

/* block j's elements as float32: x itself (dt 0), or widened into tmp (bf16: the high half) */
static const float *widen(const void *x, int dt, Py_ssize_t j, Py_ssize_t n, float *tmp)
{
    if (dt == 0) return (const float *)x + j;
    const uint16_t *h = (const uint16_t *)x + j;
    if (dt == 1) for (Py_ssize_t i = 0; i < n; i++) tmp[i] = bits_to_f32(h2f_bits(h[i]));
    else for (Py_ssize_t i = 0; i < n; i++) tmp[i] = bits_to_f32((uint32_t)h[i] << 16);
    return tmp;
}

static float block_scale(const float *p, Py_ssize_t n, float qmax)
{
    /* |x|'s bits order as |x| does (sign cleared), so an integer max finds max |x| and vectorizes;
     * bits above Inf's are a NaN's */
    uint32_t mb = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t u = f32_to_bits(p[i]) & 0x7fffffffu;
        mb = u > mb ? u : mb;
    }
    if (mb > 0x7f800000u)                        /* the block's first NaN, as NumPy's max keeps it */
        for (Py_ssize_t i = 0; i < n; i++) {
            uint32_t u = f32_to_bits(p[i]) & 0x7fffffffu;
            if (u > 0x7f800000u) { mb = u; break; }
        }
    return bits_to_f32(mb) / qmax;
}

static void quantize(const void *x, int dt, Py_ssize_t L, Py_ssize_t B, int bits, void *codes, float *scales,
                     float *tmp, int8_t *c)
{
    const float qmax = bits == 8 ? 127.0f : 7.0f;
    uint8_t *c4 = codes;
    if (bits == 4) memset(c4, 0, (size_t)(L + 1) / 2);
    for (Py_ssize_t j = 0, b = 0; j < L; j += B, b++) {
        Py_ssize_t n = j + B < L ? B : L - j;
        const float *p = widen(x, dt, j, n, tmp);
        float s = block_scale(p, n, qmax);
        scales[b] = s;
        int8_t *o = bits == 8 ? (int8_t *)codes + j : c;
        if (!(s > 0.0f) || isinf(s)) memset(o, 0, (size_t)n);   /* zero and non-finite blocks: codes 0 */
        else
            for (Py_ssize_t i = 0; i < n; i++) {
                float q = p[i] / s;
                q = q > qmax ? qmax : q;
                q = q < -qmax ? -qmax : q;
                o[i] = (int8_t)((q + RZ_MAGIC) - RZ_MAGIC);
            }
        if (bits == 4) {                         /* pack: element 2i low nibble, 2i+1 high */
            Py_ssize_t i = 0;
            if (j & 1) c4[j >> 1] |= (uint8_t)((o[i++] & 15) << 4);     /* a block that starts mid-byte */
            uint8_t *cb = c4 + ((j + i) >> 1);
            Py_ssize_t pairs = (n - i) / 2;
            for (Py_ssize_t k = 0; k < pairs; k++)
                cb[k] = (uint8_t)((o[i + 2 * k] & 15) | ((o[i + 2 * k + 1] & 15) << 4));
            i += 2 * pairs;
            if (i < n) cb[pairs] = (uint8_t)(o[i] & 15);
        }
    }
}

static void dequantize(const void *codes, const float *scales, Py_ssize_t L, Py_ssize_t B, int bits,
                       float *out, int add)
{
    const int8_t *c8 = codes;
    const uint8_t *c4 = codes;
    for (Py_ssize_t j = 0, b = 0; j < L; j += B, b++) {
        Py_ssize_t e = j + B < L ? j + B : L;
        float s = scales[b];
        if (bits == 8 && add) for (Py_ssize_t i = j; i < e; i++) out[i] = out[i] + (float)c8[i] * s;
        else if (bits == 8) for (Py_ssize_t i = j; i < e; i++) out[i] = (float)c8[i] * s;
        else {
            Py_ssize_t i = j;
            if (i & 1) {                         /* a block that starts mid-byte: its first element */
                float v = (float)((int8_t)c4[i >> 1] >> 4) * s;
                out[i] = add ? out[i] + v : v;
                i++;
            }
            const uint8_t *cb = c4 + (i >> 1);
            Py_ssize_t pairs = (e - i) / 2;
            for (Py_ssize_t k = 0; k < pairs; k++) {   /* low nibble, then high, each sign-extended */
                float lo = (float)((int8_t)(cb[k] << 4) >> 4) * s, hi = (float)((int8_t)cb[k] >> 4) * s;
                out[i + 2 * k] = add ? out[i + 2 * k] + lo : lo;
                out[i + 2 * k + 1] = add ? out[i + 2 * k + 1] + hi : hi;
            }
            i += 2 * pairs;
            if (i < e) {
                float v = (float)((int8_t)(c4[i >> 1] << 4) >> 4) * s;
                out[i] = add ? out[i] + v : v;
            }
        }
    }
}

/* ---- Python glue --------------------------------------------------------- */

static int get_buf(PyObject *obj, Py_buffer *v, int writable, const char *what)
{
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, v, flags) < 0) {
        PyErr_Format(PyExc_TypeError, "%s: expected a C-contiguous%s buffer", what, writable ? " writable" : "");
        return -1;
    }
    return 0;
}

static Py_ssize_t code_bytes(Py_ssize_t L, int bits) { return bits == 8 ? L : (L + 1) / 2; }

/* quantize(x, dt, block, bits, codes, scales): L = len(x) elements of dtype code dt. */
static PyObject *py_quantize(PyObject *self, PyObject *args)
{
    PyObject *x, *codes, *scales; int dt, bits; Py_ssize_t B;
    Py_buffer vx, vc, vs;
    if (!PyArg_ParseTuple(args, "OiniOO", &x, &dt, &B, &bits, &codes, &scales)) return NULL;
    if (get_buf(x, &vx, 0, "x") < 0) return NULL;
    if (get_buf(codes, &vc, 1, "codes") < 0) { PyBuffer_Release(&vx); return NULL; }
    if (get_buf(scales, &vs, 1, "scales") < 0) { PyBuffer_Release(&vx); PyBuffer_Release(&vc); return NULL; }
    Py_ssize_t L = vx.len / (dt == 0 ? 4 : 2);
    if (B < 1 || (bits != 8 && bits != 4) || dt < 0 || dt > 2 || vc.len != code_bytes(L, bits)
            || vs.len != 4 * ((L + B - 1) / B)) {
        PyErr_Format(PyExc_ValueError, "_quant.quantize: expected %zd code bytes and %zd scale bytes for %zd "
                     "elements, got %zd and %zd", code_bytes(L, bits), 4 * ((L + B - 1) / (B < 1 ? 1 : B)), L,
                     vc.len, vs.len);
        PyBuffer_Release(&vx); PyBuffer_Release(&vc); PyBuffer_Release(&vs); return NULL;
    }
    Py_ssize_t nt = B < L ? B : L;                /* one block's widened values and codes */
    float *tmp = PyMem_RawMalloc((size_t)(nt > 0 ? nt : 1) * (sizeof(float) + 1));
    if (!tmp) { PyBuffer_Release(&vx); PyBuffer_Release(&vc); PyBuffer_Release(&vs); return PyErr_NoMemory(); }
    Py_BEGIN_ALLOW_THREADS
    quantize(vx.buf, dt, L, B, bits, vc.buf, vs.buf, tmp, (int8_t *)(tmp + (nt > 0 ? nt : 1)));
    Py_END_ALLOW_THREADS
    PyMem_RawFree(tmp);
    PyBuffer_Release(&vx); PyBuffer_Release(&vc); PyBuffer_Release(&vs);
    Py_RETURN_NONE;
}

/* dequantize(codes, scales, block, bits, out, add): out float32 of L elements. */
static PyObject *py_dequantize(PyObject *self, PyObject *args)
{
    PyObject *codes, *scales, *out; int bits, add; Py_ssize_t B;
    Py_buffer vc, vs, vo;
    if (!PyArg_ParseTuple(args, "OOniOp", &codes, &scales, &B, &bits, &out, &add)) return NULL;
    if (get_buf(codes, &vc, 0, "codes") < 0) return NULL;
    if (get_buf(scales, &vs, 0, "scales") < 0) { PyBuffer_Release(&vc); return NULL; }
    if (get_buf(out, &vo, 1, "out") < 0) { PyBuffer_Release(&vc); PyBuffer_Release(&vs); return NULL; }
    Py_ssize_t L = vo.len / 4;
    if (B < 1 || (bits != 8 && bits != 4) || vc.len != code_bytes(L, bits) || vs.len != 4 * ((L + B - 1) / B)) {
        PyErr_Format(PyExc_ValueError, "_quant.dequantize: expected %zd code bytes for %zd elements, got %zd",
                     code_bytes(L, bits), L, vc.len);
        PyBuffer_Release(&vc); PyBuffer_Release(&vs); PyBuffer_Release(&vo); return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    dequantize(vc.buf, vs.buf, L, B, bits, vo.buf, add);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&vc); PyBuffer_Release(&vs); PyBuffer_Release(&vo);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"quantize", py_quantize, METH_VARARGS,
     "quantize(x, dt, block, bits, codes, scales): dt 0 float32, 1 float16, 2 bfloat16 bits."},
    {"dequantize", py_dequantize, METH_VARARGS,
     "dequantize(codes, scales, block, bits, out, add): out float32 = values, or += values if add."},
    {NULL, NULL, 0, NULL}
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_quant", NULL, -1, methods};

PyMODINIT_FUNC PyInit__quant(void) { return PyModule_Create(&moddef); }
