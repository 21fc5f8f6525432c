"""The host GEMM under the model's 2-D products: numpy.matmul, or MKL's cblas_?gemm where MKL is faster.

What it is
    ``matmul(a, b, out)``: out = a @ b for the 2-D products of every Linear
    and of the tied head, forward and backward: (N, in) @ (in, out),
    (in, N) @ (N, out) and (N, out) @ (out, in), where a and b are row-major
    arrays or transposed views of one (``x2.T``, ``w.T``) and out is
    C-contiguous. These are about 60 % of a step's time at width 128.

    Which library, fixed for the process by ``RINGZERO_BLAS``:
      auto   (default) MKL where the ``mkl`` wheel is installed and the CPU is
             Intel's, numpy's OpenBLAS otherwise. One width-128 layer's twelve
             GEMM shapes (``benchmarks/sgemm_libs.py --n-embd 128``) run at
             155.6 GFLOP/s in MKL against 135.6 in OpenBLAS on an Intel Xeon
             with AVX-512, and at 100.4 against 116.9 on an AMD EPYC: no
             library wins on both, so the choice follows the vendor;
             ``launch/_env.sh`` installs the wheel on Intel hosts only.
      numpy  numpy.matmul always.
      mkl    MKL, or a one-line error naming what is missing.
    ``library()`` names the choice ("mkl 2026.2" or "numpy"); the trainer's
    thread line and bench_model.py print it.

    Determinism: MKL runs in its conditional numerical reproducibility mode
    (``MKL_CBWR_Set(MKL_CBWR_AUTO)``, the fastest code path of this CPU,
    chosen once), so a product's bits depend on its shapes and values, not on
    where its buffers sit in memory: every ZeRO stage multiplies the same
    views and stays bitwise equal to the others. The thread count is what
    ``ringzero.comm.threads`` sets (MKL reads MKL_NUM_THREADS when it loads,
    on the first product, after the trainer has set it).

    Anything else, on either library, goes to ``xp.matmul`` unchanged:
    CuPy arrays, float16, more than 2 dims, strides BLAS cannot take.

What it is not
    The attention products: those are batched over strided head views and
    stay numpy.matmul (attention.py). Not a general BLAS binding.
"""
from __future__ import annotations

import ctypes
import glob
import os
import sys

import numpy as np

ENV = "RINGZERO_BLAS"
CHOICES = ("auto", "numpy", "mkl")
_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112
_MKL_CBWR_AUTO = 2

_state = {}             # "lib": None (numpy) or the loaded CDLL; "name": what library() returns


class BlasError(RuntimeError):
    """RINGZERO_BLAS asks for something this machine cannot give (one line)."""


def _cpu_vendor() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _mkl_paths() -> list:
    """libmkl_rt of the `mkl` wheel: <prefix>/lib/libmkl_rt.so.N of this interpreter's environment."""
    found = []
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        found += sorted(glob.glob(os.path.join(prefix, "lib", "libmkl_rt.so*")), reverse=True)
    return found


def _load_mkl():
    """(CDLL, version) of MKL in CNR-auto mode, or (None, why not)."""
    paths = _mkl_paths()
    if not paths:
        return None, f"no libmkl_rt under {sys.prefix}/lib (pip install mkl)"
    try:
        lib = ctypes.CDLL(paths[0])
    except OSError as e:
        return None, f"{paths[0]}: {e}"
    if lib.MKL_CBWR_Set(_MKL_CBWR_AUTO) != 0:        # the C interface; 0: MKL_CBWR_SUCCESS
        return None, f"{paths[0]}: MKL_CBWR_Set(MKL_CBWR_AUTO) refused"
    for name, T in (("cblas_sgemm", ctypes.c_float), ("cblas_dgemm", ctypes.c_double)):
        f = getattr(lib, name)
        f.argtypes = [ctypes.c_int] * 6 + [T, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                           T, ctypes.c_void_p, ctypes.c_int]
        f.restype = None
    buf = ctypes.create_string_buffer(256)
    lib.MKL_Get_Version_String(buf, len(buf))
    words = buf.value.decode(errors="replace").split()
    version = next((w.split("-")[0] for w in words if w[:1].isdigit()), "?")
    return lib, version


