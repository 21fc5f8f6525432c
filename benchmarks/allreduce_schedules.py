"""The all-reduce schedules of a power-of-two n side by side with the MPI library's, in ONE run.

    OMP_NUM_THREADS=1 mpirun --oversubscribe --bind-to none -n 4 \
        python -m mpi4py benchmarks/allreduce_schedules.py [SIZE ...]      # default 64K 256K 1M 4M 16M

For each size S (float32), timed in alternating blocks (ringzero.tools.bench.time_blocks):
  rd      recursive doubling over the whole buffer (log2 n rounds, S log2 n bytes);
  rab     Rabenseifner: recursive halving in place, then recursive doubling;
  direct  the direct reduce-scatter then the direct all-gather (one round each), as two
          Ring calls on the same buffer: a 2^k all-reduce never takes direct by itself,
          and this is what it would cost;
and MPI's Allreduce in place. Prints MPI time / schedule time, the median of the ratios
within each round (>= 1: the schedule is faster). The three give the same bits (they add
in the halving tree's order). This is how schedule.SMALL_BYTES was placed and why a
2^k all-reduce takes rab rather than direct; this machine's speed changes between
launches, so run it several times and read the ratios, not the times.
"""
import sys
from argparse import ArgumentTypeError

import numpy as np
from mpi4py import MPI

from ringzero.app.exits import leave
from ringzero.comm.ring import Ring
from ringzero.tools.bench import paired_ratio, parse_size, time_blocks

comm = MPI.COMM_WORLD
n, r = comm.size, comm.rank
if n & (n - 1) or n < 4:   # every rank sees it: one line from rank 0, MPI left cleanly (no abort)
    leave(comm, 2, f"allreduce_schedules: needs a power-of-two n >= 4, got {n}")
try:
    sizes = [parse_size(x) for x in sys.argv[1:] or ("64K", "256K", "1M", "4M", "16M")]
except (ValueError, ArgumentTypeError) as e:
    leave(comm, 2, f"allreduce_schedules: {e}")
rd, rab, direct = Ring(comm), Ring(comm), Ring(comm)
rd.small_bytes = 1 << 62                              # recursive doubling at every size
rab.small_bytes = 0                                   # Rabenseifner
direct.small_bytes, direct.latency_bytes = 0, 0       # direct RS and AG from the first byte
cells = []
for S in sizes:
    m = max(1, S // 4 // n)
    a = np.zeros(n * m, np.float32)                   # zeros: the sums stay exact and finite
    own = a[r * m:(r + 1) * m]
    fns = {"mpi": lambda: comm.Allreduce(MPI.IN_PLACE, a, MPI.SUM),
           "recursive_doubling": lambda: rd.all_reduce(a), "rabenseifner": lambda: rab.all_reduce(a),
           "direct": lambda: (direct.reduce_scatter(a, own), direct.all_gather(own, a))}
    for f in fns.values():
        f()
    t = time_blocks(comm, fns, 40)
    cells.append(f"{S >> 10}K " + " ".join(f"{k}={paired_ratio(t['mpi'], t[k]):.2f}"
                                           for k in ("recursive_doubling", "rabenseifner", "direct")))
if r == 0:
    print(f"n={n} MPI time / schedule time: " + " | ".join(cells), flush=True)
for ring in (rd, rab, direct):
    ring.free()
