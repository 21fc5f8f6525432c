"""Blockwise int8 / int4 quantize and dequantize on a GPU: quant.c's loops as CuPy ElementwiseKernels.

What it is
    The device twin of ``comm/csrc/quant.c`` for ``comm/quant.py``: three kernels, each the C
    loop's arithmetic in its order (one float32 operation at a time, ``--fmad=false`` so NVRTC
    does not contract ``code * scale + out`` into an FMA, ``rintf``: ties to even):

        rz_qscale   one thread per block: scale = absmax / qmax (the block's first NaN if any)
        rz_qcodes8  one thread per element: code = clamp(rintf(x / scale), -qmax, qmax)
        rz_qcodes4  one thread per byte: elements 2i and 2i+1, packed low nibble first
        rz_deq8 / rz_deq4   one thread per element: v = (float)code * scale; out = v or out + v

    Inputs float32 or float16 (CuPy has no bfloat16); outputs float32, or float16 rounded once
    from the float32 value. The absmax is exact in any order, so a parallel reduction would give
    the same scales; the one-thread-per-block loop is the simple first form.

What it is not
    Measured on a device: the CuPy stand-in (tests/cupy_standin) compiles these sources with the
    host's C++ compiler and checks their bits against the NumPy path, not their speed. A block of
    2048 elements read by one thread is uncoalesced; a warp per block is the next step.
"""
from __future__ import annotations

import numpy as np

_TAKES = (np.dtype(np.float32), np.dtype(np.float16))

_SOURCES = {
    "rz_qscale": ("raw X x, int64 L, int64 B, float32 qmax", "float32 s", r"""
        long long j = (long long)i * B, e = j + B < L ? j + B : L;
        float m = 0.0f, nanv = 0.0f;
        bool nan = false;
        for (; j < e; j++) {
            float a = fabsf((float)x[j]);
            if (a != a) { if (!nan) nanv = a; nan = true; }
            else if (a > m) m = a;
        }
        s = (nan ? nanv : m) / qmax;"""),
    "rz_qcodes8": ("X x, raw float32 sc, int64 B, float32 qmax", "int8 c", r"""
        float s = sc[i / B], q = 0.0f;
        if (s > 0.0f && !isinf(s)) {
            q = rintf((float)x / s);
            q = q > qmax ? qmax : (q < -qmax ? -qmax : q);
        }
        c = (signed char)(int)q;"""),
    "rz_qcodes4": ("raw X x, raw float32 sc, int64 L, int64 B", "raw uint8 c", r"""
        int byte = 0;
        for (int h = 0; h < 2; h++) {
            long long k = 2 * (long long)i + h;
            if (k >= L) break;
            float s = sc[k / B], q = 0.0f;
            if (s > 0.0f && !isinf(s)) {
                q = rintf((float)x[k] / s);
                q = q > 7.0f ? 7.0f : (q < -7.0f ? -7.0f : q);
            }
            byte |= ((int)q & 15) << (4 * h);
        }
        c[i] = (unsigned char)byte;"""),
    "rz_deq8": ("raw int8 c, raw float32 sc, int64 B, bool add", "O out", r"""
        float v = (float)c[i] * sc[i / B];
        out = (O)(add ? (float)out + v : v);"""),
    "rz_deq4": ("raw uint8 c, raw float32 sc, int64 B, bool add", "O out", r"""
        int n = (c[i >> 1] >> (4 * (int)(i & 1))) & 15;
        float v = (float)(n >= 8 ? n - 16 : n) * sc[i / B];
        out = (O)(add ? (float)out + v : v);"""),
}

_KERNELS = {}


def _k(name):
    if name not in _KERNELS:
        import cupy
        ins, outs, op = _SOURCES[name]
        _KERNELS[name] = cupy.ElementwiseKernel(ins, outs, op, name, options=("--fmad=false",))
    return _KERNELS[name]


def takes(*arrays) -> bool:
    """Whether the kernels take these float arrays (float32 / float16; codes and scales are always taken)."""
    return all(a.dtype in _TAKES for a in arrays)


def quantize(spec, x, codes, scales):
    """codes, scales of x (device arrays, checked by quant.py)."""
    L, B = len(x), spec.block
    _k("rz_qscale")(x, L, B, np.float32(spec.qmax), scales)
    if spec.bits == 8:
        _k("rz_qcodes8")(x, scales, B, np.float32(spec.qmax), codes)
    else:
        _k("rz_qcodes4")(x, scales, L, B, codes, size=len(codes))


def dequantize(spec, codes, scales, out, add):
    """out = values, or out += values (device arrays, checked by quant.py)."""
    _k("rz_deq8" if spec.bits == 8 else "rz_deq4")(codes, scales, spec.block, bool(add), out)
