"""The engine's construction, step by step: where its state lives, ZeRO++'s buffers, its schedule.

What it is
    The parts of ``Zero.__init__`` (engine.py) that allocate or decide, each a
    function of the half-built engine, called in this order:

        make_state        the five state buffers in RAM, in files or in host memory (offload), the
                          offloaded update's stream and tiles, the update-ahead or delayed-update thread
        make_zeropp       ZeRO++'s collectives, hpZ's secondary shard and qgZ's residuals, once
        make_schedule     overlap, prefetch and reduce buckets (schedule_options), the plan, the workspaces
        make_norm_buffers the step's gradient-norm scratch and its all-gathered scalars

What it is not
    Not the step (engine.py, passes.py, update.py) and not the pieces it
    builds (state.py, offload.py, stream.py, zeropp.py, plan.py,
    workspace.py): only the order and arguments they are made with.
"""
from __future__ import annotations

import numpy as np

from ringzero.runtime import stream
from ringzero.runtime.delay import DelayedUpdate
from ringzero.runtime.host_tier import DeviceLink, PinnedArena
from ringzero.runtime.limits import alloc_guard
from ringzero.runtime.offload import OffloadError, check_offload
from ringzero.runtime.plan import build_plan
from ringzero.runtime.state import ShardedState, aligned_empty
from ringzero.runtime.workspace import Workspaces
from ringzero.runtime.zeropp import ZeroPP


def make_state(self, device):
    """The state buffers, in RAM or (offload) file-backed, and the offloaded update's stream and tiles.
    A bad DIR, a small disk, or a file whose blocks cannot be reserved on any rank: one error on all."""
    L, P, topo, xp, off, U = self.layout, self.policy, self.topology, self.xp, self.offload, len(self.layout.units)
    if off.enabled:                  # a bad DIR or a small disk: refused before any file is made
        check_offload(self, off, device)
    err = None
    # a device run's offload: host arrays (and the update's pinned tile buffers), pinned up to the bound
    self.pinned = PinnedArena(off.pin_limit) if off.enabled and xp is not np else None
    self.device_link = (DeviceLink(self.storage_dtype, DeviceLink.slot_elements(off.tile, max(L.piece_numel)),
                                   off.buffers, self.pinned)
                        if self.pinned is not None else None)        # its tile buffers pinned first
    try:                             # offload: a file whose blocks cannot be reserved, on any rank
        self.state = ShardedState(L, P, topo.shard_rank, self.storage_dtype, xp, self.grad_accum,
                                  off if off.enabled else None, self.pinned)
    except OffloadError as e:
        err = str(e)
    if off.enabled:
        stream.agree(self, err, "making the offload files")
    self._decay = {(u, r): self.state.decay_runs(u, r) for u in range(U) for r in range(L.shards)}
    # offload: the update streams this rank's pieces through a few tile buffers (stream.py)
    self.offload_stream = stream.TileStream(self.state, off) if off.enabled else None
    self.offload_tiles = stream.tiles(self.state, self._decay, off.tile) if off.enabled else []
    # in RAM: each piece one tile, its decay runs cut for the fused update (update._in_ram)
    self.ram_tiles = [] if off.enabled else stream.tiles(self.state, self._decay, max(L.piece_numel))
    if self.device_link is not None:
        self.device_link.bind(self.state)
    self.update_ahead = stream.UpdateAhead(U) if off.enabled and off.ahead else None
    # DPU: step t's update beside step t+1 after off.delay exact steps; its buffer made once (delay.py)
    self.delayed = DelayedUpdate(self, off.delay) if off.enabled and off.delay is not None else None
    self.last_step_io = {}               # {class: (bytes read, bytes written)} of the offload files, last step
    self.last_update_io = {}             # the same, of the last offloaded update alone (stream.update)


def make_zeropp(self):
    """ZeRO++'s collectives, hpZ's secondary shard, qgZ's residuals (topology.zeropp): allocated once."""
    if self.zeropp.enabled:
        with alloc_guard("ZeRO++'s secondary shard and residuals"):
            self.topology.zeropp = ZeroPP(self.zeropp, self.layout, self.topology, self.xp, self.storage_dtype)


