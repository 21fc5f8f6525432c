"""``python -m ringzero.explain precision|traffic|fragmentation|offload|quantized``: ZeRO's accounting by experiment.

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
               The experiments: ringzero.tools.precision (re-exported here).
    traffic    Who sends what in each stage, per rank and per step, from
               ringzero.runtime.accounting; per unit when a GPT shape is given; measured
               beside formula when a training run's ``--metrics`` file is given.
               ``--grad-accum K``: per micro-batch and per step (stages 0-2 reduce
               once per step, stage 3 gathers and reduce-scatters every micro-batch).
               ``--nodes N``: the Nd ranks span N nodes; every figure is split into
               what stays in the node and what crosses the network (the node-aware
               schedule, accounting.internode_elements), and hybrid's point is
               stated with numbers: stage 3's all-gathers cross, hybrid's do not.
    fragmentation  A caching allocator's OOM with memory free, by replaying a
               training step's allocations (ringzero.tools.fragmentation).
    offload    The memory tiers: which of the 16 bytes offload moves to disk, each stage's
               bytes per rank per tier, the update's I/O and its time (ringzero.tools.tiers).
    quantized  ZeRO++'s int8 / int4 wire formats (ringzero.comm.quant) on the small GPT's real
               weights and gradient, beside the fp16 / bf16 casts (ringzero.tools.quant_error).

What it is not
    No thresholds are typed in: each is searched for by experiment; the seed
    document's claims are printed beside them for comparison only.
"""
from __future__ import annotations

import argparse
import sys

from ringzero.runtime import accounting as acc
from ringzero.tools.bf16 import print_bf16

# The precision experiments live in ringzero.tools.precision; their names stay importable from here.
from ringzero.tools.precision import (  # noqa: F401
    SEED_SWAMP_RATIO,
    SEED_UNDERFLOW,
    bf16_type,
    f16,
    f32,
    f64,
    loss_scaling,
    overflow_threshold,
    print_precision,
    scaler_trace,
    swamp_ratio,
    toy_run,
    underflow_threshold,
)

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
                 precision: str = "fp16", nodes: int = 1) -> list:
    """[{stage, elements, bytes, by_collective, internode, per_unit?}] for every stage, per optimizer
    step of ``grad_accum`` micro-batches (per_unit: per micro-batch). ``internode``: the elements
    of by_collective sent to other nodes when the Nd ranks span ``nodes`` nodes (node-aware schedule)."""
    rows = []
    for st in acc.STAGES:
        if st == "hybrid" and not ranks_per_node:
            continue
        r = {"stage": st, "formula": acc.traffic_formula(st, grad_accum),
             "by_collective": acc.traffic_elements(st, psi, nd, ranks_per_node, grad_accum),
             "bytes": acc.traffic_bytes(st, psi, nd, ranks_per_node, grad_accum=grad_accum,
                                        precision=precision),
             "per_micro_batch": acc.traffic_elements(st, psi, nd, ranks_per_node, 1),
             "internode": acc.internode_elements(st, psi, nd, nodes, ranks_per_node, grad_accum),
             "internode_formula": acc.internode_formula(st, grad_accum)}
        r["elements"] = sum(r["by_collective"].values())
        r["internode_total"] = sum(r["internode"].values())
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


def hybrid_point(rows, psi: int, nd: int, nodes: int, rpn: int, eb: int) -> list:
    """Lines that say, with the rows' numbers, why hybrid exists once ranks span nodes."""
    by = {r["stage"]: r for r in rows}
    if nodes < 2 or "3" not in by or "hybrid" not in by:
        return []
    s3, hy = by["3"], by["hybrid"]
    n3, nh, ag3 = s3["internode_total"], hy["internode_total"], s3["internode"]["all_gather"]
    m3, mh = acc.model_state_total("3", psi, nd), acc.model_state_total("hybrid", psi, nd, rpn)
    return [f"hybrid's point, across {nodes} nodes of {nd // nodes} ranks: stage 3 sends its all-gathers over "
            f"the network ({ag3:,.0f} of its {n3:,.0f} el across nodes per rank per step, "
            f"{ag3 * eb / 1e9:.4f} GB), hybrid does not: its gathers and reduce-scatters stay in the node "
            f"and only the all-reduce of the Ψ/Ng shard crosses, {nh:,.0f} el ({nh * eb / 1e9:.4f} GB, "
            f"{nh / n3 if n3 else 0:.2f}x stage 3's; stage 2 sends {by['2']['internode_total']:,.0f}). "
            f"With K micro-batches per step stage 3's 3 passes cross K times, hybrid's 2 once "
            f"(--grad-accum). The price is memory: 16Ψ/Ng = {mh / 1e9:.3f} GB of model state per rank, "
            f"not 16Ψ/Nd = {m3 / 1e9:.3f} GB."]


