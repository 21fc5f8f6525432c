"""``python -m ringzero.simulate``: a step-time model of ZeRO stages 0-3 and hybrid.

What it is
    The step of ringzero's engine (runtime/zero.py), written as a list of
    operations per position of the step (``step_ops``), then timed:

        forward   for u = 0..U-1:  [gather u (stage 3)]  cast u  F(u)
        backward  for u = U-1..0:  [gather u again]  cast u  B(u)  cast grad  RS u  [AG u (stage 0)]
                                   [all-reduce the shard across nodes (hybrid)]
                  (stages 0-2, reduction buckets: one RS [and AG] per bucket, after its last
                  unit's grad cast, of the bucket's bytes: the engine's plan.reduce_buckets)
        update    AdamW on the rank's elements (Ψ at stage 0, Ψ/Nd otherwise)  [AG every unit (1, 2)]

    A unit is gathered once per run of consecutive positions that
    read it (the engine's plan): a block twice, the last unit once, the tied
    embedding twice. Each collective costs, for S bytes over n ranks,

        T = steps · α(op, n) + wire · β(op, n)
        (steps, wire) = ringzero.comm.schedule.steps_wire(op, n, S): the Ring's own rule
                  (1 round per pass for direct, log2 n for halving/doubling, n - 1 for
                  the ring; wire (n-1)/n · S per pass, S·log2 n for recursive doubling)

    with α, β fitted per (op, n) on ``python -m ringzero.bench`` rows (the fitting
    routine of ringzero.fit), or given for a link (NVLink, InfiniBand figures):
    links.py. By default every rank shares one host (one link). ``Nodes``
    (links.py) models two: the ranks span N nodes of P, each collective that
    spans them runs the node-aware schedule (steps_wire(op, n, S, nodes=N)), its
    inside passes on the intra-node link and its ``internode_bytes`` on the
    network (a node's bandwidth shared by its P ranks); hybrid's shard group is
    a node and only its all-reduce crosses. ``internode_per_step``: the bytes.
    Compute per unit is measured on this machine from the model's own
    forward_unit/backward_unit, or derived from a FLOP rate (6·tokens·Ψ_u plus
    attention); casts and the update are timed on the runtime's own kernels.
    Where ranks outnumber cores, compute is slowed by ranks/cores (they share
    the cores; the per-n α, β already include it for communication).

    no overlap  every operation in program order (ringzero's default on one host,
                and --no-overlap).
    overlap     two streams, compute and communication: a unit's gather may
                start once the previous unit's compute has started (one-ahead
                prefetch, as FSDP does), a reduce-scatter as soon as its
                backward is done; the update waits for both streams. Stage
                1-2's all-gather of the new parameters is taken in the steady
                state: in front of each unit's next forward, like a gather.
                (ringzero's default when the ranks span nodes: the engine's
                overlap and stage 3's prefetch of 1.)

What it is not
    A measurement. ``benchmarks/check_simulate.py`` runs the collectives
    bench, ``benchmarks/bench_stages.py`` and this model side by side and
    prints the error on step times the model was never fitted on.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ringzero.comm.schedule import TREE_BYTES, internode_bytes, steps_wire  # the Ring's own rule (no MPI)
from ringzero.runtime import accounting as acc
from ringzero.runtime.flat import Layout
from ringzero.tools.links import LINKS, Links, Nodes  # noqa: F401 (importable from here)


# ---- compute ---------------------------------------------------------------------
@dataclass
class Compute:
    """Per-unit forward/backward seconds, and per-element costs of casts and update."""
    fwd: list
    bwd: list
    cast_s: float = 0.0       # seconds per element of one fp16<->fp32 cast
    update_s: float = 0.0     # seconds per element of the update path (norm, unscale, AdamW, cast)
    cores: int | None = None  # ranks beyond this many share cores (None: never)
    source: str = ""

    def slow(self, n: int) -> float:
        return max(1.0, n / self.cores) if self.cores else 1.0


def _median_time(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def measure_compute(cfg, batch: int, seq: int, reps: int = 5, cores: int | None = None,
                    seed: int = 0) -> Compute:
    """Time the GPT's own forward_unit/backward_unit per unit (fp32 compute, as the
    engine runs on CPU), and the runtime's casts and update per element."""
    from ringzero.comm import kernels
    from ringzero.nn.gpt import GPT
    from ringzero.runtime import optim
    from ringzero.runtime.optim import AdamConfig, AdamW
    m = GPT(cfg)
    L = Layout(m.units)
    U = len(L.units)
    p = L.init_full(np.empty(L.padded, np.float32), seed)
    g = np.zeros(L.padded, np.float32)
    P, G = L.views(p), L.views(g)
    rng = np.random.default_rng(seed)
    x = rng.integers(0, cfg.vocab, (batch, seq))
    y = rng.integers(0, cfg.vocab, (batch, seq))
    fwd, bwd = [[] for _ in range(U)], [[] for _ in range(U)]
    for _ in range(reps + 1):                 # the first round warms the pool's buffers
        h, caches = x, [None] * U
        for u in range(U):
            t0 = time.perf_counter()
            h, caches[u] = m.forward_unit(u, P, h, y if u == U - 1 else None)
            fwd[u].append(time.perf_counter() - t0)
        d = 1.0
        for u in reversed(range(U)):
            t0 = time.perf_counter()
            d = m.backward_unit(u, d, caches[u], P, G)
            bwd[u].append(time.perf_counter() - t0)
    fwd = [float(np.median(t[1:])) for t in fwd]
    bwd = [float(np.median(t[1:])) for t in bwd]
    # casts: one unit-sized fp16 -> fp32 and back
    n = L.max_unit_padded
    a16, a32 = np.zeros(n, np.float16), np.zeros(n, np.float32)
    cast = (_median_time(lambda: kernels.f16_to_f32(a16, a32), reps)
            + _median_time(lambda: kernels.f32_to_f16(a32, a16), reps)) / (2 * n)
    # the update path of Zero.step per element: widen grad + dot, widen + scale + AdamW (one fused
    # pass where the C extension was built, as update._in_ram), narrow
    k = L.padded
    gr16, gw = np.zeros(k, np.float16), np.empty(k, np.float32)
    mst, mm, vv = np.zeros(k, np.float32), np.zeros(k, np.float32), np.zeros(k, np.float32)
    out16 = np.zeros(k, np.float16)
    opt = AdamW(AdamConfig(), k, np)

    def upd():
        kernels.f16_to_f32(gr16, gw)
        float(np.dot(gw, gw))
        opt.begin_step()
        if optim.HAVE_C:
            opt.update_tile(mst, mm, vv, gr16, np.float32(0.5), 1e-4)
        else:
            kernels.f16_to_f32(gr16, gw)
            np.multiply(gw, np.float32(0.5), out=gw)
            opt.update(mst, mm, vv, gw, 1e-4, ((0, k),))
        kernels.f32_to_f16(mst, out16)
    update = _median_time(upd, reps) / k
    return Compute(fwd, bwd, cast, update, cores,
                   f"measured here: GPT {cfg.n_layer}L C={cfg.n_embd} batch {batch} x seq {seq}")


