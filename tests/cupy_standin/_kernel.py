"""cupy.ElementwiseKernel on the host: the kernel's own CUDA C++ source, compiled by the C++ compiler.

What it is
    ``ElementwiseKernel(in_params, out_params, operation, name, preamble=..)``
    as CuPy defines it (cupy/_core/_kernel.pyx), run on the stand-in's host
    arrays. The operation string is not interpreted: it is pasted into a loop
    ``for (i = 0; i < n; i++) { <operation>; }`` with each parameter bound the
    way CuPy binds it:

    - ``T x`` (an array, broadcast with the other non-raw arrays): ``const T &x``
      for an input, ``T &x`` for an output, at element i of the broadcast shape;
    - ``T x`` given a scalar: ``const T x``, the value cast to T;
    - ``raw T x``: ``CArray<T> x`` (``const`` for an input, so writing it does not
      compile, as in CuPy), indexed by flat element (``x[j]``, ``x.size()``);
    - ``i`` and ``_ind.size()``: the element index and the launch size
      (``size=`` when every array is raw);
    - an input that overlaps an output (and is not that output) is copied
      first, as CuPy does.

    Type placeholders (one-letter type names) are taken from the arrays
    bound to them and must agree. The source is built with ``c++ -O2
    -ffp-contract=off`` (CUDA kernels in ringzero pass ``--fmad=false`` to
    NVRTC for the same reason: no contraction into FMA) and cached on disk by
    its hash, so ranks and test processes compile each kernel once. CUDA's
    names that host C++ lacks come from the header below: ``__device__`` and
    ``__forceinline__`` (empty), ``__int_as_float``, ``__float_as_int``,
    float16 as ``_Float16``.

What it is not
    A CUDA compiler: no threadIdx, shared memory, warp intrinsics or
    ``RawKernel``. Raw arguments must be C-contiguous (CuPy allows strided
    ones). Host libm's ``exp``/``log`` are correctly rounded or nearly so;
    CUDA's differ by up to its documented ulp bounds, so kernels that call
    them match the host bit for bit here and only to those bounds on a device.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile

import numpy as np

from ._core import _SCALARS, _launch, _wrap, ndarray

_DTYPES = {"bool": np.bool_, "int8": np.int8, "int16": np.int16, "int32": np.int32, "int64": np.int64,
           "uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64,
           "float16": np.float16, "float32": np.float32, "float64": np.float64}
_CTYPE = {np.dtype(v): k for k, v in _DTYPES.items()}

_HEADER = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <stddef.h>
typedef _Float16 float16;
typedef float float32;
typedef double float64;
typedef int8_t int8;  typedef int16_t int16;  typedef int32_t int32;  typedef int64_t int64;
typedef uint8_t uint8; typedef uint16_t uint16; typedef uint32_t uint32; typedef uint64_t uint64;
#define __device__
#define __host__
#define __forceinline__ inline
static inline float __int_as_float(int x) { float f; memcpy(&f, &x, 4); return f; }
static inline int __float_as_int(float f) { int x; memcpy(&x, &f, 4); return x; }
template <class T> struct CArray {          /* inputs are const CArray: their elements read-only, as in CuPy */
    T *p; ptrdiff_t n;
    T &operator[](ptrdiff_t j) { return p[j]; }
    const T &operator[](ptrdiff_t j) const { return p[j]; }
    ptrdiff_t size() const { return n; }
};
struct CIndexer { ptrdiff_t n; ptrdiff_t size() const { return n; } };
"""


def _compiler():
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise NotImplementedError("cupy stand-in: ElementwiseKernel needs a C++ compiler (set CXX, or install g++)")
    return cxx


def have_compiler() -> bool:
    try:
        _compiler()
        return True
    except NotImplementedError:
        return False


def _cache_dir():
    d = os.environ.get("RINGZERO_STANDIN_CACHE") or os.path.join(tempfile.gettempdir(),
                                                                 f"ringzero-standin-{os.getuid()}")
    os.makedirs(d, exist_ok=True)
    return d


_LOADED = {}


