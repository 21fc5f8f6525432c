"""The recorder's rows as a Chrome trace: the event dicts of one rank's file (comm/trace.py writes it).

What it is
    ``events(lanes, names, comms, pid, wall)``: every Lane's rows (W numbers each, FIELDS' order) as
    trace-event dicts, thread names first. What the recorder leaves to this point, so the run does not
    pay for it:
      - the names and a collective's args (op, schedule, bytes, ...) looked up from their ids;
      - a compute span cut around the waits and blocking collectives of its thread inside it (``_cut``);
      - a flow's three points (``s`` at its start span, ``t`` at its run, ``f`` at its wait), each at
        the middle of the span that carries the flow id;
      - the "comm bytes in flight" counter at each start and wait (the start and wait spans carry
        the bytes);
      - the run presented as a device for HTA (``_device_lane``).

What it is not
    The recorder (comm/trace.py) or a reader (tools/trace_summary.py).
"""
from __future__ import annotations

import threading

FIELDS = ("name", "cat", "ph", "step", "t0", "t1", "flow", "bytes", "comm")
W = len(FIELDS)            # numbers a row
COMM_ARGS = ("op", "schedule", "dtype", "ring", "group_size", "bytes", "inter_node_bytes", "size")
CUT = ("compute",)                          # spans cut around the waits inside them ...
WAITS = ("comm", "comm_wait", "comm_start", "comm_block")  # ... which are these, on the same thread
FLOW_PH = {"comm_start": "s", "comm": "t", "comm_wait": "f"}   # the span that carries a flow id: its point
STREAMS = {"compute": 7, "comm": 13}       # the device lane's two "streams" (HTA reads args.stream)
INFLIGHT = "comm bytes in flight"


def events(lanes, names: dict, comms: dict, pid: int, wall: float) -> list:
    """Chrome trace-event dicts of ``lanes`` ([Lane]); ``wall`` turns perf_counter seconds into the wall clock."""
    name = {i: s for s, i in names.items()}
    comm = {i: k for k, i in comms.items()}
    us = 1e6
    out = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": f"rank {pid}"}},
           {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}}]
    main = threading.main_thread().ident
    inflight = _inflight(lanes, name)
    for lane in lanes:
        tid = lane.ident
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": lane.name}})
        rows = lane.events()
        for (nm, cat, ph, step, _, _, flow, nbytes, c), t0, t1 in _cut(rows, names):
            ph, cat = chr(ph), name[cat]
            d = {"ph": ph, "name": name[nm], "cat": cat, "pid": pid, "tid": tid, "ts": round((t0 + wall) * us, 3)}
            if ph == "C":
                d["args"] = {d["name"]: int(nbytes)}
                out.append(d)
                continue
            d["dur"] = round((t1 + wall) * us, 3) - d["ts"]   # end - start on one grid: abutting spans meet exactly
            a = d["args"] = {"step": int(step)}
            if cat == "comm":                    # a collective: its args (a bare span() of one: the bytes alone)
                op, sched, dtype, ring, group, sent, net, size = comm.get(c) or (d["name"], "", "", "", 0, nbytes, 0, 0)
                a.update(op=op, schedule=sched, bytes=int(sent), size=int(size), intra_node_bytes=int(sent - net),
                         inter_node_bytes=int(net), dtype=dtype, group_size=int(group), ring=ring)
            elif nbytes and cat not in FLOW_PH:
                a["bytes"] = int(nbytes)
            if flow:
                a["flow"] = int(flow)
            out.append(d)
            if flow and cat in FLOW_PH:          # the flow's point, bound to this span (Perfetto: enclosing slice)
                f = {"ph": FLOW_PH[cat], "name": "collective", "cat": "flow", "pid": pid, "tid": tid,
                     "ts": round((t0 + (t1 - t0) / 2 + wall) * us, 3), "id": int(flow)}
                if f["ph"] == "f":
                    f["bp"] = "e"
                out.append(f)
            if (flow, cat) in inflight:          # a start or a wait: the bytes in flight after it
                out.append({"ph": "C", "name": INFLIGHT, "cat": "counter", "pid": pid, "tid": tid,
                            "ts": round((t1 + wall) * us, 3), "args": {INFLIGHT: inflight[(flow, cat)]}})
            out.extend(_device_lane(d, main, len(out)))
    for tid, nm in ((STREAMS["compute"], "stream 7: compute (the main thread as the device)"),
                    (STREAMS["comm"], "stream 13: collectives (as communication kernels)")):
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": nm}})
    return out


def _inflight(lanes, name: dict) -> dict:
    """{(flow id, "comm_start" | "comm_wait"): bytes in flight} after each start (+ its bytes) and each
    wait (- its bytes, not below 0) that carries a flow, in the order of their ends (all threads)."""
    marks = []
    for lane in lanes:
        for nm, cat, ph, step, t0, t1, flow, nbytes, c in lane.events():
            kind = name[cat]
            if flow and kind in ("comm_start", "comm_wait"):
                marks.append((t1, flow, kind, nbytes if kind == "comm_start" else -nbytes))
    out, total = {}, 0
    for t1, flow, kind, db in sorted(marks):
        total = max(0, total + db)
        out[(flow, kind)] = int(total)
    return out


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


def _cut(rows, names: dict):
    """Yield (row, t0, t1): a compute span as its pieces outside the thread's waits and blocking
    collectives inside it (the passes' "prepare" and "finish" spans hold those), others whole."""
    cut = {names[c] for c in CUT if c in names}
    waits = {names[c] for c in WAITS if c in names}
    X = ord("X")
    w = sorted((r[4], r[5]) for r in rows if r[1] in waits and r[2] == X)
    for r in rows:
        a, b = r[4], r[5]
        if r[1] not in cut or not w:
            yield r, a, b
            continue
        for wa, wb in w:
            if wb <= a or wa >= b:
                continue
            if wa > a:
                yield r, a, wa
            a = max(a, wb)
        if b > a:
            yield r, a, b