def check_setting(setting: str | None = None) -> None:
    """Raise BlasError for a RINGZERO_BLAS this machine cannot honour, without loading any library
    (the trainer's input checks, before mpirun)."""
    setting = (os.environ.get(ENV, "auto") if setting is None else setting).strip().lower() or "auto"
    if setting not in CHOICES:
        raise BlasError(f"{ENV} must be one of {', '.join(CHOICES)}, got {setting!r}")
    if setting == "mkl" and not _mkl_paths():
        raise BlasError(f"{ENV}=mkl: MKL cannot be loaded: no libmkl_rt under {sys.prefix}/lib (pip install mkl)")


def choose(setting: str | None = None, vendor: str | None = None):
    """(CDLL or None, name) for a RINGZERO_BLAS setting; raises BlasError for a bad or unmet one."""
    setting = (os.environ.get(ENV, "auto") if setting is None else setting).strip().lower() or "auto"
    if setting not in CHOICES:
        raise BlasError(f"{ENV} must be one of {', '.join(CHOICES)}, got {setting!r}")
    if setting == "numpy":
        return None, "numpy"
    vendor = _cpu_vendor() if vendor is None else vendor
    if setting == "auto" and vendor != "GenuineIntel":
        return None, "numpy"
    lib, version = _load_mkl()
    if lib is None:
        if setting == "mkl":
            raise BlasError(f"{ENV}=mkl: MKL cannot be loaded: {version}")
        return None, "numpy"
    return lib, f"mkl {version}"


def _lib():
    if "lib" not in _state:
        _state["lib"], _state["name"] = choose()
    return _state["lib"]


def library() -> str:
    """The library the model's 2-D products run in: "numpy" or "mkl <version>"."""
    _lib()
    return _state["name"]


def _operand(x):
    """(transpose flag, leading dimension) of a 2-D host array as a row-major BLAS operand, or None."""
    s0, s1 = x.strides
    it = x.itemsize
    if s1 == it and s0 >= max(1, x.shape[1]) * it and s0 % it == 0:
        return _NO_TRANS, s0 // it
    if s0 == it and s1 >= max(1, x.shape[0]) * it and s1 % it == 0:
        return _TRANS, s1 // it
    return None


def matmul(a, b, out):
    """out = a @ b; a (M, K), b (K, N), out (M, N) C-contiguous. Returns out."""
    lib = _lib()
    if (lib is None or type(out) is not np.ndarray or type(a) is not np.ndarray or type(b) is not np.ndarray
            or out.ndim != 2 or a.ndim != 2 or b.ndim != 2 or not out.flags.c_contiguous
            or not (a.dtype == b.dtype == out.dtype) or out.dtype not in (np.float32, np.float64)):
        return np.matmul(a, b, out=out) if type(out) is np.ndarray else _xp_matmul(a, b, out)
    M, K = a.shape
    N = b.shape[1]
    if b.shape[0] != K or out.shape != (M, N):
        raise ValueError(f"matmul: expected a (M, K) @ b (K, N) -> out (M, N), got {a.shape} @ {b.shape} "
                         f"-> {out.shape}")
    oa, ob = _operand(a), _operand(b)
    if oa is None or ob is None or min(M, N, K) == 0:
        return np.matmul(a, b, out=out)
    f = lib.cblas_sgemm if out.dtype == np.float32 else lib.cblas_dgemm
    f(_ROW_MAJOR, oa[0], ob[0], M, N, K, 1.0, a.ctypes.data, oa[1], b.ctypes.data, ob[1],
      0.0, out.ctypes.data, N)
    return out


def _xp_matmul(a, b, out):
    from ringzero.nn.ops import array_module
    return array_module(out).matmul(a, b, out=out)
