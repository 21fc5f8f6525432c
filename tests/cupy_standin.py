"""A strict CuPy stand-in for CI: NumPy underneath, CuPy's rules on top.

What it is
    ``install(monkeypatch)`` puts modules named ``cupy``, ``cupy.cuda``,
    ``cupy.cuda.runtime``, ``cupy.cuda.cublas`` and ``cupyx`` into
    ``sys.modules``, so ringzero's GPU code paths run on a machine without a
    GPU. Where CuPy (14.x, read from its source: cupy/_core/core.pyx,
    flags.pyx, _kernel.pyx, _routines_linalg.pyx) is stricter than NumPy,
    this is as strict:

    - ``a.flags`` has only ``c_contiguous``, ``f_contiguous``, ``owndata``
      (no ``writeable``; ``flags["WRITEABLE"]`` is a KeyError);
    - ``numpy.asarray(a)`` raises CuPy's TypeError ("Implicit conversion to a
      NumPy array is not allowed. Please use `.get()` ..."); a NumPy array
      in a kernel (ufunc, ``a + np_b``, ``a[...] = np_b``, ``out=np_c``) is
      ``TypeError: Unsupported type <class 'numpy.ndarray'>``;
    - ``get(out=..)``/``set(..)`` check type, dtype, shape and contiguity as
      CuPy does; ``set`` from pinned memory is asynchronous on the current
      stream (the host array is read when the stream is next synchronized or
      used), so code that reuses a pinned buffer before synchronizing gets
      wrong results (from pageable memory CUDA copies before returning);
    - ``__cuda_array_interface__`` (how mpi4py hands a device buffer to MPI)
      refuses while the stream has unsynchronized work: handing a buffer to
      MPI without ``stream.synchronize()`` first is a race on a GPU;
    - ``cupy.matmul`` on arrays of more than 2 dims makes the copies CuPy
      makes (float16 operands are copied to float32, the result lands in a
      temporary and is copied into ``out``), counted in ``stats()``;
    - ``cupy.cuda.cublas.gemmStridedBatchedEx`` is emulated on raw pointers
      with cuBLAS's column-major rules; pointers must lie inside live
      stand-in allocations.

    The memory pool is modelled as a perfect caching allocator: used bytes
    are the live arrays, total bytes the high-water mark.

What it is not
    A GPU. It proves that ringzero uses CuPy's API as CuPy allows (types,
    contiguity, synchronization before MPI, no implicit host copies); it says
    nothing about GPU numerics, kernels or speed. Device memory is host
    memory, so "device-direct" MPI here is host MPI on the same pointers.
"""
from __future__ import annotations

import bisect
import ctypes
import os
import sys
import types
import weakref

import numpy as np

_SCALARS = (bool, int, float, complex, np.generic)


class _State:
    def __init__(self):
        self.pending = False          # kernels / async copies not yet synchronized
        self.copies = []              # queued host->device copies: (dst np view, host array)
        self.device = 0
        self.live = {}                # root base ptr -> nbytes (device allocations)
        self.starts = []              # sorted base ptrs
        self.used = 0
        self.high = 0
        self.allocs = 0
        self.matmul_nd_copies = 0
        self.host_reads = 0           # device->host reads that block: float(a), int(a), a.get()
        self.pinned = []              # (ptr, nbytes) of pinned host allocations


_S = _State()


def n_devices() -> int:
    return int(os.environ.get("RINGZERO_STANDIN_DEVICES", "1"))


def stats() -> dict:
    """Counters for tests: device allocations made, live/high-water bytes, nd-matmul copies."""
    return {"allocs": _S.allocs, "used_bytes": _S.used, "high_bytes": _S.high,
            "matmul_nd_copies": _S.matmul_nd_copies, "host_reads": _S.host_reads}


# ---------------------------------------------------------------- streams
def _flush():
    for dst, host in _S.copies:
        dst[...] = host.reshape(dst.shape)   # read the host array only now, as an async copy does
    _S.copies.clear()


def _launch():
    """A kernel is about to run on the current stream (stream order: queued copies land first)."""
    _flush()
    _S.pending = True


def _synchronize():
    _flush()
    _S.pending = False


class Stream:
    def __init__(self, null=False, non_blocking=False, ptr=0):
        self.ptr = 0 if null else 1
        self._prev = None

    def synchronize(self):
        _synchronize()

    def use(self):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


