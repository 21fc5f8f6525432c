"""The command line of ``python -m ringzero.simulate``: parse, predict, print, plot.

What it is
    Arguments to a GPT shape, a Compute (measured here, read from a
    ``measure`` JSON, or from a FLOP rate) and Links (fitted on bench files or
    given; with ``--nodes N --inter-bandwidth R`` a second link between N
    nodes), then ringzero.tools.simulate.step_time for every stage and Nd,
    with and without overlap; ``--plot`` draws step time against link
    bandwidth; ``--disk-bw`` adds the step with offload (the update's state
    streamed from disk: tools/tiers.py offload_time). ``measure`` (under mpirun)
    times the model's units on N ranks at once.

What it is not
    The model: every number comes from ringzero.tools.simulate.
"""
from __future__ import annotations

import math
from decimal import Decimal

import numpy as np

from ringzero.runtime import accounting as acc
from ringzero.runtime.flat import Layout
from ringzero.sizes import parse_quantity, parse_rate
from ringzero.tools.simulate import LINKS, Compute, Links, Nodes, flops_compute, measure_compute, step_time


# ---- CLI ------------------------------------------------------------------------------
def _shapes():
    from ringzero.nn.gpt import GPTConfig
    from ringzero.tools.estimate import ALL_MODELS
    # the ZeRO paper's 7.5B example as a GPT shape: 36 blocks of width 4096 (Ψ = 7.46B); the simulator
    # times and counts a GPT, so the Llama-family presets are not among its shapes
    gpts = {k: v for k, v in ALL_MODELS.items() if isinstance(v, GPTConfig)}
    return {**gpts, "gpt-7.5b": GPTConfig(36, 32, 4096, 1024, 50257)}


# seconds and FLOP/s per suffix (upper case, as ringzero.sizes.parse_quantity reads them); bytes/s: sizes.parse_rate
TIME_UNITS = {"": 1, "S": 1, "MS": Decimal("1e-3"), "US": Decimal("1e-6"), "NS": Decimal("1e-9")}
FLOP_UNITS = {"": 1, "G": 10**9, "T": 10**12, "TFLOPS": 10**12, "P": 10**15}


def _seconds(text, what) -> float:
    return float(parse_quantity(text, TIME_UNITS, what, "10us"))


def _flops(text, what) -> float:
    return float(parse_quantity(text, FLOP_UNITS, what, "40T"))


