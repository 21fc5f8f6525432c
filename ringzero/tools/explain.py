"""``python -m ringzero.explain precision|traffic|fragmentation``: the two lessons behind ZeRO's accounting.

What it is
    precision  Why the 12 bytes of fp32 state per parameter cannot be dropped, shown
               by experiment on real IEEE fp16 values (numpy.float16): where
               underflow starts and how the boundary rounds, when w + Δw == w
               (swamping) and how that depends on w's place in its binade, a toy
               run where fp16 weights stall while an fp32 master tracks fp32, and
               loss scaling (underflowed gradients survive; the dynamic scaler of
               ringzero.runtime.optim backs off on an overflow). Then bf16 beside
               fp16, by the same experiments on ml_dtypes.bfloat16: fp32's range
               (no underflow at 2^-24, no overflow at 65504: no loss scaler) but
               8 significant bits (swamping at 256x, not 2048x: the fp32 master
               matters more). bf16 takes fp16's bytes: the 16Ψ table is unchanged.
    traffic    Who sends what in each stage, per rank and per step, from
               ringzero.runtime.accounting; per unit when a GPT shape is given; measured
               beside formula when a training run's ``--metrics`` file is given.
               ``--grad-accum K``: per micro-batch and per step (stages 0-2 reduce
               once per step, stage 3 gathers and reduce-scatters every micro-batch).
    fragmentation  A caching allocator's OOM with memory free, by replaying a
               training step's allocations (ringzero.tools.fragmentation).

What it is not
    No thresholds are typed in: each is searched for by experiment; the seed
    document's claims are printed beside them for comparison only.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from ringzero.runtime import accounting as acc

f16, f32, f64 = np.float16, np.float32, np.float64

# The seed document's claims, printed beside what the experiments find.
SEED_UNDERFLOW = "below 2^-24 becomes zero"
SEED_SWAMP_RATIO = "2048x"


# ---- precision experiments (pure; the tests call these) --------------------------
def bf16_type():
    """ml_dtypes.bfloat16, or None without the ``bf16`` extra (pip install 'ringzero[bf16]')."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return ml_dtypes.bfloat16


def _source(dtype):
    """The float type a dtype's values are cast from: bf16 is made from fp32 in the
    runtime (and ml_dtypes converts float64 via float32), fp16 from any float64."""
    return f64 if dtype is f16 else f32


def _bisect_bits(pred, lo: float, hi: float, src=f64) -> float:
    """Smallest positive ``src`` float x in (lo, hi] with pred(x) True, pred monotone (False..True).

    Bisects on the bit patterns of ``src`` (float64 or float32), which order
    like the values for x >= 0, so the answer is exact to the last bit.
    """
    it = np.int64 if src is f64 else np.int32
    a = int(np.array(lo, src).view(it))
    b = int(np.array(hi, src).view(it))
    if pred(lo) or not pred(hi):
        raise ValueError(f"bisection needs pred(lo) False and pred(hi) True, got "
                         f"{pred(lo)} and {pred(hi)}")
    while b - a > 1:
        m = (a + b) // 2
        if pred(float(np.array(m, it).view(src))):
            b = m
        else:
            a = m
    return float(np.array(b, it).view(src))


def _cast(dtype, src, v):
    """v (a Python float) rounded to src, then to dtype: one value of dtype."""
    with np.errstate(over="ignore"):
        return np.array(src(v)).astype(dtype)


def underflow_threshold(dtype=f16) -> dict:
    """The smallest magnitude that survives conversion to ``dtype``, found by bisection
    (over float64 for fp16, over float32 for bf16: see ``_source``)."""
    src = _source(dtype)
    x = _bisect_bits(lambda v: _cast(dtype, src, v) != 0, 0.0, 1.0, src)
    below = float(np.nextafter(src(x), src(0)))
    out = {"threshold": x, "rounds_to": float(_cast(dtype, src, x)), "largest_zero": below,
           "largest_zero_log2": float(np.log2(below)), "tie_to": float(_cast(dtype, src, below))}
    if dtype is f16:
        out.update({"largest_zero_is_2^-25": below == 2.0 ** -25, "tie_2^-25_to": float(f16(2.0 ** -25))})
    return out


