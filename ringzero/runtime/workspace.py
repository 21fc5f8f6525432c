"""The unit-sized workspaces a plan's slots name, and the two moves made in them.

What it is
    ``Workspaces(layout, policy, plan, state, topology, compute_dtype)``
    allocates, once, the buffers the step loop works in:

        param_compute  compute-dtype params of a materialized unit   (when compute != storage dtype)
        grad_compute   fp32 gradient of an open unit                 (when storage is fp16/bf16)
        gather         storage-dtype landing of an all-gather        (params sharded: stage 3, hybrid;
                       the param slots themselves when nothing is cast)
        grad_bucket    storage-dtype gradient of one unit, reduce-scattered into the
                       grads shard                                    (grads sharded: 2, 3, hybrid)
        reduce_bucket  storage-dtype gradients of a bucket of units,  (stages 0-2, buckets of
                       reduced by one call                             more than one unit)

    and, per position of the step, the named views the model reads (params) and
    adds into (grads). Where no workspace is needed (stages 0-2 without a
    cast) the views point into the state buffers themselves.

        materialize(w, slot, land)  unit w's params -> a compute-dtype view: gather (or wait for
                               the gather start_gather began), then cast
        reduce_grad(w, slot)   unit w's finished gradient: cast, reduce-scatter into the
                               owner's piece (+ all-gather at stage 0, + all-reduce across
                               nodes for hybrid)
        close_grad(w, slot, k) the same for micro-batch k of K (gradient accumulation):

            stages 0-2 (no_sync)   accum[w] (full, fp32) = g_0, += g_1, ... on the rank;
                                   after g_{K-1}: cast accum[w], reduce it as reduce_grad
                                   does. Traffic per step: that of K = 1.
            stage 3, hybrid (FSDP) every g_k: cast, reduce-scatter into the grads shard,
                                   accum shard (fp32) = / += it; after g_{K-1}: grads
                                   shard = cast(accum shard), then (hybrid) all-reduced
                                   across nodes once. Traffic: K x the RS (and the gathers).

        Why stage 3 is not bitwise stage 0-2 at K > 1: stages 0-2 add the K
        micro-batch gradients on each rank first and then over ranks,
        sum_r cast(sum_k g_rk); stage 3 adds over ranks first, one rounded
        reduce-scatter per micro-batch, sum_k RS_r(cast(g_rk)). Floating
        addition is not associative, and in fp16/bf16 storage each RS result
        is also rounded to 2 bytes, so the two agree within rounding, not
        bit for bit. Stages 0-2 among themselves (same local sum, same RS) and
        stage 3 vs hybrid on one node (same RS, no replica) stay bitwise equal.

    Buckets (stages 0-2, ``reduce_bucket`` bytes > 0: plan.reduce_buckets):
    consecutive units whose gradients close one after the other share one
    reduction. Each unit's gradient is cast, as it closes, into its bucket
    laid out block by block (block j: the units' pieces j side by side), so
    that the reduce-scatter of the bucket leaves this rank's pieces of all
    its units in one run: at stage 2 straight into the grads shard (its
    pieces are consecutive there), at stages 0-1 into the bucket's own
    block, copied back into the full grads after (stage 0 all-gathers the
    bucket first; stage 1 copies every block back, as an in-place
    reduce-scatter would leave them). Every element is summed in the order its unit's own
    reduce-scatter would use (the Ring's order depends on the rank count,
    and on the size only above ``tree_bytes``, which a bucket of several
    units stays under: engine.py), so stages 0-3 stay bitwise equal.
    Without overlap, stages 1-2 gather the updated params by the same
    buckets (``gather_buckets``, ShardedState.publish): one all-gather per
    bucket in its blocks, then each unit's pieces copied out, so a step
    enters the ring twice per bucket instead of twice per unit.

    Overlap (``overlap=True``, the engine's default): a closed gradient's
    reduction is *started* on the ring's progress thread (comm/progress.py)
    and the backward goes on; ``release`` waits for it where the plan frees
    its slot (plan.grad_release), ``drain`` waits for the rest at the end of
    the backward. Hybrid's all-reduce of a unit's shard across nodes is
    started on the replica ring (its own progress thread) as soon as a wait
    finds the unit's reduce-scatter done, and the drain waits for those too.
    What it reads stays put until then: the unit's slot (fp32 storage, grads
    sharded: the plan holds it ``inflight`` positions longer), one of two
    storage-dtype buckets (2-byte storage: the cast alternates between them)
    or the unit's own range of the grads buffer (stages 0-1). The same
    collectives run on the same bytes in the same order per ring, so losses,
    norms and weights are bitwise those without overlap. Stage 3 / hybrid at
    K > 1 add each micro-batch's reduce-scattered piece into the accumulator
    when they wait for it, in micro-batch order. Stage 3 / hybrid prefetch (plan.prefetch):
    ``start_gather`` starts a unit's all-gather into its landing positions
    before it is read, on the same ring (so in one order with the
    reductions), and ``materialize`` waits for it there. ``timeline()`` gives
    the step's seconds of reductions and gathers (run on the progress thread,
    or on the caller's) and of waiting for them (exposed).
    RINGZERO_CHECK_OWNERSHIP=1: every buffer the workspaces write is first
    checked against the ring's started calls (``Ring.owner``).

What it is not
    It decides nothing about *when*: plan.py does. What a started collective holds and
    where it is waited for is inflight.py's bookkeeping. No optimizer.
"""
from __future__ import annotations

