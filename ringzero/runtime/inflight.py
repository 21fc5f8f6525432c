"""The step's started collectives: what each one holds, where it is waited for, and the timeline.

What it is
    ``Inflight(replica_ring)`` is the overlap's bookkeeping for one engine
    (workspace.py starts the collectives; plan.py says where they end):

        hold(key, pendings, after=None, replica=None)
                          a started reduction that reads/writes what ``key``
                          names (("slot", s), ("bucket", b), ("unit", w));
                          ``after()`` runs once it is done (stage 3 at K > 1:
                          the add into the accumulator), and ``replica`` (a
                          shard, hybrid) is then all-reduced across nodes,
                          started on the replica ring's own progress thread
        wait(key)         every Pending holding key done (then its after, its replica)
        drain()           all of them, and the replica all-reduces
        gather(unit, slot, pending) / gathered(unit, slot)
                          a prefetched all-gather, and waiting for it
        blocking(kind, seconds)
                          a collective run on the caller's thread: all exposed
        timeline()        the seconds since the last call, then reset:

            reduce_s, gather_s     the collectives' own time (run on the progress thread, or blocking)
            *_exposed_s            the caller's waits for them
            *_hidden_s             the difference
            progress_cpu_s         the progress thread's seconds on a core (Pending.cpu)

    ``UpdateGathers`` is the same for stages 1-2's all-gathers of the updated
    params, started by the update and waited for unit by unit by the next
    forward (or all at once by any other reader of the params).

    ``OwnershipCheck(topology)`` is the check of the waits: with
    RINGZERO_CHECK_OWNERSHIP=1, every buffer the workspaces are about to
    write is first checked against the rings' started calls (``Ring.owner``),
    and a write into one a started collective still owns raises.

What it is not
    It starts nothing on its own but the replica all-reduces, and owns no
    buffers: the workspaces and the state do.
"""
from __future__ import annotations

import os
import time

from ringzero.comm.trace import RECORDER

# --trace: the span names of a kind's waits and blocking sections (no string built per event)
WAITS = {"reduce": "reduce waits", "gather": "gather waits"}
BLOCKING = {"reduce": "reduce (blocking)", "gather": "gather (blocking)"}