def overflow_threshold(dtype=f16) -> dict:
    """The smallest magnitude that becomes Inf in ``dtype``, found by bisection, and the
    largest value that stays finite (where everything between rounds down to)."""
    src = _source(dtype)
    top = float(np.finfo(src).max)
    x = _bisect_bits(lambda v: not np.isfinite(_cast(dtype, src, v)), 1.0, top, src)
    below = float(np.nextafter(src(x), src(0)))
    return {"threshold": x, "largest_finite_input": below,
            "largest_finite": float(_cast(dtype, src, below))}


def _positive_finite(dtype):
    """Every positive finite value of a 16-bit float type, ascending."""
    v = np.arange(1, 0x8000, dtype=np.uint16).view(dtype)
    with np.errstate(invalid="ignore"):
        return v[np.isfinite(v)]


def swamp_ratio(w: float, dtype=f16) -> dict:
    """For a ``dtype`` weight w > 0: the largest Δw of that dtype with w + Δw == w (added in
    the dtype), by exhaustion.

    Every positive finite value of the dtype is tried as Δw; the threshold ratio is
    w / (largest swallowed Δw), i.e. the smallest w/Δw at which the update vanishes.
    """
    w16 = np.array(w).astype(dtype)[()]
    if not (np.isfinite(w16) and w16 > 0):
        raise ValueError(f"w must be a positive finite {np.dtype(dtype).name} value, got {w!r} -> {w16}")
    dw = _positive_finite(dtype)                             # every positive finite value
    with np.errstate(over="ignore"):                         # w + max overflows: not lost
        lost = (w16 + dw) == w16                             # one add in the dtype, one rounding
    big = dw[lost].max()
    # the next larger Δw must be kept: the swallowed set is a prefix
    if not lost[: int(np.flatnonzero(lost).max()) + 1].all():
        raise RuntimeError("swallowed updates are not a prefix of the fp16 values")
    m = float(w16) / 2.0 ** np.floor(np.log2(float(w16)))   # significand in [1, 2)
    odd = bool(np.array(w16, dtype).view(np.uint16) & 1)     # last mantissa bit
    return {"w": float(w16), "largest_lost_dw": float(big), "ratio": float(w16) / float(big),
            "significand": m, "ulp": float(np.spacing(w16)), "odd": odd}


def toy_run(n: int = 1024, steps: int = 20000, lr: float = 1e-4, seed: int = 0, dtype=f16) -> dict:
    """Gradient descent on 0.5·||w - t||² three ways; final max |w - w_fp32| of each.

    fp32 reference; fp16 (or ``dtype``) weights updated in place (w16 +=
    fp16(-lr·g)); and fp16 weights copied each step from an fp32 master that
    accumulates the updates. The keys say fp16 whatever the dtype.
    """
    rng = np.random.default_rng(seed)
    w0 = rng.uniform(0.5, 2.0, n).astype(f32)                # (n,)
    t = (w0 + rng.normal(0, 0.5, n)).astype(f32)              # (n,) targets
    w32, master = w0.copy(), w0.copy()
    w16, wm16 = w0.astype(dtype), w0.astype(dtype)
    lr32 = f32(lr)
    for _ in range(steps):
        w32 -= lr32 * (w32 - t)
        g16 = w16.astype(f32) - t                             # grads computed in fp32
        w16 -= (lr32 * g16).astype(dtype)                     # fp16 weights, fp16 add
        master -= lr32 * (wm16.astype(f32) - t)               # fp32 master accumulates
        wm16 = master.astype(dtype)                           # fp16 copy for the next forward
    moved = float(np.abs(w32 - w0).max())
    return {"steps": steps, "lr": lr, "n": n, "fp32_moved": moved,
            "fp16_err": float(np.abs(w16.astype(f32) - w32).max()),
            "master_err": float(np.abs(master - w32).max()),
            "master_fp16_err": float(np.abs(wm16.astype(f32) - w32).max()),
            "copy_within_half_ulp": bool((np.abs(wm16.astype(f64) - master) <=
                                          np.spacing(np.abs(wm16)).astype(f64) / 2).all()),
            "dtype": np.dtype(dtype).name,
            # from its own start (w0 rounded to the dtype), so the cast's rounding is not counted
            "fp16_moved": float(np.abs(w16.astype(f32) - w0.astype(dtype).astype(f32)).max())}


