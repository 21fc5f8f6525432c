"""The real CuPy's API against ringzero's calls and the CuPy stand-in, without a GPU.

What these check (group ``gpu-api``: ``./launch/test-gpu-api``, which installs
cupy-cuda12x and the nvidia-cublas-cu12 libraries into a venv of its own):

- every CuPy name ringzero calls (``cupy.*``, ``cupyx.*``, read from the source
  by tests/gpu_api/cupy_names.py, and every ``xp.NAME`` of ringzero/) exists in
  the real package (importing CuPy needs no GPU; only allocation does);
- every public name of the stand-in (tests/cupy_standin/) exists in the real
  module of the same name, with the same value for integer constants
  (cudaDataType, cublasComputeType_t, ...), and every callable and method of
  the stand-in takes its arguments as CuPy's does: names, order, keyword use,
  defaults (cupy_names.incompatible).

What they do not check: anything that needs a device (allocation, kernels,
numerics), or types. A stand-in wrapper that forwards ``*args, **kw`` is
checked by name only, and a CuPy callable that exposes no signature (neither
``inspect.signature`` nor Cython's embedded one) is listed, not compared.
"""
import inspect
import os
import sys
import types

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import cupy_names as cn  # noqa: E402

pytestmark = pytest.mark.gpu_api

# the stand-in's ndarray also carries NumPy-protocol hooks the real one has; these are Python's own
_PY_OWN = {"__dict__", "__module__", "__weakref__", "__doc__", "__init__", "__annotations__", "__slots__",
           "__firstlineno__", "__static_attributes__", "__qualname__"}


_RECEIVED = {"cupy.cuda.memory.MemoryPointer", "cupy._core.flags.Flags"}


@pytest.fixture(scope="module")
def cupy():
    try:
        import cupy
    except Exception as e:      # not installed: this group is run by launch/test-gpu-api
        pytest.skip(f"real CuPy does not import ({type(e).__name__}: {e}); run ./launch/test-gpu-api")
    if getattr(cupy, "_standin", False):
        pytest.fail("`import cupy` gave the stand-in, not the real package")
    return cupy


@pytest.fixture(scope="module")
def standin():
    import cupy_standin
    from cupy_standin import _core
    mods = dict(cupy_standin._build()._modules)  # {"cupy": module, "cupy.cuda": ..., ...}, sys.modules untouched
    # classes ringzero meets only through an array (a.data.ptr, a.flags.c_contiguous), under CuPy's names;
    # their members are compared, not their constructors (_RECEIVED): nobody builds one by hand
    mods["cupy.cuda.memory"] = types.SimpleNamespace(MemoryPointer=_core.MemoryPointer)
    mods["cupy._core.flags"] = types.SimpleNamespace(Flags=_core.Flags)
    return mods


def _surface(mods):
    """(dotted name, stand-in object) for every public name of every stand-in module,
    and (Class.member, member) for the members its classes define themselves."""
    for mname, m in mods.items():
        for k, v in sorted(vars(m).items()):
            if k.startswith("_") or isinstance(v, types.ModuleType):
                continue
            yield f"{mname}.{k}", v
            if inspect.isclass(v) and v.__module__.split(".")[0] not in ("numpy", "builtins"):
                for a in sorted(vars(v)):
                    m = inspect.getattr_static(v, a)
                    api = callable(m) or isinstance(m, (property, staticmethod, classmethod))
                    if api and a not in _PY_OWN and not (a.startswith("_") and not a.startswith("__")):
                        yield f"{mname}.{k}.{a}", m     # class data (a lookup table) is no API


def _unique_surface(mods):
    seen = {}
    for name, v in _surface(mods):
        seen.setdefault(name, v)
    return seen


# ------------------------------------------------------------- ringzero's calls
def test_every_cupy_name_ringzero_calls_exists(cupy):
    names = {**cn.project_names(), **cn.xp_names()}
    assert len(names) > 20, f"the scan found only {sorted(names)}: is cupy_names reading the sources?"
    for known in ("cupy.cuda.cublas.gemmStridedBatchedEx", "cupy.cuda.alloc_pinned_memory",
                  "cupy.cuda.runtime.getDeviceCount", "cupy.ElementwiseKernel", "cupy.copyto"):
        assert known in names, f"the scan missed {known}, which ringzero calls"
    bad = cn.missing(names)
    assert not bad, "CuPy names ringzero uses that the real CuPy lacks:\n" + "\n".join(
        f"  {n} ({bad[n]}; used in {', '.join(names[n])})" for n in sorted(bad)) + \
        "\nHINT: cupy.cuda.cublas needs the nvidia-cublas-cu12 wheel's libraries"
    print(f"{len(names)} CuPy names ringzero uses, all in CuPy {cupy.__version__}:")
    for n in sorted(names):
        print(f"  {n}  ({', '.join(names[n])})")


def test_every_call_ringzero_makes_binds_to_cupys_signature(cupy):
    """Each call's argument count and keyword names against the real signature (``Signature.bind``):
    the wrappers the stand-in forwards to NumPy (ufuncs, cumsum, searchsorted, ...) are checked here."""
    bad, bound, opaque = [], 0, set()
    calls = cn.project_calls()
    assert len(calls) > 50, f"the scan found only {len(calls)} calls"
    absent = cn.missing({c[0] for c in calls})
    for name, npos, kws, where in calls:
        if name in absent:
            continue                                    # test_every_cupy_name_ringzero_calls_exists says so
        sig = cn.signature_of(cn.resolve(name))
        if sig is None:
            opaque.add(name)
            continue
        why = cn.refused(sig, npos, kws)
        bound += not why
        if why:
            bad.append(f"{where}: {name}({npos} positional{', ' if kws else ''}{', '.join(k + '=' for k in kws)}) "
                       f"against CuPy's {name}{sig}: {why}")
    print(f"{bound} calls bound to CuPy's signatures; not comparable: {', '.join(sorted(opaque)) or 'none'}")
    assert not bad, "calls CuPy would refuse:\n  " + "\n  ".join(bad)


