"""ZeRO's arithmetic as small pure functions: bytes per rank and traffic per step.

What it is
    The formulas of the stage table, written once, for everyone who needs them:
    the sharding runtime (formula beside measurement, the memory budget), the
    trainer (its start and end reports), the estimator and the explainers.

        stage   FSDP name       bytes per parameter per rank   elements sent per rank per step
        0       NO_SHARD        16Ψ                            2Ψ(n-1)/n   (all-reduce = RS + AG)
        1       -               4Ψ + 12Ψ/Nd                    2Ψ(n-1)/n   (RS grads + AG params)
        2       SHARD_GRAD_OP   2Ψ + 14Ψ/Nd                    2Ψ(n-1)/n
        3       FULL_SHARD      16Ψ/Nd                         3Ψ(n-1)/n   (AG fwd + AG bwd + RS)
        hybrid  HYBRID_SHARD    16Ψ/Ng                         3Ψ(Ng-1)/Ng + 2(Ψ/Ng)(Nn-1)/Nn

    Of those, across nodes (N nodes of P ranks, the node-aware schedule;
    ``internode_elements``): 2(Ψ/P)(N-1)/N at stages 0-2, 3(Ψ/P)(N-1)/N at
    stage 3, and at hybrid only the all-reduce, 2(Ψ/P)(N-1)/N: stage 3's
    all-gathers cross the network, hybrid's stay in the node.

    Mixed-precision Adam keeps per parameter: fp16 parameter (2 B), fp16
    gradient (2 B), fp32 master (4 B), fp32 Adam m (4 B), fp32 Adam v (4 B).
    HYBRID here means stage-3 sharding inside a node of Ng ranks and
    replication across Nn = Nd/Ng nodes: after the intra-node reduce-scatter,
    each gradient shard is all-reduced among the Nn ranks that hold the same
    shard on other nodes.

    precision="bf16" stores params and grads in bf16: 2 B each, like fp16, with
    the same fp32 master and Adam m, v, so every byte figure above is unchanged
    (bf16 drops the loss scaler, not memory). precision="fp32" stores them in
    fp32: 4 B each, 20Ψ at stage 0. The class keys keep their names
    (``params_fp16`` is "the params in the storage dtype"); ``class_name``
    spells them for a precision.

    grad_accum=K (K micro-batches per optimizer step):

        stage   extra memory per rank          traffic per step
        0-2     fp32 accumulator of Ψ: 4Ψ      unchanged (reduced once per step,
                (full size even at stage 2)      as DDP's no_sync): per sample 1/K
        3       fp32 shard accumulator: 4Ψ/Nd  K x 3Ψ(Nd-1)/Nd (every micro-batch
                                                 gathers params twice and
                                                 reduce-scatters its grads)
        hybrid  fp32 shard accumulator: 4Ψ/Ng  K x 3Ψ(Ng-1)/Ng + 2(Ψ/Ng)(Nn-1)/Nn
                                                 (the accumulated shard crosses
                                                 nodes once per step)

    K = 1 adds no accumulator (and no dict key): gradients are used as they are.

What it is not
    No MPI, no arrays, no measurement. Pass the PADDED Ψ (``Layout.padded``)
    to get what a padded runtime allocates and sends, the real Ψ
    (``Layout.numel``) to get the textbook figure. Results are exact integers
    whenever the division is exact (always true for a padded Ψ), else floats.
"""
from __future__ import annotations

import numbers

STAGES = ("0", "1", "2", "3", "hybrid")

# The five state classes and their bytes per element.
CLASSES = ("params_fp16", "grads_fp16", "master_fp32", "adam_m_fp32", "adam_v_fp32")
CLASS_BYTES = {"params_fp16": 2, "grads_fp16": 2, "master_fp32": 4,
               "adam_m_fp32": 4, "adam_v_fp32": 4}

# Bytes of one stored param or grad element, by precision (master and Adam stay fp32).
PRECISION_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}
STORAGE_CLASSES = ("params_fp16", "grads_fp16")     # the classes held in the storage dtype
ACCUM_CLASS = "grad_accum_fp32"                     # present only when grad_accum > 1
ACCUM_BYTES = 4

