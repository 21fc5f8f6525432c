"""The unit-sized workspaces a step plan's slots name: every one allocated once, and the views into them.

What it is
    ``Slots(layout, policy, plan, state, compute_dtype, table, overlap, grad_accum)``
    allocates, at start-up, the buffers the step loop works in, by name, each
    a list of buffers (``bufs``; the start report lists them in this order):

        param_compute  compute-dtype params of a materialized unit   (when compute != storage dtype)
        grad_compute   fp32 gradient of an open unit                 (when storage is fp16/bf16)
        gather         storage-dtype landing of an all-gather        (params sharded: stage 3, hybrid;
                       the param slots themselves when nothing is cast)
        reduce_bucket  storage-dtype gradients of a bucket of units,  (stages 0-2, buckets of more
                       reduced by one call (buckets.py)               than one unit)
        grad_bucket    storage-dtype gradient of one unit, reduce-scattered into the
                       grads shard                                    (grads sharded: 2, 3, hybrid)
        accum_widen    one reduce-scattered piece widened to fp32      (stage 3 / hybrid, K > 1,
                       before it is added into the accumulator         2-byte storage)

    and, per position of the step, the named views the model reads (params,
    ``param_views``, ``forward_views``) and adds into (grads,
    ``grad_views``): a dict {name: array} per position, made once from the
    plan's tables. Where no workspace is needed (stages 0-2 without a cast)
    the views point into the state buffers themselves (``param_source``,
    ``grad_target`` say where).

    Two overlap (``overlap=True``) counts live here: 2-byte storage casts into
    one of two ``grad_bucket`` buffers in turn, and buckets fill one of two
    ``reduce_bucket`` buffers in turn, so that the cast of the next gradient
    never writes what a started reduction still reads. (fp32 storage with
    sharded grads reduces from the gradient slot itself; the plan holds that
    slot longer instead: plan.py's ``inflight``.)

What it is not
    It moves nothing and starts no collective: gather.py (gather + cast),
    reduce.py (cast + reduce) and buckets.py do, and inflight.py keeps what
    the started ones hold. When each slot is used is plan.py's.
"""
from __future__ import annotations

import numpy as np


class Slots:
    """The workspaces by name, each a list of unit-sized buffers, and the per-position views."""

    def __init__(self, layout, policy, plan, state, compute_dtype, table, *, overlap: bool = False,
                 grad_accum: int = 1):
        self.layout, self.policy, self.state = layout, policy, state
        xp, cap, storage = state.xp, layout.max_unit_padded, state.params.dtype
        # params are cast when the compute dtype differs from storage (CPU: fp32
        # compute over fp16/bf16 storage); gradients accumulate in fp32 whenever
        # storage is narrower (on GPU too, where compute is fp16: a unit's
        # gradient sums many terms, and fp16 would round after each)
        self.param_cast = compute_dtype != storage
        self.grad_cast = np.dtype(storage).itemsize < 4
        n_param = max(plan.param_slots, plan.forward_slots)
        self.bufs = {}
        if self.param_cast:
            self.bufs["param_compute"] = [xp.empty(cap, compute_dtype) for _ in range(n_param)]
        if self.grad_cast:
            self.bufs["grad_compute"] = [xp.empty(cap, np.float32) for _ in range(plan.grad_slots)]
        if policy.gather_params:
            # with a cast, the plan's landings (one, unless gathers are prefetched: cast right after
            # the gather); without, a gather lands in the param slot itself
            n_land = max(plan.land_slots, plan.forward_land_slots) if self.param_cast else n_param
            self.bufs["gather"] = [xp.empty(cap, storage) for _ in range(n_land)]
        if table.buckets:
            # every bucket's (shards, block) blocks fit the largest; overlap: two, filled in turn
            n = table.numel(layout.shards)
            self.bufs["reduce_bucket"] = [xp.empty(n, storage) for _ in range(2 if overlap else 1)]
        # a unit's own bucket: where 2-byte storage casts a unit reduced alone (none when every unit
        # is in a bucket of several), or where fp32 storage accumulates each open gradient
        alone = len(table.group) < len(layout.units)
        if policy.grad_bucket and (alone or not self.grad_cast):
            n_bucket = (2 if overlap else 1) if self.grad_cast else plan.grad_slots
            self.bufs["grad_bucket"] = [xp.empty(cap, storage) for _ in range(n_bucket)]
        if int(grad_accum) > 1 and not policy.accumulate_locally and np.dtype(storage).itemsize < 4:
            self.bufs["accum_widen"] = [xp.empty(max(layout.piece_numel), np.float32)]

        def views(table, where):
            out = []
            for pairs in table:
                d = {}
                for w, s in pairs:
                    d.update(layout.views(where(w, s), w))
                out.append(d)
            return out
        self.param_views = views(plan.param_reads, self.param_source)      # per position
        self.forward_views = views(plan.forward_reads, self.param_source)  # per forward position
        self.grad_views = views(plan.grad_writes, self.grad_target)        # per position (backward)

    def nbytes(self) -> dict:
        """{workspace: bytes} (not model state)."""
        return {k: sum(int(b.nbytes) for b in v) for k, v in self.bufs.items()}

    def param_source(self, w, slot):
        """Where unit w's compute-dtype params are read from when in ``slot``."""
        if self.param_cast:
            return self.bufs["param_compute"][slot]
        if self.policy.gather_params:
            return self.bufs["gather"][slot]
        return self.layout.unit_full(self.state.params, w)   # stages 0-2, no cast: the buffer itself

    def grad_target(self, w, slot):
        """Where the model accumulates unit w's gradient (fp32, or the storage dtype
        when that is fp32 already) in ``slot``."""
        if self.grad_cast:
            return self.bufs["grad_compute"][slot]
        if self.policy.full_grads:
            return self.layout.unit_full(self.state.grads, w)
        return self.bufs["grad_bucket"][slot]

    def landing(self, w, slot, land):
        """(where unit w's gather lands, this rank's own block of it)."""
        land = land if self.param_cast else slot       # no cast: the gather lands in the param slot
        seg = self.bufs["gather"][land][:self.layout.unit_padded[w]]
        return seg, self.layout.own(seg, w, self.state.shard_rank)
