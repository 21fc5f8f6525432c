"""The tables ``benchmarks/train_peer.py`` prints from its launches' rows.

What it is
    ``best_of`` keeps each (mode, ranks)'s fastest launch, ``paired_ratios``
    pairs ringzero's launch with the peer's of the same round, ``table`` is
    the throughput table, ``step_table`` says where every mode's step goes
    (its compute and the communication it left exposed, the same three
    figures for torch and ringzero) and ``timeline_table`` details
    ringzero's step from its own metrics.
What it is not
    A launcher or a timer: the rows come from train_peer.py's ``run_mode``.
"""
from __future__ import annotations

import statistics

TORCH_MODES = ("ddp", "fsdp-grad-op", "fsdp-full", "fsdp2-full", "ds-zero1", "ds-zero2", "ds-zero3")  # peer_engines
RZ_MODES = {"ringzero": "fp32", "ringzero-fp16": "fp16", "ringzero-zpp": "fp32",
            "ringzero-zpp-blocking": "fp32"}                 # mode -> --precision
RZ_EXTRA = {"ringzero-zpp": ("--zeropp", "qwz,hpz,qgz"),    # mode -> its own trainer flags (ZeRO++: stage 3)
            "ringzero-zpp-blocking": ("--zeropp", "qwz,hpz,qgz", "--no-overlap")}
MODES = TORCH_MODES + tuple(RZ_MODES)
TIMELINE = ("step_time_s", "fwd_bwd_s", "compute_s", "comm_s", "reduce_s", "reduce_exposed_s",
            "gather_s", "gather_exposed_s", "param_gather_exposed_s", "progress_cpu_s")
EXPOSED = ("reduce_exposed_s", "gather_exposed_s", "param_gather_exposed_s")   # ringzero's waits


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


def step_rest(recs):
    """{"rest_s": the median over ringzero's timed steps of step - compute - waits} ({} without
    compute_s). Taken step by step: the medians of the parts do not add up to the median step
    (a difference of medians read -112 ms of a 49 s step once)."""
    if not recs or not all("compute_s" in r for r in recs):
        return {}
    return {"rest_s": statistics.median(r["step_time_s"] - r["compute_s"] - sum(r.get(k, 0.0) for k in EXPOSED)
                                        for r in recs)}


def step_split(row, warmup):
    """{step, compute, exposed, rest} in seconds (medians over the timed steps) for one good row, or {}.

    ringzero: its metrics' step time, compute (forward+backward less the waits for collectives)
    and the waits themselves (reductions, stage 3's gathers, the update's gathers); the rest is
    ``step_rest``'s, step by step.
    torch: the step, the compute probe's forward+backward (a plain TorchGPT, no wrapper, same batch,
    same moment on every rank: train_peer_worker.compute_probe) and the wrapped forward+backward
    less that probe (what DDP/FSDP left exposed, their hooks and copies included); the rest is the
    median of step - forward+backward, step by step."""
    if row.get("timeline"):
        t = row["timeline"]
        if "compute_s" not in t:
            return {}
        exposed = sum(t.get(k, 0.0) for k in EXPOSED)
        return {"step": t["step_time_s"], "compute": t["compute_s"], "exposed": exposed,
                "rest": t.get("rest_s", t["step_time_s"] - t["compute_s"] - exposed)}
    if row.get("compute_s") and row.get("fwd_bwd_s"):
        compute = statistics.median(row["compute_s"])
        fb = statistics.median(row["fwd_bwd_s"][warmup:])
        steps = row["step_time_s"][warmup:]
        return {"step": statistics.median(steps), "compute": compute, "exposed": max(0.0, fb - compute),
                "rest": statistics.median(s - f for s, f in zip(steps, row["fwd_bwd_s"][warmup:]))}
    return {}


def step_table(rows, warmup):
    """Every mode's step, its compute and its exposed communication (ms, rank 0, medians)."""
    lines = ["| mode | ranks | step | compute (fwd+bwd) | exposed communication | the rest (clip, update) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        s = step_split(r, warmup) if r.get("ok") else {}
        if not s:
            continue
        lines.append(f"| {r['mode']} | {r['ranks']} | {s['step'] * 1e3:.1f} | {s['compute'] * 1e3:.1f} | "
                     f"{s['exposed'] * 1e3:.1f} | {s['rest'] * 1e3:.1f} |")
    return "\n".join(lines) if len(lines) > 2 else ""


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
            q = paired_ratios(launches, m, r["mode"], r["ranks"]) if r["mode"] != m else []
            span = f" ({min(q):.2f}–{max(q):.2f})" if len(q) > 1 else ""
            ratio += f" {statistics.median(q):.2f}×{span} |" if q else " — |"
        every = ", ".join(f"{t if t is not None else 'failed'} ({ld:.1f})"
                          for t, ld in zip(r["tokens_per_s_all"], r["load_all"]))
        lines.append(f"| {r['mode']} | {r['ranks']} | {r['tokens_per_s']:.0f} | {mib} | "
                     f"{r['rss_start_max'] / 2**20:.0f} MiB | "
                     f"{r['loss_first']:.3f} → {r['loss_last']:.3f} |{ratio} {every} |")
    return "\n".join(lines)
