"""``python -m ringzero.fit BENCH.json``: an α–β model of the ring, fitted to this machine.

What it is
    The cost of one Ring call over n ranks on a buffer of S bytes:

        T = steps · α + wire · β

    where steps (latency rounds) and wire (bytes this rank sends) are the
    Ring's own schedule, ``ringzero.comm.schedule.steps_wire``: e.g. a ring
    all-reduce takes 2(n-1) steps and 2(n-1)/n · S bytes, a direct one 2
    steps and the same bytes, recursive doubling log2 n steps and S·log2 n
    bytes. The schedule's thresholds are those the bench ran with, read from
    its file's meta (small_bytes, latency_bytes, tree_bytes, direct_bytes);
    a file without them is read with the Ring's defaults for each n.

    α is the latency of one step (one send/recv pair and its Python overhead),
    β the seconds per byte a rank puts on the wire (the local add is folded in).

    The fit minimises the sum of |log(predicted / measured)| (or, with
    --method lsq, the squared relative error), so a 4 KiB point counts as much
    as a 64 MiB one and a few points slowed by the busy machine cannot drag the
    fit. It uses every other size of each (op, n) series; the other half is
    held out and the error on it is printed.
    Then it predicts ring all-reduce time and per-step communication time of
    each ZeRO stage for Nd up to 1024 and Ψ up to 100B: an honest statement
    about scale this machine cannot run, valid as far as α and β stay what
    they are here (they will not on a real network: refit there).

What it is not
    A benchmark: it reads the JSON that ``python -m ringzero.bench`` writes
    (a list of rows, or {"rows": [...]}, with op, impl, n, bytes, time_us, ...).
    Sizes follow nccl-tests: ``bytes`` is the whole buffer S (the all-gather's
    output, the reduce-scatter's input).
"""
from __future__ import annotations

import argparse
import json
import math
import sys

import numpy as np

from ringzero.comm import schedule  # (no MPI in it)
from ringzero.runtime import accounting as acc

OPS = {"allreduce": "all_reduce", "reducescatter": "reduce_scatter", "allgather": "all_gather"}
TOLERANCE = 0.5           # held-out |relative error|, median must be below this (see README)


def norm_op(op: str) -> str | None:
    return OPS.get(str(op).lower().replace("_", "").replace("-", ""))


def _knobs(row, knobs):
    """The thresholds a row ran with: its file's meta, then the caller's (CLI), then defaults."""
    return {**(knobs or {}), **row.get("knobs", {})}


def load_rows(path: str) -> list:
    """Bench rows from a JSON file (a list, or {"rows": [...]}); one-line errors."""
    try:
        with open(path) as fh:
            d = json.load(fh)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None
    rows = d.get("rows") if isinstance(d, dict) else d
    if not isinstance(rows, list):
        raise ValueError(f"{path}: expected a JSON list of rows or {{\"rows\": [...]}}, "
                         f"got {type(d).__name__}")
    meta = (d.get("meta") or {}) if isinstance(d, dict) else {}
    ran = {k: int(meta[k]) for k in schedule.KNOBS if isinstance(meta, dict) and meta.get(k) is not None}
    if ran:  # the thresholds the Ring ran with, recorded by the bench: they decide the schedule
        rows = [{"knobs": ran, **r} if isinstance(r, dict) else r for r in rows]
    for i, r in enumerate(rows):
        miss = [k for k in ("op", "impl", "n", "bytes", "time_us") if k not in r]
        if miss:
            raise ValueError(f"{path}: row {i} lacks {miss}; has {sorted(r)}")
    return rows


def select(rows, op="all_reduce", impl="ring") -> list:
    """Rows of one op and impl with n >= 2, positive time, and not flagged wrong."""
    return [r for r in rows if norm_op(r["op"]) == op and r["impl"] == impl
            and int(r["n"]) >= 2 and float(r["time_us"]) > 0 and not r.get("wrong")]


def split_alternate(rows) -> tuple:
    """(fit, held_out): within each (op, n) series sorted by size, every other row held out."""
    series = {}
    for r in rows:
        series.setdefault((norm_op(r["op"]), int(r["n"])), []).append(r)
    fit, held = [], []
    for k in sorted(series):
        for i, r in enumerate(sorted(series[k], key=lambda r: float(r["bytes"]))):
            (held if i % 2 else fit).append(r)
    return fit, held


def _design(rows, knobs):
    X = np.array([schedule.steps_wire(norm_op(r["op"]), int(r["n"]), float(r["bytes"]), **_knobs(r, knobs))
                  for r in rows], np.float64)                 # (m, 2) steps, wire bytes
    t = np.array([float(r["time_us"]) * 1e-6 for r in rows])  # (m,) seconds
    return X, t


