"""The training-throughput peer: ringzero stage 2 beside PyTorch on gloo, one run.

What it is
    One script that launches, one after another under mpirun at the same rank
    count, the same GPT trained by

      ddp           torch DistributedDataParallel, fp32, gloo
      fsdp-grad-op  torch FSDP SHARD_GRAD_OP (ZeRO-2), fp32, gloo, one unit per Block
      fsdp-full     torch FSDP FULL_SHARD (ZeRO-3), fp32, gloo, one unit per Block
      ringzero      ``python -m ringzero.train --stage 2 --precision fp32 ...`` (``ringzero_args``)
      ringzero-fp16 the same with --precision fp16 (fp16 storage, fp32 compute)

    and prints tokens/s, peak RSS per rank and the ratio ringzero / peer:

      python benchmarks/train_peer.py --ranks 2,4 --json peer.json
      python benchmarks/train_peer.py --cluster 2x1 --link 1gbit     # across emulated nodes

    ``--cluster KxP`` runs every launch across K emulated nodes of P ranks
    (``launch/cluster``, as root): MPI between the nodes over TCP, gloo bound
    to each node's eth0 with its rendezvous at node 1's address, each node
    on its own share of the cores.

    Every side gets the same config (GPTConfig defaults: 4 layers, 4 heads,
    n_embd 256, block 128, vocab 256), batch 8 per rank, T = 128, AdamW with
    the same lr and global-norm clipping at 1.0, one thread per rank, and the
    same batches (ringzero.app.data's default corpus).
    tokens/s of a step = world * batch * T / (rank 0's wall time of the step),
    median over the steps after ``--warmup``; the same formula is applied to
    ringzero's ``step_time_s`` metric (its ``tokens_per_s`` is cross-checked).
    Peak RSS is each rank's ``ru_maxrss`` at exit, for both sides alike: the
    ranks run ``benchmarks/train_peer_worker.py`` (the ringzero side through
    its ``ringzero`` shim, which only adds that measurement). "RSS at start" is the resident size once
    the libraries are imported, before any model exists (torch alone is a few
    hundred MiB of it).

What it is not
    A ringzero dependency (torch is imported only in the torch workers), or a
    timing harness for anything but whole optimizer steps. The machine is
    noisy: compare the ratios of one run, not absolute figures across runs.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import cluster_opts  # noqa: E402  (benchmarks/ on the path first)

TORCH_MODES = ("ddp", "fsdp-grad-op", "fsdp-full")
RZ_MODES = {"ringzero": "fp32", "ringzero-fp16": "fp16"}   # mode -> --precision
MODES = TORCH_MODES + tuple(RZ_MODES)
# one thread per rank (ranks share the cores); gloo stays on loopback
THREAD_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
              "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": "lo"}


# ---- the command lines (each in one place) ----------------------------------

def ringzero_args(a, precision: str, metrics: str) -> list:
    """The ringzero trainer's flags for this benchmark: the one place to edit.

    Its position table is --seq-len long (the torch side uses block = seq_len
    too). A constant learning rate, as on the torch side, makes the loss
    columns comparable. Evaluation only at the end and no text sample keep the
    timed steps pure training steps, as on the torch side.
    """
    return ["--stage", str(a.stage), "--precision", precision, "--n-layer", str(a.n_layer),
            "--n-head", str(a.n_head), "--n-embd", str(a.n_embd), "--batch", str(a.batch),
            "--seq-len", str(a.seq_len), "--steps", str(a.steps), "--seed", str(a.seed),
            "--lr", str(a.lr), "--warmup", "0", "--min-lr-frac", "1",   # constant lr, as torch
            "--grad-clip", str(a.grad_clip), "--eval-interval", "0",
            "--sample-chars", "0", "--quiet", "--metrics", metrics] + a.rz_extra.split()


def model_args(a) -> list:
    return ["--n-layer", str(a.n_layer), "--n-head", str(a.n_head), "--n-embd", str(a.n_embd),
            "--batch", str(a.batch), "--seq-len", str(a.seq_len), "--steps", str(a.steps),
            "--seed", str(a.seed), "--lr", str(a.lr), "--grad-clip", str(a.grad_clip)]


CLUSTER = dict(prefix="rzp", net=5)     # launch/cluster's nodes for --cluster: rzp-n1 at 198.18.5.1


def mpirun_prefix(n: int) -> list:
    """mpirun for n ranks sharing the cores: one thread each, no binding."""
    venv_mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    mpirun = venv_mpirun if os.path.exists(venv_mpirun) else shutil.which("mpirun")
    if not mpirun:
        raise SystemExit("train_peer: no mpirun next to this python or on PATH")
    out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, check=False).stdout
    cmd = [mpirun]
    if "open mpi" in out.lower():
        cmd += ["--oversubscribe", "--bind-to", "none"]
        if os.getuid() == 0:
            cmd.append("--allow-run-as-root")
        for v in THREAD_ENV:
            cmd += ["-x", v]
    return cmd + ["-n", str(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the driver ----------------------------------------------------------------

def launch(cmd, log, timeout):
    """Run one mpirun job in its own process group; kill that group on timeout."""
    env = dict(os.environ, **THREAD_ENV)
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                             start_new_session=True, cwd=os.path.dirname(HERE))
        try:
            return p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            return 124


def _rank_files(d, n):
    out = []
    for r in range(n):
        path = os.path.join(d, f"rank-{r}.json")
        if not os.path.exists(path):
            raise RuntimeError(f"rank {r} wrote no result ({path})")
        with open(path) as f:
            out.append(json.load(f))
    return out


def _read_metrics(path):
    """(per-step records sorted by step, the summary record or {})."""
    from ringzero.metrics import read_metrics
    rows, summary = read_metrics(path)
    return sorted(rows, key=lambda r: r["step"]), summary or {}


def run_mode(mode, n, a, work):
    """Launch one mode at n ranks; return its table row (dict)."""
    d = os.path.join(work, f"{mode}-n{n}")
    os.makedirs(d, exist_ok=True)
    tokens = n * a.batch * a.seq_len                   # global tokens per step
    worker = os.path.join(HERE, "train_peer_worker.py")
    prefix = cluster_opts.prefix(a, os.path.join(d, "nodes")) if a.cluster else mpirun_prefix(n)
    if mode in RZ_MODES:
        metrics = os.path.join(d, "metrics.jsonl")
        cmd = prefix + [sys.executable, "-m", "mpi4py", worker, "ringzero", "--out", d,
                        "--rz-module", a.rz_module, "--"] + ringzero_args(a, RZ_MODES[mode], metrics)
    else:
        where = (["--master", f"198.18.{a.cluster_net}.1", "--ifname", "eth0"] if a.cluster else [])
        cmd = prefix + [sys.executable, worker, "torch", "--mode", mode, "--out", d,
                        "--port", str(free_port()), "--timeout", str(a.timeout)] + where + model_args(a)
    log = os.path.join(d, "log.txt")
    t0 = time.perf_counter()
    load = os.getloadavg()[0]           # 1-min load average at launch: the noise gauge
    rc = launch(cmd, log, a.timeout)
    row = {"mode": mode, "ranks": n, "rc": rc, "log": log, "command": " ".join(cmd), "load": load,
           "wall_s": round(time.perf_counter() - t0, 1)}
    try:
        if rc != 0:
            raise RuntimeError(f"exit code {rc}" + (" (timeout)" if rc == 124 else ""))
        ranks = _rank_files(d, n)
        if mode in RZ_MODES:
            recs, summary = _read_metrics(metrics)
            row["params"] = summary.get("params")
            times = [r["step_time_s"] for r in recs]
            losses = [r["loss"] for r in recs]
            own = [r["tokens_per_s"] for r in recs[a.warmup:] if "tokens_per_s" in r]
            row["reported_tokens_per_s"] = statistics.median(own) if own else None
            row["timeline"] = {k: statistics.median(r[k] for r in recs[a.warmup:])
                               for k in TIMELINE if all(k in r for r in recs[a.warmup:])}
        else:
            times, losses = ranks[0]["step_time_s"], ranks[0]["loss"]
            row["params"], row["layout_params"] = ranks[0]["params"], ranks[0]["layout_params"]
            row["torch"] = ranks[0]["torch"]
        timed = times[a.warmup:]
        if not timed:
            raise RuntimeError(f"no timed steps: {len(times)} steps, warm-up {a.warmup}")
        rss = [r["peak_rss_bytes"] for r in ranks]
        row["rss_start_max"] = max(r["rss_start_bytes"] for r in ranks)
        row.update(ok=True, tokens_per_s=tokens / statistics.median(timed), step_time_s=times,
                   loss_first=losses[0], loss_last=losses[-1], rss_min=min(rss), rss_max=max(rss))
    except (RuntimeError, OSError, KeyError, ValueError) as e:
        with open(log) as f:
            tail = f.read()[-3000:]
        row.update(ok=False, error=str(e), log_tail=tail)
        print(f"!! {mode} at n={n} failed: {e}; log {log}:\n{tail}", file=sys.stderr)
    return row


def best_of(launches):
    """One row per (mode, ranks): the fastest good launch (the least disturbed
    by other load), with every launch's figure and load kept beside it."""
    good = [r for r in launches if r.get("ok")]
    if not good:
        return launches[-1]
    best = dict(max(good, key=lambda r: r["tokens_per_s"]))
    best["tokens_per_s_all"] = [round(r["tokens_per_s"]) if r.get("ok") else None for r in launches]
    best["load_all"] = [r["load"] for r in launches]
    return best


