"""What ``--trace`` costs a step: launches without and with it, interleaved, and the recorder's ns per event.

    python benchmarks/trace_overhead.py                          # 3 pairs, 4 ranks, the default 4 x 128 model
    python benchmarks/trace_overhead.py --pairs 5 --ranks 2 --steps 80 -- --stage 3 --overlap

Each pair is two launches of ``python -m ringzero.train`` with the same seed and flags, one without
``--trace`` and one recording every step from --warm on (``--trace-steps warm:steps``), the order of the
two alternating pair by pair (off, on; on, off; ...), so a load that drifts over the run falls on both.
Per launch it prints the 1-minute load average at its start and the median of rank 0's ``step_time_s``
(the metrics file) over the steps from --warm on; per pair on / off; then the median of the pairs' ratios.

Before the launches, in this process: the recorder's cost per event (ns), a unit's compute span and a
collective's span through the Ring's wrapper, with the events per step the "on" launches recorded
(rank 0, from its file), so their product can be set beside the measured difference.

What it is not: a quiet machine. Run it with nothing else on the cores (``../shared/quiet --``); a
figure measured beside other work is that work's figure as much as the recorder's.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def per_event_ns(n: int = 200_000) -> dict:
    """ns per recorded event: a span with interned ids (a unit's forward), and a collective through the
    Ring's traced run (its wrapper, the span and its args), less the bare call."""
    from ringzero.comm.trace import SPAN, Recorder
    r = Recorder()
    r.enable(0, 1, capacity=n)
    r.active = True
    name, cat = r.intern("forward 3"), r.intern("compute")
    span = r.put
    t = time.perf_counter_ns()
    for _ in range(n):
        span(name, cat, SPAN, 0, 1.0, 2.0)
    span_ns = (time.perf_counter_ns() - t) / n
    r.disable()
    r.enable(0, 1, capacity=n)
    r.active = True

    class Plan:                     # the attributes the wrapper reads (comm/steps.py: CollectivePlan)
        name, sent, sent_net, sched, dtype, size = "all_gather", 8192, 0, "ring", "float16", 16384
    ring = type("Ring", (), {"size": 4, "trace_name": "shard"})()
    bare = lambda plan, background=False: None          # noqa: E731
    run = r.traced_run(bare, ring)
    t = time.perf_counter_ns()
    for _ in range(n):
        bare(Plan)
    t_bare = time.perf_counter_ns() - t
    t = time.perf_counter_ns()
    for _ in range(n):
        run(Plan)
    comm_ns = (time.perf_counter_ns() - t - t_bare) / n
    r.disable()
    return {"span": span_ns, "collective": comm_ns}


def mpirun_argv(n: int, flags=None) -> list:
    """mpirun -n n with Open MPI's flags here (as bench_stages.py: MPIRUN, MPIRUN_FLAGS override them)."""
    mpirun = os.environ.get("MPIRUN") or shutil.which("mpirun", path=os.path.dirname(sys.executable)) or "mpirun"
    if flags is None:
        flags = os.environ.get("MPIRUN_FLAGS", "--oversubscribe --bind-to none").split()
    root = ["--allow-run-as-root"] if os.geteuid() == 0 and "MPIRUN_FLAGS" not in os.environ else []
    return [mpirun, *flags, *root, "-n", str(n)]


def launch(args, extra, trace_dir, metrics) -> tuple:
    """One training launch; (load at its start, median step s from --warm on)."""
    cmd = [*mpirun_argv(args.ranks), sys.executable, "-m", "mpi4py", "-m", "ringzero.train",
           "--steps", str(args.steps), "--metrics", metrics, "--quiet", "--sample-chars", "0", "--eval-interval", "0",
           *extra]
    if trace_dir:
        cmd += ["--trace", trace_dir, "--trace-steps", f"{args.warm}:{args.steps}"]
    load = os.getloadavg()[0]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout,
                         env={**os.environ, "PYTHONPATH": ROOT})
    if res.returncode:
        tail = (res.stderr.strip() or res.stdout.strip()).splitlines()[-3:]
        sys.exit(f"trace_overhead: a launch failed (exit {res.returncode}): {' | '.join(tail)}")
    with open(metrics) as fh:
        rows = [json.loads(line) for line in fh]
    times = [r["step_time_s"] for r in rows if "step_time_s" in r and r.get("step", -1) >= args.warm]
    return load, statistics.median(times)


def events_per_step(trace_dir) -> float:
    """Rank 0's recorded events per step (the file's own count, over the window's steps)."""
    with open(os.path.join(trace_dir, "rank0_trace.json")) as fh:
        doc = json.load(fh)
    rz = doc["ringzero"]
    return rz["recorded_events"] / max(1, rz["recorded_steps"])


def pairs(args, work):
    """The off/on launches, alternating which runs first: (on / off ratios, on medians, events per step)."""
    ratios, on_steps, eps = [], [], None
    for k in range(args.pairs):
        med = {}
        for mode in (("off", "on") if k % 2 == 0 else ("on", "off")):
            tdir = os.path.join(work, f"tr{k}") if mode == "on" else None
            load, med[mode] = launch(args, args.extra, tdir, os.path.join(work, f"{mode}{k}.jsonl"))
            print(f"pair {k + 1} {mode:>3}: median step {med[mode] * 1e3:8.2f} ms   (load {load:.2f} at the start)")
            if tdir:
                eps = events_per_step(tdir)
        ratios.append(med["on"] / med["off"])
        on_steps.append(med["on"])
        print(f"pair {k + 1}: on / off = {ratios[-1]:.4f} ({ratios[-1] - 1:+.2%})")
    return ratios, on_steps, eps


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=3, help="off/on pairs (default 3)")
    p.add_argument("--ranks", type=int, default=4, help="mpirun -n (default 4)")
    p.add_argument("--steps", type=int, default=60, help="steps per launch (default 60)")
    p.add_argument("--warm", type=int, default=10, help="steps left out of the median, and not traced (default 10)")
    p.add_argument("--timeout", type=int, default=600, help="seconds per launch (default 600)")
    p.add_argument("extra", nargs="*", help="after --: flags for ringzero.train (the model, the stage, ...)")
    args = p.parse_args()
    if not 0 <= args.warm < args.steps or args.pairs < 1:
        sys.exit(f"trace_overhead: expected 0 <= --warm < --steps and --pairs >= 1, got warm {args.warm}, "
                 f"steps {args.steps}, pairs {args.pairs}")
    micro = per_event_ns()
    print(f"recorder: {micro['span']:.0f} ns per span, {micro['collective']:.0f} ns per collective "
          f"(its wrapper and span, less the bare call), in one process")
    with tempfile.TemporaryDirectory(prefix="trace_overhead-") as work:    # the launches' metrics and traces
        ratios, on_steps, eps = pairs(args, work)
    est = eps * micro["span"] * 1e-9 / statistics.median(on_steps)
    print(f"median on / off over {args.pairs} pairs: {statistics.median(ratios):.4f} "
          f"({statistics.median(ratios) - 1:+.2%}); load now {os.getloadavg()[0]:.2f}")
    print(f"rank 0 recorded {eps:.0f} events per step: x {micro['span']:.0f} ns = {est:.3%} of the step "
          f"(the recording alone, on one rank)")


if __name__ == "__main__":
    main()
