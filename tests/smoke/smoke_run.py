"""How a smoke test runs a command, and how it decides that the command worked.

What it is
    ``run(argv, ranks)``: one command as a subprocess (under the venv's
    mpirun, with the flags launch/_env.sh's ``mpi_flags`` gives, when
    ``ranks`` is set), inside a timeout, one BLAS thread per process, from
    the checkout; it returns (exit code, output). ``check`` fails the test,
    in a few lines with the command's last output, unless it exited 0 and
    printed a line of its table. The smoke tests run in launch/test's serial
    group (``./launch/test -k smoke`` runs them alone). The session fixtures
    make, once, what documented commands read: a tiny checkpoint and its
    metrics file (a 2-rank ``ringzero.train`` run), bench JSON files at n = 2
    and 4, a small text file, a GPT-2 folder with its tokenizer, encoded data
    and a fine-tuned checkpoint (docs/gpt2.md), and an older comm package for
    the before/after scripts. (They live here, not in a conftest.py, which would shadow
    tests/conftest.py for the tests that import from it.)
What it is not
    A check of any figure: a smoke test asks that a command exits 0 and prints
    its table, at sizes small enough for CI.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable
TIMEOUT = int(os.environ.get("RINGZERO_SMOKE_TIMEOUT", "240"))   # seconds per command
THREADS = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1", "RINGZERO_TIMEOUT": os.environ.get("RINGZERO_TIMEOUT", "60")}


def mpirun_argv(ranks: int) -> list:
    """The venv's mpirun with the flags launch/_env.sh's mpi_flags gives (Open MPI: oversubscribe, no binding)."""
    mpirun = os.path.join(os.path.dirname(PY), "mpirun")
    if not os.path.exists(mpirun):
        mpirun = shutil.which("mpirun") or "mpirun"
    flags = []
    out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, check=False).stdout.lower()
    if "open mpi" in out:
        flags = ["--oversubscribe", "--bind-to", "none"] + (["--allow-run-as-root"] if os.getuid() == 0 else [])
        for v in THREADS:
            flags += ["-x", v]
    flags += os.environ.get("MPIRUN_ARGS", "").split()
    return [mpirun, *flags, "-n", str(ranks)]


def run(argv, ranks=None, timeout=TIMEOUT, cwd=ROOT, env=None):
    """(exit code, stdout+stderr) of one command, with ``env`` added to the environment; 124 when it ran
    past ``timeout``."""
    if ranks:
        argv = mpirun_argv(ranks) + list(argv)
    env = dict(os.environ, **THREADS, **(env or {}))
    env["PATH"] = os.path.dirname(PY) + os.pathsep + env.get("PATH", "")
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                         cwd=cwd, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
        return p.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        out, _ = p.communicate()
        return 124, (out or "") + f"\n!! timed out after {timeout} s"


def check(rc, out, table, what):
    """The command exited 0 and printed the line ``table`` (a regex) of its table; else fail with its tail."""
    tail = "\n".join(out.strip().splitlines()[-40:])
    if rc != 0:
        pytest.fail(f"{what}: exit code {rc}; its output ends:\n{tail}", pytrace=False)
    if not re.search(table, out, re.MULTILINE):
        pytest.fail(f"{what}: exit 0 but no line matching {table!r}; its output ends:\n{tail}", pytrace=False)


# the GPT every tiny run trains: 1 layer, 2 heads, width 32, T = 16, batch 2 per rank
TINY_GPT = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--seq-len", "16", "--batch", "2"]


# ---- the files documented commands read ---------------------------------------------

@pytest.fixture(scope="session")
def smoke_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("smoke")


@pytest.fixture(scope="session")
def trained(smoke_dir):
    """A 2-rank tiny run: its save directory (one checkpoint, step 2) and its metrics file."""
    ck, metrics = smoke_dir / "ck", smoke_dir / "run.jsonl"
    rc, out = run([PY, "-m", "mpi4py", "-m", "ringzero.train", *TINY_GPT, "--steps", "2", "--eval-interval", "0",
                   "--sample-chars", "0", "--quiet", "--precision", "fp32", "--save-every", "2",
                   "--save-dir", str(ck), "--metrics", str(metrics)], ranks=2)
    check(rc, out, r"model state per rank", "the fixture run (ringzero.train, 2 ranks, --save-every 2)")
    steps = sorted(p for p in ck.iterdir() if p.name.startswith("step-"))
    assert steps, f"the fixture run saved no checkpoint in {ck}"
    return {"save_dir": str(ck), "step_dir": str(steps[-1]), "metrics": str(metrics)}


@pytest.fixture(scope="session")
def traced(smoke_dir):
    """A 2-rank tiny run with --trace: its trace folder (steps 0-2 recorded), as ringzero.trace and plot read it."""
    d = smoke_dir / "trace"
    rc, out = run([PY, "-m", "mpi4py", "-m", "ringzero.train", *TINY_GPT, "--steps", "3", "--eval-interval", "0",
                   "--sample-chars", "0", "--quiet", "--trace", str(d)], ranks=2)
    check(rc, out, r"model state per rank", "the fixture run (ringzero.train, 2 ranks, --trace)")
    return str(d)


@pytest.fixture(scope="session")
def bench_files(smoke_dir):
    """``ringzero.bench --json`` files at n = 2 and 4 (float32, 1 KiB to 64 KiB), as fit and plot read them."""
    files = []
    for n in (2, 4):
        f = smoke_dir / f"bench-n{n}.json"
        rc, out = run([PY, "-m", "mpi4py", "-m", "ringzero.bench", "-b", "1K", "-e", "64K", "-f", "2", "-n", "3",
                       "-w", "1", "-c", "1", "--json", str(f)], ranks=n)
        check(rc, out, r"all_reduce", f"the fixture bench at n={n}")
        files.append(str(f))
    return files


@pytest.fixture(scope="session")
def text_file(smoke_dir):
    f = smoke_dir / "corpus.txt"
    with open(os.path.join(ROOT, "ringzero", "app", "train.py"), encoding="utf-8") as src:
        f.write_text(src.read() * 4)
    return str(f)


@pytest.fixture(scope="session")
def gpt2_files(smoke_dir, text_file):
    """What docs/gpt2.md's recipe reads: a GPT-2 folder (random weights in GPT-2's file layout,
    vocab 300), a byte-level BPE tokenizer.json of 300 ids trained on the text file, the text
    encoded with it, and the recipe's fine-tuned checkpoint (2 ranks, 2 steps, --init-from)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from hf_files import small_bpe, write_gpt2
    d = smoke_dir / "gpt2"
    write_gpt2(d)
    with open(text_file, encoding="utf-8") as fh:
        tok = small_bpe(d, fh.read(), 300)
    data = smoke_dir / "train.bin"
    rc, out = run([PY, "-m", "ringzero.data", "encode", "--tokenizer", tok, text_file, str(data)])
    check(rc, out, r"tokens", "the fixture encode (ringzero.data encode)")
    ft = smoke_dir / "ft"
    rc, out = run([PY, "-m", "mpi4py", "-m", "ringzero.train", "--init-from", str(d), "--data", str(data),
                   "--seq-len", "16", "--batch", "2", "--steps", "2", "--eval-interval", "0", "--sample-chars", "0",
                   "--quiet", "--precision", "fp32", "--save-every", "2", "--save-dir", str(ft)], ranks=2)
    check(rc, out, r"initialized from", "the fixture fine-tuning run (ringzero.train --init-from, 2 ranks)")
    return {"dir": str(d), "tokenizer": tok, "data": str(data), "finetuned": str(ft)}


@pytest.fixture(scope="session")
def prev_comm(smoke_dir):
    """A folder holding ``ringzero_prev/comm``: this tree's comm package under another name.

    The before/after scripts load an older Ring from such a folder (their
    docstrings make it with ``git archive``); the smoke test needs the script
    to run, not an old commit, so it renames the current one the same way."""
    prev = smoke_dir / "prev"
    pkg = prev / "ringzero_prev"
    shutil.copytree(os.path.join(ROOT, "ringzero", "comm"), pkg / "comm",
                    ignore=shutil.ignore_patterns("__pycache__", "csrc"))
    (pkg / "__init__.py").write_text("")
    for f in (pkg / "comm").glob("*.py"):
        f.write_text(f.read_text().replace("ringzero.comm", "ringzero_prev.comm"))
    return str(prev)
