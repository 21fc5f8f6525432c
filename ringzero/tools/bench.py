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

    The buffers and the check are ringzero.tools.bench_cases, the timing
    ringzero.tools.bench_timing. Three more words, in ringzero.tools.bench_extra: ``sched`` times every
    Ring schedule against each other (how the thresholds were placed),
    ``dtypes`` times one op on the same element count in several dtypes,
    interleaved (float16 against float32), and ``median`` reads the --json
    files of several launches and prints the median ratio per cell.

What it is not
    A model benchmark: main() dispatches on a first word so one can be added
    (``python -m ringzero.bench coll ...`` is the same as no word).

    Across nodes (ranks on several hosts, or launch/cluster's emulated
    ones) the header names the topology the Ring found and whether its
    node-aware schedule runs (``# nodes:``), and the MPI component that runs
    the peer's collectives (``# MPI coll:``, tools/mpi_info.py). Given the
    link's rate (``--link 1gbit``, or RINGZERO_LINK, which launch/cluster
    sets) two more columns give the link's limit, the bytes that must leave
    a node over the rate (S (N-1)/N for a reduce-scatter or all-gather
    across N nodes, twice that for an all-reduce), and the Ring's time over
    it.

    mpirun -n 4 python -m mpi4py -m ringzero.bench -b 4K -e 64M -f 4 -c 1 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from ringzero.comm.schedule import KNOBS  # (no MPI in it)
from ringzero.sizes import human, parse_link, parse_size
from ringzero.tools.bench_cases import OP_NAMES, Case, bench_dtype, mpi_call, ring_call

# sched, dtypes and median live in their own module (the Ring timed against itself)
from ringzero.tools.bench_extra import dtypes_parser, median_parser, run_dtypes, run_median, run_sched, sched_parser
from ringzero.tools.bench_timing import copy_refs, paired_ratio, time_blocks
from ringzero.tools.mpi_info import coll_component

_Case = Case   # the name benchmarks/interleave_bias.py imports
# what the benchmarks import from here (the code lives in bench_cases, bench_timing, ringzero.sizes)
__all__ = ["OP_NAMES", "Case", "_Case", "copy_refs", "human", "main", "mpi_call", "paired_ratio", "parse_size",
           "ring_call", "run_coll", "time_blocks"]


def coll_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ringzero.bench [coll]", description=__doc__.split("\n\n")[0],
                                epilog="Sizes: 4096, 4K = 4KiB = 4096, 4KB = 4000, 64M, 1.5G (ringzero.sizes).")
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
    p.add_argument("--link", type=parse_link, default=None,
                   help="the inter-node link's rate (1gbit, 10gbit, 125MB/s; default RINGZERO_LINK): adds the "
                        "link's limit and the Ring's time over it")
    p.add_argument("--json", default=None, help="write the rows here")
    return p


def link_limit_s(op: str, nbytes: int, nodes: int, rate: float | None) -> float | None:
    """Seconds the bytes that must leave a node take at `rate` (bytes/s): S (N-1)/N per pass; None on one node."""
    if nodes < 2 or not rate:
        return None
    return (2 if op == "all_reduce" else 1) * nbytes * (nodes - 1) / nodes / rate


def _sizes(args) -> list:
    """S from -b to -e by factor -f."""
    out, S = [], args.minbytes
    while S <= args.maxbytes:
        out.append(S)
        S *= args.stepfactor
    return out


def _checked(case, impls, args, comm, xp, seed) -> dict:
    """#wrong per impl over all ranks (0 without -c); None where the MPI cannot reduce the dtype."""
    wrong = {}
    for which in impls:
        if not args.check:
            wrong[which] = 0
            continue
        try:
            w = case.check(which, comm, xp, seed=seed)
        except Exception:
            if which == "ring":
                raise
            w = None  # the MPI cannot reduce this dtype (e.g. bfloat16)
        wrong[which] = None if w is None else comm.allreduce(w)
    return wrong


