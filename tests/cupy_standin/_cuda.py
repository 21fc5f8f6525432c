"""The stand-in's CUDA side: pinned host memory, pointer attributes, the memory
pool, scatter_add and cuBLAS's strided-batched GEMM on raw pointers (see __init__)."""
from __future__ import annotations

import ctypes
import weakref

import numpy as np

from ._core import _S, CUDARuntimeError, _inside, _k, _key, _launch, n_devices, ndarray


# ------------------------------------------------------------- pinned memory
class PinnedMemoryPointer(bytearray):
    """Page-locked host memory: host bytes (the buffer protocol), plus ``ptr``."""

    @property
    def ptr(self):
        return ctypes.addressof((ctypes.c_char * 1).from_buffer(self))

    def size(self):
        return len(self)


def alloc_pinned_memory(size):
    """Page-locked bytes, registered while they live.

    Freed, the bytes go back to malloc, which hands the same addresses to the next NumPy array
    of about that size; that array is pageable (on a GPU too: cudaFreeHost unpins, and CuPy's
    pinned pool never lends its blocks to malloc), so its ``set`` must copy at once. Hence the
    finalizer: a registry that kept dead ranges made such a ``set`` an async DMA that read the
    array only at the next synchronize, after its owner had legitimately reused it."""
    m = PinnedMemoryPointer(int(size))
    if size:
        ptr = m.ptr
        _S.pinned[ptr] = len(m)
        weakref.finalize(m, _S.pinned.pop, ptr, None)
    return m


def empty_pinned(shape, dtype=float, order="C"):
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    mem = alloc_pinned_memory(max(n, 1))
    return np.frombuffer(mem, np.dtype(dtype), int(np.prod(shape))).reshape(shape, order=order)


def zeros_pinned(shape, dtype=float, order="C"):
    out = empty_pinned(shape, dtype, order)
    out[...] = 0
    return out


def _pinned_at(ptr) -> bool:
    """Does byte ptr lie in a live pinned allocation? (a copy: a finalizer may run mid-loop)"""
    return any(q <= ptr < q + n for q, n in _S.pinned.copy().items())


def _pinned(arr) -> bool:
    return _pinned_at(arr.__array_interface__["data"][0])


class _PointerAttributes:
    def __init__(self, kind):
        self.type = kind


def pointerGetAttributes(ptr):
    if _pinned_at(ptr):
        return _PointerAttributes(1)            # memoryTypeHost
    return _PointerAttributes(2 if _inside(ptr, 1) else 0)


def getDeviceProperties(device):
    if not 0 <= device < n_devices():
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
    _launch(a)
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
    _launch(C)

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
    # the row-major product the caller means (C^T = B^T A^T), computed on those row-major views,
    # so that NumPy runs the very call the host path runs on the same bytes (same bits)
    r = al * np.matmul(b.transpose(0, 2, 1).astype(cdt), a.transpose(0, 2, 1).astype(cdt)).transpose(0, 2, 1)
    if be != 0:
        r += be * c.astype(cdt)
    c[...] = r.astype(c.dtype)


def get_cublas_handle():
    return 1
