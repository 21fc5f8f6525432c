"""Step time and memory of ZeRO stages 0-3 side by side (issue 4's targets).

    mpirun -n 4 python -m mpi4py benchmarks/bench_stages.py            # timing, all stages in one run
    python benchmarks/bench_stages.py --rss -n 4                        # peak RSS, one mpirun per stage
    python benchmarks/bench_stages.py --cluster 2x2 --link 1gbit --stages 0,1,2,3,hybrid   # across nodes

Timing: one engine per stage lives in the same processes, and the stages
take steps in turn, the first of each round rotating (0123, 1230, 2301, ...),
so the machine's noise and any place-in-the-round effect fall on all alike;
the figure is each stage's median step time and its ratio to stage 0's,
beside the medians of the engine's ``timeline`` (compute: forward+backward
less its waits for collectives; comm: every collective's own time, hidden or
not; exposed: the waits; thread CPU: the progress thread's seconds on a core;
each the slowest rank's) and the bytes one rank sent in a step
(``last_step_ledger``), of them to other nodes (``last_step_internode``).
--overlap both: every stage twice, with and without overlap, interleaved like
the stages (the fair way to see what overlap gains: one run, the same noise).
--cluster KxP: the same run across K emulated nodes of P ranks
(benchmarks/cluster_opts.py, launch/cluster, as root); the script launches
itself there. Stage hybrid shards inside the node MPI finds.
Memory: a process's peak RSS can only be read for the whole process, so
--rss starts one mpirun per stage and reports each rank's ru_maxrss beside
the model-state bytes the runtime measured on its buffers.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cluster_opts  # noqa: E402  (benchmarks/ on the path first)

# the engine's timeline (runtime/engine.py), medians of the slowest rank's: compute, forward+backward,
# every collective's own time (hidden or not), the waits for them, the progress thread's CPU seconds
TIMELINE = ("compute_s", "fwd_bwd_s", "comm_s", "exposed_s", "progress_cpu_s")
EXPOSED = ("reduce_exposed_s", "gather_exposed_s", "param_gather_exposed_s")
OVERLAP = {"auto": (None,), "on": (True,), "off": (False,), "both": (True, False)}


def build(comm, stage, args, overlap=None):
    from ringzero.nn.gpt import GPT, GPTConfig
    from ringzero.runtime.zero import Zero
    cfg = GPTConfig(args.n_layer, args.n_head, args.n_embd, args.seq_len, 256)
    return Zero(GPT(cfg), comm, stage, seed=1, overlap=overlap)


def label(stage, overlap, args) -> str:
    """A row's name: the stage, and with --overlap both which of the pair it is."""
    return stage if args.overlap != "both" else f"{stage} {'ov' if overlap else 'no-ov'}"


def timeline(eng) -> list:
    tl = dict(eng.timeline, exposed_s=sum(eng.timeline.get(k, 0.0) for k in EXPOSED))
    return [tl.get(k, 0.0) for k in TIMELINE]


def timing(args):
    from mpi4py import MPI

    from ringzero.app.data import Batches
    from ringzero.comm.threads import set_blas_threads
    comm = MPI.COMM_WORLD
    if args.nodes and comm.size != args.nodes * args.ppn:
        raise SystemExit(f"bench_stages: --cluster {args.cluster} means {args.nodes * args.ppn} ranks, "
                         f"this job has {comm.size}")
    set_blas_threads(comm)     # this rank's share of the node's cores
    data = np.random.default_rng(0).integers(0, 256, 1 << 20).astype(np.uint8)
    batches = Batches(data, args.batch, args.seq_len, comm.rank, comm.size, 0)
    engines = {label(st, ov, args): build(comm, st, args, ov) for st in args.stages for ov in OVERLAP[args.overlap]}
    times = {st: [] for st in engines}
    lines = {st: [] for st in engines}       # per step: the timeline, each part the slowest rank's
    order = list(engines)
    for it in range(args.warmup + args.iters):
        x, y = batches.get(it)
        # rotate who goes first: a stage's time can depend on its place in the round
        for st in order[it % len(order):] + order[:it % len(order)]:
            eng = engines[st]
            comm.Barrier()
            t0 = time.perf_counter()
            eng.step(x, y, 1e-4)
            dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)   # the slowest rank's step
            tl = np.array(timeline(eng))
            comm.Allreduce(MPI.IN_PLACE, tl, op=MPI.MAX)
            if it >= args.warmup:
                times[st].append(dt)
                lines[st].append(tl)
    if comm.rank == 0:
        report(args, comm, engines, times, lines)


def report(args, comm, engines, times, lines):
    """Rank 0: the table (and --json)."""
    base = float(np.median(times[next(iter(engines))]))
    rows = []
    nm = next(iter(engines.values())).topology.nodes
    print(f"GPT {args.n_layer}L {args.n_embd}C T={args.seq_len}, batch {args.batch}/rank, Nd={comm.size}, "
          f"{args.iters} steps per stage, interleaved")
    if args.nodes:
        print(f"{cluster_opts.describe(args)}; MPI finds {nm.count} node(s): {nm.describe()}")
    w = max(6, *(len(k) for k in engines))
    print(f"{'stage':>{w}} {'median step':>12} {'vs ' + next(iter(engines)):>12} {'traffic/step':>14}"
          f" {'across nodes':>14} {'overlap':>7}" + "".join(f" {h:>10}" for h in
                                                             ("compute", "fwd+bwd", "comm", "exposed", "thread CPU")))
    for st, eng in engines.items():
        med = float(np.median(times[st]))
        tr = eng.traffic_report()["measured_bytes_per_step"]
        net = int(sum(eng.last_step_internode.values()))
        tl = dict(zip(TIMELINE, (float(v) for v in np.median(lines[st], axis=0))))
        rows.append({"stage": st, "engine_stage": eng.stage, "median_step_s": med, "ratio": med / base,
                     "bytes_sent": tr,
                     "bytes_sent_internode": net, "overlap": bool(eng.overlap), "timeline": tl})
        print(f"{st:>{w}} {med * 1e3:10.1f} ms {med / base:11.3f}x {tr:>12,} B {net:>12,} B"
              f" {'on' if eng.overlap else 'off':>7}" + "".join(f" {tl[k] * 1e3:7.1f} ms" for k in TIMELINE))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mode": "timing", "nd": comm.size, "nodes": nm.count, "cluster": args.cluster,
                       "link": args.link if args.nodes else None, "rows": rows}, f, indent=1)


