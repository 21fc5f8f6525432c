"""The sharding runtime: ZeRO stages 0-3 and HYBRID_SHARD over flat, partitioned state.

The four stages, one step
    Every class of model state lives in ONE flat buffer, cut per unit into
    as many equal pieces as the sharding group has ranks (Nd, the world size;
    Ng for hybrid) by the layout table (flat.py). A rank's *shard* of a class
    is its piece of every unit. The stage only decides which classes exist
    in full on a rank and which exist as the shard:

        stage   params(fp16)  grads(fp16)  master/m/v(fp32)   per step, per unit
        0       full          full         full               all-reduce grads (ring RS+AG)
        1       full          full         shard              RS grads; update shard; AG params
        2       full          shard        shard              RS grads via a unit bucket; AG params
        3       shard         shard        shard              AG params before fwd, again before bwd; RS grads
        hybrid  like 3 inside a node of Ng ranks; shard grads all-reduced across nodes

    A step, at every stage:
      1. forward, unit by unit. Before a unit runs, the parameters it reads are
         *materialized*: gathered from the shards (stage 3), then cast to the
         compute dtype (fp32 on CPU) into a unit-sized workspace. A plan made
         once at start-up says when each unit is materialized and which slot it
         uses, so nothing is allocated per step.
      2. backward, units in reverse. The loss gradient is seeded with the loss
         scale. A unit's gradient is accumulated in a workspace; once no later
         unit writes to it (a tied head writes the embedding's gradient early),
         it is cast to fp16 and reduced: all-reduce (0), or reduce-scatter into
         this rank's piece (1, 2, 3, hybrid), then all-reduced across nodes (hybrid).
      3. the update, on this rank's pieces only (every piece at stage 0): the
         fp16 gradient is unscaled in fp32, its global norm (per-piece partial
         sums, added in rank order, the same at every stage) drives clipping and
         the overflow check, and AdamW updates master, m and v. The new master
         is cast to fp16 params; stages 1 and 2 all-gather them.

    Because the ring's all-reduce is bitwise its reduce-scatter plus all-gather,
    and the update is elementwise, stages 0-3 give bitwise identical training.
    World size 1 runs through the same code.

Where each part lives
    engine.py holds ``Zero`` and its step; the stage's facts are a frozen
    ``StagePolicy`` (policy.py, from the one stage table in accounting.py);
    the communicators are a ``Topology`` (topology.py); when each unit is
    materialized and reduced is a pure ``StepPlan`` (plan.py); the buffers are a ``ShardedState`` (state.py),
    the unit-sized slots ``Workspaces`` (workspace.py); the reports compare
    measurement with formula (reports.py). This module keeps the public names.

What it is not
    It imports no model: it needs the ``UnitModel`` contract of
    nn/contract.py (``units``, ``forward_unit``, ``backward_unit``, ...).
    Data, the learning-rate schedule and printing belong to the trainer.
"""
from ringzero.runtime.engine import StepResult, Zero
from ringzero.runtime.state import MemoryBudgetError, cast_into, check_budget

__all__ = ["Zero", "StepResult", "MemoryBudgetError", "check_budget", "cast_into"]
