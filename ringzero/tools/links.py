"""The links of ``python -m ringzero.simulate``: what one collective costs in seconds.

What it is
    ``Links``: α, β per (op, n), fitted on bench rows or given for a link;
    T = steps · α + wire · β with (steps, wire) = comm/schedule.py's
    ``steps_wire``, the Ring's own rule. ``Nodes``: the ranks span several
    nodes of the same size joined by a network; a collective over them runs
    the node-aware schedule, its passes inside a node on ``Links`` and its
    passes across on the network's α and bandwidth (per node, shared by the
    node's ranks).

What it is not
    The step (simulate.py puts the step's operations in order) or a measurement.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ringzero.comm.schedule import OPS, TREE_BYTES, internode_bytes, steps_wire  # the Ring's own rule (no MPI)

# Links given, not fitted (α in s, bandwidth in bytes/s per rank on the wire).
LINKS = {
    "nvlink": (10e-6, 150e9),   # NVLink/NVSwitch class (DGX-2 V100: ~150 GB/s per GPU)
    "ib": (5e-6, 12.5e9),       # InfiniBand EDR, 100 Gb/s per rank
    "ib-hdr": (5e-6, 25e9),     # InfiniBand HDR, 200 Gb/s per rank
}


# ---- links -----------------------------------------------------------------------
@dataclass
class Links:
    """α, β per (op, n); ``fixed`` serves every (op, n) with one (α, β)."""
    fits: dict = field(default_factory=dict)    # (op, n) -> (alpha, beta)
    fixed: tuple | None = None
    source: str = ""

    @classmethod
    def given(cls, alpha: float, bandwidth: float, name: str = "given"):
        return cls(fixed=(float(alpha), 1.0 / float(bandwidth)), source=name)

    @classmethod
    def from_rows(cls, rows, impl: str = "ring", tree_bytes: int = TREE_BYTES):
        """One robust fit (ringzero.fit's least |log error|) per (op, n) on bench rows."""
        from ringzero.tools import fit
        fits = {}
        for op in OPS:
            for n in sorted({int(r["n"]) for r in rows}):
                sel = [r for r in fit.select(rows, op, impl) if int(r["n"]) == n]
                if len(sel) < 2:
                    continue
                X = np.array([steps_wire(op, n, float(r["bytes"]), **{"tree_bytes": tree_bytes, **r.get("knobs", {})})
                              for r in sel], np.float64)  # the thresholds the bench ran with (its meta)
                t = np.array([float(r["time_us"]) * 1e-6 for r in sel])
                a, b = fit._l1log(X, t)
                fits[(op, n)] = (float(a), float(b))
        if not fits:
            raise ValueError(f"no bench rows of impl {impl!r} with n >= 2 and >= 2 sizes per op")
        return cls(fits=fits, source=f"fitted per (op, n) on {len(rows)} bench rows")

    def ab(self, op: str, n: int) -> tuple:
        if self.fixed is not None:
            return self.fixed
        if (op, n) in self.fits:
            return self.fits[(op, n)]
        have = sorted(k for k in self.fits if k[0] == op) or sorted(self.fits)
        k = min(have, key=lambda k: (abs(math.log(k[1] / n)), k[1]))   # nearest n measured
        return self.fits[k]

    def time(self, op: str, n: int, S: float) -> float:
        st, w = steps_wire(op, n, S)
        a, b = self.ab(op, n)
        return st * a + w * b


@dataclass
class Nodes:
    """The ranks span ``count`` nodes of the same size joined by a network: α per round across, and
    ``bandwidth`` bytes/s leaving one node, shared by the P ranks that send across at once.

    A collective over n = N·P ranks (P > 1) runs the node-aware schedule: its rounds and bytes are
    ``steps_wire(op, n, S, nodes=N)``, of which ``internode_bytes`` leave the node; the passes
    inside the node take the intra-node Links of (op, P), the passes across the network:

        T = (rounds - rounds_across)·α(op, P) + (wire - net)·β(op, P) + rounds_across·α_net + net·P/bandwidth

    P = 1 (one rank per node): the flat schedule, every byte across. A collective among one rank
    per node (hybrid's all-reduce of the shard) sends all its bytes across, P such rings at once.
    """
    count: int
    alpha: float
    bandwidth: float

    def time(self, op: str, n: int, S: float, intra: Links) -> float:
        """Seconds of one collective on S bytes over n ranks that span the nodes."""
        N, P = self.count, n // self.count
        if P == 1:
            return self.across(op, n, S)
        rounds, wire = steps_wire(op, n, S, nodes=N)
        net = internode_bytes(op, n, S, N)
        far = sum(steps_wire(sub, N, S / P)[0] for sub in (("reduce_scatter", "all_gather")
                                                             if op == "all_reduce" else (op,)))
        a, b = intra.ab(op, P)
        return (rounds - far) * a + (wire - net) * b + far * self.alpha + net * P / self.bandwidth

    def across(self, op: str, n: int, S: float, streams: int = 1) -> float:
        """A flat collective among n ranks on n different nodes, ``streams`` of them per link."""
        rounds, wire = steps_wire(op, n, S)
        return rounds * self.alpha + wire * streams / self.bandwidth
