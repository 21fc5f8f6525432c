"""``python -m ringzero.estimate``: will it fit? ZeRO's memory and traffic arithmetic per rank.

What it is
    A calculator over ringzero.runtime.accounting (model state per stage, traffic per
    step) plus the tenants that formula leaves out: activations of a GPT with and
    without activation checkpointing, and a flattened fp32 all-reduce buffer.
    Ψ comes from the same layout table the model uses (``Layout(gpt_units(cfg))``)
    when a GPT shape is given, or from ``--params 7.5B``. Every figure is
    computed; where the seed document rounds, the exact value is printed beside.
    ``--precision bf16`` gives fp16's bytes (bf16 is 2 B too; fp32 master and
    Adam either way) and says so; ``--grad-accum K`` adds the fp32 gradient
    accumulator and multiplies stage 3's traffic by K (accounting's table).
    With a GPT shape, the model state is also given on the padded Ψ of
    ringzero's own layout at this Nd: the bytes its buffers take.
    ``--ram / --disk / --device-mem`` add the memory tiers: each stage's bytes
    per rank in RAM, device memory and on disk, with and without offload, and
    which configurations fit (tools/tiers.py).

What it is not
    A measurement. ``python -m ringzero.train`` prints measured bytes beside
    these formulas; this tool only does the arithmetic, for any size.

GB here is 10^9 bytes (what the ZeRO paper and the seed use); GiB is 2^30.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

from ringzero.nn import families
from ringzero.nn.gpt import PRESETS, GPTConfig
from ringzero.nn.llama_config import PRESETS as LLAMA_PRESETS
from ringzero.runtime import accounting as acc
from ringzero.runtime.flat import Layout
from ringzero.sizes import parse_count, parse_size
from ringzero.tools.activations import ACT_FORMULAS, activations

GB, GIB = 10**9, 2**30
FSDP_NAME = {"0": "NO_SHARD", "1": "-", "2": "SHARD_GRAD_OP", "3": "FULL_SHARD",
             "hybrid": "HYBRID_SHARD"}


# Paper shapes the estimator knows beside the GPT-2 presets: (config, default batch, note).
PAPER_PRESETS = {
    "zero-100b": (GPTConfig(125, 64, 8192, 1024, 50257), 32,
                  "the ZeRO paper (Rajbhandari et al. 2020, §3.2, as the seed quotes it): a 100B "
                  "model still needs ~60 GB of activations with checkpointing. Assumed here: batch 32 "
                  "and seq 1K as for the paper's GPT-2 figure, 125 layers, hidden 8192 (12·L·h² = "
                  "100.7B), GPT-2 vocabulary; heads (64) do not enter the ZeRO count."),
}
ALL_MODELS = {**PRESETS, **LLAMA_PRESETS, **{k: v[0] for k, v in PAPER_PRESETS.items()}}


def gpt_psi(cfg) -> int:
    """Ψ of a model config (a GPT's or a Llama's), from its layout table (nn/families.py)."""
    return Layout(families.units_of(cfg)).numel


def sig3(x: float) -> str:
    """Three significant figures, the way the seed prints its table (1.875 -> 1.88)."""
    return f"{x:.3g}" if x < 1000 else f"{x:.0f}"


# ---- fit ------------------------------------------------------------------------
def smallest_group(stage, psi: int, budget: int, extra: int, precision: str = "fp16",
                   grad_accum: int = 1, nd_max: int = 1 << 24):
    """Smallest Nd (Ng for hybrid) at which model state + ``extra`` fits ``budget``; None if never."""
    st = acc.parse_stage(stage)

    def need(n):
        return acc.model_state_total(st, psi, n, n if st == "hybrid" else None, precision,
                                     grad_accum) + extra
    if need(nd_max) > budget:
        return None
    lo, hi = 1, nd_max          # need(n) never grows with n: bisect for the first fit
    while lo < hi:
        mid = (lo + hi) // 2
        if need(mid) <= budget:
            hi = mid
        else:
            lo = mid + 1
    return lo


def padded_psi(cfg: GPTConfig, group: int) -> int:
    """Ψ padded by ringzero's layout for a sharding group of ``group`` ranks (what it allocates)."""
    return Layout(families.units_of(cfg), shards=group).padded


