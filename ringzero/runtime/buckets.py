"""Reduction buckets (stages 0-2): the gradients of consecutive units reduced by one call.

What it is
    ``BucketTable.build(layout, policy, plan, cap, itemsize)`` says which
    units share a bucket (plan.reduce_buckets: units whose gradients close one
    after the other, up to ``cap`` bytes) and where each unit's piece sits in
    its bucket's blocks; ``ReduceBuckets`` casts each unit's gradient into
    its bucket as it closes and reduces the bucket once its last unit is in.

    A bucket is laid out block by block (block j: the units' pieces j side by
    side), so that the reduce-scatter of the bucket leaves this rank's
    pieces of all its units in one run::

        units 2, 3 (pieces a2, a3 per rank), n = 2   block 0 | a2_0 a3_0 |  block 1 | a2_1 a3_1 |

    At stage 2 that run goes straight into the grads shard (the units'
    pieces are consecutive there); at stages 0-1 into the bucket's own
    block, copied back into the full grads after (stage 0 all-gathers the
    bucket first; stage 1 copies every block back, as an in-place
    reduce-scatter would leave them). Every element is summed in the order
    its unit's own reduce-scatter would use (the Ring's order depends on the
    rank count, and on the size only above ``tree_bytes``, which a bucket of
    several units stays under: engine.py), so stages 0-3 stay bitwise equal.

    Without overlap, stages 1-2 gather the updated params by the same
    buckets (``gathers``, ShardedState.publish): one all-gather per bucket in
    its blocks, then each unit's pieces copied out, so a step enters the ring
    twice per bucket instead of twice per unit. With overlap, a bucket's
    reduction is started on the progress thread and held under
    ``("rbucket", b)`` (inflight.py) until the next bucket needs buffer b.

What it is not
    No allocation (slots.py makes the ``reduce_bucket`` buffers) and no choice
    of the cap (engine.py). Units reduced alone are reduce.py's.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass

from ringzero.runtime.plan import close_order, reduce_buckets
from ringzero.runtime.state import cast_into


@dataclass(frozen=True)
class BucketTable:
    """Which units share a reduction, and where each one's piece sits in a block of its bucket."""
    buckets: tuple         # (units, ...) of every bucket of more than one unit, in close order
    group: dict            # unit -> its bucket (units reduced alone are absent)
    offset: dict           # unit -> where its piece starts in one block of its bucket
    block: dict            # bucket -> elements of one block: its units' pieces side by side

    @classmethod
    def build(cls, layout, policy, plan, cap: int, itemsize: int) -> "BucketTable":
        groups = ()
        if cap and not policy.gather_params and layout.shards > 1:   # one rank: nothing to reduce
            groups = reduce_buckets(close_order(plan), [n * itemsize for n in layout.unit_padded], cap)
        buckets = tuple(g for g in groups if len(g) > 1)
        group, offset, block = {}, {}, {}
        for g in buckets:
            block[g] = sum(layout.piece_numel[u] for u in g)
            for u in g:
                group[u] = g
                offset[u] = layout.shard_offset[u] - layout.shard_offset[g[0]]
        return cls(buckets, group, offset, block)

    def numel(self, shards: int) -> int:
        """Elements of a buffer that holds any bucket's blocks (0: no bucket)."""
        return max(self.block.values(), default=0) * shards


class ReduceBuckets:
    """Gradients into their buckets, piece j into block j; a bucket reduced once its last unit is in."""

    def __init__(self, table: BucketTable, buffers, layout, policy, state, topology, inflight, touch,
                 overlap: bool = False):
        self.table, self.layout, self.policy, self.state, self.topology = table, layout, policy, state, topology
        self.inflight, self._touch, self.overlap = inflight, touch, bool(overlap)
        self._nbuf = len(buffers)
        self._open = {}              # bucket -> [its buffer, units still to close] this step
        self._next = 0               # the reduce_bucket buffer the next bucket fills
        # per (bucket, buffer), made once: its (n, P) blocks view, and (stages 0-1) the copy back
        self._blocks, self._unbuckets = {}, {}
        for g in table.buckets:
            for b, buf in enumerate(buffers):
                blocks = buf[:layout.shards * table.block[g]].reshape(layout.shards, table.block[g])
                self._blocks[g, b] = blocks
                self._unbuckets[g, b] = functools.partial(self._unbucket, g, blocks)
        # stages 1-2 without overlap: the update's all-gathers go by bucket, in its first buffer
        self._gathers = () if self.overlap else tuple((g, self._blocks[g, 0]) for g in table.buckets)

    def __contains__(self, w) -> bool:
        return w in self.table.group

    def add(self, w, src):
        """Unit w's finished gradient ``src`` (at least its padded length, any float dtype) into its
        bucket, piece j into block j; the bucket is reduced once its last unit is in."""
        L, n, g = self.layout, self.layout.shards, self.table.group[w]
        if g not in self._open:                  # the bucket's first unit: take a buffer
            b = self._next
            self._next = (b + 1) % self._nbuf
            self.inflight.wait(("rbucket", b))   # the bucket reduced before the last one reads it
            self._open[g] = [b, len(g)]
        b = self._open[g][0]
        blocks = self._blocks[g, b]
        off, m = self.table.offset[w], L.piece_numel[w]
        pieces = src[:L.unit_padded[w]].reshape(n, m)
        self._touch(blocks)
        for j in range(n):                       # (n, m) rows into (n, P) columns: n contiguous casts
            cast_into(blocks[j, off:off + m], pieces[j])
        self._open[g][1] -= 1
        if not self._open[g][1]:
            del self._open[g]
            self._reduce(g, b)

    def _reduce(self, g, b):
        """Reduce bucket g, in buffer b as (n, P) blocks: stage 2 into the grads shard, stages 0-1 in
        its own block (stage 0: and all-gathered), then back into the full grads."""
        L, state, ring = self.layout, self.state, self.topology.ring
        blocks, key = self._blocks[g, b], ("rbucket", b)
        flat = blocks.reshape(-1)
        t0 = time.perf_counter()
        if not self.policy.full_grads:           # stage 2: the units' pieces are one run of the shard
            a = L.shard_offset[g[0]]
            out = state.grads[a:a + self.table.block[g]]
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

    def _unbucket(self, g, blocks):
        """Stages 0-1: a reduced bucket back into the full grads, every block (as a reduce-scatter in
        place would leave them: stage 1's other blocks are partial sums, which nothing reads)."""
        L, state = self.layout, self.state
        for u in g:
            off, m = self.table.offset[u], L.piece_numel[u]
            L.unit_full(state.grads, u).reshape(L.shards, m)[...] = blocks[:, off:off + m]

    def gathers(self) -> tuple:
        """((units, blocks), ...): the update's all-gathers of stages 1-2 by bucket (ShardedState.publish),
        in the reduction buckets' blocks, which nothing holds between a drained backward and the next."""
        return self._gathers
