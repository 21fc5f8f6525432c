"""Which single-thread sgemm the package registries give NumPy here: numpy's own BLAS against the others.

What it is
    Times C = op(A) op(B) in float32 on one thread for every GEMM shape of
    one GPT layer's forward and backward (batch 8 x T 128 rows, width
    ``--n-embd``: the qkv, proj and MLP projections, and their dX and dW
    products), in each BLAS it finds installed:

        numpy      numpy.matmul (numpy's bundled OpenBLAS; threadpoolctl names it)
        mkl        cblas_sgemm of libmkl_rt (pip install mkl), through ctypes
        sopenblas  scipy_cblas_sgemm of the scipy-openblas32 wheel (a newer OpenBLAS)
        blis       blis.py.gemm of the blis wheel (cython-blis)

    Every product is checked against float64 first; the best of 7 repeats
    (5 calls each) gives the GFLOP/s per shape, and the last line the whole
    layer's rate (its FLOPs over the sum of its best times). A library that
    is not installed is skipped with the line that installs it. The threads
    are pinned to one by the environment this script sets before loading
    any BLAS.

What it is not
    A benchmark of ringzero: it only says how fast the GEMMs under the model
    can be. ringzero computes with numpy.matmul.

    python3 -m venv /tmp/blas && /tmp/blas/bin/pip install numpy threadpoolctl mkl scipy-openblas32 blis
    /tmp/blas/bin/python benchmarks/sgemm_libs.py --n-embd 128
"""
from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS"):
    os.environ[_v] = "1"         # before any BLAS is loaded: one thread each

import argparse  # noqa: E402
import ctypes  # noqa: E402
import glob  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112


def _cblas(path, symbol):
    """mm(a, b, out, ta, tb) over a cblas_sgemm in the shared library at path (row-major)."""
    f = getattr(ctypes.CDLL(path), symbol)
    f.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                       ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    f.restype = None

    def mm(a, b, out, ta, tb):
        M, N = out.shape
        K = a.shape[0] if ta else a.shape[1]
        f(ROW_MAJOR, TRANS if ta else NO_TRANS, TRANS if tb else NO_TRANS, M, N, K,
          1.0, a.ctypes.data, a.shape[1], b.ctypes.data, b.shape[1], 0.0, out.ctypes.data, N)
    return mm


def libraries() -> tuple:
    """({name: mm}, [lines for the ones missing])."""
    libs = {"numpy": lambda a, b, out, ta, tb: np.matmul(a.T if ta else a, b.T if tb else b, out=out)}
    missing = []
    mkl = sorted(glob.glob(os.path.join(sys.prefix, "lib", "libmkl_rt.so*")))
    if mkl:
        libs["mkl"] = _cblas(mkl[0], "cblas_sgemm")
    else:
        missing.append("mkl: not installed (pip install mkl)")
    try:
        import scipy_openblas32
        libs["sopenblas"] = _cblas(os.path.join(scipy_openblas32.get_lib_dir(), "libscipy_openblas.so"),
                                   "scipy_cblas_sgemm")
    except (ImportError, OSError, AttributeError):
        missing.append("sopenblas: not installed (pip install scipy-openblas32)")
    try:
        import blis.py
        libs["blis"] = lambda a, b, out, ta, tb: blis.py.gemm(a, b, out=out, trans1=ta, trans2=tb, beta=0.0)
    except ImportError:
        missing.append("blis: not installed (pip install blis)")
    return libs, missing


def shapes(C: int, rows: int) -> list:
    """(tag, A shape, B shape, transpose A, transpose B) of one layer's GEMMs, forward and backward."""
    out = []
    for k, n in ((C, 3 * C), (C, C), (C, 4 * C), (4 * C, C)):     # qkv, proj, fc, fc-proj: W (k, n)
        out += [("y = x W", (rows, k), (k, n), False, False),
                ("dX = dY W^T", (rows, n), (k, n), False, True),
                ("dW = X^T dY", (rows, k), (rows, n), True, False)]
    return out


def best_time(mm, a, b, out, ta, tb, repeats=7, calls=5) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            mm(a, b, out, ta, tb)
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n-embd", type=int, default=256, help="model width C (the trainer's default run: 128)")
    ap.add_argument("--rows", type=int, default=1024, help="batch x T (default 8 x 128)")
    a = ap.parse_args(argv)
    if a.n_embd < 1 or a.rows < 1:
        print(f"sgemm_libs: --n-embd and --rows must be >= 1, got {a.n_embd} and {a.rows}", file=sys.stderr)
        return 2
    libs, missing = libraries()
    try:
        from threadpoolctl import threadpool_info
        blas = "; ".join(f"{i.get('internal_api')} {i.get('version')} core={i.get('architecture')}"
                         for i in threadpool_info() if i.get("user_api") == "blas")
    except ImportError:
        blas = "(threadpoolctl not installed)"
    print(f"# sgemm, one thread, float32, C = {a.n_embd}, {a.rows} rows; loaded BLAS: {blas}; "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for line in missing:
        print(f"# skipped {line}")
    names = list(libs)
    print(f"# {'product':<12} {'A':>12} {'B':>12} | " + " ".join(f"{n:>9}" for n in names) + "   (GFLOP/s)")
    rng = np.random.default_rng(0)
    total = dict.fromkeys(names, 0.0)
    flops = 0
    for tag, sa, sb, ta, tb in shapes(a.n_embd, a.rows):
        A = rng.standard_normal(sa, dtype=np.float32)
        B = rng.standard_normal(sb, dtype=np.float32)
        opA, opB = (A.T if ta else A), (B.T if tb else B)
        out = np.empty((opA.shape[0], opB.shape[1]), np.float32)
        ref = opA.astype(np.float64) @ opB.astype(np.float64)
        fl = 2 * opA.shape[0] * opA.shape[1] * opB.shape[1]
        flops += fl
        cells = []
        for name in names:
            out[...] = np.nan
            libs[name](A, B, out, ta, tb)
            if not np.allclose(out, ref, rtol=1e-4, atol=1e-3 * np.sqrt(opA.shape[1])):
                print(f"sgemm_libs: {name} gave a wrong {tag} product", file=sys.stderr)
                return 1
            t = best_time(libs[name], A, B, out, ta, tb)
            total[name] += t
            cells.append(f"{fl / t / 1e9:>9.1f}")
        print(f"  {tag:<12} {str(sa):>12} {str(sb):>12} | " + " ".join(cells))
    print(f"  {'the layer':<12} {'':>12} {'':>12} | "
          + " ".join(f"{flops / total[n] / 1e9:>9.1f}" for n in names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
