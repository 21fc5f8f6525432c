"""The step's global gradient norm, from per-piece partial sums: the same bits at every stage.

What it is
    ``piece_sumsq(engine)``: {r: the squared norm of this rank's gradient
    piece r}, each the dots of its units added in unit order. The dots stay
    on the device in one (pieces, units) fp32 buffer and come back in one copy
    per step, not a host sync per unit per piece.
    ``share_scalars(engine, loss, partial)``: [loss, this rank's partial,
    stop_request] all-gathered on the control ring (copies only, so the values
    arrive bit-exact, and a missing rank is named by the stall inspector);
    returns the global squared norm, the shard group's partials added in
    shard-rank order (hybrid replicas hold the same ones). Whatever the stage,
    the same pieces are added in the same order, so the norm is bitwise equal
    across stages.

What it is not
    Clipping or the overflow decision (engine.step and optim.clip_coef).
"""
from __future__ import annotations

from ringzero.comm.backend import to_host


def piece_sumsq(engine) -> dict:
    held = engine.state.held_ranks("master")
    for u, r, g in engine._grad_pieces():
        engine.xp.dot(g, g, out=engine._dots[r - held[0], u:u + 1].reshape(()))
    dots = to_host(engine._dots)
    partial = {}
    for r in held:
        acc = 0.0
        for u in range(len(engine.layout.units)):
            acc += float(dots[r - held[0], u])
        partial[r] = acc
    return partial


def share_scalars(engine, loss, partial) -> float:
    mine = 0.0
    for r in engine.state.held_ranks("master"):     # stage 0: every piece, in order
        mine += partial[r]
    engine._scalars[:] = (loss, mine, engine.stop_request)
    topo = engine.topology
    if topo.world_size > 1:
        topo.control.all_gather(engine._scalars, engine._all_scalars.reshape(-1))
    else:
        engine._all_scalars[0] = engine._scalars
    if engine.policy.full_optimizer:
        return mine
    total = 0.0
    for member in topo.shard_members():
        total += float(engine._all_scalars[member, 1])
    return total
