"""Helpers for the Slurm cluster tests: ``./launch/cluster up --slurm`` and jobs on it.

The Slurm tests share one cluster, ``rzs`` at 198.18.2.0/24 (2 nodes x 2
CPUs, unshaped links), brought up once per module by the ``slurm`` fixture
and removed after it. ``sbatch`` jobs run ``launch/slurm.sbatch`` as users
run it, from a test's temporary folder, with the venv that runs the tests
(RINGZERO_VENV) and SLURM_CONF naming this cluster's slurm.conf. Where Slurm
is not installed (and RINGZERO_SLURM_INSTALL=1, which launch/test-cluster
sets in CI, does not ask for it), the fixture skips with launch/cluster's
one line; under CI=true (Slurm could not be installed) it fails with it
(cluster_cli.skip_or_fail). The install may take 900 s: the modules that use
the fixture carry a timeout marker of their own (TIMEOUT). Not a test module.
"""
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass

import cluster_cli as cc
import pytest

PREFIX, NET, PPN = "rzs", 2, 2
INSTALL_S = 900                         # launch/cluster up --slurm --install, at most
TIMEOUT = INSTALL_S + 300               # pytest-timeout of a test whose fixture may install (s)
SCRIPT = os.path.join(cc.ROOT, "launch", "slurm.sbatch")
STATE = os.environ.get("RINGZERO_CLUSTER_STATE", "/run/ringzero-cluster")
VENV = sys.prefix                       # the venv that runs the tests
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL")


def node(i: int) -> str:
    return f"{PREFIX}-n{i}"


def _cli(*args, timeout=180):
    return subprocess.run([cc.CLUSTER, *args, "--prefix", PREFIX], capture_output=True, text=True, timeout=timeout,
                          env=cc.env())


@dataclass
class Slurm:
    conf: str

    def env(self, threads=True, **extra):
        e = {k: v for k, v in cc.env(threads, **extra).items() if not k.startswith("SLURM_")}
        e.update(SLURM_CONF=self.conf, RINGZERO_VENV=VENV)
        return e

    def cmd(self, *args, env=None, timeout=60, check=True):
        p = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, env=env or self.env())
        if check and p.returncode != 0:
            raise AssertionError(f"{' '.join(args)}: exit {p.returncode}\n{p.stdout}\n{p.stderr}")
        return p

    def sbatch(self, cwd, args, flags=(), env=None, wait=True, timeout=240):
        """Submit launch/slurm.sbatch ARGS; (job id, exit code or None, CompletedProcess). Its output: slurm-ID.out."""
        cmd = ["sbatch", "--parsable", f"--output={cwd}/slurm-%j.out", *flags, *(["--wait"] if wait else []),
               SCRIPT, *args]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or self.env(), cwd=cwd)
        m = re.match(r"^(\d+)", p.stdout)
        assert m, f"sbatch printed no job id: exit {p.returncode}\n{p.stdout}\n{p.stderr}"
        return int(m.group(1)), (p.returncode if wait else None), p

    def job(self, jid) -> dict:
        """``scontrol show job`` as a dict (JobState, ExitCode, NodeList, ...)."""
        out = self.cmd("scontrol", "show", "job", "-o", str(jid)).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def wait_state(self, jid, timeout) -> dict:
        end = time.monotonic() + timeout
        while True:
            j = self.job(jid)
            if j.get("JobState") in TERMINAL or time.monotonic() > end:
                return j
            time.sleep(0.5)

    def out(self, cwd, jid) -> str:
        p = os.path.join(cwd, f"slurm-{jid}.out")
        return open(p).read() if os.path.exists(p) else f"(no {p})"


@pytest.fixture(scope="module")
def slurm():
    cc.skip_unless_possible()
    _cli("down")                        # a cluster a killed run left behind
    args = ["up", "--slurm", "--nodes", "2", "--ranks-per-node", str(PPN), "--link", "none", "--net", str(NET)]
    if os.environ.get("RINGZERO_SLURM_INSTALL") == "1":
        args.append("--install")
    p = _cli(*args, timeout=INSTALL_S)
    if p.returncode != 0:
        line = (p.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
        if "needs Slurm and munge" in line or "could not install Slurm" in line or "--install needs" in line:
            cc.skip_or_fail(line)
        pytest.fail(f"launch/cluster up --slurm: exit {p.returncode}\n{p.stdout}\n{p.stderr}")
    try:
        yield Slurm(os.path.join(STATE, PREFIX, "slurm", "slurm.conf"))
    finally:
        _cli("down")
