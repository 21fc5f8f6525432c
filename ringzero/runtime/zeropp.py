"""ZeRO++ in the engine: the policy record (qwZ, hpZ, qgZ) and the collectives it swaps in at stage 3.

What it is
    ``ZeroPPPolicy`` (frozen, as OffloadPolicy is) names the switches:

        ZeroPPPolicy(qwz=True, hpz=True, qgz=True, block=2048, grad_bits=4, error_feedback=False, grad_block=256)
        ZeroPPPolicy.parse("qwz,hpz,qgz", block=2048, grad_bits=4)     # the trainer's --zeropp

      qwz   every all-gather of a unit's params (forward, and backward without hpz) moves int8
            codes + one fp32 scale per ``block`` (comm/quantized.py ``all_gather``). Every rank
            then computes with dequant(quant(shard)) of every shard, its own included.
      hpz   a secondary copy of the params, sharded INSIDE the node: each rank keeps 1/P of every
            unit (P ranks per node; 2Ψ/P bytes at 2-byte storage, one buffer allocated here from
            the layout table). It is cut from the first gather of a unit after each update (the
            forward's), so it holds exactly the bits that gather produced; every later gather of
            that unit until the next update (the backward's, a later micro-batch's forward) is an
            all-gather over the node's ranks only (a plain Ring: full precision, never leaves the
            node). ``invalidate()`` (the engine's publish_params, after every update) drops it.
      qgz   each unit's gradient reduce-scatter goes through the two-hop all-to-all of
            comm/quantized.py: int4 (``grad_bits``) codes between ranks, one fp32 scale per
            ``grad_block`` (256: int4 absmax blocks of 2048 send half a gradient's elements as zero,
            and held-out loss ends 4-6 % above the unquantized run's at 4 x 256; at 256, 0.17-0.32 %:
            docs/quantized.md), float32 sums at each hop;
            ``error_feedback``: one float32 residual per unit (the whole padded unit, 4 bytes per
            element, allocated once) carried from step to step; cleared by a step the fp16 loss
            scaler skips, rescaled when the scale changes (``after_step``); a checkpoint saves
            each rank's (runtime/zeropp_state.py).

    ``ZeroPP(policy, layout, topology, xp, storage_dtype)`` holds the collectives and the
    buffers; runtime/gather.py and reduce.py call ``gather`` and ``reduce_scatter`` (or their
    ``_start`` forms, then ``gathered`` once a gather is done) where they would call the shard
    Ring's. ``ledgers()`` yields (label, ledger) for reports.ledger_totals:
    the QuantizedComm's (codes and scales apart, inside and across nodes) and hpZ's node ring.

    Where it is valid (``check``): stage 3 and hybrid (hybrid: qwz and qgz, whose shard group is
    already a node, so hpz is refused); with overlap and prefetch on the host (``gather_start``
    and ``reduce_scatter_start``: QuantizedComm's nonblocking forms on the shard Ring's progress
    thread, hpZ's node gathers on the node Ring's; overlap is on by default across nodes, as
    without --zeropp), without them on a device (the nonblocking forms keep no stream order: on
    CuPy --overlap and --prefetch are refused and overlap defaults off); with --offload except
    ``ahead`` when hpz is on (the update running beside the forward would publish units under a
    live secondary); on a device (CuPy: the collectives' CUDA kernels).

    Arithmetic: the master, Adam and the checkpoint stay full precision; only what travels is
    quantized. qwz+hpz is bitwise qwz alone (the backward gets the forward's bits), hpz alone is
    bitwise the unquantized run (tests/test_zeropp.py checks both, and the quantized runs against
    a NumPy reference of the same codes, scales and sums).

What it is not
    The collectives' arithmetic (comm/quant.py, comm/quantized.py) or the byte formulas
    (comm/qledger.zeropp_volume; runtime/reports.zeropp_report prints them beside the ledger).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ringzero.comm.quant import Quant

SWITCHES = ("qwz", "hpz", "qgz")


class ZeroPPError(ValueError):
    """A ZeRO++ setting the engine does not run (one line; the trainer exits 2)."""


@dataclass(frozen=True)
class ZeroPPPolicy:
    """Which of ZeRO++'s switches are on, and their quantization (module docstring)."""
    qwz: bool = False            # params' all-gathers in int8 codes + fp32 block scales
    hpz: bool = False            # secondary params shard inside the node: the backward's gathers stay there
    qgz: bool = False            # gradients' reduce-scatter through the two-hop quantized all-to-all
    block: int = 2048            # elements per fp32 scale of qwZ's int8 weights (DeepSpeed's: 4k-8k)
    grad_bits: int = 4           # qgZ's codes: 4 (ZeRO++'s default) or 8
    error_feedback: bool = False  # qgZ: carry each rank's quantization residual into the next step
    grad_block: int = 256        # elements per fp32 scale of qgZ's codes (DeepSpeed's: a weight's smaller dimension)

    def __post_init__(self):
        for flag, v, hint in (("block", self.block, 2048), ("grad-block", self.grad_block, 256)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ZeroPPError(f"--zeropp-{flag}: expected an int >= 1, got {v!r}; HINT: the default is {hint}")
        if self.grad_bits not in (4, 8):
            raise ZeroPPError(f"--zeropp-bits: expected 4 or 8, got {self.grad_bits!r}")
        if self.error_feedback and not self.qgz:
            raise ZeroPPError("--zeropp-error-feedback applies to qgz: expected --zeropp with qgz, got "
                             f"{self.describe() or 'no --zeropp'}")

    @classmethod
    def parse(cls, spec: str, **kw) -> "ZeroPPPolicy":
        """'qwz,hpz,qgz' (any subset, comma-separated; '' or 'none': all off)."""
        words = [w.strip().lower() for w in (spec or "").split(",") if w.strip()]
        if words == ["none"]:
            words = []
        bad = [w for w in words if w not in SWITCHES]
        if bad:
            raise ZeroPPError(f"--zeropp: expected a comma-separated subset of {','.join(SWITCHES)}, got {bad[0]!r}")
        return cls(**{w: True for w in words}, **kw)

    @property
    def enabled(self) -> bool:
        return self.qwz or self.hpz or self.qgz

    @property
    def weights(self) -> Quant:
        return Quant(8, int(self.block))

    @property
    def grads(self) -> Quant:
        return Quant(int(self.grad_bits), int(self.grad_block))

    def describe(self) -> str:
        on = [s for s in SWITCHES if getattr(self, s)]
        if not on:
            return ""
        out = ",".join(on) + f" (block {self.block}"
        if self.qgz:
            out += f", grads int{self.grad_bits} in blocks of {self.grad_block}" + (
                ", error feedback" if self.error_feedback else "")
        return out + ")"


def check(zpp: ZeroPPPolicy, stage_policy, offload=None, overlap=None, prefetch=None, host: bool = True) -> None:
    """Refuse a combination the engine does not run, in one line (ValueError). host: NumPy buffers."""
    if not zpp.enabled:
        return
    if not stage_policy.gather_params:
        raise ZeroPPError(f"--zeropp {zpp.describe()} needs params gathered unit by unit: expected --stage 3 or "
                         f"hybrid, got stage {stage_policy.stage}")
    if zpp.hpz and stage_policy.hybrid:
        raise ZeroPPError("--zeropp hpz: hybrid's shard group is already one node, so its gathers never leave it: "
                         "expected --stage 3 with hpz, got hybrid; HINT: drop hpz (qwz, qgz run at hybrid)")
    if overlap and not host:
        raise ZeroPPError("--zeropp on a device runs without overlap (its quantized collectives have no "
                         "nonblocking form on CuPy): expected no --overlap, got --overlap; HINT: drop --overlap "
                         "(--zeropp turns it off on a device)")
    if prefetch and not host:
        raise ZeroPPError(f"--zeropp on a device gathers each unit where it is read (no overlap): expected no "
                         f"--prefetch, got --prefetch {prefetch}; HINT: drop --prefetch")
    if zpp.hpz and offload is not None and getattr(offload, "ahead", False):
        raise ZeroPPError("--zeropp hpz with --offload-ahead: the update beside the forward would change units "
                         "under the secondary shard; HINT: drop --offload-ahead or hpz")


class ZeroPP:
    """The collectives and buffers of a ZeroPPPolicy on one engine (module docstring)."""

    def __init__(self, policy: ZeroPPPolicy, layout, topology, xp, storage_dtype):
        from ringzero.comm.quantized import QuantizedComm
        from ringzero.comm.ring import Ring
        self.policy, self.layout, self.topology, self.xp = policy, layout, topology, xp
        ring = topology.ring
        self.qc = QuantizedComm(ring, policy.weights, policy.grads) if policy.qwz or policy.qgz else None
        self.node_ring, self.secondary, self.sec_offset = None, None, []
        self.P = 1
        if policy.hpz:
            nm = ring.nodes
            if nm.ppn is None:
                raise ZeroPPError(f"--zeropp hpz needs the same number of ranks on every node: got {nm.describe()}")
            self.P = P = nm.ppn
            me = ring.rank
            # the node's ranks, ordered as the shard ring orders them: node-ring rank == local index
            node_comm = ring.comm.Split(nm.node_of[me], me)
            self.node_ring = Ring(node_comm, timeout=ring.limits.timeout, nodes=[0] * P)
            self.node_ring.trace_name = "hpz"        # the trace's "ring" arg (the ledger's label too)
            node_comm.Free()
            self.local = nm.local_of[me]
            # unit u's secondary piece: elements [local*c, (local+1)*c) of the padded unit, c = unit_padded/P
            off = 0
            for u in range(len(layout.units)):
                self.sec_offset.append(off)
                off += layout.unit_padded[u] // P
            self.secondary = xp.empty(max(off, 1), storage_dtype)    # 2Ψ/P bytes at 2-byte storage, once
        self.fresh = [False] * len(layout.units)   # unit u's secondary holds the params since the last update
        self.residual = None
        if policy.qgz and policy.error_feedback:
            self.residual = xp.zeros(max(layout.padded, 1), np.float32)   # one fp32 residual per element

    # ---- the engine's calls -------------------------------------------------
    def gather(self, w, own, seg):
        """seg (unit w's padded params) = every rank's ``own`` piece: from the secondary shard inside the
        node (hpz, after the first gather since the update), quantized (qwz), or plain."""
        if self.policy.hpz and self.fresh[w]:
            self.node_ring.all_gather(self._sec(w), seg)
        elif self.policy.qwz:
            self.qc.all_gather(own, seg)
        else:
            self.topology.ring.all_gather(own, seg)
        return self.gathered(w, seg)

    def gather_start(self, w, own, seg):
        """``gather`` started (overlap's prefetch): its Pending; ``gathered(w, seg)`` once it is waited for.
        The path is chosen now: hpZ's secondary is fresh from the forward's gather by the time the
        backward's gather of a unit starts (prefetch starts it at a later position of the plan)."""
        if self.policy.hpz and self.fresh[w]:
            return self.node_ring.all_gather_start(self._sec(w), seg)
        if self.policy.qwz:
            return self.qc.all_gather_start(own, seg)
        return self.topology.ring.all_gather_start(own, seg)

    def gathered(self, w, seg):
        """Unit w's gather into seg is done: hpZ keeps this rank's node piece of the first one since the
        update (the secondary shard: the exact bits this gather produced)."""
        if self.policy.hpz and not self.fresh[w]:
            c = self.layout.unit_padded[w] // self.P
            self._sec(w)[...] = seg[self.local * c:(self.local + 1) * c]
            self.fresh[w] = True
        return seg

    def reduce_scatter(self, w, seg, out):
        """out = this rank's piece of the sum over ranks of unit w's gradient ``seg`` (qgz or plain)."""
        if not self.policy.qgz:
            return self.topology.ring.reduce_scatter(seg, out)
        return self.qc.reduce_scatter(seg, out, "sum", residual=self._residual(w))

    def reduce_scatter_start(self, w, seg, out):
        """``reduce_scatter`` started (overlap): its Pending. The call owns unit w's residual until then."""
        if not self.policy.qgz:
            return self.topology.ring.reduce_scatter_start(seg, out)
        return self.qc.reduce_scatter_start(seg, out, "sum", residual=self._residual(w))

    def trace_on(self):
        """--trace was enabled after these were built: wrap their runs now (comm/trace.py: traced_run)."""
        from ringzero.comm.trace import RECORDER
        if self.node_ring is not None:
            self.node_ring._run = RECORDER.traced_run(self.node_ring.executor.run, self.node_ring)
        if self.qc is not None:
            self.qc.trace_on()

    def owner(self, x):
        """The started call on hpZ's node ring that writing x would race (the shard Ring's are its own)."""
        return self.node_ring.owner(x) if self.node_ring is not None else None

    def _residual(self, w):
        if self.residual is None:
            return None
        o = self.layout.unit_offset[w]
        return self.residual[o:o + self.layout.unit_padded[w]]

    def after_step(self, skipped: bool, old_scale: float, new_scale: float):
        """qgZ's residual across the loss scaler's decision (error feedback at fp16). It holds errors of
        loss-scaled gradients: an overflowed step leaves inf/NaN in it (and its gradient is thrown
        away), so it is cleared, else every later step would overflow too; a scale change (a power
        of 2: exact) rescales it into the next step's units."""
        if self.residual is None:
            return
        if skipped:
            self.residual[...] = 0
        elif new_scale != old_scale:
            self.residual *= np.float32(new_scale / old_scale)

    def invalidate(self):
        """The params changed (an update, a restore): the next gather of every unit is a full one."""
        self.fresh = [False] * len(self.fresh)

    # ---- accounting -------------------------------------------------------
    def ledgers(self):
        """(label, ledger) of the collectives this object sends on."""
        if self.qc is not None:
            yield "shard", self.qc.ledger
        if self.node_ring is not None:
            yield "hpz", self.node_ring.ledger

    def nbytes(self) -> dict:
        """Bytes this rank holds for ZeRO++: hpZ's secondary shard, qgZ's residuals."""
        return {"hpz_secondary": int(self.secondary.nbytes) if self.secondary is not None else 0,
                "qgz_residual": int(self.residual.nbytes) if self.residual is not None else 0}

    def _sec(self, w):
        o = self.sec_offset[w]
        return self.secondary[o:o + self.layout.unit_padded[w] // self.P]