def estimate(psi: int, nd: int, ranks_per_node=None, cfg: GPTConfig | None = None,
             batch: int | None = None, seq: int | None = None, gpu_mem: int | None = None,
             temp_buffer: str = "fp32-flat", precision: str = "fp16", grad_accum: int = 1) -> dict:
    """Everything the CLI prints, as a dict (the --json output)."""
    stages = [s for s in acc.STAGES if s != "hybrid" or ranks_per_node]
    K, pr = grad_accum, precision
    rows = []
    for st in stages:
        by = acc.model_state_bytes(st, psi, nd, ranks_per_node, pr, K)
        tot = sum(by.values())
        el = acc.traffic_elements(st, psi, nd, ranks_per_node, K)
        tb = sum(acc.traffic_bytes(st, psi, nd, ranks_per_node, grad_accum=K, precision=pr).values())
        row = {
            "stage": st, "fsdp": FSDP_NAME[st], "formula": acc.bytes_per_param_formula(st, pr, K),
            "bytes_per_param": acc.bytes_per_param(st, nd, ranks_per_node, pr, K),
            "bytes": tot, "GB": tot / GB, "GiB": tot / GIB, "by_class": by,
            "traffic_formula": acc.traffic_formula(st, K),
            "traffic_elements": sum(el.values()), "traffic_by_collective": el,
            "traffic_bytes": tb, "traffic_bytes_per_micro_batch": tb / K,
        }
        if cfg is not None:      # ringzero's own buffers: the padded Ψ of its layout
            group = ranks_per_node if st == "hybrid" else nd
            pp = padded_psi(cfg, group)
            row["psi_padded"] = pp
            row["bytes_padded"] = acc.model_state_total(st, pp, nd, ranks_per_node, pr, K)
            row["by_class_padded"] = acc.model_state_bytes(st, pp, nd, ranks_per_node, pr, K)
        rows.append(row)
    out = {"psi": psi, "nd": nd, "ranks_per_node": ranks_per_node, "stages": rows,
           "precision": pr, "grad_accum": K, "loss_scaler": pr == "fp16",
           "buffers": {"fp32_flat_allreduce_bytes": 4 * psi,
                       "fp16_flat_allreduce_bytes": 2 * psi}}
    act = None
    if cfg is not None and batch:
        act = activations(cfg, batch, seq)
        out["activations"] = {"batch": batch, "seq": seq, "bytes": act, "formulas": ACT_FORMULAS,
                              "global_batch": batch * K * nd}
    if gpu_mem:
        buf = {"fp32-flat": 4 * psi, "fp16-flat": 2 * psi, "none": 0}[temp_buffer]
        extra = {"no_ckpt": (act["zero_paper"] if act else 0) + buf,
                 "ckpt": (act["zero_ckpt"] if act else 0) + buf}
        fit = []
        for r in rows:
            f = {"stage": r["stage"]}
            for k, e in extra.items():
                f[k] = {"need_bytes": r["bytes"] + e, "fits": r["bytes"] + e <= gpu_mem,
                        "smallest_group": smallest_group(r["stage"], psi, gpu_mem, e, pr, K)}
            fit.append(f)
        out["fit"] = {"gpu_mem": gpu_mem, "activations_counted": act is not None,
                      "temp_buffer": temp_buffer, "temp_buffer_bytes": buf,
                      "activation_formula": "zero_paper / zero_ckpt", "stages": fit}
    # Other accountings users meet, labelled (bytes per rank at this Nd).
    out["other_accountings"] = {
        "deepspeed_zero2_estimator (2Ψ + 18Ψ/N)": 2 * psi + 18 * psi / nd,
        "megatron_distributed_optimizer_fp16 (4Ψ + 16Ψ/N)": 4 * psi + 16 * psi / nd,
        "megatron_optimizer_fp16_not_distributed (20Ψ)": 20 * psi,
    }
    return out