def _load(src, name):
    """The compiled kernel function of a source: loaded once per process, built once per cache."""
    key = hashlib.sha256(src.encode()).hexdigest()[:24]
    if key in _LOADED:
        return _LOADED[key]
    d = _cache_dir()
    so = os.path.join(d, f"{name}-{key}.so")
    if not os.path.exists(so):
        cpp = os.path.join(d, f"{name}-{key}.{os.getpid()}.cpp")
        tmp = so + f".{os.getpid()}.tmp"
        with open(cpp, "w") as f:
            f.write(src)
        r = subprocess.run([_compiler(), "-O2", "-std=c++17", "-ffp-contract=off", "-fPIC", "-shared",
                            "-o", tmp, cpp], capture_output=True, text=True)
        os.unlink(cpp)
        if r.returncode:
            raise RuntimeError(f"cupy stand-in: kernel {name!r} does not compile:\n{r.stderr[-4000:]}")
        os.replace(tmp, so)                  # atomic: a rank racing on the same kernel loads a whole file
    fn = ctypes.CDLL(so).rz_kernel
    fn.restype = None
    fn.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_void_p]
    _LOADED[key] = fn
    return fn


def _parse(params):
    out = []
    for p in (s.strip() for s in params.split(",")):
        if not p:
            continue
        words = p.split()
        raw = words[0] == "raw"
        words = words[1:] if raw else words
        if len(words) != 2 or not re.fullmatch(r"[A-Za-z_]\w*", words[1]):
            raise ValueError(f"cupy stand-in: cannot read kernel parameter {p!r}")
        if len(words[0]) > 1 and words[0] not in _DTYPES:       # CuPy: one letter is a placeholder
            raise TypeError(f"data type {words[0]!r} not understood")
        if words[1] == "i":
            raise ValueError("Can not use 'i' as a parameter name")
        out.append((raw, words[0], words[1]))
    return out


