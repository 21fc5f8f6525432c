"""No import cycles among ringzero's modules, counting imports inside functions too (serial, no imports run).

The graph is read from the source with ``ast``: every ``import`` and ``from ... import``
anywhere in a module (top level, functions, methods, ``try`` blocks) is an edge from that
module to the ringzero module it names. ``from P import X`` names P.X when X is a
submodule of P (a .py file or a package), and P itself when X is a name P's
``__init__`` binds; otherwise X is a compiled extension (``ringzero.nn._fused``), which
imports nothing of ringzero. Being inside a package is not an edge: Python runs the
package's ``__init__`` first, but a cycle through it shows up as the explicit imports
that close it. A cycle found is printed with the import that makes each edge.
"""
import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ringzero")


def _modules(root):
    """{dotted name: path} of every .py file under root (packages by their __init__)."""
    top = os.path.dirname(root)
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                parts = os.path.relpath(path, top)[:-3].split(os.sep)
                out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _bound(tree) -> set:
    """Top-level names a module binds (what ``from pkg import name`` can read off its __init__)."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def import_graph(root=ROOT) -> dict:
    """{module: {imported module: first line importing it}} over the package at root."""
    mods = _modules(root)
    trees = {m: ast.parse(open(p, encoding="utf-8").read(), p) for m, p in mods.items()}
    bound = {m: _bound(t) for m, t in trees.items()}

    def known(name):   # the longest prefix of a dotted name that is one of our modules
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for m, tree in trees.items():
        pkg = m if mods[m].endswith("__init__.py") else m.rpartition(".")[0]
        edges = {}
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [known(a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                for a in node.names:
                    if base + "." + a.name in mods:
                        targets.append(base + "." + a.name)
                    elif base in mods and mods[base].endswith("__init__.py") and a.name not in bound[base] | {"*"}:
                        continue   # a submodule that is no .py file: a compiled extension
                    else:
                        targets.append(known(base))
            for t in targets:
                if t and t != m:
                    edges.setdefault(t, node.lineno)
        graph[m] = edges
    return graph


def cycles(graph) -> list:
    """The strongly connected components of more than one module (Tarjan, iterative), sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in graph:
                    continue
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return sorted(out)


def _describe(graph, comp) -> str:
    return "; ".join(f"{a} -> {b} (line {graph[a][b]})" for a in comp for b in sorted(graph[a]) if b in comp)


def test_no_import_cycles():
    graph = import_graph()
    assert "ringzero.comm.schedule" in graph and "ringzero.tools.bench" in graph, sorted(graph)[:5]
    found = cycles(graph)
    assert not found, "import cycles: " + " | ".join(_describe(graph, c) for c in found)


def test_the_check_sees_a_cycle_through_a_function(tmp_path):
    """A two-module cycle closed by an import inside a function, and one through a package __init__."""
    pkg = tmp_path / "ringzero"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("import ringzero.b\n")
    (pkg / "b.py").write_text("def f():\n    from ringzero.a import x\n    return x\n")
    (pkg / "sub" / "__init__.py").write_text("from ringzero.sub.c import C\n")
    (pkg / "sub" / "c.py").write_text("class C:\n    def m(self):\n        from ringzero.sub import C\n")
    (pkg / "sub" / "d.py").write_text("from ringzero.sub import _ext\n")   # an extension: no edge
    (pkg / "e.py").write_text("from . import a\n")                       # relative: e -> a, no cycle
    graph = import_graph(str(pkg))
    assert graph["ringzero.b"] == {"ringzero.a": 2} and graph["ringzero.sub.d"] == {}
    assert graph["ringzero.e"] == {"ringzero.a": 1}
    assert cycles(graph) == [["ringzero.a", "ringzero.b"], ["ringzero.sub", "ringzero.sub.c"]]


# the layers, lowest first: a module may import its own layer and those below it
LAYERS = ("comm", "runtime", "nn", "interop", "tools", "app")
# the one upward edge allowed: under ``if TYPE_CHECKING`` (never run), the runtime names the contract it needs
ALLOWED = {("ringzero.runtime.engine", "ringzero.nn.contract")}


def _layer(module):
    part = module.split(".")[1] if module.count(".") >= 1 else ""
    return LAYERS.index(part) if part in LAYERS else None


def upward_imports(graph) -> list:
    """[(module, imported, line)] for every import of a higher layer from a lower one."""
    out = []
    for m, edges in graph.items():
        lm = _layer(m)
        for t, line in edges.items():
            lt = _layer(t)
            if lm is not None and lt is not None and lt > lm and (m, t) not in ALLOWED:
                out.append((m, t, line))
    return sorted(out)


def test_no_module_under_tools_imports_app():
    """The layers hold: tools (and every layer under it) import no app module, nn no interop, and so on."""
    graph = import_graph()
    assert "ringzero.tools.sample" in graph and "ringzero.interop.hf_import" in graph, sorted(graph)[:5]
    bad = upward_imports(graph)
    assert not bad, "imports against the layers' order: " + "; ".join(f"{m} -> {t} (line {n})" for m, t, n in bad)


def test_the_layer_check_sees_tools_importing_app(tmp_path):
    pkg = tmp_path / "ringzero"
    for d in ("tools", "app", "nn"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "app" / "x.py").write_text("from ringzero.tools import y\n")          # down: fine
    (pkg / "tools" / "y.py").write_text("def f():\n    from ringzero.app.x import z\n")   # up: caught
    (pkg / "nn" / "w.py").write_text("import ringzero.tools.y\n")                 # up: caught
    assert upward_imports(import_graph(str(pkg))) == [("ringzero.nn.w", "ringzero.tools.y", 1),
                                                      ("ringzero.tools.y", "ringzero.app.x", 2)]
