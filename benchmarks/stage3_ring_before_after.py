"""Stage-3 engine step on an older Ring against this one, interleaved in one run.

    git archive 16b42e7 | (mkdir -p /tmp/ring_old && tar -x -C /tmp/ring_old)
    mpirun -n 4 python -m mpi4py benchmarks/stage3_ring_before_after.py /tmp/ring_old 20

Two engines with the same weights; engine A gets the old Ring, engine B the new one.
Steps alternate (rotating who goes first); each step's time is the slowest rank's, and the
time spent inside Ring calls on each rank (max over ranks) gives the communication share.
"""
import importlib.util, sys, time
import numpy as np
from mpi4py import MPI
from ringzero.app.data import Batches
from ringzero.nn.gpt import GPT, GPTConfig
from ringzero.runtime.zero import Zero
spec = importlib.util.spec_from_file_location("ring_old", sys.argv[1] + "/ringzero/comm/ring.py")
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
comm = MPI.COMM_WORLD
L, C, T, B, iters = 4, 256, 128, 8, int(sys.argv[2]) if len(sys.argv) > 2 else 20
data = np.random.default_rng(0).integers(0, 256, 1 << 20).astype(np.uint8)
batches = Batches(data, B, T, comm.rank, comm.size, 0)
engs = {}
for name in ("old", "new"):
    e = Zero(GPT(GPTConfig(L, 4, C, T, 256)), comm, "3", seed=1)
    if name == "old":
        e.ring.free(); e.ring = old.Ring(e.shard_comm)
    engs[name] = e
commt = {k: 0.0 for k in engs}
def wrap(name, ring):
    for m in ("all_reduce", "reduce_scatter", "all_gather"):
        f = getattr(ring, m)
        def g(*a, _f=f, **k):
            t = time.perf_counter(); r = _f(*a, **k); commt[name] += time.perf_counter() - t; return r
        setattr(ring, m, g)
for k, e in engs.items(): wrap(k, e.ring)
times = {k: [] for k in engs}; shares = {k: [] for k in engs}
order = list(engs)
losses = {}
for it in range(3 + iters):
    x, y = batches.get(it)
    for k in order[it % 2:] + order[:it % 2]:
        comm.Barrier(); commt[k] = 0.0
        t0 = time.perf_counter(); res = engs[k].step(x, y, 1e-4); dt = time.perf_counter() - t0
        dt, c = comm.allreduce(dt, op=MPI.MAX), comm.allreduce(commt[k], op=MPI.MAX)
        if it >= 3: times[k].append(dt); shares[k].append(c)
        losses.setdefault(k, []).append(res.loss)
assert losses["old"] == losses["new"], (losses["old"][:3], losses["new"][:3])  # same weights and batches: bitwise
if comm.rank == 0:
    mo, mn = np.median(times["old"]), np.median(times["new"])
    print(f"stage 3, GPT {L}L {C}C T={T} batch {B}/rank, n={comm.size}, {iters} steps each, interleaved; losses bitwise equal")
    for k in engs:
        print(f"  {k:>4} Ring: median step {np.median(times[k])*1e3:8.1f} ms, in Ring calls (slowest rank) "
              f"{np.median(shares[k])*1e3:8.1f} ms = {np.median(shares[k])/np.median(times[k]):.0%}")
    print(f"  new/old step time: {mn/mo:.3f}")