def build_parser():
    import argparse
    ap = argparse.ArgumentParser(
        prog="python -m ringzero.simulate",
        description="Predict the step time of ZeRO stages 0-3 and hybrid at any Nd and Ψ, with and "
                    "without compute-communication overlap, from compute (measured here, or a FLOP "
                    "rate) and the α-β of each link (fitted on bench files, or given).",
        epilog="Examples: --model gpt-7.5b --nd 64 --flops 40T --link nvlink --plot docs/img/x.png;  "
               "--n-layer 4 --n-embd 256 --n-head 4 --block-size 128 --vocab 256 --batch 8 --measure "
               "--bench b2.json b4.json --nd 4.   'measure' (under mpirun) writes compute per unit.")
    ap.add_argument("what", nargs="?", default="predict", choices=("predict", "measure"),
                    help="predict (default) or measure: time the model's units here (run it under "
                         "mpirun -n N to measure N ranks sharing the machine) and write --json")
    ap.add_argument("--model", choices=sorted(_shapes()), help="a GPT shape")
    for k in ("n_layer", "n_embd", "n_head", "vocab", "block_size"):
        ap.add_argument("--" + k.replace("_", "-"), type=int, help=f"GPT {k} (overrides --model)")
    ap.add_argument("--batch", type=int, default=8, help="micro-batch per rank (default 8)")
    ap.add_argument("--seq", type=int, help="sequence length (default: block size)")
    ap.add_argument("--nd", type=int, nargs="+", default=[64], help="data-parallel ranks (several allowed)")
    ap.add_argument("--stages", default="0,1,2,3", help="comma-separated; hybrid needs --ranks-per-node")
    ap.add_argument("--ranks-per-node", type=int, help="Ng for hybrid")
    c = ap.add_argument_group("compute (one of)")
    c.add_argument("--flops", help="sustained FLOP/s per rank, e.g. 40T")
    c.add_argument("--mem-bw", default="900GB/s", help="memory bandwidth with --flops (update, casts)")
    c.add_argument("--measure", action="store_true", help="time the model's forward/backward here")
    c.add_argument("--compute", help="a JSON written by 'measure'")
    c.add_argument("--cores", type=int, help="with --measure: ranks beyond this many share cores")
    lk = ap.add_argument_group("links (one of)")
    lk.add_argument("--link", choices=sorted(LINKS), help="given α and bandwidth: " + ", ".join(
        f"{k} {a * 1e6:g} us {b / 1e9:g} GB/s" for k, (a, b) in LINKS.items()))
    lk.add_argument("--alpha", help="latency per step, e.g. 10us (with --bandwidth)")
    lk.add_argument("--bandwidth", help="bytes/s per rank, e.g. 100GB/s")
    lk.add_argument("--bench", nargs="+", help="python -m ringzero.bench JSON files: α, β fitted per (op, n)")
    lk.add_argument("--inter-link", choices=sorted(LINKS), help="hybrid on one link model: the link between nodes")
    nk = ap.add_argument_group("nodes (two links: the one above inside a node, a network between nodes)")
    nk.add_argument("--nodes", type=int, default=1,
                    help="N: the Nd ranks span N nodes of Nd/N (node-aware collectives; hybrid's Ng = Nd/N); "
                         "default 1, one host")
    nk.add_argument("--inter-bandwidth", help="with --nodes: bytes/s leaving one node, shared by its ranks, "
                                              "e.g. 125MB/s (1 Gbit/s) or 25GB/s")
    nk.add_argument("--inter-alpha", default="5us", help="with --nodes: latency per round across nodes (default 5us)")
    ap.add_argument("--reduce-bucket-mb", type=float,
                    help="stages 0-2: reduce consecutive units' gradients in buckets of up to this many MiB, "
                         "as the trainer's flag (0: each unit alone; default: 16 without overlap, 0 with)")
    ok = ap.add_argument_group("offload (the update's state streamed from disk)")
    ok.add_argument("--disk-bw", help="the disk's bandwidth per node, e.g. 2GB/s: adds the step with offload")
    ok.add_argument("--offload", default="optimizer,optimizer+params",
                    help="with --disk-bw: the offload choices to predict, comma-separated, + joining tiers "
                         "(default optimizer,optimizer+params; params only at stage 3)")
    zp = ap.add_argument_group("ZeRO++ (docs/quantized.md): adds a stage 3 (and hybrid) row with the switches")
    zp.add_argument("--zeropp", default="", help="any of qwz,hpz,qgz (comma-separated), as the trainer's --zeropp")
    zp.add_argument("--zeropp-block", type=int, default=2048, help="elements per fp32 scale of qwz's weights "
                    "(default 2048)")
    zp.add_argument("--zeropp-grad-block", type=int, default=256, help="elements per fp32 scale of qgz's gradients "
                    "(default 256)")
    zp.add_argument("--zeropp-bits", type=int, default=4, help="qgz's gradient codes: 4 or 8 (default 4)")
    ap.add_argument("--plot", help="PNG: step time against link bandwidth per stage (matplotlib)")
    ap.add_argument("--json", help="write the predictions (or, for measure, the compute) here")
    return ap


def _config(a):
    from ringzero.nn.gpt import GPTConfig
    dims = {k: getattr(a, k) for k in ("n_layer", "n_embd", "n_head", "vocab", "block_size")
            if getattr(a, k) is not None}
    if not (a.model or dims):
        raise ValueError("no model: give --model gpt-7.5b (or another) or --n-layer/--n-embd/...")
    base = _shapes()[a.model] if a.model else GPTConfig()
    return GPTConfig(**{**base.__dict__, **dims})