Stream.null = Stream(null=True)
_current_stream = Stream()


def get_current_stream(device_id=None):
    return _current_stream


class CUDARuntimeError(RuntimeError):
    pass


class Device:
    def __init__(self, device=None):
        self.id = _S.device if device is None else int(device)

    def use(self):
        if not 0 <= self.id < n_devices():
            raise CUDARuntimeError("cudaErrorInvalidDevice: invalid device ordinal")
        _S.device = self.id

    def synchronize(self):
        _synchronize()

    def __enter__(self):
        self._prev = _S.device
        self.use()
        return self

    def __exit__(self, *a):
        _S.device = self._prev

    def __eq__(self, other):
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self):
        return self.id


# ----------------------------------------------------------- allocations
def _root(a):
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _register(a):
    """Record a fresh device allocation (its root ndarray owns the memory)."""
    ptr, n = a.__array_interface__["data"][0], max(a.nbytes, 1)
    n = -(-n // 512) * 512                   # CuPy's pool rounds to 512 bytes
    _S.live[ptr] = n
    bisect.insort(_S.starts, ptr)
    _S.used += n
    _S.high = max(_S.high, _S.used)
    _S.allocs += 1

    def free(ptr=ptr, n=n):
        if _S.live.pop(ptr, None) is not None:
            _S.starts.remove(ptr)
            _S.used -= n
    weakref.finalize(a, free)


def _inside(ptr, nbytes) -> bool:
    i = bisect.bisect_right(_S.starts, ptr) - 1
    return i >= 0 and ptr + nbytes <= _S.starts[i] + _S.live[_S.starts[i]]


class MemoryPointer:
    def __init__(self, ptr, device_id):
        self.ptr, self.device_id = ptr, device_id

    @property
    def device(self):
        return Device(self.device_id)


class Flags:
    """CuPy's flags: c_contiguous, f_contiguous, owndata. Nothing else."""
    __slots__ = ("c_contiguous", "f_contiguous", "owndata")

    def __init__(self, c, f, o):
        self.c_contiguous, self.f_contiguous, self.owndata = c, f, o

    def __getitem__(self, name):
        d = {"C_CONTIGUOUS": self.c_contiguous, "F_CONTIGUOUS": self.f_contiguous, "OWNDATA": self.owndata}
        if name not in d:
            raise KeyError(f"{name} is not defined for cupy.ndarray.flags")
        return d[name]


def _dev_check(x):
    if x._dev != _S.device:
        raise ValueError(f"Array device must be same as the current device: array device = {x._dev} "
                         f"while current = {_S.device}")


def _k(x):
    """One kernel argument: a device array's NumPy view, or a scalar; anything else is CuPy's TypeError."""
    if isinstance(x, ndarray):
        _dev_check(x)
        return x._a
    if x is None or isinstance(x, _SCALARS):
        return x
    raise TypeError(f"Unsupported type {type(x)}")


def _wrap(r, fresh=True):
    """A result of NumPy work as a new device array (a fresh allocation, as a kernel's output is)."""
    r = np.asarray(r)
    if not r.flags.owndata or r.base is not None:
        r = r.copy()
    _register(r)
    out = ndarray.__new__(ndarray)
    out._a, out._dev = r, _S.device
    return out


class ndarray:
    """A device array: a NumPy array nobody may touch as NumPy."""
    __module__ = "cupy._core.core"   # where CuPy's ndarray lives (ringzero tells arrays apart by it)
    __slots__ = ("_a", "_dev", "__weakref__")
    __array_priority__ = 100

    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C"):
        a = np.empty(shape, dtype, order=order)
        _register(a)
        self._a, self._dev = a, _S.device

    # ---- attributes
    shape = property(lambda s: s._a.shape)
    dtype = property(lambda s: s._a.dtype)
    ndim = property(lambda s: s._a.ndim)
    size = property(lambda s: s._a.size)
    nbytes = property(lambda s: s._a.nbytes)
    itemsize = property(lambda s: s._a.itemsize)
    strides = property(lambda s: s._a.strides)
    T = property(lambda s: s.transpose())
    device = property(lambda s: Device(s._dev))

    @property
    def flags(self):
        a = self._a
        return Flags(bool(a.flags.c_contiguous), bool(a.flags.f_contiguous),
                     a.__array_interface__["data"][0] in _S.live and a.base is None)

    @property
    def data(self):
        return MemoryPointer(self._a.__array_interface__["data"][0], self._dev)

    @property
    def __cuda_array_interface__(self):
        if _S.pending:
            raise RuntimeError("cupy stand-in: a device buffer was handed out (to MPI?) while the current "
                               "stream has unsynchronized work; synchronize the stream first")
        a = self._a
        return {"shape": a.shape, "typestr": a.dtype.str, "descr": [("", a.dtype.str)],
                "data": (a.__array_interface__["data"][0], False), "version": 3, "stream": 1,
                "strides": None if a.flags.c_contiguous else a.strides}

    # ---- conversions CuPy refuses or makes explicit
    def __array__(self, dtype=None, copy=None):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. "
                        "Please use `.get()` to construct a NumPy array explicitly.")

    def get(self, stream=None, order="C", out=None, blocking=True):
        if out is not None:
            if not isinstance(out, np.ndarray):
                raise TypeError("Only numpy.ndarray can be obtained fromcupy.ndarray")
            if self.dtype != out.dtype:
                raise TypeError(f"{out.dtype} array cannot be obtained from {self.dtype} array")
            if self.shape != out.shape:
                raise ValueError(f"Shape mismatch. Expected shape: {self.shape}, actual shape: {out.shape}")
            if not (out.flags.c_contiguous or out.flags.f_contiguous):
                raise RuntimeError("`out` cannot be specified when copying to non-contiguous ndarray")
        _synchronize() if blocking else _flush()
        _S.host_reads += 1
        if out is None:
            return np.array(self._a, order=order)
        out[...] = self._a
        return out

    def set(self, arr, stream=None):
        if not isinstance(arr, np.ndarray):
            raise TypeError("Only numpy.ndarray can be set to cupy.ndarray")
        if self.dtype != arr.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self.dtype} array")
        if self.shape != arr.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: {arr.shape}")
        if not (self._a.flags.c_contiguous or self._a.flags.f_contiguous):
            raise RuntimeError("Cannot set to non-contiguous array")
        _launch()
        if _pinned(arr):        # a DMA from page-locked memory: reads arr when the stream gets there
            _S.copies.append((self._a, arr))
        else:                   # pageable: CUDA stages it before returning, so arr may be reused at once
            self._a[...] = arr

    def __float__(self):
        return float(self.get())

    def __int__(self):
        return int(self.get())

    def __bool__(self):
        return bool(self.get())

    def __index__(self):
        if self.ndim or self.dtype.kind not in "iu":
            raise TypeError("only integer scalar arrays can be converted to a scalar index")
        return int(self.get())

    def __repr__(self):
        return repr(self.get()).replace("array", "cupy-standin array", 1)

    __str__ = __repr__

    def __len__(self):
        if not self.ndim:
            raise TypeError("len() of unsized object")
        return len(self._a)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    # ---- NumPy protocol: CuPy's dispatch, NumPy operands refused
    def __array_ufunc__(self, ufunc, method, *inputs, **kw):
        fn = getattr(_mod(), ufunc.__name__, None)
        if fn is None:
            return NotImplemented
        if method != "__call__":
            fn = getattr(fn, method, None)
            if fn is None:
                return NotImplemented
        if "out" in kw:
            (kw["out"],) = kw["out"]
        return fn(*inputs, **kw)

    def __array_function__(self, func, types_, args, kwargs):
        fn = getattr(_mod(), func.__name__, None)
        if fn is None or fn is func:
            return NotImplemented
        return fn(*args, **kwargs)

    # ---- views (no kernel, no allocation)
    def __getitem__(self, key):
        key = _key(key)
        t = key if isinstance(key, tuple) else (key,)
        if all(k is None or k is Ellipsis or isinstance(k, (int, np.integer, slice)) for k in t):
            # basic indexing: a view, 0-d included (CuPy has no scalars), empty included
            return self._same(self._a[t if Ellipsis in t else t + (Ellipsis,)])
        _launch()                            # advanced indexing: a gather kernel, a new array
        return _wrap(self._a[key], fresh=True)

    def __setitem__(self, key, value):
        if isinstance(value, np.ndarray):
            raise TypeError(f"Unsupported type {type(value)}")
        v = _k(value)
        _launch()
        self._a[_key(key)] = v

    def view(self, dtype=None):
        out = ndarray.__new__(ndarray)
        out._a, out._dev = (self._a.view() if dtype is None else self._a.view(dtype)), self._dev
        return out

    def reshape(self, *shape, order="C"):
        r = self._a.reshape(*shape, order=order)
        if r.size and not np.shares_memory(r, self._a):
            _launch()
            return _wrap(r, fresh=True)
        return self._same(r)

    def transpose(self, *axes):
        return self._same(self._a.transpose(*axes))

    def ravel(self):
        return self.reshape(-1)

    def _same(self, r):
        out = ndarray.__new__(ndarray)
        out._a, out._dev = r, self._dev
        return out

    # ---- kernels
    def astype(self, dtype, copy=True, **kw):
        if not copy and self.dtype == np.dtype(dtype):
            return self
        _launch()
        return _wrap(self._a.astype(dtype, **kw), fresh=True)

    def copy(self, order="C"):
        _launch()
        return _wrap(self._a.copy(order=order), fresh=True)

    def fill(self, value):
        _launch()
        self._a.fill(_k(value))

    def dot(self, b, out=None):
        return _mod().dot(self, b, out=out)


