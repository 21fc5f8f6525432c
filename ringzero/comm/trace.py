"""The timeline recorder: per-rank, per-thread events of a run, written as a Chrome trace (Perfetto, HTA).

What it is
    ``RECORDER``, one per process (as torch.profiler's is): off until ``enable(rank, world, nodes, ...)``.
    Every hook in the runtime reads one attribute, ``RECORDER.active``, and does nothing more when it is
    False: tracing off costs one attribute read per hooked call (the Ring's run, a unit's forward).
    While active (the trainer's ``--trace-steps A:B`` window) hooks append events to the buffer of the
    thread they run on (a Lane: no lock, no other thread writes it), allocated once when the thread first
    records. See [Note: one event, nine numbers] for what an event costs and why it is stored so.

    Event kinds (``ph`` of the Chrome trace-event format):
        X  a complete span: ts, dur (a unit's forward, a collective, a tile read, a wait)
        C  a counter sample: RSS (once per step); bytes in flight at each start and wait, derived from
           the start and wait spans when the file is written, not recorded
        s/t/f  a flow: a nonblocking collective's start (main thread), its run (progress thread), its
           wait (main thread), joined by one id so Perfetto draws the arrows; derived when the file is
           written from the three spans, which carry the flow id
    Every span carries the step it belongs to (``RECORDER.step``: the engine sets it while a step runs,
    -1 outside; a started collective keeps the step that started it, as the byte ledger counts it).

    ``write(path)`` writes ``{"traceEvents": [...], "distributedInfo": {...}, "displayTimeUnit": "ms"}``
    with thread-name metadata; ts in µs of the wall clock (time.time), so ranks on one host (and on
    hosts in NTP step) share one axis.

[Note: one event, nine numbers]
    An event is nine numbers written into the thread's preallocated flat list, one slice assignment:
    (name id, cat id, ph, step, t0, t1, flow id, bytes, comm id). Names are interned once to small ints
    (the passes' "forward 3" etc. come from tables made once, ``table``); a collective's args (op,
    schedule, dtype, ring, group size, bytes, inter-node bytes, S) are one interned tuple, its id the
    last number. Times are the perf_counter floats the hooks already read for the engine's own timeline
    (one clock for both: the compute spans sum to compute_s). Nothing is formatted until ``write``.
    Why a list and not a NumPy structured array: a row assigned into a structured array converts its
    fields one by one, several times the cost of a slice of a preallocated list, which takes the numbers
    as they are and keeps no per-event container (the times' floats only: tests/test_trace.py counts).
    ``benchmarks/trace_overhead.py`` prints the ns per event beside the step's measured difference.

What it is not
    No analysis (ringzero/tools/trace_summary.py reads the files) and no choice of what to record:
    the hooks in comm/ring.py, runtime/ and app/train.py decide that.
"""
from __future__ import annotations

import itertools
import json
import os
import threading
import time

from ringzero.comm import trace_file
from ringzero.comm.trace_file import W

# one event: the W numbers of trace_file.FIELDS, a row of a Lane's flat list ("comm" is the id of a
# collective's args tuple, trace_file.COMM_ARGS, 0 otherwise). A collective's "bytes" are what this rank
# sent (the ledger's figure), "size" is S, the whole buffer (nccl-tests' size)
SPAN, _C = ord("X"), ord("C")   # ph of a span, of a counter sample (Recorder.put)
PAUSE_ENV = "RINGZERO_FAULT_TRACE_PAUSE"   # tests: "rank:step:FILE" (Recorder.at_step)
CAPACITY = 1 << 15         # events per thread: a 48-layer stage-3 step is ~600; 32768 hold a window of ~50


class Lane:
    """One thread's events: a flat list of capacity * W numbers, filled from the front."""
    __slots__ = ("ident", "name", "rows", "n", "cap", "dropped")

    def __init__(self, ident: int, name: str, capacity: int):
        self.ident, self.name, self.cap = ident, name, capacity
        self.rows = [0] * (capacity * W)
        self.n = self.dropped = 0

    def events(self) -> list:
        """[(name, cat, ph, step, t0, t1, flow, bytes, comm)] as recorded."""
        it = iter(self.rows[:self.n * W])
        return list(zip(*[it] * W))


