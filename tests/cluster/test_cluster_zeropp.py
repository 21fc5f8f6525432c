"""ZeRO++ (``--zeropp qwz,hpz,qgz``) across emulated nodes (``./launch/cluster``), against the one-host run.

A quantized stage 3 job across 2 nodes x 2 ranks, its nodes found by MPI itself, gives the same
losses bit for bit, the same traffic per step and the same bytes across the nodes (codes and
scales) as the same job on one host with its node map emulated (``RINGZERO_EMULATE_NODES=2``, the
trainer's form of the tests' ``nodes=`` labels; tests/test_zeropp.py checks that run against a
NumPy reference). The quantized job's cross-node bytes per step are below a third of the
unquantized formula's (3 -> 0.75 in ZeRO++'s units, plus the block scales).
"""
import json
import re

import cluster_cli as cc
import pytest
from trainer_cli import TINY, corpus, losses

pytestmark = pytest.mark.cluster

ACROSS = re.compile(r"^\s+across nodes \(2 nodes x 2 ranks\)\s+measured ([\d,]+) B\s+formula .* = ([\d,]+) B", re.M)
TRAFFIC = re.compile(r"^traffic per step per rank\s+measured ([\d,]+) B", re.M)


def _internode(path):
    with open(path) as f:
        return [json.loads(ln).get("bytes_sent_internode") for ln in f if '"summary"' not in ln]


def test_quantized_training_across_two_nodes_is_the_emulated_run(tmp_path):
    cc.skip_unless_possible()
    base = TINY + ["--data", corpus(tmp_path / "corpus.txt"), "--stage", "3", "--steps", "6",
                   "--zeropp", "qwz,hpz,qgz", "--zeropp-block", "256"]
    one = cc.one_host(base + ["--metrics", "one.jsonl"], 4, tmp_path, env_=cc.env(RINGZERO_EMULATE_NODES="2"))
    assert one.returncode == 0, cc.tail(one)
    two = cc.run(2, 2, ["python", "-m", "ringzero.train", *base, "--metrics", "two.jsonl"], tmp_path / "logs",
                 cwd=tmp_path)
    assert two.returncode == 0, cc.tail(two)
    a, b = losses(tmp_path / "one.jsonl"), losses(tmp_path / "two.jsonl")
    assert len(a) == 6 and a == b, f"one host {a}\nacross nodes {b}"
    assert _internode(tmp_path / "one.jsonl") == _internode(tmp_path / "two.jsonl")
    assert TRAFFIC.findall(one.stdout) == TRAFFIC.findall(two.stdout), cc.tail(two)
    across = ACROSS.findall(two.stdout)
    assert across and across == ACROSS.findall(one.stdout), cc.tail(two)
    measured, unquantized = (int(x.replace(",", "")) for x in across[0])
    assert 0 < measured < unquantized / 3, cc.tail(two)
    assert "ZeRO++ qwz,hpz,qgz" in two.stdout and "q_reduce_scatter" in two.stdout, cc.tail(two)
