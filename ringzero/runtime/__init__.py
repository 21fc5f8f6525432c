"""The sharding runtime: ZeRO stages 0-3 and HYBRID_SHARD over flat buffers.

    accounting   the stage table and the ZeRO formulas, written once
    flat         the layout table every buffer comes from (offsets, padding, pieces)
    policy       StagePolicy: what a stage holds in full, gathers and reduces
    topology     the shard and replica communicators and their rings
    plan         StepPlan, pure: when each unit is materialized and reduced
    state        the five flat state buffers; cast_into; the memory budget
    passes       the forward and backward through the plan, position by position
    workspace    Workspaces: the step loop's one handle on the four parts below
    slots        the plan's unit-sized workspaces, allocated once, and their views
    gather       gather + cast: a unit's params readable in the compute dtype
    reduce       cast + reduce: a unit's finished gradient, and accumulation over K
    buckets      stages 0-2: several units' gradients reduced by one call
    inflight     the started collectives: what each holds, where it ends; the timeline
    optim        AdamW and the loss scaler
    engine       Zero: the parts put together, the step and the update
    reports      memory and traffic, measured beside the formulas
    zero         the public names (Zero, StepResult, ...) and the four stages taught
    checkpoint   sharded save and load (collective)
    manifest     the checkpoint's on-disk format, its checks, ranged reads
    export       export to safetensors and inspect (serial; the command line)

The runtime imports no model: it is handed an object that follows
``ringzero.nn.contract``. It uses ``ringzero.comm`` for every byte it moves.
"""