def loss_scaling(scale: float = 2.0 ** 16, n: int = 100000, seed: int = 0) -> dict:
    """Tiny gradients (log-uniform 2^-34..2^-14) cast to fp16 with and without a loss scale."""
    rng = np.random.default_rng(seed)
    g = (2.0 ** rng.uniform(-34, -14, n)).astype(f32)        # (n,) true fp32 gradients
    plain = g.astype(f16)
    scaled = (g * f32(scale)).astype(f16)                      # what backward of scale·loss gives
    back = scaled.astype(f32) / f32(scale)                     # unscaled in fp32 (the master's side)
    rel = np.abs(back - g) / g
    return {"n": n, "scale": scale, "zero_plain": float(np.mean(plain == 0)),
            "zero_scaled": float(np.mean(scaled == 0)),
            "max_rel_err_scaled": float(rel.max()),
            "max_rel_err_plain_nonzero": float((np.abs(plain.astype(f32) - g) / g)[plain != 0].max())}


def scaler_trace(steps: int = 12, overflow_at=(3,), grad_max: float = 2.0) -> list:
    """Run ringzero.runtime.optim.LossScaler on fp16 gradients; inject an Inf at ``overflow_at`` steps.

    Each step the gradient (max |g| = grad_max) is multiplied by the current
    scale and cast to fp16, as backward of scale·loss would produce it; a
    non-finite value is an overflow. The master weight changes only on clean steps.
    """
    from ringzero.runtime.optim import LossScaler
    sc = LossScaler(init=2.0 ** 16, growth_interval=4, hysteresis=1, min_scale=1.0)
    g = np.array([grad_max, 1e-3, -0.5], f32)
    master = np.ones(3, f32)
    out = []
    for step in range(steps):
        s = sc.scale
        with np.errstate(over="ignore"):
            g16 = (g * f32(s)).astype(f16)                      # > 65504 becomes Inf
        if step in overflow_at:
            g16[1] = f16(np.inf)                                # injected overflow
        found = not bool(np.isfinite(g16).all())
        before = master.copy()
        skip = sc.update(found)
        if not skip:
            master -= f32(1e-3) * (g16.astype(f32) / f32(s))
        out.append({"step": step, "scale": s, "found_inf": found, "skipped": skip,
                    "master_changed": bool((master != before).any()),
                    "master_finite": bool(np.isfinite(master).all()), "next_scale": sc.scale})
    return out


