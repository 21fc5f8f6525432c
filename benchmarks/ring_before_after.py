"""An older Ring against this one and the MPI library, interleaved call by call in ONE run.

    git archive 16b42e7 | (mkdir -p /tmp/ring_old && tar -x -C /tmp/ring_old)
    mpirun -n 4 python -m mpi4py benchmarks/ring_before_after.py /tmp/ring_old 3

For each op and size S (float32, 4 KiB to 64 MiB by 4): per iteration, a barrier
then each of the three (old Ring, new Ring, MPI), rotating who goes first; time =
median over iterations of the slowest rank; about BUDGET seconds per row. Prints
MPI time / Ring time for old and new, i.e. busbw Ring/MPI (on a loaded machine the
only figure that means anything is a ratio taken side by side like this).
"""
import importlib.util, sys, time
import numpy as np
from mpi4py import MPI
spec = importlib.util.spec_from_file_location("ring_old", sys.argv[1] + "/ringzero/comm/ring.py")
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
from ringzero.comm.ring import Ring
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
        order = list(fns); T = {k: [] for k in fns}
        for it in range(iters):
            for k in order[it % 3:] + order[:it % 3]:
                comm.Barrier(); t = time.perf_counter(); fns[k](); T[k].append(time.perf_counter() - t)
        arr = np.array([T[k] for k in order]); comm.Allreduce(MPI.IN_PLACE, arr, op=MPI.MAX)
        med = {k: float(np.median(arr[i])) for i, k in enumerate(order)}
        if r == 0:
            print(f"{op:>14} {S:>9} iters={iters:>4} old={med['old']*1e6:10.1f}us new={med['new']*1e6:10.1f}us "
                  f"mpi={med['mpi']*1e6:10.1f}us  ratio old={med['mpi']/med['old']:.2f} new={med['mpi']/med['new']:.2f}", flush=True)
