"""``python -m ringzero.explain precision``: why fp32 state cannot be dropped, by experiment.

What it is
    The precision lesson behind ZeRO's 16Ψ accounting, shown on real IEEE
    fp16 values (numpy.float16): where underflow starts and how the boundary
    rounds, when w + Δw == w (swamping) and how that depends on w's place in
    its binade, a toy run where fp16 weights stall while an fp32 master
    tracks fp32, and loss scaling (underflowed gradients survive; the dynamic
    scaler of ringzero.runtime.optim backs off on an overflow). The
    experiments are pure functions, dtype-generic where it matters, so
    ``ringzero.tools.bf16`` runs them on ml_dtypes.bfloat16 beside fp16
    (bf16 imports this module, never the other way round).
    ``ringzero.tools.explain`` wires the subcommand (``print_precision``,
    then bf16's ``print_bf16``) and re-exports these names.

What it is not
    No thresholds are typed in: each is searched for by experiment; the seed
    document's claims are printed beside them for comparison only. No CLI of
    its own.
"""
from __future__ import annotations

import sys

import numpy as np

f16, f32, f64 = np.float16, np.float32, np.float64

# The seed document's claims, printed beside what the experiments find.
SEED_UNDERFLOW = "below 2^-24 becomes zero"
SEED_SWAMP_RATIO = "2048x"


# ---- the experiments (pure; the tests call these) ------------------------------
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