import functools
import os
import time

import numpy as np

from ringzero.runtime.inflight import Inflight
from ringzero.runtime.offload import read_into
from ringzero.runtime.plan import close_order, reduce_buckets
from ringzero.runtime.state import cast_into


class Workspaces:
    """Slot buffers and per-position views for one engine."""

    def __init__(self, layout, policy, plan, state, topology, compute_dtype, grad_accum: int = 1,
                 overlap: bool = False, reduce_bucket: int = 0):
        self.layout, self.policy, self.state, self.topology = layout, policy, state, topology
        xp, cap, storage = state.xp, layout.max_unit_padded, state.params.dtype
        # params are cast when the compute dtype differs from storage (CPU: fp32
        # compute over fp16/bf16 storage); gradients accumulate in fp32 whenever
        # storage is narrower (on GPU too, where compute is fp16: a unit's
        # gradient sums many terms, and fp16 would round after each)
        self.param_cast = compute_dtype != storage
        self.grad_cast = np.dtype(storage).itemsize < 4
        self.grad_accum = int(grad_accum)
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
        # overlap: a reduction may still read a gradient while the next unit computes
        self.overlap = bool(overlap)
        self._init_buckets(plan, int(reduce_bucket), np.dtype(storage).itemsize, xp, storage)
        # a unit's own bucket: where 2-byte storage casts a unit reduced alone (none when every unit
        # is in a bucket of several), or where fp32 storage accumulates each open gradient
        alone = len(self._group) < len(layout.units)
        if policy.grad_bucket and (alone or not self.grad_cast):
            n_bucket = (2 if self.overlap else 1) if self.grad_cast else plan.grad_slots
            self.bufs["grad_bucket"] = [xp.empty(cap, storage) for _ in range(n_bucket)]
        self._bucket = 0             # the bucket the next cast writes (2-byte storage, overlap)
        # hybrid: each shard is all-reduced across nodes once its reduce-scatter is done
        self._replicas = topology.replica_ring is not None and topology.replica_ring.size > 1
        self.inflight = Inflight(topology.replica_ring)   # what the started collectives hold; the timeline
        self._check = os.environ.get("RINGZERO_CHECK_OWNERSHIP", "0") == "1"
        # K > 1, stage 3 / hybrid, 2-byte storage: one reduce-scattered piece widened to fp32
        # before it is added into the accumulator (a unit's piece at most)
        self._widen = None
        if self.grad_accum > 1 and not policy.accumulate_locally and np.dtype(storage).itemsize < 4:
            self._widen = xp.empty(max(layout.piece_numel), np.float32)
            self.bufs["accum_widen"] = [self._widen]

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

    def _init_buckets(self, plan, cap, itemsize, xp, storage):
        """The reduction buckets of stages 0-2 (module docstring); units alone need none."""
        L = self.layout
        groups = ()
        if cap and not self.policy.gather_params and L.shards > 1:   # one rank: nothing to reduce
            groups = reduce_buckets(close_order(plan), [n * itemsize for n in L.unit_padded], cap)
        self.buckets = tuple(g for g in groups if len(g) > 1)
        self._group, self._goff, self._gsize = {}, {}, {}
        for g in self.buckets:
            self._gsize[g] = sum(L.piece_numel[u] for u in g)      # elements of one block
            for u in g:
                self._group[u] = g
                self._goff[u] = L.shard_offset[u] - L.shard_offset[g[0]]   # the unit's piece in a block
        self._open = {}              # bucket -> [its buffer, units still to close] this step
        self._rb = 0                 # the reduce_bucket buffer the next bucket fills
        self._blocks, self._unbuckets = {}, {}
        if self.buckets:
            n = max(self._gsize.values()) * L.shards
            self.bufs["reduce_bucket"] = [xp.empty(n, storage) for _ in range(2 if self.overlap else 1)]
            # per (bucket, buffer), made once: its (n, P) blocks view, and (stages 0-1) the copy back
            for g in self.buckets:
                for b, buf in enumerate(self.bufs["reduce_bucket"]):
                    blocks = buf[:L.shards * self._gsize[g]].reshape(L.shards, self._gsize[g])
                    self._blocks[g, b] = blocks
                    self._unbuckets[g, b] = functools.partial(self._unbucket, g, blocks)
        # stages 1-2 without overlap: the update's all-gathers go by bucket, in its first buffer
        self._gathers = () if self.overlap else tuple((g, self._blocks[g, 0]) for g in self.buckets)

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

    def zero_grad(self, w, slot):
        self.inflight.wait(("slot", slot))   # a reduction the plan let run past its close reads this slot
        g = self.grad_target(w, slot)[:self.layout.unit_padded[w]]
        self._touch(g)
        g.fill(0)

    def _landing(self, w, slot, land):
        """(where unit w's gather lands, this rank's own block of it)."""
        land = land if self.param_cast else slot       # no cast: the gather lands in the param slot
        seg = self.bufs["gather"][land][:self.layout.unit_padded[w]]
        return seg, self.layout.own(seg, w, self.state.shard_rank)

    def start_gather(self, w, slot, land):
        """Prefetch (overlap, params gathered): start unit w's all-gather into its landing; the plan's
        ``materialize`` at a later position waits for it. The landing is the gather's until then."""
        seg, own = self._landing(w, slot, land)
        self._touch(seg)
        read_into(self.layout.unit_shard(self.state.params, w), own)   # from RAM, or its file (offload)
        self.inflight.gather(w, slot, self.topology.ring.all_gather_start(own, seg))

    def materialize(self, w, slot, land=0):
        """Make unit w's full params available in the compute dtype, in ``slot``: wait for its started
        gather, or gather it now (stage 3, hybrid); then cast (where compute != storage dtype)."""
        L, state = self.layout, self.state
        if self.policy.gather_params:
            seg, own = self._landing(w, slot, land)
            if not self.inflight.gathered(w, slot):      # not prefetched: gather it here
                t0 = time.perf_counter()
                self._touch(seg)
                read_into(L.unit_shard(state.params, w), own)
                self.topology.ring.all_gather(own, seg)
                self.inflight.blocking("gather", time.perf_counter() - t0)
            src = seg
        else:
            src = L.unit_full(state.params, w)
        if self.param_cast:
            cast_into(self.bufs["param_compute"][slot][:L.unit_padded[w]], src)

    def _storage_seg(self, w, slot):
        """(where unit w's storage-dtype gradient is reduced from, what a started reduction of it holds):
        the grads buffer (stages 0, 1), a bucket, or the gradient slot itself."""
        L = self.layout
        if self.policy.full_grads:
            return L.unit_full(self.state.grads, w), ("unit", w)
        if not self.grad_cast:
            return self.bufs["grad_bucket"][slot][:L.unit_padded[w]], ("slot", slot)
        b = self._bucket
        self._bucket = (b + 1) % len(self.bufs["grad_bucket"])
        self.inflight.wait(("bucket", b))    # the reduction started two units ago reads this bucket
        return self.bufs["grad_bucket"][b][:L.unit_padded[w]], ("bucket", b)

    def reduce_grad(self, w, slot):
        """Unit w's gradient is complete: cast to the storage dtype and reduce it."""
        if w in self._group:
            src = self.bufs["grad_compute"][slot] if self.grad_cast else self.grad_target(w, slot)
            return self._into_bucket(w, src)
        seg, key = self._storage_seg(w, slot)
        if self.grad_cast:
            self._touch(seg)
            cast_into(seg, self.bufs["grad_compute"][slot][:self.layout.unit_padded[w]])
        self._reduce(w, seg, key)

    def _reduce(self, w, seg, key):
        """Reduce unit w's storage-dtype gradient ``seg`` over the shard group (and replicas)."""
        L, state, topo, ring = self.layout, self.state, self.topology, self.topology.ring
        t0 = time.perf_counter()
        if self.policy.full_grads:
            # stage 0's all-reduce is spelled out as the reduce-scatter and
            # all-gather it is made of, so its ledger reads as the formula's
            # 2Ψ(n-1)/n whichever algorithm the ring picks for the unit's size
            # (Ring guarantees all_reduce == reduce_scatter + all_gather, bitwise)
            own = L.own(seg, w, state.shard_rank)
            if self.overlap:          # one ring, one order: the all-gather reads what the RS wrote
                ps = [ring.reduce_scatter_start(seg, own)]
                if self.policy.all_reduce_grads:
                    ps.append(ring.all_gather_start(own, seg))
                self.inflight.hold(key, ps)
                return
            ring.reduce_scatter(seg, own)
            if self.policy.all_reduce_grads:
                ring.all_gather(own, seg)
        else:
            out = L.unit_shard(state.grads, w)
            if self.overlap:
                self.inflight.hold(key, [ring.reduce_scatter_start(seg, out)],
                                   replica=out if self._replicas else None)
                return
            ring.reduce_scatter(seg, out)
            if self._replicas:
                topo.replica_ring.all_reduce(out)
        self.inflight.blocking("reduce", time.perf_counter() - t0)

    def _into_bucket(self, w, src):
        """Unit w's finished gradient ``src`` (at least its padded length, any float dtype) into its
        bucket, piece j into block j; the bucket is reduced once its last unit is in."""
        L, n, g = self.layout, self.layout.shards, self._group[w]
        if g not in self._open:                  # the bucket's first unit: take a buffer
            b = self._rb
            self._rb = (b + 1) % len(self.bufs["reduce_bucket"])
            self.inflight.wait(("rbucket", b))   # the bucket reduced before the last one reads it
            self._open[g] = [b, len(g)]
        b = self._open[g][0]
        blocks = self._blocks[g, b]
        off, m = self._goff[w], L.piece_numel[w]
        pieces = src[:L.unit_padded[w]].reshape(n, m)
        self._touch(blocks)
        for j in range(n):                       # (n, m) rows into (n, P) columns: n contiguous casts
            cast_into(blocks[j, off:off + m], pieces[j])
        self._open[g][1] -= 1
        if not self._open[g][1]:
            del self._open[g]
            self._reduce_bucket(g, b)

    def _reduce_bucket(self, g, b):
        """Reduce bucket g, in buffer b as (n, P) blocks: stage 2 into the grads shard, stages 0-1 in
        its own block (stage 0: and all-gathered), then back into the full grads."""
        L, state, ring = self.layout, self.state, self.topology.ring
        blocks, key = self._blocks[g, b], ("rbucket", b)
        flat = blocks.reshape(-1)
        t0 = time.perf_counter()
        if not self.policy.full_grads:           # stage 2: the units' pieces are one run of the shard
            a = L.shard_offset[g[0]]
            out = state.grads[a:a + self._gsize[g]]
            if self.overlap:
                self.inflight.hold(key, [ring.reduce_scatter_start(flat, out)])
                return
            ring.reduce_scatter(flat, out)
        else:
            own = blocks[state.shard_rank]
            after = self._unbuckets[g, b]
            if self.overlap:
                ps = [ring.reduce_scatter_start(flat, own)]
                if self.policy.all_reduce_grads:
                    ps.append(ring.all_gather_start(own, flat))
                self.inflight.hold(key, ps, after=after)
                return
            ring.reduce_scatter(flat, own)
            if self.policy.all_reduce_grads:
                ring.all_gather(own, flat)
            after()
        self.inflight.blocking("reduce", time.perf_counter() - t0)

    def gather_buckets(self) -> tuple:
        """((units, blocks), ...): the update's all-gathers of stages 1-2 by bucket (ShardedState.publish),
        in the reduction buckets' blocks, which nothing holds between a drained backward and the next."""
        return self._gathers

    def _unbucket(self, g, blocks):
        """Stages 0-1: a reduced bucket back into the full grads, every block (as a reduce-scatter in
        place would leave them: stage 1's other blocks are partial sums, which nothing reads)."""
        L, state = self.layout, self.state
        for u in g:
            off, m = self._goff[u], L.piece_numel[u]
            L.unit_full(state.grads, u).reshape(L.shards, m)[...] = blocks[:, off:off + m]

    def release(self, w, slot):
        """The plan frees unit w's slot here: its reduction must be done."""
        self.inflight.wait(("slot", slot))

    def drain(self):
        """End of a backward: every started reduction done (hybrid: and its all-reduce across nodes)."""
        self.inflight.drain()

    def timeline(self) -> dict:
        """The step's seconds of reductions and gathers, run and exposed (inflight.py); then reset."""
        return self.inflight.timeline()

    def _touch(self, x):
        """RINGZERO_CHECK_OWNERSHIP=1: refuse to write a buffer a started collective still owns."""
        if self._check:
            rr = self.topology.replica_ring
            p = self.topology.ring.owner(x) or (rr.owner(x) if rr is not None else None)
            if p is not None:
                raise RuntimeError(f"workspace: a buffer is written while a started {p.name} owns it; "
                                   "HINT: the overlap's wait is missing or in the wrong place")

    def close_grad(self, w, slot, k: int = 0):
        """Micro-batch k's gradient of unit w is complete (see the module docstring)."""
        K = self.grad_accum
        if K == 1:
            return self.reduce_grad(w, slot)
        L, state, topo = self.layout, self.state, self.topology
        n, last = L.unit_padded[w], k == K - 1
        g = self.grad_target(w, slot)[:n]             # this micro-batch's gradient (fp32 workspace)
        if self.policy.accumulate_locally:            # stages 0-2: sum on the rank, reduce once
            acc = L.unit_full(state.accum, w)
            if k == 0:
                cast_into(acc, g)
            else:
                acc += g
            if last and w in self._group:
                self._into_bucket(w, acc)
            elif last:
                seg, key = self._storage_seg(w, slot)
                self._touch(seg)
                cast_into(seg, acc)
                self._reduce(w, seg, key)
            return
        # stage 3 / hybrid: reduce-scatter every micro-batch into the fp32 shard accumulator
        seg, key = self._storage_seg(w, slot)
        if self.grad_cast:
            self._touch(seg)
            cast_into(seg, g)
        out = L.unit_shard(state.grads, w)
        if self.overlap:      # the add into the accumulator waits for the RS (at a release or the drain)
            self.inflight.hold(key, [topo.ring.reduce_scatter_start(seg, out)],
                               after=functools.partial(self._accumulate, w, k))
            return
        t0 = time.perf_counter()
        topo.ring.reduce_scatter(seg, out)
        self.inflight.blocking("reduce", time.perf_counter() - t0)
        self._accumulate(w, k)

    def _accumulate(self, w, k):
        """Stage 3 / hybrid at K > 1: micro-batch k's reduce-scattered piece of unit w into the fp32
        accumulator; after the last, the step's gradient back in the grads shard (hybrid: all-reduced
        across nodes, at once, or at the drain with overlap)."""
        L, state, topo = self.layout, self.state, self.topology
        out, acc = L.unit_shard(state.grads, w), L.unit_shard(state.accum, w)
        if k == 0:
            cast_into(acc, out)
        elif self._widen is None:                     # fp32 storage: add as it is
            acc += out
        else:
            wide = self._widen[:out.size]
            cast_into(wide, out)
            acc += wide
        if k == self.grad_accum - 1:
            cast_into(out, acc)                       # the step's gradient, in the storage dtype
            if self._replicas:
                if self.overlap:
                    self.inflight.replicate(out)
                else:
                    topo.replica_ring.all_reduce(out)     # across nodes once per step
