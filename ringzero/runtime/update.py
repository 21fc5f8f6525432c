"""The update: AdamW on every master piece this rank holds, then the params published from master.

What it is
    ``apply(engine, coef, lr)`` runs one step's update after the global norm and the overflow check
    (engine.py): the gradient pieces scaled by ``coef`` (1 / (scale x K x n), times the clip), AdamW on
    each (optim.py), then the cast of master into the storage-dtype params and, where params are held
    in full (stages 1-2), their all-gathers, started or blocking. It has three forms, one result:

        in RAM        piece by piece: on the host the fused C pass (optim.update_tile) where it was
                      built, else NumPy (or CuPy) AdamW; then state.publish casts and gathers
        offloaded     streamed through a few tile buffers (stream.py): the fused AdamW reads master,
                      m, v from their files, writes them back and casts the params in the same pass
        ahead         the offloaded update on its own thread, unit by unit, beside the next forward,
                      which waits for a unit only where it gathers it (stream.UpdateAhead)
        delayed       after the warm-up, the offloaded update on its own thread beside the next
                      step's forward and backward, which read the params one step stale; its
                      params are published at the next step's join (delay.py, ZeRO-Offload's DPU)

    ``drain_ahead(engine)`` waits for an update running ahead and agrees on its error (collective).

What it is not
    No norm, no clipping decision, no loss scaling (engine.py), no AdamW arithmetic (optim.py,
    csrc/adam.c), no files or threads (offload.py, stream.py).
"""
from __future__ import annotations

import time

import numpy as np

from ringzero.comm.trace import RECORDER, SPAN
from ringzero.runtime import optim, stream


def apply(engine, coef, lr: float):
    """One step's AdamW on this rank's pieces, and the params published (see the module docstring)."""
    t0 = time.perf_counter()
    engine.adam.begin_step()
    if engine.delayed is not None and engine.delayed.active(engine.step_count):
        engine.delayed.start(engine, coef, lr)   # beside the next step; published at its join (delay.py)
        return
    if engine.update_ahead is not None:          # beside the next forward, unit by unit
        engine.update_ahead.start(engine, coef, lr)
    elif engine.offload_stream is not None:      # streamed from the files; params cast in the same pass
        _offloaded(engine, coef, lr)
    else:
        _in_ram(engine, coef, lr)
    # with overlap (stages 1-2) the params' all-gathers run while the next forward computes;
    # whoever reads params before it waits for them (engine.wait_params)
    t1 = time.perf_counter()
    streamed = engine.offload_stream is not None
    engine.update_gathers.started(engine.state.publish(
        engine.ring, start=engine.overlap, cast=not streamed,
        buckets=() if streamed else engine.workspaces.gather_buckets()))
    P = engine.policy
    if not engine.overlap and P.full_params and not P.full_optimizer:
        dt = time.perf_counter() - t1            # stages 1-2: the blocking gathers (and casts)
        for k in ("param_gather_s", "param_gather_exposed_s", "comm_s"):
            engine.timeline[k] += dt
    if RECORDER.active:                          # --trace: the update's span (its pieces and gathers inside)
        RECORDER.span("update", "update", t0, time.perf_counter())


def _in_ram(engine, coef, lr: float):
    """The update on the pieces in RAM. On the host with the C pass built: one fused pass a piece
    (widen and scale the gradient, AdamW; optim.update_tile, the bits of the NumPy steps) instead of
    the cast into scratch and AdamW's ten NumPy passes over master, m, v and scratch."""
    piece, adam = engine.state.piece, engine.adam
    if engine.xp is np and optim.HAVE_C:
        rec = RECORDER if RECORDER.active else None    # --trace: a span a piece, its name id made once
        if rec:
            tiles = engine.ram_tiles
            ids = rec.table(("adam", *((t.u, t.r) for t in tiles)), lambda: [f"adam u{t.u} r{t.r}" for t in tiles])
            cat = rec.intern("update_piece")
        for k, t in enumerate(engine.ram_tiles):  # one tile a piece, r outer (stream.tiles)
            u, r = t.u, t.r
            t0 = time.perf_counter()
            adam.update_tile(piece("master", u, r), piece("adam_m", u, r), piece("adam_v", u, r),
                             piece("grads", u, r), coef, lr, t.runs)
            if rec:
                rec.put(ids[k], cat, SPAN, rec.step, t0, time.perf_counter())
        return
    for u, r, g in engine._grad_pieces():
        g *= coef
        adam.update(piece("master", u, r), piece("adam_m", u, r), piece("adam_v", u, r),
                    g, lr, engine._decay[(u, r)])


def _offloaded(engine, coef, lr: float):
    """The streamed update (stream.py). Any exception on any rank (an I/O error, a short read, a
    ValueError, a bug) is one OffloadFailed on every rank, never a rank left waiting for the watchdog."""
    err = None
    try:
        stream.update(engine, coef, lr)
    except Exception as e:      # noqa: BLE001 (every kind is agreed: the others wait in the next collective)
        err = stream.error_text(e)
    stream.agree(engine, err)


def drain_ahead(engine):
    """Wait for an update started beside this forward (UpdateAhead); agree on its error. Collective.
    A delayed one (delay.py): joined, its params published."""
    if engine.update_ahead:
        stream.agree(engine, engine.update_ahead.drain())
    if engine.delayed:
        engine.delayed.join(engine)


def close(engine):
    """The update's threads end: an update ahead drained, a delayed one's thread done (not published)."""
    if engine.update_ahead is not None:
        engine.update_ahead.drain()
        engine.update_ahead.close()
    if engine.delayed is not None:
        engine.delayed.close()