def flops_compute(cfg, batch: int, seq: int, flops: float, mem_bw: float = 900e9) -> Compute:
    """Compute from a FLOP rate: forward of unit u = 2·tokens·Ψ_u (+ attention
    4·B·T²·C per block), backward twice that; casts and the update move bytes
    at ``mem_bw`` (6 B per cast element, 36 B per updated element)."""
    L = Layout(_units(cfg))
    tok = batch * seq
    fwd = []
    for u in range(len(L.units)):
        f = 2 * tok * L.unit_numel[u]
        if 1 <= u <= cfg.n_layer:
            f += 4 * batch * seq * seq * cfg.n_embd
        if u == len(L.units) - 1:
            f += 2 * tok * cfg.vocab * cfg.n_embd    # the tied head's matmul
        fwd.append(f / flops)
    return Compute(fwd, [2 * t for t in fwd], 6 / mem_bw, 36 / mem_bw, None,
                   f"{flops / 1e12:g} TFLOP/s, {mem_bw / 1e9:g} GB/s memory")


def _units(cfg):
    from ringzero.nn.gpt import gpt_units
    return gpt_units(cfg)


# ---- the step's operations ----------------------------------------------------------
def _closes(layout: Layout):
    """(visits, reads, writes, close): the step's positions and where each unit's gradient closes."""
    U = len(layout.units)
    visits = [("F", u) for u in range(U)] + [("B", u) for u in reversed(range(U))]
    writes = [set(layout.needs(u)) if ph == "B" else set() for ph, u in visits]
    close = {w: max(i for i, s in enumerate(writes) if w in s) for w in range(U)}
    return visits, writes, close