def print_precision(f=None):
    p = lambda *a: print(*a, file=f or sys.stdout)  # noqa: E731
    fi = np.finfo(f16)
    u = underflow_threshold()
    p("== Underflow: the smallest magnitude that does not become 0 in fp16 (bisection over float64)")
    p(f"  found: x > {u['largest_zero']!r} (= 2^{np.log2(u['largest_zero']):.0f}) survives; "
      f"it rounds to {u['rounds_to']!r} (= 2^{np.log2(u['rounds_to']):.0f})")
    p(f"  at the boundary: 2^-25 is a tie between 0 and 2^-24; ties go to even, so "
      f"fp16(2^-25) = {u['tie_2^-25_to']}; the next float64 above it rounds up to 2^-24")
    p(f"  seed: '{SEED_UNDERFLOW}'. Exact: magnitudes <= 2^-25 become 0; (2^-25, 2^-24) round up to"
      f" 2^-24 = {float(fi.smallest_subnormal)!r}, the smallest subnormal (numpy: "
      f"finfo.smallest_subnormal = {float(fi.smallest_subnormal)!r}).")
    p(f"  below 2^-14 = {float(fi.tiny)!r} (smallest normal) values are subnormal: "
      f"fewer than 11 significant bits.")
    p(f"  e.g. grad 1e-3 x lr 1e-5 = 1e-8 -> fp16 {f16(1e-8)}")
    p("\n== Swamping: the smallest w/Δw at which w + Δw == w (fp16 add, every fp16 Δw tried)")
    p(f"  {'w':>10} {'significand m':>14} {'last bit':>9} {'largest lost Δw':>16} {'ratio w/Δw':>11}"
      f" {'2048·m':>8}")
    for w in (1.0, 1.25, 1.5, 1.75, float(np.nextafter(f16(2), f16(0))), 0.01, 3.14159, 100.0):
        s = swamp_ratio(w)
        p(f"  {s['w']:>10.6g} {s['significand']:>14.6f} {'odd' if s['odd'] else 'even':>9} "
          f"{s['largest_lost_dw']:>16.6g} {s['ratio']:>11.1f} {2048 * s['significand']:>8.1f}")
    p(f"  seed: '{SEED_SWAMP_RATIO}'. Exact: Δw is lost when Δw <= ulp(w)/2 = w/(2048·m), m = w's "
      f"significand in [1, 2): 2048 at the bottom of a binade, approaching 4096 at its top. At "
      f"Δw = ulp/2 exactly (a tie) an even w keeps its value, an odd w rounds up, so odd w need a "
      f"hair more than 2048·m; when Δw is subnormal (w < 2^-3) its coarse grid moves the ratio "
      f"further. The seed's 2048 is the lowest ratio: weights >= 2048x the update ALWAYS lose it.")
    t = toy_run()
    p(f"\n== Toy run: {t['steps']} steps of gradient descent, lr {t['lr']:g}, {t['n']} weights "
      f"in [0.5, 2); each update lr·|w - t| is about 5e-5, below ulp(w)/2")
    p(f"  fp32 run moved the weights by up to {t['fp32_moved']:.4f}")
    p(f"  fp16 weights updated in place: moved {t['fp16_moved']:.4f} from their fp16 start; max error vs fp32 "
      f"{t['fp16_err']:.4f}  (stalled: every update was swamped)")
    p(f"  fp32 master, fp16 copy:        max error of master vs fp32 {t['master_err']:.2e} "
      f"({100 * t['master_err'] / t['fp32_moved']:.3f} % of the distance moved); its fp16 copy "
      f"{t['master_fp16_err']:.2e}, within half an fp16 ulp of the master: "
      f"{t['copy_within_half_ulp']}")
    ls = loss_scaling()
    p(f"\n== Loss scaling: {ls['n']} gradients log-uniform in [2^-34, 2^-14]")
    p(f"  cast to fp16 as is:          {100 * ls['zero_plain']:.1f} % become 0")
    p(f"  scaled by 2^16 first:        {100 * ls['zero_scaled']:.1f} % become 0; after unscaling in "
      f"fp32, max relative error {ls['max_rel_err_scaled']:.1e}")
    p("\n== Dynamic loss scaler (ringzero.runtime.optim.LossScaler, init 2^16, growth every 4 clean steps,"
      " hysteresis 1); max |g| = 2, fp16 max = 65504; an Inf injected at step 3")
    p(f"  {'step':>4} {'scale':>8} {'overflow':>9} {'skipped':>8} {'master changed':>15} "
      f"{'master finite':>14} {'next':>8}")
    for r in scaler_trace():
        p(f"  {r['step']:>4} {r['scale']:>8g} {str(r['found_inf']):>9} {str(r['skipped']):>8} "
          f"{str(r['master_changed']):>15} {str(r['master_finite']):>14} {r['next_scale']:>8g}")
    p("  steps 0-1 overflow for real (2 x 65536 and 2 x 32768 exceed 65504), step 3 by injection: "
      "each is skipped, the master is untouched and the scale halves; 4 clean steps double it.")
    from ringzero.tools.bf16 import print_bf16
    print_bf16(f)