def print_traffic(psi, nd, rpn, cfg, metrics, f=None, grad_accum: int = 1, precision: str = "fp16",
                  nodes: int = 1):
    p = lambda *a: print(*a, file=f or sys.stdout)  # noqa: E731
    units = None
    if cfg is not None:
        from ringzero.nn.families import units_of
        units = units_of(cfg)                     # a GPT's or a Llama's layout table
    K, eb = grad_accum, acc.storage_bytes(precision)
    p(f"Ψ = {psi:,}  Nd = {nd}" + (f"  Ng = {rpn}" if rpn else "") +
      f"; elements and bytes SENT by one rank per optimizer step ({precision}: {eb} B/element"
      + (f"; K = {K} micro-batches per step" if K > 1 else "") + ").")
    p("A ring reduce-scatter or all-gather over n ranks takes n-1 steps; in each, every rank sends "
      "one block of 1/n of the buffer to its right neighbour: Ψ(n-1)/n elements in all.\n")
    if nodes > 1:
        P = nd // nodes
        p(f"The Nd = {nd} ranks span N = {nodes} nodes of P = {P}: every collective that spans nodes runs "
          f"the node-aware schedule (a pass inside the node on the whole buffer, Ψ(P-1)/P per rank over "
          f"shared memory; then a pass across nodes on 1/P of it, (Ψ/P)(N-1)/N per rank over the network, "
          f"so a node sends Ψ(N-1)/N, the least that must leave it). The sum is the ring's Ψ(Nd-1)/Nd.\n")
    rows = traffic_rows(psi, nd, rpn, units, K, precision, nodes)
    for r in rows:
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
            p(f"  {'':<16} {k:<15} {v:>18,.0f} el  {r['bytes'][k] / 1e9:>10.4f} GB"
              + (f"   across nodes {r['internode'][k]:>16,.0f} el" if nodes > 1 else ""))
        if nodes > 1:
            net = r["internode_total"]
            p(f"  {'split':<16} within the node {r['elements'] - net:,.0f} el; across nodes "
              f"{r['internode_formula']} = {net:,.0f} el = {net * eb / 1e9:.4f} GB")
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
    for line in hybrid_point(rows, psi, nd, nodes, rpn, eb):
        p("\n" + line)
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
        if t.get("nodes", 1) > 1:
            fn = t.get("formula_internode_bytes_per_step")
            p(f"  across nodes ({t['nodes']} nodes of {t.get('node_ppn')}): measured "
              f"{t['measured_internode_bytes_per_step']:,} B   formula {t.get('internode_formula')} = "
              + (f"{fn:,} B" if fn is not None else "none (nodes of different sizes)"))
        if "zeropp_measured_psi" in t:        # a --zeropp run: the cross-node bytes in ZeRO++'s units
            p(f"  ZeRO++ {t['zeropp']}: across nodes measured {t['zeropp_measured_psi']:.4f} x (N-1)/Nd·Ψ·b B, "
              f"formula {t['zeropp_formula_psi']:.4f} (comm.qledger.zeropp_volume; unquantized 3) = "
              f"{t['zeropp_formula_internode_bytes_per_step']:,} B")
        plan_bytes = t.get("plan_bytes_per_step", t.get("schedule_bytes_per_step"))   # (older files: schedule_)
        if plan_bytes is not None:
            p(f"  the runtime's step plan predicts {plan_bytes:,} B")
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
    tp.add_argument("--ranks-per-node", type=int, help="Ng: adds HYBRID_SHARD (default with --nodes: Nd/N)")
    tp.add_argument("--nodes", type=int, default=1,
                    help="N: the Nd ranks span N nodes of Nd/N; splits each figure into within the node "
                         "and across nodes (default 1: one host)")
    tp.add_argument("--metrics", help="a trainer metrics .jsonl: measured beside formula")
    tp.add_argument("--zeropp", default="", help="with --nodes: ZeRO++'s switches at stage 3 (any of qwz,hpz,qgz): "
                                                 "the bytes across nodes and hpZ's memory")
    add_step_args(tp)
    from ringzero.tools import fragmentation
    fragmentation.add_args(sub.add_parser(
        "fragmentation", help="a caching allocator OOMs with 30 %% free; ringzero's flat plan does not",
        description=fragmentation.__doc__.split("\n\n")[0]))
    op = sub.add_parser("offload", help="the memory tiers: what offload moves to disk, and what it costs",
                        description="Prints, for a model, the 16 bytes per parameter by when they are used, "
                                    "each stage's bytes per rank in RAM and on disk with and without --offload, "
                                    "the update's disk I/O per step and its time at a disk bandwidth.")
    add_model_args(op)
    op.add_argument("--nd", type=int, default=8, help="data-parallel ranks (default 8)")
    op.add_argument("--ranks-per-node", type=int, help="ranks sharing one node's disk (default: Nd)")
    op.add_argument("--disk-bw", default="2GB/s", help="the node's disk bandwidth (default 2GB/s)")
    op.add_argument("--precision", choices=tuple(acc.PRECISION_BYTES), default="fp16")
    qp = sub.add_parser("quantized", help="ZeRO++'s int8 / int4 wire formats on a real gradient and weights",
                        description="Prints the error of fp16, bf16, int8 and int4 (one fp32 scale per block, "
                                    "ringzero.comm.quant) on the small GPT's weights and gradient after a few "
                                    "steps: relative RMS, worst element, share flushed to zero, bytes per element.")
    qp.add_argument("--steps", type=int, default=3, help="Adam steps before the gradient is taken (default 3)")
    qp.add_argument("--block", type=int, default=2048, help="elements per fp32 scale of the weights (default 2048)")
    qp.add_argument("--grad-block", type=int, default=256, help="elements per fp32 scale of the gradient "
                    "(default 256, as the trainer's qgZ)")
    a = ap.parse_args(argv)
    if a.what == "quantized":
        if a.steps < 1 or a.block < 1 or a.grad_block < 1:
            qp.error(f"expected --steps >= 1, --block >= 1 and --grad-block >= 1, got --steps {a.steps} "
                     f"--block {a.block} --grad-block {a.grad_block}")
        from ringzero.tools.quant_error import print_quant
        print_quant(a.steps, a.block, grad_block=a.grad_block)
        return 0
    if a.what == "offload":
        return _offload(a, op)
    if a.what == "fragmentation":
        return fragmentation.run(a)
    if a.what == "precision":
        print_precision()
        print_bf16()
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
        if a.nodes < 1 or a.nd % a.nodes:
            raise ValueError(f"--nodes must be >= 1 and divide --nd: got nd={a.nd}, nodes={a.nodes}")
        if a.nodes > 1:
            a.ranks_per_node = a.ranks_per_node or a.nd // a.nodes
            if (a.nd // a.nodes) % a.ranks_per_node:
                raise ValueError(f"hybrid's shard group must sit inside a node: expected (Nd/N) % Ng == 0, "
                                 f"got {a.nd // a.nodes} ranks per node, Ng={a.ranks_per_node}")
    except (ValueError, OSError) as e:
        tp.error(str(e))
    try:
        zpp = None
        if a.zeropp:
            from ringzero.runtime.zeropp import ZeroPPPolicy
            from ringzero.tools.zeropp_estimate import zeropp_estimate
            if a.nodes < 2:
                raise ValueError(f"--zeropp needs --nodes N >= 2 (what crosses the nodes), got --nodes {a.nodes}")
            zpp = zeropp_estimate(psi, a.nd, a.nd // a.nodes, ZeroPPPolicy.parse(a.zeropp), a.precision)
    except ValueError as e:
        tp.error(str(e))
    print_traffic(psi, a.nd, a.ranks_per_node, cfg, a.metrics, grad_accum=a.grad_accum,
                  precision=a.precision, nodes=a.nodes)
    if zpp is not None:
        from ringzero.tools.zeropp_estimate import print_zeropp
        print_zeropp(print, zpp)
    return 0


def _offload(a, op) -> int:
    from ringzero.sizes import parse_rate
    from ringzero.tools.estimate import model_from_args
    from ringzero.tools.tiers import print_offload
    try:
        if not (a.params or a.model or a.n_layer or a.n_embd):
            a.model = "gpt2-xl"                      # the seed's example
        psi, _ = model_from_args(a)
        bw = parse_rate(a.disk_bw, "--disk-bw")
        ppn = a.ranks_per_node or a.nd
        if a.nd < 1 or ppn < 1 or a.nd % ppn:
            raise ValueError(f"--nd must be >= 1 and a multiple of --ranks-per-node, got nd={a.nd}, {ppn}")
    except ValueError as e:
        op.error(str(e))
    print_offload(psi, a.nd, ppn, bw, a.precision)
    return 0


if __name__ == "__main__":
    sys.exit(main())