def reduce_buckets(layout: Layout, stage: str, overlap: bool = False, reduce_bucket: int | None = None,
                   elem_bytes: int = 2) -> tuple:
    """The engine's reduction buckets of several units ((units ascending), ...), as Zero picks them:
    stages 0-2 on more than one shard; ``reduce_bucket`` None: the Ring's tree_bytes (16 MiB) without
    overlap, none with it; 0: none."""
    from ringzero.runtime.plan import reduce_buckets as group
    st = acc.parse_stage(stage)
    if reduce_bucket is None:
        reduce_bucket = 0 if overlap or st in ("3", "hybrid") else TREE_BYTES
    if not reduce_bucket or st in ("3", "hybrid") or layout.shards < 2:
        return ()
    _, _, close = _closes(layout)
    order = sorted(close, key=lambda w: (close[w], w))
    return tuple(g for g in group(order, [n * elem_bytes for n in layout.unit_padded], reduce_bucket)
                 if len(g) > 1)


def step_ops(layout: Layout, stage: str, bwd_reads=lambda u: u != 0, overlap: bool = False,
             buckets: tuple = ()) -> list:
    """[(kind, unit)] in program order for one step of the engine at ``stage``.

    kinds: gather, cast, F, B, gcast, rs, ag, ar (compute kinds: cast, F, B, gcast).
    ``bwd_reads(u)``: does unit u's backward read its parameters (GPT: not the embedding).
    overlap=True: stage 1-2's all-gather of the updated parameters is taken in
    the steady state, as a gather in front of each unit's first forward (it
    feeds the next step's forward, and can hide behind it), not after the update.
    ``buckets`` (``reduce_buckets``): a bucket's units are reduced by one ``rs``
    (and stage 0's ``ag``), named by the unit that closes last, after its grad cast;
    without overlap, stage 1-2's update gathers them by one ``ag``, named by its first unit.
    """
    st = acc.parse_stage(stage)
    U = len(layout.units)
    visits, writes, close = _closes(layout)
    reads = [set(layout.needs(u)) if (ph == "F" or bwd_reads(u)) else set() for ph, u in visits]
    last = {max(g, key=lambda w: (close[w], w)): g for g in buckets}
    inside = {w for g in buckets for w in g}
    ops = []
    for i, (ph, u) in enumerate(visits):
        for w in sorted(reads[i]):
            if i == 0 or w not in reads[i - 1]:          # a new run: materialize
                first = not any(w in r for r in reads[:i])
                if st in ("3", "hybrid") or (overlap and st in ("1", "2") and first):
                    ops.append(("gather", w))
                ops.append(("cast", w))
        ops.append((ph, u))
        for w in range(U):
            if close[w] == i:
                ops.append(("gcast", w))
                if w in inside and w not in last:
                    continue                             # its bucket is reduced when its last unit closes
                ops.append(("rs", w))
                if st == "0":
                    ops.append(("ag", w))
                if st == "hybrid":
                    ops.append(("ar", w))
    if overlap:     # issue each gather when the compute before it starts (FSDP's prefetch,
        out = []    # ahead of the reduce-scatter still queued: BACKWARD_PRE)
        for op in ops:
            if op[0] == "gather":
                j = max((k for k, o in enumerate(out) if o[0] in ("F", "B")), default=len(out))
                out.insert(j, op)
            else:
                out.append(op)
        ops = out
    ops.append(("update", -1))
    if st in ("1", "2") and not overlap:     # by bucket (named by its first unit), as ShardedState.publish
        ops += [("ag", w) for w in range(U) if w not in inside or any(g[0] == w for g in buckets)]
    return ops


COMM_KINDS = ("gather", "rs", "ag", "ar")