_ALIASES = {
    "0": "0", "1": "1", "2": "2", "3": "3", "hybrid": "hybrid",
    "no_shard": "0", "shard_grad_op": "2", "full_shard": "3", "hybrid_shard": "hybrid",
    "ddp": "0", "dp": "0",
}

# THE stage table, the only place a stage's sharding is written down: which
# state classes each stage partitions over its sharding group, and whether that
# group is a node whose shards are replicated across nodes (HYBRID_SHARD).
# runtime/policy.py builds the engine's StagePolicy from it; the formulas below
# read it too.
OPTIMIZER_CLASSES = ("master_fp32", "adam_m_fp32", "adam_v_fp32")
STAGE_TABLE = {
    #  stage     partitioned classes                        replicated across nodes
    "0":      ((),                                          False),
    "1":      (OPTIMIZER_CLASSES,                           False),
    "2":      (("grads_fp16",) + OPTIMIZER_CLASSES,         False),
    "3":      (CLASSES,                                     False),
    "hybrid": (CLASSES,                                     True),
}


def sharded_classes(stage) -> tuple:
    """The state classes ``stage`` partitions over its sharding group."""
    return STAGE_TABLE[parse_stage(stage)][0]


def replicated_across_nodes(stage) -> bool:
    """True if ``stage`` shards inside a node and replicates across nodes (HYBRID)."""
    return STAGE_TABLE[parse_stage(stage)][1]


def parse_stage(stage) -> str:
    """'0'..'3', 'hybrid', ints 0..3, or an FSDP name -> one of STAGES."""
    if isinstance(stage, bool):
        raise TypeError(f"stage must be an int or a name, got {stage!r}")
    key = str(stage).strip().lower().replace("-", "_")
    if key not in _ALIASES:
        raise ValueError(f"unknown stage {stage!r}: expected one of 0, 1, 2, 3, hybrid, "
                         f"NO_SHARD, SHARD_GRAD_OP, FULL_SHARD, HYBRID_SHARD")
    return _ALIASES[key]


def _div(a, b):
    """a / b, as an int when exact."""
    return a // b if a % b == 0 else a / b


def _check(psi, nd, stage, ranks_per_node):
    """Validate the arguments; return the sharding group size (Nd, or Ng for hybrid)."""
    if not isinstance(psi, numbers.Integral) or isinstance(psi, bool) or psi < 0:
        raise ValueError(f"psi must be an int >= 0, got {psi!r}")
    if not isinstance(nd, numbers.Integral) or isinstance(nd, bool) or nd < 1:
        raise ValueError(f"nd must be an int >= 1, got {nd!r}")
    if not STAGE_TABLE[stage][1]:
        return nd
    if ranks_per_node is None:
        raise ValueError("stage hybrid needs ranks_per_node (Ng), got None")
    ng = ranks_per_node
    if not isinstance(ng, numbers.Integral) or ng < 1 or nd % ng:
        raise ValueError(f"ranks_per_node must divide nd: expected nd % Ng == 0, "
                         f"got nd={nd}, Ng={ng}")
    return ng


def storage_bytes(precision: str = "fp16") -> int:
    """Bytes of a stored param or grad element: fp16 2, bf16 2, fp32 4."""
    if precision not in PRECISION_BYTES:
        raise ValueError(f"unknown precision {precision!r}: expected one of "
                         f"{', '.join(PRECISION_BYTES)}")
    return PRECISION_BYTES[precision]


def _check_k(grad_accum) -> int:
    if not isinstance(grad_accum, numbers.Integral) or isinstance(grad_accum, bool) or grad_accum < 1:
        raise ValueError(f"grad_accum must be an int >= 1, got {grad_accum!r}")
    return int(grad_accum)


def class_bytes(precision: str = "fp16", grad_accum: int = 1) -> dict:
    """Bytes per element of every class held at this precision and K: {class: bytes}."""
    sb = storage_bytes(precision)
    out = {c: sb if c in STORAGE_CLASSES else CLASS_BYTES[c] for c in CLASSES}
    if _check_k(grad_accum) > 1:
        out[ACCUM_CLASS] = ACCUM_BYTES
    return out


