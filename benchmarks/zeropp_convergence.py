"""ZeRO++'s switches against the unquantized run: held-out loss after N steps, same seed and data.

What it is
    Runs the trainer (``python -m ringzero.train``) once per config at stage 3, the same model,
    seed, data and schedule, with a held-out evaluation every --eval-interval steps::

        off        no --zeropp                                 (the reference)
        qwz        int8 weights in every all-gather
        hpz        the secondary shard inside each node (full precision: changes no bit)
        qgz        int4 gradients through the two-hop all-to-all
        all        qwz,hpz,qgz
        all+ef     qwz,hpz,qgz --zeropp-error-feedback
        qgz+ef     qgz --zeropp-error-feedback                 (not in the default list)
        qgz8       qgz --zeropp-bits 8: int8 gradients         (not in the default list)

    across ``launch/cluster --nodes 2 --ranks-per-node 2`` (--cluster 2x2, as root; the nodes
    are rzq-n1, rzq-n2 at 198.18.49.0/24) or, with --emulate, ``mpirun -n 4`` on one host with
    RINGZERO_EMULATE_NODES=2 (the same node map, the same bits: tests/cluster/test_cluster_zeropp.py).
    Each config writes OUT/NAME.jsonl (the trainer's metrics); the script prints a markdown
    table (final held-out loss, its difference from off in %, the cross-node bytes per step)
    and draws every curve in one PNG with ``python -m ringzero.plot loss``.

        python benchmarks/zeropp_convergence.py --cluster 2x2 --link none --steps 300 \\
            --out /tmp/zeropp --png docs/img/zeropp-convergence.png

    The losses are deterministic (a pure function of the flags): the figures do not depend on
    the machine's load. The step times in the JSONL files do; they are not reported here.

What it is not
    A speed benchmark: benchmarks/train_peer.py --cluster 2x2 times the quantized step.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import cluster_opts

ROOT = cluster_opts.ROOT
PY = sys.executable
CONFIGS = {"off": [], "qwz": ["--zeropp", "qwz"], "hpz": ["--zeropp", "hpz"], "qgz": ["--zeropp", "qgz"],
           "all": ["--zeropp", "qwz,hpz,qgz"],
           "all+ef": ["--zeropp", "qwz,hpz,qgz", "--zeropp-error-feedback"],
           "qgz+ef": ["--zeropp", "qgz", "--zeropp-error-feedback"], "qgz8": ["--zeropp", "qgz", "--zeropp-bits", "8"]}


def trainer_args(a, name: str, out: str) -> list:
    return ["--stage", "3", "--n-layer", str(a.n_layer), "--n-embd", str(a.n_embd), "--n-head", str(a.n_head),
            "--seq-len", str(a.seq_len), "--batch", str(a.batch), "--steps", str(a.steps),
            "--eval-interval", str(a.eval_interval), "--eval-batches", str(a.eval_batches), "--seed", str(a.seed),
            "--quiet", "--metrics", os.path.join(out, f"{name}.jsonl")] + (
                ["--lr", repr(a.lr)] if a.lr else []) + CONFIGS[name] + (
                ["--zeropp-block", str(a.block)] if a.block and CONFIGS[name] else []) + (
                ["--zeropp-grad-block", str(a.grad_block)] if a.grad_block and CONFIGS[name] else [])


def launch(a, out: str) -> list:
    """The command line before ``-m ringzero.train``'s flags."""
    if a.emulate:
        mpirun = os.path.join(os.path.dirname(PY), "mpirun")
        return ["timeout", str(a.timeout), mpirun, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
                "-n", str(a.nodes * a.ppn), "-x", "OMP_NUM_THREADS=1", "-x", "RINGZERO_EMULATE_NODES",
                "-x", "PYTHONPATH", PY, "-m", "mpi4py", "-m", "ringzero.train"]
    return ["timeout", str(a.timeout)] + cluster_opts.prefix(a, os.path.join(out, "logs")) + \
        ["python", "-m", "ringzero.train"]


def final(path: str) -> dict:
    with open(path) as f:
        rows = [json.loads(ln) for ln in f]
    summ = next(r for r in rows if r.get("summary"))
    steps = [r for r in rows if "step" in r and "loss" in r]
    return {"eval": float(summ["eval_loss"]), "train": float(summ["train_loss"]),
            "internode": steps[-1].get("bytes_sent_internode"), "steps": len(steps)}


