"""bf16 beside fp16: the experiments of ``python -m ringzero.explain precision`` run on
ml_dtypes.bfloat16 (``--precision bf16``).

What it is
    The underflow and overflow thresholds (bisection), the swamping ratio
    (exhaustion over every bf16 value), the share of small gradients a cast
    flushes to zero, and the toy run, each for fp16 and bf16 side by side,
    using the dtype-generic experiments of ringzero.tools.precision. What they
    show: bf16 has fp32's exponent range (no underflow at 2^-24, no overflow
    at 65504: no loss scaler) and 8 significant bits (an update is lost at
    256x the weight instead of 2048x: the fp32 master matters more).

What it is not
    No typed-in thresholds: numpy's / ml_dtypes' finfo is printed beside the
    experiments only as a check. Without ml_dtypes it says so and does nothing.
"""
from __future__ import annotations

import sys

import numpy as np

from ringzero.tools.precision import bf16_type, f16, f32, overflow_threshold, swamp_ratio, toy_run, underflow_threshold


def cast_gradients(dtype, n: int = 100000, seed: int = 0, lo: float = -34, hi: float = -14) -> dict:
    """fp32 gradients log-uniform in [2^lo, 2^hi] cast to ``dtype`` with no loss scale:
    the fraction that becomes 0 and the worst relative error of the rest."""
    rng = np.random.default_rng(seed)
    g = (2.0 ** rng.uniform(lo, hi, n)).astype(f32)          # (n,) true fp32 gradients
    c = g.astype(dtype).astype(f32)
    nz = c != 0
    return {"n": n, "zero": float(np.mean(~nz)),
            "max_rel_err": float((np.abs(c - g) / g)[nz].max()) if nz.any() else float("nan")}


def bf16_vs_fp16(toy_steps: int = 4000) -> dict | None:
    """The fp16 experiments run on bf16 too (None without ml_dtypes)."""
    bf16 = bf16_type()
    if bf16 is None:
        return None
    import ml_dtypes
    out = {}
    for name, dt in (("fp16", f16), ("bf16", bf16)):
        fi = ml_dtypes.finfo(dt)                         # numpy's finfo does not know bf16
        out[name] = {"underflow": underflow_threshold(dt), "overflow": overflow_threshold(dt),
                     "swamp_at_1": swamp_ratio(1.0, dt), "swamp_at_1.5": swamp_ratio(1.5, dt),
                     "grads": cast_gradients(dt),
                     "toy": toy_run(n=256, steps=toy_steps, lr=1e-4, dtype=dt),
                     "finfo": {"smallest_subnormal": float(fi.smallest_subnormal),
                               "max": float(fi.max), "eps": float(fi.eps)}}
    return out



def print_bf16(f=None):
    p = lambda *a: print(*a, file=f or sys.stdout)  # noqa: E731
    r = bf16_vs_fp16()
    p("\n== bf16 beside fp16 (--precision bf16): the same experiments on ml_dtypes.bfloat16")
    if r is None:
        p("  skipped: needs ml_dtypes (pip install 'ringzero[bf16]')")
        return
    lg = lambda x: f"2^{np.log2(x):.0f}" if x > 0 and np.log2(x) == round(np.log2(x)) else f"{x:.6g}"  # noqa: E731
    a, b = r["fp16"], r["bf16"]
    rows = [
        ("largest magnitude that becomes 0", lg(a["underflow"]["largest_zero"]),
         lg(b["underflow"]["largest_zero"])),
        ("smallest nonzero it rounds to", lg(a["underflow"]["rounds_to"]), lg(b["underflow"]["rounds_to"])),
        ("smallest magnitude that becomes Inf", f"{a['overflow']['threshold']:.6g}",
         f"{b['overflow']['threshold']:.6g}"),
        ("largest finite value", f"{a['overflow']['largest_finite']:.6g}",
         f"{b['overflow']['largest_finite']:.6g}"),
        ("swamping: smallest w/Δw lost, w = 1", f"{a['swamp_at_1']['ratio']:g}x", f"{b['swamp_at_1']['ratio']:g}x"),
        ("                                w = 1.5", f"{a['swamp_at_1.5']['ratio']:g}x",
         f"{b['swamp_at_1.5']['ratio']:g}x"),
        ("grads in [2^-34, 2^-14] that become 0", f"{100 * a['grads']['zero']:.1f} %",
         f"{100 * b['grads']['zero']:.1f} %"),
        ("  worst relative error of the rest", f"{a['grads']['max_rel_err']:.2e}",
         f"{b['grads']['max_rel_err']:.2e}"),
        (f"toy run ({a['toy']['steps']} steps): in-place weights moved", f"{a['toy']['fp16_moved']:.4f}",
         f"{b['toy']['fp16_moved']:.4f}"),
        ("  (the fp32 run moved)", f"{a['toy']['fp32_moved']:.4f}", f"{b['toy']['fp32_moved']:.4f}"),
        ("  fp32 master's error vs fp32", f"{a['toy']['master_err']:.1e}", f"{b['toy']['master_err']:.1e}"),
    ]
    p(f"  {'found by experiment':<44}{'fp16':>14}{'bf16':>14}")
    for label, x, y in rows:
        p(f"  {label:<44}{x:>14}{y:>14}")
    p(f"  {'(finfo, beside: smallest subnormal)':<44}"
      f"{lg(a['finfo']['smallest_subnormal']):>14}{lg(b['finfo']['smallest_subnormal']):>14}")
    p(f"  {'(finfo max)':<44}{a['finfo']['max']:>14.6g}{b['finfo']['max']:>14.6g}")
    p("  bf16 keeps fp32's 8 exponent bits: gradients reach neither its floor nor its ceiling, so "
      "it runs with no loss scaler (nothing to scale up, no overflow to back off from). It has 8 "
      f"significant bits to fp16's 11: an update is lost at {b['swamp_at_1']['ratio']:g}x the weight, "
      f"not {a['swamp_at_1']['ratio']:g}x, so the fp32 master matters more, not less. Bytes: 2 per "
      "param and grad, as fp16: the 16Ψ table is the same (python -m ringzero.estimate --precision bf16).")
