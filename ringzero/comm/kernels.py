"""float16 kernels: widen, narrow and add, bitwise equal with or without C.

What it is
    ``f16_to_f32(src, out)``, ``f32_to_f16(src, out)`` (round to nearest even,
    exactly NumPy's ``astype``) and ``add_f16(a, b, out)`` (each pair widened
    to float32, added once, rounded once). The ring uses ``add_f16`` for every
    float16 hop; the sharding runtime uses the two casts per unit.

    The work is done by the optional C extension ``ringzero.comm._f16`` (F16C + AVX
    when the CPU has them, checked at run time, portable C otherwise) when it
    was built, and by NumPy otherwise. ``HAVE_C`` says which. Both give the
    same bits for every input, NaN payloads included (tests/test_kernels.py
    checks all 65536 float16 patterns and random pairs).

    CuPy arrays go to CuPy: the casts are ``astype`` copies into ``out`` and
    the add is one elementwise kernel with the same float32 rule.

What it is not
    A dtype dispatcher: inputs must already be 1-D contiguous arrays of the
    stated dtypes and equal lengths; anything else is a one-line error.
"""
from __future__ import annotations

import os

import numpy as np

from ringzero.comm.backend import get_array_module

try:  # the optional C extension (setup.py, optional=True)
    from ringzero.comm import _f16 as _c
except ImportError:  # no compiler at install time: NumPy does the work
    _c = None

# RINGZERO_NO_C=1 forces the NumPy path (to compare, or to rule the C out).
if os.environ.get("RINGZERO_NO_C", "0") == "1":
    _c = None

HAVE_C = _c is not None
HAVE_F16C = bool(HAVE_C and _c.HAVE_F16C)


def _check(name, arrays, dtypes):
    xp = get_array_module(*arrays)
    n = len(arrays[0])
    for what, a, dt in zip(("src/a", "b" if len(arrays) == 3 else "out", "out"), arrays, dtypes):
        if a.dtype != dt:
            raise TypeError(f"{name}: expected {what} of dtype {np.dtype(dt).name}, got {a.dtype}")
        if a.ndim != 1 or not a.flags.c_contiguous:
            raise ValueError(f"{name}: expected {what} 1-D contiguous, got shape {a.shape} strides {a.strides}")
        if len(a) != n:
            raise ValueError(f"{name}: expected len({what}) == {n}, got {len(a)}")
    return xp


def f16_to_f32(src, out):
    """out[:] = src widened (exact). src float16 (n,), out float32 (n,)."""
    xp = _check("f16_to_f32", (src, out), (np.float16, np.float32))
    if xp is np and _c is not None:
        _c.f16_to_f32(src, out)
    else:
        out[...] = src  # exact; NumPy and CuPy cast in place, no temporary
    return out


def f32_to_f16(src, out):
    """out[:] = src rounded to nearest even (Inf past 65504). src float32 (n,), out float16 (n,)."""
    xp = _check("f32_to_f16", (src, out), (np.float32, np.float16))
    if xp is np and _c is not None:
        _c.f32_to_f16(src, out)
    else:
        with np.errstate(over="ignore", invalid="ignore"):
            out[...] = src
    return out


_cupy_add = None


def _cupy_add_kernel():
    # One rounding from a float32 sum, like the CPU: not CuPy's native half add,
    # which would round the exact sum once and differ in rare double-rounding cases.
    global _cupy_add
    if _cupy_add is None:
        import cupy
        _cupy_add = cupy.ElementwiseKernel(
            "float16 a, float16 b", "float16 c",
            "c = (float16)((float)a + (float)b)", "ringzero_add_f16")
    return _cupy_add


def add_f16(a, b, out):
    """out[:] = fp16(fp32(a) + fp32(b)), one rounding per element. out may be a or b."""
    xp = _check("add_f16", (a, b, out), (np.float16, np.float16, np.float16))
    if xp is np:
        if _c is not None:
            _c.add_f16(a, b, out)
        else:  # NumPy's float16 add is itself "widen, add in float32, round once"
            with np.errstate(over="ignore", invalid="ignore"):
                np.add(a, b, out=out)
    else:
        _cupy_add_kernel()(a, b, out)
    return out
