"""The pictures of docs/trace.md: runs the trainer with --trace as that page shows, and draws docs/img/trace-*.png.

    python benchmarks/trace_pictures.py                          # all of them, into docs/img
    python benchmarks/trace_pictures.py --only stages,slow --out /tmp/img
    python benchmarks/trace_pictures.py --only stages --out /tmp/img -- --n-layer 1 --n-embd 32   # flags for every run

Each picture is one or two trainer runs and ``python -m ringzero.plot trace DIR --step 6``; every command is
printed before it runs, with the 1-minute load average at its start:

    stages    trace-stage2.png, trace-stage3.png: 4 ranks, the default model, --overlap, stage 2 and stage 3
    overlap   trace-overlap-on.png, trace-overlap-off.png: stage 3 on 2 emulated nodes of 2 ranks joined by
              a 1 Gbit/s link (launch/cluster: root, ip, tc; its own --prefix and --net, so it does not meet a
              cluster already up), with and without --overlap
    offload   trace-offload.png: --model gpt2 (124M), stage 3, --offload optimizer, 2 ranks, batch 1
    slow      trace-slow-rank.png: 2 ranks each bound to its core, rank 1's core shared with a busy loop
              (taskset), and ``python -m ringzero.trace summary`` naming the straggler

What it is not: a timing. The pictures show where each thread spends a step; their milliseconds are those of
the machine that drew them (docs/trace.md says which).
"""
import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from trace_overhead import mpirun_argv  # noqa: E402

TRAIN = ["-m", "mpi4py", "-m", "ringzero.train", "--quiet", "--sample-chars", "0", "--eval-interval", "0"]
MAX_LOAD = 0.0            # --max-load
STEP = 6                   # the step drawn: inside the default window 5:8, after the loss-scale skips


def run(cmd, **kw) -> str:
    """Run cmd from the checkout (printed first, with the load); its stdout. Exits on failure."""
    t0 = time.monotonic()
    while MAX_LOAD and os.getloadavg()[0] >= MAX_LOAD and time.monotonic() - t0 < 600:
        time.sleep(5)                # --max-load: a quieter start, 10 minutes at most
    print(f"$ {shlex.join(cmd)}    # load {os.getloadavg()[0]:.2f}", flush=True)
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200,
                         env={**os.environ, "PYTHONPATH": ROOT}, **kw)
    if res.returncode:
        tail = (res.stderr.strip() or res.stdout.strip()).splitlines()[-5:]
        sys.exit(f"trace_pictures: exit {res.returncode}: {' | '.join(tail)}")
    return res.stdout


def train(n, flags, trace, args, mpi_flags=None):
    run([*mpirun_argv(n, mpi_flags), sys.executable, *TRAIN, "--steps", "10", "--trace", trace, *flags, *args.extra])


def plot(trace, out):
    run([sys.executable, "-m", "ringzero.plot", "trace", trace, "--step", str(STEP), "-o", out])
    print(f"  -> {out}", flush=True)


def stages(work, out, args):
    for st in ("2", "3"):
        train(4, ["--stage", st, "--overlap"], f"{work}/s{st}", args)
        plot(f"{work}/s{st}", f"{out}/trace-stage{st}.png")


def overlap(work, out, args):
    for on in (True, False):
        d = f"{work}/ov{int(on)}"
        run([os.path.join(ROOT, "launch", "cluster"), "--nodes", "2", "--ranks-per-node", "2", "--link", "1gbit",
             "--prefix", args.cluster_prefix, "--net", str(args.cluster_net), "--logs", f"{work}/cluster-logs",
             "--", "python", "-m", "ringzero.train", *TRAIN[4:], "--stage", "3",
             "--overlap" if on else "--no-overlap", "--steps", "10", "--trace", d, *args.extra])
        plot(d, f"{out}/trace-overlap-{'on' if on else 'off'}.png")


def offload(work, out, args):
    os.makedirs(f"{work}/offload-dir", exist_ok=True)
    train(2, ["--model", "gpt2", "--stage", "3", "--offload", "optimizer", "--offload-dir", f"{work}/offload-dir",
              "--batch", "1"], f"{work}/off", args)
    plot(f"{work}/off", f"{out}/trace-offload.png")


def slow(work, out, args):
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        sys.exit(f"trace_pictures: the slow-rank picture binds 2 ranks to 2 cores; this process has {len(cores)}")
    hog = subprocess.Popen(["taskset", "-c", str(cores[1]), "sh", "-c", "while :; do :; done"])
    print(f"$ taskset -c {cores[1]} sh -c 'while :; do :; done' &    # pid {hog.pid}: rank 1's core, shared",
          flush=True)
    try:
        train(2, [], f"{work}/slow", args, ["--oversubscribe", "--bind-to", "core", "--map-by", "core"])
    finally:
        hog.kill()
        hog.wait()
    print(run([sys.executable, "-m", "ringzero.trace", "summary", f"{work}/slow"]), flush=True)
    plot(f"{work}/slow", f"{out}/trace-slow-rank.png")


PICTURES = {"stages": stages, "overlap": overlap, "offload": offload, "slow": slow}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="stages,overlap,offload,slow", help="which pictures (comma-separated)")
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "img"), help="folder of the PNGs (docs/img)")
    p.add_argument("--work", default="", help="folder of the runs' traces, kept (default: a new temporary one, "
                   "removed at the end)")
    p.add_argument("--cluster-prefix", default="rzpic", help="launch/cluster --prefix (default rzpic)")
    p.add_argument("--cluster-net", type=int, default=21, help="launch/cluster --net (default 21)")
    p.add_argument("--max-load", type=float, default=0.0, help="before each command, wait (10 min at most) for "
                   "the 1-minute load average to fall below this (default 0: do not wait)")
    p.add_argument("extra", nargs="*", help="after --: flags added to every trainer run (a smaller model)")
    args = p.parse_args()
    global MAX_LOAD
    MAX_LOAD = args.max_load
    todo = args.only.split(",")
    bad = sorted(set(todo) - set(PICTURES))
    if bad:
        sys.exit(f"trace_pictures: --only takes stages, overlap, offload, slow; got {','.join(bad)}")
    work = args.work or tempfile.mkdtemp(prefix="trace_pictures-")
    os.makedirs(args.out, exist_ok=True)
    try:
        for name in todo:
            print(f"== {name}", flush=True)
            PICTURES[name](work, os.path.abspath(args.out), args)
    finally:            # a failed run exits through here too: a folder the user did not name is not left behind
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    if args.work:
        print(f"traces in {work}")


if __name__ == "__main__":
    main()