def _key(key):
    """Index with device arrays (advanced indexing) or Python/NumPy ints and slices."""
    if isinstance(key, tuple):
        return tuple(_key(k) for k in key)
    if isinstance(key, ndarray):
        return _k(key)
    return key


def _mod():
    return sys.modules.get("cupy") or _build()


def _ewise(name):
    """A CuPy ufunc: device arrays and scalars in, device array out."""
    npf = getattr(np, name)

    def f(*args, out=None, **kw):
        xs = [_k(a) for a in args]
        if out is not None and not isinstance(out, ndarray):
            raise TypeError(f"Unsupported type {type(out)}")
        _launch()
        if out is not None:
            npf(*xs, out=out._a, **kw)
            return out
        return _wrap(npf(*xs, **kw), fresh=True)

    def at(a, idx, b):
        if not isinstance(a, ndarray):
            raise TypeError(f"Unsupported type {type(a)}")
        _launch()
        npf.at(a._a, _key(idx), _k(b))
    f.__name__, f.at = name, at
    return f


_UFUNCS = ("add", "subtract", "multiply", "divide", "true_divide", "negative", "power", "exp", "log",
           "tanh", "sqrt", "abs", "absolute", "minimum", "maximum", "less", "less_equal", "greater",
           "greater_equal", "equal", "not_equal", "isfinite", "isnan", "floor_divide", "square")

