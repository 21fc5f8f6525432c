"""What a rank will hold, by tier, before anything is allocated; and which run would fit the room there is.

What it is
    ``state_by_tier(stage, psi, nd, ..., offload)``: accounting.py's bytes per state class, each placed on
    a tier: ``ram`` (host memory), ``disk`` (an offloaded class lives in files under --offload-dir,
    streamed through a few host buffers) or, on a GPU run, ``device`` (what is not offloaded; the
    offloaded classes are then on ``ram``, host_tier.py, or ``disk``). ``offload`` is a plain set of
    tier names:

        optimizer   master, Adam m and v (12Ψ per parameter at stage 0, 12Ψ/Nd from stage 1)
        params      the storage-dtype param shard, at stage 3 and hybrid (2Ψ/Nd)

    ``workspace_bytes(layout, policy, ...)``: the bytes ``Workspaces`` and the optimizer's scratch will
    allocate for this layout and stage, from the same plan the engine builds (plan.py, pure), without
    allocating them (tests/test_budget.py checks it equals the engine's measured figure).

    ``Need`` is one rank's sum (model state in RAM + workspace + activations; the activation
    estimate is the model's: tools/activations.py for a GPT). ``first_fit`` walks the runs a user could
    switch to, in order of what they cost (a sharding stage, then activation checkpointing, then
    stage 3, then offload, then more nodes), and returns the first whose need fits; app/memcheck.py
    words the refusal.

What it is not
    No reading of limits (limits.py), no MPI, no model: the caller passes a ``need(run)`` function.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ringzero.runtime import accounting as acc

# offload tier name -> the accounting classes it moves to disk
OFFLOAD_CLASSES = {"optimizer": acc.OPTIMIZER_CLASSES, "params": ("params_fp16",)}


def parse_offload(value) -> frozenset:
    """'optimizer', 'optimizer,params', ('optimizer',), '' or None -> a frozenset of OFFLOAD_CLASSES' keys."""
    if not value:
        return frozenset()
    items = value.split(",") if isinstance(value, str) else list(value)
    out = frozenset(x.strip() for x in items if x.strip())
    bad = sorted(out - set(OFFLOAD_CLASSES))
    if bad:
        raise ValueError(f"offload must name some of {', '.join(OFFLOAD_CLASSES)}, got {bad}")
    return out


def offloaded(stage, offload) -> frozenset:
    """The accounting classes ``offload`` moves off RAM at ``stage`` (params only where they are sharded)."""
    st, off = acc.parse_stage(stage), parse_offload(offload)
    out = set()
    for tier in off:
        if tier == "params" and "params_fp16" not in acc.sharded_classes(st):
            continue                       # stages 0-2 hold params in full for compute: nothing to move
        out.update(OFFLOAD_CLASSES[tier])
    return frozenset(out)


def state_by_tier(stage, psi: int, nd: int, ranks_per_node=None, precision: str = "fp16",
                  grad_accum: int = 1, offload=(), device: str = "cpu", offload_to: str = "disk") -> dict:
    """{class: (bytes per rank, tier)}; the bytes are accounting's. On "cpu" a class is on "ram" or, offloaded,
    "disk". On a device ("cuda") it is on "device", or, offloaded, on ``offload_to``: "ram" (host memory,
    host_tier.py) or "disk" (--offload-dir)."""
    by = acc.model_state_bytes(stage, psi, nd, ranks_per_node, precision, grad_accum)
    moved = offloaded(stage, offload)
    home = "ram" if device == "cpu" else "device"
    return {c: (b, (offload_to if device != "cpu" else "disk") if c in moved else home) for c, b in by.items()}


def tier_totals(by_tier: dict) -> dict:
    """{"ram": bytes, "disk": bytes} of a state_by_tier dict, and "device" on a device run."""
    out = {"ram": 0, "disk": 0}
    for b, tier in by_tier.values():
        out[tier] = out.get(tier, 0) + b
    return out


