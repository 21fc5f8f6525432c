"""ringzero under a real Slurm (22.05, Debian's packages) on the emulated nodes.

One cluster for the module (slurm_cli.slurm: ``launch/cluster up --slurm``,
2 nodes of 2 CPUs, munged, slurmctld, a slurmd in each node). Each test
submits ``launch/slurm.sbatch`` as a user would, or runs ``srun`` itself:

- ranks and threads: ``srun --mpi=pmix`` at 2 tasks x 1 CPU and 1 task x
  2 CPUs per node; each rank's hostname is its Slurm node, MPI's
  shared-memory split holds the node's tasks, and its BLAS threads (as
  threadpoolctl reads them back) are --cpus-per-task, the CPUs task/affinity
  bound it to;
- ``--stage hybrid`` through the script, with srun and with mpirun inside the
  allocation: the losses bit for bit and the traffic per step of the one-host
  run with ``--ranks-per-node 2``;
- the time limit: ``--time=2 --signal=TERM@30`` (stage hybrid); every rank saves and exits
  143, the job is FAILED 143:0, and the job resubmitted after it
  (``--dependency=afterany``) with ``--resume latest`` follows the one-host
  run that never stopped bit for bit;
- ``scancel``: no process of the job anywhere within 30 s, only the slurmds
  left in the nodes, the job CANCELLED;
- a node's link cut for good mid-job: rank 0 names rank 1 in the job's
  output, the job ends, and Slurm records it as failed (last: the node is
  brought back for nothing after it).
"""
import json
import os
import re
import subprocess
import sys
import time

import cluster_cli as cc
import pytest
import slurm_cli as sc
from slurm_cli import slurm  # noqa: F401 (the fixture)
from trainer_cli import TINY, corpus, losses

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(sc.TIMEOUT)]   # the fixture's install: not the 300 s

TRAFFIC = re.compile(r"^traffic per step per rank\s+measured ([\d,]+) B", re.M)
NODE_INFO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "node_info.py")
STALL = r"rank 0: \w+ has made no progress for ([\d.]+) s at step \d+, waiting for (?:a message from|a send to be " \
        r"taken by) rank 1"


def _base(tmp_path, stage):
    return TINY + ["--data", corpus(tmp_path / "corpus.txt"), "--stage", stage, "--precision", "fp32"]