# ---- traffic ----------------------------------------------------------------------
_STAGE_STEPS = {
    "0": [("backward", "all-reduce grads, unit by unit (ring RS then AG on the same blocks)",
           ("reduce_scatter", "all_gather"))],
    "1": [("after backward", "reduce-scatter fp16 grads: each rank keeps its summed piece",
           ("reduce_scatter",)),
          ("after update", "all-gather updated fp16 params from every rank's slice", ("all_gather",))],
    "2": [("during backward", "reduce-scatter each unit's grads as soon as they exist (bucket)",
           ("reduce_scatter",)),
          ("after update", "all-gather updated fp16 params", ("all_gather",))],
    "3": [("forward", "all-gather each unit's params before its forward, free after", ("all_gather",)),
          ("backward", "all-gather each unit's params again, then reduce-scatter its grads",
           ("all_gather", "reduce_scatter"))],
}
_STAGE_STEPS["hybrid"] = _STAGE_STEPS["3"] + [
    ("after backward", "all-reduce the grad shard with the same shard on the other nodes",
     ("all_reduce",))]


def traffic_rows(psi: int, nd: int, ranks_per_node=None, units=None, grad_accum: int = 1,
                 precision: str = "fp16") -> list:
    """[{stage, elements, bytes, by_collective, per_unit?}] for every stage, per optimizer step
    of ``grad_accum`` micro-batches (per_unit: per micro-batch)."""
    rows = []
    for st in acc.STAGES:
        if st == "hybrid" and not ranks_per_node:
            continue
        r = {"stage": st, "formula": acc.traffic_formula(st, grad_accum),
             "by_collective": acc.traffic_elements(st, psi, nd, ranks_per_node, grad_accum),
             "bytes": acc.traffic_bytes(st, psi, nd, ranks_per_node, grad_accum=grad_accum,
                                        precision=precision),
             "per_micro_batch": acc.traffic_elements(st, psi, nd, ranks_per_node, 1)}
        r["elements"] = sum(r["by_collective"].values())
        r["total_bytes"] = sum(r["bytes"].values())
        if units is not None:
            from ringzero.runtime.flat import Layout
            lay = Layout(units, nd)
            r["per_unit"] = [(u.name, lay.unit_numel[i], lay.unit_padded[i],     # per micro-batch
                              acc.traffic_elements(st, lay.unit_padded[i], nd, ranks_per_node))
                             for i, u in enumerate(lay.units)]
            r["padded_psi"] = lay.padded
        rows.append(r)
    return rows


def read_summary(path: str) -> dict:
    """The ``"summary": true`` line of a trainer metrics file."""
    from ringzero.metrics import read_metrics
    _, summ = read_metrics(path)
    if summ is None:
        raise ValueError(f"{path}: no line with \"summary\": true (expected the trainer's final line)")
    for k in ("params", "world_size", "stage", "traffic", "memory"):
        if k not in summ:
            raise ValueError(f"{path}: summary line lacks {k!r}; has {sorted(summ)}")
    return summ


_ACCUM = {  # what K > 1 micro-batches per optimizer step change, per stage
    "0": "micro-batches add their grads into a local fp32 buffer of Ψ (4Ψ B); the all-reduce "
         "runs once, after the last (DDP's no_sync): traffic per step as at K = 1",
    "1": "micro-batches add their grads into a local fp32 buffer of Ψ (4Ψ B); one reduce-scatter "
         "after the last: traffic per step as at K = 1",
    "2": "micro-batches add their grads into a local fp32 buffer of Ψ (4Ψ B, full size: the price "
         "of reducing once; DeepSpeed's ZeRO-2 reduces every micro-batch into its partition "
         "instead): traffic per step as at K = 1",
    "3": "every micro-batch gathers each unit for forward and backward again and reduce-scatters "
         "its grads into an fp32 shard accumulator (4Ψ/Nd B), as FSDP does: K x the traffic of one",
}
_ACCUM["hybrid"] = (_ACCUM["3"].replace("Nd", "Ng") + "; the accumulated shard is all-reduced "
                    "across nodes once per step")


