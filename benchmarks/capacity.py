"""Capacity, measured: the largest GPT each stage trains under a per-rank memory cap the kernel enforces.

What it is
    Every rank runs under ``prlimit --data=CAP`` (RLIMIT_DATA: heap, arrays, thread stacks; no
    privileges, the machine's cgroups untouched). A run "fits" when it trains ``--steps`` steps and every
    rank exits 0; the kernel is the judge: ringzero's own start-up check is turned off
    (``--no-mem-check``, RINGZERO_MEM_CHECK=0). For each mode and Nd the script searches the number of
    layers at a fixed width (doubling, then bisection) for the largest that fits:

        ringzero stage 0, 1, 2, 3        python -m ringzero.train --stage S (fp16 storage, fp32 master and Adam)
        stage 3 + offload                the same with --offload optimizer / optimizer,params (where the
                                         trainer has the flag; else one line says the rows are skipped)
        torch ddp, fsdp-full, fsdp2-full benchmarks/train_peer_worker.py (fp32 params, grads, AdamW: 16 B a
                                         parameter too), gloo, one thread per rank; FSDP built on the meta
                                         device (no rank ever holds the whole model; peer_engines.py)
        ds-zero3                         DeepSpeed ZeRO-3 under deepspeed.zero.Init, its CPU Adam, the same worker,
                                         buckets as Transformers sizes them (width^2; DeepSpeed's own default
                                         of 5e8 elements allocates 2 GB before the first step)
        ds-zero3+nvme                    the same with DeepSpeed's own offload to files (ZeRO-Infinity:
                                         offload_optimizer and offload_param on nvme, its async_io op);
                                         ds-zero3+cpu: its offload to host memory (ZeRO-Offload)

    A peer that cannot start at all (1 layer, no cap: a missing op, a refused config) gets a row that says
    so with the last error line it printed, instead of a search.

    It prints the largest Ψ per mode, its ratio to stage 0's beside the ratio the accounting predicts
    for model state alone (16 : 4 + 12/Nd : 2 + 14/Nd : 16/Nd; the seed's 1 : ~4 : ~8 : Nd at large Nd),
    and what else took the cap at the largest model: the runtime's own baseline (the smallest cap under
    which a 1-layer model of width 64 trains, found the same way), the workspace and activation
    estimates (runtime/budget.py, tools/activations.py) and the model state formula.

        ../shared/memwatch -- python benchmarks/capacity.py --cap 2GiB --nd 2,4,8

What it is not
    A timing, or ringzero's arithmetic checked against itself: the figures are the kernel's verdicts.
    Keep Nd x CAP well under the machine's memory (the script refuses above MemAvailable - 2 GiB).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from train_peer import THREAD_ENV, free_port, mpirun_prefix  # noqa: E402  (benchmarks/ on the path first)
from train_peer_worker import PEER_MODES  # noqa: E402

from ringzero.runtime import accounting as acc  # noqa: E402
from ringzero.runtime.limits import data_limit_prefix  # noqa: E402
from ringzero.sizes import parse_size  # noqa: E402

TINY = {"n_layer": 1, "n_embd": 64, "n_head": 2}     # the baseline's model


def psi_of(n_layer, n_embd, seq_len) -> int:
    from ringzero.nn.gpt import GPTConfig, gpt_units
    from ringzero.runtime.flat import Layout
    return Layout(gpt_units(GPTConfig(n_layer, 1, n_embd, seq_len, 256))).numel


def has_offload() -> bool:
    from dataclasses import fields

    from ringzero.app.config import Config
    return "offload" in {f.name for f in fields(Config)}


def command(mode, n, cap, dims, a, work) -> list:
    """The probe: mpirun, then ``prlimit --data=CAP`` around each rank (none where cap is None)."""
    lim = data_limit_prefix(cap) if cap else []
    model = ["--n-layer", str(dims["n_layer"]), "--n-head", str(dims["n_head"]), "--n-embd", str(dims["n_embd"]),
             "--seq-len", str(a.seq_len), "--batch", str(a.batch), "--steps", str(a.steps)]
    stage, _, off = mode.partition("+")
    if stage in PEER_MODES:
        # --compute-steps 0: the throughput benchmark's compute probe builds a whole plain model at the end
        # DeepSpeed's buckets as Transformers sizes them (its defaults alone take 2 GB fp32 a rank)
        ds = (["--ds-offload", off, "--ds-nvme-dir", os.path.join(work, "offload")] if off else []) + (
            ["--ds-buckets", "hf"] if stage.startswith("ds-") else [])
        return mpirun_prefix(n) + lim + [sys.executable, os.path.join(HERE, "train_peer_worker.py"), "torch",
                                         "--mode", stage, "--out", work, "--port", str(free_port()),
                                         "--timeout", str(a.timeout), "--lr", "3e-4", "--compute-steps", "0"
                                         ] + ds + model
    extra = ["--offload", off.replace("+", ","), "--offload-dir", os.path.join(work, "offload")] if off else []
    return (mpirun_prefix(n) + lim + [sys.executable, "-m", "mpi4py", "-m", "ringzero.train", "--stage", stage,
                                      "--no-mem-check", "--warmup", "1", "--eval-interval", "0", "--eval-batches",
                                      "1", "--sample-chars", "0", "--quiet"] + model + extra)


# what a run that ran out of its RLIMIT_DATA prints (Python, NumPy, OpenBLAS, torch's allocator, a thread
# or a shared library that could not be mapped, ringzero's AllocationError); any other failure is no verdict
OUT_OF_MEMORY = re.compile(r"MemoryError|cannot allocate|can't allocate|Memory allocation|bad_alloc|"
                           r"Resource temporarily unavailable|failed to map segment|out of memory|error code: 12|"
                           r"timed out after", re.IGNORECASE)


class ProbeFailed(Exception):
    """A probe failed twice for a reason that is not memory (its last error line)."""


def probe(mode, n, cap, dims, a) -> bool:
    """True if every rank of one run trains --steps steps under the cap (exit 0); False if it ran out of
    memory (or time). A failure of another kind (a port taken by a neighbour, a peer that died of something
    else) is run once more, then raised (ProbeFailed): it says nothing about what fits."""
    for attempt in (1, 2):
        ok, out = run_probe(mode, n, cap, dims, a)
        if ok or OUT_OF_MEMORY.search(out):
            return ok
        why = last_error(out)
        print(f"    {mode} n={n} {dims['n_layer']} layers: failed, not for memory ({why}); "
              f"{'once more' if attempt == 1 else 'no verdict'}", flush=True)
    raise ProbeFailed(why)


def last_error(out: str) -> str:
    """The last line of ``out`` that names an error (else its last line), for one table cell."""
    lines = [ln.strip() for ln in out.splitlines() if ln.strip(" -=*")]   # not mpirun's banner rules
    errs = [ln for ln in lines if "Error" in ln or "error" in ln] or lines[-1:] or ["(no output)"]
    return errs[-1][-300:].replace("|", "/")


def refusal(mode, n, a) -> str:
    """'' if a peer trains its 1-layer model with no cap; else the last error line it printed. A failure
    that may be the machine's (the port free_port chose, taken by a neighbour before rank 0 bound it; an
    mpirun that could not start) is run once more on a fresh port, as probe does."""
    for _ in (1, 2):
        ok, out = run_probe(mode, n, None, {"n_embd": a.n_embd, "n_head": a.n_head, "n_layer": 1}, a)
        if ok:
            return ""
    return last_error(out)


def run_probe(mode, n, cap, dims, a):
    """(every rank exited 0, the run's output) for one run under the cap."""
    work = tempfile.mkdtemp(prefix="capacity-")
    os.makedirs(os.path.join(work, "offload"))         # --offload-dir must exist (the trainer checks it)
    try:
        env = dict(os.environ, **THREAD_ENV, RINGZERO_MEM_CHECK="0")
        try:
            p = subprocess.run(command(mode, n, cap, dims, a, work), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, env=env, timeout=a.timeout, start_new_session=True)
        except subprocess.TimeoutExpired:
            print(f"    {mode} n={n} {dims['n_layer']} layers: timed out after {a.timeout} s (counted as not fitting)")
            return False, f"timed out after {a.timeout} s"
        if a.verbose:
            print(f"    {mode} n={n} cap {cap} {dims}: rc {p.returncode}")
        if p.returncode == 2:          # the trainer refused its flags: a broken probe, not a verdict
            last = p.stdout.decode(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
            raise SystemExit(f"capacity: the probe's command was refused (exit 2): {last[0]}")
        return p.returncode == 0, p.stdout.decode(errors="replace")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def largest(fits, hi_max: int, rel: float = 0.0) -> int:
    """The largest k in 1..hi_max with fits(k) (fits is monotone: True up to a point), or 0; with ``rel`` > 0
    the bisection stops once the bracket is within rel·k (a lower bound within that fraction of the largest)."""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= hi_max and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, hi_max + 1)             # fits(lo) holds; fits(hi) does not (or hi is past the range)
    while hi - lo > max(1, int(rel * lo)):
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def baseline(mode, n, a) -> int:
    """The smallest cap (to 8 MiB) under which the tiny model trains: the runtime's own RLIMIT_DATA."""
    dims = dict(TINY)
    step, top = 8 << 20, parse_size(a.cap)
    k = largest(lambda j: probe(mode, n, top - j * step, dims, a), top // step - 1)   # caps from the top down
    return top - k * step


def predicted_ratio(mode, nd) -> float | None:
    """Model state alone: stage 0's bytes per parameter over this mode's (what the accounting predicts)."""
    stage, _, off = mode.partition("+")
    if stage not in acc.STAGES:
        return {"ddp": 1.0, "fsdp-full": float(nd), "fsdp2-full": float(nd), "ds-zero3": float(nd)}.get(mode)
    from ringzero.runtime import budget
    t = budget.tier_totals(budget.state_by_tier(stage, 10**6 * nd * 64, nd, offload=off.replace("+", ",")))
    return 16 * 10**6 * nd * 64 / t["ram"]


def what_else(mode, nd, n_layer, a, base) -> str:
    """At the largest model of a ringzero mode: model state, workspace and activations (estimates) and the baseline."""
    stage, _, off = mode.partition("+")
    if stage not in acc.STAGES or not n_layer:
        return ""
    import numpy as np

    from ringzero.comm.schedule import TREE_BYTES
    from ringzero.nn.gpt import GPTConfig, gpt_units
    from ringzero.runtime import budget
    from ringzero.runtime.flat import Layout
    from ringzero.runtime.policy import StagePolicy
    from ringzero.tools.activations import training_bytes
    cfg = GPTConfig(n_layer, a.n_head, a.n_embd, a.seq_len, 256)
    L, P = Layout(gpt_units(cfg), shards=nd), StagePolicy.of(stage)
    st = budget.tier_totals(budget.state_by_tier(stage, L.padded, nd, offload=off.replace("+", ",")))
    ws = budget.workspace_bytes(L, P, np.float16, np.float32, 1, False, 0, 0 if P.gather_params else TREE_BYTES,
                                [u != 0 for u in range(len(L.units))])
    act = training_bytes(cfg, a.batch, a.seq_len, False, 4)
    cap = parse_size(a.cap)
    parts = [("model state", st["ram"]), ("workspace", ws), ("activations", act)]
    rest = cap - sum(v for _, v in parts) - (base or 0)
    return (", ".join(f"{k} {v / 2**20:,.0f}" for k, v in parts) + " MiB (estimates), "
            + (f"baseline {base / 2**20:,.0f} MiB (measured)" if base else "baseline not measured")
            + f"; the other {rest / 2**20:,.0f} MiB of the cap: what one more layer would not fit in, the ring's "
            "scratch, the allocator's slack")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cap", default="2GiB", help="RLIMIT_DATA per rank (prlimit --data), e.g. 2GiB")
    ap.add_argument("--nd", default="2,4,8", help="rank counts, comma-separated")
    ap.add_argument("--stages", default="0,1,2,3", help="ringzero stages")
    ap.add_argument("--offload", default="optimizer,optimizer+params",
                    help="stage 3 with each of these offloads (+ joins tiers); '' for none")
    ap.add_argument("--peers", default="ddp,fsdp-full,fsdp2-full,ds-zero3,ds-zero3+nvme",
                    help="torch modes (needs torch: RINGZERO_PEER=1; ds-*: deepspeed); '' for none")
    ap.add_argument("--n-embd", type=int, default=256, help="the fixed width (default 256)")
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--max-layers", type=int, default=4096, help="the search's upper end")
    ap.add_argument("--resolution", type=float, default=2.0,
                    help="stop bisecting once the bracket is within this percent of the layers found (default 2; "
                         "0: to the layer)")
    ap.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                    help="measure each side's own baseline (the tiny model's smallest cap)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per probe")
    ap.add_argument("--verbose", action="store_true", help="one line per probe")
    a = ap.parse_args(argv)
    cap = parse_size(a.cap)
    nds = [int(x) for x in a.nd.split(",") if x]
    from ringzero.runtime.limits import mem_available
    avail = mem_available()
    if avail is not None and max(nds) * cap > avail - (2 << 30):
        print(f"capacity: Nd {max(nds)} x cap {cap / 2**20:,.0f} MiB = {max(nds) * cap / 2**30:.1f} GiB is more "
              f"than MemAvailable {avail / 2**30:.1f} GiB less 2 GiB: lower --cap or --nd")
        return 2
    modes = [s for s in a.stages.split(",") if s]
    offs = [o for o in a.offload.split(",") if o]
    if offs and not has_offload():
        print("capacity: this trainer has no --offload (the offload tiers): the stage 3 + offload rows are skipped")
        offs = []
    modes += [f"3+{o}" for o in offs]
    import importlib.util
    peers = [p for p in a.peers.split(",") if p]
    if peers and importlib.util.find_spec("torch") is None:
        print("capacity: torch is not installed (RINGZERO_PEER=1 installs it): the torch rows are skipped")
        peers = []
    bad = [p for p in peers if p.partition("+")[0] not in PEER_MODES
           or p.partition("+")[2] not in (("", "cpu", "nvme") if p.startswith("ds-") else ("",))]
    if bad:
        print(f"capacity: --peers must be from {', '.join(PEER_MODES)} (a ds-zero mode +cpu or +nvme), got {bad}")
        return 2
    if any(p.startswith("ds-") for p in peers) and importlib.util.find_spec("deepspeed") is None:
        print("capacity: deepspeed is not installed (RINGZERO_PEER=1 installs it): the ds-zero rows are skipped")
        peers = [p for p in peers if not p.startswith("ds-")]
    modes += peers
    how = "prlimit --data" if data_limit_prefix(cap)[0] == "prlimit" else "ulimit -d: this prlimit cannot run"
    print(f"capacity: RLIMIT_DATA {cap / 2**20:,.0f} MiB per rank ({how}), GPT width {a.n_embd}, "
          f"{a.n_head} heads, batch {a.batch} x {a.seq_len}, {a.steps} steps; largest n_layer that trains",
          flush=True)
    base = {}
    if a.baseline:
        for side in ["0"] + (peers[:1]):
            key = "torch" if side in peers else "ringzero"
            who = f"{'torch ' + side if side in peers else 'ringzero'}, Nd = {min(nds)}"
            try:
                base[key] = b = baseline(side, min(nds), a)
            except ProbeFailed as e:        # one side's floor unknown: the table's rows still say what fits
                print(f"  baseline ({who}): no verdict, a probe failed twice, not for memory: {e}", flush=True)
                continue
            print(f"  baseline ({who}): the tiny model trains under {b / 2**20:,.0f} MiB of RLIMIT_DATA "
                  f"({100 * b / cap:.0f} % of the cap)", flush=True)
    print("| mode | Nd | layers | Ψ | Ψ / stage 0's | the seed's ratio (model state alone, this Nd) "
          "| what else took the cap |")
    print("|---|---|---|---|---|---|---|")
    for n in nds:
        ref = None
        for mode in modes:
            dims = {"n_embd": a.n_embd, "n_head": a.n_head}
            why = refusal(mode, n, a) if mode in peers else ""
            if why:
                print(f"| {mode} | {n} | — | — | — | — | did not start (1 layer, no cap): {why} |", flush=True)
                continue
            try:
                k = largest(lambda j: probe(mode, n, cap, {**dims, "n_layer": j}, a), a.max_layers,
                            a.resolution / 100)
            except ProbeFailed as e:
                print(f"| {mode if mode in peers else 'stage ' + mode} | {n} | — | — | — | — | no verdict: a probe "
                      f"failed twice, not for memory: {e} |", flush=True)
                continue
            psi = psi_of(k, a.n_embd, a.seq_len) if k else 0
            ref = psi if mode == "0" else ref
            pred = predicted_ratio(mode, n)
            ratio = f"{psi / ref:.2f}" if ref else "—"
            side = "torch" if mode in peers else "ringzero"
            top = " (the search's top)" if k == a.max_layers else ""
            pred = "—" if pred is None else f"{pred:.2f}"
            print(f"| {mode if mode in peers else 'stage ' + mode} | {n} | {k}{top} | {psi:,} | {ratio} | "
                  f"{pred} | {what_else(mode, n, k, a, base.get(side))} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
