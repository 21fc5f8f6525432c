"""The unit-sized workspaces a plan's slots name, and the two moves made in them.

What it is
    ``Workspaces(layout, policy, plan, state, topology, compute_dtype)``
    allocates, once, the buffers the step loop works in:

        param_compute  compute-dtype params of a materialized unit   (when compute != storage dtype)
        grad_compute   compute-dtype gradient of an open unit        (when compute != storage dtype)
        gather         storage-dtype landing slot of an all-gather   (params sharded: stage 3, hybrid)
        grad_bucket    storage-dtype gradient of one unit, reduce-scattered into the
                       grads shard                                    (grads sharded: 2, 3, hybrid)

    and, per schedule position, the named views the model reads (params) and
    adds into (grads). Where no workspace is needed (stages 0-2 without a
    cast) the views point into the state buffers themselves.

        materialize(w, slot)   unit w's params -> a compute-dtype view: gather, then cast
        reduce_grad(w, slot)   unit w's finished gradient: cast, reduce-scatter into the
                               owner's piece (+ all-gather at stage 0, + all-reduce across
                               nodes for hybrid)

What it is not
    It decides nothing about *when*: plan.py does. No optimizer.
"""
from __future__ import annotations

from ringzero.runtime.state import cast_into


class Workspaces:
    """Slot buffers and per-position views for one engine."""

    def __init__(self, layout, policy, plan, state, topology, compute_dtype):
        self.layout, self.policy, self.state, self.topology = layout, policy, state, topology
        xp, cap, storage = state.xp, layout.max_unit_padded, state.params.dtype
        self.cast = compute_dtype != storage
        n_param = max(plan.param_slots, plan.forward_slots)
        self.bufs = {}
        if self.cast:
            self.bufs["param_compute"] = [xp.empty(cap, compute_dtype) for _ in range(n_param)]
            self.bufs["grad_compute"] = [xp.empty(cap, compute_dtype) for _ in range(plan.grad_slots)]
        if policy.gather_params:
            # with a cast, one storage-dtype landing slot suffices (cast right after the gather)
            self.bufs["gather"] = [xp.empty(cap, storage) for _ in range(1 if self.cast else n_param)]
        if policy.grad_bucket:
            self.bufs["grad_bucket"] = [xp.empty(cap, storage) for _ in range(1 if self.cast else plan.grad_slots)]

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
        if self.cast:
            return self.bufs["param_compute"][slot]
        if self.policy.gather_params:
            return self.bufs["gather"][slot]
        return self.layout.unit_full(self.state.params, w)   # stages 0-2, no cast: the buffer itself

    def grad_target(self, w, slot):
        """Where the model accumulates unit w's gradient (compute dtype) in ``slot``."""
        if self.cast:
            return self.bufs["grad_compute"][slot]
        if self.policy.full_grads:
            return self.layout.unit_full(self.state.grads, w)
        return self.bufs["grad_bucket"][slot]

    def zero_grad(self, w, slot):
        self.grad_target(w, slot)[:self.layout.unit_padded[w]].fill(0)

    def materialize(self, w, slot):
        """Make unit w's full params available in the compute dtype, in ``slot``."""
        L, state = self.layout, self.state
        if self.policy.gather_params:
            land = self.bufs["gather"][0 if self.cast else slot]
            seg = land[:L.unit_padded[w]]
            own = L.own(seg, w, state.shard_rank)
            own[...] = L.unit_shard(state.params, w)
            self.topology.ring.all_gather(own, seg)
            src = seg
        else:
            src = L.unit_full(state.params, w)
        if self.cast:
            cast_into(self.bufs["param_compute"][slot][:L.unit_padded[w]], src)

    def reduce_grad(self, w, slot):
        """Unit w's gradient is complete: cast to the storage dtype and reduce it."""
        L, state, topo = self.layout, self.state, self.topology
        n = L.unit_padded[w]
        if self.policy.full_grads:
            seg = L.unit_full(state.grads, w)
        else:
            seg = self.bufs["grad_bucket"][0 if self.cast else slot][:n]
        if self.cast:
            cast_into(seg, self.bufs["grad_compute"][slot][:n])
        if self.policy.full_grads:
            # stage 0's all-reduce is spelled out as the reduce-scatter and
            # all-gather it is made of, so its ledger reads as the formula's
            # 2Ψ(n-1)/n whichever algorithm the ring picks for the unit's size
            # (Ring guarantees all_reduce == reduce_scatter + all_gather, bitwise)
            own = L.own(seg, w, state.shard_rank)
            topo.ring.reduce_scatter(seg, own)
            if self.policy.all_reduce_grads:
                topo.ring.all_gather(own, seg)
        else:
            out = L.unit_shard(state.grads, w)
            topo.ring.reduce_scatter(seg, out)
            if topo.replica_ring is not None and topo.replica_ring.size > 1:
                topo.replica_ring.all_reduce(out)
