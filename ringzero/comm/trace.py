"""The timeline recorder: per-rank, per-thread events of a run, written as a Chrome trace (Perfetto, HTA).

What it is
    ``RECORDER``, one per process (as torch.profiler's is): off until ``enable(rank, world, nodes, ...)``.
    Every hook in the runtime reads one attribute, ``RECORDER.active``, and does nothing more when it is
    False: tracing off costs one attribute read per hooked call (the Ring's run, a unit's forward).
    While active (the trainer's ``--trace-steps A:B`` window) hooks append events to a buffer of the
    thread they run on: one NumPy structured array per thread (EVENT), allocated once when the thread
    first records, names interned to small ints. Nothing is formatted until ``write``.

    Event kinds (``ph`` of the Chrome trace-event format):
        X  a complete span: ts, dur (a unit's forward, a collective, a tile read, a wait)
        C  a counter sample: RSS, bytes in flight
        s/t/f  a flow: a nonblocking collective's start (main thread), its run (progress thread), its
           wait (main thread), joined by one id so Perfetto draws the arrows
    Every span carries the step it belongs to (``RECORDER.step``: the engine sets it while a step runs,
    -1 outside; a started collective keeps the step that started it, as the byte ledger counts it).

    ``write(path)`` writes ``{"traceEvents": [...], "distributedInfo": {...}, "displayTimeUnit": "ms"}``
    with thread-name metadata; ts in µs of the wall clock (time.time), so ranks on one host (and on
    hosts in NTP step) share one axis.

What it is not
    No analysis (ringzero/tools/trace_summary.py reads the files) and no choice of what to record:
    the hooks in comm/ring.py, runtime/ and app/train.py decide that.
"""
from __future__ import annotations

import json
import os
import threading
import time

import numpy as np

# one event, 77 bytes (EVENT.itemsize, packed); strings are ids into Recorder.names. A collective's
# "bytes" are what this rank sent (the ledger's figure), "size" is S, the whole buffer (nccl-tests' size)
EVENT = np.dtype([("name", np.int32), ("cat", np.int32), ("ph", np.uint8), ("step", np.int32),
                  ("t0", np.float64), ("t1", np.float64), ("flow", np.int64),
                  ("bytes", np.int64), ("net", np.int64), ("group", np.int32),
                  ("sched", np.int32), ("dtype", np.int32), ("ring", np.int32),
                  ("size", np.int64)])
PH = {ord("X"): "X", ord("C"): "C", ord("s"): "s", ord("t"): "t", ord("f"): "f"}
PAUSE_ENV = "RINGZERO_FAULT_TRACE_PAUSE"   # tests: "rank:step:FILE" (Recorder.at_step)
_X = ord("X")
CAPACITY = 1 << 15         # events per thread: a 48-layer stage-3 step is ~600; 32768 hold a window of ~50


