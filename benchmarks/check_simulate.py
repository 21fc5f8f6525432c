"""Check ``python -m ringzero.simulate`` against real step times it was never fitted on.

    python benchmarks/check_simulate.py                    # n = 2, 4, 8; two GPT sizes; a few minutes
    python benchmarks/check_simulate.py --ns 2 --json out.json
    python benchmarks/check_simulate.py --ns 2 --models 1L-32C --iters 2 --max-bytes 16K   # tiny (smoke test)
    python benchmarks/check_simulate.py --cluster 2x2 --link 1gbit      # across emulated nodes (as root)

1. The collectives bench (``python -m ringzero.bench``, float16, ring only,
   reduce-scatter and all-gather, 1 KiB .. 4 MiB) at each n: the only thing
   the α, β of each (op, n) are fitted on.
2. ``benchmarks/bench_stages.py`` at each n for each model size: the median
   step time of stages 0-3, interleaved in one run.
3. Compute per unit: ``python -m ringzero.simulate measure`` under the same
   mpirun size, just before and just after bench_stages (all ranks time the
   model's own forward_unit/backward_unit at once, so core sharing is in the
   figure; the mean of the two is used, their ratio printed as "drift": the
   machine's load moving under the run).
4. The simulator predicts each stage's step; the table prints predicted
   against measured. On one host the engine runs without overlap, and so
   does the prediction.

--cluster KxP --link RATE (replaces --ns with K·P): every mpirun of 1-3 runs
across K emulated nodes of P ranks (launch/cluster, as root; nodes rzh-n1, ...
at 198.18.7.0/24 by default), so α, β are fitted on collectives that cross the
links, per (op, n) at this placement (the node-aware schedule's cost folded
into them), and compute is timed with each node on its own cores. The engine
overlaps reductions with backward when its ranks span nodes (Zero's
overlap=None), so the table prints the prediction without and with overlap,
the error of the one the engine ran ("ran"), and the bytes one rank sent to
other nodes per step, measured (the engine's last_step_internode) beside the
simulator's internode_per_step.

Every mpirun sits inside a timeout. Ranks get one BLAS thread each. The load
average is printed before and after: on a shared machine, errors that move
with it are the machine's, not the model's.
"""
from __future__ import annotations

import argparse
import json
import os

# one BLAS thread, in this process (the compute measurement) as in every rank
for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_v] = "1"
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import cluster_opts  # noqa: E402  (benchmarks/ on the path first)

MODELS = {   # name: (n_layer, n_head, n_embd, seq_len, batch per rank)
    "4L-256C": (4, 4, 256, 128, 8),
    "2L-128C": (2, 4, 128, 128, 8),
    "1L-32C": (1, 2, 32, 16, 2),      # not a default: the smoke test's (tests/smoke/), seconds per n
}
DEFAULT_MODELS = ("4L-256C", "2L-128C")


def mpirun(n: int, args: list, timeout: int, cluster=None) -> str:
    """Run ``python -m mpi4py ARGS`` on n ranks: under mpirun here, or with ``cluster`` (the parsed
    --cluster flags) across its emulated nodes; its stdout. A failure ends the script (one line)."""
    flags = os.environ.get("MPIRUN_FLAGS", "--oversubscribe --bind-to none"
                           + (" --allow-run-as-root" if os.geteuid() == 0 else "")).split()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    mpi = os.path.join(os.path.dirname(sys.executable), "mpirun")
    if cluster is not None:              # launch/cluster puts the venv's python in place of "python"
        cmd = cluster_opts.prefix(cluster, cluster.logs) + ["python", "-m", "mpi4py", *args]
    else:
        cmd = [mpi if os.path.exists(mpi) else "mpirun", *flags, "-n", str(n),
               sys.executable, "-m", "mpi4py", *args]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT, check=False)
    if res.returncode:    # exit 2 (launch/cluster refused, bad input) passes through
        print(f"check_simulate: {' '.join(args[:3])} at n={n} failed: "
              f"{(res.stderr.strip().splitlines() or ['?'])[-1]}", file=sys.stderr)
        sys.exit(2 if res.returncode == 2 else 1)
    return res.stdout


def read_json(path):
    with open(path) as f:
        return json.load(f)


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def print_fit_held_out(rows):
    """The α–β fit alone: each (op, n) fitted on every other size, the rest predicted."""
    from ringzero.tools import fit
    from ringzero.tools import simulate as sm
    fit_rows, held = fit.split_alternate(rows)
    links = sm.Links.from_rows(fit_rows)
    errs = {}
    for r in held:
        op, n = fit.norm_op(r["op"]), int(r["n"])
        t = float(r["time_us"]) * 1e-6
        errs.setdefault(n, []).append(abs(links.time(op, n, float(r["bytes"])) - t) / t)
    print("\nthe α–β fit itself, per (op, n) with the Ring's step counts, on held-out sizes:")
    for n, e in sorted(errs.items()):
        print(f"  n = {n}: median |error| {100 * np.median(e):.1f} %, max {100 * max(e):.1f} % "
              f"({len(e)} sizes)")