# ---- printing -------------------------------------------------------------------
def _g(b):
    return f"{b / GB:,.4f}"


def _print_per_param(p, r):
    """Bytes per parameter of each state class at stage 0."""
    pr, K = r["precision"], r["grad_accum"]
    p(f"Model state per parameter ({pr} params and grads, fp32 master and Adam"
      + (f", fp32 gradient accumulator for {K} micro-batches" if K > 1 else "") + "), stage 0:")
    s0 = r["stages"][0]["by_class"]
    cb = acc.class_bytes(pr, K)
    for c in s0:
        p(f"  {acc.class_name(c, pr):<16} {cb[c]} B/param  {_g(s0[c]):>14} GB  "
          f"{100 * s0[c] / sum(s0.values()):5.1f} % of model state")
    if pr == "bf16":
        p("  bf16 takes the same bytes as fp16 (2 B params and grads, 12 B of fp32 master, m, v): "
          "every formula below is the fp16 one. What bf16 changes is range, so it runs without a "
          "loss scaler (python -m ringzero.explain precision).")


def _print_stages(p, r):
    """The stage table (bytes per rank, traffic per step), its notes, the padded buffers, the temporaries."""
    pr, K = r["precision"], r["grad_accum"]
    p("")
    hdr = (f"{'stage':<7}{'FSDP':<14}{'bytes/param':<13}{'B/param':>8}{'GB exact':>16}{'GB 3sf':>8}"
           f"{'GiB':>12}{'vs 0':>7}   {'traffic/step (elements)':<42}{'GB sent':>10}")
    p(hdr)
    p("-" * len(hdr))
    for row in r["stages"]:
        p(f"{row['stage']:<7}{row['fsdp']:<14}{row['formula']:<13}{row['bytes_per_param']:>8.3f}"
          f"{_g(row['bytes']):>16}{sig3(row['GB']):>8}{row['GiB']:>12,.3f}"
          f"{s0_total(r) / row['bytes'] if row['bytes'] else math.inf:>6.2f}x   "
          f"{row['traffic_formula'] + ' = ' + format(row['traffic_elements'], ',.0f'):<42}"
          f"{row['traffic_bytes'] / GB:>10.3f}")
    if pr != "fp32" and K == 1:
        p("as Nd grows, stage 1 tends to 16/4 = 4x less than stage 0, stage 2 to 16/2 = 8x, stage 3 "
          "falls as 1/Nd; stage 3 sends 3/2 = 1.5x the elements of stages 0-2.")
    eb = acc.storage_bytes(pr)
    p(f"traffic: elements sent per rank per optimizer step (ring: each RS or AG of Ψ sends Ψ(n-1)/n); "
      f"GB sent at {eb} B/element ({pr} grads and params)")
    if K > 1:
        p(f"grad accumulation, K = {K} micro-batches per step: stages 0-2 add up gradients locally "
          f"in an fp32 buffer of Ψ (4Ψ, full size even at stage 2) and reduce once per step, so "
          f"their traffic per step is that of K = 1 ({1 / K:.3g}x per sample); stage 3 gathers "
          f"params and reduce-scatters grads in every micro-batch (into a 4Ψ/Nd fp32 shard), so "
          f"its traffic per step is {K}x the per-micro-batch 3Ψ(Nd-1)/Nd; hybrid likewise inside "
          f"the node, with the accumulated shard all-reduced across nodes once per step.")
    if "bytes_padded" in r["stages"][0]:
        p("\nringzero's buffers (units padded to a multiple of group x 32 elements):")
        for row in r["stages"]:
            p(f"  stage {row['stage']:<7} padded Ψ {row['psi_padded']:>16,}   model state per rank "
              f"{row['bytes_padded']:>18,} B = {_g(row['bytes_padded'])} GB")
    b = r["buffers"]
    p(f"\nTemporary buffers: a flattened fp32 all-reduce buffer of the whole model = 4Ψ = "
      f"{_g(b['fp32_flat_allreduce_bytes'])} GB (fp16: {_g(b['fp16_flat_allreduce_bytes'])} GB); "
      f"ringzero reduces unit by unit instead, so its buffer is one unit.")


