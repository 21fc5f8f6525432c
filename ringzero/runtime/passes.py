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

from time import perf_counter

from ringzero.comm.trace import RECORDER
from ringzero.comm.trace import SPAN as X


def train_pass(engine, x, y, micro: int = 0) -> float:
    """Forward and backward of micro-batch ``micro`` (of grad_accum); returns its local loss."""
    m, plan, ws, gathers = engine.model, engine.plan, engine.workspaces, engine.update_gathers
    U = plan.units
    caches = [None] * U
    act = peak = 0
    h = x
    # --trace: each position is a "prepare" span (materialize, casts, zeroing), the unit's span and a
    # "finish" span (the gradient's cast and reduction), end to end (a position starts where the last
    # ended, so the recording's own time is inside them too); the recorder cuts the waits and blocking
    # collectives out of them when it writes (comm/trace.py), so the compute spans sum to the engine's
    # compute time (its wall time less the exposed communication)
    rec = RECORDER if RECORDER.active else None
    tp = perf_counter() if micro or not rec else engine.trace_t0     # the step's start (engine.step)
    if rec:                              # the spans' name ids, made once ([Note: one event, nine numbers])
        pre, fwd, bwd, fin, compute = _ids(rec, U, engine)
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
        t0 = perf_counter()
        h, caches[i] = m.forward_unit(i, ws.param_views[i], h, y if i == U - 1 else None)
        act += m.cache_nbytes(caches[i])
        peak = max(peak, act)
        if rec:
            t1 = perf_counter()
            st = rec.step
            rec.put(pre[i], compute, X, st, tp, t0)
            rec.put(fwd[i], compute, X, st, t0, t1)
            tp = t1
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
        t0 = perf_counter()
        dy = m.backward_unit(u, dy, caches[u], ws.param_views[i], ws.grad_views[i])
        t1 = perf_counter()
        act -= m.cache_nbytes(caches[u])
        caches[u] = None
        for w, s in plan.grad_close[i]:
            ws.close_grad(w, s, micro)
        if rec:
            t2 = perf_counter()
            st = rec.step
            rec.put(pre[u], compute, X, st, tp, t0)
            rec.put(bwd[u], compute, X, st, t0, t1)
            rec.put(fin[u], compute, X, st, t1, t2)
            tp = t2
    ws.drain()                           # every reduction done before anyone reads the grads
    engine.activation_peak = max(engine.activation_peak, peak)
    if rec:
        rec.span("drain", "compute", tp, perf_counter())       # its waits cut out: what is left is bookkeeping
    return loss


def _ids(rec, U: int, engine) -> tuple:
    """(prepare, forward, backward, finish) name ids by unit, and the id of "compute"."""
    ck = bool(getattr(engine.model, "checkpoint", False))
    return (*(rec.table((kind, U, ck), lambda k=kind: [_name(k, u, U, engine) for u in range(U)])
              for kind in ("prepare", "forward", "backward", "finish")), rec.intern("compute"))


def _name(kind: str, u: int, U: int, engine) -> str:
    """A unit's span name: "forward 3", "backward 3 (recompute)" (activation checkpointing), "forward 5 + loss"."""
    s = f"{kind} {u}"
    if kind in ("prepare", "finish"):
        return s
    if u == U - 1:
        s += " + loss"
    if kind == "backward" and getattr(engine.model, "checkpoint", False) and 0 < u < U - 1:   # the blocks
        s += " (recompute)"
    return s


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