def parse():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ns", default="2,4,8", help="world sizes")
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"of {', '.join(MODELS)}")
    ap.add_argument("--iters", type=int, default=5, help="timed steps per stage in bench_stages")
    ap.add_argument("--max-bytes", default="4M", help="largest collective size the α–β fit sees (default 4M)")
    ap.add_argument("--json", help="write every row here")
    cluster_opts.add_args(ap, replaces="--ns")
    a = ap.parse_args()
    bad = [m for m in a.models.split(",") if m not in MODELS]
    if bad:
        cluster_opts.fail("check_simulate", f"--models: unknown {', '.join(bad)}; expected some of "
                          f"{', '.join(MODELS)}")
    cluster_opts.check(a, "check_simulate")
    try:
        a.ns = [a.nodes * a.ppn] if a.nodes else [int(x) for x in a.ns.split(",")]
    except ValueError:
        cluster_opts.fail("check_simulate", f"--ns must be a comma list of ints, got {a.ns!r}")
    a.models = a.models.split(",")
    return a


def measure(a, tmp, t_start):
    """1-3: the bench rows, and per (model, n) the measured stage rows, the compute and its drift."""
    from ringzero.tools import simulate as sm
    cl = a if a.nodes else None
    if cl is not None:
        a.logs = os.path.join(tmp, "nodes")      # every rank's output (launch/cluster --logs)
    rows = []
    for n in [n for n in a.ns if n > 1]:   # 1. the collectives: what α, β are fitted on
        for op in ("reduce_scatter", "all_gather"):
            f = os.path.join(tmp, f"bench-{op}-{n}.json")
            mpirun(n, ["-m", "ringzero.bench", "-b", "1K", "-e", a.max_bytes, "-f", "2", "-o", op,
                       "-d", "float16", "-c", "0", "--no-mpi", "-n", "10", "-w", "2",
                       "--max-seconds", "0.5", "--json", f], 600, cl)
            with open(f) as fh:
                rows += json.load(fh)["rows"]
    print(f"α–β fitted on {len(rows)} collective rows ({time.time() - t_start:.0f} s)", flush=True)
    meas, comps, drift = {}, {}, {}
    where = (["--cluster", a.cluster, "--link", a.link, "--cluster-prefix", a.cluster_prefix,
              "--cluster-net", str(a.cluster_net)] if cl else [])
    for m in a.models:                  # 2. the real steps
        nl, nh, ne, T, B = MODELS[m]
        for n in a.ns:
            f = os.path.join(tmp, f"stages-{m}-{n}.json")
            dims = ["--n-layer", str(nl), "--n-head", str(nh), "--n-embd", str(ne),
                    "--block-size", str(T), "--vocab", "256", "--seq", str(T), "--batch", str(B)]
            cj = [os.path.join(tmp, f"compute-{m}-{n}-{k}.json") for k in (0, 1)]
            mpirun(n, ["-m", "ringzero.simulate", "measure", *dims, "--json", cj[0]], 600, cl)
            mpirun(n, [os.path.join("benchmarks", "bench_stages.py"), "--n-layer", str(nl),
                       "--n-head", str(nh), "--n-embd", str(ne), "--seq-len", str(T),
                       "--batch", str(B), "--iters", str(a.iters), "--warmup", "1",
                       "--json", f, *where], 600, cl)
            mpirun(n, ["-m", "ringzero.simulate", "measure", *dims, "--json", cj[1]], 600, cl)
            meas[(m, n)] = {r["stage"]: r for r in read_json(f)["rows"]}
            c0, c1 = (read_json(c) for c in cj)         # before and after: their mean
            comps[(m, n)] = sm.Compute(*[list((np.array(c0[k]) + np.array(c1[k])) / 2)
                                         for k in ("fwd", "bwd")],
                                       (c0["cast_s"] + c1["cast_s"]) / 2,
                                       (c0["update_s"] + c1["update_s"]) / 2, None,
                                       f"{n} ranks at once, before and after the bench")
            drift[(m, n)] = (sum(c1["fwd"]) + sum(c1["bwd"])) / (sum(c0["fwd"]) + sum(c0["bwd"]))
            print(f"bench_stages {m} n={n} done ({time.time() - t_start:.0f} s, load {load()})",
                  flush=True)
    return rows, meas, comps, drift


