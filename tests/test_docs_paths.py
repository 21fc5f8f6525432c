"""Every path and module the README and docs/*.md cite exists.

What it checks
    - file paths that start with one of the checkout's folders (``ringzero/...``,
      ``benchmarks/...``, ``launch/...``, ``tests/...``, ``docs/...``), globs
      included (``ringzero/comm/_f16*.so`` must match a file), and a
      ``path.py::name`` suffix names something that file defines;
    - relative Markdown links (``[model](docs/model.md#anchor)``), against the
      file that holds them, and their anchors against the target's headings;
    - dotted names ``ringzero.x.y``: the longest prefix is found as a module
      without importing it (``importlib.machinery.PathFinder`` walks the
      package folders; nothing under ``ringzero`` is executed), and what is left
      (``ringzero.comm.backend.cuda_aware``) must be defined in that module's
      source, read with ``ast``;
    - ``python -m ringzero.z``: z is a module, or a package with ``__main__``.
What it is not
    A check of what the docs say about those files, or of the commands' output
    (that is the smoke group, tests/smoke/).
"""
from __future__ import annotations

import ast
import glob
import os
import re
from importlib.machinery import PathFinder

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
FOLDERS = ("ringzero", "benchmarks", "launch", "tests", "docs")
# a path starts at one of the folders, not inside a longer path (/tmp/prev/ringzero_prev/...)
PATH_RE = re.compile(r"(?<![\w./~$-])((?:" + "|".join(FOLDERS) + r")/[\w.*/-]*)")
NAME_RE = re.compile(r"(?<![\w./\\-])ringzero(?:\.[A-Za-z_]\w*)+")
RUN_RE = re.compile(r"python -m (?:mpi4py -m )?(ringzero(?:\.[A-Za-z_]\w*)+)")
LINK_RE = re.compile(r"\]\(([^)\s]+)\)")


def read(doc):
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        return f.read()


def cited_paths(text):
    """(path, name-after-::) for every path-like token; trailing punctuation dropped."""
    out = []
    for m in PATH_RE.finditer(text):
        path = m.group(1).rstrip(".")
        name = None
        rest = text[m.end():]
        if rest.startswith("::"):
            name = re.match(r"::(\w+)", rest)
            name = name.group(1) if name else None
        if path.endswith("/…") or "…" in path:   # "tests/…::test_x": an elided path, not a citation
            continue
        out.append((path, name))
    return out


def table_files(text):
    """Bare file names in a table row whose first cell is a folder: ``| `ringzero/comm/` | `ring.py` (...) |``.

    Each ``name.py`` / ``csrc/f16.c`` token of the row is read inside that folder."""
    out = []
    for line in text.splitlines():
        m = re.match(r"\|\s*`((?:" + "|".join(FOLDERS) + r")/[\w/]*/)`", line)
        if not m:
            continue
        for name in re.findall(r"`([\w/]+\.(?:py|c|sh))`", line):
            if not name.startswith(FOLDERS):
                out.append(m.group(1) + name)
    return out


def locate(dotted):
    """(module name, its source file or package folder, the rest of the name) without importing.

    The longest prefix of ``dotted`` that is a module or package wins; the
    rest is an attribute path inside it."""
    parts = dotted.split(".")
    spec = PathFinder.find_spec(parts[0], [ROOT])
    if spec is None:
        return None, None, parts
    found = (parts[0], spec, parts[1:])
    for i in range(1, len(parts)):
        locs = spec.submodule_search_locations
        if not locs:
            break
        sub = PathFinder.find_spec(".".join(parts[:i + 1]), list(locs))
        if sub is None:
            break
        spec = sub
        found = (".".join(parts[:i + 1]), spec, parts[i + 1:])
    return found


