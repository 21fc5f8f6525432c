"""The offloaded step beside what bounds it: compute, and the offload I/O at the disk's measured rate.

    mpirun -n 8 python -m mpi4py benchmarks/bench_offload.py --model gpt2-large --stage 3 \\
        --offload optimizer --offload-dir /tmp/rz-offload --steps 3 --compare-ram
    mpirun -n 2 python -m mpi4py benchmarks/bench_offload.py --n-layer 2 --n-embd 64 --offload-dir /tmp/x

First every rank writes, then reads back, a file of ``--probe`` bytes in DIR at
the same time, like for like with the update's I/O engine (aio.py): requests of a
tile (1 MiB), ``--threads`` of them in flight per rank, O_DIRECT where the filesystem
takes it, into blocks reserved first, and no fdatasync, as the engine issues none
(where O_DIRECT is refused, the page cache, with fdatasync after the writes and the
pages dropped before the reads, so that the disk is timed and not the cache). That
gives the node's write and read rate with all its ranks at it, as the step has them. A third
pass reads and writes at once (half the requests each, alternating), as the update does: that
is the disk's mix, the ceiling of an update that reads one tile while it writes another. Then an
engine with ``--offload`` trains
``--steps`` steps (after one warm-up) on random tokens, and rank 0 prints the
median step (by the slowest rank's time) split into parts that add up to it,
each measured on that rank in that step:

    compute              forward + backward, less its waits for collectives
    collectives exposed  the waits for reductions and gathers, and the step's scalar all-gather
    update arithmetic    the fused AdamW on the tiles (stream.py's compute)
    I/O waited           the update's waits for the disk: a tile's read, a slot whose write had not
                         returned (the writes hold the update there), the last writes
    update ahead waited  --ahead: the wait for the previous step's update (which ran beside
                         the forward: its arithmetic and I/O are not on this thread)
    rest                 the step less the above (casts, the ledgers, Python)

then beside it the offload I/O at the measured rates (the bytes the node's ranks
read and wrote in a step, the files' counters, at the probe's rates: what the disk
alone would need), the I/O engine's achieved rates (aio.py: the bytes the node's ranks'
update streams moved, over the slowest rank's seconds with a tile's requests in flight, for
reads and for writes, and both together over the slowest rank's update) beside the probe's,
and step / max(compute + arithmetic, I/O): 1 is a step bound by the slower of the two, with
the other hidden behind it. ``--compare-ram`` then
runs the same steps on the same tokens with every class in RAM and prints offloaded / in RAM.

What it is not: a test (the bitwise checks are tests/test_offload.py).
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import numpy as np
from mpi4py import MPI

from ringzero.app.exits import leave


def probe(path: str, nbytes: int, comm, threads: int = 8, request: int = 1 << 20) -> tuple:
    """(write, read, both) bytes/s of the node, and the path ("O_DIRECT" or "page cache"): every rank writes
    then reads nbytes at once, then does both at once (half its requests reading the first half of
    the file, half writing the second: the update's mix, whose reads and writes share the disk), as the
    update's I/O engine moves its tiles (aio.py): page-aligned requests of
    ``request`` bytes (a tile of one fp32 class), ``threads`` of them in flight per rank, O_DIRECT where
    the filesystem takes it, into blocks reserved first (posix_fallocate, as offload.FileStore does), and
    no fdatasync, as the engine issues none. Where O_DIRECT is refused the engine goes through the page
    cache; the probe then ends its writes with fdatasync and drops the pages before reading, so that it
    still times the disk, not the cache."""
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from ringzero.runtime.aio import PAGE, AlignedBuffer, IOEngine
    request = -(-request // PAGE) * PAGE
    nbytes = max(2 * request, nbytes // request * request)          # whole requests, two at least (the mix)
    fd = os.open(path, os.O_TMPFILE | os.O_RDWR, 0o600)
    bufs = [AlignedBuffer(request) for _ in range(threads)]
    for b in bufs:
        b.raw[:] = np.random.default_rng(comm.rank).integers(0, 255, b.raw.size, dtype=np.uint8)
    pool, dfd = ThreadPoolExecutor(threads), None
    try:
        os.posix_fallocate(fd, 0, nbytes)
        dfd = IOEngine._open_direct(SimpleNamespace(fd=fd))          # the engine's own probe of O_DIRECT
        io, mode = (fd, "page cache") if dfd is None else (dfd, "O_DIRECT")

        def each(fn):
            offs = range(0, nbytes, request)
            list(pool.map(lambda k: fn(io, [memoryview(bufs[k % threads].raw)[:request]], offs[k]),
                          range(len(offs))))

        def both(k):          # request k of the mix: reads and writes alternate, so both are in flight
            fn, base = (os.preadv, 0) if k % 2 == 0 else (os.pwritev, half)
            return fn(io, [memoryview(bufs[k % threads].raw)[:request]], base + k // 2 * request)
        comm.Barrier()
        t0 = time.perf_counter()
        each(os.pwritev)
        if dfd is None:
            os.fdatasync(fd)
        comm.Barrier()
        tw = time.perf_counter() - t0
        os.posix_fadvise(fd, 0, nbytes, os.POSIX_FADV_DONTNEED)
        comm.Barrier()
        t0 = time.perf_counter()
        each(os.preadv)
        comm.Barrier()
        tr = time.perf_counter() - t0
        half = nbytes // request // 2 * request
        os.posix_fadvise(fd, 0, nbytes, os.POSIX_FADV_DONTNEED)
        comm.Barrier()
        t0 = time.perf_counter()
        list(pool.map(both, range(2 * (half // request))))
        if dfd is None:
            os.fdatasync(fd)
        comm.Barrier()
        tb = time.perf_counter() - t0
    finally:
        pool.shutdown()
        if dfd is not None:
            os.close(dfd)
        os.close(fd)
    total = nbytes * comm.size
    return total / tw, total / tr, 2 * half * comm.size / tb, mode


PARTS = ("compute", "collectives exposed", "update arithmetic", "I/O waited", "update ahead waited")


def split(step: float, tl: dict, ahead: bool) -> dict:
    """One rank's step of ``step`` seconds in parts that add up to it (engine.timeline's seconds; the
    module docstring); "rest" is what is left, never below 0 unless a part were counted twice."""
    g = tl.get
    out = {"step": step, "compute": g("compute_s", 0.0),
           "collectives exposed": g("reduce_exposed_s", 0.0) + g("gather_exposed_s", 0.0)
           + g("param_gather_exposed_s", 0.0) + g("scalars_s", 0.0),
           # --ahead: the update's own seconds ran on its thread, beside the forward
           "update arithmetic": 0.0 if ahead else g("offload_compute_s", 0.0),
           "I/O waited": 0.0 if ahead else g("offload_exposed_s", 0.0),
           "update ahead waited": g("update_wait_s", 0.0),
           "reads": g("offload_read_wait_s", 0.0), "write slots": g("offload_slot_wait_s", 0.0),
           "last writes": g("offload_drain_s", 0.0)}
    out["rest"] = step - sum(out[k] for k in PARTS)
    return out


def line(r: dict) -> str:
    """``step 1.000 s = compute ... + rest ...``: the split as printed (and parsed by the smoke test)."""
    io = (f" (reads {r['reads']:.3f} + write slots {r['write slots']:.3f} + last writes {r['last writes']:.3f})"
          if r["I/O waited"] else "")
    parts = " + ".join(f"{k} {r[k]:.3f}" + (io if k == "I/O waited" else "") for k in (*PARTS, "rest"))
    return f"step {r['step']:.3f} s = {parts}"


def steps(eng, a, comm, say) -> list:
    """``a.steps`` timed steps after a warm-up, on the same random tokens whatever the engine: per step
    (the slowest rank's split, the offload I/O at the probe's rates, the I/O engine's (read, write)
    bytes/s or None)."""
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
        every = comm.allgather(split(dt, eng.timeline, a.ahead))
        if eng.offload_stream is None:
            if s:
                rows.append((max(every, key=lambda r: r["step"]), 0.0, None))
            continue
        io = eng.io_report()
        nbytes = comm.allreduce(io["read_bytes_per_step"]), comm.allreduce(io["write_bytes_per_step"])
        tl = eng.timeline
        moved = comm.allreduce(tl.get("offload_read_bytes", 0.0)), comm.allreduce(tl.get("offload_write_bytes", 0.0))
        busy = comm.allreduce(tl.get("offload_read_s", 0.0), MPI.MAX), comm.allreduce(tl.get("offload_write_s", 0.0),
                                                                                      MPI.MAX)
        upd = comm.allreduce(tl.get("offload_compute_s", 0.0) + tl.get("offload_exposed_s", 0.0), MPI.MAX)
        rates = (moved[0] / busy[0], moved[1] / busy[1], sum(moved) / upd) if min(busy) > 0 and upd > 0 else None
        if s:                                   # the first step warms up
            rows.append((max(every, key=lambda r: r["step"]), nbytes[0] / a.disk[0] + nbytes[1] / a.disk[1], rates))
    return rows


def trim_heap():
    """glibc's malloc_trim(0): return the heap's free pages to the kernel (no-op where libc has none)."""
    import ctypes
    import ctypes.util
    try:
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def refusal(a, model, comm, offload: bool) -> str | None:
    """The trainer's start-up memory check (app/memcheck.py) for this engine: its one-line refusal, or None.
    Collective. Each engine is checked before it allocates, as ``python -m ringzero.train`` checks."""
    from ringzero.app import memcheck
    from ringzero.app.config import Config, ConfigError
    cfg = Config(stage=a.stage, precision=a.precision, batch=a.batch, seq_len=a.seq_len, sample_chars=0,
                 offload=a.offload if offload else "", offload_dir=a.offload_dir if offload else "",
                 offload_depth=a.depth, offload_threads=a.threads)
    try:
        memcheck.check(cfg, model, comm)
    except ConfigError as e:
        return str(e)
    return None


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
    ap.add_argument("--offload-dir", required=True, help="the offload files' folder (made if missing, as the trainer)")
    ap.add_argument("--ahead", action="store_true", help="the update beside the next forward (stage 3, hybrid)")
    ap.add_argument("--depth", type=int, default=2, help="tiles read ahead (the trainer's --offload-depth)")
    ap.add_argument("--threads", type=int, default=8, help="I/O requests in flight per rank (--offload-threads)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--compare-ram", action="store_true",
                    help="then the same steps with every class in RAM, and offloaded / in RAM (one command)")
    ap.add_argument("--probe", default="256M", help="bytes each rank writes and reads to measure the disk")
    a = ap.parse_args()
    from ringzero.nn.gpt import GPT, model_config
    from ringzero.runtime.offload import OffloadError, OffloadPolicy, make_dir
    from ringzero.runtime.zero import Zero
    from ringzero.sizes import parse_size
    dims = {} if a.model else dict(n_layer=a.n_layer, n_embd=a.n_embd, n_head=a.n_head)
    cfg = model_config(a.model or None, 256, block_size=None if a.model else a.seq_len, **dims)
    try:
        make_dir(a.offload_dir)        # mkdir -p, as the trainer (and DeepSpeed its swap folder) does
        wr, rd, mix, how = probe(a.offload_dir, parse_size(a.probe), comm, a.threads, OffloadPolicy().tile * 4)
        a.disk = rd, wr, mix
        model = GPT(cfg)
        why = refusal(a, model, comm, offload=True)
        if why:
            return leave(comm, 2, f"bench_offload: {why}")
        eng = Zero(model, comm, a.stage, precision=a.precision, seed=1,
                   offload=OffloadPolicy.parse(a.offload, a.offload_dir, ahead=a.ahead, buffers=a.depth + 2,
                                               io_threads=a.threads))
    except (OSError, OffloadError) as e:
        return leave(comm, 2, f"bench_offload: {e}")
    say = print if comm.rank == 0 else (lambda *x, **k: None)
    say(f"disk in {a.offload_dir}: {comm.size} ranks at once write {wr / 1e9:.2f} GB/s, read {rd / 1e9:.2f} GB/s, "
        f"both at once {mix / 1e9:.2f} GB/s "
        f"({how}, {a.threads} requests of a tile in flight per rank, as the engine); "
        f"Ψ = {eng.layout.numel:,}, stage {eng.stage}, offload {eng.offload.describe()}, Nd = {comm.size}; "
        f"I/O engine: {eng.offload_stream.io.mode}, {eng.offload_stream.depth} tiles read ahead, "
        f"{eng.offload.io_threads} requests in flight per rank")
    rows = steps(eng, a, comm, say)
    row, io_s, rates = sorted(rows, key=lambda r: r[0]["step"])[(len(rows) - 1) // 2]     # the median step
    say(f"per step (the median of {a.steps} by the slowest rank's time; that rank's split, which adds up to it):")
    say("  " + line(row))
    work = row["compute"] + row["update arithmetic"]
    say(f"  offload I/O at the measured rate {io_s:.3f} s (the node's bytes at the probe's rates)")
    if rates:
        say(f"  I/O engine achieved: read {rates[0] / 1e9:.2f} GB/s ({rates[0] / rd:.0%} of the disk's), write "
            f"{rates[1] / 1e9:.2f} GB/s ({rates[1] / wr:.0%}) (the node's bytes over the slowest rank's busy seconds); "
            f"both {rates[2] / 1e9:.2f} GB/s ({rates[2] / mix:.0%} of the disk's mix) (read + written over the "
            f"slowest rank's update, its arithmetic included)")
    say(f"step / max(compute + arithmetic, I/O) = {row['step'] / max(work, io_s):.2f}")
    eng.close()
    del eng, model             # its RAM classes (the model's units hold views of them) go before the in-RAM
    gc.collect()               # engine allocates, and the heap's freed pages back to the kernel: glibc keeps
    trim_heap()                # them (~150 MB a rank at gpt2-large's shapes), and the memory check counts them
    comm.Barrier()             # every rank's freed before any reads MemAvailable
    if a.compare_ram:          # the same shapes, steps and tokens with every class in RAM, in this command
        model = GPT(cfg)
        why = refusal(a, model, comm, offload=False)
        if why:
            return leave(comm, 2, f"bench_offload: --compare-ram: {why}")
        ram = Zero(model, comm, a.stage, precision=a.precision, seed=1)
        ram_row = sorted(steps(ram, a, comm, say), key=lambda r: r[0]["step"])[(len(rows) - 1) // 2][0]
        say(f"in RAM: step {ram_row['step']:.3f} s (the median of {a.steps}); offloaded / in RAM = "
            f"{row['step'] / ram_row['step']:.2f}")
        say("  in RAM, " + line(ram_row))     # its split: what the offloaded step added, part by part
        ram.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
