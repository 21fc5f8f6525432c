"""What test_cupy_api.py checks against the real CuPy: the CuPy names ringzero
calls, read from its source, and a signature comparison that works on CuPy's
Cython functions too.

What it is
    - ``project_names()``: every attribute chain rooted at the cupy module in
      ringzero/, benchmarks/ and the Python inside launch/gpu-check (read with
      ``ast``, nothing imported): ``cupy.x.y``, ``cp.x`` where ``cp`` is bound by
      ``import cupy as cp`` or ``cp = cupy_or_none()``, ``rt.X`` after
      ``rt = cupy.cuda.runtime``, names from ``from cupy.cuda import cublas``.
    - ``xp_names()``: the array-module functions ringzero calls as ``xp.NAME``
      (``xp`` is NumPy or CuPy at run time, so each must exist in both).
    - ``signature_of(obj)``: ``inspect.signature``, or for a Cython function the
      signature Cython writes on the docstring's first line
      (``gemmStridedBatchedEx(intptr_t handle, int transa, ...)``), types dropped.
    - ``incompatible(standin, real)``: the ways a call the stand-in accepts would
      fail on CuPy, or a call CuPy needs would fail on the stand-in.

What it is not
    A type checker: it cannot follow ``xp`` through data flow, and it compares
    parameter names, order, kinds and defaults, not types.
"""
from __future__ import annotations

import ast
import importlib
import inspect
import os
import re
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROOTS = ("cupy", "cupyx")
# calls whose result is the cupy module (ringzero.comm.backend)
MODULE_CALLS = {"cupy_or_none", "xp_for", "get_array_module", "array_module"}
P = inspect.Parameter
POSITIONAL = (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)


# ------------------------------------------------------------ the project's names
def _sources():
    """(label, python source) for every file scanned."""
    for top in ("ringzero", "benchmarks"):
        for d, _, files in os.walk(os.path.join(ROOT, top)):
            for f in sorted(files):
                if f.endswith(".py"):
                    p = os.path.join(d, f)
                    with open(p, encoding="utf-8") as fh:
                        yield os.path.relpath(p, ROOT), fh.read()
    p = os.path.join(ROOT, "launch", "gpu-check")
    with open(p, encoding="utf-8") as fh:
        text = fh.read()
    # heredocs (<<'EOF' ... EOF) and "$PY" -c "..." one-liners
    for i, m in enumerate(re.finditer(r"<<'EOF'\n(.*?)\nEOF\n", text, re.S)):
        yield f"launch/gpu-check heredoc {i}", m.group(1)
    for i, m in enumerate(re.finditer(r'-c "([^"]*cupy[^"]*)"', text)):
        yield f"launch/gpu-check -c {i}", m.group(1)


def _parse(src, label):
    with warnings.catch_warnings():     # an invalid escape in someone's docstring is not our finding
        warnings.simplefilter("ignore")
        return ast.parse(src, label)


