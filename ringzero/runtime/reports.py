"""What an engine measured, beside what the ZeRO formulas predict.

What it is
    ``memory_report(engine)``: bytes allocated on this rank per state class
    (the buffers' own ``nbytes``) beside the stage formula, plus workspaces,
    optimizer scratch and the activation peak. ``traffic_report(engine)``:
    bytes this rank sent in the last step, from the rings' ledgers, beside
    the formula and the exact figure of the engine's step plan (plan.py), and the part of
    those bytes that went to ranks on other nodes beside its formula (N nodes of P ranks,
    accounting.internode_elements). ``ledger_totals`` sums the ledgers the engine snapshots
    around each step. With offload, each class's bytes are also given per tier (RAM,
    device, disk: a file's blocks as fstat reports them), and ``io_report(engine)``
    gives the bytes the last step read from and wrote to the offload files (their own
    counters) beside accounting.offload_io_bytes.

    Vocabulary, as in accounting.py: Nd is the world size (data-parallel
    ranks); the sharding group is Nd ranks, or Ng for hybrid.

What it is not
    No formula of its own (accounting.py has them) and no communication.
"""
from __future__ import annotations

import numpy as np

from ringzero.runtime import accounting
from ringzero.runtime.policy import ACCUM_BUFFER, BUFFER_CLASS


def ledger_totals(topology, counter: str = "bytes_sent") -> dict:
    """{op: bytes sent so far} (or another ledger counter: "bytes_sent_internode" is the
    part sent to ranks on other nodes); replica-ring ops as "op@replica", hpZ's node ring's as "op@hpz"."""
    out = {}
    for name, ledger in topology.ledgers():
        for op, rec in ledger.as_dict().items():
            key = op if name == "shard" else f"{op}@{name}"
            out[key] = out.get(key, 0) + rec[counter]
    return out


def _formula_state(engine, psi):
    """accounting's bytes per class at the engine's stage, precision and K."""
    topo = engine.topology
    return accounting.model_state_bytes(engine.stage, psi, topo.world_size,
                                        engine.policy.ranks_per_node(topo.shard_size),
                                        engine.precision, engine.grad_accum)


def memory_report(engine) -> dict:
    """Bytes allocated on this rank, per state class, beside the formula.

    'formula_bytes' uses the padded Ψ (what the formula predicts for the
    buffers this layout allocates); 'textbook_bytes' uses the real Ψ. The
    class keys are accounting's (``params_fp16`` is "params in the storage
    dtype"; ``grad_accum_fp32`` only when K > 1).
    """
    L, st = engine.layout, engine.state
    names = {{**BUFFER_CLASS, **ACCUM_BUFFER}[name]: name for name in st.bufs}
    meas = {c: st.bufs[name].nbytes for c, name in names.items()}
    form, text = _formula_state(engine, L.padded), _formula_state(engine, L.numel)
    classes = {c: {"measured_bytes": int(meas[c]), "formula_bytes": form[c],
                   "textbook_bytes": text[c], **_tiers(st, names[c])} for c in meas}
    return {"stage": engine.stage, "psi": L.numel, "psi_padded": L.padded,
            "precision": engine.precision, "grad_accum": engine.grad_accum,
            "nd": engine.topology.world_size, "shard_group": engine.topology.shard_size,
            "classes": classes,
            "model_state_measured": sum(int(meas[c]) for c in meas),
            "model_state_formula": sum(form.values()),
            "workspace": engine.workspaces.nbytes(),
            "optimizer_scratch": int(engine.optimizer_scratch_nbytes),
            "activation_peak": int(engine.activation_peak),
            "tiers": {t: sum(d[f"{t}_bytes"] for d in classes.values()) for t in TIERS},
            "offload": engine.offload.describe(),
            "offload_buffers": (int(engine.offload_stream.nbytes()) if engine.offload_stream else 0)
            + (engine.device_link.nbytes() if engine.device_link else 0)
            + (engine.workspaces.param_reads.nbytes() if engine.workspaces.param_reads else 0)
            + (engine.delayed.nbytes if engine.delayed is not None else 0),
            # --offload-delay's buffer (delay.py): the storage dtype x master's elements (Ψ/Nd at stages 1-3)
            "offload_delay_bytes": engine.delayed.nbytes if engine.delayed is not None else 0,
            "offload_delay_formula_bytes": delay_formula(engine),
            # a device run's host tier (host_tier.PinnedArena): the host bytes pinned and pageable
            "host_pinned": engine.pinned.pinned if engine.pinned else 0,
            "host_pageable": engine.pinned.pageable if engine.pinned else 0,
            **zeropp_memory(engine)}