def defined_names(source_path):
    """Top-level names a module defines (defs, classes, assignments, imports) and each class's members."""
    with open(source_path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    top, members = set(), {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            top.add(node.name)
            if isinstance(node, ast.ClassDef):
                members[node.name] = {n.name for n in node.body
                                      if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
                for n in node.body:
                    if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                        members[node.name].add(n.target.id)
                    elif isinstance(n, ast.Assign):
                        members[node.name].update(t.id for t in n.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                top.update(e.id for e in ast.walk(t) if isinstance(e, ast.Name))
            # names served by a module __getattr__ (ringzero/__init__.py's lazy API table)
            if isinstance(node.value, (ast.Dict, ast.List, ast.Tuple)):
                elts = node.value.keys if isinstance(node.value, ast.Dict) else node.value.elts
                top.update(e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            top.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            top.update((a.asname or a.name).split(".")[0] for a in node.names)
    return top, members


def check_name(dotted):
    """None if ``dotted`` resolves, else why not."""
    mod, spec, rest = locate(dotted)
    if spec is None:
        return f"no module {dotted.split('.')[0]!r}"
    if not rest:
        return None
    src = spec.origin
    if not src or not src.endswith(".py"):
        return f"{mod} has no Python source to look {'.'.join(rest)} up in"
    top, members = defined_names(src)
    if rest[0] not in top:
        return f"{mod} (found at {os.path.relpath(src, ROOT)}) defines no {rest[0]!r}"
    if len(rest) > 1 and rest[0] in members and rest[1] not in members[rest[0]]:
        return f"{mod}.{rest[0]} has no member {rest[1]!r}"
    return None


@pytest.mark.parametrize("doc", DOCS)
def test_cited_paths_exist(doc):
    bad = []
    text = read(doc)
    for path in table_files(text):
        if not os.path.exists(os.path.join(ROOT, path)):
            bad.append(f"{path}: no such file (a table row names it inside its folder)")
    for path, name in cited_paths(text):
        full = os.path.join(ROOT, path)
        hits = glob.glob(full) if "*" in path else ([full] if os.path.exists(full) else [])
        if not hits:
            bad.append(f"{path}: no such file or folder")
        elif name and path.endswith(".py"):
            top, _ = defined_names(hits[0])
            if name not in top:
                bad.append(f"{path}::{name}: {path} defines no {name!r}")
    assert not bad, f"{doc} cites what is not there:\n  " + "\n  ".join(sorted(set(bad)))


def anchors(md_path):
    """The anchors GitHub gives a Markdown file's headings (lower case, punctuation dropped, spaces to -)."""
    with open(md_path, encoding="utf-8") as f:
        text = re.sub(r"```.*?```", "", f.read(), flags=re.DOTALL)  # a "# comment" in a code block is no heading
    seen, out = {}, set()
    for h in re.findall(r"^#{1,6}\s+(.+?)\s*$", text, re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("doc", DOCS)
def test_links_resolve(doc):
    bad = []
    for target in LINK_RE.findall(read(doc)):
        if re.match(r"[a-z]+:", target):                # http:, mailto:
            continue
        path, _, anchor = target.partition("#")
        full = os.path.join(ROOT, os.path.dirname(doc), path) if path else os.path.join(ROOT, doc)
        if not os.path.exists(full):
            bad.append(f"{target}: no such file")
        elif anchor and full.endswith(".md") and anchor not in anchors(full):
            bad.append(f"{target}: no heading with that anchor in {os.path.relpath(full, ROOT)}")
    assert not bad, f"{doc} links to what is not there:\n  " + "\n  ".join(sorted(set(bad)))


@pytest.mark.parametrize("doc", DOCS)
def test_cited_modules_exist(doc):
    text = read(doc)
    bad = {n: why for n in set(NAME_RE.findall(text)) if (why := check_name(n))}
    for mod in set(RUN_RE.findall(text)):
        _, spec, rest = locate(mod)
        if spec is None or rest:
            bad[f"python -m {mod}"] = f"no module {mod}"
        elif spec.submodule_search_locations and not PathFinder.find_spec(
                mod + ".__main__", list(spec.submodule_search_locations)):
            bad[f"python -m {mod}"] = f"{mod} is a package without __main__"
    assert not bad, f"{doc} cites modules or names that are not there:\n  " + "\n  ".join(
        f"{k}: {v}" for k, v in sorted(bad.items()))


def test_the_checks_can_fail():
    """The finders see a stale path, a stale module and a stale attribute (and accept real ones)."""
    assert cited_paths("see `ringzero/kernels.py` and ringzero/comm/ring.py.") == [
        ("ringzero/kernels.py", None), ("ringzero/comm/ring.py", None)]
    assert not os.path.exists(os.path.join(ROOT, "ringzero/kernels.py"))
    assert check_name("ringzero.comm.ring") is None
    assert check_name("ringzero.comm.backend.cuda_support") is None
    assert check_name("ringzero.comm.nosuchmodule") is not None
    assert check_name("ringzero.comm.backend.no_such_function") is not None
    assert NAME_RE.findall("sed 's/ringzero\\.comm/ringzero_prev.comm/'") == []
    assert "benchmark-python--m-ringzerobench" in anchors(os.path.join(ROOT, "docs", "collectives.md"))
    assert table_files("| `ringzero/comm/` | `ring.py` (the Ring), `csrc/f16.c` |") == [
        "ringzero/comm/ring.py", "ringzero/comm/csrc/f16.c"]