# ------------------------------------------------------------------ the stand-in
def test_every_standin_name_exists_in_cupy(cupy, standin):
    surface = _unique_surface(standin)
    bad = cn.missing(surface)
    assert not bad, "names the stand-in provides that the real CuPy lacks (code written against the stand-in " \
                    "would fail on a GPU):\n" + "\n".join(f"  {n}: {bad[n]}" for n in sorted(bad))


def test_standin_constants_are_cupys(cupy, standin):
    """cudaDataType, cublasOperation_t, cublasComputeType_t, cudaMemoryType: ringzero passes these
    to cuBLAS and compares pointer attributes with them, so their values matter, not only their names."""
    bad, n = [], 0
    for name, v in _unique_surface(standin).items():
        if isinstance(v, int) and not isinstance(v, bool):
            n += 1
            real = cn.resolve(name)
            if int(real) != v:
                bad.append(f"{name}: stand-in {v}, CuPy {int(real)}")
        elif isinstance(v, type) and issubclass(v, __import__("numpy").generic):
            n += 1
            if cn.resolve(name) is not v:
                bad.append(f"{name}: stand-in {v}, CuPy {cn.resolve(name)}")
    assert n >= 10, f"only {n} constants found in the stand-in"
    assert not bad, "constants that differ:\n  " + "\n  ".join(bad)


def test_standin_signatures_match_cupys(cupy, standin):
    problems, compared, by_name, opaque = [], [], [], []
    surface = _unique_surface(standin)
    absent = cn.missing(surface)                        # test_every_standin_name_exists_in_cupy's business
    for name, v in surface.items():
        if name in absent:
            continue
        if isinstance(v, (staticmethod, classmethod)):
            v = v.__func__
        if isinstance(v, property) or not callable(v) or name.split(".")[-1].startswith("__"):
            continue
        real = cn.resolve(name)
        if v is real or name in _RECEIVED:              # NumPy's own (cupy.float32 is numpy.float32)
            continue
        s = cn.signature_of(v)
        if s is None or cn.generic(s):
            by_name.append(name)
            continue
        r = cn.signature_of(real)
        if r is None:
            opaque.append(name)
            continue
        method = inspect.isclass(cn.resolve(name.rsplit(".", 1)[0]))
        s, r = (cn.bare(t, method) for t in (s, r))
        compared.append(name)
        problems += [f"{name}{s} vs CuPy {name}{r}: {p}" for p in cn.incompatible(s, r)]
    print(f"compared {len(compared)} signatures: {', '.join(compared)}")
    print(f"by name only ({len(by_name)}; the stand-in forwards *args, **kw): {', '.join(by_name)}")
    print(f"not comparable ({len(opaque)}; CuPy exposes no signature): {', '.join(opaque) or 'none'}")
    assert len(compared) > 20, f"only {len(compared)} signatures compared"
    assert not problems, "stand-in signatures that differ from CuPy's:\n  " + "\n  ".join(problems)


# ------------------------------------------------------- the checker can fail
def test_checker_reports_a_made_up_name(cupy):
    bad = cn.missing(["cupy.cuda.runtime.getDeviceCount", "cupy.cuda.runtime.notARealCall", "cupy.nope.deeper"])
    assert sorted(bad) == ["cupy.cuda.runtime.notARealCall", "cupy.nope.deeper"], bad


def test_checker_reports_a_wrong_signature(cupy):
    from cupy.cuda import cublas
    r = cn.signature_of(cublas.gemmStridedBatchedEx)
    assert r is not None and len(r.parameters) == 23 and list(r.parameters)[:3] == ["handle", "transa", "transb"]
    right = inspect.Signature([inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in r.parameters])
    assert cn.incompatible(right, r) == []
    names = list(r.parameters)
    names[1], names[2] = names[2], names[1]            # transb before transa
    swapped = right.replace(parameters=[inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                                        for n in names])
    assert any("argument 1" in p for p in cn.incompatible(swapped, r))

    def get(stream=None, order="F", out=None, blocking=True, pinned=False):    # wrong default, extra kwarg
        pass
    got = cn.incompatible(inspect.signature(get), cn.signature_of(cupy.ndarray.get))
    assert any("default of order" in p for p in got) and any("pinned=" in p for p in got), got

    def short(handle, transa):                          # CuPy requires 21 more
        pass
    assert any("requires 'm'" in p for p in cn.incompatible(inspect.signature(short), r))


def test_checker_reports_a_call_cupy_refuses(cupy):
    """NumPy takes these; CuPy does not (the stand-in's NumPy-forwarding wrappers would let them by)."""
    add = cn.signature_of(cupy.add)
    assert add is not None and cn.refused(add, 2, ["out", "casting", "dtype"]) == ""
    assert "where" in cn.refused(add, 2, ["out", "where"])                      # numpy.add(..., where=)
    assert cn.refused(cn.signature_of(cupy.take), 2, ["axis", "out", "mode"])   # numpy.take(..., mode=)
    assert cn.refused(cn.signature_of(cupy.cuda.alloc_pinned_memory), 2, [])