def _chain(node):
    """['cp', 'cuda', 'runtime'] for the expression cp.cuda.runtime, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id] + parts[::-1]
    return None


def _pairs(n):
    """(target name, value) of ``a = v`` and ``a, b = v, w``."""
    if not (isinstance(n, ast.Assign) and len(n.targets) == 1):
        return []
    t, v = n.targets[0], n.value
    if isinstance(t, ast.Name):
        return [(t.id, v)]
    if isinstance(t, ast.Tuple) and isinstance(v, ast.Tuple) and len(t.elts) == len(v.elts):
        return [(a.id, b) for a, b in zip(t.elts, v.elts) if isinstance(a, ast.Name)]
    return []


def _aliases(tree, seed=None) -> dict:
    """local name -> the dotted cupy path it stands for (flow-insensitive)."""
    al = dict(seed or {})
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                if a.name.split(".")[0] in ROOTS:
                    al[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] in ROOTS:
            for a in n.names:
                al[a.asname or a.name] = f"{n.module}.{a.name}"
    for _ in range(3):          # rt = cupy.cuda.runtime; cp = cupy_or_none(); a chain of such
        for name, v in (pv for n in ast.walk(tree) for pv in _pairs(n)):
            if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "cupy_or_none":
                al[name] = "cupy"
            c = _chain(v)
            if c and len(c) > 1 and c[0] in al and name not in al:
                al[name] = ".".join([al[c[0]]] + c[1:])
    return al


def _uses(tree, al):
    """Dotted cupy paths of the longest attribute chains on an alias, plus aliases from imports."""
    seen, inner = set(), set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and id(n) not in inner:
            c = _chain(n)
            if c and c[0] in al:
                seen.add(".".join([al[c[0]]] + c[1:]))
                v = n.value
                while isinstance(v, ast.Attribute):      # the shorter chains inside this one
                    inner.add(id(v))
                    v = v.value
        # getattr(rt, "CUDA_R_16F", 2), or a helper called that way (nn/ops.py's c(mod, name, default))
        if isinstance(n, ast.Call) and len(n.args) >= 2 and isinstance(n.args[0], ast.Name) \
                and n.args[0].id in al and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str):
            seen.add(f"{al[n.args[0].id]}.{n.args[1].value}")
    return seen | {v for v in al.values() if v not in ROOTS}


def project_names() -> dict:
    """dotted cupy name -> sorted list of files that use it."""
    out = {}
    for label, src in _sources():
        tree = _parse(src, label)
        for name in _uses(tree, _aliases(tree)):
            out.setdefault(name, set()).add(label.split(" ")[0])
    return {k: sorted(v) for k, v in sorted(out.items())}


def xp_names() -> dict:
    """NAME -> files, for every xp.NAME[.more] in ringzero/ (``xp``, ``self.xp``, ``engine.xp``, and
    ``rt = xp.cuda.runtime`` followed by ``rt.X``), as ``cupy.NAME``."""
    out = {}
    for label, src in _sources():
        if not label.startswith("ringzero/"):
            continue
        tree = _parse(src, label)
        for n in ast.walk(tree):        # self.xp.NAME, engine.xp.NAME -> a Name "xp" for _uses
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) and n.value.attr == "xp":
                n.value = ast.Name("xp", ast.Load())
        al = _aliases(tree, {"xp": "cupy"})
        al = {k: v for k, v in al.items() if v == "cupy" and k == "xp" or v.startswith("cupy.")}
        for name in _uses(tree, al):
            out.setdefault(name, set()).add(label)
    return {k: sorted(v) for k, v in sorted(out.items())}


def project_calls() -> list:
    """(dotted cupy name, positional count, keyword names, "file:line") for every call ringzero,
    benchmarks/ and launch/gpu-check make on a cupy name or an ``xp`` one; calls with ``*args`` or
    ``**kw`` are left out (nothing to count)."""
    out = []
    for label, src in _sources():
        tree = _parse(src, label)
        al = _aliases(tree)
        if label.startswith("ringzero/"):
            for n in ast.walk(tree):
                if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) and n.value.attr == "xp":
                    n.value = ast.Name("xp", ast.Load())
            al = {**{k: v for k, v in _aliases(tree, {"xp": "cupy"}).items() if k == "xp" or v.startswith("cupy.")},
                  **al}
        for n in ast.walk(tree):
            if not isinstance(n, ast.Call):
                continue
            c = _chain(n.func)
            if not c or c[0] not in al or len(c) < 2 and al[c[0]] in ROOTS:
                continue
            if any(isinstance(a, ast.Starred) for a in n.args) or any(k.arg is None for k in n.keywords):
                continue
            out.append((".".join([al[c[0]]] + c[1:]), len(n.args), [k.arg for k in n.keywords],
                        f"{label}:{n.lineno}"))
    return out


def refused(sig: inspect.Signature, npos: int, kws) -> str:
    """Why CuPy would refuse a call with npos positional arguments and these keywords ("" if it would not)."""
    try:
        sig.bind(*range(npos), **dict.fromkeys(kws))
        return ""
    except TypeError as e:
        return str(e)


def resolve(dotted: str):
    """The object at a dotted path in the real package (importing submodules as needed); raises."""
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i, p in enumerate(parts[1:], 1):
        try:
            obj = getattr(obj, p)
        except AttributeError:
            if not inspect.ismodule(obj):
                raise AttributeError(f"{'.'.join(parts[:i])} has no attribute {p!r}") from None
            obj = importlib.import_module(".".join(parts[:i + 1]))
    return obj


def missing(names, resolver=resolve) -> dict:
    """name -> why it does not resolve, for each name that does not."""
    bad = {}
    for n in names:
        try:
            resolver(n)
        except Exception as e:          # AttributeError, ImportError (a library it loads is absent), ...
            bad[n] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return bad


# ------------------------------------------------------------------ signatures
def _split(s):
    """Split a parameter list at top-level commas (quotes and brackets respected)."""
    out, depth, q, cur = [], 0, None, ""
    for ch in s:
        if q:
            q = None if ch == q else q
        elif ch in "'\"":
            q = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(cur)
            cur = ""
            continue
        cur += ch
    return [t.strip() for t in out + [cur] if t.strip()]


def _default(text):
    try:
        return ast.literal_eval(text)
    except Exception:
        return _Text(text)


class _Text(str):
    """A default that is not a literal (``float``, ``numpy.float64``): compared as text."""


def doc_signature(obj):
    """The signature Cython (embedsignature) writes on a docstring's first line, or None."""
    doc = (getattr(obj, "__doc__", None) or "").lstrip().split("\n")[0]
    name = getattr(obj, "__name__", "")
    m = re.match(r"^([\w.]+)\((.*)\)\s*(->.*)?$", doc)
    # a ufunc's __name__ is 'cupy_add', its docstring says add(x1, x2, /, ...)
    if not m or m.group(1).split(".")[-1] not in (name, name.removeprefix("cupy_")):
        return None
    params, kind = [], P.POSITIONAL_OR_KEYWORD
    toks = _split(m.group(2).replace("\\*", "*"))
    if "/" in toks:                     # everything before the slash is positional-only
        cut = toks.index("/")
        toks = [t for t in toks if t != "/"]
    else:
        cut = -1
    for i, t in enumerate(toks):
        if t == "*":
            kind = P.KEYWORD_ONLY
            continue
        lhs, _, dflt = t.partition("=")
        pname = lhs.split()[-1].strip()
        if pname.startswith("**"):
            params.append(P(pname[2:], P.VAR_KEYWORD))
            continue
        if pname.startswith("*"):
            params.append(P(pname.lstrip("*"), P.VAR_POSITIONAL))
            kind = P.KEYWORD_ONLY
            continue
        k = P.POSITIONAL_ONLY if i < cut else kind
        params.append(P(pname.lstrip("*&"), k, default=_default(dflt.strip()) if dflt else P.empty))
    if params and params[0].name == "self":
        params = params[1:]
    try:
        return inspect.Signature(params)
    except ValueError:
        return None