def paired_ratios(launches, rz_mode, peer, n):
    """ringzero / peer tokens/s per round, both launches of a round adjacent in
    time, so slow swings of the machine's load largely cancel."""
    a, b = launches.get((rz_mode, n), []), launches.get((peer, n), [])
    return [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(a, b) if x.get("ok") and y.get("ok")]


TIMELINE = ("step_time_s", "fwd_bwd_s", "compute_s", "comm_s", "reduce_s", "reduce_exposed_s",
            "gather_s", "gather_exposed_s", "param_gather_exposed_s", "progress_cpu_s")


def timeline_table(rows):
    """Where ringzero's step goes (rank 0's metrics, medians over the timed steps, ms): the
    forward+backward beside its compute and its collectives' own time (hidden or not), and the
    overlap's figure of merit, forward+backward / max(compute, communication): 1.00 when the
    shorter of the two is wholly hidden."""
    rz = [r for r in rows if r.get("ok") and r.get("timeline")]
    if not rz:
        return ""
    lines = ["| mode | ranks | step | fwd+bwd | compute | comm (run) | reductions exposed | gathers exposed | "
             "update's gathers exposed | progress thread on a core | fwd+bwd / max(compute, comm) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rz:
        t = r["timeline"]
        ms = lambda k: f"{t[k] * 1e3:.1f}" if k in t else "—"      # noqa: E731
        merit = t["fwd_bwd_s"] / max(t["compute_s"], t["comm_s"]) if "comm_s" in t else None
        lines.append(f"| {r['mode']} | {r['ranks']} | {ms('step_time_s')} | {ms('fwd_bwd_s')} | {ms('compute_s')} | "
                     f"{ms('comm_s')} | {ms('reduce_exposed_s')} | {ms('gather_exposed_s')} | "
                     f"{ms('param_gather_exposed_s')} | {ms('progress_cpu_s')} | {f'{merit:.2f}' if merit else '—'} |")
    return "\n".join(lines)


def table(rows, launches):
    """Markdown table. tokens/s is each mode's fastest launch; a ratio cell is
    the median of the per-round ratios, with their range when rounds > 1."""
    cols = [m for m in RZ_MODES if any(r["mode"] == m and r.get("ok") for r in rows)]
    head = "".join(f" {m} / peer |" for m in cols)
    lines = [(f"| mode | ranks | tokens/s | peak RSS per rank | RSS at start | loss first → last |{head}"
              " every launch (load) |"), "|---|---|---|---|---|---|" + "---|" * len(cols) + "---|"]
    for r in rows:
        if not r.get("ok"):
            lines.append(f"| {r['mode']} | {r['ranks']} | failed: {r['error']} | — | — | — |"
                         + " — |" * len(cols) + " — |")
            continue
        mib = f"{r['rss_min'] / 2**20:.0f}–{r['rss_max'] / 2**20:.0f} MiB"
        ratio = ""
        for m in cols:
            q = paired_ratios(launches, m, r["mode"], r["ranks"]) if r["mode"] in TORCH_MODES else []
            span = f" ({min(q):.2f}–{max(q):.2f})" if len(q) > 1 else ""
            ratio += f" {statistics.median(q):.2f}×{span} |" if q else " — |"
        every = ", ".join(f"{t if t is not None else 'failed'} ({ld:.1f})"
                          for t, ld in zip(r["tokens_per_s_all"], r["load_all"]))
        lines.append(f"| {r['mode']} | {r['ranks']} | {r['tokens_per_s']:.0f} | {mib} | "
                     f"{r['rss_start_max'] / 2**20:.0f} MiB | "
                     f"{r['loss_first']:.3f} → {r['loss_last']:.3f} |{ratio} {every} |")
    return "\n".join(lines)


def parse(argv=None):
    ap = argparse.ArgumentParser(description="ringzero stage 2 vs torch DDP/FSDP on gloo, "
                                 "same GPT, same rank count, one run.")
    ap.add_argument("--ranks", default="2,4", help="comma list of rank counts (default 2,4)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma list from {','.join(MODES)}")
    ap.add_argument("--steps", type=int, default=15, help="optimizer steps per launch")
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the median")
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate (both sides)")
    ap.add_argument("--grad-clip", type=float, default=1.0, help="global-norm clip (both sides)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stage", default="2", help="ringzero stage (default 2)")
    ap.add_argument("--rz-module", default="ringzero.train", help="the trainer module to run")
    ap.add_argument("--rz-extra", default="", help="extra flags for the ringzero trainer, one string")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds over all modes; each mode's fastest launch is reported")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per launch")
    ap.add_argument("--json", default=None, help="write the rows (with per-step times) here")
    ap.add_argument("--keep", default=None, help="keep logs and metrics in this folder")
    cluster_opts.add_args(ap, replaces="--ranks", **CLUSTER)
    a = ap.parse_args(sys.argv[1:] if argv is None else argv)
    cluster_opts.check(a, "train_peer")
    if a.cluster:
        a.ranks = str(a.nodes * a.ppn)
    try:
        a.ranks = [int(x) for x in a.ranks.split(",") if x]
    except ValueError:
        ap.error(f"--ranks must be a comma list of ints, got {a.ranks!r}")
    a.modes = [m for m in a.modes.split(",") if m]
    bad = [m for m in a.modes if m not in MODES]
    if bad or not a.modes:
        ap.error(f"--modes must be from {','.join(MODES)}, got {bad or a.modes}")
    if min(a.ranks, default=0) < 1:
        ap.error(f"--ranks must be >= 1, got {a.ranks}")
    if a.steps <= a.warmup or a.warmup < 0:
        ap.error(f"need 0 <= --warmup < --steps, got warmup {a.warmup}, steps {a.steps}")
    if a.repeat < 1:
        ap.error(f"--repeat must be >= 1, got {a.repeat}")
    return a


def main(argv=None):
    a = parse(argv)
    if importlib.util.find_spec("torch") is None and any(m in TORCH_MODES for m in a.modes):
        print("train_peer: torch is not installed (RINGZERO_PEER=1 installs it): the torch rows are skipped")
        a.modes = [m for m in a.modes if m not in TORCH_MODES]
        if not a.modes:
            return 0
    work = a.keep or tempfile.mkdtemp(prefix="train_peer-")
    os.makedirs(work, exist_ok=True)
    print(f"train_peer: GPT n_layer={a.n_layer} n_head={a.n_head} n_embd={a.n_embd} "
          f"block={a.seq_len}, batch {a.batch}/rank, T={a.seq_len}, {a.steps} steps "
          f"({a.warmup} warm-up), {a.repeat} round(s), logs in {work}"
          + (f"; {cluster_opts.describe(a)}" if a.cluster else ""),
          flush=True)
    launches = {}
    for rnd in range(a.repeat):         # rounds interleave the modes, so a noisy spell
        for n in a.ranks:               # on the machine hits every mode alike
            for mode in a.modes:
                row = run_mode(mode, n, a, os.path.join(work, f"round{rnd}"))
                launches.setdefault((mode, n), []).append(row)
                if row.get("ok"):
                    print(f"  round {rnd} {mode:13s} n={n}: {row['tokens_per_s']:8.0f} tokens/s  "
                          f"(load {row['load']:.1f}, {row['wall_s']} s launch)", flush=True)
    rows = [best_of(launches[(m, n)]) for n in a.ranks for m in a.modes]
    print(table(rows, launches))
    tl = timeline_table(rows)
    if tl:
        print("\nringzero's step (ms, medians of rank 0's timed steps):\n" + tl)
    params = {r["mode"]: r["params"] for r in rows if r.get("params")}
    layout = [r["layout_params"] for r in rows if r.get("layout_params")]
    if layout:
        params["ringzero layout"] = layout[-1]
    if params:
        print("params: " + ", ".join(f"{k} {v:,}" for k, v in params.items())
              + ("" if len(set(params.values())) == 1 else "  !! MISMATCH: the models differ"))
    for r in rows:
        own = r.get("reported_tokens_per_s")
        if own and abs(own / r["tokens_per_s"] - 1) > 0.10:
            print(f"note: ringzero n={r['ranks']} reports {own:.0f} tokens/s, step_time_s gives "
                  f"{r['tokens_per_s']:.0f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": vars(a),
                       "rows": rows, "launches": [r for v in launches.values() for r in v]},
                      f, indent=1)
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
