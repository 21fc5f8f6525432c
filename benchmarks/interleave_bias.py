"""Why the bench times blocks: a call timed right after the other implementation's pays for it.

    mpirun -n 8 python -m mpi4py benchmarks/interleave_bias.py

For each op and size, the Ring and the MPI library's collective on the same
buffers, timed three ways in ONE launch:

  percall   barrier, one call, alternating ring / mpi every call (the bench's
            old method)
  blocks    ringzero.tools.bench.time_blocks: alternating blocks, each led in
            by one untimed call (the bench's method now)
  loop      OSU / nccl-tests style: 10 back-to-back calls timed as one, the
            implementations alternating loop by loop

Prints each method's median time per call (slowest rank) and MPI time / Ring
time. If the methods disagree, one implementation leaves work behind that
the next call pays for.
"""
import sys
import time

import numpy as np
from mpi4py import MPI

from ringzero.comm.ring import Ring
from ringzero.tools.bench import _Case, paired_ratio, time_blocks

comm = MPI.COMM_WORLD
n, r = comm.size, comm.rank
ring = Ring(comm)
sizes = [int(x) for x in sys.argv[1:]] or [256 << 10, 1 << 20, 4 << 20]


def percall(fns, iters=30):
    T = {k: [] for k in fns}
    for _ in range(iters):
        for k, f in fns.items():
            comm.Barrier()
            t = time.perf_counter()
            f()
            T[k].append(time.perf_counter() - t)
    arr = np.array([T[k] for k in fns])
    comm.Allreduce(MPI.IN_PLACE, arr, op=MPI.MAX)
    return {k: arr[i] for i, k in enumerate(fns)}


def loop(fns, rounds=6, k=10):
    T = {name: [] for name in fns}
    for _ in range(rounds):
        for name, f in fns.items():
            comm.Barrier()
            t = time.perf_counter()
            for _ in range(k):
                f()
            comm.Barrier()
            T[name].append((time.perf_counter() - t) / k)
    arr = np.array([T[name] for name in fns])
    comm.Allreduce(MPI.IN_PLACE, arr, op=MPI.MAX)
    return {name: arr[i] for i, name in enumerate(fns)}


if r == 0:
    print(f"# n={n} float32; median us per call (slowest rank); mpi/ring = MPI time / Ring time", flush=True)
for op in ("all_gather", "all_reduce"):
    for S in sizes:
        case = _Case(op, ring, comm, np, np.dtype(np.float32), max(n, S // 4) // n * n, False)
        fns = {"ring": case.ring, "mpi": case.mpi}
        for f in fns.values():
            f(), f()
        for name, T in (("percall", percall(fns)), ("blocks", time_blocks(comm, fns, 30)), ("loop", loop(fns))):
            if r == 0:
                a, b = np.median(T["ring"]) * 1e6, np.median(T["mpi"]) * 1e6
                print(f"{op:>11} {S:>9} {name:>8}  ring {a:9.1f}  mpi {b:9.1f}  "
                      f"mpi/ring {paired_ratio(T['mpi'], T['ring']):5.2f}", flush=True)
ring.free()
