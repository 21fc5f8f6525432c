"""The sharding runtime: ZeRO stages 0-3 and HYBRID_SHARD over flat buffers.

    accounting   the stage table and the ZeRO formulas, written once
    flat         the layout table every buffer comes from (offsets, padding, pieces)
    policy       StagePolicy: what a stage holds in full, gathers and reduces
    topology     the shard and replica communicators and their rings
    plan         StepPlan, pure: when each unit is materialized and reduced
    state        the five flat state buffers; cast_into; the memory budget
    workspace    the plan's unit-sized slots; gather+cast and cast+reduce
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