def _compute(a, cfg, seq):
    import json
    given = [x for x in ("flops", "measure", "compute") if getattr(a, x)]
    if len(given) != 1:
        raise ValueError(f"give exactly one of --flops, --measure, --compute; got {given or 'none'}")
    if a.flops:
        return flops_compute(cfg, a.batch, seq, _flops(a.flops, "--flops"),
                             parse_rate(a.mem_bw, "--mem-bw"))
    if a.measure:
        return measure_compute(cfg, a.batch, seq, cores=a.cores)
    with open(a.compute) as fh:
        d = json.load(fh)
    return Compute(d["fwd"], d["bwd"], d["cast_s"], d["update_s"], None, d.get("source", a.compute))


def _links(a):
    from ringzero.tools import fit
    given = [x for x in ("link", "bandwidth", "bench") if getattr(a, x)]
    if len(given) != 1:
        raise ValueError(f"give exactly one of --link, --alpha/--bandwidth, --bench; got {given or 'none'}")
    if a.link:
        return Links.given(*LINKS[a.link], name=a.link)
    if a.bandwidth:
        return Links.given(_seconds(a.alpha or "0", "--alpha"),
                           parse_rate(a.bandwidth, "--bandwidth"), "given")
    return Links.from_rows([r for f in a.bench for r in fit.load_rows(f)])