def print_traffic(psi, nd, rpn, cfg, metrics, f=None, grad_accum: int = 1, precision: str = "fp16"):
    p = lambda *a: print(*a, file=f or sys.stdout)  # noqa: E731
    units = None
    if cfg is not None:
        from ringzero.nn.gpt import gpt_units
        units = gpt_units(cfg)
    K, eb = grad_accum, acc.storage_bytes(precision)
    p(f"Ψ = {psi:,}  Nd = {nd}" + (f"  Ng = {rpn}" if rpn else "") +
      f"; elements and bytes SENT by one rank per optimizer step ({precision}: {eb} B/element"
      + (f"; K = {K} micro-batches per step" if K > 1 else "") + ").")
    p(f"A ring reduce-scatter or all-gather over n ranks takes n-1 steps; in each, every rank sends "
      f"one block of 1/n of the buffer to its right neighbour: Ψ(n-1)/n elements in all.\n")
    for r in traffic_rows(psi, nd, rpn, units, K, precision):
        st = r["stage"]
        one = sum(r["per_micro_batch"].values())
        p(f"stage {st}: {r['formula']} = {r['elements']:,.0f} elements = "
          f"{r['total_bytes'] / 1e9:.4f} GB per rank per step")
        for when, what, keys in _STAGE_STEPS[st]:
            p(f"  {when:<16} {what.replace('fp16', precision)}")
        if K > 1:
            p(f"  {'K = ' + str(K):<16} {_ACCUM[st]}")
            p(f"  {'':<16} per micro-batch alone {one:,.0f} el; per step {r['elements']:,.0f} el = "
              f"{r['elements'] / one if one else 0:.3g}x; per sample {r['elements'] / one / K if one else 0:.3g}x "
              f"of K = 1")
        for k, v in r["by_collective"].items():
            p(f"  {'':<16} {k:<15} {v:>18,.0f} el  {r['bytes'][k] / 1e9:>10.4f} GB")
        if st in ("3", "hybrid") and "per_unit" in r:
            p(f"  per unit and micro-batch (padded to a multiple of Nd·align; total padded Ψ = "
              f"{r['padded_psi']:,}):")
            shown = r["per_unit"] if len(r["per_unit"]) <= 8 else r["per_unit"][:3] + r["per_unit"][-2:]
            for name, real, padded, el in shown:
                p(f"    {name:<10} Ψ_unit {real:>12,} (padded {padded:>12,})  AG fwd+bwd "
                  f"{el['all_gather']:>14,.0f}  RS {el['reduce_scatter']:>14,.0f}")
            if len(r["per_unit"]) > 8:
                p(f"    ... {len(r['per_unit']) - 5} more units")
            p("    (formula: each unit gathered for forward and again for backward; a runtime that "
              "keeps a unit gathered across the forward/backward turn sends less, a tied head "
              "that gathers the embedding again sends more)")
    if metrics:
        s = read_summary(metrics)
        st, n, P = acc.parse_stage(s["stage"]), int(s["world_size"]), int(s["params"])
        t = s["traffic"]
        spr, sk = s.get("precision", "fp16"), int(s.get("grad_accum", 1))   # what the run used
        ours = sum(acc.traffic_bytes(st, P, n, s.get("ranks_per_node"), grad_accum=sk,
                                     precision=spr).values())
        p(f"\n== measured ({metrics}): stage {st}, Ψ = {P:,}, Nd = {n}, {spr}"
          + (f", K = {sk}" if sk > 1 else ""))
        p(f"  traffic/step: measured {t['measured_bytes_per_step']:,} B   trainer's formula "
          f"{t['formula_bytes_per_step']:,} B   accounting on unpadded Ψ {ours:,.0f} B")
        if "schedule_bytes_per_step" in t:
            p(f"  the runtime's own schedule predicts {t['schedule_bytes_per_step']:,} B")
        d = t["measured_bytes_per_step"] - ours
        why = ["padding each unit to a multiple of Nd·align adds bytes"]
        if st in ("3", "hybrid"):
            why += ["a unit that reads another unit's parameters (a tied head reads the "
                    "embedding) gathers that unit again, which adds",
                    "a unit used twice in a row (at the forward/backward turn) is gathered once, "
                    "not twice, which removes"]
        p(f"  measured - unpadded formula = {d:,.0f} B ({100 * d / ours if ours else 0:+.3f} %)"
          + (": " + "; ".join(why) if d else ": exact match"))
        mine = acc.model_state_bytes(st, P, n, s.get("ranks_per_node"), spr, sk)
        p(f"  {'memory class':<14}{'measured B':>16}{'trainer formula B':>20}{'unpadded formula B':>20}")
        for c, v in s["memory"].items():
            p(f"  {c:<14}{v['measured_bytes']:>16,}{v['formula_bytes']:>20,}"
              f"{mine.get(c, float('nan')):>20,.0f}")