def _timed(case, impls, args, comm, xp) -> dict:
    """Warm-up, one probe round that sizes the run to about --max-seconds, then time_blocks."""
    from mpi4py import MPI
    fns = {"ring": case.ring, "mpi": case.mpi}
    for _ in range(args.warmup_iters):
        for which in impls:
            fns[which]()
    comm.Barrier()
    t0 = time.perf_counter()
    for which in impls:
        fns[which]()
    probe = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    iters = max(3, min(args.iters, int(args.max_seconds / max(probe, 1e-9))))
    sync = None if xp is np else xp.cuda.get_current_stream().synchronize
    return time_blocks(comm, {which: fns[which] for which in impls}, iters, sync)


def _row_line(op, nbytes, count, dtype, redop, rg, mp, ratio) -> str:
    """One printed row: the ring's columns, the MPI's (or n/a), the ratio (and the link's limit, if known)."""
    mcol = (f"{mp['time_us']:>10.1f} {mp['algbw_GBps']:>7.3f} {mp['busbw_GBps']:>7.3f} {mp['wrong']:>6}"
            if mp else f"{'n/a':>10} {'':>7} {'':>7} {'':>6}")
    lim = rg.get("link_limit_us")
    lcol = f" | {lim / 1e3:>8.1f} {rg['time_us'] / lim:>10.2f}" if lim else ""
    return (f"  {op:>14} {human(nbytes):>9} {count:>10} {dtype.name:>8} {redop:>5} | "
            f"{rg['time_us']:>10.1f} {rg['algbw_GBps']:>7.3f} {rg['busbw_GBps']:>7.3f} {rg['wrong']:>6} | "
            f"{mcol} | {ratio:>14.2f}{lcol}")


