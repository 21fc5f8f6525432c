"""Stage-3 engine step on an older Ring against this one, interleaved in one run.

    git archive db3d859 ringzero/comm | tar -x -C /tmp/prev && mv /tmp/prev/ringzero /tmp/prev/ringzero_prev \
      && touch /tmp/prev/ringzero_prev/__init__.py \
      && sed -i 's/ringzero\\.comm/ringzero_prev.comm/g' /tmp/prev/ringzero_prev/comm/*.py \
      && cp ringzero/comm/_f16*.so /tmp/prev/ringzero_prev/comm/
    mpirun -n 4 python -m mpi4py benchmarks/stage3_ring_before_after.py /tmp/prev 20

The older comm package is loaded whole as ``ringzero_prev`` (its ring.py needs its own
plan.py). Two engines with the same weights; engine A gets the old Ring, engine B the new one.
Steps alternate (rotating who goes first); each step's time is the slowest rank's, and the
time spent inside Ring calls on each rank (max over ranks) gives the communication share.
"""
import sys
import time

import numpy as np
from mpi4py import MPI

from ringzero.app.data import Batches
from ringzero.nn.gpt import GPT, GPTConfig
from ringzero.runtime.zero import Zero

sys.path.insert(0, sys.argv[1])
import ringzero_prev.comm.ring as old

comm = MPI.COMM_WORLD
L, C, T, B, iters = 4, 256, 128, 8, int(sys.argv[2]) if len(sys.argv) > 2 else 20
data = np.random.default_rng(0).integers(0, 256, 1 << 20).astype(np.uint8)
batches = Batches(data, B, T, comm.rank, comm.size, 0)
engs = {}
for name in ("old", "new"):
    e = Zero(GPT(GPTConfig(L, 4, C, T, 256)), comm, "3", seed=1)
    if name == "old":
        mine = e.topology.ring   # the engine and its workspace reach the ring through the topology
        e.topology.ring = e.ring = old.Ring(mine.comm)
        mine.free()
    engs[name] = e
commt = {k: 0.0 for k in engs}


def wrap(name, ring):
    """Time every Ring call of engine ``name`` into commt[name]."""
    for m in ("all_reduce", "reduce_scatter", "all_gather"):
        f = getattr(ring, m)

        def g(*a, _f=f, **k):
            t = time.perf_counter()
            r = _f(*a, **k)
            commt[name] += time.perf_counter() - t
            return r
        setattr(ring, m, g)


for k, e in engs.items():
    wrap(k, e.ring)
times = {k: [] for k in engs}
shares = {k: [] for k in engs}
order = list(engs)
losses = {}
for it in range(3 + iters):
    x, y = batches.get(it)
    for k in order[it % 2:] + order[:it % 2]:
        comm.Barrier()
        commt[k] = 0.0
        t0 = time.perf_counter()
        res = engs[k].step(x, y, 1e-4)
        dt = time.perf_counter() - t0
        dt, c = comm.allreduce(dt, op=MPI.MAX), comm.allreduce(commt[k], op=MPI.MAX)
        if it >= 3:            # the first 3 steps are warm-up
            times[k].append(dt)
            shares[k].append(c)
        losses.setdefault(k, []).append(res.loss)
# same weights and batches: equal when both Rings sum in the same order, else within rounding
dloss = max(abs(a - b) for a, b in zip(losses["old"], losses["new"]))
if comm.rank == 0:
    mo, mn = np.median(times["old"]), np.median(times["new"])
    print(f"stage 3, GPT {L}L {C}C T={T} batch {B}/rank, n={comm.size}, {iters} steps each, interleaved; "
          f"largest loss difference {dloss:.3g}")
    for k in engs:
        print(f"  {k:>4} Ring: median step {np.median(times[k])*1e3:8.1f} ms, in Ring calls (slowest rank) "
              f"{np.median(shares[k])*1e3:8.1f} ms = {np.median(shares[k])/np.median(times[k]):.0%}")
    print(f"  new/old step time: {mn/mo:.3f}")
