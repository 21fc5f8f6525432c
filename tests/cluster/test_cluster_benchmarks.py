"""benchmarks/bench_stages.py --cluster across emulated nodes (the tests' nodes, rzt at net 1).

At 2 nodes x 1 rank every peer of a rank is on the other node, so the bytes
each stage sent to other nodes must equal all the bytes it sent; MPI must
find 2 nodes, and the engine must overlap (its default across nodes).
"""
import json
import os
import subprocess
import sys

import cluster_cli as cc
import pytest

pytestmark = pytest.mark.cluster

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--seq-len", "16", "--batch", "2",
        "--iters", "2", "--warmup", "1"]


def test_bench_stages_across_two_nodes(tmp_path):
    cc.skip_unless_possible()
    out = tmp_path / "stages.json"
    cmd = [sys.executable, os.path.join(cc.ROOT, "benchmarks", "bench_stages.py"), *TINY,
           "--stages", "0,1,2,3,hybrid", "--cluster", "2x1", "--link", "none",
           "--cluster-prefix", cc.PREFIX, "--cluster-net", str(cc.NET), "--json", str(out)]
    p = subprocess.run(cmd, env=cc.env(), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, cc.tail(p)
    assert "across 2 emulated nodes x 1 ranks" in p.stdout and "MPI finds 2 node(s)" in p.stdout, cc.tail(p)
    with open(out) as f:
        res = json.load(f)
    assert res["nd"] == 2 and res["nodes"] == 2, res
    assert [r["stage"] for r in res["rows"]] == ["0", "1", "2", "3", "hybrid"], res
    for r in res["rows"]:
        assert r["bytes_sent"] > 0 and r["bytes_sent_internode"] == r["bytes_sent"], r
        assert r["overlap"] is True, r
        assert r["timeline"]["fwd_bwd_s"] > 0, r
