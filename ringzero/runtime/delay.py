"""ZeRO-Offload's delayed parameter update (DPU): step t's update beside step t+1's forward and backward.

What it is
    ``DelayedUpdate(engine, warmup)`` (offload ``delay``, ``--offload-delay N``). The first ``warmup``
    steps are exact. From step N on, step t's update (AdamW on the offloaded master, m and v,
    streamed as stream.update does, and the new params) runs on a thread of its own while step t+1's
    forward and backward run; step t+1 therefore reads the params of step t-1's update, one step
    stale, as ZeRO-Offload's DPU does. Per step, on the caller's thread::

        after step t's backward:   join   wait for step t-1's update, agree on its error (collective),
                                          copy its new params into the params' own pieces, publish them
                                          (stages 1-2: the all-gathers); this wait is update_wait_s
                                   norm   the global norm, the clip and the overflow check (engine.step),
                                          on step t's gradient, on this thread: they carry a collective
                                   start  step t's own gradient pieces copied into ``buf``; the thread
                                          runs AdamW from ``buf``, writing the cast params back into
                                          ``buf`` (each tile's gradient is read before its params are
                                          written: the fused pass widens a block first, the NumPy twin
                                          the whole tile), never the params the forward reads

    ``buf`` is allocated once: the storage dtype, the size of this rank's master (Ψ/Nd elements at
    stages 1-3: 2 bytes x Ψ/Nd at fp16/bf16, 4 at fp32); it holds step t's gradient, then its new
    params. An overflow step (fp16) starts no update, as without delay; the pending one still lands
    at the next join. Whatever reads the whole state (engine.wait_params: a checkpoint, an
    evaluation, a full gather) joins at once, so a checkpoint holds the exact state, and the next
    step reads fresh params (its own update then runs delayed again); ``close`` lets the thread
    finish without publishing.

What it is not
    Not the update's arithmetic or streaming (optim.py, stream.py) and not the norm (norms.py). Params
    in files (``--offload optimizer,params``) and devices are refused (OffloadPolicy.check): there the forward
    would read what the update writes.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ringzero.runtime import stream
from ringzero.runtime.state import aligned_empty


class DelayedUpdate:
    """Step t's offloaded update on a thread beside step t+1 (module docstring)."""

    def __init__(self, engine, warmup: int):
        st = engine.state
        self.warmup = int(warmup)
        # this rank's gradient pieces of a step, then their new params: (master's size,) storage dtype
        self.buf = aligned_empty(np, st.master.size, engine.storage_dtype)
        self.layout = L = engine.layout
        self.pieces = [(u, r) for r in st.held_ranks("master") for u in range(len(L.units))]
        self._ex = ThreadPoolExecutor(1, thread_name_prefix="rz-offload-delay")
        self._future = None

    def __bool__(self) -> bool:
        """Whether an update is pending (started, not joined)."""
        return self._future is not None

    @property
    def nbytes(self) -> int:
        return int(self.buf.nbytes)

    def active(self, step: int) -> bool:
        """Whether step ``step`` (0-based) runs its update delayed: after the warm-up."""
        return step >= self.warmup

    def piece(self, u: int, r: int):
        """Piece (u, r) of ``buf``: laid out as master is (the layout table's piece)."""
        return self.layout.piece(self.buf, u, r)

    def start(self, engine, coef, lr: float):
        """Step t's gradient into ``buf``; its update started on the thread (AdamW's step count already
        advanced by the caller). Allocates nothing."""
        st = engine.state
        for u, r in self.pieces:
            self.piece(u, r)[...] = st.piece("grads", u, r)
        self._future = self._ex.submit(stream.update, engine, coef, lr, None, self.piece)

    def join(self, engine) -> float:
        """Wait for the pending update (collective: every rank has one, or none); its params into the
        params' own pieces and published. Returns the seconds waited for the thread."""
        if self._future is None:
            return 0.0
        t0 = time.perf_counter()
        f, self._future = self._future, None
        e = f.exception()
        waited = time.perf_counter() - t0
        stream.agree(engine, None if e is None else stream.error_text(e))
        st = engine.state
        for u, r in self.pieces:
            st.piece("params", u, r)[...] = self.piece(u, r)
        if engine.topology.zeropp is not None:       # refused by policies.py; kept for the engine's own use
            engine.topology.zeropp.invalidate()
        engine.update_gathers.started(st.publish(engine.ring, start=engine.overlap, cast=False))
        return waited

    def close(self):
        self._ex.shutdown(wait=True)

