"""``python -m ringzero.bench``: the collectives sweep, in the style of nccl-tests.

What it is
    For each size S (the whole array, bytes) from -b to -e by factor -f, and
    each op, it times the hand-written Ring and the MPI library's own
    collective (Allreduce / Reduce_scatter_block / Allgather) on the same
    buffers, in alternating blocks (``time_blocks``): each block is a barrier,
    one untimed lead-in call, a barrier, then back-to-back calls of ONE
    implementation timed as a loop, as nccl-tests and the OSU benchmarks do.
    A time is the median over blocks of the slowest rank's loop time per
    call; the ratio column is the median over rounds of the ratio within each
    round (``paired_ratio``). Alternating blocks lets noise hit both alike; timing each call
    right after the other implementation's would not be fair: with ranks
    sharing cores, a call that follows Open MPI's collective pays for work
    that collective left behind (docs/collectives.md, "How the bench
    times"). As in nccl-tests,

        algbw = S / time
        busbw = algbw * 2(n-1)/n   all_reduce
        busbw = algbw *  (n-1)/n   reduce_scatter, all_gather

    With -c 1 each op first runs once on integer-valued data, whose sums are
    exact in any order, and #wrong counts wrong elements over all ranks.
    Only rank 0 prints. ``--json FILE`` writes {"rows": [...], "meta": {...}};
    each row is {"op", "impl" ("ring"|"mpi"), "n", "bytes", "count", "dtype",
    "redop", "time_us", "algbw_GBps", "busbw_GBps", "wrong"}, and the ring row
    also "busbw_ratio" (the printed ratio column).

    --device cuda: when MPI is not CUDA-aware both sides stage (device ->
    pinned host, collective, host -> device), so the ratio compares like with
    like; after the sweep, rank 0 alone measures device->device memcpy and
    pinned host<->device copies (rows with op "copy") as physical references.

    Three more words, in ringzero.tools.bench_extra: ``sched`` times every
    Ring schedule against each other (how the thresholds were placed),
    ``dtypes`` times one op on the same element count in several dtypes,
    interleaved (float16 against float32), and ``median`` reads the --json
    files of several launches and prints the median ratio per cell.

What it is not
    A model benchmark: main() dispatches on a first word so one can be added
    (``python -m ringzero.bench coll ...`` is the same as no word).

    mpirun -n 4 python -m mpi4py -m ringzero.bench -b 4K -e 64M -f 4 -c 1 --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from ringzero.comm.schedule import KNOBS  # (no MPI in it)
# sched, dtypes and median live in their own module (the Ring timed against itself)
from ringzero.tools.bench_extra import (dtypes_parser, median_parser, run_dtypes, run_median, run_sched,
                                        sched_parser)

OP_NAMES = ("all_reduce", "reduce_scatter", "all_gather")


def parse_size(s: str) -> int:
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    s = s.strip().upper().rstrip("B")
    num, unit = (s[:-1], s[-1]) if s and s[-1] in units else (s, "")
    try:
        return int(float(num) * units[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size like 4096, 4K, 64M or 1G, got {s!r}") from None


def human(nbytes: int) -> str:
    for unit, f in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= f and nbytes % f == 0:
            return f"{nbytes // f}{unit}"
    return str(nbytes)


def coll_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ringzero.bench [coll]", description=__doc__.split("\n\n")[0])
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("4K"), help="smallest S (bytes)")
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64M"), help="largest S (bytes)")
    p.add_argument("-f", "--stepfactor", type=int, default=4, help="multiply S by this each row")
    p.add_argument("-n", "--iters", type=int, default=20, help="timed iterations per impl")
    p.add_argument("-w", "--warmup_iters", type=int, default=3, help="untimed iterations per impl")
    p.add_argument("-c", "--check", type=int, default=1, help="1: count wrong elements first")
    p.add_argument("-o", "--op", default="all", choices=OP_NAMES + ("all",))
    p.add_argument("-d", "--dtype", default="float32", help="float16|float32|float64|int32|int64|bfloat16")
    p.add_argument("--redop", default="sum", choices=("sum",), help="the check needs exact sums")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--no-mpi", action="store_true", help="time the ring only")
    p.add_argument("--max-seconds", type=float, default=20.0,
                   help="cut the iterations of a row so that it takes about this long")
    p.add_argument("--small-bytes", type=int, default=None, help="Ring.small_bytes for this run")
    p.add_argument("--seg-bytes", type=int, default=None, help="Ring.seg_bytes for this run")
    p.add_argument("--json", default=None, help="write the rows here")
    return p


def _dtype(name):
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _fill(xp, out, rank, seed):
    """Integer-valued data in [-6, 6], reproducible on any rank from (rank, seed)."""
    i = np.arange(len(out), dtype=np.int64)
    host = ((i * 7 + rank * 5 + seed) % 13 - 6).astype(out.dtype)
    out[...] = xp.asarray(host) if xp is not np else host


def _expect(n, count, dtype, seed):
    """Sum over ranks of _fill's data, in int64 (exact), for the check."""
    i = np.arange(count, dtype=np.int64)
    return sum((i * 7 + r * 5 + seed) % 13 - 6 for r in range(n))