def rss_one(args):
    """One stage, a few steps; print each rank's peak RSS (run under mpirun)."""
    from mpi4py import MPI

    from ringzero.app.data import Batches
    from ringzero.comm.threads import set_blas_threads
    comm = MPI.COMM_WORLD
    set_blas_threads(comm)     # this rank's share of the node's cores
    data = np.random.default_rng(0).integers(0, 256, 1 << 20).astype(np.uint8)
    batches = Batches(data, args.batch, args.seq_len, comm.rank, comm.size, 0)
    eng = build(comm, args.stages[0], args)
    for it in range(3):
        x, y = batches.get(it)
        eng.step(x, y, 1e-4)
    rep = eng.memory_report()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux: KiB
    rows = comm.gather({"rank": comm.rank, "peak_rss": peak, "model_state": rep["model_state_measured"],
                        "workspace": sum(rep["workspace"].values()),
                        "activation_peak": rep["activation_peak"]})
    if comm.rank == 0:
        print(json.dumps({"stage": args.stages[0], "rows": rows}))


def rss(args):
    mpirun = os.environ.get("MPIRUN", "mpirun")
    flags = os.environ.get("MPIRUN_FLAGS", "--oversubscribe --bind-to none"
                           + (" --allow-run-as-root" if os.geteuid() == 0 else "")).split()
    launcher = [mpirun, *flags, "-n", str(args.n), sys.executable]
    out = []
    for st in args.stages:
        if args.nodes:                  # launch/cluster puts the venv's python in place of "python"
            launcher = cluster_opts.prefix(args, tempfile.mkdtemp(prefix=f"bench_stages-rss-{st}-")) + ["python"]
        cmd = [*launcher, "-m", "mpi4py", __file__, "--rss-one",
               "--stages", st, "--n-layer", str(args.n_layer), "--n-head", str(args.n_head),
               "--n-embd", str(args.n_embd), "--seq-len", str(args.seq_len), "--batch", str(args.batch)]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if res.returncode:
            sys.exit(f"bench_stages: stage {st} failed: {res.stderr.strip().splitlines()[-1:]}")
        out.append(json.loads(res.stdout.strip().splitlines()[-1]))
    mib = 2 ** 20
    print(f"{'stage':>6} {'peak RSS/rank':>14} {'model state':>12} {'workspace':>10} {'activations':>12}")
    for r in out:
        pk = max(x["peak_rss"] for x in r["rows"])
        x = r["rows"][0]
        print(f"{r['stage']:>6} {pk / mib:10.1f} MiB {x['model_state'] / mib:8.2f} MiB "
              f"{x['workspace'] / mib:6.2f} MiB {x['activation_peak'] / mib:8.2f} MiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mode": "rss", "nd": args.n, "cluster": args.cluster, "stages": out}, f, indent=1)


def across_nodes(args) -> int:
    """Run this script again under launch/cluster (the same flags); its exit code."""
    logs = tempfile.mkdtemp(prefix="bench_stages-nodes-")
    cmd = cluster_opts.prefix(args, logs) + ["python", "-m", "mpi4py", os.path.abspath(__file__), *sys.argv[1:]]
    rc = subprocess.run(cmd, check=False).returncode
    if rc and not os.listdir(logs):      # launch/cluster refused (its one line said why): no rank ran
        os.rmdir(logs)
    elif rc:
        print(f"bench_stages: the run across nodes failed (exit {rc}); every rank's output is in {logs}",
              file=sys.stderr)
    else:
        shutil.rmtree(logs, ignore_errors=True)
    return rc


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", default="0,1,2,3", help="comma-separated stages (0-3, hybrid), the first is "
                   "the baseline")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rss", action="store_true", help="peak RSS: one mpirun per stage (run without mpirun)")
    p.add_argument("-n", type=int, default=4, help="ranks for --rss (--cluster: K*P)")
    p.add_argument("--rss-one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--overlap", choices=tuple(OVERLAP), default="auto",
                   help="the engines' overlap: auto (on when the ranks span nodes), on, off, or both: each "
                        "stage twice, with and without, interleaved like the stages")
    p.add_argument("--json", help="write the rows here")
    cluster_opts.add_args(p)
    args = p.parse_args()
    from ringzero.runtime.accounting import parse_stage
    try:
        args.stages = [parse_stage(s) for s in args.stages.split(",")]
    except ValueError as e:
        cluster_opts.fail("bench_stages", f"--stages: {e}")
    cluster_opts.check(args, "bench_stages")
    if args.nodes:
        args.n = args.nodes * args.ppn
    if args.rss_one:
        rss_one(args)
    elif args.rss:
        rss(args)
    elif args.nodes and not cluster_opts.inside_mpi():
        sys.exit(across_nodes(args))
    else:
        timing(args)


if __name__ == "__main__":
    main()
