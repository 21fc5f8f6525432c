"""Helpers for the cluster tests: ``./launch/cluster`` run as users run it.

The tests' nodes are named ``rzt-n1``, ``rzt-n2``, ... at 198.18.1.0/24 (not
the default ``rz`` at 198.18.0.0/24, so a cluster a person keeps up is left
alone). Each job's environment carries ``RINGZERO_TEST_TAG`` (forwarded to the
ranks like every RINGZERO_ variable), so a test can look for a process of its
job left anywhere on the machine. Not a test module.
"""
import os
import subprocess
import sys
import time
import uuid

import pytest

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)
sys.path.insert(0, TESTS)

import trainer_cli  # noqa: E402  (tests/ on the path first)

PREFIX, NET = "rzt", 1
CLUSTER = os.path.join(ROOT, "launch", "cluster")
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def node(i: int) -> str:
    return f"{PREFIX}-n{i}"


def skip_or_fail(line: str):
    """Skip with ``line``; under CI=true, where the cluster group must run whole, fail with it."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{line} (CI=true: the cluster group must not drop out)", pytrace=False)
    pytest.skip(line)


def skip_unless_possible():
    if os.geteuid() != 0:
        skip_or_fail("needs root (network namespaces)")
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        skip_or_fail("network namespaces are unavailable")


def env(threads=True, **extra):
    """The job's environment: no MPI variables of an outer job, a fresh tag,
    one BLAS thread per rank unless ``threads=False`` (then none set at all)."""
    e = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "PMI_"))}
    for v in THREAD_VARS:
        e.pop(v, None)
        if threads:
            e[v] = "1"
    e["RINGZERO_TEST_TAG"] = uuid.uuid4().hex
    e.update(extra)
    return e


def command(nodes, ppn, cmd, logs, link="none"):
    return [CLUSTER, "--nodes", str(nodes), "--ranks-per-node", str(ppn), "--link", link,
            "--prefix", PREFIX, "--net", str(NET), "--logs", str(logs), "--", *cmd]


def run(nodes, ppn, cmd, logs, link="none", env_=None, timeout=300, cwd=None):
    """Run to the end: the CompletedProcess (text)."""
    return subprocess.run(command(nodes, ppn, cmd, logs, link), env=env_ or env(), cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def start(nodes, ppn, cmd, logs, link="none", env_=None, cwd=None, stdout=None, stderr=None):
    return subprocess.Popen(command(nodes, ppn, cmd, logs, link), env=env_ or env(), cwd=cwd,
                            stdout=stdout or subprocess.PIPE, stderr=stderr or subprocess.PIPE, text=True)


def tagged(tag: str) -> list:
    """pids of every live process on the machine whose environment holds RINGZERO_TEST_TAG=tag."""
    want = f"RINGZERO_TEST_TAG={tag}".encode()
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                if want in f.read().split(b"\0"):
                    with open(f"/proc/{d}/stat") as s:
                        if s.read().rsplit(")", 1)[1].split()[0] != "Z":
                            out.append(int(d))
        except OSError:
            continue
    return out


def one_host(args, n, cwd, env_=None, timeout=300):
    """The trainer on this host (no nodes): ``mpirun -n N python -m mpi4py -m ringzero.train ARGS``."""
    cmd = ["timeout", str(timeout)] + trainer_cli._mpirun() + ["-n", str(n), sys.executable, "-m", "mpi4py",
                                                             "-m", "ringzero.train", *args]
    for _ in range(2):
        p = subprocess.run(cmd, cwd=cwd, env=env_ or env(), capture_output=True, text=True, timeout=timeout + 10)
        # Open MPI's launcher can fail to start its PMIx listener (seen once in CI, right after a
        # cluster's links were removed) before any rank runs: that start is tried once more
        if p.returncode == 0 or LAUNCHER_FLAKE not in p.stderr:
            return p
    return p


LAUNCHER_FLAKE = "PMIx server's listener thread failed to start"


def wait_for(pred, timeout, proc=None, step=0.2):
    t = time.monotonic() + timeout
    while time.monotonic() < t:
        if pred():
            return True
        if proc is not None and proc.poll() is not None:
            return pred()
        time.sleep(step)
    return False


def tail(p, n=3000):
    return f"--- exit {p.returncode}\n--- stdout\n{p.stdout[-n:]}\n--- stderr\n{p.stderr[-n:]}"