def offload_io_bytes(stage, psi: int, nd: int, ranks_per_node=None, precision: str = "fp16",
                     grad_accum: int = 1, offload=()) -> dict:
    """Bytes one rank reads from and writes to disk per optimizer step, with ``offload``.

    The update reads and writes every offloaded optimizer class once (12Ψ/Nd each way from stage 1,
    12Ψ at stage 0). Offloaded params (stage 3) are written once by the update (2Ψ/Nd in the storage
    dtype) and read once per gather of a unit: twice per micro-batch (forward, backward), K micro-batches.
    """
    by = state_by_tier(stage, psi, nd, ranks_per_node, precision, grad_accum, offload)
    opt = sum(b for c, (b, t) in by.items() if t == "disk" and c in acc.OPTIMIZER_CLASSES)
    par = by["params_fp16"][0] if by["params_fp16"][1] == "disk" else 0
    return {"read": opt + 2 * grad_accum * par, "written": opt + par,
            "optimizer": opt, "params_per_gather": par}


def workspace_bytes(layout, policy, storage_dtype, compute_dtype, grad_accum: int = 1, overlap: bool = False,
                    prefetch: int = 0, reduce_bucket: int = 0, backward_reads=None) -> int:
    """Bytes of the engine's workspaces plus the optimizer's scratch, as Zero allocates them for this layout.

    The same plan as the engine's (plan.build_plan, and plan.reduce_buckets at stages 0-2), and the same
    buffer choices as workspace.py's Workspaces; ``backward_reads[u]``: does unit u's backward read its
    params (default: all). Pass the engine's overlap, prefetch and reduce_bucket as it resolves them.
    """
    from ringzero.runtime.plan import build_plan, close_order, reduce_buckets
    L, U = layout, len(layout.units)
    sb, cb = np.dtype(storage_dtype).itemsize, np.dtype(compute_dtype).itemsize
    param_cast, grad_cast = np.dtype(compute_dtype) != np.dtype(storage_dtype), sb < 4
    reads = [True] * U if backward_reads is None else [bool(x) for x in backward_reads]
    plan = build_plan([L.needs(u) for u in range(U)], reads,
                      inflight=1 if overlap and sb == 4 and policy.grad_bucket else 0,
                      prefetch=prefetch if overlap and policy.gather_params else 0,
                      land_in_slot=not param_cast)
    cap, total = L.max_unit_padded, 0
    n_param = max(plan.param_slots, plan.forward_slots)
    if param_cast:
        total += n_param * cap * cb                                   # param_compute
    if grad_cast:
        total += plan.grad_slots * cap * 4                            # grad_compute (fp32)
    if policy.gather_params:                                          # gather landings
        total += (max(plan.land_slots, plan.forward_land_slots) if param_cast else n_param) * cap * sb
    groups = ()
    if reduce_bucket and not policy.gather_params and L.shards > 1:
        groups = tuple(g for g in reduce_buckets(close_order(plan), [n * sb for n in L.unit_padded], reduce_bucket)
                       if len(g) > 1)
    if groups:                                                        # reduce_bucket buffers
        total += max(sum(L.unit_padded[u] for u in g) for g in groups) * sb * (2 if overlap else 1)
    alone = sum(len(g) for g in groups) < U
    if policy.grad_bucket and (alone or not grad_cast):               # grad_bucket
        total += ((2 if overlap else 1) if grad_cast else plan.grad_slots) * cap * sb
    piece = max(L.piece_numel)
    if grad_accum > 1 and not policy.accumulate_locally and sb < 4:
        total += piece * 4                                            # accum_widen
    return total + 2 * piece * 4                                      # AdamW's scratch + the grad scratch


def comm_scratch_bytes(layout, policy, storage_dtype, reduce_bucket: int = 0) -> int:
    """The Ring's scratch (comm/cache.py, grow-only) after a step: about the largest buffer one collective
    reduces (a unit, or a reduction bucket at stages 0-2), plus 2 MiB for the small exchanges. An estimate
    (measured 18 MiB at stage 1 with 16 MiB buckets, 4.5 MiB at stage 3 with 6.3 MB units)."""
    sb = np.dtype(storage_dtype).itemsize
    big = layout.max_unit_padded * sb
    if reduce_bucket and not policy.gather_params and layout.shards > 1:
        big = max(big, min(reduce_bucket, layout.padded * sb))
    return big + (2 << 20)


