"""The unit-sized workspaces a plan's slots name, and the two moves made in them: one handle, four parts.

What it is
    ``Workspaces(layout, policy, plan, state, topology, compute_dtype)`` is
    what the step loop (passes.py) holds. It is made of:

        slots.py     Slots: every workspace buffer, allocated once, and the views the model reads
                     (params) and adds into (grads) at each position of the step
        gather.py    GatherCast: unit params gathered (stage 3, hybrid) and cast to the compute dtype
        reduce.py    CastReduce: a unit's finished gradient cast to the storage dtype and reduced
        buckets.py   ReduceBuckets: several units' gradients reduced by one call (stages 0-2)
        inflight.py  Inflight: what each started collective holds, where it is waited for, the
                     step's timeline; OwnershipCheck (RINGZERO_CHECK_OWNERSHIP=1)

    and it answers the plan's calls:

        materialize(w, slot, land)  unit w's params -> a compute-dtype view: gather (or wait for
                               the gather start_gather began), then cast
        close_grad(w, slot, k) micro-batch k of K of unit w's gradient is complete:

            K = 1                  cast, reduce-scatter into the owner's piece (+ all-gather at
                                   stage 0, + all-reduce across nodes for hybrid)
            stages 0-2 (no_sync)   accum[w] (full, fp32) = g_0, += g_1, ... on the rank;
                                   after g_{K-1}: cast accum[w], reduce it as at K = 1.
                                   Traffic per step: that of K = 1.
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

        zero_grad, release, drain, timeline: a gradient slot opened; freed (its
        reduction done); every reduction done; the step's seconds of them.

    Overlap (``overlap=True``, the engine's default across nodes): a closed
    gradient's reduction is *started* on the ring's progress thread
    (comm/progress.py) and the backward goes on; ``release`` waits for it
    where the plan frees its slot (plan.grad_release), ``drain`` waits for the
    rest at the end of the backward. Hybrid's all-reduce of a unit's shard
    across nodes is started on the replica ring (its own progress thread) as
    soon as a wait finds the unit's reduce-scatter done, and the drain waits
    for those too. What it reads stays put until then: the unit's slot (fp32
    storage, grads sharded: the plan holds it ``inflight`` positions longer),
    one of two storage-dtype buckets (2-byte storage: the cast alternates
    between them) or the unit's own range of the grads buffer (stages 0-1).
    The same collectives run on the same bytes in the same order per ring, so
    losses, norms and weights are bitwise those without overlap. Stage 3 /
    hybrid at K > 1 add each micro-batch's reduce-scattered piece into the
    accumulator when they wait for it, in micro-batch order. Stage 3 / hybrid
    prefetch (plan.prefetch): ``start_gather`` starts a unit's all-gather
    into its landing positions before it is read, on the same ring (so in
    one order with the reductions), and ``materialize`` waits for it there.
    ``timeline()`` gives the step's seconds of reductions and gathers (run on
    the progress thread, or on the caller's) and of waiting for them
    (exposed).

What it is not
    It decides nothing about *when*: plan.py does. No optimizer, and no model
    state: the five flat buffers are state.py's.
"""
from __future__ import annotations

import numpy as np

from ringzero.runtime.buckets import BucketTable, ReduceBuckets
from ringzero.runtime.gather import GatherCast
from ringzero.runtime.inflight import Inflight, OwnershipCheck
from ringzero.runtime.offload import on_disk
from ringzero.runtime.param_reads import ParamReads
from ringzero.runtime.reduce import CastReduce
from ringzero.runtime.slots import Slots


class Workspaces:
    """Slot buffers and per-position views for one engine, and the moves the plan calls for in them."""

    def __init__(self, layout, policy, plan, state, topology, compute_dtype, grad_accum: int = 1,
                 overlap: bool = False, reduce_bucket: int = 0):
        itemsize = np.dtype(state.params.dtype).itemsize
        table = BucketTable.build(layout, policy, plan, int(reduce_bucket), itemsize)
        self.slots = slots = Slots(layout, policy, plan, state, compute_dtype, table, overlap=bool(overlap),
                                   grad_accum=grad_accum)
        self.inflight = Inflight(topology.replica_ring)   # what the started collectives hold; the timeline
        touch = OwnershipCheck(topology)
        self.reduce_buckets = ReduceBuckets(table, slots.bufs.get("reduce_bucket", ()), layout, policy, state,
                                            topology, self.inflight, touch, overlap=overlap)
        # offload params (stage 3, hybrid): the next gather's disk read on an I/O thread (param_reads.py)
        self.param_reads = (ParamReads(layout, state) if policy.gather_params and on_disk(state.params) else None)
        self.gather_cast = GatherCast(slots, layout, policy, state, topology, self.inflight, touch, self.param_reads)
        self.cast_reduce = CastReduce(slots, self.reduce_buckets, layout, policy, state, topology, self.inflight,
                                touch, overlap=overlap, grad_accum=grad_accum)
        self.bufs = slots.bufs                        # {workspace: [unit-sized buffers]}
        self.param_views, self.forward_views, self.grad_views = (
            slots.param_views, slots.forward_views, slots.grad_views)
        self.buckets = table.buckets                  # the reduction buckets of several units
        self._group = table.group                     # unit -> its bucket (tests/test_buckets.py counts them)

    def nbytes(self) -> dict:
        """{workspace: bytes} (not model state)."""
        return self.slots.nbytes()

    # ------------------------------------------------------------------ params
    def start_gather(self, w, slot, land):
        """Prefetch: start unit w's all-gather into its landing (gather.py)."""
        self.gather_cast.start(w, slot, land)

    def materialize(self, w, slot, land=0):
        """Unit w's full params in the compute dtype, in ``slot`` (gather.py)."""
        self.gather_cast.materialize(w, slot, land)

    def begin_pass(self, kind: str, final=None):
        """A pass of ``kind`` ("train", "forward") starts: params reads ahead follow its order (param_reads.py)."""
        if self.param_reads is not None:
            self.param_reads.begin(kind, final)

    def close(self):
        if self.param_reads is not None:
            self.param_reads.close()

    # ------------------------------------------------------------------- grads
    def zero_grad(self, w, slot):
        """Open unit w's gradient in ``slot``: zeroed, once no reduction reads it (reduce.py)."""
        self.cast_reduce.zero_grad(w, slot)

    def close_grad(self, w, slot, k: int = 0):
        """Micro-batch k's gradient of unit w is complete (the module docstring; reduce.py)."""
        self.cast_reduce.close_grad(w, slot, k)

    def reduce_grad(self, w, slot):
        """Unit w's gradient is complete: cast to the storage dtype and reduce it (reduce.py)."""
        self.cast_reduce.reduce_grad(w, slot)

    def gather_buckets(self) -> tuple:
        """((units, blocks), ...): stages 1-2's update gathers by bucket (buckets.py)."""
        return self.reduce_buckets.gathers()

    # --------------------------------------------------------------- in flight
    def release(self, w, slot):
        """The plan frees unit w's slot here: its reduction must be done."""
        self.inflight.wait(("slot", slot))

    def drain(self):
        """End of a backward: every started reduction done (hybrid: and its all-reduce across nodes)."""
        self.inflight.drain()

    def timeline(self) -> dict:
        """The step's seconds of reductions and gathers, run and exposed (inflight.py); then reset."""
        return self.inflight.timeline()
