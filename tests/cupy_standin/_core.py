"""The stand-in's device array, streams, devices and allocation registry (see __init__)."""
from __future__ import annotations

import bisect
import ctypes
import os
import sys
import threading
import weakref

import numpy as np
from numpy.lib.array_utils import byte_bounds

_SCALARS = (bool, int, float, complex, np.generic)


class _State:
    """The stand-in's device state. ``device`` is per thread, as cudaSetDevice is."""

    def __init__(self):
        self.copies = []              # queued host->device copies: (dst np view, host array)
        self.tls = threading.local()  # .device, .streams (the `with stream:` stack) of each thread
        self.writes = {}              # allocation start -> [(lo, hi, Stream, epoch)] of writes maybe not done
        self.live = {}                # root base ptr -> nbytes (device allocations)
        self.starts = []              # sorted base ptrs
        self.used = 0
        self.high = 0
        self.allocs = 0
        self.matmul_nd_copies = 0
        self.host_reads = 0           # device->host reads that block: float(a), int(a), a.get()
        self.pinned = {}              # ptr -> nbytes of the LIVE pinned host allocations (see _cuda.py)

    device = property(lambda self: getattr(self.tls, "device", 0),
                      lambda self, d: setattr(self.tls, "device", d))

    @property
    def pending(self) -> bool:
        """Has the calling thread's current stream work not yet synchronized?"""
        return get_current_stream()._busy


_S = _State()


def n_devices() -> int:
    return int(os.environ.get("RINGZERO_STANDIN_DEVICES", "1"))


def stats() -> dict:
    """Counters for tests: device allocations made, live/high-water bytes, nd-matmul copies."""
    return {"allocs": _S.allocs, "used_bytes": _S.used, "high_bytes": _S.high,
            "matmul_nd_copies": _S.matmul_nd_copies, "host_reads": _S.host_reads}


# ---------------------------------------------------------------- streams
# Work is modelled as epochs: a kernel launched on stream s is s's epoch s._queued += 1, and it is
# done once s._done reaches it. s.synchronize() (or an event's) completes s up to then, and, through
# every wait_event s has queued, the other streams' work those events marked. A kernel records
# the bytes it writes (``_launch(out)``), so a buffer handed to MPI or read back while a write
# into its bytes is not known to be done is a race the stand-in refuses, whatever thread asks.
def _flush():
    for dst, host in _S.copies:
        dst[...] = host.reshape(dst.shape)   # read the host array only now, as an async copy does
    _S.copies.clear()


def _alloc_of(ptr):
    """The start of the live device allocation holding byte ptr, or None."""
    i = bisect.bisect_right(_S.starts, ptr) - 1
    if i >= 0 and ptr < _S.starts[i] + _S.live[_S.starts[i]]:
        return _S.starts[i]
    return None


def _bounds(w):
    """[lo, hi) bytes of what a kernel writes: a device array (stand-in, or its NumPy view), or a pointer."""
    if isinstance(w, int):
        return w, w + 1
    a = w._a if isinstance(w, ndarray) else w
    return byte_bounds(a) if a.size else (0, 0)


def _launch(*written):
    """A kernel is about to run on the current stream (stream order: queued copies land first).

    written: what it writes: device arrays (stand-in, or their NumPy views) or device pointers.
    Each allocation keeps the byte ranges written by work not known to be done."""
    _flush()
    s = get_current_stream()
    s._queued += 1
    for w in written:
        _wrote(_bounds(w), s)


def _wrote(bounds, s):
    lo, hi = bounds
    k = _alloc_of(lo) if hi > lo else None
    if k is not None:
        live = [e for e in _S.writes.get(k, ()) if e[2]._done < e[3]]
        live.append((lo, hi, s, s._queued))
        _S.writes[k] = live


def _unfinished_writer(a):
    """The stream of a write into a's bytes that is not known to be done, or None."""
    lo, hi = _bounds(a)
    for wlo, whi, s, ep in _S.writes.get(_alloc_of(lo), ()) if hi > lo else ():
        if wlo < hi and lo < whi and s._done < ep:
            return s
    return None