def _print_activations(p, a, cfg, nd, K):
    """Activation bytes per rank by every count (ZeRO paper, checkpoints, Korthikanti), with the numbers in."""
    ab = a["bytes"]
    p(f"\nActivations per rank, micro-batch {a['batch']} x seq {a['seq']} "
      f"(L={cfg.n_layer}, h={cfg.n_embd}, a={cfg.n_head}, V={cfg.vocab}); one micro-batch is "
      f"alive at a time, so they do not grow with K (global batch = {a['batch']} x K {K} x Nd "
      f"{nd} = {a['global_batch']:,} sequences per step):")
    for k, label in (("zero_paper", "ZeRO paper, no checkpointing"),
                     ("ckpt_inputs", "layer-input checkpoints alone"),
                     ("zero_ckpt", "ZeRO count, checkpoint per layer"),
                     ("korthikanti", "Korthikanti et al., no recompute"),
                     ("korthikanti_ckpt", "Korthikanti et al., full recompute"),
                     ("logits", "fp16 logits (in neither count)")):
        p(f"  {label:<36}{a['formulas'][k]:<38}{_g(ab[k]):>12} GB")
    b_, s_, h_, L_ = a["batch"], a["seq"], cfg.n_embd, cfg.n_layer
    p(f"  checkpoints alone, numbers in: 2 B x {b_}·{s_}·{h_}·{L_} = {ab['ckpt_inputs']:,} B = "
      f"{ab['ckpt_inputs'] / GB:.1f} GB = {ab['ckpt_inputs'] / GIB:.1f} GiB")
    for name, (pc, _, note) in PAPER_PRESETS.items():
        if pc == cfg:
            p(f"  {name}: {note}")
            p(f"  the paper's ~60 GB is this count: {ab['ckpt_inputs'] / GB:.1f} GB "
              f"({ab['ckpt_inputs'] / GIB:.1f} GiB) of fp16 layer inputs; with one layer "
              f"recomputed, {ab['zero_ckpt'] / GB:.1f} GB")
    p("  recompute cost of checkpointing: one more forward; backward is ~2 forwards, so "
      "+1/(1+2) = 33 % of a step's compute.")
    p("  used below: the ZeRO paper's count (the seed's ~60 GB / ~8 GB for GPT-2 1.5B, seq 1K,"
      " batch 32).")
    p("  why they differ: ZeRO's 12·bshL leaves out the a·s² attention scores and dropout masks"
      " that Korthikanti counts; the paper gives no formula for its ~8 GB, which lies between"
      " the per-layer checkpoints alone and checkpoints + one recomputed layer + logits.")


def _print_fit(p, ft, nd):
    """Which stages fit in --gpu-mem per rank, and the smallest group that fits."""
    p(f"\nFits in {ft['gpu_mem'] / GB:g} GB per rank at Nd = {nd}? model state"
      + (" + activations (ZeRO count)" if ft["activations_counted"]
         else " (no GPT shape given: activations NOT counted)")
      + f" + temporary buffer {ft['temp_buffer']} ({_g(ft['temp_buffer_bytes'])} GB)")
    for x in ft["stages"]:
        cells = []
        kinds = (("no_ckpt", "no ckpt"), ("ckpt", "ckpt")) if ft["activations_counted"] \
            else (("no_ckpt", "model state"),)
        for k, label in kinds:
            c = x[k]
            sm = c["smallest_group"]
            grp = "Ng" if x["stage"] == "hybrid" else "Nd"
            cells.append(f"{label}: need {_g(c['need_bytes']):>12} GB "
                         f"{'fits ' if c['fits'] else 'NO   '} smallest {grp} "
                         f"{sm if sm else 'never':>6}")
        p(f"  stage {x['stage']:<7}" + "   |   ".join(cells))