def _lsq(X, t):
    """α, β >= 0 minimising sum((pred - t) / t)²."""
    A, b = X / t[:, None], np.ones_like(t)
    sol = np.linalg.lstsq(A, b, rcond=None)[0]
    if (sol < 0).any():                                       # clamp: best single-term fit
        cands = []
        for j in (0, 1):
            c = np.zeros(2)
            c[j] = max(0.0, (A[:, j] @ b) / max(A[:, j] @ A[:, j], 1e-300))
            cands.append((np.sum((A @ c - b) ** 2), c))
        sol = min(cands, key=lambda x: x[0])[1]
    return sol


def _l1log(X, t):
    """α, β > 0 minimising sum |log(pred / t)|: a median-like fit that a few
    points slowed by a busy machine (ranks sharing cores) cannot drag away.
    Grid search over log α, log β, refined around the best cell until the
    cells are far below any measurement's precision."""
    la, lb = np.log(np.array([1e-9, 1e-1])), np.log(np.array([1e-13, 1e-6]))
    lt = np.log(t)
    best = None
    for _ in range(10):
        ga = np.exp(np.linspace(la[0], la[1], 161))           # (161,)
        gb = np.exp(np.linspace(lb[0], lb[1], 161))           # (161,)
        pred = (X[:, 0, None, None] * ga[None, :, None] +
                X[:, 1, None, None] * gb[None, None, :])      # (m, 161, 161)
        cost = np.abs(np.log(np.maximum(pred, 1e-300)) - lt[:, None, None]).sum(0)
        i, j = np.unravel_index(np.argmin(cost), cost.shape)
        best = np.array([ga[i], gb[j]])
        da, db = (la[1] - la[0]) / 160 * 4, (lb[1] - lb[0]) / 160 * 4
        la = np.log(best[0]) + np.array([-da, da])
        lb = np.log(best[1]) + np.array([-db, db])
    return best


def fit_alpha_beta(rows, knobs: dict | None = None, method: str = "l1log") -> dict:
    """Fit α (s) and β (s/byte) to bench rows. method: "l1log" (robust, default) or "lsq"."""
    if len(rows) < 2:
        raise ValueError(f"need >= 2 bench rows to fit alpha and beta, got {len(rows)}")
    if method not in ("l1log", "lsq"):
        raise ValueError(f"method must be l1log or lsq, got {method!r}")
    X, t = _design(rows, knobs)
    sol = _l1log(X, t) if method == "l1log" else _lsq(X, t)
    alpha, beta = float(sol[0]), float(sol[1])
    return {"alpha_s": alpha, "beta_s_per_byte": beta, "method": method,
            "bandwidth_GBps": (1 / beta / 1e9) if beta > 0 else math.inf, "rows": len(rows)}


def predict(model: dict, op: str, n: int, S: float, knobs: dict | None = None) -> float:
    """Seconds for one call of ``op`` over n ranks on S bytes."""
    st, w = schedule.steps_wire(op, n, S, **(knobs or {}))
    return st * model["alpha_s"] + w * model["beta_s_per_byte"]


def errors(model: dict, rows, knobs: dict | None = None) -> list:
    """[(row, predicted_us, relative error)] for rows."""
    out = []
    for r in rows:
        p = predict(model, norm_op(r["op"]), int(r["n"]), float(r["bytes"]), _knobs(r, knobs)) * 1e6
        out.append((r, p, (p - float(r["time_us"])) / float(r["time_us"])))
    return out