# ---- CLI ------------------------------------------------------------------------
def main(argv=None):
    from ringzero.tools.estimate import add_model_args, add_step_args, model_from_args
    ap = argparse.ArgumentParser(prog="python -m ringzero.explain",
                                 description="Explain ZeRO's accounting by experiment.")
    sub = ap.add_subparsers(dest="what", required=True)
    sub.add_parser("precision", help="fp16 underflow, swamping, a toy run, loss scaling; bf16 beside",
                   description="Prints, found by experiment on numpy.float16: the underflow "
                               "threshold and its rounding, the swamping ratio w/Δw by position "
                               "in the binade, a toy run (fp16 weights vs fp32 master), and loss "
                               "scaling with ringzero's dynamic scaler backing off on an overflow.")
    tp = sub.add_parser("traffic", help="who sends what per stage, per rank, per step",
                        description="Prints, per stage, the collectives each rank runs per step "
                                    "and the elements and bytes it sends (per unit for a GPT); "
                                    "with --metrics, measured bytes beside the formula.")
    add_model_args(tp)
    tp.add_argument("--nd", type=int, default=64, help="data-parallel ranks (default 64)")
    tp.add_argument("--ranks-per-node", type=int, help="Ng: adds HYBRID_SHARD")
    tp.add_argument("--metrics", help="a trainer metrics .jsonl: measured beside formula")
    add_step_args(tp)
    from ringzero.tools import fragmentation
    fragmentation.add_args(sub.add_parser(
        "fragmentation", help="a caching allocator OOMs with 30 %% free; ringzero's flat plan does not",
        description=fragmentation.__doc__.split("\n\n")[0]))
    a = ap.parse_args(argv)
    if a.what == "fragmentation":
        return fragmentation.run(a)
    if a.what == "precision":
        print_precision()
        return 0
    try:
        dims = any(getattr(a, k) is not None
                   for k in ("n_layer", "n_embd", "n_head", "vocab", "block_size"))
        if a.metrics and not (a.params or a.model or dims):
            s = read_summary(a.metrics)
            psi, cfg = int(s["params"]), None
            a.nd = int(s["world_size"])
        else:
            psi, cfg = model_from_args(a)
            if a.metrics:
                read_summary(a.metrics)
        if a.grad_accum < 1:
            raise ValueError(f"--grad-accum must be >= 1, got {a.grad_accum}")
        if a.nd < 1 or (a.ranks_per_node and a.nd % a.ranks_per_node):
            raise ValueError(f"--nd must be >= 1 and divisible by --ranks-per-node: got nd={a.nd}, "
                             f"ranks-per-node={a.ranks_per_node}")
    except (ValueError, OSError) as e:
        tp.error(str(e))
    print_traffic(psi, a.nd, a.ranks_per_node, cfg, a.metrics, grad_accum=a.grad_accum,
                  precision=a.precision)
    return 0


if __name__ == "__main__":
    sys.exit(main())