for _n, _op in (("add", "add"), ("sub", "subtract"), ("mul", "multiply"), ("truediv", "true_divide"),
                ("pow", "power"), ("floordiv", "floor_divide"), ("mod", "remainder")):
    def _bin(op=_op):
        def fwd(self, o):
            return _ewise(op)(self, o)

        def rev(self, o):
            return _ewise(op)(o, self)

        def inplace(self, o):
            _ewise(op)(self, o, out=self)
            return self
        return fwd, rev, inplace
    _f, _r, _i = _bin()
    setattr(ndarray, f"__{_n}__", _f)
    setattr(ndarray, f"__r{_n}__", _r)
    setattr(ndarray, f"__i{_n}__", _i)
for _n, _op in (("lt", "less"), ("le", "less_equal"), ("gt", "greater"), ("ge", "greater_equal"),
                ("eq", "equal"), ("ne", "not_equal")):
    setattr(ndarray, f"__{_n}__", (lambda op: lambda self, o: _ewise(op)(self, o))(_op))
ndarray.__neg__ = lambda self: _ewise("negative")(self)
ndarray.__hash__ = None


def _reduction(name):
    def f(a, axis=None, dtype=None, out=None, keepdims=False, **kw):
        x = _k(a)
        _launch()
        if dtype is not None:
            kw["dtype"] = dtype
        r = getattr(np, name)(x, axis=axis, keepdims=keepdims, **kw)
        if out is not None:
            out._a[...] = r
            return out
        return _wrap(r, fresh=True)
    return f