def step_time(model: dict, stage, psi: int, nd: int, units: int = 1, ranks_per_node=None,
              elem_bytes: int = 2) -> float:
    """Predicted communication seconds per training step, without overlap.

    Every unit pays its collectives' latency steps; the wire bytes are the
    stage's traffic from ringzero.runtime.accounting. Large units: ring schedule.
    """
    st = acc.parse_stage(stage)
    el = acc.traffic_elements(st, psi, nd, ranks_per_node)
    group = ranks_per_node if st == "hybrid" else nd
    passes = {"0": 2, "1": 2, "2": 2, "3": 3, "hybrid": 3}[st]   # RS/AG passes per unit
    steps = units * passes * (group - 1)
    if st == "hybrid":
        steps += units * 2 * (nd // group - 1)
    wire = sum(el.values()) * elem_bytes
    return steps * model["alpha_s"] + wire * model["beta_s_per_byte"]


def report(rows, impl="ring", op="all_reduce", knobs=None, units=1,
           tolerance=TOLERANCE, method="l1log", predict_n=None) -> dict:
    """Fit per world size n (and pooled), check held-out sizes, predict from n = predict_n.

    On this machine α and β depend on n: with more ranks than cores, a step
    waits for the scheduler, so one (α, β) cannot describe n = 2 and n = 8 at
    once. The check therefore fits each n on every other size and predicts the
    sizes it did not see; the pooled fit is printed beside it for comparison.
    Predictions use the fit at predict_n (default: the smallest n measured,
    where each rank has a core to itself, as on a cluster).
    """
    sel = select(rows, op, impl)
    ns = sorted({int(r["n"]) for r in sel})
    per_n, held_rows = {}, []
    for n in ns:
        rs = [r for r in sel if int(r["n"]) == n]
        fr, hr = split_alternate(rs)
        if len(fr) < 2 or not hr:
            raise ValueError(f"need >= 3 sizes of {op} (impl {impl!r}) at n={n} to fit and hold "
                             f"some out, got {len(rs)}")
        m_n = fit_alpha_beta(fr, knobs, method)
        per_n[str(n)] = {"fit_on_half": m_n, "fit_on_all": fit_alpha_beta(rs, knobs, method)}
        held_rows += [(r, p, e) for r, p, e in errors(m_n, hr, knobs)]
    if not ns:
        raise ValueError(f"need >= 2 sizes per (op, n) to hold some out; got 0 {op} rows of "
                         f"impl {impl!r}")
    fit_rows, held = split_alternate(sel)
    pooled = fit_alpha_beta(fit_rows, knobs, method)
    pooled_err = np.abs([e for _, _, e in errors(pooled, held, knobs)])
    rel = np.abs([e for _, _, e in held_rows])
    pn = predict_n if predict_n is not None else ns[0]
    if str(pn) not in per_n:
        raise ValueError(f"--predict-from n={pn} has no rows; measured n: {ns}")
    base = per_n[str(pn)]["fit_on_all"]
    pred_ar = {f"{n}": {f"{psi / 1e9:g}B": predict(base, "all_reduce", n, 2 * psi, knobs)
                        for psi in (1.5e9, 7.5e9, 100e9)} for n in (2, 8, 64, 256, 1024)}
    pred_step = {st: {f"{n}": {f"{psi / 1e9:g}B": step_time(base, st, int(psi), n, units)
                               for psi in (1.5e9, 7.5e9, 100e9)} for n in (8, 64, 1024)}
                 for st in ("0", "2", "3")}
    lat0 = {"alpha_s": base["alpha_s"], "beta_s_per_byte": 0.0}
    share = {f"{psi / 1e9:g}B": step_time(lat0, "3", int(psi), 1024, units) /
             step_time(base, "3", int(psi), 1024, units) for psi in (1.5e9, 100e9)}
    return {"op": op, "impl": impl, "method": method, "fit_per_n": per_n,
            "latency_share_1024": share,
            "dtypes": sorted({str(r.get("dtype", "?")) for r in sel}),
            "pooled_fit_on_half": pooled,
            "pooled_median_abs_rel_err": float(np.median(pooled_err)),
            "held_out": [{"n": int(r["n"]), "bytes": int(r["bytes"]),
                          "measured_us": float(r["time_us"]), "predicted_us": p, "rel_err": e}
                         for r, p, e in held_rows],
            "median_abs_rel_err": float(np.median(rel)), "max_abs_rel_err": float(rel.max()),
            "tolerance": tolerance, "within_tolerance": bool(np.median(rel) <= tolerance),
            "predict_from_n": pn, "predict_model": base,
            "predict_allreduce_fp16_grads_s": pred_ar, "predict_step_comm_s": pred_step,
            "units": units}


def _t(s: float) -> str:
    return f"{s * 1e6:.0f} us" if s < 1e-3 else f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def print_report(r: dict, f=None):
    p = lambda *a: print(*a, file=f or sys.stdout)  # noqa: E731
    how = {"l1log": "least |log(predicted/measured)|", "lsq": "least squares of relative error"}
    p(f"α–β fit of {r['impl']} {r['op']}: T = steps·α + wire_bytes·β, {how[r['method']]}")

    def ab(m):
        return (f"α = {m['alpha_s'] * 1e6:8.2f} us, β = {m['beta_s_per_byte'] * 1e9:.4f} ns/B "
                f"({m['bandwidth_GBps']:.2f} GB/s)")
    for n, d in r["fit_per_n"].items():
        p(f"  n = {n:>3}: every other size {ab(d['fit_on_half'])};  all sizes {ab(d['fit_on_all'])}")
    p(f"  pooled over n, every other size: {ab(r['pooled_fit_on_half'])}; its held-out median "
      f"|error| {100 * r['pooled_median_abs_rel_err']:.0f} % (one α, β cannot serve every n "
      f"when ranks outnumber cores)")
    p("\nHeld-out sizes, each predicted by the fit of its own n on the other sizes:")
    p(f"  {'n':>3} {'bytes':>12} {'measured':>12} {'predicted':>12} {'error':>8}")
    for h in r["held_out"]:
        p(f"  {h['n']:>3} {h['bytes']:>12,} {_t(h['measured_us'] * 1e-6):>12} "
          f"{_t(h['predicted_us'] * 1e-6):>12} {100 * h['rel_err']:>+7.1f}%")
    p(f"  median |error| {100 * r['median_abs_rel_err']:.1f} %, max {100 * r['max_abs_rel_err']:.1f} %; "
      f"tolerance: median <= {100 * r['tolerance']:.0f} % -> "
      f"{'within' if r['within_tolerance'] else 'OUTSIDE'}")
    p(f"\nPredictions use the n = {r['predict_from_n']} fit on all sizes: {ab(r['predict_model'])}")
    p(f"  (bench rows in {', '.join(r['dtypes'])}; the fp16 predictions below assume the same cost "
      f"per byte: bench with -d float16 to fit fp16 itself)")
    p("\nPredicted ring all-reduce of the fp16 gradients (2Ψ bytes), this machine's α and β:")
    cols = list(next(iter(r["predict_allreduce_fp16_grads_s"].values())))
    p("  " + f"{'Nd':>6}" + "".join(f"{'Ψ=' + c:>12}" for c in cols))
    for n, row in r["predict_allreduce_fp16_grads_s"].items():
        p("  " + f"{n:>6}" + "".join(f"{_t(v):>12}" for v in row.values()))
    p(f"\nPredicted communication per step, no overlap, {r['units']} unit(s) "
      f"(stage 0-2: RS + AG of Ψ; stage 3: RS + 2 AG):")
    p("  " + f"{'stage':>6}{'Nd':>6}" + "".join(f"{'Ψ=' + c:>12}" for c in cols))
    for st, by_n in r["predict_step_comm_s"].items():
        for n, row in by_n.items():
            p("  " + f"{st:>6}{n:>6}" + "".join(f"{_t(v):>12}" for v in row.values()))
    lat = r["latency_share_1024"]
    p(f"  the wire term grows as (Nd-1)/Nd, so it is flat in Nd; the latency term grows as "
      f"Nd·units: at Nd = 1024 it is {100 * lat['1.5B']:.2f} % of stage 3's time at Ψ = 1.5B "
      f"and {100 * lat['100B']:.3f} % at 100B with {r['units']} unit(s)")


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m ringzero.fit",
        description="Fit latency α and inverse bandwidth β of ringzero's ring to a bench JSON, print the "
                    "error on held-out bench points, and predict ring all-reduce time and per-step "
                    "communication time of each stage for Nd up to 1024 and Ψ up to 100B.")
    ap.add_argument("bench", nargs="+", help="JSON file(s) written by python -m ringzero.bench "
                                             "(one per world size; their rows are pooled)")
    ap.add_argument("--op", default="all_reduce", choices=sorted(OPS.values()))
    ap.add_argument("--impl", default="ring", help="rows of this impl (ring or mpi)")
    ap.add_argument("--small-bytes", type=int, default=None,
                    help="the Ring's recursive-doubling cutoff (RINGZERO_SMALL_BYTES) for rows whose "
                         "file does not record it in meta.small_bytes (default: the Ring's for each n)")
    ap.add_argument("--units", type=int, default=1, help="units per model, for per-step latency")
    ap.add_argument("--method", default="l1log", choices=("l1log", "lsq"),
                    help="l1log: robust to the busy machine's outliers (default); lsq: relative "
                         "least squares")
    ap.add_argument("--predict-from", type=int, default=None,
                    help="world size whose fit makes the predictions (default: the smallest)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    try:
        if a.units < 1:
            raise ValueError(f"--units must be >= 1, got {a.units}")
        knobs = None if a.small_bytes is None else {"small_bytes": a.small_bytes}
        r = report([row for b in a.bench for row in load_rows(b)], a.impl, a.op, knobs,
                   a.units, method=a.method, predict_n=a.predict_from)
    except (ValueError, OSError) as e:
        ap.error(str(e))
    if a.json:
        print(json.dumps(r, indent=1))
    else:
        print_report(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