def _nodes(a, stages):
    """The Nodes of --nodes, --inter-bandwidth, --inter-alpha (None on one host)."""
    if a.nodes < 1:
        raise ValueError(f"--nodes must be >= 1, got {a.nodes}")
    if a.nodes == 1:
        if a.inter_bandwidth:
            raise ValueError("--inter-bandwidth needs --nodes N > 1")
        return None
    if not a.inter_bandwidth:
        raise ValueError(f"--nodes {a.nodes} needs --inter-bandwidth (bytes/s leaving one node), e.g. 125MB/s")
    bad = [n for n in a.nd if n % a.nodes]
    if bad:
        raise ValueError(f"--nd must be a multiple of --nodes {a.nodes}, got {bad}")
    if "hybrid" in stages and a.ranks_per_node and any(n // a.nodes != a.ranks_per_node for n in a.nd):
        raise ValueError(f"hybrid across --nodes shards inside each node: expected --ranks-per-node = Nd/N, "
                         f"got {a.ranks_per_node} for Nd = {a.nd}")
    return Nodes(a.nodes, _seconds(a.inter_alpha, "--inter-alpha"), parse_rate(a.inter_bandwidth, "--inter-bandwidth"))


def run_measure(a, cfg, seq) -> int:
    """Every rank times the units at once (ranks share the machine as in training); the
    slowest rank's time per unit is kept, as a step waits for it."""
    import json
    try:
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
    except ImportError:
        comm = None
    if comm is not None:
        comm.Barrier()
    c = measure_compute(cfg, a.batch, seq, seed=comm.rank if comm else 0)
    vals = np.array(c.fwd + c.bwd + [c.cast_s, c.update_s])
    if comm is not None and comm.size > 1:
        comm.Allreduce(MPI.IN_PLACE, vals, op=MPI.MAX)
    U = len(c.fwd)
    n = comm.size if comm else 1
    if (comm is None or comm.rank == 0):
        d = {"fwd": list(vals[:U]), "bwd": list(vals[U:2 * U]), "cast_s": float(vals[-2]),
             "update_s": float(vals[-1]), "ranks": n,
             "source": f"measured: {n} ranks at once, GPT {cfg.n_layer}L C={cfg.n_embd} "
                       f"batch {a.batch} x seq {seq}"}
        if a.json:
            with open(a.json, "w") as fh:
                json.dump(d, fh, indent=1)
        print(f"{d['source']}: forward {sum(d['fwd']) * 1e3:.1f} ms, backward "
              f"{sum(d['bwd']) * 1e3:.1f} ms, cast {d['cast_s'] * 1e9:.2f} ns/elem, "
              f"update {d['update_s'] * 1e9:.2f} ns/elem")
    return 0


def print_predictions(rows, cfg, comp, links, psi, f=None, nodes=None):
    import sys
    p = lambda *x: print(*x, file=f or sys.stdout)  # noqa: E731
    p(f"GPT {cfg.n_layer}L C={cfg.n_embd} H={cfg.n_head} V={cfg.vocab}: Ψ = {psi:,}")
    p(f"compute: {comp.source}; forward {sum(comp.fwd) * 1e3:.2f} ms + backward "
      f"{sum(comp.bwd) * 1e3:.2f} ms per rank" + (f", slowed by n/{comp.cores} past {comp.cores} ranks"
                                                     if comp.cores else ""))
    p(f"links: {links.source}" + ("" if links.fixed is None else
                                  f": α = {links.fixed[0] * 1e6:g} us, {1 / links.fixed[1] / 1e9:g} GB/s"))
    if nodes is not None:
        p(f"nodes: {nodes.count}, Nd/{nodes.count} ranks each, node-aware collectives; the link above "
          f"inside a node, {nodes.bandwidth / 1e9:g} GB/s leaving each node (shared by its ranks), "
          f"α = {nodes.alpha * 1e6:g} us across")
    p(f"\n{'stage':>6}{'Nd':>6}{'no overlap':>14}{'overlap':>12}{'compute':>12}{'comm':>12}"
      f"{'update':>12}{'exposed (ov)':>14}{'vs stage 0':>11}" + (f"{'across nodes':>15}" if nodes else ""))
    base = {r0["nd"]: r0["step_s"] for r0, _ in rows if r0["stage"] == "0"}   # no-overlap stage 0
    for r0, r1 in rows:
        b = base.get(r0["nd"])
        p(f"{r0['stage']:>6}{r0['nd']:>6}{_t(r0['step_s']):>14}{_t(r1['step_s']):>12}"
          f"{_t(r0['compute']):>12}{_t(r0['comm']):>12}{_t(r0['update']):>12}"
          f"{_t(r1['exposed_comm_s']):>14}" + (f"{r0['step_s'] / b:>10.3f}x" if b else f"{'':>11}" if nodes else "")
          + (f"{r0['internode_bytes'] / 2**20:>11.2f} MiB" if nodes else ""))
    p("no overlap: every operation in program order (ringzero on one host); overlap: collectives on a "
      "second stream (one-ahead gathers, reduce-scatters behind the backward; ringzero across nodes).")
    if nodes is not None:
        p("across nodes: bytes one rank sends to other nodes per step (stage 3 sends its all-gathers "
          "over the network, hybrid only its all-reduce)")


def print_offload_steps(a, rows, psi, nodes) -> list:
    """The step with offload (tools/tiers.py offload_time) beside the simulated step, per stage and Nd:
    the update streams 12Ψ/Nd each way (optimizer), and 2Ψ/Nd per gather (params, stage 3), on a disk
    shared by the node's ranks."""
    from ringzero.runtime import budget
    from ringzero.tools.tiers import offload_time
    bw = parse_rate(a.disk_bw, "--disk-bw")
    offs = [tuple(x.split("+")) for x in a.offload.split(",") if x]
    print(f"\nwith offload, disk {bw / 1e9:g} GB/s per node shared by its ranks (no overlap's step as the base):")
    print(f"{'stage':>6}{'Nd':>6}  {'offload':<18}{'step':>11}{'disk I/O':>11}{'blocking':>11}{'streamed':>11}"
          f"{'vs step':>9}")
    out = []
    for r0, _ in rows:
        st, n = r0["stage"], r0["nd"]
        for off in offs:
            if "params" in off and st not in ("3", "hybrid"):
                continue
            sharing = n // nodes.count if nodes else n
            rpn = ((n // nodes.count) if nodes else a.ranks_per_node) if st == "hybrid" else None
            io = budget.offload_io_bytes(st, psi, n, rpn, "fp16", 1, off)     # fp16: the simulated step's
            t = offload_time(r0, io, bw, sharing)
            out.append({"stage": st, "nd": n, "offload": ",".join(off), **t})
            print(f"{st:>6}{n:>6}  {','.join(off):<18}{_t(r0['step_s']):>11}{_t(t['io_s']):>11}"
                  f"{_t(t['blocking_s']):>11}{_t(t['streamed_s']):>11}{t['streamed_s'] / r0['step_s']:>8.2f}x")
    print("disk I/O: per rank per step, the node's ranks in turn on one disk; blocking: read, update, write one "
          "after the other; streamed: tiles read and written beside the update's compute (and stage 3's param "
          "shard beside the forward and backward)")
    return out


def _t(s):
    return f"{s * 1e6:.0f} us" if s < 1e-3 else f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.3f} s"


def plot_bandwidth(cfg, nd, comp, alpha, out, stages=("0", "1", "2", "3"), title=None,
                   bws=None, reduce_bucket=None) -> dict:
    """Step time against link bandwidth per stage, with and without overlap (left),
    and each stage's step over stage 2's (right); PNG at ``out``.

    A stage's "knee" is the lowest bandwidth at which its step stays within 5 %
    of its compute-bound step (the step at infinite bandwidth).
    """
    from ringzero.nn.gpt import gpt_units
    from ringzero.tools.plot import _plt
    L = Layout(gpt_units(cfg))
    bws = list(np.logspace(8, 12, 81)) if bws is None else bws   # 0.1 GB/s .. 1 TB/s
    curves, knee = {}, {}
    for st in stages:
        for ov in (False, True):
            c = [step_time(L, st, nd, comp, Links.given(alpha, bw), ov, reduce_bucket=reduce_bucket)["step_s"]
                 for bw in bws]
            floor = step_time(L, st, nd, comp, Links.given(alpha, math.inf), ov,
                              reduce_bucket=reduce_bucket)["step_s"]
            curves[(st, ov)] = c
            ok = [bw for bw, t in zip(bws, c) if t <= 1.05 * floor]
            knee[(st, ov)] = min(ok) if ok else None
    plt = _plt()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.4), dpi=110)
    colors = {"0": "tab:blue", "1": "tab:orange", "2": "tab:green", "3": "tab:red"}
    x = np.array(bws) / 1e9
    for st in stages:
        for ov, ls, lw in ((False, "--", 1.2), (True, "-", 2.0)):
            ax.plot(x, curves[(st, ov)], ls, color=colors.get(st), lw=lw,
                    label=f"stage {st}" + (", overlap" if ov else ", no overlap"))
        if knee[(st, True)]:
            ax.axvline(knee[(st, True)] / 1e9, color=colors.get(st), lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link bandwidth per rank (GB/s)")
    ax.set_ylabel("step time (s)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    ax.set_title("step time (dotted: overlap knee, 5 % over compute-bound)", fontsize=9)
    ref = "2" if "2" in stages else stages[0]
    for st in stages:
        for ov, ls in ((False, "--"), (True, "-")):
            ax2.plot(x, np.array(curves[(st, ov)]) / np.array(curves[(ref, ov)]), ls,
                     color=colors.get(st), label=f"stage {st}" + (", overlap" if ov else ""))
    ax2.set_xscale("log")
    ax2.set_xlabel("link bandwidth per rank (GB/s)")
    ax2.set_ylabel(f"step time / stage {ref}'s")
    ax2.grid(True, which="both", alpha=0.3)
    ax2.legend(fontsize=7, ncol=2)
    ax2.set_title("stage 3's extra Ψ: 1.5x the wire; costs where the link is slow", fontsize=9)
    fig.suptitle(title or f"GPT {cfg.n_layer}L C={cfg.n_embd} (Ψ = {L.numel / 1e9:.2f}B), "
                          f"Nd = {nd}, α = {alpha * 1e6:g} us; compute: {comp.source}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return {"bandwidths": bws, "knee_Bps": {f"{k[0]}{'+overlap' if k[1] else ''}": v for k, v in knee.items()},
            "curves": {f"{k[0]}{'+overlap' if k[1] else ''}": v for k, v in curves.items()}, "out": out}


def main(argv=None):
    import json
    ap = build_parser()
    a = ap.parse_args(argv)
    try:
        cfg = _config(a)
        seq = a.seq or cfg.block_size
        if not 1 <= seq <= cfg.block_size or a.batch < 1:
            raise ValueError(f"--seq must be in 1..{cfg.block_size} and --batch >= 1, got seq={seq}, "
                             f"batch={a.batch}")
        if a.what == "measure":
            return run_measure(a, cfg, seq)
        stages = [acc.parse_stage(s) for s in a.stages.split(",")]
        if "hybrid" in stages and not a.ranks_per_node and a.nodes == 1:
            raise ValueError("stage hybrid needs --ranks-per-node (Ng), or --nodes (Ng = Nd/N)")
        if any(n < 1 or (a.ranks_per_node and n % a.ranks_per_node) for n in a.nd):
            raise ValueError(f"--nd must be >= 1 and a multiple of --ranks-per-node, got {a.nd}")
        if a.reduce_bucket_mb is not None and not a.reduce_bucket_mb >= 0:
            raise ValueError(f"--reduce-bucket-mb must be >= 0, got {a.reduce_bucket_mb}")
        from ringzero.runtime.zeropp import ZeroPPPolicy
        zpp = ZeroPPPolicy.parse(a.zeropp, block=a.zeropp_block, grad_bits=a.zeropp_bits,
                                 grad_block=a.zeropp_grad_block)
        if zpp.hpz and "hybrid" in stages and not zpp.qwz and not zpp.qgz and "3" not in stages:
            raise ValueError("--zeropp hpz applies to stage 3 (hybrid's gathers stay in the node already)")
        comp, links = _compute(a, cfg, seq), _links(a)
        inter = Links.given(*LINKS[a.inter_link], name=a.inter_link) if a.inter_link else None
        nodes = _nodes(a, stages)
        if a.disk_bw:                         # read both before any work: a bad value is one line
            from ringzero.runtime.budget import parse_offload
            parse_rate(a.disk_bw, "--disk-bw")
            for x in a.offload.split(","):
                parse_offload(tuple(x.split("+")) if x else ())
    except (ValueError, OSError) as e:
        ap.error(str(e))
    from ringzero.nn.gpt import gpt_units
    L = Layout(gpt_units(cfg))
    rpn = lambda n: n // nodes.count if nodes else a.ranks_per_node  # noqa: E731 (hybrid's Ng)
    bucket = None if a.reduce_bucket_mb is None else int(a.reduce_bucket_mb * 2 ** 20)
    rows = [tuple(step_time(L, st, n, comp, links, ov, rpn(n), inter, nodes=nodes, reduce_bucket=bucket)
                  for ov in (False, True))
            for n in a.nd for st in stages]
    if zpp.enabled:                          # the same stage 3 / hybrid rows with the switches
        rows += [tuple(step_time(L, st, n, comp, links, ov, rpn(n), inter, nodes=nodes, reduce_bucket=bucket,
                                 zeropp=zpp) for ov in (False, True))
                 for n in a.nd for st in stages if st in ("3", "hybrid")]
    print_predictions(rows, cfg, comp, links, L.numel, nodes=nodes)
    out = {"psi": L.numel, "rows": [r for pair in rows for r in pair]}
    if a.disk_bw:
        out["offload"] = print_offload_steps(a, rows, L.numel, nodes)
    if a.plot:
        alpha = links.fixed[0] if links.fixed else links.ab("all_gather", a.nd[0])[0]
        pr = plot_bandwidth(cfg, a.nd[0], comp, alpha, a.plot, [s for s in stages if s != "hybrid"],
                            reduce_bucket=bucket)
        print(f"\nwrote {a.plot}: step time against bandwidth at Nd = {a.nd[0]}, α = {alpha * 1e6:g} us")
        kn = pr["knee_Bps"]
        for st in [s for s in stages if s != "hybrid"]:
            f = lambda k: f"{k / 1e9:.3g} GB/s" if k else "none plotted"  # noqa: E731
            print(f"  stage {st}: within 5 % of its compute-bound step above {f(kn[st])} without "
                  f"overlap, {f(kn[st + '+overlap'])} with")
        out["plot"] = {k: v for k, v in pr.items() if k != "curves"}
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1, default=float)
    return 0
