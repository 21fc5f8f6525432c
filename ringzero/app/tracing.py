"""The trainer's ``--trace DIR`` / ``--trace-steps A:B``: which steps are recorded, and where the files go.

What it is
    config.trace_window(cfg) parses --trace-steps (a ConfigError on bad input); ``TraceWindow.open(cfg, comm,
    engine)`` makes DIR, turns the process's recorder (comm/trace.py) on, and then, step by step:

        tw.load(train, step)      data loading, a span on the main thread
        tw.stepped(step, t0, dt)  the step's span and an RSS counter
        with tw.span(name, cat)   evaluation and checkpoint saves after a recorded step
        tw.close()                the rank writes DIR/rank{R}_trace.json and the recorder stops: at the
                                  first step past the window, or at the end of a run that ends inside it

    The default window: steps 5, 6, 7 (after the first steps' plan building and loss-scale skips), or the
    last three steps of a shorter run; a resumed run counts them from its first step.

What it is not
    The recorder (comm/trace.py) or the reader (tools/trace_summary.py, ``python -m ringzero.trace``).
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager

from ringzero.app.config import ConfigError, trace_window
from ringzero.comm.trace import RECORDER, rss_bytes


class TraceWindow:
    def __init__(self, cfg, comm, engine):
        self.dir, (self.a, self.b) = cfg.trace, trace_window(cfg)
        self.rank, self.engine = comm.rank, engine
        self.path = os.path.join(self.dir, f"rank{self.rank}_trace.json")
        self.written, self.first = False, None
        self.relative = not cfg.trace_steps and cfg.resume    # the default window counts from a resumed step
        self.last = cfg.steps
        topo = engine.topology
        RECORDER.enable(comm.rank, comm.size, topo.nodes.count, "mpi", stage=str(engine.stage),
                        precision=engine.precision, overlap=bool(engine.overlap), steps=[self.a, self.b],
                        ranks_per_node=topo.nodes.ppn, shard_size=topo.shard_size)
        # the Rings were built before enable(): wrap their runs now (comm/trace.py: traced_run)
        for _, ring in (*topo.rings(), ("control", topo.control)):
            ring._run = RECORDER.traced_run(ring.executor.run, ring)
        if topo.zeropp is not None:                  # ZeRO++'s quantized calls and hpZ's node ring
            topo.zeropp.trace_on()

    @classmethod
    def open(cls, cfg, comm, engine):
        """The window of --trace DIR (None without it). Raises ConfigError if DIR cannot be made."""
        if not cfg.trace:
            return None
        try:
            os.makedirs(cfg.trace, exist_ok=True)
            probe = os.path.join(cfg.trace, f".rank{comm.rank}.probe")
            open(probe, "w").close()
            os.remove(probe)
        except OSError as e:
            raise ConfigError(f"--trace {cfg.trace!r}: cannot write there: {e.strerror or e}") from None
        return cls(cfg, comm, engine)

    def load(self, train, step):
        """train.get(step), a "data" span when recorded."""
        if self.first is None:
            self.first = step
            if self.relative and step:
                self.a, self.b = min(step + self.a, self.last - 1), min(step + self.b, self.last)
        if step >= self.b:
            self.close()                  # past the window (its last eval and save recorded): write once
        RECORDER.active = self.a <= step < self.b
        RECORDER.step = step
        if not RECORDER.active:
            return train.get(step)
        t0 = time.perf_counter()
        out = train.get(step)
        RECORDER.span("load batch", "data", t0, time.perf_counter(), step)
        return out

    def stepped(self, step, t0, dt):
        """After the engine's step (t0: its start after the barrier; dt: its seconds)."""
        if not RECORDER.active:
            return
        RECORDER.span(f"step {step}", "step", t0, t0 + dt, step)
        RECORDER.counter("rss bytes", rss_bytes())

    @contextmanager
    def span(self, name, cat):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if RECORDER.active:
                RECORDER.span(name, cat, t0, time.perf_counter(), -1)

    def close(self):
        """Write this rank's file (once) and stop recording."""
        if self.written:
            return
        self.engine.wait_params()         # the update's started gathers (stages 1-2, overlap) run and recorded
        RECORDER.active = False
        if RECORDER.recorded():
            RECORDER.write(self.path)
        self.written = True
