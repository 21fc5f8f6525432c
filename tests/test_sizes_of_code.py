"""The house sizes of ringzero's code: a module about 400 lines, a class about 250, a function about 100.

What it checks
    Every ``.py`` file under ``ringzero/``, read with ``ast`` (nothing is
    imported): the module's lines, and the lines of every class and every
    function or method in it (nested ones too), from its ``def``/``class``
    line (its decorators included) to its last line, docstring and comments
    included. "About" is a 5 % allowance over the limit; past it the test
    names every piece over, largest first, with its file and line.

    Run as a script it prints the same list, then the largest of each kind:

        python tests/test_sizes_of_code.py          # exit 1 if anything is over

What it is not
    A measure of complexity, or of tests/ and benchmarks/ (not checked).
"""
from __future__ import annotations

import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "ringzero")
LIMITS = {"module": 400, "class": 250, "function": 100}   # lines
ALLOWANCE = 1.05                                          # "about": 5 % over still passes


def sizes(root=PACKAGE) -> list:
    """[(kind, lines, "path:line name")] of every module, class and function under root."""
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            path = os.path.join(d, f)
            rel = os.path.relpath(path, ROOT)
            with open(path, encoding="utf-8") as fh:
                src = fh.read()
            out.append(("module", len(src.splitlines()), rel))
            for node in ast.walk(ast.parse(src, path)):
                if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    first = min([node.lineno] + [x.lineno for x in node.decorator_list])
                    kind = "class" if isinstance(node, ast.ClassDef) else "function"
                    out.append((kind, node.end_lineno - first + 1, f"{rel}:{first} {node.name}"))
    return out


def over(items) -> list:
    """The items past their kind's limit with the allowance, largest first (by lines over the limit)."""
    bad = [it for it in items if it[1] > LIMITS[it[0]] * ALLOWANCE]
    return sorted(bad, key=lambda it: it[1] / LIMITS[it[0]], reverse=True)


def test_every_module_class_and_function_is_within_the_house_sizes():
    items = sizes()
    assert len([it for it in items if it[0] == "module"]) > 10, f"no modules found under {PACKAGE}"
    bad = over(items)
    assert not bad, ("over the house sizes (module 400, class 250, function 100 lines, +5 %): "
                     + "; ".join(f"{k} {where}: {n} lines" for k, n, where in bad)
                     + "; HINT: split it where a reader would look for each part "
                       "(python tests/test_sizes_of_code.py lists the largest)")


def test_the_check_counts_what_it_says():
    """The counter against a source whose sizes are known by construction."""
    import tempfile
    body = "\n".join(["x = 0"] * 7)                           # 7 lines, then a class of 1 + 1 + 102 lines
    fn = "    def f(self):\n" + "\n".join(["        y = 1"] * 101)
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "m.py"), "w", encoding="utf-8") as fh:
            fh.write(body + "\n@dataclass\nclass C:\n" + fn + "\n")
        got = {(k, n) for k, n, _ in sizes(tmp)}
    assert got == {("module", 7 + 2 + 102), ("class", 104), ("function", 102)}, got
    assert [k for k, _, _ in over([("function", 106, "f"), ("function", 105, "g"), ("class", 263, "C")])] \
        == ["function", "class"]


def main() -> int:
    items = sizes()
    bad = over(items)
    for k, n, where in bad:
        print(f"OVER  {k:<8} {n:5d} lines (limit {LIMITS[k]})  {where}")
    for kind in LIMITS:
        top = sorted((it for it in items if it[0] == kind), key=lambda it: -it[1])[:5]
        print(f"largest ({kind}): " + ", ".join(f"{where} {n}" for _, n, where in top))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