class Recorder:
    """The process's event buffers. ``active`` is the one check a hook makes."""

    def __init__(self):
        self.enabled = False     # enable() ran: the Ring wraps its runs (ring.py)
        self.active = False      # inside the recording window
        self.step = -1
        self.names = {"": 0}
        self._tls = threading.local()
        self._bufs = []          # [(thread ident, thread name, array, [count])]
        self._lock = threading.Lock()
        self._flow = 0
        self.dropped = 0
        self.inflight = 0        # bytes of started, not yet waited collectives (a counter)
        self.info = {}
        self.capacity = CAPACITY
        self._pause = None

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

    def _buf(self):
        b = getattr(self._tls, "buf", None)
        if b is None:
            th = threading.current_thread()
            b = (th.ident, th.name, np.zeros(self.capacity, EVENT), [0])
            with self._lock:
                self._bufs.append(b)
            self._tls.buf = b
        return b

    def _put(self, row: tuple):
        """Store one event (a tuple in EVENT's field order) in this thread's buffer: one assignment."""
        b = getattr(self._tls, "buf", None) or self._buf()
        arr, n = b[2], b[3]
        i = n[0]
        if i >= len(arr):
            self.dropped += 1
            return
        arr[i] = row
        n[0] = i + 1

    # ---- the events -------------------------------------------------------
    def span(self, name: str, cat: str, t0: float, t1: float, step=None, flow: int = 0, nbytes: int = 0,
             net: int = 0, group: int = 0, sched: str = "", dtype: str = "", ring: str = "",
             size: int = 0):
        """A complete span [t0, t1] (perf_counter seconds) on this thread."""
        i = self.names.get
        self._put((i(name) or self.intern(name), i(cat) or self.intern(cat), _X, self.step if step is None else step,
                   t0, t1, flow, nbytes, net, group, i(sched) or self.intern(sched), i(dtype) or self.intern(dtype),
                   i(ring) or self.intern(ring), size))

    def counter(self, name: str, value: int, t: float | None = None):
        t = time.perf_counter() if t is None else t
        self._put((self.intern(name), self.intern("counter"), ord("C"), self.step, t, t, 0, value, 0, 0, 0, 0, 0, 0))

    def flow(self, kind: str, fid: int, t: float, step=None):
        """One end (or the middle) of flow ``fid`` at t, bound to the span around t on this thread."""
        self._put((self.intern("collective"), self.intern("flow"), ord(kind), self.step if step is None else step,
                   t, t, fid, 0, 0, 0, 0, 0, 0, 0))

    def new_flow(self) -> int:
        with self._lock:
            self._flow += 1
            return self._flow

    # ---- a collective run (wrapped around the Executor's run by ring.py) ---
    def traced_run(self, run, ring):
        """``run(plan, background=False)`` with a span per call while active; ``run`` itself when not enabled."""
        if not self.enabled:
            return run
        rec = self

        def traced(plan, background=False):
            fl = getattr(rec._tls, "flow", None) or (0, None)     # (flow id, step) of a started job
            if not rec.active or (background and not fl[0]):
                return run(plan, background)      # off, or started before the window opened
            t0 = time.perf_counter()
            try:
                return run(plan, background)
            finally:
                t1 = time.perf_counter()
                step = rec.step if fl[1] is None else fl[1]
                rec.span(plan.name, "comm", t0, t1, step, fl[0], plan.sent, plan.sent_net, ring.size,
                         plan.sched, plan.dtype, getattr(ring, "trace_name", ""), plan.size)
                if fl[0]:
                    rec.flow("t", fl[0], t0 + (t1 - t0) / 2, step)
        return traced

    def started(self, pending, job):
        """A nonblocking collective started on this thread (``pending``, progress.py): its start span and
        flow (``pending.flow``), and ``job`` wrapped to carry the flow id and step to the progress thread."""
        fid, step, t0 = self.new_flow(), self.step, time.perf_counter()
        name, pending.flow = pending.name, fid
        rec = self

        def carried():
            rec._tls.flow = (fid, step)
            try:
                return job()
            finally:
                rec._tls.flow = (0, None)
        t1 = time.perf_counter()
        self.span(f"{name}.start", "comm_start", t0, t1, step, fid)
        self.flow("s", fid, t0 + (t1 - t0) / 2, step)
        self.inflight += pending.recv.nbytes
        self.counter("comm bytes in flight", self.inflight, t1)
        return carried

    def waited(self, name: str, fid: int, t0: float, t1: float, nbytes: int = 0):
        """The caller waited [t0, t1] for started collective ``fid``: its wait span ends the flow."""
        self.span(f"{name}.wait", "comm_wait", t0, t1, None, fid)
        if not fid:              # started before the window opened: a wait, no flow, not counted in flight
            return
        self.flow("f", fid, t0 + (t1 - t0) / 2)
        self.inflight = max(0, self.inflight - nbytes)
        self.counter("comm bytes in flight", self.inflight, t1)

    # ---- output -----------------------------------------------------------
    def events(self) -> list:
        """The recorded events as Chrome trace-event dicts (thread names first)."""
        pid = self.info.get("rank", 0)
        names = {i: s for s, i in self.names.items()}
        us = 1e6
        out = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": f"rank {pid}"}},
               {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}}]
        main = threading.main_thread().ident
        for tid, tname, arr, n in self._bufs:
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": tname}})
            for e, t0, t1 in _cut(arr[:n[0]], self.names):
                ph = PH[int(e["ph"])]
                ts = (t0 + self._wall) * us
                d = {"ph": ph, "name": names[int(e["name"])], "cat": names[int(e["cat"])], "pid": pid,
                     "tid": tid, "ts": round(ts, 3)}
                if ph == "X":
                    d["dur"] = round((t1 - t0) * us, 3)
                    a = {"step": int(e["step"])}
                    if d["cat"] == "comm":
                        a.update(op=d["name"], schedule=names[int(e["sched"])], bytes=int(e["bytes"]),
                                 size=int(e["size"]),
                                 intra_node_bytes=int(e["bytes"] - e["net"]), inter_node_bytes=int(e["net"]),
                                 dtype=names[int(e["dtype"])], group_size=int(e["group"]),
                                 ring=names[int(e["ring"])])
                    elif e["bytes"]:
                        a["bytes"] = int(e["bytes"])
                    if e["flow"]:
                        a["flow"] = int(e["flow"])
                    d["args"] = a
                elif ph == "C":
                    d["args"] = {d["name"]: int(e["bytes"])}
                else:                   # a flow end: bound to the enclosing span
                    d["id"] = int(e["flow"])
                    if ph == "f":
                        d["bp"] = "e"
                out.append(d)
                out.extend(_device_lane(d, main, len(out)))
        for tid, name in ((STREAMS["compute"], "stream 7: compute (the main thread as the device)"),
                          (STREAMS["comm"], "stream 13: collectives (as communication kernels)")):
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
        return out

    def write(self, path: str):
        """Write this rank's trace (atomically: a reader never sees half a file)."""
        doc = {"traceEvents": self.events(), "displayTimeUnit": "ms",
               "distributedInfo": dict(self.info), "ringzero": {"dropped_events": self.dropped,
                                                                 "capacity_per_thread": self.capacity}}
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as fh:
            json.dump(doc, fh)
            fh.flush()
        os.replace(tmp, path)


