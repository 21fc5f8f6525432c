"""The passes through the step plan: forward and backward of one micro-batch, and a forward alone.

What it is
    ``train_pass(engine, x, y, micro) -> local loss`` visits the plan's
    positions in order (forward 0..U-1, backward U-1..0). At each position:
    materialize what the plan says (or wait for its prefetched gather),
    start the gathers the plan prefetches from there, wait for the
    reductions whose slots it frees, zero the gradients it opens, run the
    unit, close (cast, reduce) the gradients it finishes. After the last
    position every reduction is drained, so the grads are final.
    ``forward_pass(engine, x, y) -> local loss`` is the forward alone,
    through the plan's forward-only tables (evaluation).

What it is not
    No update, no norms, no loss scale: engine.py's step does those around
    the passes. No collectives of its own: the workspaces run them.
"""
from __future__ import annotations


def train_pass(engine, x, y, micro: int = 0) -> float:
    """Forward and backward of micro-batch ``micro`` (of grad_accum); returns its local loss."""
    m, plan, ws, gathers = engine.model, engine.plan, engine.workspaces, engine.update_gathers
    U = plan.units
    caches = [None] * U
    act = peak = 0
    h = x
    ua = engine.update_ahead
    ws.begin_pass("train", (lambda w: ua.wait([w])) if ua else None)   # params read ahead in the plan's order
    for i in range(U):
        if gathers:                      # stages 1-2 with overlap: the update's gathers, unit by unit
            gathers.wait(engine.layout.needs(i))
        if engine.update_ahead:          # the offloaded update running ahead (stage 3): the units gathered here
            engine.update_ahead.wait([w for w, s, g in plan.materialize[i] + plan.gather_start[i]])
        for w, s, g in plan.materialize[i]:
            ws.materialize(w, s, g)
        for w, s, g in plan.gather_start[i]:
            ws.start_gather(w, s, g)     # prefetch: a later position's gather runs beside this compute
        h, caches[i] = m.forward_unit(i, ws.param_views[i], h, y if i == U - 1 else None)
        act += m.cache_nbytes(caches[i])
        peak = max(peak, act)
    loss = float(h)
    dy = engine._seed()                  # d(loss)/d(loss): the loss scale over K
    for i in range(U, 2 * U):
        u = plan.positions[i][1]
        for w, s, g in plan.materialize[i]:
            ws.materialize(w, s, g)
        for w, s, g in plan.gather_start[i]:
            ws.start_gather(w, s, g)
        for w, s in plan.grad_release[i]:
            ws.release(w, s)             # a reduction in flight since an earlier position
        for w, s in plan.grad_open[i]:
            ws.zero_grad(w, s)
        dy = m.backward_unit(u, dy, caches[u], ws.param_views[i], ws.grad_views[i])
        act -= m.cache_nbytes(caches[u])
        caches[u] = None
        for w, s in plan.grad_close[i]:
            ws.close_grad(w, s, micro)
    ws.drain()                           # every reduction done before anyone reads the grads
    engine.activation_peak = max(engine.activation_peak, peak)
    return loss


def forward_pass(engine, x, y) -> float:
    """The local loss of a forward pass alone (no gradients)."""
    m, plan, ws = engine.model, engine.plan, engine.workspaces
    U = plan.units
    h = x
    ws.begin_pass("forward")
    for i in range(U):
        for w, s, g in plan.forward_materialize[i]:
            ws.materialize(w, s, g)
        h, _ = m.forward_unit(i, ws.forward_views[i], h, y if i == U - 1 else None)
    return float(h)
