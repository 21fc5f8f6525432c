"""The offloaded step beside what bounds it: compute, and the offload I/O at the disk's measured rate.

    mpirun -n 8 python -m mpi4py benchmarks/bench_offload.py --model gpt2-large --stage 3 \\
        --offload optimizer --offload-dir /tmp/rz-offload --steps 3
    mpirun -n 2 python -m mpi4py benchmarks/bench_offload.py --n-layer 2 --n-embd 64 --offload-dir /tmp/x

First every rank writes, then reads back, a file of ``--probe`` bytes in DIR at
the same time (pwrite + fdatasync; then posix_fadvise DONTNEED and pread, so the
reads come from the disk), which gives the node's write and read rate with all
its ranks at it, as the step has them. Then an engine with ``--offload`` trains
``--steps`` steps (after one warm-up) on random tokens, and rank 0 prints, per
step, the medians over steps of the slowest rank's:

    step       the wall time of engine.step
    compute    forward + backward (less its waits for collectives) + the update's arithmetic
    I/O        the bytes the node's ranks read and wrote in a step (the files' counters) at the
               measured rates: what the disk alone would need
    exposed    the update's waits for reads and writes (stream.py)

(--ahead: the update runs beside the next forward, and a step's compute and
exposed I/O include the previous update's.)

and step / max(compute, I/O): 1 is a step bound by the slower of the two, with
the other hidden behind it.

What it is not: a test (the bitwise checks are tests/test_offload.py).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from mpi4py import MPI

from ringzero.app.exits import leave


def probe(path: str, nbytes: int, comm) -> tuple:
    """(write, read) bytes/s of the node: every rank writes then reads nbytes at once."""
    buf = np.random.default_rng(comm.rank).integers(0, 255, min(nbytes, 64 << 20), dtype=np.uint8)
    fd = os.open(path, os.O_TMPFILE | os.O_RDWR, 0o600)
    try:
        comm.Barrier()
        t0 = time.perf_counter()
        for off in range(0, nbytes, buf.size):
            os.pwrite(fd, buf[:min(buf.size, nbytes - off)], off)
        os.fdatasync(fd)
        comm.Barrier()
        tw = time.perf_counter() - t0
        os.posix_fadvise(fd, 0, nbytes, os.POSIX_FADV_DONTNEED)
        comm.Barrier()
        t0 = time.perf_counter()
        for off in range(0, nbytes, buf.size):
            os.preadv(fd, [buf[:min(buf.size, nbytes - off)]], off)
        comm.Barrier()
        tr = time.perf_counter() - t0
    finally:
        os.close(fd)
    total = nbytes * comm.size
    return total / tw, total / tr


def main() -> int:
    comm = MPI.COMM_WORLD
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="", help="a GPT-2 preset (gpt2 ... gpt2-xl); else the dims below")
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--stage", default="3")
    # bf16 by default: fp16's loss scaler skips the first steps (overflow at 2**16), and a skipped
    # step runs no update, so it would time no offload I/O at all
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--offload", default="optimizer")
    ap.add_argument("--offload-dir", required=True)
    ap.add_argument("--ahead", action="store_true", help="the update beside the next forward (stage 3, hybrid)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--probe", default="256M", help="bytes each rank writes and reads to measure the disk")
    a = ap.parse_args()
    from ringzero.nn.gpt import GPT, model_config
    from ringzero.runtime.offload import OffloadError, OffloadPolicy
    from ringzero.runtime.zero import Zero
    from ringzero.sizes import parse_size
    dims = {} if a.model else dict(n_layer=a.n_layer, n_embd=a.n_embd, n_head=a.n_head)
    cfg = model_config(a.model or None, 256, block_size=None if a.model else a.seq_len, **dims)
    try:
        wr, rd = probe(a.offload_dir, parse_size(a.probe), comm)
        eng = Zero(GPT(cfg), comm, a.stage, precision=a.precision, seed=1,
                   offload=OffloadPolicy.parse(a.offload, a.offload_dir, ahead=a.ahead))
    except (OSError, OffloadError) as e:
        return leave(comm, 2, f"bench_offload: {e}")
    say = print if comm.rank == 0 else (lambda *x, **k: None)
    say(f"disk in {a.offload_dir}: {comm.size} ranks at once write {wr / 1e9:.2f} GB/s, read {rd / 1e9:.2f} GB/s; "
        f"Ψ = {eng.layout.numel:,}, stage {eng.stage}, offload {eng.offload.describe()}, Nd = {comm.size}")
    rng = np.random.default_rng(comm.rank)
    rows = []
    for s in range(a.steps + 1):
        x = rng.integers(0, 256, (a.batch, a.seq_len))
        y = rng.integers(0, 256, (a.batch, a.seq_len))
        comm.Barrier()
        t0 = time.perf_counter()
        res = eng.step(x, y, 1e-4)
        dt = time.perf_counter() - t0
        if res.skipped:
            say(f"step {s}: skipped by the loss scaler (no update, no offload I/O)")
        tl, io = eng.timeline, eng.io_report()
        nbytes = comm.allreduce(io["read_bytes_per_step"]), comm.allreduce(io["write_bytes_per_step"])
        mine = np.array([dt, tl["compute_s"] + tl.get("offload_compute_s", 0.0), tl.get("offload_exposed_s", 0.0)])
        worst = np.empty_like(mine)
        comm.Allreduce(mine, worst, op=MPI.MAX)
        if s:                                   # the first step warms up
            rows.append((*worst, nbytes[0] / rd + nbytes[1] / wr))
    step, compute, exposed, io_s = (float(np.median([r[i] for r in rows])) for i in range(4))
    say(f"per step (median of {a.steps}, slowest rank): step {step:.3f} s   compute {compute:.3f} s   "
        f"I/O at the measured rate {io_s:.3f} s   exposed I/O {exposed:.3f} s")
    say(f"step / max(compute, I/O) = {step / max(compute, io_s):.2f}")
    eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
