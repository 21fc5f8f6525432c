"""Gather + cast: a unit's parameters made readable in the compute dtype, in the slot the plan names.

What it is
    ``GatherCast(slots, layout, policy, state, topology, inflight, touch)``:

        materialize(w, slot, land)   unit w's params -> a compute-dtype view in ``slot``:
                                     all-gather its pieces (stage 3, hybrid), or wait for the
                                     gather ``start`` began; then cast where compute != storage
        start(w, slot, land)         prefetch (overlap, params gathered: plan.prefetch): start
                                     unit w's all-gather into its landing now, on the shard
                                     ring, so that it runs beside the compute of the positions
                                     before the one that reads it

    A gather lands in the storage dtype: in the param slot itself when
    nothing is cast, else in a landing buffer of its own (``land``), cast into
    the param slot by ``materialize``. This rank's own block is copied in from
    its shard of the params first, and the ring fills the others. Prefetched
    gathers go on the same ring as the reductions, so both run in one order.
    With --zeropp both go through runtime/zeropp.py (``gather``, ``gather_start``,
    then ``gathered``: qwZ's quantized calls on the same ring's progress thread,
    hpZ's gathers from the secondary shard on the node's ring).
    At stages 0-2 the params are held in full: ``materialize`` only casts.

What it is not
    No choice of when (plan.py), no buffers of its own (slots.py). The update's
    all-gathers of stages 1-2 are the state's (ShardedState.publish).
"""
from __future__ import annotations

import time

from ringzero.runtime.offload import read_into
from ringzero.runtime.state import cast_into


class GatherCast:
    """Unit params into a compute-dtype slot: gathered (now or prefetched), then cast."""

    def __init__(self, slots, layout, policy, state, topology, inflight, touch, reads=None):
        self.slots, self.layout, self.policy, self.state, self.topology = slots, layout, policy, state, topology
        self.inflight, self._touch = inflight, touch
        self.reads = reads          # params in a file (offload params): param_reads.ParamReads, read ahead

    def _own(self, w, own):
        """This rank's params piece of unit w into ``own``: from RAM, or its file (read ahead where it can)."""
        if self.reads is not None:
            self.reads.take(w, own)
        else:
            read_into(self.layout.unit_shard(self.state.params, w), own)

    def start(self, w, slot, land):
        """Prefetch (overlap, params gathered): start unit w's all-gather into its landing; the plan's
        ``materialize`` at a later position waits for it. The landing is the gather's until then."""
        seg, own = self.slots.landing(w, slot, land)
        self._touch(seg)
        self._own(w, own)                                  # from RAM, or its file (offload)
        zpp = self.topology.zeropp                        # ZeRO++ (runtime/zeropp.py): qwZ, hpZ
        if zpp is None:
            pending = self.topology.ring.all_gather_start(own, seg)
        else:
            pending = zpp.gather_start(w, own, seg)
        self.inflight.gather(w, slot, pending)

    def materialize(self, w, slot, land=0):
        """Make unit w's full params available in the compute dtype, in ``slot``: wait for its started
        gather, or gather it now (stage 3, hybrid); then cast (where compute != storage dtype)."""
        L, state = self.layout, self.state
        if self.policy.gather_params:
            seg, own = self.slots.landing(w, slot, land)
            zpp = self.topology.zeropp                    # ZeRO++ (runtime/zeropp.py): qwZ, hpZ
            if not self.inflight.gathered(w, slot):      # not prefetched: gather it here
                t0 = time.perf_counter()
                self._touch(seg)
                self._own(w, own)
                if zpp is not None:
                    zpp.gather(w, own, seg)
                else:
                    self.topology.ring.all_gather(own, seg)
                self.inflight.blocking("gather", time.perf_counter() - t0)
            elif zpp is not None:
                zpp.gathered(w, seg)                      # hpZ: the secondary from the prefetched gather
            src = seg
        else:
            src = L.unit_full(state.params, w)
        if self.slots.param_cast:
            cast_into(self.slots.bufs["param_compute"][slot][:L.unit_padded[w]], src)