def _synchronize():
    """cudaDeviceSynchronize: every stream's work done."""
    _flush()
    for s in list(Stream._all):
        s._done = s._queued


class Stream:
    _all = weakref.WeakSet()

    def __init__(self, null=False, non_blocking=False, ptds=False, priority=None):
        self.ptr = 0 if null else id(self)
        self._queued = self._done = 0     # epochs: work queued, work done
        self._waits = []            # (my epoch, event's stream, its epoch) of each wait_event
        self._prev = None
        Stream._all.add(self)

    _busy = property(lambda self: self._done < self._queued)
    done = property(lambda self: not self._busy)    # CuPy's: all work queued here is done

    def _complete(self, upto):
        if upto <= self._done:
            return
        self._done = upto
        for mine, src, theirs in self._waits:
            if mine <= upto:
                src._complete(theirs)
        self._waits = [w for w in self._waits if w[0] > upto]

    def synchronize(self):
        _flush()
        self._complete(self._queued)

    def wait_event(self, event):
        """cudaStreamWaitEvent: work queued here after this runs after the event's work."""
        if event._stream is not None:
            self._queued += 1
            self._waits.append((self._queued, event._stream, event._epoch))

    def record(self, event=None):
        event = Event() if event is None else event
        event.record(self)
        return event

    def use(self):
        _S.tls.streams = [self]
        return self

    def __enter__(self):
        st = getattr(_S.tls, "streams", None)
        if st is None:
            st = _S.tls.streams = [Stream.null]
        st.append(self)
        return self

    def __exit__(self, *a):
        _S.tls.streams.pop()
        return False


Stream.null = Stream(null=True)


def get_current_stream(device_id=-1):
    st = getattr(_S.tls, "streams", None)
    return st[-1] if st else Stream.null


class Event:
    """cudaEvent: marks a stream's work queued so far (record); done once that work is."""

    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self._stream, self._epoch = None, 0

    def record(self, stream=None):
        self._stream = get_current_stream() if stream is None else stream
        self._epoch = self._stream._queued

    @property
    def done(self) -> bool:
        return self._stream is None or self._stream._done >= self._epoch

    def synchronize(self):
        if self._stream is not None:
            _flush()
            self._stream._complete(self._epoch)


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

    def copy_from_device_async(self, src, size, stream=None):
        """cudaMemcpyAsync device-to-device of ``size`` bytes from ``src`` (a MemoryPointer)."""
        for p in (self.ptr, src.ptr):
            if size and not _inside(p, size):
                raise RuntimeError(f"cupy stand-in: memcpy [{p:#x}, +{size}) is outside any live device allocation")
        _launch(self.ptr)
        ctypes.memmove(self.ptr, src.ptr, size)

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
    _wrote(_bounds(r), get_current_stream())     # the kernel that made it wrote it
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
        if _unfinished_writer(self._a) is not None:
            raise RuntimeError("cupy stand-in: a device buffer was handed out (to MPI?) while a kernel that "
                               "writes it on another stream may still run; wait for its event first")
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
        if blocking:
            get_current_stream().synchronize()
        else:
            _flush()
        if _unfinished_writer(self._a) is not None:
            raise RuntimeError("cupy stand-in: get() read a device buffer that a kernel on another stream "
                               "may still be writing; make this stream wait for its event first")
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
        _launch(self)
        from ._cuda import _pinned
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
        _launch(self)
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
    def astype(self, dtype, order="K", casting=None, subok=None, copy=True):
        if not copy and self.dtype == np.dtype(dtype):
            return self
        _launch()
        return _wrap(self._a.astype(dtype, order=order, casting=casting or "unsafe"), fresh=True)

    def copy(self, order="C"):
        _launch()
        return _wrap(self._a.copy(order=order), fresh=True)

    def fill(self, value):
        _launch(self)
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
    if "cupy" in sys.modules and getattr(sys.modules["cupy"], "_standin", False):
        return sys.modules["cupy"]
    from . import _build
    return _build()