def class_name(c: str, precision: str = "fp16") -> str:
    """A class key as it reads at a precision: params_fp16 -> params_bf16."""
    storage_bytes(precision)
    return c.replace("fp16", precision) if c in STORAGE_CLASSES else c


def _is_sharded(stage: str, c: str) -> bool:
    """Whether a stage divides class c by the sharding group (the accumulator: at 3 and hybrid)."""
    sharded = STAGE_TABLE[stage][0]
    return c in sharded or (c == ACCUM_CLASS and "params_fp16" in sharded)


def model_state_bytes(stage, psi: int, nd: int, ranks_per_node: int | None = None,
                      precision: str = "fp16", grad_accum: int = 1) -> dict:
    """Bytes per rank of each state class: {class: bytes} for CLASSES (+ ACCUM_CLASS if K > 1)."""
    st = parse_stage(stage)
    group = _check(psi, nd, st, ranks_per_node)
    return {c: _div(b * psi, group) if _is_sharded(st, c) else b * psi
            for c, b in class_bytes(precision, grad_accum).items()}


def model_state_total(stage, psi: int, nd: int, ranks_per_node: int | None = None,
                      precision: str = "fp16", grad_accum: int = 1):
    """Total model-state bytes per rank (the 16Ψ-family figure)."""
    return sum(model_state_bytes(stage, psi, nd, ranks_per_node, precision, grad_accum).values())


def bytes_per_param(stage, nd: int, ranks_per_node: int | None = None,
                    precision: str = "fp16", grad_accum: int = 1) -> float:
    """Model-state bytes per parameter per rank, as a number (16, 4 + 12/Nd, ...)."""
    st = parse_stage(stage)
    group = _check(0, nd, st, ranks_per_node)
    return sum(b / group if _is_sharded(st, c) else b
               for c, b in class_bytes(precision, grad_accum).items())


def bytes_per_param_formula(stage, precision: str = "fp16", grad_accum: int = 1) -> str:
    """The stage's formula as the ZeRO paper writes it ("4Ψ + 12Ψ/Nd"), for a precision and K."""
    st = parse_stage(stage)
    full = sharded = 0
    for c, b in class_bytes(precision, grad_accum).items():
        if _is_sharded(st, c):
            sharded += b
        else:
            full += b
    g = "Ng" if st == "hybrid" else "Nd"
    terms = ([f"{full}Ψ"] if full else []) + ([f"{sharded}Ψ/{g}"] if sharded else [])
    return " + ".join(terms)


def traffic_elements(stage, psi: int, nd: int, ranks_per_node: int | None = None,
                     grad_accum: int = 1) -> dict:
    """Elements sent by one rank per optimizer step, by collective.

    Keys: "reduce_scatter", "all_gather" and, for hybrid only, "all_reduce"
    (the inter-node all-reduce of the gradient shard). A ring all-reduce is
    counted as the reduce-scatter plus the all-gather it is made of.
    With grad_accum = K: stages 0-2 reduce once per step (unchanged); stage 3
    and hybrid gather and reduce-scatter once per micro-batch (K times); the
    hybrid all-reduce of the accumulated shard stays once per step.
    """
    st = parse_stage(stage)
    group = _check(psi, nd, st, ranks_per_node)
    k = _check_k(grad_accum)
    sharded, replicated = STAGE_TABLE[st]
    one = _div(psi * (group - 1), group)          # one ring RS or AG over Ψ in the group
    if "params_fp16" not in sharded:               # params held in full: gathered once, after the update
        return {"reduce_scatter": one, "all_gather": one}
    out = {"reduce_scatter": k * one, "all_gather": 2 * k * one}   # gathers for forward and backward
    if replicated:
        nn = nd // group
        out["all_reduce"] = _div(2 * psi * (nn - 1), nd)  # 2·(Ψ/Ng)·(Nn-1)/Nn
    return out


