"""The torch peer of benchmarks/train_peer.py follows ringzero across emulated nodes.

tests/test_peer_trajectory.py (GPT-2's width, 6 steps, DDP and FSDP FULL_SHARD on
gloo against ringzero's stage 2) run as one MPI job across 2 nodes x 2 ranks
(``./launch/cluster``): gloo on the nodes' links, ringzero's ring across them.
The peer's losses and final weights must follow ringzero's within that module's
tolerances, as they do on one host (train_peer.py's --cluster ratios rest on it), and the
module's own check that the comparison can fail must fail there too.
"""
import re
import subprocess
import sys

import cluster_cli as cc
import pytest

pytestmark = pytest.mark.cluster


@pytest.mark.timeout(480)             # its job may take 420 s: more than the group's 300 s a test
def test_peer_follows_ringzero_across_two_nodes(tmp_path):
    cc.skip_unless_possible()
    pytest.importorskip("torch")
    module = f"{cc.TESTS}/test_peer_trajectory.py"
    env = cc.env(RINGZERO_PEER_MASTER=f"198.18.{cc.NET}.1", RINGZERO_PEER_IFNAME="eth0")
    p = cc.run(2, 2, [sys.executable, "-m", "pytest", "--with-mpi", "-q", "-p", "no:cacheprovider",
                      "-rA", module],
               tmp_path / "logs", env_=env, timeout=1200, cwd=tmp_path)
    assert p.returncode == 0, cc.tail(p)
    # every rank ran every case the module holds (today: GPT-2 in seven modes, DDP, FSDP x 2, FSDP2,
    # DeepSpeed ZeRO-1/2/3, the Llama cases, and the mutants the comparison must fail), counted here by
    # pytest's own collection; a skip, e.g. no torch or deepspeed on a node, is no pass
    ids = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          module], capture_output=True, text=True, timeout=300, cwd=tmp_path).stdout
    cases = sum("::" in line for line in ids.splitlines())
    assert cases >= 12, ids
    summaries = re.findall(r"^(\d+) passed(.*) in [0-9.]+s", p.stdout, re.M)
    assert len(summaries) == 4, cc.tail(p)
    for passed, rest in summaries:
        assert int(passed) == cases and "skipped" not in rest and "failed" not in rest, cc.tail(p)
