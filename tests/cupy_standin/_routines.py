"""The stand-in's kernels and module-level routines: ufuncs, reductions, creation,
copies, matmul (with CuPy's copies counted). ElementwiseKernel is _kernel.py."""
from __future__ import annotations

import numpy as np

from ._core import _S, _k, _key, _launch, _mod, _register, _wrap, ndarray


def _ewise(name):
    """A CuPy ufunc: device arrays and scalars in, device array out."""
    npf = getattr(np, name)

    def f(*args, out=None, **kw):
        xs = [_k(a) for a in args]
        if out is not None and not isinstance(out, ndarray):
            raise TypeError(f"Unsupported type {type(out)}")
        _launch(*(() if out is None else (out,)))
        if out is not None:
            npf(*xs, out=out._a, **kw)
            return out
        return _wrap(npf(*xs, **kw), fresh=True)

    def at(a, idx, b):
        if not isinstance(a, ndarray):
            raise TypeError(f"Unsupported type {type(a)}")
        _launch(a)
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


# CuPy 14's parameters (cupy/_math/sumprod.py, _statistics, _sorting/search.py, _logic/truth.py): only
# these take dtype=; the ndarray methods order argmax/argmin's as (axis, out, dtype, keepdims)
_DTYPE_REDUCTIONS = ("sum", "mean", "prod", "argmax", "argmin")


def _reduce(name, a, axis, dtype, out, keepdims):
    x = _k(a)
    _launch(*(() if out is None else (out,)))
    kw = {} if dtype is None else {"dtype": dtype}
    r = getattr(np, name)(x, axis=axis, keepdims=bool(keepdims), **kw)
    if out is not None:
        out._a[...] = r
        return out
    return _wrap(r, fresh=True)


def _reduction(name):
    if name in _DTYPE_REDUCTIONS:
        def f(a, axis=None, dtype=None, out=None, keepdims=False):
            return _reduce(name, a, axis, dtype, out, keepdims)
    else:
        def f(a, axis=None, out=None, keepdims=False):
            return _reduce(name, a, axis, None, out, keepdims)
    f.__name__ = name
    return f


def _method(name):
    if name in ("argmax", "argmin"):
        def m(self, axis=None, out=None, dtype=None, keepdims=False):
            return _reduce(name, self, axis, dtype, out, keepdims)
    elif name in _DTYPE_REDUCTIONS:
        def m(self, axis=None, dtype=None, out=None, keepdims=False if name != "prod" else None):
            return _reduce(name, self, axis, dtype, out, keepdims)
    else:
        def m(self, axis=None, out=None, keepdims=False):
            return _reduce(name, self, axis, None, out, keepdims)
    m.__name__ = name
    return m


for _n in ("sum", "mean", "max", "min", "prod", "argmax", "argmin", "any", "all"):
    setattr(ndarray, _n, _method(_n))


# ------------------------------------------------------- module functions
def _creator(npf):
    def f(*a, **kw):
        _launch()
        return _wrap(npf(*a, **kw), fresh=True)
    return f


def empty(shape, dtype=float, order="C"):
    return _wrap(np.empty(shape, dtype, order=order), fresh=True)   # no kernel: nothing to sync


def empty_like(prototype, dtype=None):
    return empty(prototype.shape, prototype.dtype if dtype is None else dtype)


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


def array(obj, dtype=None, copy=True, order="K"):
    if isinstance(obj, ndarray):
        return obj.astype(obj.dtype if dtype is None else dtype) if copy else asarray(obj, dtype)
    return asarray(obj, dtype)


def ascontiguousarray(a, dtype=None):
    x = asarray(a, dtype)
    return x if x._a.flags.c_contiguous else x.copy()


def asnumpy(a, stream=None, order="C", out=None, *, blocking=True):
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
    _launch(dst)
    np.copyto(dst._a, _k(src), casting=casting, where=True if where is None else _k(where))


def take(a, indices, axis=None, out=None):
    if not isinstance(indices, (ndarray, int, np.integer)):
        raise TypeError(f"Unsupported type {type(indices)}")
    x, idx = _k(a), _k(indices)
    _launch(*(() if out is None else (out,)))
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
    _launch(*(() if out is None else (out,)))
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
    _launch(*(() if out is None else (out,)))
    if out is None:
        return _wrap(np.dot(x, y), fresh=True)
    np.dot(x, y, out=o)
    return out


def concatenate(tup, axis=0, out=None, *, dtype=None):
    xs = [_k(t) for t in tup]
    _launch()
    return _wrap(np.concatenate(xs, axis=axis, dtype=dtype), fresh=True)


def where(condition, x=None, y=None):
    _launch()
    if x is None:
        return tuple(_wrap(t, fresh=True) for t in np.where(_k(condition)))
    return _wrap(np.where(_k(condition), _k(x), _k(y)), fresh=True)


def _simple(name):
    npf = getattr(np, name)

    def f(a, *args, **kw):
        x = _k(a)
        args = [_k(t) for t in args]
        out = kw.get("out")
        if out is not None and not isinstance(out, ndarray):
            raise TypeError(f"Unsupported type {type(out)}")
        kw = {k: _k(v) if isinstance(v, (ndarray, np.ndarray)) else v for k, v in kw.items()}
        _launch(*(() if out is None else (out,)))
        r = npf(x, *args, **kw)
        if out is not None:
            return out                      # written in place: no new allocation
        return tuple(_wrap(t, fresh=True) for t in r) if isinstance(r, tuple) else _wrap(r, fresh=True)
    return f


_SIMPLE = ("cumsum", "sort", "argsort", "triu", "tril", "searchsorted", "diff", "nonzero", "flatnonzero",
           "unique", "bincount", "repeat", "clip", "isclose", "allclose", "array_equal", "count_nonzero",
           "flip", "linalg_norm", "sign", "round", "floor", "ceil")