for _n in ("sum", "mean", "max", "min", "prod", "argmax", "argmin", "any", "all"):
    def _m(self, axis=None, dtype=None, out=None, keepdims=False, _n=_n, **kw):
        return _reduction(_n)(self, axis=axis, dtype=dtype, out=out, keepdims=keepdims, **kw)
    setattr(ndarray, _n, _m)


# ------------------------------------------------------- module functions
def _creator(npf):
    def f(*a, **kw):
        _launch()
        return _wrap(npf(*a, **kw), fresh=True)
    return f


def empty(shape, dtype=float, order="C"):
    return _wrap(np.empty(shape, dtype, order=order), fresh=True)   # no kernel: nothing to sync


def empty_like(a, dtype=None):
    return empty(a.shape, a.dtype if dtype is None else dtype)


def zeros_like(a, dtype=None):
    return _creator(np.zeros)(a.shape, a.dtype if dtype is None else dtype)


def ones_like(a, dtype=None):
    return _creator(np.ones)(a.shape, a.dtype if dtype is None else dtype)


def asarray(a, dtype=None, order=None):
    """A device array: itself (or a cast copy) if it is one, else a host->device copy."""
    if isinstance(a, ndarray):
        return a if dtype is None or a.dtype == np.dtype(dtype) else a.astype(dtype)
    h = np.asarray(a, dtype=dtype, order=order)
    _launch()
    return _wrap(np.array(h, copy=True), fresh=True)


def array(a, dtype=None, copy=True, order="K"):
    if isinstance(a, ndarray):
        return a.astype(a.dtype if dtype is None else dtype) if copy else asarray(a, dtype)
    return asarray(a, dtype)


def ascontiguousarray(a, dtype=None):
    x = asarray(a, dtype)
    return x if x._a.flags.c_contiguous else x.copy()


def asnumpy(a, stream=None, order="C", out=None, blocking=True):
    if isinstance(a, ndarray):
        return a.get(stream=stream, order=order, out=out, blocking=blocking)
    return np.asarray(a, order=order) if out is None else np.copyto(out, a) or out


def get_array_module(*args):
    return _mod() if any(isinstance(a, ndarray) for a in args) else np


def copyto(dst, src, casting="same_kind", where=None):
    if not isinstance(dst, ndarray):
        raise TypeError(f"Unsupported type {type(dst)}")
    if isinstance(src, np.ndarray):
        if src.size != 1:
            raise ValueError("non-scalar numpy.ndarray cannot be used for copyto")
        src = src.reshape(()).item()
    _launch()
    np.copyto(dst._a, _k(src), casting=casting, where=True if where is None else _k(where))


def take(a, indices, axis=None, out=None):
    if not isinstance(indices, (ndarray, int, np.integer)):
        raise TypeError(f"Unsupported type {type(indices)}")
    x, idx = _k(a), _k(indices)
    _launch()
    # CuPy wraps out-of-range indices around instead of raising (see cupy.take's docs)
    if out is not None:
        np.take(x, idx, axis=axis, out=_k(out), mode="wrap")
        return out
    return _wrap(np.take(x, idx, axis=axis, mode="wrap"), fresh=True)


def matmul(a, b, out=None):
    """cupy.matmul, with the copies CuPy makes for more than 2 dims
    (_routines_linalg.pyx: float16 operands become float32 copies, the result
    goes to a float32 temporary unless ``out`` is a C-contiguous match, then
    is copied into ``out``)."""
    x, y = _k(a), _k(b)
    o = _k(out)
    _launch()
    if max(x.ndim, y.ndim) > 2:
        dt = np.promote_types(x.dtype, y.dtype)
        cdt = np.dtype(np.float32) if dt == np.float16 else dt
        xs = [np.ascontiguousarray(t, cdt) for t in (x, y)]
        for t, src in zip(xs, (x, y)):
            if t is not src:
                _register(t)
                _S.matmul_nd_copies += 1
        r = np.matmul(*xs)
        if o is None:
            return _wrap(r.astype(dt, copy=False), fresh=True)
        if not (o.dtype == cdt and o.flags.c_contiguous):
            _register(r)
            _S.matmul_nd_copies += 1
        o[...] = r
        return out
    if o is None:
        return _wrap(np.matmul(x, y), fresh=True)
    np.matmul(x, y, out=o)
    return out