def traffic_bytes(stage, psi: int, nd: int, ranks_per_node: int | None = None,
                  grad_bytes: int = 2, param_bytes: int = 2, grad_accum: int = 1,
                  precision: str | None = None) -> dict:
    """Bytes sent by one rank per step, by collective (fp16 grads and params by default).

    Reduce-scatters and all-reduces carry gradients, all-gathers carry
    parameters. ``precision`` (fp16, bf16, fp32), when given, sets both
    element sizes; bf16 sends what fp16 sends.
    """
    if precision is not None:
        grad_bytes = param_bytes = storage_bytes(precision)
    el = traffic_elements(stage, psi, nd, ranks_per_node, grad_accum)
    return {k: v * (param_bytes if k == "all_gather" else grad_bytes) for k, v in el.items()}


def traffic_formula(stage, grad_accum: int = 1) -> str:
    """Elements sent per rank per step, as a formula (K micro-batches: "K x ..." at stage 3)."""
    st = parse_stage(stage)
    k = _check_k(grad_accum)
    base = {"0": "2Ψ(Nd-1)/Nd", "1": "2Ψ(Nd-1)/Nd", "2": "2Ψ(Nd-1)/Nd", "3": "3Ψ(Nd-1)/Nd",
            "hybrid": "3Ψ(Ng-1)/Ng"}[st]
    if k > 1 and st in ("3", "hybrid"):
        base = f"{k} x {base}"
    return base + (" + 2(Ψ/Ng)(Nn-1)/Nn" if st == "hybrid" else "")


def _check_nodes(nd: int, nodes) -> int:
    """P, the ranks per node, of nd ranks on ``nodes`` nodes of the same size."""
    if not isinstance(nodes, numbers.Integral) or isinstance(nodes, bool) or nodes < 1 or nd % nodes:
        raise ValueError(f"nodes must be an int >= 1 that divides nd: expected nd % N == 0, "
                         f"got nd={nd}, N={nodes!r}")
    return nd // nodes


def internode_elements(stage, psi: int, nd: int, nodes: int = 1, ranks_per_node: int | None = None,
                       grad_accum: int = 1) -> dict:
    """Elements one rank sends to ranks on OTHER nodes per optimizer step, by collective.

    The nd ranks sit on N = ``nodes`` nodes of P = nd/N ranks each, and every
    collective that spans nodes runs the node-aware schedule (comm/plan.py
    node_aware: a pass inside the node on the whole buffer, then a pass across
    the N nodes on 1/P of it). A reduce-scatter or all-gather of Ψ elements
    over the nd ranks then sends, per rank,

        inside the node   Ψ(P-1)/P
        across nodes      (Ψ/P)(N-1)/N        (= Ψ(N-1)/Nd: a node sends Ψ(N-1)/N, the least possible)

    which add up to the flat ring's Ψ(Nd-1)/Nd. Per step, across nodes:

        stage 0-2   2(Ψ/P)(N-1)/N        stage 0's all-reduce is its RS + AG; 1-2: RS grads + AG params
        stage 3     3(Ψ/P)(N-1)/N        AG fwd + AG bwd + RS, K times with K micro-batches
        hybrid      2(Ψ/P)(N-1)/N        only the all-reduce of the shard (Ψ/Ng) among the replicas
                                         crosses; with Ng = P it is flat over N ranks, 2(Ψ/Ng)(N-1)/N

    Hybrid needs its shard group inside a node (P % Ng == 0; Ng defaults to P):
    its reduce-scatters and all-gathers then never leave the node. With P = 1
    there is no node-aware schedule: every byte crosses, as the formula says
    (Ψ(N-1)/N per pass). nodes = 1: nothing crosses (all zeros). Same keys as
    ``traffic_elements``. A flat all-reduce that takes recursive doubling
    (shards of at most 64 KiB, comm/schedule.py SMALL_BYTES) sends S·log2 N
    instead of 2S(N-1)/N: the same at N = 2, more above. A hybrid shard that does
    not split into N equal blocks sends up to an element per pass more or less
    on a rank (the ring's blocks differ by one); the ranks' sum stays exact.
    """
    st = parse_stage(stage)
    P = _check_nodes(nd, nodes)
    k = _check_k(grad_accum)
    if STAGE_TABLE[st][1]:
        ng = P if ranks_per_node is None else ranks_per_node
        _check(psi, nd, st, ng)
        if P % ng:
            raise ValueError(f"hybrid's shard group must sit inside a node: expected P % Ng == 0, "
                             f"got P={P} ranks per node, Ng={ng}")
    else:
        _check(psi, nd, st, ranks_per_node)
    one = _div(psi * (nodes - 1), nd)             # one pass across nodes: (Ψ/P)(N-1)/N
    if STAGE_TABLE[st][1]:
        return {"reduce_scatter": 0, "all_gather": 0, "all_reduce": 2 * one}
    if "params_fp16" not in STAGE_TABLE[st][0]:
        return {"reduce_scatter": one, "all_gather": one}
    return {"reduce_scatter": k * one, "all_gather": 2 * k * one}


