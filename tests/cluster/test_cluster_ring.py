"""The Ring and the node across real node boundaries (``./launch/cluster``).

- conformance: tests/test_collectives.py's MPI tests that check the Ring's
  all-reduce, reduce-scatter and all-gather against NumPy sums (and one
  against MPI's own all-reduce), under mpirun across 2 and 3 nodes x 2 ranks
  (where the Ring takes its node-aware schedule) and 3 nodes x 1 rank (flat),
  so that every ring crosses TCP between network namespaces; each rank must
  have run on the node its rank maps to;
- the bench across 2 x 2: it names the node-aware schedule and HAN, and
  counts no wrong element;
- the node as MPI finds it: each rank's hostname, MPI's shared-memory split,
  its BLAS threads (cores // ranks on ITS node, as threadpoolctl reads them
  back) and its GPU (node-local rank mod the device count, the CuPy stand-in
  showing 4 devices), all per node, against formulas written here.
"""
import json
import os
import re

import cluster_cli as cc
import pytest

pytestmark = pytest.mark.cluster

# the conformance subset (against NumPy sums, and MPI's own all-reduce once)
CONFORMANCE = ("(all_reduce_sum_and_avg or reduce_scatter_and_all_gather) and (float32 or int64)"
               " or large_and_pipelined or (against_mpi_library and float32)")


@pytest.mark.parametrize("nodes,ppn", [(2, 2), (3, 2), (3, 1)])
def test_ring_conformance_across_nodes(tmp_path, nodes, ppn):
    cc.skip_unless_possible()
    logs, verdicts = tmp_path / "logs", tmp_path / "verdicts"
    verdicts.mkdir()
    cmd = ["python", "-m", "mpi4py", os.path.join(cc.ROOT, "launch", "mpi_pytest.py"), str(verdicts),
           "--with-mpi", "-m", "mpi", "-q", "-p", "no:cacheprovider", "--color=no", "-k", CONFORMANCE,
           os.path.join(cc.TESTS, "test_collectives.py")]
    p = cc.run(nodes, ppn, cmd, logs, cwd=cc.ROOT)
    assert p.returncode == 0, cc.tail(p)
    passed, failed, skipped, errors = map(int, (verdicts / "summary").read_text().split())
    assert passed >= 20 and failed == errors == 0, f"{passed} passed, {failed} failed, {errors} errors\n" + cc.tail(p)
    want = sorted(f"{cc.node(r // ppn + 1)}.rank-{r}.log" for r in range(nodes * ppn))
    assert sorted(os.listdir(logs)) == want


def test_bench_across_nodes_names_the_node_aware_schedule(tmp_path):
    cc.skip_unless_possible()
    p = cc.run(2, 2, ["python", "-m", "ringzero.bench", "-b", "256K", "-e", "1M", "-n", "2", "-w", "1"],
               tmp_path / "logs", link="1gbit", cwd=cc.ROOT)
    assert p.returncode == 0, cc.tail(p)
    assert "# nodes: 2 nodes x 2 ranks; across nodes the Ring runs its node-aware schedule" in p.stdout, cc.tail(p)
    assert "# MPI coll: han" in p.stdout and "# total wrong elements: 0" in p.stdout, cc.tail(p)
    assert "ring/limit" in p.stdout, cc.tail(p)          # launch/cluster hands the link's rate to the ranks


def test_node_found_by_mpi_threads_and_device_per_node(tmp_path):
    cc.skip_unless_possible()
    nodes, ppn, devices = 2, 2, 4
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "node_info.py")
    p = cc.run(nodes, ppn, ["python", script], tmp_path / "logs",
               env_=cc.env(threads=False, RINGZERO_STANDIN_DEVICES=str(devices)))
    assert p.returncode == 0, cc.tail(p)
    m = re.search(r"^NODE_INFO (.*)$", p.stdout, re.M)
    assert m, cc.tail(p)
    recs = sorted(json.loads(m.group(1)), key=lambda r: r["rank"])
    cores = len(os.sched_getaffinity(0))
    for r in recs:
        rank = r["rank"]
        want = {"host": cc.node(rank // ppn + 1), "node_size": ppn, "local_rank": rank % ppn,
                "threads": max(1, cores // ppn), "sharing": ppn, "device": (rank % ppn) % devices}
        got = {k: r[k] for k in want}
        assert got == want, f"rank {rank}: {got} != {want}"
        assert r["libraries"] and all(n == want["threads"] for n in r["libraries"]), r
