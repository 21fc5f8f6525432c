"""``python -m ringzero.bench sched|dtypes|median``: the Ring timed against itself, and many runs read as one.

What it is
    Three words of ``ringzero.bench`` (``ringzero.tools.bench`` dispatches to them):

    sched   For each op and size, every schedule of the Ring ("ring";
            "recursive_doubling"; halving reduce-scatter / doubling all-gather
            "tree"; "direct"; recursive_doubling and tree only when the world
            size is a power of two,
            direct only for 3 <= n <= 16 and never for a 2^k all-reduce) forced
            in turn, and the MPI library's collective beside them, all on ONE
            set of buffers per op and size (where a buffer lies can move a
            time by itself), in alternating blocks (bench_timing.time_blocks); the
            median of the slowest rank's time, fastest Ring schedule marked
            with *. ``-o OP`` times one op. This is how the thresholds of
            ringzero/comm/schedule.py were placed.
    dtypes  One op on the same element count in several dtypes, interleaved
            (float16 against float32: the bytes halve, does the time?), each
            checked first on integer-valued data (#wrong).
    median  No MPI: reads the ``--json`` files of several ``coll`` launches
            and prints, per op, n and size, the median of their Ring/MPI busbw
            ratios and their range, as a Markdown table. This machine's speed
            changes between launches, so one launch's ratio is one sample.

    sched and dtypes reuse the bench's cases (``bench_cases.Case``: buffers,
    fill, check) and its timing (``bench_timing.time_blocks``); bench.py
    imports this module, never the other way round. Only rank 0 prints;
    ``--json FILE`` writes the rows.

What it is not
    Not the nccl-tests-style sweep (that is ``coll``, in bench.py), and no
    algbw/busbw: sched and dtypes compare times on identical buffers only.
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from ringzero.sizes import human, parse_size
from ringzero.tools.bench_cases import OP_NAMES, Case, bench_dtype, ring_call
from ringzero.tools.bench_timing import time_blocks


def sched_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ringzero.bench sched",
                                description="time every schedule of the Ring on the same buffers, interleaved, "
                                            "to place the thresholds (small_bytes, tree_bytes)")
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("4K"))
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("16M"))
    p.add_argument("-f", "--stepfactor", type=int, default=4)
    p.add_argument("-n", "--iters", type=int, default=15)
    p.add_argument("-o", "--op", choices=["all_reduce", "reduce_scatter", "all_gather", "all"], default="all")
    p.add_argument("-d", "--dtype", default="float32")
    p.add_argument("--json", default=None)
    return p


# (small_bytes, tree_bytes, direct_bytes, latency_bytes) that force each schedule
_FORCE = {"ring": (0, 0, 0, 0), "recursive_doubling": (1 << 62, 1 << 62, 0, 0), "tree": (0, 1 << 62, 0, 0),
          "direct": (0, 1 << 62, 1 << 62, 0)}


def run_sched(args, comm) -> list:
    """Median time of each schedule per op and size; rank 0 prints, best marked with *."""
    from ringzero.comm.ring import DIRECT_RANKS, Ring
    n, rank = comm.size, comm.rank
    dtype = bench_dtype(args.dtype)
    rings = {}
    pow2 = n & (n - 1) == 0
    variants = {"all_reduce": ["ring", "recursive_doubling", "tree", "direct"],
                "reduce_scatter": ["ring", "tree", "direct"], "all_gather": ["ring", "tree", "direct"]}
    rows = []
    if rank == 0:
        print(f"# ringzero.bench sched: n={n} dtype={dtype.name}; time per call in us, alternating blocks "
              "(tree: halving RS / doubling AG; direct: one round; * fastest)")
    for op, names in variants.items():
        if args.op not in ("all", op):
            continue
        # a 2^k all-reduce is never direct (the tree's order takes recursive_doubling or
        # rabenseifner): "direct" would time rabenseifner again
        names = [x for x in names if (pow2 or x not in ("recursive_doubling", "tree"))
                 and (3 <= n <= DIRECT_RANKS or x != "direct")
                 and not (pow2 and op == "all_reduce" and x == "direct")]
        S = args.minbytes
        while S <= args.maxbytes:
            count = max(n, S // dtype.itemsize) // n * n
            for name in names:  # one Ring per schedule, its knobs set once
                if name not in rings:
                    rings[name] = Ring(comm)
                    (rings[name].small_bytes, rings[name].tree_bytes, rings[name].direct_bytes,
                     rings[name].latency_bytes) = _FORCE[name]
            # ONE set of buffers for every schedule and MPI: where a buffer lies can move a cell on its own
            case = Case(op, rings[names[0]], comm, np, dtype, count, False)
            a, b = case.a, case.b
            fns = {name: ring_call(op, rings[name], a, b) for name in names}
            impls = names + ["mpi"]
            fns["mpi"] = case.mpi
            for f in fns.values():
                f()
            times = time_blocks(comm, fns, args.iters)
            med = {name: float(np.median(times[name])) * 1e6 for name in impls}
            best = min(names, key=med.get)
            for name in impls:
                rows.append(dict(op=op, impl=name, n=n, bytes=count * dtype.itemsize, dtype=dtype.name,
                                 time_us=round(med[name], 2)))
            if rank == 0:
                cells = " ".join(f"{name}={med[name]:9.1f}{'*' if name == best else ' '}" for name in impls)
                print(f"  {op:>14} {human(count * dtype.itemsize):>6}  {cells}", flush=True)
            S *= args.stepfactor
    if args.json and rank == 0:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "meta": dict(n=n, dtype=dtype.name, kind="sched")}, f, indent=1)
    for ring in rings.values():
        ring.free()
    return [dict(r, wrong=0) for r in rows]


def dtypes_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ringzero.bench dtypes",
                                description="one op on the same element count in several dtypes, interleaved "
                                            "(e.g. float16 against float32 all_reduce at 16 MiB of float32)")
    p.add_argument("--count", type=parse_size, default=parse_size("4M"), help="elements (4M = 16 MiB of float32)")
    p.add_argument("-d", "--dtypes", default="float16,float32")
    p.add_argument("-o", "--op", default="all_reduce", choices=OP_NAMES)
    p.add_argument("-n", "--iters", type=int, default=15)
    p.add_argument("-w", "--warmup_iters", type=int, default=2)
    p.add_argument("--json", default=None)
    return p


def run_dtypes(args, comm) -> list:
    from ringzero.comm.ring import Ring
    n, rank = comm.size, comm.rank
    ring = Ring(comm)
    dts = [bench_dtype(d) for d in args.dtypes.split(",")]
    count = max(n, args.count) // n * n
    cases = [Case(args.op, ring, comm, np, dt, count, False) for dt in dts]
    wrong = [comm.allreduce(c.check("ring", comm, np, seed=1)) for c in cases]
    for _ in range(args.warmup_iters):
        for c in cases:
            c.ring()
    times = time_blocks(comm, {k: c.ring for k, c in enumerate(cases)}, args.iters)
    rows = []
    for k, dt in enumerate(dts):
        t = float(np.median(times[k]))
        rows.append(dict(op=args.op, impl="ring", n=n, bytes=count * dt.itemsize, count=count, dtype=dt.name,
                         redop="sum", time_us=round(t * 1e6, 2), wrong=wrong[k]))
    if rank == 0:
        base = rows[-1]["time_us"]
        print(f"# ringzero.bench dtypes: n={n} op={args.op} count={count} iters={args.iters} (interleaved)")
        for r in rows:
            print(f"  {r['dtype']:>9} {human(r['bytes']):>6} {r['time_us']:>11.1f} us  "
                  f"x{r['time_us'] / base:.2f} of {rows[-1]['dtype']}  #wrong {r['wrong']}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"rows": rows, "meta": dict(n=n, kind="dtypes")}, f, indent=1)
    ring.free()
    return rows


def median_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ringzero.bench median",
                                description="the median over several `coll` launches (their --json files) of "
                                            "the Ring/MPI busbw ratio, per op, n and size, as a Markdown table")
    p.add_argument("files", nargs="+", help="JSON files written by python -m ringzero.bench --json")
    p.add_argument("--target", type=float, default=None,
                   help="bold the cells whose median is at least this")
    return p


def run_median(args) -> list:
    """Median and range of busbw_ratio per (op, n, bytes) over the files' ring rows, printed as Markdown."""
    got = {}
    for path in args.files:
        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"ringzero.bench median: {path}: {e}") from None
        rows = d.get("rows") if isinstance(d, dict) else d
        if not isinstance(rows, list):
            raise SystemExit(f"ringzero.bench median: {path}: expected {{\"rows\": [...]}} from bench --json")
        for r in rows:
            if isinstance(r, dict) and r.get("impl") == "ring" and r.get("busbw_ratio") is not None:
                got.setdefault((r["op"], int(r["n"]), int(r["bytes"])), []).append(float(r["busbw_ratio"]))
    if not got:
        raise SystemExit("ringzero.bench median: no ring rows with busbw_ratio in "
                         f"{', '.join(args.files)} (files from python -m ringzero.bench --json)")
    sizes = sorted({b for _, _, b in got})
    order = {"all_reduce": 0, "reduce_scatter": 1, "all_gather": 2}
    keys = sorted({(op, n) for op, n, _ in got}, key=lambda k: (order.get(k[0], 9), k[0], k[1]))
    out = []
    print("| op | n | " + " | ".join(human(b) for b in sizes) + " |")
    print("|---|---|" + "---|" * len(sizes))
    for op, n in keys:
        cells = []
        for b in sizes:
            v = got.get((op, n, b))
            if not v:
                cells.append("")
                continue
            med = float(np.median(v))
            out.append(dict(op=op, n=n, bytes=b, median=med, lo=min(v), hi=max(v), runs=len(v)))
            txt = f"{med:.2f}" + (f" ({min(v):.2f}–{max(v):.2f})" if len(v) > 1 else "")
            cells.append(f"**{txt}**" if args.target is not None and med >= args.target else txt)
        print(f"| {op} | {n} | " + " | ".join(cells) + " |")
    return out
