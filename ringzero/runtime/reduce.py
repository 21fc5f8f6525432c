"""Cast + reduce: a unit's finished gradient cast to the storage dtype and reduced over the ranks.

What it is
    ``CastReduce(slots, buckets, layout, policy, state, topology, inflight, touch, overlap, grad_accum)``
    runs the gradient side of a unit's life in the step (the schedule of
    each stage, and of accumulation, is workspace.py's docstring):

        zero_grad(w, slot)     open: zero unit w's gradient slot (once a reduction
                               still reading that slot is done)
        close_grad(w, slot, k) micro-batch k's gradient of unit w is final: reduce it (K = 1),
                               sum it on the rank (stages 0-2, K > 1: reduced after the last),
                               or reduce-scatter it into the fp32 shard accumulator (stage 3,
                               hybrid, K > 1)
        reduce_grad(w, slot)   cast, then reduce-scatter into the owner's piece (+ all-gather
                               at stage 0, + all-reduce across nodes for hybrid); a unit in a
                               bucket goes to buckets.py instead

    Where a gradient is reduced from: the grads buffer itself (stages 0-1,
    fp32 storage), the gradient slot (fp32 storage, grads sharded), or one of
    the ``grad_bucket`` buffers it is cast into (2-byte storage: with overlap
    the cast alternates between two, so it never writes what the reduction
    started one unit before still reads). With overlap the reduction is
    started and held in inflight.py under the key of what it reads; the
    blocking path records its seconds there too.

What it is not
    No buffers of its own (slots.py), no buckets (buckets.py), no choice of
    when (plan.py).
"""
from __future__ import annotations

import functools
import time

from ringzero.runtime.state import cast_into


class CastReduce:
    """A unit's gradient: opened, closed, cast, reduced (now or started), and accumulated over K."""

    def __init__(self, slots, buckets, layout, policy, state, topology, inflight, touch, *,
                 overlap: bool = False, grad_accum: int = 1):
        self.slots, self.buckets, self.layout, self.policy = slots, buckets, layout, policy
        self.state, self.topology, self.inflight, self._touch = state, topology, inflight, touch
        self.overlap, self.grad_accum = bool(overlap), int(grad_accum)
        self._bucket = 0             # the grad_bucket the next cast writes (2-byte storage, overlap)
        # hybrid: each shard is all-reduced across nodes once its reduce-scatter is done
        self._replicas = topology.replica_ring is not None and topology.replica_ring.size > 1
        # K > 1, stage 3 / hybrid, 2-byte storage: a reduce-scattered piece widened to fp32
        self._widen = slots.bufs["accum_widen"][0] if "accum_widen" in slots.bufs else None

    def zero_grad(self, w, slot):
        self.inflight.wait(("slot", slot))   # a reduction the plan let run past its close reads this slot
        g = self.slots.grad_target(w, slot)[:self.layout.unit_padded[w]]
        self._touch(g)
        g.fill(0)

    def _storage_seg(self, w, slot):
        """(where unit w's storage-dtype gradient is reduced from, what a started reduction of it holds):
        the grads buffer (stages 0, 1), a bucket, or the gradient slot itself."""
        L, bufs = self.layout, self.slots.bufs
        if self.policy.full_grads:
            return L.unit_full(self.state.grads, w), ("unit", w)
        if not self.slots.grad_cast:
            return bufs["grad_bucket"][slot][:L.unit_padded[w]], ("slot", slot)
        b = self._bucket
        self._bucket = (b + 1) % len(bufs["grad_bucket"])
        self.inflight.wait(("bucket", b))    # the reduction started two units ago reads this bucket
        return bufs["grad_bucket"][b][:L.unit_padded[w]], ("bucket", b)

    def reduce_grad(self, w, slot):
        """Unit w's gradient is complete: cast to the storage dtype and reduce it."""
        grad_cast, bufs = self.slots.grad_cast, self.slots.bufs
        if w in self.buckets:
            src = bufs["grad_compute"][slot] if grad_cast else self.slots.grad_target(w, slot)
            return self.buckets.add(w, src)
        seg, key = self._storage_seg(w, slot)
        if grad_cast:
            self._touch(seg)
            cast_into(seg, bufs["grad_compute"][slot][:self.layout.unit_padded[w]])
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
                self.inflight.hold(key, [self._reduce_scatter_start(w, seg, out)],
                                   replica=out if self._replicas else None)
                return
            self._reduce_scatter(w, seg, out)
            if self._replicas:
                topo.replica_ring.all_reduce(out)
        self.inflight.blocking("reduce", time.perf_counter() - t0)

    def _reduce_scatter(self, w, seg, out):
        """Unit w's gradient seg -> this rank's piece out, over the shard ring or ZeRO++'s qgZ (zeropp.py)."""
        zpp = self.topology.zeropp
        if zpp is not None:
            zpp.reduce_scatter(w, seg, out)
        else:
            self.topology.ring.reduce_scatter(seg, out)

    def _reduce_scatter_start(self, w, seg, out):
        zpp = self.topology.zeropp
        if zpp is not None:                       # ZeRO++'s qgZ (zeropp.py), or the shard ring's
            return zpp.reduce_scatter_start(w, seg, out)
        return self.topology.ring.reduce_scatter_start(seg, out)

    def close_grad(self, w, slot, k: int = 0):
        """Micro-batch k's gradient of unit w is complete (workspace.py's docstring)."""
        K = self.grad_accum
        if K == 1:
            return self.reduce_grad(w, slot)
        L, state = self.layout, self.state
        n, last = L.unit_padded[w], k == K - 1
        g = self.slots.grad_target(w, slot)[:n]       # this micro-batch's gradient (fp32 workspace)
        if self.policy.accumulate_locally:            # stages 0-2: sum on the rank, reduce once
            acc = L.unit_full(state.accum, w)
            if k == 0:
                cast_into(acc, g)
            else:
                acc += g
            if last and w in self.buckets:
                self.buckets.add(w, acc)
            elif last:
                seg, key = self._storage_seg(w, slot)
                self._touch(seg)
                cast_into(seg, acc)
                self._reduce(w, seg, key)
            return
        # stage 3 / hybrid: reduce-scatter every micro-batch into the fp32 shard accumulator
        seg, key = self._storage_seg(w, slot)
        if self.slots.grad_cast:
            self._touch(seg)
            cast_into(seg, g)
        out = L.unit_shard(state.grads, w)
        if self.overlap:      # the add into the accumulator waits for the RS (at a release or the drain)
            self.inflight.hold(key, [self._reduce_scatter_start(w, seg, out)],
                               after=functools.partial(self._accumulate, w, k))
            return
        t0 = time.perf_counter()
        self._reduce_scatter(w, seg, out)
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
