"""An older Ring against this one and the MPI library, on the same buffers, in ONE run.

    git archive db3d859 ringzero/comm | tar -x -C /tmp/prev && mv /tmp/prev/ringzero /tmp/prev/ringzero_prev \
      && touch /tmp/prev/ringzero_prev/__init__.py \
      && sed -i 's/ringzero\\.comm/ringzero_prev.comm/g' /tmp/prev/ringzero_prev/comm/*.py \
      && cp ringzero/comm/_f16*.so /tmp/prev/ringzero_prev/comm/
    mpirun -n 4 python -m mpi4py benchmarks/ring_before_after.py /tmp/prev [--ops all_reduce] \
        [--sizes 256K,1M] [--allocs 3] [--budget 1.0]

(The older comm package is loaded whole as ``ringzero_prev``: its ring.py needs its own
plan.py. For a tree from before plan.py existed the same commands work.)

For each op and size S (float32; default 4 KiB to 64 MiB by 4) the three (old Ring, new
Ring, MPI) run on ONE set of buffers, timed in alternating blocks
(ringzero.tools.bench.time_blocks), and the cell is repeated on --allocs fresh sets of
buffers. The Rings share the buffers so that both see the same memory: where a
buffer lies can move a cell on its own (MPI's time per allocation is printed too).

Prints, per cell, MPI time / Ring time for old and new: the median over allocations of
the median over rounds of the ratio within each round (busbw Ring/MPI), with each
allocation's figure in brackets; then MPI's own time per call on each allocation.
"""
import argparse
import sys

import numpy as np
from mpi4py import MPI

from ringzero.app.exits import leave
from ringzero.tools.bench import OP_NAMES, mpi_call, paired_ratio, parse_size, ring_call, time_blocks

comm = MPI.COMM_WORLD
n, r = comm.size, comm.rank


class _Args(argparse.ArgumentParser):
    def error(self, message):   # one line from rank 0, exit 2 on every rank
        leave(comm, 2, f"ring_before_after: {message}")


ap = _Args(description=__doc__.splitlines()[0])
ap.add_argument("prev", help="folder that holds ringzero_prev/ (see the docstring)")
ap.add_argument("--ops", default=",".join(OP_NAMES), help="comma-separated, of " + ", ".join(OP_NAMES))
ap.add_argument("--sizes", default="4K,16K,64K,256K,1M,4M,16M,64M", help="comma-separated bytes, e.g. 256K,1M")
ap.add_argument("--allocs", type=int, default=3, help="fresh buffer sets per cell (default 3)")
ap.add_argument("--budget", type=float, default=1.0, help="about this many seconds per allocation")
args = ap.parse_args()
try:
    ops = args.ops.split(",")
    bad = [o for o in ops if o not in OP_NAMES]
    if bad:
        raise ValueError(f"unknown op {bad[0]!r}; ops are {', '.join(OP_NAMES)}")
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.allocs < 1 or args.budget <= 0 or min(sizes) < 4:
        raise ValueError("--allocs >= 1, --budget > 0 and sizes >= 4 bytes")
except (ValueError, argparse.ArgumentTypeError) as e:
    leave(comm, 2, f"ring_before_after: {e}")
sys.path.insert(0, args.prev)
try:
    import ringzero_prev.comm.ring as old
except ImportError as e:
    leave(comm, 2, f"ring_before_after: no older comm package under {args.prev} ({e}); see the docstring")
from ringzero.comm.ring import Ring  # noqa: E402

rings = {"old": old.Ring(comm), "new": Ring(comm)}
if r == 0:
    print(f"# n={n} float32, old/new/MPI on shared buffers, {args.allocs} allocations per cell; "
          "MPI time / Ring time (busbw Ring/MPI)", flush=True)


for op in ops:
    for S in sizes:
        cnt = max(n, S // 4) // n * n
        ratios, mpi_us = {"old": [], "new": []}, []
        for _ in range(args.allocs):
            if op == "all_reduce":
                a = b = np.zeros(cnt, np.float32)
            elif op == "reduce_scatter":
                a, b = np.zeros(cnt, np.float32), np.zeros(cnt // n, np.float32)
            else:
                a, b = np.zeros(cnt // n, np.float32), np.zeros(cnt, np.float32)
            fns = {k: ring_call(op, R, a, b) for k, R in rings.items()}
            fns["mpi"] = mpi_call(op, comm, a, b)
            for f in fns.values():
                f()                                    # the Rings build and keep their plans
            comm.Barrier()
            t0 = MPI.Wtime()
            for f in fns.values():
                f()
            probe = comm.allreduce(MPI.Wtime() - t0, op=MPI.MAX)
            T = time_blocks(comm, fns, int(max(15, min(400, args.budget / max(probe, 1e-9)))))
            for k in ratios:
                ratios[k].append(paired_ratio(T["mpi"], T[k]))
            mpi_us.append(float(np.median(T["mpi"])) * 1e6)
        if r == 0:
            print(f"{op:>14} {S:>9}  " + "  ".join(
                f"{k} {np.median(v):.2f} ({' '.join(f'{x:.2f}' for x in v)})" for k, v in ratios.items())
                + f"  mpi us ({' '.join(f'{x:.0f}' for x in mpi_us)})", flush=True)
for R in rings.values():
    if hasattr(R, "free"):   # older Rings may not have it
        R.free()