def make_schedule(self, model, overlap, prefetch, reduce_bucket):
    """self.overlap, .prefetch, .reduce_bucket, .plan and .workspaces (None arguments: the defaults)."""
    L, P, topo, U = self.layout, self.policy, self.topology, len(self.layout.units)
    # overlap: a closed gradient's reduction runs while the next unit's backward computes
    # (workspace.py); where it reads the gradient slot itself (fp32 storage, sharded grads)
    # the plan holds that slot one position longer. None: on when the ranks span several
    # nodes, where communication is a third of the step; on one host it is a few percent and
    # the progress thread costs the compute more than it hides (docs/overlap.md)
    # (--zeropp on a device: off, its quantized collectives have no nonblocking form on CuPy)
    zpp_blocks = self.zeropp.enabled and self.xp is not np
    self.overlap = topo.nodes.count > 1 and not zpp_blocks if overlap is None else bool(overlap)
    self.prefetch, self.reduce_bucket = schedule_options(P, self.overlap, prefetch, reduce_bucket,
                                                         self.ring.tree_bytes)
    reads_slot = np.dtype(self.storage_dtype).itemsize == 4 and P.grad_bucket
    self.plan = build_plan([L.needs(u) for u in range(U)],
                           [bool(model.backward_reads_params(u)) for u in range(U)],
                           inflight=1 if self.overlap and reads_slot else 0, prefetch=self.prefetch,
                           land_in_slot=self.compute_dtype == self.storage_dtype)
    with alloc_guard("the workspaces (unit-sized slots)"):
        self.workspaces = Workspaces(L, P, self.plan, self.state, topo, self.compute_dtype, self.grad_accum,
                                     overlap=self.overlap, reduce_bucket=self.reduce_bucket)


def make_norm_buffers(self):
    """The step's gradient-norm scratch, its per-piece dots and its [loss, sumsq, stop] scalars."""
    L, xp, U = self.layout, self.xp, len(self.layout.units)
    self._grad_scratch = aligned_empty(xp, max(L.piece_numel), np.float32)  # one unscaled grad piece
    # squared norm of each gradient piece this rank holds: (pieces, units) fp32
    self._dots = xp.zeros((len(self.state.held_ranks("master")), U), np.float32)
    # [loss, sumsq, stop] of this rank; stop rides along so that a request
    # one rank raised (the trainer's preemption signal) reaches every rank
    # at the same step, with no collective of its own
    self.stop_request = 0
    self._scalars = np.zeros(3, np.float64)
    self._all_scalars = np.zeros((self.topology.world_size, 3), np.float64)


def schedule_options(P, overlap: bool, prefetch, reduce_bucket, tree_bytes: int):
    """(prefetch, reduce_bucket) of this stage and overlap, from the arguments (None: the defaults)."""
    # prefetch (stage 3, hybrid, with overlap): a unit's gather starts this many positions before
    # it is read (FSDP's forward and backward prefetch; 1 by default, as FSDP's)
    if prefetch is not None and (isinstance(prefetch, bool) or int(prefetch) != prefetch or prefetch < 0):
        raise ValueError(f"prefetch must be an int >= 0, got {prefetch!r}")
    if prefetch and not overlap:
        raise ValueError(f"prefetch {prefetch} needs overlap (a gather runs beside compute only then); "
                         "drop --no-overlap or use --prefetch 0")
    prefetch = (1 if prefetch is None else int(prefetch)) if overlap and P.gather_params else 0
    # buckets (stages 0-2): consecutive units' gradients reduced by one call (plan.reduce_buckets).
    # None: without overlap, up to the ring's tree_bytes (16 MiB), where the Ring sums a bucket in
    # the order it sums each unit, so the stages stay bitwise equal; one call, and one wait for the
    # slowest rank, per bucket instead of per unit (on one host that measured neutral: docs/runtime.md).
    # With overlap, each unit alone, started as its backward ends (as FSDP's are)
    if reduce_bucket is not None and (isinstance(reduce_bucket, bool) or int(reduce_bucket) != reduce_bucket
                                      or reduce_bucket < 0):
        raise ValueError(f"reduce_bucket must be an int >= 0 (bytes), got {reduce_bucket!r}")
    if reduce_bucket and P.gather_params:
        raise ValueError(f"reduce_bucket applies to stages 0-2; stage {P.stage} reduces each unit's "
                         "gradient as its backward ends (FSDP's order): drop the bucket size")
    if reduce_bucket is None:
        reduce_bucket = 0 if overlap or P.gather_params else tree_bytes
    return prefetch, int(reduce_bucket)
