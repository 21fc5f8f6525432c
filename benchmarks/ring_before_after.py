"""An older Ring against this one and the MPI library, interleaved call by call in ONE run.

    git archive db3d859 ringzero/comm | tar -x -C /tmp/prev && mv /tmp/prev/ringzero /tmp/prev/ringzero_prev \
      && touch /tmp/prev/ringzero_prev/__init__.py && sed -i 's/ringzero\.comm/ringzero_prev.comm/g' /tmp/prev/ringzero_prev/comm/*.py \
      && cp ringzero/comm/_f16*.so /tmp/prev/ringzero_prev/comm/
    mpirun -n 4 python -m mpi4py benchmarks/ring_before_after.py /tmp/prev 3

(The older comm package is loaded whole as ``ringzero_prev``: its ring.py needs its own
plan.py. For a tree from before plan.py existed the same commands work.)

For each op and size S (float32, 4 KiB to 64 MiB by 4): the three (old Ring, new
Ring, MPI) timed in alternating blocks (ringzero.tools.bench.time_blocks); time =
median over rounds of the slowest rank; about BUDGET seconds per row. Prints MPI
time / Ring time for old and new, the median of the ratios within each round, i.e.
busbw Ring/MPI (on a loaded machine the only figure that means anything is a ratio
taken side by side like this).
"""
import importlib.util, sys, time
import numpy as np
from mpi4py import MPI
sys.path.insert(0, sys.argv[1])
import ringzero_prev.comm.ring as old
from ringzero.comm.ring import Ring
from ringzero.tools.bench import paired_ratio, time_blocks
comm = MPI.COMM_WORLD; n, r = comm.size, comm.rank
rings = {"old": old.Ring(comm), "new": Ring(comm)}
sizes = [4096 * 4 ** k for k in range(8)]
budget = float(sys.argv[2]) if len(sys.argv) > 2 else 4.0
if r == 0:
    print(f"# n={n} float32, old/new/MPI interleaved; time ratio ring/MPI for S <= 64K, busbw ratio above", flush=True)
for op in ("all_reduce", "reduce_scatter", "all_gather"):
    for S in sizes:
        cnt = max(n, S // 4) // n * n
        bufs = {}
        for k in ("old", "new", "mpi"):
            if op == "all_reduce": a = np.zeros(cnt, np.float32); b = a
            elif op == "reduce_scatter": a, b = np.zeros(cnt, np.float32), np.zeros(cnt // n, np.float32)
            else: a, b = np.zeros(cnt // n, np.float32), np.zeros(cnt, np.float32)
            bufs[k] = (a, b)
        def fn(k):
            a, b = bufs[k]
            if k == "mpi":
                return {"all_reduce": lambda: comm.Allreduce(MPI.IN_PLACE, a), "reduce_scatter": lambda: comm.Reduce_scatter_block(a, b),
                        "all_gather": lambda: comm.Allgather(a, b)}[op]
            R = rings[k]
            return {"all_reduce": lambda: R.all_reduce(a), "reduce_scatter": lambda: R.reduce_scatter(a, b),
                    "all_gather": lambda: R.all_gather(a, b)}[op]
        fns = {k: fn(k) for k in bufs}
        for _ in range(3):
            for f in fns.values(): f()
        comm.Barrier(); t0 = time.perf_counter()
        for f in fns.values(): f()
        probe = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        iters = int(max(15, min(400, budget / max(probe, 1e-9))))
        T = time_blocks(comm, fns, iters)   # alternating blocks, as python -m ringzero.bench
        med = {k: float(np.median(v)) for k, v in T.items()}
        if r == 0:
            print(f"{op:>14} {S:>9} iters={iters:>4} old={med['old']*1e6:10.1f}us new={med['new']*1e6:10.1f}us "
                  f"mpi={med['mpi']*1e6:10.1f}us  ratio old={paired_ratio(T['mpi'], T['old']):.2f} "
                  f"new={paired_ratio(T['mpi'], T['new']):.2f}", flush=True)