def internode_bytes(stage, psi: int, nd: int, nodes: int = 1, ranks_per_node: int | None = None,
                    grad_accum: int = 1, precision: str = "fp16") -> dict:
    """``internode_elements`` in bytes of the storage dtype (fp16 and bf16: 2 B, fp32: 4 B)."""
    eb = storage_bytes(precision)
    return {c: v * eb for c, v in internode_elements(stage, psi, nd, nodes, ranks_per_node, grad_accum).items()}


def internode_formula(stage, grad_accum: int = 1) -> str:
    """Elements sent across nodes per rank per step, as a formula (N nodes of P ranks)."""
    st = parse_stage(stage)
    k = _check_k(grad_accum)
    base = {"0": "2(Ψ/P)(N-1)/N", "1": "2(Ψ/P)(N-1)/N", "2": "2(Ψ/P)(N-1)/N", "3": "3(Ψ/P)(N-1)/N",
            "hybrid": "2(Ψ/P)(N-1)/N"}[st]
    return f"{k} x {base}" if k > 1 and st == "3" else base


def stages_that_fit(budget_bytes, psi: int, nd: int, ranks_per_node: int | None = None,
                    extra_bytes=0, precision: str = "fp16", grad_accum: int = 1) -> list:
    """The stages whose model state (plus ``extra_bytes``) fits ``budget_bytes`` per rank."""
    out = []
    for st in STAGES:
        if STAGE_TABLE[st][1] and ranks_per_node is None:
            continue
        if model_state_total(st, psi, nd, ranks_per_node, precision, grad_accum) + extra_bytes \
                <= budget_bytes:
            out.append(st)
    return out


def offload_io_bytes(stage, psi: int, nd: int, ranks_per_node: int | None = None, params: bool = False,
                     precision: str = "fp16", grad_accum: int = 1, gathered: int | None = None) -> dict:
    """Bytes one rank reads from and writes to its offload files per optimizer step (runtime/offload.py).

    Optimizer offload: the update reads and writes master, m and v of every element the rank
    updates, E = Ψ/Nd (Ψ at stage 0, Ψ/Ng at hybrid): 12E each way. Params offload (params sharded:
    3, hybrid) adds the cast params written by the update, 2E, and the params read by the step's
    gathers: each unit's piece is read once per run of its gathers (forward and backward: twice,
    the last unit once, as plan.py makes them), K times per step: 2 x 2E x K textbook, or
    ``gathered`` (the plan's gathered elements, all units' runs summed) x 2B x K / Ng exactly.
    Returns {"read": bytes, "write": bytes, "read_formula": str, "write_formula": str}."""
    st = parse_stage(stage)
    g = _check(psi, nd, st, ranks_per_node)
    k = _check_k(grad_accum)
    e = psi if st == "0" else _div(psi, g)
    sb = storage_bytes(precision)
    out = {"read": 12 * e, "write": 12 * e, "read_formula": "12Ψ/Nd", "write_formula": "12Ψ/Nd"}
    if st == "0":
        out["read_formula"] = out["write_formula"] = "12Ψ"
    if params:
        if not sharded_classes(st) or "params_fp16" not in sharded_classes(st):
            raise ValueError(f"params offload needs the params sharded (stage 3, hybrid), got stage {st}")
        reads = 2 * e * k if gathered is None else _div(gathered * k, g)
        out["read"] += reads * sb
        out["write"] += e * sb
        out["read_formula"] = f"12Ψ/Nd + {'K x ' if k > 1 else ''}2 x {sb}Ψ/Nd"
        out["write_formula"] = f"12Ψ/Nd + {sb}Ψ/Nd"
    return out
