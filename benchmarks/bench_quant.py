"""The quantized collectives against the Ring's: time and bytes per call, per rank.

What it is
    Run under mpirun. For each size (elements of the full buffer, L = n * m) it times, with a
    barrier around every repeat, and prints the median over ranks' maxima:

        all_gather      Ring.all_gather on fp16       vs  QuantizedComm.all_gather (int8, qwZ)
        reduce_scatter  Ring.reduce_scatter on fp16   vs  QuantizedComm.reduce_scatter (int4, qgZ)

    beside the bytes this rank sent per call and the part that left its node (the ledgers).
    ``--nodes N`` labels the ranks as N nodes (rank r on node r * N // n), as the node-aware tests
    do, so one host shows the two-hop schedule; under launch/cluster the real map is used.

What it is not
    A training step: the engine does not call these yet (docs/quantized.md).

    mpirun -n 4 python benchmarks/bench_quant.py 1M 16M --nodes 2
    ./launch/cluster --nodes 2 --ranks-per-node 2 --link 1gbit -- python benchmarks/bench_quant.py 16M
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

from ringzero.comm.quant import Quant
from ringzero.comm.quantized import QuantizedComm
from ringzero.comm.ring import Ring
from ringzero.sizes import parse_size


def timed(comm, fn, repeats):
    """Median over repeats of the slowest rank's time of fn() (seconds)."""
    out = []
    for _ in range(repeats):
        comm.Barrier()
        t = time.perf_counter()
        fn()
        out.append(comm.allreduce(time.perf_counter() - t, op=MPI.MAX))
    return statistics.median(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("sizes", nargs="+", help="elements of the full buffer, e.g. 1M 16M")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--nodes", type=int, default=0, help="emulate N nodes on one host (default: MPI's map)")
    ap.add_argument("--block", type=int, default=2048, help="elements per fp32 scale (default 2048)")
    w = MPI.COMM_WORLD
    a = ap.parse_args(argv)
    n = w.size
    try:
        sizes = [parse_size(t) for t in a.sizes]
        if a.repeats < 1 or a.block < 1:
            raise ValueError(f"expected --repeats >= 1 and --block >= 1, got {a.repeats} and {a.block}")
        if a.nodes and (a.nodes < 1 or n % a.nodes):
            raise ValueError(f"expected --nodes to divide the {n} ranks, got {a.nodes}")
    except ValueError as e:
        ap.error(str(e))                       # one line, exit 2, on every rank
    labels = [r * a.nodes // n for r in range(n)] if a.nodes else None
    ring = Ring(w, nodes=labels)
    qc = QuantizedComm(ring, weights=Quant(8, a.block), grads=Quant(4, a.block))
    if w.rank == 0:
        print(f"n={n} ({ring.nodes.describe()}), block {a.block}; median of {a.repeats}, slowest rank")
        print(f"{'op':<16}{'elements':>12}{'fp16 ring ms':>14}{'quantized ms':>14}{'ratio':>8}"
              f"{'ring B sent':>14}{'quant B sent':>14}{'ring B inter':>14}{'quant B inter':>15}")
    for L in sizes:
        m = max(1, L // n)
        x16 = np.random.default_rng(w.rank).standard_normal(n * m).astype(np.float16)
        mine = np.empty(m, np.float16)
        full = np.empty(n * m, np.float16)
        for op, ring_call, q_call in (
                ("all_gather", lambda: ring.all_gather(x16[:m], full), lambda: qc.all_gather(x16[:m], full)),
                ("reduce_scatter", lambda: ring.reduce_scatter(x16, mine), lambda: qc.reduce_scatter(x16, mine))):
            ring_call(), q_call()                                     # warm: plans and scratch made
            ring.ledger.reset(), qc.ledger.reset()
            t_ring, t_q = timed(w, ring_call, a.repeats), timed(w, q_call, a.repeats)
            rl, ql = ring.ledger[op], qc.ledger["q_" + op]
            per = lambda d, k: d[k] // max(1, d["calls"])   # noqa: E731
            if w.rank == 0:
                print(f"{op:<16}{n * m:>12,}{1e3 * t_ring:>14.2f}{1e3 * t_q:>14.2f}{t_ring / t_q:>8.2f}"
                      f"{per(rl, 'bytes_sent'):>14,}{per(ql, 'bytes_sent'):>14,}"
                      f"{per(rl, 'bytes_sent_internode'):>14,}{per(ql, 'bytes_sent_internode'):>15,}")
    qc.free()
    ring.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
