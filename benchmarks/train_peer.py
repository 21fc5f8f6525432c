"""The training-throughput peer: ringzero stage 2 beside PyTorch on gloo, one run.

What it is
    One script that launches, one after another under mpirun at the same rank
    count, the same GPT trained by

      ddp           torch DistributedDataParallel, fp32, gloo
      fsdp-grad-op  torch FSDP SHARD_GRAD_OP (ZeRO-2), fp32, gloo, one unit per Block, meta-device init
      fsdp-full     torch FSDP FULL_SHARD (ZeRO-3), the same
      fsdp2-full    torch FSDP2 ``fully_shard`` per Block and the root, meta-device init
      ds-zero1/2/3  DeepSpeed ZeRO stage 1/2/3, fp32, gloo, its CPU Adam (stage 3 under zero.Init)
      ringzero      ``python -m ringzero.train --stage 2 --precision fp32 ...`` (``ringzero_args``)
      ringzero-fp16 the same with --precision fp16 (fp16 storage, fp32 compute)
      ringzero-zpp  fp32 with ZeRO++'s three switches, ``--zeropp qwz,hpz,qgz`` (needs --stage 3);
                    its row against the ringzero row is quantized / unquantized, round by round
      ringzero-zpp-blocking
                    the same with ``--no-overlap``: every quantized call where it is read (against
                    ringzero-zpp: what the overlap gains, or costs where ranks share cores)

    and prints tokens/s, peak RSS per rank and the ratio ringzero / peer:

      python benchmarks/train_peer.py --ranks 2,4 --json peer.json
      python benchmarks/train_peer.py --cluster 2x1 --link 1gbit     # across emulated nodes

    ``--cluster KxP`` runs every launch across K emulated nodes of P ranks
    (``launch/cluster``, as root): MPI between the nodes over TCP, gloo bound
    to each node's eth0 with its rendezvous at node 1's address, each node
    on its own share of the cores.

    Every side trains the same GPT (GPTConfig defaults: 4 layers, 4 heads,
    n_embd 256, block = T, or a GPT-2 preset with ``--model gpt2`` ...,
    context 1024, and the dimension flags over it) or the same Llama-family
    model (``--model smollm2-135m``, ``qwen2.5-0.5b``, ``tinyllama-1.1b`` ...:
    the torch side is transformers' own LlamaForCausalLM / Qwen2ForCausalLM
    built from the same config, benchmarks/torch_llama.py; the flags and
    ``--n-kv-head`` over the preset's shapes; peer_models.py), the byte vocabulary (or
    ``--vocab N``: the same bytes as ids of an N-token vocabulary, so the
    embedding and head have GPT-2's 50304 rows, or smollm2's 49152), batch 8 per rank, T = 128,
    from the same initial weights (ringzero's draw for ``--seed``, loaded one
    parameter at a time: no sharded mode holds the whole model; benchmarks/peer_engines.py), with the
    same batches, the same AdamW (decay on the same parameters), the same
    global-norm clipping at 1.0 and the same learning-rate schedule (constant
    unless ``--lr-warmup`` / ``--min-lr-frac``), one thread per rank:
    tests/test_peer_trajectory.py holds the torch ranks to ringzero's losses
    and weights. The loss columns are the mean over ranks on both sides.
    Every mode's step is split into its compute and the communication it
    left exposed (``peer_tables.step_split`` says how each side measures them).
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
from peer_models import describe, peer_flags, resolve_model, vocab_data  # noqa: E402
from peer_tables import (  # noqa: E402
    MODES,
    RZ_EXTRA,
    RZ_MODES,
    TIMELINE,
    TORCH_MODES,
    best_of,
    step_rest,
    step_table,
    table,
    timeline_table,
)

# one thread per rank (ranks share the cores); gloo stays on loopback
THREAD_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
              "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": "lo", "DS_ACCELERATOR": "cpu"}
DS_MODES = tuple(m for m in TORCH_MODES if m.startswith("ds-"))     # need deepspeed too


# ---- the command lines (each in one place) ----------------------------------

def ringzero_args(a, precision: str, metrics: str) -> list:
    """The ringzero trainer's flags for this benchmark: the one place to edit.

    The model is ``resolve_model``'s (a --model preset keeps its context of
    1024 positions; without one the position table is --seq-len long), on the
    same data as the torch side. The learning-rate schedule is the same on
    both sides (constant by default). Evaluation only at the end and no text
    sample keep the timed steps pure training steps, as on the torch side.
    """
    model = ["--model", a.model] if a.model else []
    model += ["--n-kv-head", str(a.n_kv_head)] if a.n_kv_head else []    # a Llama-family preset's
    data = ["--data", a.data] if a.data else []
    return model + data + [
        "--stage", str(a.stage), "--precision", precision, "--n-layer", str(a.n_layer),
        "--n-head", str(a.n_head), "--n-embd", str(a.n_embd), "--batch", str(a.batch),
        "--seq-len", str(a.seq_len), "--steps", str(a.steps), "--seed", str(a.seed),
        "--lr", str(a.lr), "--warmup", str(a.lr_warmup), "--min-lr-frac", str(a.min_lr_frac),
        "--weight-decay", str(a.weight_decay), "--grad-clip", str(a.grad_clip), "--eval-interval", "0",
        "--sample-chars", "0", "--quiet", "--metrics", metrics] + a.rz_extra.split()


def model_args(a) -> list:
    """The torch ranks' flags: the same model, data, batches and schedule (train_peer_worker.py); a
    Llama-family preset's name too (peer_models.peer_flags)."""
    return ["--n-layer", str(a.n_layer), "--n-head", str(a.n_head), "--n-embd", str(a.n_embd),
            "--block", str(a.block), "--data", a.data, "--batch", str(a.batch), "--seq-len", str(a.seq_len),
            "--steps", str(a.steps), "--seed", str(a.seed), "--lr", str(a.lr), "--lr-warmup", str(a.lr_warmup),
            "--min-lr-frac", str(a.min_lr_frac), "--weight-decay", str(a.weight_decay),
            "--grad-clip", str(a.grad_clip), "--compute-steps", str(a.compute_steps)] + peer_flags(a)


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