def ring_call(op, ring, a, b):
    """fn() running `op` of `ring` on (a, b) as the bench lays them out: all_reduce in
    place on a (b is a), reduce_scatter a -> b, all_gather a -> b."""
    return {"all_reduce": lambda: ring.all_reduce(a), "reduce_scatter": lambda: ring.reduce_scatter(a, b),
            "all_gather": lambda: ring.all_gather(a, b)}[op]


def mpi_call(op, comm, a, b):
    """fn() running the MPI library's collective for `op` on the same layout as ring_call."""
    from mpi4py import MPI
    return {"all_reduce": lambda: comm.Allreduce(MPI.IN_PLACE, b, MPI.SUM),
            "reduce_scatter": lambda: comm.Reduce_scatter_block(a, b, MPI.SUM),
            "all_gather": lambda: comm.Allgather(a, b)}[op]


class _Case:
    """Buffers for one op and size, and closures that run the ring / MPI on them.

    Like with like: both sides start and end with their data in ``a``/``b``
    (device arrays for --device cuda). When MPI is not CUDA-aware (staged),
    the MPI side pays what the Ring pays: device->pinned host copy, the MPI
    collective on the pinned buffers, host->device copy.
    """

    def __init__(self, op, ring, comm, xp, dtype, count, mpi_staged):
        from mpi4py import MPI
        n = comm.size
        self.op, self.count = op, count
        if op == "all_reduce":
            self.a = xp.zeros(count, dtype)
            self.b = self.a
        elif op == "reduce_scatter":
            self.a, self.b = xp.zeros(count, dtype), xp.zeros(count // n, dtype)
        else:
            self.a, self.b = xp.zeros(count // n, dtype), xp.zeros(count, dtype)
        ring_fn = ring_call(op, ring, self.a, self.b)
        if mpi_staged:  # pinned host buffers, made once (grow-only, like the Ring's)
            from ringzero.comm.backend import Staging
            st = Staging()
            ma = st.host("a", self.a.nbytes).view(dtype)
            mb = ma if op == "all_reduce" else st.host("b", self.b.nbytes).view(dtype)
        else:
            ma, mb = self.a, self.b
        coll = mpi_call(op, comm, ma, mb)
        if mpi_staged:
            stream = xp.cuda.get_current_stream()

            def mpi_fn():
                self.a.get(out=ma)   # device -> pinned host (blocking)
                coll()
                self.b.set(mb)       # pinned host -> device
                stream.synchronize()
        elif xp is not np:
            stream = xp.cuda.get_current_stream()

            def mpi_fn():
                stream.synchronize()  # CUDA-aware MPI reads the device buffer: producers done
                coll()
        else:
            mpi_fn = coll
        self.ring, self.mpi = ring_fn, mpi_fn

    def check(self, which, comm, xp, seed):
        """Wrong elements of this rank after one run of `which` on fresh data."""
        n, r = comm.size, comm.rank
        a, b = self.a, self.b
        _fill(xp, a, r, seed)
        (self.ring if which == "ring" else self.mpi)()
        got = np.asarray(b.get() if xp is not np else b).astype(np.int64)
        m = self.count // n
        if self.op == "all_reduce":
            want = _expect(n, self.count, a.dtype, seed)
        elif self.op == "reduce_scatter":
            want = _expect(n, self.count, a.dtype, seed)[r * m:(r + 1) * m]
        else:
            i = np.arange(m, dtype=np.int64)
            want = np.concatenate([(i * 7 + k * 5 + seed) % 13 - 6 for k in range(n)])
        wrong = int(np.count_nonzero(got != want))
        a[...] = 0  # timing runs on zeros: sums never overflow
        return wrong


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
            rows.append(dict(op="copy", impl=name, n=1, bytes=S, count=S, dtype="uint8", redop="", time_us=round(t * 1e6, 2),
                             algbw_GBps=round(S / t / 1e9, 4), busbw_GBps=round(S / t / 1e9, 4), wrong=0))
    return rows


def run_coll(args, comm) -> list:
    from mpi4py import MPI

    from ringzero.comm.backend import cuda_aware, select_device, xp_for
    from ringzero.comm.ring import Ring

    n, rank = comm.size, comm.rank
    if args.device == "cuda":
        select_device(comm)
    xp = xp_for(args.device)
    dtype = _dtype(args.dtype)
    ring = Ring(comm)
    if args.small_bytes is not None:
        ring.small_bytes = args.small_bytes
    if args.seg_bytes is not None:
        ring.seg_bytes = args.seg_bytes
    mpi_on_host = args.device == "cuda" and not cuda_aware()  # then both sides stage, see _Case
    ops = OP_NAMES if args.op == "all" else (args.op,)
    rows = []

    def out(line):
        if rank == 0:
            print(line, flush=True)

    out(f"# ringzero.bench coll: n={n} dtype={dtype.name} device={args.device} iters={args.iters} "
        f"warmup={args.warmup_iters} small_bytes={ring.small_bytes} seg_bytes={ring.seg_bytes}"
        + (" (MPI is not CUDA-aware: ring and MPI both copy device->pinned host, reduce there, copy back)"
           if mpi_on_host else ""))
    out(f"# {'op':>14} {'size':>9} {'count':>10} {'type':>8} {'redop':>5} | {'ring us':>10} {'algbw':>7} "
        f"{'busbw':>7} {'#wrong':>6} | {'mpi us':>10} {'algbw':>7} {'busbw':>7} {'#wrong':>6} | {'busbw ring/mpi':>14}")
    for op in ops:
        factor = 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n
        S = args.minbytes
        while S <= args.maxbytes:
            count = max(n, S // dtype.itemsize) // n * n  # divisible by n, as RS/AG need
            nbytes = count * dtype.itemsize
            case = _Case(op, ring, comm, xp, dtype, count, mpi_on_host)
            impls = ["ring"] + ([] if args.no_mpi else ["mpi"])
            wrong = {}
            for which in impls:
                if args.check:
                    try:
                        w = case.check(which, comm, xp, seed=S % 97)
                    except Exception:
                        if which == "ring":
                            raise
                        w = None  # the MPI cannot reduce this dtype (e.g. bfloat16)
                    wrong[which] = None if w is None else comm.allreduce(w)
                else:
                    wrong[which] = 0
            if wrong.get("mpi", 0) is None:
                impls = ["ring"]
            fns = {"ring": case.ring, "mpi": case.mpi}
            for _ in range(args.warmup_iters):
                for which in impls:
                    fns[which]()
            # one probe iteration sizes the run so a row takes about --max-seconds
            comm.Barrier()
            t0 = time.perf_counter()
            for which in impls:
                fns[which]()
            probe = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            iters = max(3, min(args.iters, int(args.max_seconds / max(probe, 1e-9))))
            sync = None if xp is np else xp.cuda.get_current_stream().synchronize
            times = time_blocks(comm, {which: fns[which] for which in impls}, iters, sync)
            res = {}
            for which in impls:
                t = float(np.median(times[which]))
                alg = nbytes / t / 1e9
                res[which] = dict(op=op, impl=which, n=n, bytes=nbytes, count=count, dtype=dtype.name,
                                  redop=args.redop, time_us=round(t * 1e6, 2), algbw_GBps=round(alg, 4),
                                  busbw_GBps=round(alg * factor, 4), wrong=wrong[which])
                rows.append(res[which])
            rg = res["ring"]
            if "mpi" in res:
                mp = res["mpi"]
                ratio = paired_ratio(times["mpi"], times["ring"])  # busbw ring/mpi = time mpi/ring
                rg["busbw_ratio"] = round(ratio, 4)
                mcol = f"{mp['time_us']:>10.1f} {mp['algbw_GBps']:>7.3f} {mp['busbw_GBps']:>7.3f} {mp['wrong']:>6}"
            else:
                ratio, mcol = float("nan"), f"{'n/a':>10} {'':>7} {'':>7} {'':>6}"
            out(f"  {op:>14} {human(nbytes):>9} {count:>10} {dtype.name:>8} {args.redop:>5} | "
                f"{rg['time_us']:>10.1f} {rg['algbw_GBps']:>7.3f} {rg['busbw_GBps']:>7.3f} {rg['wrong']:>6} | "
                f"{mcol} | {ratio:>14.2f}")
            S *= args.stepfactor
    if xp is not np:  # the physical references, on rank 0 alone while the others wait
        sizes, S = [], args.minbytes
        while S <= args.maxbytes:
            sizes.append(S)
            S *= args.stepfactor
        refs = copy_refs(xp, sizes) if rank == 0 else []
        comm.Barrier()
        out("# physical references (rank 0 alone): GB/s of one copy")
        out(f"# {'size':>9} {'d2d memcpy':>11} {'h2d pinned':>11} {'d2h pinned':>11}")
        for S in sizes:
            bw = {r["impl"]: r["algbw_GBps"] for r in refs if r["bytes"] == S}
            out(f"  {human(S):>9} {bw.get('memcpy_d2d', 0):>11.2f} {bw.get('memcpy_h2d_pinned', 0):>11.2f} "
                f"{bw.get('memcpy_d2h_pinned', 0):>11.2f}")
        rows += refs
    bad = sum(r["wrong"] or 0 for r in rows)
    out(f"# total wrong elements: {bad}")
    if args.json and rank == 0:
        from ringzero.comm.backend import cuda_support
        meta = dict(n=n, dtype=dtype.name, device=args.device, iters=args.iters, warmup=args.warmup_iters,
                    **{k: getattr(ring, k) for k in KNOBS}, seg_bytes=ring.seg_bytes, mpi=MPI.Get_library_version().split(",")[0],
                    mpi_on_host=mpi_on_host, mpi_staged=mpi_on_host,
                    cuda_aware=cuda_support()[1] if args.device == "cuda" else None,
                    argv=sys.argv[1:], time=time.strftime("%Y-%m-%dT%H:%M:%S"))
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "meta": meta}, f, indent=1)
    ring.free()
    return rows


SUBCOMMANDS = {"coll": (coll_parser, run_coll), "sched": (sched_parser, run_sched),
               "dtypes": (dtypes_parser, run_dtypes), "median": (median_parser, run_median)}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    name = argv.pop(0) if argv and argv[0] in SUBCOMMANDS else "coll"
    make_parser, run = SUBCOMMANDS[name]
    args = make_parser().parse_args(argv)
    if name == "median":   # reads files: no MPI
        run(args)
        return 0
    from mpi4py import MPI
    from ringzero.comm.threads import set_blas_threads
    set_blas_threads(MPI.COMM_WORLD)   # this rank's share of the node's cores
    rows = run(args, MPI.COMM_WORLD)
    return 1 if any(r["wrong"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
