"""The trainer across emulated nodes (``./launch/cluster``), against one-host runs.

- ``--stage hybrid`` across 2 nodes x 2 ranks, with the node found by MPI
  itself (no --ranks-per-node), gives the same losses bit for bit, and the
  same traffic per step, as the one-host run with ``--ranks-per-node 2``;
- a checkpoint saved by a 2-node run holds the same bytes (every file's
  sha256 in the manifest) as the one saved by the same run on one host, and
  resumes on one host at Nd = 1 (the same global batch, --batch doubled):
  the resumed losses follow the uninterrupted 2-rank run's within float32
  tolerance (the reduction order changes with Nd: docs/checkpoint.md).
"""
import json
import os
import re

import cluster_cli as cc
import numpy as np
import pytest
from trainer_cli import TINY, corpus, losses

pytestmark = pytest.mark.cluster

TRAFFIC = re.compile(r"^traffic per step per rank\s+measured ([\d,]+) B", re.M)


def test_hybrid_across_nodes_is_bitwise_the_one_host_run(tmp_path):
    cc.skip_unless_possible()
    base = TINY + ["--data", corpus(tmp_path / "corpus.txt"), "--stage", "hybrid", "--precision", "fp32",
                   "--steps", "5"]
    one = cc.one_host(base + ["--ranks-per-node", "2", "--metrics", "one.jsonl"], 4, tmp_path)
    assert one.returncode == 0, cc.tail(one)
    two = cc.run(2, 2, ["python", "-m", "ringzero.train", *base, "--metrics", "two.jsonl"], tmp_path / "logs",
                 cwd=tmp_path)
    assert two.returncode == 0, cc.tail(two)
    a, b = losses(tmp_path / "one.jsonl"), losses(tmp_path / "two.jsonl")
    assert len(a) == 5 and a == b, f"one host {a}\nacross nodes {b}"
    # the same groups: 2 ranks share each unit, the replicas all-reduce across the nodes
    for p in (one, two):
        assert "all_reduce@replica" in p.stdout, cc.tail(p)
    assert TRAFFIC.findall(one.stdout) == TRAFFIC.findall(two.stdout), cc.tail(two)


def _sha256s(step_dir):
    with open(os.path.join(step_dir, "manifest.json")) as f:
        man = json.load(f)
    files = man["files"]
    items = files.items() if isinstance(files, dict) else ((f.get("name", i), f) for i, f in enumerate(files))
    return {name: f["sha256"] for name, f in items}


def test_checkpoint_from_two_nodes_resumes_on_one_host_at_another_nd(tmp_path):
    cc.skip_unless_possible()
    base = TINY + ["--data", corpus(tmp_path / "corpus.txt"), "--stage", "3", "--precision", "fp32"]
    save = ["--steps", "3", "--save-every", "3"]
    two = cc.run(2, 1, ["python", "-m", "ringzero.train", *base, *save, "--save-dir", "ck2"], tmp_path / "logs",
                 cwd=tmp_path)
    assert two.returncode == 0, cc.tail(two)
    # the same run on one host, run on to step 5 (the reference)
    one = cc.one_host(base + ["--steps", "5", "--save-every", "3", "--save-dir", "ck1", "--metrics", "ref.jsonl"],
                      2, tmp_path)
    assert one.returncode == 0, cc.tail(one)
    s2, s1 = _sha256s(tmp_path / "ck2" / "step-000003"), _sha256s(tmp_path / "ck1" / "step-000003")
    assert s2 and s2 == s1, f"two nodes {s2}\none host {s1}"
    # resumed on one host at Nd = 1, the same 8-row global batch
    res = cc.one_host(base + ["--batch", "8", "--steps", "5", "--resume", "latest", "--save-dir", "ck2",
                              "--metrics", "res.jsonl"], 1, tmp_path)
    assert res.returncode == 0, cc.tail(res)
    assert "resumed from" in res.stdout and "step 3" in res.stdout, cc.tail(res)
    ref, got = losses(tmp_path / "ref.jsonl"), losses(tmp_path / "res.jsonl")
    assert sorted(got) == [3, 4], got
    np.testing.assert_allclose([got[3], got[4]], [ref[3], ref[4]], rtol=1e-5)
