"""Where one Ring call's time goes, step kind by step kind, beside the MPI library's collective.

    OMP_NUM_THREADS=1 mpirun --oversubscribe --bind-to none -n 8 \
        python -m mpi4py benchmarks/plan_profile.py all_reduce 256K [CALLS]

The Ring compiles the call into a plan (ringzero/comm/plan.py); this script runs that
plan's steps itself, CALLS times (default 300), with a clock around each: "start"
(Startall), "wait" (Waitall / the Waitsome loop, i.e. time inside MPI until the data is
there), "check" (received counts), "add" (the reductions), "copy"; "python" is what is
left of the wall time (the loop, the step dispatch). Then the Ring's own call and the
MPI collective are timed in alternating blocks on the same buffers. Rank 0 prints one
line per rank, in microseconds per call.
"""
import sys
import time
from argparse import ArgumentTypeError

import numpy as np
from mpi4py import MPI

from ringzero.app.exits import leave
from ringzero.comm.ring import Ring
from ringzero.comm.steps import Add, Copy, Exchange, MultiWait, Start, Wait
from ringzero.tools.bench import OP_NAMES, mpi_call, parse_size, ring_call, time_blocks

comm = MPI.COMM_WORLD
n, r = comm.size, comm.rank
try:   # every rank parses the same argv: a bad one is one line from rank 0 and exit 2 everywhere
    op = sys.argv[1] if len(sys.argv) > 1 else "all_reduce"
    if op not in OP_NAMES:
        raise ValueError(f"op must be one of {', '.join(OP_NAMES)}, got {op!r}")
    S = parse_size(sys.argv[2]) if len(sys.argv) > 2 else 256 << 10
    calls = int(sys.argv[3]) if len(sys.argv) > 3 else 300
    if n < 2 or calls < 1:
        raise ValueError(f"needs n >= 2 ranks and CALLS >= 1, got n = {n}, CALLS = {calls}")
except (ValueError, ArgumentTypeError) as e:
    leave(comm, 2, f"plan_profile: {e}")
m = max(1, S // 4 // n)
big, part = np.zeros(n * m, np.float32), np.zeros(m, np.float32)
ring = Ring(comm)
a, b = {"all_reduce": (big, big), "reduce_scatter": (big, part), "all_gather": (part, big)}[op]
run, mpi = ring_call(op, ring, a, b), mpi_call(op, comm, a, b)
for _ in range(3):
    run()                                   # kept from the second call on
plan = next(p for p in ring.cache.plans.values() if p.name == op)
sched = ring.schedule(op, big.nbytes, len(part) if op == "all_gather" else len(big))
clock = time.perf_counter
acc = dict(start=0.0, wait=0.0, check=0.0, add=0.0, copy=0.0)
waitall, startall, byte = MPI.Request.Waitall, MPI.Prequest.Startall, MPI.BYTE
comm.Barrier()
t_all = clock()
for _ in range(calls):
    for st in plan.steps:
        k = type(st)
        if k is Exchange or k is Wait:
            t0 = clock()
            if k is Exchange:
                startall(st.reqs)
            t1 = clock()
            waitall(st.reqs, st.statuses)
            t2 = clock()
            for status, _nb in st.checks:
                status.Get_count(byte)
            acc["start"] += t1 - t0
            acc["wait"] += t2 - t1
            acc["check"] += clock() - t2
        elif k is Start:
            t0 = clock()
            startall(st.reqs)
            acc["start"] += clock() - t0
        elif k is MultiWait:
            t0 = clock()
            ring.executor._multi_wait(plan, st)
            acc["wait"] += clock() - t0
        elif k is Add:
            t0 = clock()
            st.fn(st.a, st.b, st.out)
            acc["add"] += clock() - t0
        elif k is Copy:
            t0 = clock()
            st.dst[...] = st.src
            acc["copy"] += clock() - t0
t_all = clock() - t_all
t = time_blocks(comm, {"ring": run, "mpi": mpi}, 40)
rows = comm.gather((t_all, acc), root=0)
if r == 0:
    kinds = {Exchange: "xchg", Wait: "wait", Start: "start", MultiWait: "mwait", Add: "add", Copy: "copy"}
    print(f"# {op} {S >> 10} KiB float32, n={n}, schedule {sched}: {len(plan.steps)} steps "
          f"({' '.join(kinds.get(type(s), '?') for s in plan.steps)}); us per call, {calls} calls")
    for k, (tt, a) in enumerate(rows):
        rest = tt - sum(a.values())
        print(f"  rank {k}: total {tt / calls * 1e6:8.1f}  " +
              " ".join(f"{name}={v / calls * 1e6:7.1f}" for name, v in a.items()) +
              f"  python={rest / calls * 1e6:6.1f}")
    print(f"  Ring call {np.median(t['ring']) * 1e6:.1f} us, MPI {np.median(t['mpi']) * 1e6:.1f} us "
          "(alternating blocks, slowest rank)")
ring.free()
