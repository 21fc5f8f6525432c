"""``python -m ringzero.plot memory|busbw|loss|trace``: PNG figures for the accounting.

What it is
    memory  model state per rank against Nd for each stage, log-log, from
            ringzero.runtime.accounting (Ψ from --params or a GPT preset).
    busbw   bus bandwidth against message size, ringzero's ring beside the MPI
            library, one line per (impl, n), from a bench JSON.
    loss    training (and eval, where logged) loss against step from a trainer
            metrics .jsonl, with the unigram entropy of the held-out bytes.
    trace   one step of every rank of a --trace DIR, a lane per thread (tools/trace_plot.py).

What it is not
    Needed to train: matplotlib is an optional extra (``pip install
    ringzero[plot]``), imported only here and only when a plot is drawn, with
    the headless Agg backend so it works with no display.
"""
from __future__ import annotations

import argparse
import sys

from ringzero.runtime import accounting as acc
from ringzero.sizes import parse_size


def _plt():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("ringzero.plot needs matplotlib: pip install 'ringzero[plot]' "
                         "(or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_memory(psi: int, out: str, nd_max: int = 1024, ranks_per_node=None, gpu_mem=None,
                title=None) -> str:
    plt = _plt()
    nds = [n for n in range(1, nd_max + 1)]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for st in acc.STAGES:
        if st == "hybrid":
            if not ranks_per_node:
                continue
            xs = [n for n in nds if n % ranks_per_node == 0]
            ys = [acc.model_state_total(st, psi, n, ranks_per_node) / 1e9 for n in xs]
            label = f"HYBRID (Ng={ranks_per_node}): {acc.bytes_per_param_formula(st)}"
        else:
            xs, ys = nds, [acc.model_state_total(st, psi, n) / 1e9 for n in nds]
            label = f"stage {st}: {acc.bytes_per_param_formula(st)}"
        line, = ax.plot(xs, ys, label=label)
        if 64 in xs and st != "hybrid":        # the ZeRO paper's Nd, marked and labelled
            y = ys[xs.index(64)]
            ax.plot([64], [y], "o", color=line.get_color(), ms=4)
            ax.annotate(f"{y:.3g}", (64, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    if gpu_mem:
        ax.axhline(gpu_mem / 1e9, color="k", ls="--", lw=1, label=f"{gpu_mem / 1e9:g} GB per rank")
    ax.set_xlabel("data-parallel ranks Nd")
    ax.set_ylabel("model state per rank (GB = 1e9 B)")
    ax.set_title(title or f"ZeRO model state per rank, Ψ = {psi / 1e9:g}B (mixed-precision Adam)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def plot_busbw(rows: list, out: str, op: str = "all_reduce", title=None) -> str:
    from ringzero.tools.fit import norm_op
    plt = _plt()
    series = {}
    for r in rows:
        if norm_op(r["op"]) != op or r.get("wrong") or int(r["n"]) < 2:
            continue
        series.setdefault((r["impl"], int(r["n"])), []).append(
            (float(r["bytes"]), float(r["busbw_GBps"])))
    if not series:
        raise ValueError(f"no {op} rows with n >= 2 in the bench data; ops present: "
                         f"{sorted({r['op'] for r in rows})}")
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    ns = sorted({n for _, n in series})
    for (impl, n), pts in sorted(series.items()):
        pts.sort()                             # one colour per n; ring solid, MPI dashed
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color=f"C{ns.index(n)}",
                ls="-" if impl == "ring" else "--", marker="o" if impl == "ring" else "x", ms=3,
                label=f"{impl}, n={n}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(title or f"{op}: ringzero ring vs MPI library")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def plot_loss(path: str, out: str, title=None) -> str:
    from ringzero.metrics import read_metrics
    steps, summ = read_metrics(path)
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    ax.plot([d["step"] for d in steps], [d["loss"] for d in steps], lw=1, label="train loss")
    ev = [d for d in steps if d.get("eval_loss") is not None]
    if ev:
        ax.plot([d["step"] for d in ev], [d["eval_loss"] for d in ev], "o-", label="eval loss")
    if summ and summ.get("unigram_entropy") is not None:
        ax.axhline(summ["unigram_entropy"], color="k", ls="--", lw=1,
                   label=f"unigram entropy {summ['unigram_entropy']:.2f} nats")
    if summ and summ.get("eval_loss") is not None:
        ax.axhline(summ["eval_loss"], color="C1", ls=":", lw=1,
                   label=f"final eval loss {summ['eval_loss']:.2f}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    if summ:
        title = title or (f"stage {summ.get('stage')}, Nd = {summ.get('world_size')}, "
                          f"Ψ = {summ.get('params'):,}")
    ax.set_title(title or path)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def eval_points(steps: list, summ) -> tuple:
    """(steps, losses) of a run's held-out evaluations: the periodic ones (in their step's record) and
    the final one (in the summary), at the last step's record, the step after which it ran."""
    ev = [(d["step"], d["eval_loss"]) for d in steps if d.get("eval_loss") is not None]
    if summ and summ.get("eval_loss") is not None and steps and (not ev or ev[-1][0] != steps[-1]["step"]):
        ev.append((steps[-1]["step"], summ["eval_loss"]))
    return [x for x, _ in ev], [y for _, y in ev]


def plot_losses(paths: list, out: str, title=None) -> dict:
    """Several runs side by side (e.g. ZeRO++'s switches against the unquantized run): each file's
    train loss (thin) and eval loss (markers), labelled by the file's name. Returns {name: final eval
    loss or None}."""
    import os

    from ringzero.metrics import read_metrics
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    finals = {}
    for i, path in enumerate(paths):
        steps, summ = read_metrics(path)
        name = os.path.splitext(os.path.basename(path))[0]
        ax.plot([d["step"] for d in steps], [d["loss"] for d in steps], lw=0.8, color=f"C{i}", alpha=0.6,
                label=f"{name} train")
        xs, ys = eval_points(steps, summ)
        if xs:
            ax.plot(xs, ys, "o-", color=f"C{i}", ms=3, label=f"{name} eval")
        finals[name] = summ.get("eval_loss") if summ else None
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(title or "loss, side by side")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return finals


def main(argv=None):
    from ringzero.tools.estimate import add_model_args, model_from_args
    ap = argparse.ArgumentParser(prog="python -m ringzero.plot",
                                 description="Write PNG figures (matplotlib, headless Agg backend).")
    sub = ap.add_subparsers(dest="what", required=True)
    m = sub.add_parser("memory", help="model state per rank vs Nd, per stage (log-log)",
                       description="Plots model-state bytes per rank against Nd = 1..--nd-max for "
                                   "stages 0-3 (and HYBRID with --ranks-per-node), log-log.")
    add_model_args(m)
    m.add_argument("--nd-max", type=int, default=1024)
    m.add_argument("--ranks-per-node", type=int)
    m.add_argument("--gpu-mem", help="draw a per-rank memory line, e.g. 32GB")
    b = sub.add_parser("busbw", help="bus bandwidth vs size, ring vs MPI, from a bench JSON",
                       description="Plots busbw_GBps against bytes for each (impl, n) of one op.")
    b.add_argument("bench", nargs="+", help="bench JSON file(s), rows pooled")
    b.add_argument("--op", default="all_reduce")
    lo = sub.add_parser("loss", help="loss curve from a trainer metrics .jsonl (several: side by side)",
                        description="Plots train loss per step (eval loss and the unigram entropy "
                                    "where the file has them); several files: their curves in one plot, "
                                    "with each final eval loss printed.")
    lo.add_argument("metrics", nargs="+")
    tr = sub.add_parser("trace", help="one step of every rank, a lane per thread, from --trace DIR",
                        description="Draws step N of the trainer's --trace DIR (tools/trace_plot.py).")
    tr.add_argument("dir")
    tr.add_argument("--step", type=int, required=True)
    for p in (m, b, lo, tr):
        p.add_argument("-o", "--out", required=True, help="PNG file to write")
    a = ap.parse_args(argv)
    sp = {"memory": m, "busbw": b, "loss": lo, "trace": tr}[a.what]
    try:
        if a.what == "memory":
            psi, _ = model_from_args(a)
            if a.nd_max < 1:
                raise ValueError(f"--nd-max must be >= 1, got {a.nd_max}")
            gpu = parse_size(a.gpu_mem) if a.gpu_mem else None
            out = plot_memory(psi, a.out, a.nd_max, a.ranks_per_node, gpu)
        elif a.what == "busbw":
            from ringzero.tools.fit import load_rows
            out = plot_busbw([row for f in a.bench for row in load_rows(f)], a.out, a.op)
        elif a.what == "trace":
            from ringzero.tools.trace_plot import plot_trace
            out = plot_trace(a.dir, a.step, a.out)
        elif len(a.metrics) == 1:
            out = plot_loss(a.metrics[0], a.out)
        else:
            for name, ev in plot_losses(a.metrics, a.out).items():
                print(f"{name}: final eval loss {'-' if ev is None else f'{ev:.4f}'}")
            out = a.out
    except (ValueError, OSError) as e:
        sp.error(str(e))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