@pytest.mark.parametrize("per_node,cpt", [(2, 1), (1, 2)])
def test_ranks_per_node_and_threads_from_cpus_per_task(slurm, per_node, cpt):  # noqa: F811
    devices = 4
    p = slurm.cmd("srun", "--mpi=pmix", "--nodes=2", f"--ntasks-per-node={per_node}", f"--cpus-per-task={cpt}",
                  sys.executable, "-m", "mpi4py", NODE_INFO, timeout=120,
                  env=slurm.env(threads=False, RINGZERO_STANDIN_DEVICES=str(devices)))
    m = re.search(r"^NODE_INFO (.*)$", p.stdout, re.M)
    assert m, p.stdout + p.stderr
    recs = sorted(json.loads(m.group(1)), key=lambda r: r["rank"])
    assert len(recs) == 2 * per_node, recs
    for r in recs:
        rank = r["rank"]
        want = {"host": sc.node(rank // per_node + 1), "node_size": per_node, "local_rank": rank % per_node,
                "cores": cpt, "sharing": 1, "threads": cpt, "device": (rank % per_node) % devices}
        assert {k: r[k] for k in want} == want, f"rank {rank}: {r}"
        assert r["libraries"] and all(n == cpt for n in r["libraries"]), r


@pytest.fixture(scope="module")
def hybrid_ref(tmp_path_factory):
    """The one-host run of the hybrid test: 4 ranks, --ranks-per-node 2, 5 steps."""
    d = tmp_path_factory.mktemp("hybrid_ref")
    base = _base(d, "hybrid") + ["--steps", "5"]
    one = cc.one_host(base + ["--ranks-per-node", "2", "--metrics", "one.jsonl"], 4, d)
    assert one.returncode == 0, cc.tail(one)
    return losses(d / "one.jsonl"), TRAFFIC.findall(one.stdout)


@pytest.mark.parametrize("launch", ["srun", "mpirun"])
def test_sbatch_hybrid_is_bitwise_the_one_host_run(slurm, hybrid_ref, tmp_path, launch):  # noqa: F811
    base = _base(tmp_path, "hybrid") + ["--steps", "5"]
    jid, rc, _ = slurm.sbatch(tmp_path, base + ["--metrics", "two.jsonl"],
                              env=slurm.env(threads=False, RINGZERO_LAUNCH=launch))
    out = slurm.out(tmp_path, jid)
    assert rc == 0, out
    job = slurm.job(jid)
    assert job["JobState"] == "COMPLETED" and job["NodeList"] == f"{sc.PREFIX}-n[1-2]", job
    assert "all_reduce@replica" in out, out
    if launch == "srun":        # each task bound to its one CPU (--cpus-per-task=1, task/affinity)
        assert "BLAS/OpenMP threads per rank: 1 (1 cores shared by 1 ranks" in out, out
    ref, traffic = hybrid_ref
    got = losses(tmp_path / "two.jsonl")
    assert len(ref) == 5 and got == ref, f"one host {ref}\nunder Slurm ({launch}) {got}"
    assert TRAFFIC.findall(out) == traffic, out


def _exit_lines(out):
    """{task: exit code} from srun's "srun: error: NODE: tasks 0-1: Exited with exit code N" lines."""
    got = {}
    for first, last, code in re.findall(r"tasks? (\d+)(?:-(\d+))?: Exited with exit code (\d+)", out):
        for t in range(int(first), int(last or first) + 1):
            got[t] = int(code)
    return got


def test_time_limit_saves_exits_143_and_the_resubmitted_job_resumes_bitwise(slurm, tmp_path):  # noqa: F811
    base = _base(tmp_path, "hybrid")          # bitwise the one-host run with --ranks-per-node 2
    jid, rc, _ = slurm.sbatch(tmp_path, base + ["--steps", "1000000", "--save-dir", "ck", "--metrics", "cut.jsonl"],
                              # Slurm sends the signal up to 60 s earlier than asked (its time-limit check runs
                              # every 30 s and looks that far ahead): with --time=1 any @N could come in the first
                              # second, before a loaded machine had started Python and the ranks' handlers (the
                              # default action: no checkpoint). --time=2 with @30 comes 30-90 s in.
                              flags=["--time=2", "--signal=TERM@30", "--no-requeue"], timeout=240)
    out = slurm.out(tmp_path, jid)
    assert rc == 143, out
    assert re.search(r"SIGTERM at step \d+: .*saved.*; exiting 143", out), out
    assert _exit_lines(out) == {t: 143 for t in range(4)}, out
    job = slurm.job(jid)
    assert job["JobState"] == "FAILED" and job["ExitCode"] == "143:0", job
    ck = sorted(p.name for p in (tmp_path / "ck").glob("step-*"))
    assert ck, out
    start = int(ck[-1].split("-")[1])
    end = start + 3
    jid2, rc2, _ = slurm.sbatch(tmp_path, base + ["--steps", str(end), "--resume", "latest", "--save-dir", "ck",
                                                  "--metrics", "res.jsonl"], flags=[f"--dependency=afterany:{jid}"])
    assert rc2 == 0, slurm.out(tmp_path, jid2)
    ref = cc.one_host(base + ["--steps", str(end), "--ranks-per-node", "2", "--metrics", "ref.jsonl"], 4, tmp_path,
                      timeout=280)
    assert ref.returncode == 0, cc.tail(ref)
    a, cut, res = losses(tmp_path / "ref.jsonl"), losses(tmp_path / "cut.jsonl"), losses(tmp_path / "res.jsonl")
    assert sorted(res) == list(range(start, end)), sorted(res)
    assert {s: a[s] for s in res} == res, f"resumed at {start}: {res}\nreference {[a[s] for s in res]}"
    assert {s: a[s] for s in cut} == cut, "the steps before the stop differ from the reference"


def _metrics_lines(path):
    return len(path.read_text().splitlines()) if path.exists() else 0


def _pids_in(n) -> set:
    return set(map(int, subprocess.run(["ip", "netns", "pids", n], capture_output=True, text=True).stdout.split()))


def _left_in_nodes():
    """Processes in the nodes other than the slurmds: (node, pid, name)."""
    left = []
    for i in (1, 2):
        for pid in _pids_in(sc.node(i)):
            try:
                name = open(f"/proc/{pid}/comm").read().strip()
            except OSError:
                continue
            if name != "slurmd":
                left.append((sc.node(i), int(pid), name))
    return left


def test_scancel_ends_every_rank_on_every_node(slurm, tmp_path):  # noqa: F811
    env = slurm.env()
    tag = env["RINGZERO_TEST_TAG"]
    jid, _, _ = slurm.sbatch(tmp_path, _base(tmp_path, "3") + ["--steps", "1000000", "--metrics", "m.jsonl"],
                             env=env, wait=False)
    try:
        assert cc.wait_for(lambda: _metrics_lines(tmp_path / "m.jsonl") >= 3, 90), slurm.out(tmp_path, jid)
        ranks = set(cc.tagged(tag))
        assert all(ranks & _pids_in(sc.node(i)) for i in (1, 2)), "the job is not on both nodes"
        slurm.cmd("scancel", str(jid))
        t0 = time.monotonic()
        gone = cc.wait_for(lambda: not cc.tagged(tag) and not _left_in_nodes(), 30)
        took = time.monotonic() - t0
        assert gone, f"30 s after scancel: {cc.tagged(tag)} tagged, in the nodes {_left_in_nodes()}"
        job = slurm.wait_state(jid, 10)
        assert job["JobState"] == "CANCELLED", job
        print(f"scancel: every process gone after {took:.1f} s")
    finally:
        subprocess.run(["scancel", str(jid)], env=env, capture_output=True)


def test_link_cut_ends_the_job_names_the_rank_and_fails(slurm, tmp_path):  # noqa: F811
    env = slurm.env(RINGZERO_STALL_WARN="3", RINGZERO_TIMEOUT="10")
    jid, _, _ = slurm.sbatch(tmp_path, _base(tmp_path, "2") + ["--steps", "1000000", "--metrics", "m.jsonl"],
                             flags=["--ntasks-per-node=1", "--no-requeue"], env=env, wait=False)
    link = f"{sc.node(2)}-h"
    try:
        assert cc.wait_for(lambda: _metrics_lines(tmp_path / "m.jsonl") >= 5, 90), slurm.out(tmp_path, jid)
        subprocess.run(["ip", "link", "set", link, "down"], check=True)
        t0 = time.monotonic()
        job = slurm.wait_state(jid, 150)
        took = time.monotonic() - t0
        out = slurm.out(tmp_path, jid)
        assert job["JobState"] in ("FAILED", "NODE_FAIL"), f"{took:.1f} s after the cut: {job}\n{out[-3000:]}"
        stall = re.findall(STALL, out)
        assert stall and float(stall[0]) < 5, out[-3000:]
        print(f"link cut: job {job['JobState']} {job.get('ExitCode')} {took:.1f} s after the cut")
    finally:
        subprocess.run(["ip", "link", "set", link, "up"])
        subprocess.run(["scancel", str(jid)], env=env, capture_output=True)
        slurm.cmd("scontrol", "update", f"nodename={sc.node(2)}", "state=resume", check=False)
