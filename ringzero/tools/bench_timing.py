"""How the bench times: alternating blocks, a ratio taken within each round, and copy references.

What it is
    ``time_blocks(comm, fns, calls)`` times several implementations of one
    call in alternating blocks (each led in by one untimed call between
    barriers) and returns, per implementation, the slowest rank's time per
    call in each round; ``paired_ratio`` is the median over rounds of the
    ratio within each round (docs/collectives.md, "How the bench times").
    ``copy_refs`` measures device->device and pinned host<->device copies on
    one GPU, the physical references of ``--device cuda``.

What it is not
    No buffers and no checks (bench_cases.py), no table (bench.py).
"""
from __future__ import annotations

import time

import numpy as np


def time_blocks(comm, fns: dict, calls: int, sync=None, rounds: int | None = None):
    """Per-call time of each fns[name]() in seconds: {name: array over rounds}, the slowest rank's.

    `calls` timed calls per implementation, in `rounds` rounds (default: up
    to 10, blocks of at least 2 calls); in each round every implementation
    runs one block, the first one rotating, so entry i of every array comes
    from the same stretch of time (``paired_ratio``). A block: Barrier, one untimed lead-in call (it absorbs what the
    previous block left in flight), Barrier, then the loop, timed on each rank
    without a closing barrier. `sync()` (a device stream) ends each call.
    """
    from mpi4py import MPI
    names = list(fns)
    rounds = max(1, min(10, calls // 2)) if rounds is None else max(1, min(rounds, calls))
    block = max(1, calls // rounds)
    times = np.zeros((len(names), rounds))
    for i in range(rounds):
        order = names[i % len(names):] + names[:i % len(names)]
        for name in order:
            fn = fns[name]
            comm.Barrier()
            fn()
            if sync is not None:
                sync()
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(block):
                fn()
                if sync is not None:
                    sync()
            times[names.index(name), i] = (time.perf_counter() - t0) / block
    comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
    return {name: times[k] for k, name in enumerate(names)}


def paired_ratio(t_num, t_den) -> float:
    """Median over rounds of t_num[i] / t_den[i]: a ratio taken within each round.

    This machine's speed drifts by 2-5x over seconds; a ratio of medians taken
    over different stretches mixes those modes, a median of paired ratios
    does not.
    """
    return float(np.median(np.asarray(t_num) / np.asarray(t_den)))


def copy_refs(xp, sizes, iters=20) -> list:
    """Physical references on one GPU: device->device memcpy, pinned host<->device copies (GB/s).

    Rows like the bench's, impl "memcpy_d2d" | "memcpy_h2d_pinned" | "memcpy_d2h_pinned".
    """
    from ringzero.comm.backend import Staging
    rt, st = xp.cuda.runtime, Staging()
    rows = []
    for S in sizes:
        src, dst = xp.zeros(S, xp.uint8), xp.zeros(S, xp.uint8)
        host = st.host("h", S)
        hp = host.ctypes.data
        kinds = {"memcpy_d2d": (dst.data.ptr, src.data.ptr, rt.memcpyDeviceToDevice),
                 "memcpy_h2d_pinned": (dst.data.ptr, hp, rt.memcpyHostToDevice),
                 "memcpy_d2h_pinned": (hp, src.data.ptr, rt.memcpyDeviceToHost)}
        for name, (d, s_, kind) in kinds.items():
            ts = []
            for _ in range(iters + 2):
                rt.deviceSynchronize()
                t0 = time.perf_counter()
                rt.memcpy(d, s_, S, kind)
                rt.deviceSynchronize()
                ts.append(time.perf_counter() - t0)
            t = float(np.median(ts[2:]))
            rows.append(dict(op="copy", impl=name, n=1, bytes=S, count=S, dtype="uint8", redop="",
                             time_us=round(t * 1e6, 2), algbw_GBps=round(S / t / 1e9, 4),
                             busbw_GBps=round(S / t / 1e9, 4), wrong=0))
    return rows