def print_report(r: dict, cfg, f=None):
    """The whole report of ``estimate``, printed (to f, or stdout)."""
    p = lambda *a: print(*a, file=f or sys.stdout)  # noqa: E731
    psi, nd = r["psi"], r["nd"]
    p(f"Ψ = {psi:,} parameters   Nd = {nd}" + (f"   Ng = {r['ranks_per_node']} ranks per node"
                                                  if r["ranks_per_node"] else ""))
    p("GB = 1e9 bytes (the ZeRO paper's unit); GiB = 2^30 bytes.\n")
    _print_per_param(p, r)
    _print_stages(p, r)
    if "activations" in r:
        _print_activations(p, r["activations"], cfg, nd, r["grad_accum"])
    if "fit" in r:
        _print_fit(p, r["fit"], nd)
    p("\nOther accountings (labelled; bytes per rank at this Nd):")
    for k, v in r["other_accountings"].items():
        p(f"  {k:<52}{_g(v):>14} GB")
    p("  DeepSpeed's estimator adds an fp32 gradient copy (4 B); Megatron's distributed optimizer "
      "keeps fp32 main grads too.")


def s0_total(r):
    return r["stages"][0]["bytes"]


# ---- CLI ------------------------------------------------------------------------
_DIMS = ("n_layer", "n_embd", "n_head", "vocab", "block_size")


def add_model_args(ap):
    """--params / --model / --n-layer ...: shared with ``python -m ringzero.explain traffic``."""
    src = ap.add_argument_group("model size (one of)")
    src.add_argument("--params", help="parameter count with K/M/B/T suffix, e.g. 7.5B")
    src.add_argument("--model", choices=sorted(ALL_MODELS),
                     help="a GPT-2 or Llama-family preset (smollm2-135m ...), or zero-100b (the ZeRO "
                          "paper's 100B shape); Ψ from its layout")
    for k, h in (("n_layer", "blocks"), ("n_embd", "width"), ("n_head", "heads"),
                 ("vocab", "vocabulary"), ("block_size", "context length")):
        src.add_argument("--" + k.replace("_", "-"), type=int, help=f"GPT {h} (overrides --model)")


def model_from_args(a):
    """(Ψ, GPTConfig or None) from parsed model args; ValueError on a bad or missing size."""
    dims = {k: getattr(a, k) for k in _DIMS if getattr(a, k) is not None}
    if a.params and (a.model or dims):
        raise ValueError("give --params or a GPT shape (--model / --n-layer ...), not both")
    if a.params:
        return parse_count(a.params), None
    if a.model or dims:
        base = ALL_MODELS[a.model] if a.model else GPTConfig()
        if a.model in LLAMA_PRESETS:        # the flags it shares with a GPT; head_dim follows n_embd / n_head
            cfg = families.model_config(a.model, dims.pop("vocab", None), **dims)
        else:
            cfg = GPTConfig(**{**base.__dict__, **dims})
        return gpt_psi(cfg), cfg
    raise ValueError("no model size: give --params 7.5B or --model gpt2-xl or --n-layer ...")