def delay_formula(engine) -> int:
    """--offload-delay's buffer by the formula: the storage itemsize x (Ψ_padded/Nd, or Ψ_padded at stage 0)."""
    if engine.delayed is None:
        return 0
    L = engine.layout
    return np.dtype(engine.storage_dtype).itemsize * (L.padded if engine.policy.full_optimizer else L.shard_numel)


def zeropp_memory(engine) -> dict:
    """ZeRO++'s buffers on this rank beside their formulas: hpZ's secondary shard (the padded Ψ params
    over P ranks per node, storage dtype: 2Ψ/P at 2-byte storage) and qgZ's residual (4Ψ, fp32)."""
    zpp = engine.topology.zeropp
    if zpp is None:
        return {}
    L, itemsize = engine.layout, np.dtype(engine.storage_dtype).itemsize
    got = zpp.nbytes()
    return {"zeropp": engine.zeropp.describe(),
            "hpz_secondary_bytes": got["hpz_secondary"],
            "hpz_secondary_formula_bytes": (L.padded // zpp.P * itemsize) if zpp.policy.hpz else 0,
            "hpz_ranks_per_node": zpp.P,
            "hpz_itemsize": itemsize,              # the formula's bytes per element: 2 (fp16/bf16) or 4 (fp32)
            "qgz_residual_bytes": got["qgz_residual"],
            "qgz_residual_formula_bytes": 4 * L.padded if zpp.residual is not None else 0}


TIERS = ("ram", "device", "disk")


def _tiers(st, name) -> dict:
    """Where one class's bytes are: {"tier", "ram_bytes", "device_bytes", "disk_bytes"}; a file's are the
    blocks its filesystem gave it (fstat), an array's its nbytes."""
    tier = st.tier(name)
    buf = st.bufs[name]
    got = buf.disk_bytes if tier == "disk" else int(buf.nbytes)
    return {"tier": tier, **{f"{t}_bytes": got if t == tier else 0 for t in TIERS}}


def io_report(engine) -> dict:
    """Bytes this rank read from and wrote to its offload files in the last step (the files' own
    counters), beside the formula (accounting.offload_io_bytes) and the plan's exact figure."""
    L, topo, P = engine.layout, engine.topology, engine.policy
    io = engine.last_step_io
    read, written = sum(r for r, _ in io.values()), sum(w for _, w in io.values())
    kw = dict(ranks_per_node=P.ranks_per_node(topo.shard_size), params=engine.offload.params,
              precision=engine.precision, grad_accum=engine.grad_accum)
    form = accounting.offload_io_bytes(engine.stage, L.padded, topo.world_size, **kw)
    gathered = sum(L.unit_padded[w] for w, a, b in engine.plan.param_runs) if engine.offload.params else None
    plan = accounting.offload_io_bytes(engine.stage, L.padded, topo.world_size, gathered=gathered, **kw)
    return {"offload": engine.offload.describe(), "by_class": {n: {"read": r, "write": w} for n, (r, w) in io.items()},
            "read_bytes_per_step": int(read), "write_bytes_per_step": int(written),
            "read_formula_bytes": int(form["read"]), "write_formula_bytes": int(form["write"]),
            "read_plan_bytes": int(plan["read"]), "write_plan_bytes": int(plan["write"]),
            "read_formula": form["read_formula"], "write_formula": form["write_formula"]}


def reported_step(engine) -> tuple:
    """(ledger, internode ledger, step number or None): the ledgers the traffic report reads, the last step
    taken's (engine.taken_step): a step skipped for an fp16 overflow updates nothing, so stages 1-2
    all-gather no params in it. None: no step was taken yet, and the last step's are read."""
    taken = getattr(engine, "taken_step", None)
    if taken is None:
        return getattr(engine, "last_step_ledger", {}), getattr(engine, "last_step_internode", {}), None
    return engine.taken_step_ledger, engine.taken_step_internode, taken


def traffic_report(engine) -> dict:
    """Bytes this rank sent in the last step taken (reported_step), by collective, beside the formula."""
    ledger, _, taken = reported_step(engine)
    L, topo, policy, K = engine.layout, engine.topology, engine.policy, engine.grad_accum
    n = topo.shard_size
    elements = accounting.traffic_elements(engine.stage, L.padded, topo.world_size, policy.ranks_per_node(n), K)
    itemsize = np.dtype(engine.storage_dtype).itemsize
    formula = sum(elements.values()) * itemsize
    # the exact figure for the step plan: units gathered once per run of
    # consecutive uses (the last unit once), every unit reduce-scattered once,
    # per micro-batch where params are sharded (K times per step)
    exact = formula
    if policy.gather_params:
        gathered = sum(L.unit_padded[w] for w, a, b in engine.plan.param_runs)
        exact = formula - K * ((2 * L.padded - gathered) * (n - 1) // n) * itemsize
    measured = sum(ledger.values())
    return {"stage": engine.stage, "by_op": dict(ledger), "measured_step": taken,
            "steps_run": getattr(engine, "step_count", 0),
            "measured_bytes_per_step": int(measured),
            "formula_bytes_per_step": int(formula),
            "plan_bytes_per_step": int(exact),
            "formula": accounting.traffic_formula(engine.stage, K), "grad_accum": K,
            "formula_elements": elements, **internode_report(engine, itemsize), **zeropp_traffic(engine, itemsize)}


def zeropp_traffic(engine, itemsize: int) -> dict:
    """ZeRO++: the last step's cross-node bytes (codes and scales apart) beside its formula.

    The unquantized stage 3 step sends (N-1)/Nd of Ψ elements across nodes in each of its three
    phases (forward gather, backward gather, reduce-scatter: the seed's 3Ψ); each switch scales one
    phase by comm/qledger.zeropp_volume's factor (qwZ: (1 + 4/block)/itemsize on both gathers, hpZ:
    0 on the backward one, qgZ: (bits/8 + 4/block)/itemsize on the reduce-scatter). ``psi_multiple``:
    measured bytes over (N-1)/Nd * Ψ * itemsize, the figure to set beside 3 -> 0.75.
    """
    zpp = engine.topology.zeropp
    if zpp is None:
        return {}
    from ringzero.comm.qledger import zeropp_volume
    L, nm, nd, K = engine.layout, engine.topology.nodes, engine.topology.world_size, engine.grad_accum
    pol = engine.zeropp
    vol = zeropp_volume(pol.qwz, pol.hpz, pol.qgz, pol.weights, pol.grads, elem_bytes=itemsize)
    unit = (nm.count - 1) * L.padded * itemsize / nd          # one unquantized phase's cross-node bytes
    q = zpp.qc.ledger.as_dict() if zpp.qc is not None else {}
    split = {k: sum(rec[k] for rec in q.values()) for k in ("codes_intra", "scales_intra", "codes_inter",
                                                             "scales_inter")}
    measured = sum(reported_step(engine)[1].values())
    if engine.policy.hybrid:         # the switches act inside the node; only the replicas' all-reduce crosses
        return {"zeropp": pol.describe(), "zeropp_hybrid": True, "zeropp_quantized_bytes_so_far": split}
    return {"zeropp": pol.describe(), "zeropp_phases_psi": {k: v for k, v in vol.items() if k != "total"},
            "zeropp_formula_psi": vol["total"],
            "zeropp_formula_internode_bytes_per_step": int(K * vol["total"] * unit) if unit else 0,
            "zeropp_measured_psi": (measured / unit) if unit else 0.0,
            "zeropp_quantized_bytes_so_far": split}


def internode_report(engine, itemsize: int) -> dict:
    """The part of the reported step's bytes (reported_step) that went to other nodes, beside its formula.

    N and P come from the world's NodeMap (topology.nodes): keys ``nodes``, ``node_ppn``
    (ranks per node; not hybrid's Ng), ``by_op_internode`` and the measured, formula and
    plan figures in bytes (``internode_formula`` in elements). A map with several
    nodes of different sizes, or a hybrid shard group wider than a node, has no
    formula (None).
    The plan figure corrects stage 3 as traffic_report does: each unit is
    gathered once per run of consecutive uses, (N-1)/Nd of it crossing.
    """
    L, topo, K, nm = engine.layout, engine.topology, engine.grad_accum, engine.topology.nodes
    nd = topo.world_size
    measured = sum(reported_step(engine)[1].values())
    formula = plan = None
    try:                 # hybrid's shard group must sit inside a node, else no formula
        el = accounting.internode_elements(engine.stage, L.padded, nd, nm.count,
                                           engine.policy.ranks_per_node(topo.shard_size), K)
    except ValueError:
        el = None
    if engine.policy.hybrid and topo.ring.nodes.count > 1:    # the shard group itself spans nodes
        el = None
    if el is not None and (nm.count == 1 or nm.ppn is not None):
        formula = plan = int(sum(el.values()) * itemsize)
        if engine.policy.gather_params and not engine.policy.hybrid:
            gathered = sum(L.unit_padded[w] for w, a, b in engine.plan.param_runs)
            plan = formula - K * ((2 * L.padded - gathered) * (nm.count - 1) // nd) * itemsize
    return {"nodes": nm.count, "node_ppn": nm.ppn, "node_map": nm.describe(),
            "by_op_internode": dict(reported_step(engine)[1]),
            "measured_internode_bytes_per_step": int(measured),
            "formula_internode_bytes_per_step": formula,
            "plan_internode_bytes_per_step": plan,
            "internode_formula": accounting.internode_formula(engine.stage, K)}


def io_snapshot(engine) -> dict:
    """{class: (bytes read, bytes written)} of the offload files so far (their own counters); the
    stream's seconds start again from 0, so a step's are its own (not a save's, not a start-up cast's)."""
    if engine.offload_stream is not None and engine.update_ahead is None:
        engine.offload_stream.reset_timeline()
        engine.last_update_io = {}            # a skipped step updates nothing
    return {n: (f.bytes_read, f.bytes_written) for n, f in engine.state.files.items()}


def io_delta(engine, io0: dict):
    """engine.last_step_io: per offload file, what the step's update moved (engine.last_update_io:
    with ``ahead``, the last update that finished) and, for params, what the step's gathers read
    since ``io0``; the update's seconds (read, compute, write, exposed) into engine.timeline."""
    now = {n: (f.bytes_read, f.bytes_written) for n, f in engine.state.files.items()}
    upd = getattr(engine, "last_update_io", {})
    engine.last_step_io = {n: (now[n][0] - io0[n][0] if n == "params" else upd.get(n, (0, 0))[0],
                               upd.get(n, (0, 0))[1]) for n in now}
    if engine.offload_stream is not None:
        engine.timeline.update({f"offload_{k}": v for k, v in engine.offload_stream.reset_timeline().items()})