class Inflight:
    """Started collectives by what they hold, and the step's communication seconds."""

    def __init__(self, replica_ring=None):
        self.replica_ring = replica_ring
        self._pending = {}       # key -> [Pending]
        self._after = {}         # key -> what to run once its Pendings are done
        self._replica_of = {}    # key -> the shard to all-reduce across nodes once they are done
        self._replica = []       # started all-reduces across nodes, waited for at the drain
        self._gathers = {}       # (unit, slot) -> its prefetched all-gather
        self._t = dict.fromkeys(("reduce", "reduce_exposed", "gather", "gather_exposed", "cpu"), 0.0)

    def hold(self, key, pendings, after=None, replica=None):
        self._pending[key] = list(pendings)
        if after is not None:
            self._after[key] = after
        if replica is not None:
            self._replica_of[key] = replica

    def _done(self, ps, kind):
        """Wait for ps; their seconds run count as `kind`, the wait as exposed."""
        t0 = time.perf_counter()
        for p in ps:
            p.wait()
            self._t[kind] += p.ran
            self._t["cpu"] += p.cpu
        t1 = time.perf_counter()
        self._t[kind + "_exposed"] += t1 - t0
        if RECORDER.active:      # --trace: the exposed interval as the step's timeline counts it
            RECORDER.span(WAITS[kind], "comm_block", t0, t1)

    def wait(self, key):
        """Every started reduction holding `key` done; then what was to follow it."""
        ps = self._pending.pop(key, None)
        if ps:
            self._done(ps, "reduce")
        after = self._after.pop(key, None)
        if after is not None:
            after()
        out = self._replica_of.pop(key, None)
        if out is not None:          # hybrid: the reduce-scatter is done, so across nodes it goes
            self.replicate(out)

    def replicate(self, out):
        """Start the all-reduce of a finished shard across nodes (waited for at the drain)."""
        self._replica.append(self.replica_ring.all_reduce_start(out))

    def drain(self):
        """Every started reduction done, and every all-reduce across nodes."""
        for key in list(self._pending):
            self.wait(key)
        if self._replica:
            self._done(self._replica, "reduce")
            self._replica.clear()

    def gather(self, unit, slot, pending):
        self._gathers[(unit, slot)] = pending

    def gathered(self, unit, slot) -> bool:
        """Wait for unit's prefetched gather into slot; False when none was started."""
        p = self._gathers.pop((unit, slot), None)
        if p is None:
            return False
        self._done((p,), "gather")
        return True

    def blocking(self, kind, seconds):
        """A collective of `kind` ("reduce", "gather") ran on the caller's thread."""
        self._t[kind] += seconds
        self._t[kind + "_exposed"] += seconds
        if RECORDER.active:      # --trace: the whole blocking section (copy-in, cast, the collective) as exposed
            t1 = time.perf_counter()
            RECORDER.span(BLOCKING[kind], "comm_block", t1 - seconds, t1)

    def timeline(self) -> dict:
        t = self._t
        out = {"reduce_s": t["reduce"], "reduce_exposed_s": t["reduce_exposed"],
               "reduce_hidden_s": max(0.0, t["reduce"] - t["reduce_exposed"]),
               "gather_s": t["gather"], "gather_exposed_s": t["gather_exposed"],
               "gather_hidden_s": max(0.0, t["gather"] - t["gather_exposed"]),
               "progress_cpu_s": t["cpu"]}
        for k in t:
            t[k] = 0.0
        return out


class UpdateGathers:
    """Stages 1-2: the update's all-gathers of the new params, started unit by unit (overlap) or
    run at once; ``wait`` before anything reads a unit's params; ``timeline`` (ran, exposed, cpu)."""

    def __init__(self):
        self._started = {}       # unit -> its started all-gather
        self._t = [0.0, 0.0, 0.0]

    def __bool__(self) -> bool:
        return bool(self._started)

    def started(self, pendings: dict):
        self._started = pendings

    def wait(self, units=None):
        """Wait for these units' gathers (None: every one). Collective-free."""
        if not self._started:
            return
        t0 = time.perf_counter()
        for u in (list(self._started) if units is None else units):
            p = self._started.pop(u, None)
            if p is not None:
                p.wait()
                self._t[0] += p.ran
                self._t[2] += p.cpu
        t1 = time.perf_counter()
        self._t[1] += t1 - t0
        if RECORDER.active:      # --trace: as Inflight._done
            RECORDER.span("param gather waits", "comm_block", t0, t1)

    def timeline(self) -> tuple:
        out, self._t = tuple(self._t), [0.0, 0.0, 0.0]
        return out


class OwnershipCheck:
    """RINGZERO_CHECK_OWNERSHIP=1 (read once, here): ``check(x)`` raises before buffer x is written while a
    started collective on the shard, the replica or hpZ's node ring still owns it. Off: a call that does nothing."""

    def __init__(self, topology):
        self.topology = topology     # read at each call: a caller may swap topology.ring
        self.on = os.environ.get("RINGZERO_CHECK_OWNERSHIP", "0") == "1"

    def __call__(self, x):
        if self.on:
            rr = self.topology.replica_ring
            zpp = self.topology.zeropp       # hpZ's node ring (the quantized calls are the shard ring's)
            p = self.topology.ring.owner(x) or (rr.owner(x) if rr is not None else None) or \
                (zpp.owner(x) if zpp is not None else None)
            if p is not None:
                raise RuntimeError(f"workspace: a buffer is written while a started {p.name} owns it; "
                                   "HINT: the overlap's wait is missing or in the wrong place")
