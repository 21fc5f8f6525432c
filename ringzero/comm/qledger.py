"""What the quantized collectives move: their byte ledger, and ZeRO++'s volume formula.

What it is
    ``QLedger``: this rank's cumulative counters per op ("q_all_gather", "q_reduce_scatter"),
    in the form of the Ring's ledger (comm/cache.py), so ``runtime.reports.ledger_totals`` can sum
    it beside the rings' (``as_dict()[op]["bytes_sent"]`` and ``["bytes_sent_internode"]``), plus
    the split the trainer needs to print ZeRO++'s 3Ψ -> 0.75Ψ: codes and scales apart, inside the
    node and across it:

        bytes_sent = codes_intra + scales_intra + codes_inter + scales_inter
        bytes_sent_internode = codes_inter + scales_inter

    ("codes" counts the codes and their padding to 4 bytes; "scales" the fp32 scales.)

    ``zeropp_volume(...)``: the seed's per-step stage 3 communication in units of Ψ fp16
    elements' bytes (the seed's 3Ψ: forward all-gather Ψ, backward all-gather Ψ, gradient
    reduce-scatter Ψ), and what crosses the nodes with ZeRO++'s switches: qwZ sends the forward
    all-gather in int8 (1 + 4/block bytes an element against fp16's 2: 0.5Ψ), hpZ keeps the
    backward all-gather inside the node (0), qgZ sends the reduce-scatter in int4 (0.25Ψ).
    With the scales counted the figures are slightly above ZeRO++'s 0.5 + 0 + 0.25 = 0.75Ψ.

What it is not
    A measurement: the ledger counts what the ops posted; the figures per step are the
    trainer's (runtime/reports.zeropp_traffic, through Topology.ledgers) and the benchmarks'.
"""
from __future__ import annotations

from ringzero.comm.quant import Quant

QOPS = ("q_all_gather", "q_reduce_scatter")
_SPLIT = ("codes_intra", "scales_intra", "codes_inter", "scales_inter")
_KEYS = ("bytes_sent", "bytes_sent_internode", "bytes_recv", "messages", "calls", *_SPLIT)


class QLedger:
    """Cumulative per-op counters of this rank's quantized collectives (module docstring)."""

    def __init__(self):
        self.reset()

    def reset(self):
        self._d = {op: dict.fromkeys(_KEYS, 0) for op in QOPS}

    def sent(self, op: str, codes: int, scales: int, internode: bool):
        """One message of `codes` + `scales` bytes posted to a rank on another node or this one."""
        d, where = self._d[op], "inter" if internode else "intra"
        d["codes_" + where] += codes
        d["scales_" + where] += scales
        d["bytes_sent"] += codes + scales
        d["bytes_sent_internode"] += (codes + scales) if internode else 0
        d["messages"] += 1

    def received(self, op: str, nbytes: int):
        self._d[op]["bytes_recv"] += nbytes

    def called(self, op: str):
        self._d[op]["calls"] += 1

    def __getitem__(self, op):
        return dict(self._d[op])

    def as_dict(self) -> dict:
        return {op: self[op] for op in QOPS}

    def total_sent(self) -> int:
        return sum(self._d[op]["bytes_sent"] for op in QOPS)

    def total_sent_internode(self) -> int:
        return sum(self._d[op]["bytes_sent_internode"] for op in QOPS)


def zeropp_volume(qwz: bool = False, hpz: bool = False, qgz: bool = False,
                  weights: Quant = Quant(8, 2048), grads: Quant = Quant(4, 256), elem_bytes: int = 2) -> dict:
    """Stage 3's cross-node volume per step in units of Ψ * elem_bytes (the seed's 3Ψ at fp16).

    Returns {"forward_all_gather", "backward_all_gather", "reduce_scatter", "total"}: each phase's
    bytes per element over elem_bytes (1.0 = the unquantized phase). The unquantized total is 3.0;
    all three switches with int8 weights in blocks of 2048 and int4 gradients in blocks of 256 (the
    engine's defaults, runtime/zeropp.py) give 0.5 + 1/1024 + 0 + 0.25 + 1/128.
    """
    wq = weights.bytes_per_element() / elem_bytes if qwz else 1.0
    out = {"forward_all_gather": wq,
           "backward_all_gather": 0.0 if hpz else wq,     # hpZ: from the secondary shard inside the node
           "reduce_scatter": grads.bytes_per_element() / elem_bytes if qgz else 1.0}
    out["total"] = sum(out.values())
    return out