class Recorder:
    """The process's event buffers. ``active`` is the one check a hook makes."""

    def __init__(self):
        self.enabled = False     # enable() ran: the Ring wraps its runs (ring.py)
        self.active = False      # inside the recording window
        self.step = -1
        self.names = {"": 0}
        self.comms = {}          # a collective's args tuple (COMM_ARGS) -> its id (1, 2, ...)
        self._tables = {}
        self._tls = threading.local()
        self._bufs = []          # [Lane], one per thread that recorded
        self._lock = threading.Lock()
        self._flows = itertools.count(1)   # next() is atomic under the GIL: no lock per start
        self.steps = set()
        self.info = {}
        self.capacity = CAPACITY
        self._pause = None
        self._wall = 0.0

    # ---- set-up -----------------------------------------------------------
    def enable(self, rank: int, world_size: int, nodes: int = 1, backend: str = "mpi",
               capacity: int = CAPACITY, **extra):
        """Tracing on for this process (buffers come per thread, at its first event)."""
        self.enabled, self.capacity = True, int(capacity)
        self.info = {"rank": int(rank), "world_size": int(world_size), "backend": backend, "nodes": int(nodes),
                     **extra}
        # perf_counter (monotonic, fine) -> wall clock µs, fixed once
        self._wall = time.time() - time.perf_counter()
        f = os.environ.get(PAUSE_ENV, "").split(":", 2)
        self._pause = (int(f[0]), int(f[1]), f[2]) if len(f) == 3 and f[0] == str(rank) else None

    def at_step(self, step: int):
        """The engine's step begins (recording). Tests: RINGZERO_FAULT_TRACE_PAUSE=rank:step:FILE makes that rank
        write its pid to FILE and compute (a "paused" span) until FILE is gone, for the test to SIGSTOP it."""
        self.step = step
        self.steps.add(step)
        if self._pause is not None and self._pause[1] == step:
            path, t0 = self._pause[2], time.perf_counter()
            with open(path + ".tmp", "w") as fh:
                fh.write(str(os.getpid()))
            os.replace(path + ".tmp", path)
            while os.path.exists(path) and time.perf_counter() - t0 < 60:
                sum(range(10000))                # on a core, as a slow rank is
            self.span("paused (test)", "compute", t0, time.perf_counter())

    def end_step(self, t0: float, fwd_bwd: float):
        """The engine's step ends: its forward + backward span (t0, seconds), and later events are outside."""
        self.span("forward + backward", "fwd_bwd", t0, t0 + fwd_bwd)
        self.step = -1

    def disable(self):
        self.__init__()

    def intern(self, s: str) -> int:
        i = self.names.get(s)
        if i is None:
            with self._lock:
                i = self.names.setdefault(s, len(self.names))
        return i

    def table(self, key, make) -> tuple:
        """The ids of the names ``make()`` lists, made once per key (the passes' "forward 3", ...)."""
        t = self._tables.get(key)
        if t is None:
            t = self._tables[key] = tuple(self.intern(s) for s in make())
        return t

    @property
    def dropped(self) -> int:
        return sum(b.dropped for b in self._bufs)

    def recorded(self) -> int:
        """Events recorded, all threads."""
        return sum(b.n for b in self._bufs)

    def _lane(self) -> Lane:
        th = threading.current_thread()
        b = Lane(th.ident, th.name, self.capacity)
        with self._lock:
            self._bufs.append(b)
        self._tls.buf = b
        return b

    # ---- the events -------------------------------------------------------
    def put(self, name: int, cat: int, ph: int, step: int, t0: float, t1: float, flow: int = 0,
            nbytes: int = 0, comm: int = 0):
        """Store one event (ids and numbers, FIELDS' order) in this thread's Lane: one slice assignment."""
        try:
            b = self._tls.buf
        except AttributeError:
            b = self._lane()
        n = b.n
        if n >= b.cap:
            b.dropped += 1
            return
        k = n * W
        b.rows[k:k + W] = (name, cat, ph, step, t0, t1, flow, nbytes, comm)
        b.n = n + 1

    def span(self, name: str, cat: str, t0: float, t1: float, step=None, flow: int = 0, nbytes: int = 0):
        """A complete span [t0, t1] (perf_counter seconds) on this thread."""
        i = self.names.get
        self.put(i(name) or self.intern(name), i(cat) or self.intern(cat), SPAN,
                 self.step if step is None else step, t0, t1, flow, nbytes)

    def counter(self, name: str, value: int, t: float | None = None):
        t = time.perf_counter() if t is None else t
        self.put(self.intern(name), self.intern("counter"), _C, self.step, t, t, 0, value)

    def new_flow(self) -> int:
        return next(self._flows)

    # ---- a collective run (wrapped around the Executor's run by ring.py) ---
    def traced_run(self, run, ring):
        """``run(plan, background=False)`` with a span per call while active; ``run`` itself when not enabled."""
        if not self.enabled:
            return run
        rec, tls, comms = self, self._tls, self.comms
        comm_cat = self.intern("comm")

        def traced(plan, background=False):
            fl = getattr(tls, "flow", None) or (0, None)     # (flow id, step) of a started job
            if not rec.active or (background and not fl[0]):
                return run(plan, background)      # off, or started before the window opened
            t0 = time.perf_counter()
            try:
                return run(plan, background)
            finally:
                t1 = time.perf_counter()
                key = (plan.name, plan.sched, plan.dtype, getattr(ring, "trace_name", ""), ring.size,
                       plan.sent, plan.sent_net, plan.size)
                c = comms.get(key)
                if c is None:
                    with rec._lock:
                        c = comms.setdefault(key, len(comms) + 1)
                rec.put(rec.names.get(plan.name) or rec.intern(plan.name), comm_cat, SPAN,
                        rec.step if fl[1] is None else fl[1], t0, t1, fl[0], plan.sent, c)
        return traced

    def started(self, pending, job):
        """A nonblocking collective started on this thread (``pending``, progress.py): its start span
        (``pending.flow``, and the bytes it holds in flight), and ``job`` wrapped to carry the flow id and
        step to the progress thread."""
        fid, step, t0 = next(self._flows), self.step, time.perf_counter()
        pending.flow = fid
        tls = self._tls

        def carried():
            tls.flow = (fid, step)
            try:
                return job()
            finally:
                tls.flow = (0, None)
        self.span(pending.name + ".start", "comm_start", t0, time.perf_counter(), step, fid, pending.recv.nbytes)
        return carried

    def waited(self, name: str, fid: int, t0: float, t1: float, nbytes: int = 0):
        """The caller waited [t0, t1] for started collective ``fid``: its wait span ends the flow (a wait
        for one started before the window opened has no flow and no bytes in flight)."""
        self.span(name + ".wait", "comm_wait", t0, t1, None, fid, nbytes if fid else 0)

    # ---- output -----------------------------------------------------------
    def events(self) -> list:
        """The recorded events as Chrome trace-event dicts (thread names first); trace_file.py."""
        return trace_file.events(self._bufs, self.names, self.comms, self.info.get("rank", 0), self._wall)

    def write(self, path: str):
        """Write this rank's trace (atomically: a reader never sees half a file)."""
        doc = {"traceEvents": self.events(), "displayTimeUnit": "ms",
               "distributedInfo": dict(self.info),
               "ringzero": {"dropped_events": self.dropped, "capacity_per_thread": self.capacity,
                            "recorded_events": self.recorded(), "recorded_steps": len(self.steps)}}
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as fh:
            json.dump(doc, fh)
            fh.flush()
        os.replace(tmp, path)


RECORDER = Recorder()


def rss_bytes() -> int:
    """This process's resident set (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
