"""What MPI's own point-to-point gets across a link: one way, both ways on one pair, both ways on two pairs.

What it is
    Run under mpirun on an even number of ranks split over two nodes (or
    two halves of one host). Rank i of the first node is paired with rank i
    of the second. Each size is timed three ways, with a barrier around
    every repeat, and the median is printed:

        one way          pair 0 only: the first node's rank sends, the other receives
        both ways, 1 pair  pair 0 only: MPI_Sendrecv, each rank sends S and receives S
        both ways, 2 pairs pair 0 sends first -> second, pair 1 second -> first:
                           the link carries S each way, each pair one way only
                           (needs 2 ranks per node)

    With RINGZERO_LINK set (launch/cluster sets it) it prints the link's
    limit, S at the link's rate, and each time over it. The node-aware
    schedule's cross pass (comm/nodes.Pair) is laid out after what this
    measures; ``--mca btl_tcp_links`` (MPIRUN_ARGS) changes the second row.

What it is not
    A test of the Ring: no ringzero collective runs here.

    ./launch/cluster --nodes 2 --ranks-per-node 2 --link 1gbit -- python benchmarks/link_pairs.py 4M 16M
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

from ringzero.sizes import parse_link, parse_size


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("sizes", nargs="+", help="bytes per message, e.g. 4M 16M")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)
    try:
        sizes = [parse_size(t) for t in a.sizes]
    except ValueError as e:
        ap.error(str(e))                       # one line, exit 2, on every rank
    w = MPI.COMM_WORLD
    node = w.Split_type(MPI.COMM_TYPE_SHARED)
    if node.size == w.size:                    # one host: its two halves stand in for the nodes
        node.Free()
        node = w.Split(int(w.rank >= w.size // 2), w.rank)
    cross = w.Split(node.rank, w.rank)         # this rank and its partner on the other node
    if w.size % 2 or cross.size != 2:
        if w.rank == 0:
            print(f"link_pairs: needs the same number of ranks on each of two nodes, got {w.size} ranks",
                  file=sys.stderr)
        return 2
    side, pair, peer = cross.rank, node.rank, 1 - cross.rank
    link = os.environ.get("RINGZERO_LINK", "")
    rate = parse_link(link) if link and link != "none" else None     # bytes/s
    kinds = ["one way", "both ways, 1 pair"] + (["both ways, 2 pairs"] if node.size > 1 else [])
    if w.rank == 0:
        print(f"# link_pairs: {w.size} ranks, {node.size} per node; link {link or 'not set'}; "
              f"MPI {MPI.Get_library_version().split(',')[0].strip()}")
        print(f"{'bytes':>10} {'pattern':>20} {'median ms':>10}" + (f" {'limit ms':>9} {'x limit':>8}" if rate else ""))
    for S in sizes:
        x, y = np.ones(S, np.uint8), np.empty(S, np.uint8)
        for kind in kinds:
            ts = []
            for _ in range(a.repeats + 1):
                w.Barrier()
                t0 = time.perf_counter()
                if kind == "one way" and pair == 0:
                    cross.Send(x, peer, 0) if side == 0 else cross.Recv(y, peer, 0)
                elif kind == "both ways, 1 pair" and pair == 0:
                    cross.Sendrecv(x, peer, 0, y, peer, 0)
                elif kind == "both ways, 2 pairs" and pair < 2:
                    cross.Send(x, peer, 0) if side == pair else cross.Recv(y, peer, 0)
                w.Barrier()
                ts.append(time.perf_counter() - t0)
            med = 1e3 * statistics.median(ts[1:])           # the first is a warm-up
            if w.rank == 0:
                row = f"{S:>10,} {kind:>20} {med:>10.1f}"
                if rate:
                    row += f" {1e3 * S / rate:>9.1f} {med / (1e3 * S / rate):>8.2f}"
                print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