def signature_of(obj):
    """inspect.signature, else the docstring's; None where neither tells."""
    try:
        sig = inspect.signature(obj)
        ps = list(sig.parameters.values())
        if inspect.isclass(obj) and ps and all(p.kind in (P.VAR_POSITIONAL, P.VAR_KEYWORD) or p.name.startswith("_")
                                               for p in ps):
            return doc_signature(obj) or sig     # cupy.ndarray: (*args, _obj=None, **kwargs) hides the real one
        return sig
    except (ValueError, TypeError):
        return doc_signature(obj)


def _norm(v):
    if isinstance(v, type):
        return v.__name__
    if isinstance(v, _Text):
        return str(v).split(".")[-1]
    return v


def incompatible(s: inspect.Signature, r: inspect.Signature) -> list:
    """Problems, one line each; [] when every call the stand-in accepts CuPy also
    accepts (names, order, keyword use, defaults) and CuPy's required arguments
    are all accepted by the stand-in. A stand-in narrower than CuPy (it lacks an
    optional parameter) is not a problem: such a call fails in the tests."""
    sp, rp = list(s.parameters.values()), list(r.parameters.values())
    s_pos = [p for p in sp if p.kind in POSITIONAL]
    r_pos = [p for p in rp if p.kind in POSITIONAL]
    s_var = {p.kind for p in sp} & {P.VAR_POSITIONAL, P.VAR_KEYWORD}
    r_var = {p.kind for p in rp} & {P.VAR_POSITIONAL, P.VAR_KEYWORD}
    r_kw = {p.name: p for p in rp if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)}
    out = []
    if len(s_pos) > len(r_pos) and P.VAR_POSITIONAL not in r_var:
        out.append(f"stand-in takes {len(s_pos)} positional arguments, CuPy {len(r_pos)}")
    for i, p in enumerate(s_pos):
        q = r_pos[i] if i < len(r_pos) else None
        if q is not None and q.kind == P.POSITIONAL_ONLY:
            continue
        if q is not None and q.name != p.name:
            out.append(f"argument {i}: stand-in '{p.name}', CuPy '{q.name}'")
    for p in sp:
        if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY) and p.name not in r_kw \
                and P.VAR_KEYWORD not in r_var and (p.kind == P.KEYWORD_ONLY or p.default is not P.empty):
            out.append(f"stand-in accepts {p.name}=, CuPy does not")
    if P.VAR_KEYWORD in s_var and P.VAR_KEYWORD not in r_var:
        out.append("stand-in accepts any keyword (**kw), CuPy only its own")
    s_names = {p.name for p in sp}
    for i, q in enumerate(rp):
        if q.default is not P.empty or q.kind in (P.VAR_POSITIONAL, P.VAR_KEYWORD):
            continue
        by_pos = q.kind in POSITIONAL and (i < len(s_pos) or P.VAR_POSITIONAL in s_var)
        by_name = q.name in s_names or P.VAR_KEYWORD in s_var
        if not (by_pos or by_name):
            out.append(f"CuPy requires '{q.name}', the stand-in does not take it")
    for p in sp:
        q = r_kw.get(p.name)
        if p.default is not P.empty and q is not None and q.default is not P.empty \
                and _norm(p.default) != _norm(q.default):
            out.append(f"default of {p.name}: stand-in {_norm(p.default)!r}, CuPy {_norm(q.default)!r}")
    return out


def bare(sig: inspect.Signature, method: bool) -> inspect.Signature:
    """sig without a method's leading ``self`` and without private ``_x`` parameters
    (the stand-in binds loop variables that way: ``_n=_n``)."""
    ps = list(sig.parameters.values())
    if method and ps and ps[0].name == "self":
        ps = ps[1:]
    return sig.replace(parameters=[p for p in ps if not p.name.startswith("_")])


def generic(sig: inspect.Signature) -> bool:
    """A stand-in wrapper that forwards anything (``f(*a, **kw)``): nothing to compare but the name."""
    kinds = {p.kind for p in sig.parameters.values()}
    return P.VAR_POSITIONAL in kinds and P.VAR_KEYWORD in kinds and len(kinds) <= 3
