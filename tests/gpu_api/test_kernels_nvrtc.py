"""ringzero's CUDA kernels through CuPy's own code generator and NVRTC, without a GPU.

Each ElementwiseKernel of ringzero/nn/fused_cuda.py (and the float16 add of
ringzero/comm/kernels.py) is turned into the CUDA source CuPy would launch,
by CuPy's own generator (cupy._core._kernel: the placeholder typedefs, the
parameter list with its const raw arrays and scalars, the per-element
bindings), for each dtype combination the model uses, and compiled by NVRTC
for sm_90 (the H200) with the options the kernel passes. NVRTC runs on the
host: no device, no driver. This checks that the sources compile as CUDA
C++ with CuPy's headers (its float16 class, CArray), which the CuPy stand-in
(a host C++ compiler) cannot; their arithmetic is checked by
tests/test_fused_cuda.py, and their behaviour on a device by launch/gpu-check.

It reads CuPy internals (``_ArgInfo``, ``_TypeMap``, ``_get_param_info``,
``_get_elementwise_kernel_code``) of the pinned CuPy 14: if they move, the
test fails and says so rather than skipping.
"""
import os
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

pytestmark = pytest.mark.gpu_api

ARCH = "compute_90"
# the dtypes each placeholder takes in the model: T the arrays, the others float statistics and targets
COMBOS = [dict(T="float16", Q="float32", R="float32", W="float32", P="float32", I="int64"),
          dict(T="float32", Q="float32", R="float32", W="float32", P="float32", I="int64"),
          dict(T="float64", Q="float64", R="float64", W="float64", P="float64", I="int64"),
          dict(T="float32", Q="float32", R="float32", W="float32", P="float32", I="int32")]


@pytest.fixture(scope="module")
def nv():
    try:
        import cupy
        from cupy._core import _carray, _kernel, _scalar
        from cupy_backends.cuda.libs import nvrtc
    except Exception as e:      # not installed: this group is run by launch/test-gpu-api
        pytest.skip(f"real CuPy / NVRTC do not import ({type(e).__name__}: {e}); run ./launch/test-gpu-api")
    if getattr(cupy, "_standin", False):
        pytest.fail("`import cupy` gave the stand-in, not the real package")
    for name in ("_ArgInfo", "_TypeMap", "_get_param_info", "_get_elementwise_kernel_code"):
        assert hasattr(_kernel, name), f"cupy._core._kernel.{name} is gone in CuPy {cupy.__version__}"
    inc = os.path.join(os.path.dirname(cupy.__file__), "_core", "include")
    site = os.path.dirname(os.path.dirname(cupy.__file__))
    dirs = [inc] + [os.path.join(inc, "cupy", "_cccl", d) for d in ("libcudacxx", "thrust", "cub")]
    rt = os.path.join(site, "nvidia", "cuda_runtime", "include")                  # cuda_fp16.h
    assert os.path.exists(os.path.join(rt, "cuda_fp16.h")), \
        f"no cuda_fp16.h under {rt}: HINT: launch/test-gpu-api installs nvidia-cuda-runtime-cu12"
    dirs.append(rt)
    return dict(cupy=cupy, K=_kernel, carray=_carray, scalar=_scalar, nvrtc=nvrtc, incs=["-I" + d for d in dirs])


def _source(nv, ins, outs, op, name, preamble, types, scalars):
    """CuPy's own source for the kernel with these placeholder dtypes (1-D, contiguous, 32-bit index)."""
    K, cupy = nv["K"], nv["cupy"]
    params = K._get_param_info(ins, True) + K._get_param_info(outs, False) + K._get_param_info("CIndexer _ind", False)
    infos, tmap = [], {}
    for p in params[:-1]:
        dt = np.dtype(p.dtype if p.dtype is not None else types[p.ctype])
        if p.dtype is None:
            tmap[p.ctype] = dt
        if p.name in scalars:
            infos.append(K._ArgInfo(3, nv["scalar"].CScalar, dt, 0, True, True))     # ARG_KIND_SCALAR
        else:
            infos.append(K._ArgInfo(1, cupy.ndarray, dt, 1, True, True))             # ARG_KIND_NDARRAY
    infos.append(K._ArgInfo(2, nv["carray"].Indexer, None, 1, True, True))          # ARG_KIND_INDEXER
    code = K._get_elementwise_kernel_code(tuple(infos), K._TypeMap(tuple(sorted(tmap.items()))), params, op,
                                          name, preamble)
    hdr = "".join(f"#include <{h}>\n" for h in ("cupy/complex.cuh", "cupy/carray.cuh", "cupy/atomics.cuh",
                                                 "cupy/math_constants.h"))
    return hdr + code