def dot(a, b, out=None):
    x, y = _k(a), _k(b)
    if out is not None:
        o = _k(out)
        if np.result_type(x.dtype, y.dtype) != o.dtype:
            raise ValueError("Not supported dtype combination.")
        if not o.flags.c_contiguous:
            raise ValueError("Output array must be C-contiguous")
    _launch()
    if out is None:
        return _wrap(np.dot(x, y), fresh=True)
    np.dot(x, y, out=o)
    return out


def concatenate(arrays, axis=0, out=None, dtype=None):
    xs = [_k(t) for t in arrays]
    _launch()
    return _wrap(np.concatenate(xs, axis=axis, dtype=dtype), fresh=True)


def where(c, x=None, y=None):
    _launch()
    if x is None:
        return tuple(_wrap(t, fresh=True) for t in np.where(_k(c)))
    return _wrap(np.where(_k(c), _k(x), _k(y)), fresh=True)


def _simple(name):
    npf = getattr(np, name)

    def f(a, *args, **kw):
        x = _k(a)
        args = [_k(t) for t in args]
        kw = {k: _k(v) if isinstance(v, (ndarray, np.ndarray)) else v for k, v in kw.items()}
        _launch()
        r = npf(x, *args, **kw)
        return tuple(_wrap(t, fresh=True) for t in r) if isinstance(r, tuple) else _wrap(r, fresh=True)
    return f


_SIMPLE = ("cumsum", "sort", "argsort", "triu", "tril", "searchsorted", "diff", "nonzero", "flatnonzero",
           "unique", "bincount", "repeat", "clip", "isclose", "allclose", "array_equal", "count_nonzero",
           "flip", "linalg_norm", "sign", "round", "floor", "ceil")


class _ElementwiseKernel:
    """Only the kernels ringzero defines, interpreted by name: a CUDA source
    cannot run here. Arguments are checked against the declared types."""
    KNOWN = {"ringzero_add_f16": lambda a, b: (a.astype(np.float32) + b.astype(np.float32)).astype(np.float16)}

    def __init__(self, in_params, out_params, operation, name="kernel", **kw):
        if name not in self.KNOWN:
            raise NotImplementedError(f"cupy stand-in: no host rendering of ElementwiseKernel {name!r}")
        self.ins = [p.split() for p in in_params.split(",")]
        self.outs = [p.split() for p in out_params.split(",")]
        self.name, self.fn = name, self.KNOWN[name]

    def __call__(self, *args):
        if len(args) not in (len(self.ins), len(self.ins) + len(self.outs)):
            raise TypeError(f"Wrong number of arguments for {self.name!r}")
        for (t, n), a in zip(self.ins + self.outs, args):
            if not isinstance(a, ndarray):
                raise TypeError(f"Unsupported type {type(a)}")
            if a.dtype != np.dtype(t):
                raise TypeError(f"{self.name}: argument {n} expected {t}, got {a.dtype}")
        _launch()
        r = self.fn(*[a._a for a in args[:len(self.ins)]])
        if len(args) > len(self.ins):
            args[-1]._a[...] = r
            return args[-1]
        return _wrap(r, fresh=True)


# ------------------------------------------------------------- pinned memory
class PinnedMemoryPointer(bytearray):
    """Page-locked host memory: host bytes (the buffer protocol), plus ``ptr``."""

    @property
    def ptr(self):
        return ctypes.addressof((ctypes.c_char * 1).from_buffer(self))

    def size(self):
        return len(self)


def alloc_pinned_memory(nbytes):
    m = PinnedMemoryPointer(int(nbytes))
    if nbytes:
        _S.pinned.append((m.ptr, len(m)))
    return m


def empty_pinned(shape, dtype=float, order="C"):
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    mem = alloc_pinned_memory(max(n, 1))
    return np.frombuffer(mem, np.dtype(dtype), int(np.prod(shape))).reshape(shape, order=order)


def zeros_pinned(shape, dtype=float, order="C"):
    out = empty_pinned(shape, dtype, order)
    out[...] = 0
    return out


def _pinned(arr) -> bool:
    p = arr.__array_interface__["data"][0]
    return any(q <= p < q + n for q, n in _S.pinned)


class _PointerAttributes:
    def __init__(self, kind):
        self.type = kind


def pointerGetAttributes(ptr):
    for p, n in _S.pinned:
        if p <= ptr < p + n:
            return _PointerAttributes(1)        # memoryTypeHost
    return _PointerAttributes(2 if _inside(ptr, 1) else 0)


