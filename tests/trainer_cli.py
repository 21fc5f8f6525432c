"""The trainer as users start it: ``mpirun -n N python -m mpi4py -m ringzero.train``.

Helpers for the serial tests that drive real mpirun jobs (test_signals.py,
test_save_failure.py, test_late_errors.py): start a job in the background or
run it to the end, read every rank's own exit code (each rank runs under a
tiny ``sh -c`` that prints it), and find the rank processes to signal them.
Not a test module.
"""
import json
import os
import subprocess
import sys

import numpy as np
from test_checkpoint import _clean_env, _mpirun

# a 1-layer GPT on bytes, constant lr after 2 warm-up steps: --steps only
# sets how long a run is, never its schedule, so runs of any length compare
TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--seq-len", "32", "--batch", "4",
        "--eval-batches", "2", "--sample-chars", "0", "--quiet", "--eval-interval", "0",
        "--min-lr-frac", "1", "--warmup", "2"]
RC_TAG = "ringzero-test rank"
WRAP = f'"$0" -m mpi4py -m ringzero.train "$@"; echo "{RC_TAG} $OMPI_COMM_WORLD_RANK rc $?"'


def corpus(path, n=60_000):
    rng = np.random.default_rng(0)
    words = ["def ", "return ", "self.", "value", "(x)", ":\n", "    ", "import ", "numpy", " = "]
    with open(path, "w") as f:
        f.write("".join(words[i] for i in rng.integers(0, len(words), n // 5)))
    return str(path)


def command(args, n=2, wrap=True):
    """mpirun (inside `timeout`) -> sh -> python; each sh prints its rank's exit
    code. ``wrap=False``: no sh (a signal sent to mpirun is forwarded to its
    children, and would end an sh before its python)."""
    ranks = ["sh", "-c", WRAP, sys.executable] if wrap else [sys.executable, "-m", "mpi4py", "-m", "ringzero.train"]
    return ["timeout", "300"] + _mpirun() + ["-n", str(n)] + ranks + list(args)


def start(args, cwd, n=2, env=None, wrap=True):
    e = _clean_env()
    e.update(env or {})
    return subprocess.Popen(command(args, n, wrap), cwd=cwd, env=e, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(p, timeout=300):
    """(every rank's exit code {rank: rc}, stdout, stderr) of a started job."""
    out, err = p.communicate(timeout=timeout)
    rcs = {}
    for line in out.splitlines():
        if line.startswith(RC_TAG):
            _, _, r, _, rc = line.split()
            rcs[int(r)] = int(rc)
    return rcs, out, err


def run(args, cwd, n=2, env=None, timeout=300):
    return finish(start(args, cwd, n, env), timeout)


def descendants(root: int) -> list:
    """Every process under process ``root`` (any depth), from /proc."""
    kids = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        for pid in kids.get(todo.pop(), []):
            out.append(pid)
            todo.append(pid)
    return out


def rank_pids(root: int) -> list:
    """The python rank processes under process ``root`` (any depth), from /proc."""
    out = []
    for pid in descendants(root):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if b"ringzero.train" in cmd and b"sh\x00-c" not in cmd:
            out.append(pid)
    return out


def losses(path):
    """{step: loss} of a metrics file's step records."""
    out = {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if "step" in r and not r.get("summary"):
                out[r["step"]] = r["loss"]
    return out


def tail(out, err, n=3000):
    return f"--- stdout\n{out[-n:]}\n--- stderr\n{err[-n:]}"