def _compile(nv, src, name, options):
    nvrtc = nv["nvrtc"]
    prog = nvrtc.createProgram(src, name + ".cu", [], [])
    try:
        nvrtc.compileProgram(prog, nv["incs"] + ["-arch=" + ARCH, "--std=c++17", *options])
        return None
    except nvrtc.NVRTCError:
        return nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)


def _kernels():
    from ringzero.nn import fused_cuda as fc
    from ringzero.nn import fused_cuda_llama  # noqa: F401 (its kernels join fc._SOURCES)
    scalar_names = {"m", "eps", "rows", "tn", "scale", "V", "f"}
    for name, (ins, outs, op) in fc._SOURCES.items():
        scalars = {p.split()[-1] for p in ins.split(",")} & scalar_names
        yield name, ins, outs, op, fc._PREAMBLE, scalars, ("--fmad=false",)


def test_fused_kernels_compile_with_nvrtc(nv):
    from ringzero.nn import fused_cuda as fc
    bad, n = [], 0
    for name, ins, outs, op, pre, scalars, opts in _kernels():
        used = {t for t in "TQRWPI" if any(f" {t} " in f" {p.strip()} " for p in (ins + "," + outs).split(","))}
        seen = set()
        for combo in COMBOS:
            key = tuple(sorted((t, combo[t]) for t in used))
            if key in seen:
                continue
            seen.add(key)
            log = _compile(nv, _source(nv, ins, outs, op, name, pre, combo, scalars), name, opts)
            n += 1
            if log:
                bad.append(f"{name} {dict(key)}:\n{log[:1500]}")
    print(f"{n} kernel sources compiled by NVRTC {nv['nvrtc'].getVersion()} for {ARCH}")
    assert n >= 2 * len(fc._SOURCES), f"only {n} kernel/dtype sources were tried"
    assert not bad, "NVRTC refused:\n" + "\n".join(bad)


def test_f16_add_compiles_with_nvrtc(nv):
    src = _source(nv, "float16 a, float16 b", "float16 c", "c = (float16)((float)a + (float)b)",
                  "ringzero_add_f16", "", {}, set())
    log = _compile(nv, src, "ringzero_add_f16", ())
    assert log is None, log


def test_checker_reports_a_kernel_nvrtc_refuses(nv):
    """The check can fail: a made-up intrinsic in an operation is a compile error."""
    src = _source(nv, "T x", "T y", "y = __rz_no_such_intrinsic(x)", "rz_bad", "", {"T": "float32"}, set())
    log = _compile(nv, src, "rz_bad", ())
    assert log and "__rz_no_such_intrinsic" in log


def test_quant_kernels_compile_with_nvrtc(nv):
    """comm/quant_cuda.py's kernels (ZeRO++'s int8 / int4 quantizer) for float32 and float16 arrays."""
    from ringzero.comm import quant_cuda as qc
    scalar_names = {"L", "B", "qmax", "add"}
    bad, n = [], 0
    for name, (ins, outs, op) in qc._SOURCES.items():
        scalars = {p.split()[-1] for p in ins.split(",")} & scalar_names
        for dt in ("float32", "float16"):
            log = _compile(nv, _source(nv, ins, outs, op, name, "", {"X": dt, "O": dt}, scalars), name,
                           ("--fmad=false",))
            n += 1
            if log:
                bad.append(f"{name} {dt}:\n{log[:1500]}")
    assert n == 2 * len(qc._SOURCES)
    assert not bad, "NVRTC refused:\n" + "\n".join(bad)