PORT_TRIES = 3


def _port_taken(log) -> bool:
    """Whether a failed launch's log says its rendezvous port was taken (EADDRINUSE)."""
    with open(log, errors="replace") as f:
        text = f.read()
    return "EADDRINUSE" in text or "address already in use" in text.lower()


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
        flags = ringzero_args(a, RZ_MODES[mode], metrics) + list(RZ_EXTRA.get(mode, ()))
        cmd = prefix + [sys.executable, "-m", "mpi4py", worker, "ringzero", "--out", d,
                        "--rz-module", a.rz_module, "--"] + flags
    else:
        where = (["--master", f"198.18.{a.cluster_net}.1", "--ifname", "eth0"] if a.cluster else [])
        cmd = prefix + [sys.executable, worker, "torch", "--mode", mode, "--out", d,
                        "--port", "PORT", "--timeout", str(a.timeout)] + where + model_args(a)
    log = os.path.join(d, "log.txt")
    t0 = time.perf_counter()
    load = os.getloadavg()[0]           # 1-min load average at launch: the noise gauge
    for attempt in range(PORT_TRIES):
        # the rendezvous port is free when picked but another process may bind it before rank 0's
        # TCPStore does (EADDRINUSE): such a launch never started, so it is launched again on a new port
        port = str(free_port()) if "PORT" in cmd else None          # ringzero's ranks rendezvous through MPI
        ran = [port if c == "PORT" else c for c in cmd]
        rc = launch(ran, log, a.timeout)
        if rc == 0 or port is None or attempt + 1 == PORT_TRIES or not _port_taken(log):
            break
        print(f"!! {mode} at n={n}: port {port} was taken before the rendezvous bound it; "
              f"launching again on another", file=sys.stderr)
    row = {"mode": mode, "ranks": n, "rc": rc, "log": log, "command": " ".join(ran), "load": load,
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
            row["timeline"].update(step_rest(recs[a.warmup:]))
        else:
            times, losses = ranks[0]["step_time_s"], ranks[0]["loss"]
            row["params"], row["layout_params"] = ranks[0]["params"], ranks[0]["layout_params"]
            row.update(torch=ranks[0]["torch"], fwd_bwd_s=ranks[0].get("fwd_bwd_s"),
                       compute_s=ranks[0].get("compute_s"), optimizer=ranks[0].get("optimizer"),
                       deepspeed=ranks[0].get("deepspeed"))
        timed = times[a.warmup:]
        if not timed:
            raise RuntimeError(f"no timed steps: {len(times)} steps, warm-up {a.warmup}")
        rss = [r["peak_rss_bytes"] for r in ranks]
        row["rss_start_max"] = max(r["rss_start_bytes"] for r in ranks)
        row.update(ok=True, tokens_per_s=tokens / statistics.median(timed), step_time_s=times, loss=losses,
                   loss_first=losses[0], loss_last=losses[-1], rss_min=min(rss), rss_max=max(rss))
    except (RuntimeError, OSError, KeyError, ValueError) as e:
        with open(log) as f:
            tail = f.read()[-3000:]
        row.update(ok=False, error=str(e), log_tail=tail)
        print(f"!! {mode} at n={n} failed: {e}; log {log}:\n{tail}", file=sys.stderr)
    return row


def parse(argv=None):
    ap = argparse.ArgumentParser(description="ringzero stage 2 vs torch DDP/FSDP on gloo, "
                                 "same GPT, same rank count, one run.")
    ap.add_argument("--ranks", default="2,4", help="comma list of rank counts (default 2,4)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma list from {','.join(MODES)}")
    ap.add_argument("--steps", type=int, default=15, help="optimizer steps per launch")
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the median")
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--model", default="", help="a preset: GPT-2's gpt2 ... gpt2-xl (context 1024) or a Llama "
                    "family's smollm2-135m ... (transformers' LlamaForCausalLM / Qwen2ForCausalLM as the torch "
                    "peer); the dimension flags override a preset's")
    ap.add_argument("--n-layer", type=int, default=None, help="blocks (default 4, or the preset's)")
    ap.add_argument("--n-head", type=int, default=None, help="heads (default 4, or the preset's)")
    ap.add_argument("--n-embd", type=int, default=None, help="width (default 256, or the preset's)")
    ap.add_argument("--n-kv-head", type=int, default=None, help="a Llama-family preset's KV heads (its own)")
    ap.add_argument("--vocab", type=int, default=None, help="a vocabulary of N ids (e.g. 50257, GPT-2's: "
                    "its head's GEMM) over the same bytes; default: the bytes' 256")
    ap.add_argument("--data", default="", help="the trainer's --data FILE for both sides (default: its corpus)")
    ap.add_argument("--lr", type=float, default=3e-4, help="AdamW peak learning rate (both sides)")
    ap.add_argument("--lr-warmup", type=int, default=0, help="linear warm-up steps of the lr (both sides; "
                    "the trainer's schedule, ringzero.app.config.lr_at)")
    ap.add_argument("--min-lr-frac", type=float, default=1.0, help="cosine decay to lr * this after the "
                    "warm-up (default 1: a constant lr)")
    ap.add_argument("--weight-decay", type=float, default=0.1, help="AdamW, not on biases and norms (both)")
    ap.add_argument("--grad-clip", type=float, default=1.0, help="global-norm clip (both sides)")
    ap.add_argument("--compute-steps", type=int, default=2, help="torch: forward+backward steps of a plain "
                    "model after the run, the step's compute (0: none)")
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
    if a.vocab is not None and (not 256 < a.vocab <= 65536 or a.data):
        ap.error(f"--vocab must be in (256, 65536] and without --data, got {a.vocab}"
                 + (f" and --data {a.data}" if a.data else ""))
    if a.data and not os.path.isfile(a.data):
        ap.error(f"--data {a.data!r} is not a file")
    if a.lr_warmup < 0 or not 0 <= a.min_lr_frac <= 1 or a.compute_steps < 0:
        ap.error(f"need --lr-warmup >= 0, 0 <= --min-lr-frac <= 1, --compute-steps >= 0; got {a.lr_warmup}, "
                 f"{a.min_lr_frac}, {a.compute_steps}")
    try:
        cfg = resolve_model(a)
    except ValueError as e:
        ap.error(f"--model/--n-layer/--n-head/--n-embd/--n-kv-head: {e}")
    if a.seq_len > cfg.block_size:
        ap.error(f"--seq-len must be <= the model's context: expected <= {cfg.block_size}, got {a.seq_len}")
    return a


