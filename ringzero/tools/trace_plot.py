"""``python -m ringzero.plot trace DIR --step N -o step.png``: one step of every rank, a lane per thread.

What it is
    The trace files of ``--trace DIR`` (tools/trace_summary.py reads them), drawn with matplotlib: for
    each rank its main thread (compute, the collectives it ran or waited for, the update), its progress
    thread (the started collectives) and the offload reader and writer (tile I/O), on one time axis in
    ms from the earliest start of that step on any rank. Colours are the event categories; a thin
    outline marks each rank's step span, so a rank that waits for a slow one shows where.

What it is not
    Perfetto: no zoom, no arrows (``python -m ringzero.trace merge DIR`` opens there). No analysis.
"""
from __future__ import annotations

from ringzero.tools.trace_summary import TraceError, load, main_tid

COLOURS = {"compute": "#4c72b0", "comm": "#dd8452", "comm_wait": "#c44e52", "comm_block": "#c44e52",
           "comm_start": "#8c8c8c", "update_piece": "#55a868", "norm": "#8172b3", "data": "#937860",
           "offload_read": "#da8bc3", "offload_write": "#64b5cd", "offload_wait": "#c44e52",
           "eval": "#ccb974", "checkpoint": "#ccb974"}
LABELS = {"compute": "compute", "comm": "collective (run)", "comm_wait": "waiting for a collective",
          "comm_block": "waiting for a collective", "comm_start": "starting a collective",
          "update_piece": "update (AdamW piece)", "norm": "grad norm", "offload_read": "tile read",
          "offload_write": "tile write", "offload_wait": "waiting for a tile read", "data": "data loading",
          "eval": "evaluation, checkpoint", "checkpoint": "evaluation, checkpoint"}
UPDATE = "#d9ecd9"         # the update's whole span, under its pieces: what is left pale is its waits


def _lanes(doc, step):
    """[(lane label, [events])] of one rank at one step: main, then its other threads by first use."""
    tid = main_tid(doc)
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    ev = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["args"].get("step") == step
          and e["cat"] not in ("kernel", "user_annotation")]       # the device lane's copies (comm/trace.py)
    lanes = {tid: []}
    for e in ev:
        lanes.setdefault(e["tid"], []).append(e)
    r = doc["distributedInfo"]["rank"]
    out = []
    for t, es in lanes.items():
        nm = "main" if t == tid else ("progress" if "progress" in names.get(t, "") else names.get(t, str(t)))
        out.append((f"rank {r} {nm}", es))
    return out


def plot_trace(d: str, step: int, out: str) -> str:
    docs = load(d)
    spans = [e for doc in docs for e in doc["traceEvents"] if e["ph"] == "X" and e.get("cat") == "step"
             and e["args"]["step"] == step]
    if not spans:
        have = sorted({e["args"]["step"] for doc in docs for e in doc["traceEvents"] if e.get("cat") == "step"})
        raise TraceError(f"{d}: no step {step} in the traces; recorded steps: {have}")
    t0 = min(e["ts"] for e in spans)
    lanes = [lane for doc in docs for lane in _lanes(doc, step)]
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("ringzero.plot needs matplotlib: pip install 'ringzero[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(lanes) + 1.6), dpi=110)
    seen = set()
    for y, (label, es) in enumerate(lanes):
        for e in es:
            cat = e["cat"]
            x, w = (e["ts"] - t0) / 1e3, e["dur"] / 1e3
            if cat == "step":
                ax.add_patch(plt.Rectangle((x, y - 0.42), w, 0.84, fill=False, lw=0.8, ec="k"))
                continue
            if cat == "update":                       # behind its pieces (offload: the I/O it waits for)
                lab = None if "update" in seen else "update (its span)"
                seen.add("update")
                ax.barh(y, w, left=x, height=0.7, color=UPDATE, label=lab, lw=0, zorder=0)
                continue
            if cat not in COLOURS:                    # parents (forward + backward) are outlines' kin
                continue
            lab = LABELS.get(cat)
            lab = None if lab in seen else lab        # one legend entry a label (two kinds of wait share one)
            seen.add(lab)
            ax.barh(y, w, left=x, height=0.7, color=COLOURS[cat], label=lab, lw=0, zorder=1)
    ax.set_yticks(range(len(lanes)), [lb for lb, _ in lanes], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(f"ms from the start of step {step}")
    info = docs[0]["distributedInfo"]
    ax.set_title(f"step {step}: {len(docs)} ranks, {info.get('nodes', 1)} node(s), stage {info.get('stage')}, "
                 f"overlap {'on' if info.get('overlap') else 'off'}", fontsize=9)
    ax.autoscale_view()
    fig.legend(fontsize=7, loc="lower center", ncol=6, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(out)
    plt.close(fig)
    return out