class ElementwiseKernel:
    """cupy.ElementwiseKernel, compiled for the host (see the module docstring)."""

    def __init__(self, in_params, out_params, operation, name="kernel", reduce_dims=True, preamble="",
                 no_return=False, return_tuple=False, **kwargs):
        self.ins, self.outs = _parse(in_params), _parse(out_params)
        self.params = self.ins + self.outs
        self.operation, self.name, self.preamble = operation, name, preamble
        self.loop_prep, self.after_loop = kwargs.pop("loop_prep", ""), kwargs.pop("after_loop", "")
        self.options = tuple(kwargs.pop("options", ()))            # NVRTC's; the host build has its own
        if kwargs:
            raise TypeError(f"Wrong arguments {kwargs}")
        self.no_return, self.return_tuple = no_return, return_tuple

    def _types(self, args):
        """Placeholder name -> dtype, from the arrays bound to it (CuPy's 'Type is mismatched')."""
        got = {}
        for (raw, t, n), a in zip(self.params, args):
            if t in _DTYPES or not isinstance(a, ndarray):
                continue
            if got.setdefault(t, a.dtype) != a.dtype:
                raise TypeError(f"Type is mismatched. {n} {a.dtype} {got[t]}")
        return got

    def __call__(self, *args, **kwargs):
        size = kwargs.pop("size", None)
        kwargs.pop("block_size", None)
        if kwargs:
            raise TypeError(f"Wrong arguments {kwargs}")
        n_in, n_out = len(self.ins), len(self.outs)
        if len(args) not in (n_in, n_in + n_out):
            raise TypeError(f"Wrong number of arguments for {self.name!r}")
        for (raw, t, n), a in zip(self.params, args):
            if not isinstance(a, (ndarray, *_SCALARS)):
                raise TypeError(f"Unsupported type {type(a)}")
            if raw and not isinstance(a, ndarray):
                raise TypeError(f"{self.name}: raw argument {n} must be an array")
        types = self._types(args)

        def dtype_of(t, n):
            if t in _DTYPES:
                return np.dtype(_DTYPES[t])
            if t not in types:
                raise TypeError(f"{self.name}: cannot guess the type {t} of {n}")
            return np.dtype(types[t])

        for (raw, t, n), a in zip(self.params, args):
            if isinstance(a, ndarray) and a.dtype != dtype_of(t, n):
                raise TypeError(f"{self.name}: argument {n} expected {dtype_of(t, n)}, got {a.dtype}")
        shapes = [a.shape for (raw, _, _), a in zip(self.params, args) if isinstance(a, ndarray) and not raw]
        if shapes and size is not None:
            raise ValueError("Specified 'size' can be used only if all of the ndarray are 'raw'.")
        if not shapes and size is None:
            raise ValueError("Loop size is undecided.")
        shape = np.broadcast_shapes(*shapes) if shapes else (int(size),)
        args = list(args)
        for k in range(len(args), n_in + n_out):                    # outputs not given: allocated
            raw, t, n = self.outs[k - n_in]
            if raw:
                raise ValueError(f"{self.name}: raw output {n} must be given")
            args.append(_wrap(np.empty(shape, dtype_of(t, n)), fresh=True))
        for (raw, t, n), a in zip(self.outs, args[n_in:]):
            if not raw and a.shape != shape:
                raise ValueError(f"Out shape is mismatched: {n} {a.shape}, the broadcast shape {shape}")
        for (raw, t, n), a in zip(self.params, args):
            if raw and not a._a.flags.c_contiguous:
                raise NotImplementedError(f"cupy stand-in: raw argument {n} must be C-contiguous")
        for k in range(n_in):                       # CuPy copies an input that overlaps an output first
            a = args[k]
            if isinstance(a, ndarray) and any(a is not o and np.may_share_memory(a._a, o._a) for o in args[n_in:]):
                args[k] = _wrap(a._a.copy(), fresh=True)

        nd = max(len(shape), 1)
        dims = np.array(shape if shape else (1,), np.intp)
        keep, ptrs, strides, sizes = [], [], [], []
        for (raw, t, n), a in zip(self.params, args):
            if isinstance(a, ndarray):
                v = a._a if raw else np.broadcast_to(a._a, shape)
                st = (0,) * nd if raw else (v.strides if v.ndim else (0,))
                ptrs.append(a._a.ctypes.data)
                sizes.append(a._a.size)
            else:
                v = np.array(a, dtype_of(t, n))                   # the scalar cast to its type
                keep.append(v)
                st = (0,) * nd
                ptrs.append(v.ctypes.data)
                sizes.append(1)
            strides.extend(st)
        src = self._source([dtype_of(t, n) for (_, t, n) in self.params], types,
                           [isinstance(a, ndarray) for a in args], nd)
        fn = _load(src, self.name)
        outs = args[n_in:]
        _launch(*outs)
        n = int(np.prod(shape)) if shape else 1
        p = np.array(ptrs, np.uintp)
        s = np.array(strides, np.intp)
        z = np.array(sizes, np.intp)
        fn(n, nd, dims.ctypes.data, p.ctypes.data, s.ctypes.data, z.ctypes.data)
        if self.no_return:
            return None
        if n_out == 1 and not self.return_tuple:
            return outs[0]
        return tuple(outs)

    def _source(self, dts, types, is_array, nd):
        lines = [_HEADER]                                           # CuPy's order: typedefs, preamble, kernel
        lines += [f"typedef {_CTYPE[np.dtype(d)]} {t};" for t, d in types.items()]
        lines += [self.preamble,
                  'extern "C" void rz_kernel(ptrdiff_t n, int nd, const ptrdiff_t *shape, char **ptrs,',
                  "                          const ptrdiff_t *strides, const ptrdiff_t *sizes) {"]
        lines.append("    CIndexer _ind{n};")
        for k, ((raw, t, name), dt, arr) in enumerate(zip(self.params, dts, is_array)):
            if raw:
                const = "const " if k < len(self.ins) else ""
                lines.append(f"    {const}CArray<{_CTYPE[dt]}> {name}{{({_CTYPE[dt]} *)ptrs[{k}], sizes[{k}]}};")
        lines.append(f"    {self.loop_prep}")
        lines.append("    for (ptrdiff_t i = 0; i < n; i++) {")
        for k, ((raw, t, name), dt, arr) in enumerate(zip(self.params, dts, is_array)):
            if raw:
                continue
            c = _CTYPE[dt]
            if not arr:
                lines.append(f"        const {c} {name} = *(const {c} *)ptrs[{k}];")
                continue
            lines.append(f"        ptrdiff_t o{k} = 0;")
            lines.append(f"        for (ptrdiff_t r = i, d = nd - 1; d >= 0; d--) "
                         f"{{ o{k} += (r % shape[d]) * strides[{k} * nd + d]; r /= shape[d]; }}")
            const = "const " if k < len(self.ins) else ""
            lines.append(f"        {const}{c} &{name} = *({const}{c} *)(ptrs[{k}] + o{k});")
        lines.append(f"        {{ {self.operation}; }}")
        lines.append("    }")
        lines.append(f"    {self.after_loop}")
        lines.append("}")
        return "\n".join(lines)