def predict(a, links, meas, comps, drift):
    """4. The model beside each measured stage: without and with overlap, the error of the one that ran."""
    from ringzero.nn.gpt import GPTConfig, gpt_units
    from ringzero.runtime.flat import Layout
    from ringzero.tools import simulate as sm
    table = []
    for m in a.models:
        nl, nh, ne, T, B = MODELS[m]
        L = Layout(gpt_units(GPTConfig(nl, nh, ne, T, 256)))
        for n in a.ns:
            for st in ("0", "1", "2", "3"):
                p = [sm.step_time(L, st, n, comps[(m, n)], links, ov) for ov in (False, True)]
                got = meas[(m, n)][st]
                ran = bool(got.get("overlap", False))
                r = {"model": m, "n": n, "stage": st, "measured_s": got["median_step_s"],
                     "predicted_s": p[ran]["step_s"], "predicted_no_overlap_s": p[0]["step_s"],
                     "predicted_overlap_s": p[1]["step_s"], "overlap_ran": ran,
                     "compute_s": p[ran]["compute"], "comm_s": p[ran]["comm"], "update_s": p[ran]["update"],
                     "rel_err": (p[ran]["step_s"] - got["median_step_s"]) / got["median_step_s"],
                     "compute_drift": drift[(m, n)]}
                if a.nodes:
                    r["internode_measured_bytes"] = got.get("bytes_sent_internode")
                    r["internode_predicted_bytes"] = sm.internode_per_step(L, st, n, a.nodes)
                table.append(r)
    return table


def print_table(a, table):
    ms = lambda x: f"{x * 1e3:>9.1f}ms"   # noqa: E731
    pred = f"{'no overlap':>11}{'overlap':>11}" if a.nodes else f"{'predicted':>11}"
    print(f"\n{'model':<9}{'n':>3}{'stage':>6}{'measured':>11}{pred}{'error':>8}"
          f"{'compute':>10}{'comm':>9}{'update':>9}{'drift':>7}"
          + (f"{'ran':>8}{'across nodes: measured':>24}{'model':>14}" if a.nodes else ""))
    for r in table:
        pred = ms(r["predicted_no_overlap_s"]) + ms(r["predicted_overlap_s"]) if a.nodes else ms(r["predicted_s"])
        line = (f"{r['model']:<9}{r['n']:>3}{r['stage']:>6}{ms(r['measured_s'])}{pred}{100 * r['rel_err']:>+7.1f}%"
                f"{r['compute_s'] * 1e3:>8.1f}ms{r['comm_s'] * 1e3:>7.1f}ms{r['update_s'] * 1e3:>7.1f}ms"
                f"{r['compute_drift']:>7.2f}")
        if a.nodes:
            got = r["internode_measured_bytes"]
            got = f"{got:,}" if got is not None else "?"
            line += (f"{'overlap' if r['overlap_ran'] else 'none':>8}{got:>22} B"
                     f"{r['internode_predicted_bytes']:>12,.0f} B")
        print(line)
    if a.nodes:
        print("error: of the prediction the engine ran (\"ran\": it overlaps reductions with backward when "
              "its ranks span nodes); across nodes: bytes one rank sent to other nodes per step")


def main():
    a = parse()
    from ringzero.tools import simulate as sm
    t_start = time.time()
    print(f"load average at start: {load()} ({os.cpu_count()} cores)"
          + (f"; {cluster_opts.describe(a)}" if a.nodes else ""), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        rows, meas, comps, drift = measure(a, tmp, t_start)
    # n = 1 sends nothing: any link will do
    links = sm.Links.from_rows(rows) if rows else sm.Links.given(0.0, float("inf"), "none (n = 1)")
    table = predict(a, links, meas, comps, drift)
    print(f"\nload average at end: {load()}; total {time.time() - t_start:.0f} s")
    print_table(a, table)
    err = np.abs([r["rel_err"] for r in table])
    print(f"\n|error|: median {100 * np.median(err):.1f} %, max {100 * err.max():.1f} %, "
          f"{int((err <= 0.2).sum())} of {len(err)} within 20 %")
    for n in a.ns:
        e = np.abs([r["rel_err"] for r in table if r["n"] == n])
        print(f"  n = {n}: median {100 * np.median(e):.1f} %, max {100 * e.max():.1f} %")
    if rows:
        print_fit_held_out(rows)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"table": table, "fits": {f"{k[0]}@{k[1]}": v for k, v in links.fits.items()},
                       "cluster": a.cluster, "link": a.link if a.nodes else None, "bench_rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