RECORDER = Recorder()
CUT = ("compute",)                          # spans cut around the waits inside them ...
WAITS = ("comm", "comm_wait", "comm_start", "comm_block")  # ... which are these, on the same thread


STREAMS = {"compute": 7, "comm": 13}       # the device lane's two "streams" (HTA reads args.stream)


def _device_lane(d, main, corr: int):
    """The CPU run presented as a device, for readers built around GPU kernels (Holistic Trace Analysis):
    a compute span of the main thread is a compute kernel on stream 7, a collective (on any thread) a
    communication kernel ("ncclKernel_<Op>", the names HTA matches) on stream 13, and
    each step span a ProfilerStep#N annotation (HTA's iterations). Copies: the thread lanes stay as they are;
    a kernel and its span share args.correlation (HTA keeps the kernels whose launch it finds)."""
    cat = d["cat"]
    if d["ph"] != "X":
        return ()
    if cat == "step":
        return ({**d, "name": f"ProfilerStep#{d['args']['step']}", "cat": "user_annotation"},)
    if cat == "compute" and d["tid"] == main:
        name, stream = d["name"], STREAMS["compute"]
    elif cat == "comm":
        name = "ncclKernel_" + "".join(w.capitalize() for w in d["name"].split("_")) + "_" + d["args"]["schedule"]
        stream = STREAMS["comm"]
    else:
        return ()
    d["args"]["correlation"] = corr
    return ({**d, "name": name, "cat": "kernel", "tid": stream,
             "args": {"stream": stream, "device": d["pid"], "correlation": corr, "step": d["args"]["step"]}},)


def _cut(events, names):
    """Yield (event, t0, t1): a compute span as its pieces outside the thread's waits and blocking
    collectives inside it (the passes' "prepare" and "finish" spans hold those), others whole."""
    cut = {names[c] for c in CUT if c in names}
    waits = {names[c] for c in WAITS if c in names}
    w = sorted((float(e["t0"]), float(e["t1"])) for e in events if int(e["cat"]) in waits and e["ph"] == ord("X"))
    for e in events:
        a, b = float(e["t0"]), float(e["t1"])
        if int(e["cat"]) not in cut or not w:
            yield e, a, b
            continue
        for wa, wb in w:
            if wb <= a or wa >= b:
                continue
            if wa > a:
                yield e, a, wa
            a = max(a, wb)
        if b > a:
            yield e, a, b


def rss_bytes() -> int:
    """This process's resident set (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