def _op_rows(op, S, ring, comm, xp, dtype, args, mpi_on_host, out) -> list:
    """Check, time and print one (op, S) cell; its rows (ring, and mpi unless --no-mpi or unsupported)."""
    n = comm.size
    factor = 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n
    count = max(n, S // dtype.itemsize) // n * n  # divisible by n, as RS/AG need
    nbytes = count * dtype.itemsize
    case = Case(op, ring, comm, xp, dtype, count, mpi_on_host)
    impls = ["ring"] + ([] if args.no_mpi else ["mpi"])
    wrong = _checked(case, impls, args, comm, xp, seed=S % 97)
    if wrong.get("mpi", 0) is None:
        impls = ["ring"]
    times = _timed(case, impls, args, comm, xp)
    res = {}
    for which in impls:
        t = float(np.median(times[which]))
        alg = nbytes / t / 1e9
        res[which] = dict(op=op, impl=which, n=n, bytes=nbytes, count=count, dtype=dtype.name,
                          redop=args.redop, time_us=round(t * 1e6, 2), algbw_GBps=round(alg, 4),
                          busbw_GBps=round(alg * factor, 4), wrong=wrong[which])
    lim = link_limit_s(op, nbytes, ring.nodes.count, args.link)
    if lim:
        for r in res.values():
            r["link_limit_us"] = round(lim * 1e6, 2)
    ratio = float("nan")
    if "mpi" in res:
        ratio = paired_ratio(times["mpi"], times["ring"])  # busbw ring/mpi = time mpi/ring
        res["ring"]["busbw_ratio"] = round(ratio, 4)
    out(_row_line(op, nbytes, count, dtype, args.redop, res["ring"], res.get("mpi"), ratio))
    return list(res.values())


def _copy_table(xp, sizes, comm, out) -> list:
    """--device cuda: the physical references, measured on rank 0 alone while the others wait."""
    refs = copy_refs(xp, sizes) if comm.rank == 0 else []
    comm.Barrier()
    out("# physical references (rank 0 alone): GB/s of one copy")
    out(f"# {'size':>9} {'d2d memcpy':>11} {'h2d pinned':>11} {'d2h pinned':>11}")
    for S in sizes:
        bw = {r["impl"]: r["algbw_GBps"] for r in refs if r["bytes"] == S}
        out(f"  {human(S):>9} {bw.get('memcpy_d2d', 0):>11.2f} {bw.get('memcpy_h2d_pinned', 0):>11.2f} "
            f"{bw.get('memcpy_d2h_pinned', 0):>11.2f}")
    return refs


def _write_json(path, rows, args, ring, n, dtype, mpi_on_host):
    from mpi4py import MPI

    from ringzero.comm.backend import cuda_support
    meta = dict(n=n, dtype=dtype.name, device=args.device, iters=args.iters, warmup=args.warmup_iters,
                **{k: getattr(ring, k) for k in KNOBS}, seg_bytes=ring.seg_bytes, node_bytes=ring.node_bytes,
                nodes=ring.nodes.count, ppn=ring.nodes.ppn, link_Bps=args.link,
                mpi=MPI.Get_library_version().split(",")[0], mpi_on_host=mpi_on_host, mpi_staged=mpi_on_host,
                cuda_aware=cuda_support()[1] if args.device == "cuda" else None,
                argv=sys.argv[1:], time=time.strftime("%Y-%m-%dT%H:%M:%S"))
    with open(path, "w") as f:
        json.dump({"rows": rows, "meta": meta}, f, indent=1)


def run_coll(args, comm) -> list:
    """The sweep: one row per (op, S) and impl, printed by rank 0; returns the rows."""
    from ringzero.comm.backend import cuda_aware, select_device, xp_for
    from ringzero.comm.ring import Ring

    n, rank = comm.size, comm.rank
    if args.device == "cuda":
        select_device(comm)
    xp = xp_for(args.device)
    dtype = bench_dtype(args.dtype)
    ring = Ring(comm)
    if args.small_bytes is not None:
        ring.small_bytes = args.small_bytes
    if args.seg_bytes is not None:
        ring.seg_bytes = args.seg_bytes
    mpi_on_host = args.device == "cuda" and not cuda_aware()  # then both sides stage, see Case
    ops = OP_NAMES if args.op == "all" else (args.op,)
    if args.link is None and os.environ.get("RINGZERO_LINK", "none") != "none":
        args.link = parse_link(os.environ["RINGZERO_LINK"])
    spans = ring.nodes.count > 1

    def out(line):
        if rank == 0:
            print(line, flush=True)

    out(f"# ringzero.bench coll: n={n} dtype={dtype.name} device={args.device} iters={args.iters} "
        f"warmup={args.warmup_iters} small_bytes={ring.small_bytes} seg_bytes={ring.seg_bytes}"
        + (" (MPI is not CUDA-aware: ring and MPI both copy device->pinned host, reduce there, copy back)"
           if mpi_on_host else ""))
    nodes = ring.nodes
    out(f"# nodes: {nodes.describe()}; across nodes the Ring runs "
        + ("its node-aware schedule" if nodes.uniform and ring.node_bytes >= 0 else "its flat schedules"
           if spans else "-") + (f"; link {args.link / 1e6:g} MB/s" if args.link and spans else ""))
    coll = coll_component(spans) if rank == 0 else ""
    out(f"# MPI coll: {coll}")
    limit_head = f" | {'limit ms':>8} {'ring/limit':>10}" if args.link and spans else ""
    out(f"# {'op':>14} {'size':>9} {'count':>10} {'type':>8} {'redop':>5} | {'ring us':>10} {'algbw':>7} "
        f"{'busbw':>7} {'#wrong':>6} | {'mpi us':>10} {'algbw':>7} {'busbw':>7} {'#wrong':>6} | "
        f"{'busbw ring/mpi':>14}{limit_head}")
    rows = [r for op in ops for S in _sizes(args)
            for r in _op_rows(op, S, ring, comm, xp, dtype, args, mpi_on_host, out)]
    if xp is not np:
        rows += _copy_table(xp, _sizes(args), comm, out)
    out(f"# total wrong elements: {sum(r['wrong'] or 0 for r in rows)}")
    if args.json and rank == 0:
        _write_json(args.json, rows, args, ring, n, dtype, mpi_on_host)
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
