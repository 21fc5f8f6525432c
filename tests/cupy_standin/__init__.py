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
      wrong results (from pageable memory CUDA copies before returning;
      pinned means inside a live pinned allocation: freed, its addresses
      are pageable again, as after cudaFreeHost);
    - ``__cuda_array_interface__`` (how mpi4py hands a device buffer to MPI)
      refuses while the stream has unsynchronized work: handing a buffer to
      MPI without ``stream.synchronize()`` first is a race on a GPU;
    - streams and events are modelled as work in stream order: each thread
      has its own current stream (``with stream:``) and current device (a
      kernel on another device's array is CuPy's ValueError), a kernel records
      the allocation it writes, and a buffer whose last writer on some other
      stream is not known to be done (no ``wait_event`` on its event, then a
      synchronize) is refused by ``__cuda_array_interface__`` and ``get()``,
      as the race it would be on a GPU;
    - ``cupy.matmul`` on arrays of more than 2 dims makes the copies CuPy
      makes (float16 operands are copied to float32, the result lands in a
      temporary and is copied into ``out``), counted in ``stats()``;
    - ``cupy.cuda.cublas.gemmStridedBatchedEx`` is emulated on raw pointers
      with cuBLAS's column-major rules; pointers must lie inside live
      stand-in allocations;
    - ``cupy.ElementwiseKernel`` compiles the kernel's own CUDA C++ operation
      string with the host C++ compiler (_kernel.py), parameters bound as CuPy
      binds them, so a kernel's source and arithmetic are checked on the host.

    The memory pool is modelled as a perfect caching allocator: used bytes
    are the live arrays, total bytes the high-water mark.

What it is not
    A GPU. It proves that ringzero uses CuPy's API as CuPy allows (types,
    contiguity, synchronization before MPI, no implicit host copies), and runs
    ElementwiseKernel sources with host arithmetic; it says nothing about
    CUDA's libm, thread layout or speed. Device memory is host
    memory, so "device-direct" MPI here is host MPI on the same pointers.
"""
from __future__ import annotations

import sys
import types

import numpy as np

from . import _routines
from ._core import (
    _S,
    CUDARuntimeError,
    Device,
    Event,
    Stream,
    _synchronize,
    get_current_stream,
    n_devices,
    ndarray,
    stats,
)
from ._cuda import (
    _POOL,
    CUBLAS_COMPUTE_16F,
    CUBLAS_COMPUTE_32F,
    CUBLAS_COMPUTE_64F,
    MemoryPool,
    PinnedMemoryPointer,
    alloc_pinned_memory,
    empty_pinned,
    gemmStridedBatchedEx,
    get_cublas_handle,
    getDeviceProperties,
    pointerGetAttributes,
    scatter_add,
    zeros_pinned,
)
from ._kernel import ElementwiseKernel
from ._routines import _SIMPLE, _UFUNCS, _creator, _ewise, _reduction, _simple

__all__ = ["install", "run_script", "reset", "stats", "ndarray"]

# ------------------------------------------------------------------ install
def _build():
    cp = types.ModuleType("cupy")
    cp.__doc__ = "CuPy stand-in (tests/cupy_standin/): NumPy underneath, CuPy's rules on top."
    cp.__version__ = "14.0.0-standin"
    cp._standin = True
    for name in ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16",
                 "uint32", "uint64", "intp", "uintp", "bool_", "complex64", "complex128", "dtype",
                 "newaxis", "inf", "nan", "pi", "e"):        # no errstate: CuPy has none
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
                 "asnumpy", "get_array_module", "copyto", "take", "matmul", "dot", "concatenate", "where"):
        setattr(cp, name, getattr(_routines, name))
    cp.ndarray = ndarray
    cp.ElementwiseKernel = ElementwiseKernel
    cp.get_default_memory_pool = lambda: _POOL
    cp.get_default_pinned_memory_pool = lambda: _POOL

    cuda = types.ModuleType("cupy.cuda")
    rt = types.ModuleType("cupy.cuda.runtime")
    rt.getDeviceCount = n_devices
    rt.getDevice = lambda: _S.device
    rt.setDevice = lambda device: Device(device).use()
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
    cuda.Stream, cuda.Event, cuda.Device, cuda.get_current_stream = Stream, Event, Device, get_current_stream
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
    from ringzero.nn import fused_cuda
    monkeypatch.setattr(fused_cuda, "_KERNELS", {})
    return cp


class _ForGood:
    """install()'s patcher for a whole process (scripts), with nothing to undo."""

    def setitem(self, d, k, v):
        d[k] = v

    def setattr(self, o, k, v):
        setattr(o, k, v)


def run_script(path, argv=()):
    """Run a Python script with ``cupy`` being the stand-in (launch/gpu-check's
    dry run of its GPU scripts: API use only, its numbers mean nothing)."""
    import runpy
    install(_ForGood())
    sys.argv = [path, *argv]
    runpy.run_path(path, run_name="__main__")


def reset():
    _synchronize()
    _S.device = 0
    _S.tls.streams = None
    _S.writes.clear()
    _S.copies.clear()
    _S.allocs = _S.matmul_nd_copies = _S.host_reads = 0
