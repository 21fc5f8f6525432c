/* ringzero.comm._quant: blockwise symmetric int8 / int4 quantize and dequantize(+accumulate) on the host.
 *
 * What it is: two loops over contiguous buffers for ringzero/comm/quant.py, which checks dtypes
 * and lengths before calling in here. The arithmetic is quant.py's, one IEEE float32 operation
 * at a time, so the bits are the NumPy path's:
 *     scale = absmax(block) / qmax            (NaN if the block holds one; Inf if an Inf)
 *     code  = clamp(rintf(x / scale), -qmax, qmax), or 0 where scale is 0 or not finite
 *     value = (float)code * scale;  out = value, or out = out + value (no fused multiply-add:
 *             setup.py builds with -ffp-contract=off)
 * rintf rounds ties to even in the default rounding mode, as NumPy's rint. int4 codes are packed
 * two per byte, element 2i in the low nibble, as (c & 15).
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

/* element i of x as float32: dt 0 float32, 1 float16, 2 bfloat16 */
static inline float load(const void *x, int dt, Py_ssize_t i)
{
    if (dt == 0) return ((const float *)x)[i];
    if (dt == 1) return bits_to_f32(h2f_bits(((const uint16_t *)x)[i]));
    return bits_to_f32((uint32_t)((const uint16_t *)x)[i] << 16);
}

static void quantize(const void *x, int dt, Py_ssize_t L, Py_ssize_t B, int bits, void *codes, float *scales)
{
    const float qmax = bits == 8 ? 127.0f : 7.0f;
    int8_t *c8 = codes;
    uint8_t *c4 = codes;
    if (bits == 4) memset(c4, 0, (size_t)(L + 1) / 2);
    for (Py_ssize_t j = 0, b = 0; j < L; j += B, b++) {
        Py_ssize_t e = j + B < L ? j + B : L;
        float m = 0.0f, nanv = 0.0f;
        int nan = 0;
        for (Py_ssize_t i = j; i < e; i++) {
            float a = fabsf(load(x, dt, i));
            if (a != a) { if (!nan) nanv = a; nan = 1; }   /* the block's first NaN, as NumPy's max keeps */
            else if (a > m) m = a;
        }
        float s = (nan ? nanv : m) / qmax;
        scales[b] = s;
        int zero = !(s > 0.0f) || isinf(s);
        for (Py_ssize_t i = j; i < e; i++) {
            float q = 0.0f;
            if (!zero) {
                q = rintf(load(x, dt, i) / s);
                q = q > qmax ? qmax : (q < -qmax ? -qmax : q);
            }
            int c = (int)q;
            if (bits == 8) c8[i] = (int8_t)c;
            else c4[i >> 1] |= (uint8_t)((c & 15) << ((i & 1) * 4));
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
        for (Py_ssize_t i = j; i < e; i++) {
            int c;
            if (bits == 8) c = c8[i];
            else {
                c = (c4[i >> 1] >> ((i & 1) * 4)) & 15;
                c = c >= 8 ? c - 16 : c;
            }
            float v = (float)c * s;
            out[i] = add ? out[i] + v : v;
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
    Py_BEGIN_ALLOW_THREADS
    quantize(vx.buf, dt, L, B, bits, vc.buf, vs.buf);
    Py_END_ALLOW_THREADS
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