def getDeviceProperties(i):
    if not 0 <= i < n_devices():
        raise CUDARuntimeError("cudaErrorInvalidDevice: invalid device ordinal")
    return {"name": b"CuPy stand-in (NumPy, no GPU)", "totalGlobalMem": 1 << 34, "multiProcessorCount": 1}


class MemoryPool:
    """A perfect caching allocator: used = live arrays, total = high-water mark."""

    def used_bytes(self):
        return _S.used

    def total_bytes(self):
        return _S.high

    def free_bytes(self):
        return _S.high - _S.used

    def free_all_blocks(self):
        _S.high = _S.used

    def n_free_blocks(self):
        return 0


_POOL = MemoryPool()


def scatter_add(a, slices, value):
    """cupyx.scatter_add: an atomicAdd per element on a GPU (order not fixed)."""
    if not isinstance(a, ndarray):
        raise TypeError(f"Unsupported type {type(a)}")
    _launch()
    np.add.at(a._a, _key(slices), _k(value))


# -------------------------------------------------------------------- cuBLAS
_ITEM = {0: np.float32, 1: np.float64, 2: np.float16}      # cudaDataType: CUDA_R_32F, _64F, _16F
CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_64F, CUBLAS_COMPUTE_16F = 68, 70, 64


def _device_view(ptr, dtype, shape, strides):
    """A NumPy view of device memory at ptr; every element must lie in a live allocation."""
    dt = np.dtype(dtype)
    hi = sum((n - 1) * s for n, s in zip(shape, strides)) + dt.itemsize if all(shape) else 0
    if hi and not _inside(ptr, hi):
        raise RuntimeError(f"cupy stand-in: cuBLAS operand [{ptr:#x}, +{hi}) is outside any live device "
                           "allocation (wrong ld/stride/batch?)")
    buf = (ctypes.c_char * max(hi, dt.itemsize)).from_address(ptr)
    flat = np.frombuffer(buf, dt, max(hi, dt.itemsize) // dt.itemsize)
    return np.lib.stride_tricks.as_strided(flat, shape=shape, strides=strides)


def gemmStridedBatchedEx(handle, transa, transb, m, n, k, alpha, A, Atype, lda, strideA,
                         B, Btype, ldb, strideB, beta, C, Ctype, ldc, strideC, batchCount,
                         computeType, algo):
    """cuBLAS, column-major: C_i = alpha op(A_i) op(B_i) + beta C_i for i < batchCount."""
    if computeType not in (CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_64F, 0, 1):
        raise NotImplementedError(f"cupy stand-in: computeType {computeType}")
    cdt = np.float64 if computeType in (CUBLAS_COMPUTE_64F, 1) else np.float32
    al = np.frombuffer((ctypes.c_char * 8).from_address(alpha), cdt, 1)[0]
    be = np.frombuffer((ctypes.c_char * 8).from_address(beta), cdt, 1)[0]
    _launch()

    def mat(ptr, typ, ld, stride, rows, cols, trans):
        dt = np.dtype(_ITEM[typ])
        i = dt.itemsize
        if trans:       # stored cols x rows, column-major
            v = _device_view(ptr, dt, (batchCount, cols, rows), (stride * i, i, ld * i))
            return v.transpose(0, 2, 1)
        return _device_view(ptr, dt, (batchCount, rows, cols), (stride * i, i, ld * i))
    a = mat(A, Atype, lda, strideA, m, k, transa)
    b = mat(B, Btype, ldb, strideB, k, n, transb)
    c = mat(C, Ctype, ldc, strideC, m, n, False)
    r = al * np.matmul(a.astype(cdt), b.astype(cdt))
    if be != 0:
        r += be * c.astype(cdt)
    c[...] = r.astype(c.dtype)


def get_cublas_handle():
    return 1


# ------------------------------------------------------------------ install
def _build():
    cp = types.ModuleType("cupy")
    cp.__doc__ = "CuPy stand-in (tests/cupy_standin.py): NumPy underneath, CuPy's rules on top."
    cp.__version__ = "14.0.0-standin"
    cp._standin = True
    for name in ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16",
                 "uint32", "uint64", "intp", "uintp", "bool_", "complex64", "complex128", "dtype",
                 "newaxis", "inf", "nan", "pi", "e", "errstate"):
        setattr(cp, name, getattr(np, name))
    for name in _UFUNCS:
        setattr(cp, name, _ewise(name))
    for name in ("sum", "mean", "max", "min", "prod", "argmax", "argmin", "any", "all"):
        setattr(cp, name, _reduction(name))
    cp.amax, cp.amin = cp.max, cp.min
    for name in _SIMPLE:
        if hasattr(np, name):
            setattr(cp, name, _simple(name))
    for name in ("zeros", "ones", "full", "arange", "linspace", "eye"):
        setattr(cp, name, _creator(getattr(np, name)))
    for name in ("empty", "empty_like", "zeros_like", "ones_like", "asarray", "array", "ascontiguousarray",
                 "asnumpy", "get_array_module", "copyto", "take", "matmul", "dot", "concatenate", "where",
                 "ndarray"):
        setattr(cp, name, globals()[name])
    cp.ElementwiseKernel = _ElementwiseKernel
    cp.get_default_memory_pool = lambda: _POOL
    cp.get_default_pinned_memory_pool = lambda: _POOL

    cuda = types.ModuleType("cupy.cuda")
    rt = types.ModuleType("cupy.cuda.runtime")
    rt.getDeviceCount = n_devices
    rt.getDevice = lambda: _S.device
    rt.setDevice = lambda i: Device(i).use()
    rt.deviceSynchronize = _synchronize
    rt.pointerGetAttributes = pointerGetAttributes
    rt.getDeviceProperties = getDeviceProperties
    rt.memGetInfo = lambda: ((1 << 34) - _S.used, 1 << 34)
    rt.memoryTypeUnregistered, rt.memoryTypeHost, rt.memoryTypeDevice = 0, 1, 2
    rt.CUDA_R_32F, rt.CUDA_R_64F, rt.CUDA_R_16F = 0, 1, 2
    rt.CUDARuntimeError = CUDARuntimeError
    blas = types.ModuleType("cupy.cuda.cublas")
    blas.gemmStridedBatchedEx = gemmStridedBatchedEx
    blas.CUBLAS_OP_N, blas.CUBLAS_OP_T = 0, 1
    blas.CUBLAS_GEMM_DEFAULT = -1
    blas.CUBLAS_COMPUTE_32F, blas.CUBLAS_COMPUTE_64F, blas.CUBLAS_COMPUTE_16F = (
        CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_64F, CUBLAS_COMPUTE_16F)
    dev = types.ModuleType("cupy.cuda.device")
    dev.get_cublas_handle = get_cublas_handle
    dev.Device = Device
    cuda.runtime, cuda.cublas, cuda.device = rt, blas, dev
    cuda.Stream, cuda.Device, cuda.get_current_stream = Stream, Device, get_current_stream
    cuda.get_cublas_handle = get_cublas_handle
    cuda.alloc_pinned_memory, cuda.PinnedMemoryPointer = alloc_pinned_memory, PinnedMemoryPointer
    cuda.MemoryPool = MemoryPool
    cuda.is_available = lambda: n_devices() > 0
    cp.cuda = cuda

    cx = types.ModuleType("cupyx")
    cx.scatter_add = scatter_add
    cx.empty_pinned, cx.zeros_pinned = empty_pinned, zeros_pinned
    cp._modules = {"cupy": cp, "cupy.cuda": cuda, "cupy.cuda.runtime": rt, "cupy.cuda.cublas": blas,
                   "cupy.cuda.device": dev, "cupyx": cx}
    return cp


def install(monkeypatch):
    """Make ``import cupy`` / ``import cupyx`` give the stand-in for one test
    (monkeypatch undoes it), and forget ringzero's cached CuPy lookups."""
    cp = _build()
    for name, m in cp._modules.items():
        monkeypatch.setitem(sys.modules, name, m)
    reset()
    from ringzero.comm import backend, kernels
    monkeypatch.setattr(backend, "_cupy", None)
    monkeypatch.setattr(backend, "_cupy_err", None)
    monkeypatch.setattr(kernels, "_cupy_add", None)
    return cp


def reset():
    _S.pending, _S.device = False, 0
    _S.copies.clear()
    _S.allocs = _S.matmul_nd_copies = _S.host_reads = 0
