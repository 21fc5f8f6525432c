"""The optional C extensions are built wherever they can be: CI fails, with one line naming the
extension, when this machine has a C compiler and Python's headers but an extension of setup.py
is missing or does not import.

setup.py marks the extensions ``optional=True`` (an install without a compiler still
succeeds, and the code falls back to NumPy), so a compile error in adam.c would otherwise turn the
fused-path tests into skips and leave CI green. The names come from setup.py itself (ast), so an
extension added there is checked here too. Where no compiler or no Python.h is found, the test
skips and says which is missing: that is the machine the fallback is for.
"""
import ast
import importlib
import os
import shutil
import sysconfig

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def extension_names() -> list:
    """The first argument of every ``Extension(...)`` call in setup.py."""
    with open(os.path.join(ROOT, "setup.py")) as f:
        tree = ast.parse(f.read())
    return [n.args[0].value for n in ast.walk(tree)
            if isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", "")) == "Extension"
            and n.args and isinstance(n.args[0], ast.Constant)]


def build_tools() -> tuple:
    """(the C compiler's path or None, Python.h's path or None): what setup.py's build_ext needs."""
    cc = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()
    compiler = shutil.which(cc[0]) if cc else None
    header = os.path.join(sysconfig.get_paths()["include"], "Python.h")
    return compiler, header if os.path.exists(header) else None


def test_setup_py_names_the_four_extensions():
    assert extension_names() == ["ringzero.comm._f16", "ringzero.comm._quant", "ringzero.nn._fused",
                                 "ringzero.runtime._adam"]


@pytest.mark.parametrize("name", extension_names())
def test_buildable_extension_was_built(name):
    compiler, header = build_tools()
    if compiler is None or header is None:
        pytest.skip(f"{name}: cannot be built here: "
                    + ("no C compiler" if compiler is None else f"no Python.h in {sysconfig.get_paths()['include']}"))
    try:
        importlib.import_module(name)
    except ImportError as e:
        pytest.fail(f"{name} is not built or does not import ({e}), although this machine can build it "
                    f"(compiler {compiler}, {header}); HINT: python setup.py build_ext --inplace, and read "
                    "its compile errors", pytrace=False)