@dataclass(frozen=True)
class Run:
    """The knobs of a run that change what a rank holds."""
    stage: str
    nd: int                      # ranks in all
    ppn: int                     # ranks per node (the ranks sharing one node's memory)
    checkpointing: bool = False
    offload: frozenset = frozenset()
    sample: bool = False         # the trainer's text sample at the end (a full fp32 gather of the params)

    def flags(self, base: "Run") -> str:
        """The command-line flags that turn ``base`` into this run."""
        out = []
        if self.stage != base.stage:
            out.append(f"--stage {self.stage}")
        if self.checkpointing and not base.checkpointing:
            out.append("--activation-checkpointing")
        if self.offload != base.offload:
            out.append("--offload " + ",".join(t for t in OFFLOAD_CLASSES if t in self.offload))
        if base.sample and not self.sample:
            out.append("--sample-chars 0")
        if self.nd != base.nd:
            out.append(f"on {self.nd // self.ppn} nodes of {self.ppn} ranks (Nd = {self.nd})")
        return " ".join(out)


@dataclass(frozen=True)
class Need:
    """One rank's bytes, by what holds them: the state always; then either the start-up's transient (the
    fp32 initial weights before they are copied into master) or the step's workspace and activations
    (and, at the end, a full fp32 gather of the params, for the trainer's text sample)."""
    model_state: int             # state classes in RAM (offloaded ones live on disk)
    workspace: int
    activations: int
    disk: int = 0                # offloaded state classes, per rank
    init: int = 0                # fp32 master-sized host buffer of init_master (4Ψ at stage 0, 4Ψ/Nd above)
    end: int = 0                 # after the last step, beside the workspaces (4Ψ: the sample's gather)
    shm: int = 0                 # of ``disk``, the bytes on a tmpfs/ramfs: the node's memory, not a disk's

    @property
    def total(self) -> int:
        """Rank 0's peak: the only rank the sample's gather lands on (``end``)."""
        return self.model_state + max(self.init, self.workspace + self.activations + self.end)

    @property
    def rest(self) -> int:
        """Any other rank's peak."""
        return self.model_state + max(self.init, self.workspace + self.activations)

    def at(self, rank: int) -> int:
        return self.total if rank == 0 else self.rest

    def node(self, ranks: int, with_rank0: bool = True) -> int:
        """The peak of a node's ``ranks`` ranks together (an upper bound: each rank's own peak), with the
        offloaded files of a memory-backed --offload-dir (page cache that cannot be dropped; not in a rank's
        RLIMIT_DATA, which counts its own mappings only)."""
        return ((self.total + (ranks - 1) * self.rest) if with_rank0 else ranks * self.rest) + ranks * self.shm


def fits(need: Need, run: Run, rank_room, node_room) -> bool:
    """A rank's need within its own room (RLIMIT_DATA) and the node's ranks' within the node's."""
    return ((rank_room is None or need.total <= rank_room)
            and (node_room is None or need.node(run.ppn) <= node_room))


def candidates(base: Run, offload_ok: bool, max_nodes: int = 1024):
    """The runs to try instead of ``base``, cheapest first (communication, then recompute, then disk I/O)."""
    later = [s for s in ("1", "2", "3") if s > base.stage] if base.stage != "hybrid" else []
    ck = [False, True] if not base.checkpointing else [True]
    out = [replace(base, stage=s) for s in later if s != "3"]
    out += [replace(base, stage=s, checkpointing=c) for c in ck[1:] for s in [base.stage] + later if s != "3"]
    top = "3" if base.stage != "hybrid" else "hybrid"
    out += [replace(base, stage=top, checkpointing=c) for c in ck]
    offs = [frozenset({"optimizer"}), frozenset({"optimizer", "params"})] if offload_ok else []
    out += [replace(base, stage=top, checkpointing=c, offload=o) for o in offs for c in ck if o > base.offload]
    nodes = max(1, base.nd // base.ppn)
    for n in sorted({2 ** k for k in range(max_nodes.bit_length())} | {nodes + 1}):
        if n > nodes:                                 # more nodes of the same size: stage 3, then with offload
            for o in [base.offload] + [x for x in offs if x > base.offload]:
                out += [replace(base, stage=top, nd=n * base.ppn, checkpointing=c, offload=o) for c in ck]
    if base.sample:                                   # each also without the sample's gather, right after it
        out = [replace(base, sample=False)] + [x for r in out for x in (r, replace(r, sample=False))]
    return [r for r in out if r != base]


def first_fit(need_of, base: Run, rank_room, node_room, offload_ok: bool = False):
    """(run, need) of the first candidate that fits, or None; ``need_of(run) -> Need``."""
    for run in candidates(base, offload_ok):
        try:
            n = need_of(run)
        except ValueError:            # a layout the candidate cannot have (hybrid's group, ...)
            continue
        if fits(n, run, rank_room, node_room):
            return run, n
    return None