def main(argv=None):
    a = parse(argv)
    if importlib.util.find_spec("torch") is None and any(m in TORCH_MODES for m in a.modes):
        print("train_peer: torch is not installed (RINGZERO_PEER=1 installs it): the torch rows are skipped")
        a.modes = [m for m in a.modes if m not in TORCH_MODES]
        if not a.modes:
            return 0
    if importlib.util.find_spec("deepspeed") is None and any(m in DS_MODES for m in a.modes):
        print("train_peer: deepspeed is not installed (RINGZERO_PEER=1 installs it): the ds-zero rows are skipped")
        a.modes = [m for m in a.modes if m not in DS_MODES]
        if not a.modes:
            return 0
    work = a.keep or tempfile.mkdtemp(prefix="train_peer-")
    os.makedirs(work, exist_ok=True)
    if a.vocab:
        vocab_data(a, work)
    print(f"train_peer: {describe(a)} block={a.block} vocab {a.vocab or 'of the data'}, batch {a.batch}/rank, "
          f"T={a.seq_len}, lr {a.lr} (warm-up {a.lr_warmup}, to x{a.min_lr_frac}), {a.steps} steps "
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
    st = step_table(rows, a.warmup)
    if st:
        print("\nwhere each mode's step goes (ms, rank 0, medians of the timed steps):\n" + st)
    tl = timeline_table(rows)
    if tl:
        print("\nringzero's step (ms, medians of rank 0's timed steps):\n" + tl)
    params = {r["mode"]: r["params"] for r in rows if r.get("params")}
    layout = [r["layout_params"] for r in rows if r.get("layout_params")]
    if layout:
        params["ringzero layout"] = layout[-1]
    opts = {f"{r['mode']}": r["optimizer"] for r in rows if r.get("optimizer")}
    if opts:
        ds = next((r["deepspeed"] for r in rows if r.get("deepspeed")), None)
        print("AdamW: " + ", ".join(f"{k} {v}" for k, v in opts.items()) + (f" (deepspeed {ds})" if ds else ""))
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
