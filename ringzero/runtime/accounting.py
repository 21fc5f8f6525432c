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

    Mixed-precision Adam keeps per parameter: fp16 parameter (2 B), fp16
    gradient (2 B), fp32 master (4 B), fp32 Adam m (4 B), fp32 Adam v (4 B).
    HYBRID here means stage-3 sharding inside a node of Ng ranks and
    replication across Nn = Nd/Ng nodes: after the intra-node reduce-scatter,
    each gradient shard is all-reduced among the Nn ranks that hold the same
    shard on other nodes.

What it is not
    No MPI, no arrays, no measurement. Pass the PADDED Ψ (``Layout.padded``)
    to get what a padded runtime allocates and sends, the real Ψ
    (``Layout.numel``) to get the textbook figure. Results are exact integers
    whenever the division is exact (always true for a padded Ψ), else floats.
"""
from __future__ import annotations

import numbers
import re
from decimal import Decimal

STAGES = ("0", "1", "2", "3", "hybrid")

# The five state classes and their bytes per element.
CLASSES = ("params_fp16", "grads_fp16", "master_fp32", "adam_m_fp32", "adam_v_fp32")
CLASS_BYTES = {"params_fp16": 2, "grads_fp16": 2, "master_fp32": 4,
               "adam_m_fp32": 4, "adam_v_fp32": 4}

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


def model_state_bytes(stage, psi: int, nd: int, ranks_per_node: int | None = None) -> dict:
    """Bytes per rank of each state class: {class: bytes} for CLASSES."""
    st = parse_stage(stage)
    group = _check(psi, nd, st, ranks_per_node)
    return {c: _div(CLASS_BYTES[c] * psi, group) if c in STAGE_TABLE[st][0] else CLASS_BYTES[c] * psi
            for c in CLASSES}


def model_state_total(stage, psi: int, nd: int, ranks_per_node: int | None = None):
    """Total model-state bytes per rank (the 16Ψ-family figure)."""
    return sum(model_state_bytes(stage, psi, nd, ranks_per_node).values())


def bytes_per_param(stage, nd: int, ranks_per_node: int | None = None) -> float:
    """Model-state bytes per parameter per rank, as a number (16, 4 + 12/Nd, ...)."""
    st = parse_stage(stage)
    group = _check(0, nd, st, ranks_per_node)
    return sum(CLASS_BYTES[c] / group if c in STAGE_TABLE[st][0] else CLASS_BYTES[c] for c in CLASSES)


def bytes_per_param_formula(stage) -> str:
    """The stage's formula as the ZeRO paper writes it."""
    return {"0": "16Ψ", "1": "4Ψ + 12Ψ/Nd", "2": "2Ψ + 14Ψ/Nd", "3": "16Ψ/Nd",
            "hybrid": "16Ψ/Ng"}[parse_stage(stage)]


def traffic_elements(stage, psi: int, nd: int, ranks_per_node: int | None = None) -> dict:
    """Elements sent by one rank per step, by collective.

    Keys: "reduce_scatter", "all_gather" and, for hybrid only, "all_reduce"
    (the inter-node all-reduce of the gradient shard). A ring all-reduce is
    counted as the reduce-scatter plus the all-gather it is made of.
    """
    st = parse_stage(stage)
    group = _check(psi, nd, st, ranks_per_node)
    sharded, replicated = STAGE_TABLE[st]
    one = _div(psi * (group - 1), group)          # one ring RS or AG over Ψ in the group
    if "params_fp16" not in sharded:               # params held in full: gathered once, after the update
        return {"reduce_scatter": one, "all_gather": one}
    out = {"reduce_scatter": one, "all_gather": 2 * one}   # gathers for forward and backward
    if replicated:
        nn = nd // group
        out["all_reduce"] = _div(2 * psi * (nn - 1), nd)  # 2·(Ψ/Ng)·(Nn-1)/Nn
    return out


def traffic_bytes(stage, psi: int, nd: int, ranks_per_node: int | None = None,
                  grad_bytes: int = 2, param_bytes: int = 2) -> dict:
    """Bytes sent by one rank per step, by collective (fp16 grads and params by default).

    Reduce-scatters and all-reduces carry gradients, all-gathers carry parameters.
    """
    el = traffic_elements(stage, psi, nd, ranks_per_node)
    return {k: v * (param_bytes if k == "all_gather" else grad_bytes) for k, v in el.items()}


def traffic_formula(stage) -> str:
    """Elements sent per rank per step, as a formula."""
    return {"0": "2Ψ(Nd-1)/Nd", "1": "2Ψ(Nd-1)/Nd", "2": "2Ψ(Nd-1)/Nd", "3": "3Ψ(Nd-1)/Nd",
            "hybrid": "3Ψ(Ng-1)/Ng + 2(Ψ/Ng)(Nn-1)/Nn"}[parse_stage(stage)]


def stages_that_fit(budget_bytes, psi: int, nd: int, ranks_per_node: int | None = None,
                    extra_bytes=0) -> list:
    """The stages whose model state (plus ``extra_bytes``) fits ``budget_bytes`` per rank."""
    out = []
    for st in STAGES:
        if STAGE_TABLE[st][1] and ranks_per_node is None:
            continue
        if model_state_total(st, psi, nd, ranks_per_node) + extra_bytes <= budget_bytes:
            out.append(st)
    return out


# ---- quantities people type ----------------------------------------------------
_COUNT = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_BYTES = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def _parse(text, table, what, example):
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).upper() if m else None
    if not m or unit not in table:
        raise ValueError(f"cannot read {what} {text!r}: expected a number with an optional "
                         f"suffix {'/'.join(k for k in table if k)}, e.g. {example}")
    return Decimal(m.group(1)) * table[unit]   # exact: '0.1B' is 10**8, not 100000000.00000001


def parse_count(text) -> int:
    """'7.5B' -> 7500000000 (K, M, B or G, T are powers of 1000)."""
    v = _parse(text, _COUNT, "count", "7.5B")
    if v != int(v) or v < 1:
        raise ValueError(f"count {text!r} must be a whole number >= 1, got {v}")
    return int(v)


def parse_bytes(text) -> int:
    """'32GB' -> 32e9, '512MiB' -> 512*2**20 (GB = 1e9 bytes, GiB = 2**30)."""
    v = _parse(text, _BYTES, "size", "32GB or 512MiB")
    if v < 1:
        raise ValueError(f"size {text!r} must be >= 1 byte, got {v}")
    return int(v)