def build_parser():
    ap = argparse.ArgumentParser(
        prog="python -m ringzero.estimate",
        description="Per-rank memory and traffic of ZeRO stages 0-3 (and HYBRID_SHARD): prints, per "
                    "stage, the bytes-per-parameter formula, the model state per rank in GB (exact and "
                    "to 3 significant figures, as the ZeRO paper rounds), the elements and bytes each "
                    "rank sends per step; then temporary buffers, activations (with --batch), "
                    "whether it fits (with --gpu-mem), and other published accountings.",
        epilog="Examples: --params 7.5B --nd 64 (the seed's 120/31.4/16.6/1.88 GB);  "
               "--model gpt2-xl --nd 1 --batch 32 --seq 1024 --gpu-mem 32GB;  "
               "--model zero-100b --nd 1 (the ~60 GB of checkpoints, batch 32 by default)")
    add_model_args(ap)
    ap.add_argument("--nd", type=int, default=64, help="data-parallel ranks Nd (default 64)")
    ap.add_argument("--ranks-per-node", type=int, help="Ng: adds the HYBRID_SHARD row")
    ap.add_argument("--batch", type=int, help="micro-batch per rank, for activations (GPT only)")
    ap.add_argument("--seq", type=int, help="sequence length (default: the block size)")
    ap.add_argument("--gpu-mem", help="memory per rank, e.g. 32GB or 80GiB: which stages fit")
    ap.add_argument("--temp-buffer", choices=("fp32-flat", "fp16-flat", "none"), default="fp32-flat",
                    help="temporary buffer counted by --gpu-mem: the paper's flattened fp32 "
                         "all-reduce buffer of the whole model (default), fp16, or none")
    add_step_args(ap)
    from ringzero.tools.tiers import add_tier_args
    add_tier_args(ap)
    from ringzero.tools.zeropp_estimate import add_args
    add_args(ap)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead")
    return ap


def add_step_args(ap):
    """--precision / --grad-accum: shared with ``python -m ringzero.explain traffic``."""
    ap.add_argument("--precision", choices=tuple(acc.PRECISION_BYTES), default="fp16",
                    help="storage dtype of params and grads (default fp16; bf16 takes the same bytes)")
    ap.add_argument("--grad-accum", type=int, default=1, metavar="K",
                    help="micro-batches per optimizer step (default 1): adds the fp32 gradient "
                         "accumulator, multiplies stage 3's traffic by K")


def main(argv=None):
    ap = build_parser()
    a = ap.parse_args(argv)
    try:
        psi, cfg = model_from_args(a)
        if a.nd < 1:
            raise ValueError(f"--nd must be >= 1, got {a.nd}")
        if a.ranks_per_node is not None and (a.ranks_per_node < 1 or a.nd % a.ranks_per_node):
            raise ValueError(f"--ranks-per-node must divide --nd: got nd={a.nd}, "
                             f"ranks-per-node={a.ranks_per_node}")
        if a.grad_accum < 1:
            raise ValueError(f"--grad-accum must be >= 1, got {a.grad_accum}")
        if a.batch is not None and a.batch < 1:
            raise ValueError(f"--batch must be >= 1, got {a.batch}")
        seq = a.seq
        if a.model in PAPER_PRESETS and a.batch is None:
            a.batch = PAPER_PRESETS[a.model][1]       # the paper's batch for its figure
        if a.batch and cfg is None:
            raise ValueError("--batch needs a GPT shape (--model or --n-layer ...) for activations")
        if cfg is not None:
            seq = seq or cfg.block_size
            if not 1 <= seq <= cfg.block_size:
                raise ValueError(f"--seq must be in 1..block_size={cfg.block_size}, got {seq}")
        gpu = parse_size(a.gpu_mem) if a.gpu_mem else None
        from ringzero.tools.zeropp_estimate import from_args
        zpp = from_args(a, psi)                       # --zeropp: hpZ's memory, the bytes across nodes
    except ValueError as e:
        ap.error(str(e))
    r = estimate(psi, a.nd, a.ranks_per_node, cfg, a.batch, seq, gpu, a.temp_buffer,
                 a.precision, a.grad_accum)
    if zpp is not None:
        r["zeropp"] = zpp
    from ringzero.tools.tiers import run_tiers
    if a.json:
        try:
            with open(os.devnull, "w") as quiet:      # the rows only, into the JSON
                r["tiers"] = run_tiers(a, psi, cfg, seq, f=quiet)
        except ValueError as e:
            ap.error(str(e))
        print(json.dumps(r, indent=1))
        return 0
    print_report(r, cfg)
    if "zeropp" in r:
        from ringzero.tools.zeropp_estimate import print_zeropp
        print_zeropp(print, r["zeropp"])
    try:
        run_tiers(a, psi, cfg, seq)           # --ram / --disk / --device-mem: what fits where
    except ValueError as e:
        ap.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