def _done(path: str, steps: int):
    try:
        r = final(path)
    except (OSError, StopIteration, ValueError, KeyError):
        return None
    return r if r["steps"] == steps else None


def table(res: dict) -> str:
    off = res.get("off", {}).get("eval")
    lines = ["| config | --zeropp | final held-out loss | vs off | train loss (last 10) "
             "| cross-node B/step/rank |",
             "|---|---|---|---|---|---|"]
    for name, r in res.items():
        diff = "" if off is None or name == "off" else f"{100 * (r['eval'] / off - 1):+.2f} %"
        flags = " ".join(CONFIGS[name][1:]) or "(none)"
        lines.append(f"| {name} | {flags} | {r['eval']:.4f} | {diff} | {r['train']:.4f} | {r['internode']:,} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    cluster_opts.add_args(ap, prefix="rzq", net=49)
    ap.add_argument("--emulate", action="store_true", help="mpirun -n K*P on this host, RINGZERO_EMULATE_NODES=K "
                    "(default: --cluster 2x2)")
    ap.add_argument("--configs", default="off,qwz,hpz,qgz,all,all+ef", help=f"comma list of {','.join(CONFIGS)}")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--eval-interval", type=int, default=50)
    ap.add_argument("--eval-batches", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--lr", type=float, default=2e-3, help="the peak learning rate (default 2e-3: of 1e-3, 2e-3 and "
                    "4e-3, the unquantized run ends lowest at 2e-3 at the default model; docs/quantized.md)")
    ap.add_argument("--block", type=int, default=None, help="--zeropp-block (qwz's weights) for every quantized "
                    "config (default: the trainer's, 2048)")
    ap.add_argument("--grad-block", type=int, default=None, help="--zeropp-grad-block (qgz's gradients) for every "
                    "quantized config (default: the trainer's, 256)")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per config")
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "ringzero-zeropp"),
                    help="the metrics files' folder")
    ap.add_argument("--png", default="", help="draw the curves here (python -m ringzero.plot loss)")
    ap.add_argument("--reuse", action="store_true", help="keep a config whose OUT/NAME.jsonl already holds "
                    "--steps steps and a summary (a run cut short goes on where it stopped)")
    a = ap.parse_args(argv)
    a.cluster = a.cluster or "2x2"
    cluster_opts.check(a, "zeropp_convergence.py")
    names = [c.strip() for c in a.configs.split(",") if c.strip()]
    bad = [c for c in names if c not in CONFIGS]
    if bad or not names:
        cluster_opts.fail("zeropp_convergence.py", f"--configs: expected a comma list of {','.join(CONFIGS)}, "
                          f"got {bad[0] if bad else a.configs!r}")
    out = os.path.abspath(a.out)
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=ROOT, RINGZERO_EMULATE_NODES=str(a.nodes))
    if not a.emulate:
        env.pop("RINGZERO_EMULATE_NODES")              # the nodes are real namespaces: MPI finds them
    res = {}
    for name in names:
        done = _done(os.path.join(out, f"{name}.jsonl"), a.steps) if a.reuse else None
        if done:
            res[name] = done
            continue
        cmd = launch(a, out) + trainer_args(a, name, out)
        t0 = time.perf_counter()
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if p.returncode != 0:
            print(f"zeropp_convergence.py: {name} exited {p.returncode}:\n{(p.stdout + p.stderr)[-3000:]}",
                  file=sys.stderr)
            return 1
        res[name] = final(os.path.join(out, f"{name}.jsonl"))
        print(f"{name}: held-out {res[name]['eval']:.4f} after {res[name]['steps']} steps "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    where = (f"mpirun -n {a.nodes * a.ppn}, RINGZERO_EMULATE_NODES={a.nodes}" if a.emulate
             else cluster_opts.describe(a))
    print(f"\nstage 3, {a.n_layer} x {a.n_embd} (seq {a.seq_len}, batch {a.batch} a rank), {a.steps} steps, "
          f"lr {a.lr or 'the trainer default'}, blocks {a.block or 2048} (weights) and {a.grad_block or 256} "
          "(gradients), "
          f"{where}\n")
    print(table(res))
    if a.png:
        files = [os.path.join(out, f"{n}.jsonl") for n in names]
        subprocess.run([PY, "-m", "ringzero.plot", "loss", *files, "-o", a.png], cwd=ROOT, env=env, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