def _group(stage: str, nd: int, ranks_per_node, nodes) -> int:
    """The shard group's size: Nd, or hybrid's Ng (a node's ranks when the nodes are modelled)."""
    if stage != "hybrid":
        return nd
    if nodes is not None and nodes.count > 1:
        if nd % nodes.count or ranks_per_node not in (None, nd // nodes.count):
            raise ValueError(f"hybrid across {nodes.count} nodes shards inside each node: expected Nd % N == 0 "
                             f"and Ng = Nd/N, got Nd={nd}, Ng={ranks_per_node}")
        return nd // nodes.count
    if not ranks_per_node:
        raise ValueError("stage hybrid needs ranks_per_node (Ng), got None")
    return ranks_per_node


def comm_ops(layout_full: Layout, stage, nd: int, ranks_per_node=None, nodes: Nodes | None = None,
             elem_bytes: int = 2, overlap: bool = False, reduce_bucket: int | None = None, zeropp=None):
    """Yield (kind, unit, op, ranks, S bytes) of every operation of one step (op None: compute).

    zeropp (a runtime.zeropp.ZeroPPPolicy, stage 3 / hybrid): qwZ's gathers and qgZ's reduce-scatters
    carry their wire bytes (codes + block scales: S · bytes_per_element / elem_bytes) on the same
    node-aware schedule (the same wire per rank, comm/quantized.py's table; the rounds are the Ring's,
    not the all-to-all's one message per peer); hpZ's later gather of a unit (the backward's) is a
    full-precision all-gather among the node's P ranks."""
    st = acc.parse_stage(stage)
    group = _group(st, nd, ranks_per_node, nodes)
    L = Layout(layout_full.units, shards=group)
    buckets = reduce_buckets(L, st, overlap, reduce_bucket, elem_bytes)
    _, _, close = _closes(L)
    span = {max(g, key=lambda w: (close[w], w)): g for g in buckets}
    first = {g[0]: g for g in buckets}                 # stages 1-2: the update's all-gathers, by bucket
    reduced = False
    zpp = zeropp if zeropp is not None and zeropp.enabled and st in ("3", "hybrid") else None
    P = nd // nodes.count if nodes is not None and nodes.count > 1 else group     # hpZ's node
    seen = set()                                       # units gathered once this step (hpZ)
    for kind, u in step_ops(L, st, overlap=overlap, buckets=buckets):
        reduced = reduced or kind == "update"
        if kind not in COMM_KINDS:
            yield kind, u, None, 0, 0
        elif kind == "ar":                             # the shard, among the Nn = Nd/Ng replicas
            yield kind, u, "all_reduce", nd // group, L.unit_padded[u] * elem_bytes // group
        else:
            units = (span.get(u, (u,)) if kind == "rs" or (kind == "ag" and not reduced)
                     else first.get(u, (u,)) if kind == "ag" else (u,))
            S = sum(L.unit_padded[w] for w in units) * elem_bytes
            n = group
            if zpp is not None and kind == "gather":
                if zpp.hpz and st == "3" and u in seen:
                    n = P
                elif zpp.qwz:
                    S = round(S * zpp.weights.bytes_per_element() / elem_bytes)
                seen.add(u)
            elif zpp is not None and kind == "rs" and zpp.qgz:
                S = round(S * zpp.grads.bytes_per_element() / elem_bytes)
            yield kind, u, "reduce_scatter" if kind == "rs" else "all_gather", n, S


def internode_per_step(layout_full: Layout, stage, nd: int, nodes: int, ranks_per_node=None,
                       elem_bytes: int = 2, reduce_bucket: int | None = None, zeropp=None) -> float:
    """Bytes one rank sends to other nodes in one step: comm/schedule.py's ``internode_bytes`` of
    every collective of the step (hybrid's all-reduce: among one rank per node, all of it)."""
    out = 0.0
    for kind, u, op, n, S in comm_ops(layout_full, stage, nd, ranks_per_node, Nodes(nodes, 0.0, 1.0), elem_bytes,
                                      reduce_bucket=reduce_bucket, zeropp=zeropp):
        if op is None or nodes < 2:
            continue
        if kind == "ar":                 # among one rank per node: every byte crosses
            out += steps_wire(op, n, S)[1]
        elif n == nd:                    # the world's collectives (P = 1: the flat schedule, the same bytes)
            out += internode_bytes(op, n, S, nodes)
    return out


def durations(layout_full: Layout, stage, nd: int, comp: Compute, links: Links,
              ranks_per_node: int | None = None, inter: Links | None = None,
              elem_bytes: int = 2, overlap: bool = False, nodes: Nodes | None = None,
              reduce_bucket: int | None = None, zeropp=None) -> list:
    """[(kind, unit, seconds)] of one step in program order, for one rank.

    nodes None (or one node): every collective on ``links`` (hybrid's all-reduce on ``inter``
    if given); else the two links of ``Nodes``: ``links`` inside a node, the network across."""
    st = acc.parse_stage(stage)
    group = _group(st, nd, ranks_per_node, nodes)
    L = Layout(layout_full.units, shards=group)
    two = nodes is not None and nodes.count > 1
    slow = comp.slow(nd)
    out = []
    for kind, u, op, n, S in comm_ops(layout_full, st, nd, ranks_per_node, nodes, elem_bytes, overlap,
                                      reduce_bucket, zeropp):
        if op is not None:
            if kind == "ar":
                d = nodes.across(op, n, S, group) if two else (inter or links).time(op, n, S)
            elif two and n == nd:                      # the shard group spans the nodes
                d = nodes.time(op, n, S, links)
            else:                                      # inside one node (hybrid), or one host
                d = links.time(op, n, S)
        elif kind == "update":
            d = comp.update_s * (L.padded if st == "0" else L.shard_numel) * slow
        elif kind in ("cast", "gcast"):
            d = comp.cast_s * L.unit_padded[u] * slow
        else:
            d = (comp.fwd if kind == "F" else comp.bwd)[u] * slow
        out.append((kind, u, d))
    return out


def step_time(layout_full: Layout, stage, nd: int, comp: Compute, links: Links, overlap=False,
              ranks_per_node: int | None = None, inter: Links | None = None,
              elem_bytes: int = 2, nodes: Nodes | None = None, reduce_bucket: int | None = None,
              zeropp=None) -> dict:
    """Predicted seconds of one step per rank, and its parts (compute, comm, update).

    No overlap: the sum of every operation. Overlap: two streams; a gather
    may start when the compute before it in program order starts; a
    unit's reduce-scatter waits for its gradient cast; a materializing cast
    waits for its gather; the update waits for every collective; stage 1-2's
    all-gathers wait for the update. ``nodes`` (several): the two links (Nodes), and the
    result's ``internode_bytes``, what one rank sends across nodes per step. ``reduce_bucket``:
    bytes per reduction bucket at stages 0-2, as ``Zero(reduce_bucket=)`` (None: its default).
    """
    st = acc.parse_stage(stage)
    ops = durations(layout_full, st, nd, comp, links, ranks_per_node, inter, elem_bytes, overlap, nodes,
                    reduce_bucket, zeropp)
    parts = {"compute": 0.0, "comm": 0.0, "update": 0.0}
    for kind, _, d in ops:
        parts["comm" if kind in COMM_KINDS else "update" if kind == "update" else "compute"] += d
    if not overlap:
        total = sum(d for _, _, d in ops)
    else:
        t_comp = t_comm = last_start = 0.0
        fin = {}
        for kind, u, d in ops:
            if kind in COMM_KINDS:
                ready = {"gather": last_start, "rs": fin.get(("gcast", u), 0.0),
                         "ar": fin.get(("rs", u), 0.0),
                         "ag": fin.get(("update", -1), fin.get(("rs", u), 0.0))}[kind]
                t_comm = max(t_comm, ready) + d
                fin[(kind, u)] = t_comm
            else:
                ready = t_comp
                if kind == "cast" and ("gather", u) in fin:
                    ready = max(ready, fin[("gather", u)])
                if kind == "update":
                    ready = max(ready, t_comm)
                last_start = ready
                t_comp = ready + d
                fin[(kind, u)] = t_comp
        total = max(t_comp, t_comm)
    zpp = zeropp is not None and zeropp.enabled and st in ("3", "hybrid")
    out = {"stage": st + ("+zpp" if zpp else ""), "nd": nd, "overlap": bool(overlap), "step_s": total, **parts,
           "exposed_comm_s": total - parts["compute"] - parts["update"]}
    if nodes is not None and nodes.count > 1:
        out["nodes"] = nodes.count
        out["internode_bytes"] = internode_per_step(layout_full, st, nd, nodes.count, ranks_per_node, elem_bytes,
                                                    reduce_bucket, zeropp if zpp else None)
    return out

