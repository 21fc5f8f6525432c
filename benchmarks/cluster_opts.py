"""``--cluster KxP --link RATE`` for the benchmarks: the flags, their check, the launch/cluster command.

What it is
    ``add_args`` puts the flags on a parser; ``check`` reads them into
    ``a.nodes``, ``a.ppn`` (None without --cluster) or ends the script with one
    line and exit code 2; ``prefix`` is the command line that runs what follows
    it across K emulated nodes of P ranks (``launch/cluster``, as root: it
    builds the nodes and removes them afterwards); ``inside_mpi`` says whether
    this process is already a rank of an MPI job (then a script with --cluster
    runs its part instead of launching itself again).
    The nodes are ``rzh-n1``, ``rzh-n2``, ... at 198.18.7.0/24 unless
    --cluster-prefix / --cluster-net say otherwise (launch/cluster's own default
    is ``rz`` at net 0, benchmarks/train_peer.py's ``rzp`` at 5, the tests' ``rzt`` at 1).
What it is not
    A benchmark: bench_stages.py, check_simulate.py and train_peer.py use it.
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_PREFIX, DEFAULT_NET = "rzh", 7
MPI_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")   # set in a rank by Open MPI / Hydra / PMIx


def add_args(ap, replaces: str = "", prefix: str = DEFAULT_PREFIX, net: int = DEFAULT_NET):
    ap.add_argument("--cluster", metavar="KxP", help="run across K emulated nodes of P ranks (launch/cluster, "
                    "as root)" + (f"; replaces {replaces}" if replaces else ""))
    ap.add_argument("--link", default="1gbit", help="--cluster: the links' rate (tc: 1gbit, 10gbit, none)")
    ap.add_argument("--cluster-prefix", default=prefix, help=f"--cluster: node names (default {prefix})")
    ap.add_argument("--cluster-net", type=int, default=net,
                    help=f"--cluster: addresses 198.18.N.0/24 (default {net})")


def fail(script: str, msg: str):
    print(f"{script}: {msg}", file=sys.stderr)
    sys.exit(2)


def check(a, script: str):
    """a.nodes, a.ppn from a.cluster ('2x2' -> 2, 2; None -> None, None); a bad value: one line, exit 2."""
    a.nodes = a.ppn = None
    if a.cluster is None:
        return
    try:
        a.nodes, a.ppn = (int(x) for x in a.cluster.lower().split("x"))
    except ValueError:
        fail(script, f"--cluster must be KxP (nodes x ranks per node), e.g. 2x1, got {a.cluster!r}")
    if not 2 <= a.nodes <= 99 or a.ppn < 1:
        fail(script, f"--cluster needs 2..99 nodes of >= 1 rank, got {a.cluster!r}")
    if not a.link.replace(".", "").isalnum():
        fail(script, f"--link must be a tc rate (1gbit, 10gbit, 500mbit) or none, got {a.link!r}")


def inside_mpi() -> bool:
    return any(v in os.environ for v in MPI_VARS)


def prefix(a, logs: str) -> list:
    """launch/cluster across a.nodes x a.ppn at a.link, every rank's output also in ``logs``; then ``--``."""
    return [os.path.join(ROOT, "launch", "cluster"), "--prefix", a.cluster_prefix, "--net", str(a.cluster_net),
            "--nodes", str(a.nodes), "--ranks-per-node", str(a.ppn), "--link", a.link, "--logs", logs, "--"]


def describe(a) -> str:
    return (f"across {a.nodes} emulated nodes x {a.ppn} ranks, links {a.link} "
            f"(launch/cluster '{a.cluster_prefix}', 198.18.{a.cluster_net}.0/24)")
