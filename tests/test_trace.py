"""The recorder (ringzero/comm/trace.py) and the reader (ringzero/tools/trace_summary.py) without MPI.

Against hand-made timelines: the cut of compute spans around waits, a full buffer, the written file's
format, the union and overlap arithmetic of summary, the straggler rule, bus bandwidth factors, and that
tracing off leaves the Ring's run untouched. The runs themselves: tests/test_trace_run.py.
"""
import json
import threading
import time

import pytest

from ringzero.comm.trace import Recorder
from ringzero.tools import trace_summary as ts


def _rec(capacity=64):
    r = Recorder()
    r.enable(0, 1, capacity=capacity)
    r.active = True
    return r


def test_off_leaves_the_run_as_it_is_and_records_nothing():
    r = Recorder()
    run = object()
    assert r.traced_run(run, None) is run            # not enabled: the Executor's own run, no wrapper
    r.enable(0, 1)
    calls = []

    class Plan:
        name, sent, sent_net, sched, dtype, size = "all_gather", 8, 0, "ring", "float16", 16
    wrapped = r.traced_run(lambda p, bg=False: calls.append(p), type("R", (), {"size": 2})())
    wrapped(Plan)                                     # enabled but outside the window: not recorded
    assert calls == [Plan] and r._bufs == []


def test_compute_spans_are_cut_around_the_waits_inside_them(tmp_path):
    r = _rec()
    r.span("prepare 0", "compute", 1.0, 2.0, step=3)
    r.span("all_gather", "comm", 1.2, 1.3, step=3)     # blocking, inside
    r.span("reduce waits", "comm_block", 1.5, 1.8, step=3)
    r.span("reduce_scatter.wait", "comm_wait", 1.6, 1.7, step=3)   # nested in the block
    p = tmp_path / "rank0_trace.json"
    r.write(str(p))
    doc = json.loads(p.read_text())
    pieces = sorted((e["ts"], e["dur"]) for e in doc["traceEvents"] if e.get("cat") == "compute")
    t = [(round(a - pieces[0][0]), round(d)) for a, d in pieces]
    assert t == [(0, 200_000), (300_000, 200_000), (800_000, 200_000)]     # µs: 1.0-1.2, 1.3-1.5, 1.8-2.0
    assert doc["distributedInfo"] == {"rank": 0, "world_size": 1, "backend": "mpi", "nodes": 1}
    kernels = [e for e in doc["traceEvents"] if e.get("cat") == "kernel"]
    assert sorted(e["args"]["stream"] for e in kernels) == [7, 7, 7, 13]   # compute pieces and the collective
    assert ts.overlap(doc) == 0.0


def test_a_full_buffer_drops_and_counts(tmp_path):
    r = _rec(capacity=4)
    for i in range(10):
        r.span("forward 0", "compute", float(i), i + 0.5)
    assert r.dropped == 6
    r.write(str(tmp_path / "t.json"))
    assert json.loads((tmp_path / "t.json").read_text())["ringzero"]["dropped_events"] == 6


def test_each_thread_gets_its_own_buffer_and_name():
    r = _rec()
    r.span("forward 0", "compute", 0.0, 1.0)
    th = threading.Thread(target=lambda: r.span("all_gather", "comm", 0.2, 0.4), name="ringzero-progress-0")
    th.start()
    th.join()
    names = {e["args"]["name"] for e in r.events() if e["name"] == "thread_name"}
    assert {"MainThread", "ringzero-progress-0"} <= names and len(r._bufs) == 2


def _doc(rank, spans):
    ev = [{"ph": "M", "name": "thread_name", "pid": rank, "tid": 1, "args": {"name": "MainThread"}}]
    for name, cat, ts_, dur, tid in spans:
        ev.append({"ph": "X", "name": name, "cat": cat, "pid": rank, "tid": tid, "ts": ts_, "dur": dur,
                   "args": {"step": 0, "op": name, "group_size": 2, "size": 1000, "ring": "shard"}})
    return {"traceEvents": ev, "distributedInfo": {"rank": rank, "world_size": 2}}


def test_breakdown_overlap_straggler_and_bandwidth():
    # rank 0 computes 0-100 µs, its progress thread runs a collective 50-150, the step waits for it 100-150
    d0 = _doc(0, [("step 0", "step", 0, 160, 1), ("forward 0", "compute", 0, 100, 1),
                  ("all_gather", "comm", 50, 100, 2), ("all_gather.wait", "comm_wait", 100, 50, 1)])
    # rank 1: 150 µs of compute, a 10 µs blocking collective
    d1 = _doc(1, [("step 0", "step", 0, 160, 1), ("forward 0", "compute", 0, 150, 1),
                  ("all_gather", "comm", 150, 10, 1)])
    bd = ts.breakdown([d0, d1])
    assert bd[0][0]["compute"] == 100 and bd[0][0]["exposed"] == 50 and bd[0][0]["hidden"] == 50
    assert bd[0][1]["exposed"] == 10 and bd[0][1]["idle"] == 0
    assert ts.overlap(d0) == pytest.approx(0.5) and ts.overlap(d1) == 0.0
    assert ts.stragglers(bd) == {0: (1, 40, 40)}     # rank 1 waited least; rank 0 waited 40 µs more
    rows = {(op, t): (alg, bus) for op, n, size, calls, t, alg, bus in ts.bandwidth([d0, d1])}
    # 2 calls of S = 1000 B, mean (100 + 10) / 2 = 55 µs: algbw = 1000 / 55e-6 B/s, busbw (n-1)/n of it
    alg, bus = rows[("all_gather", 55.0)]
    assert alg == pytest.approx(1000 / 55e-6 / 1e9) and bus == pytest.approx(alg / 2)


def test_union_counts_nested_waits_once():
    spans = [{"ts": 0, "dur": 10}, {"ts": 2, "dur": 3}, {"ts": 8, "dur": 5}, {"ts": 20, "dur": 1}]
    assert ts._union(spans) == 14


def test_a_missing_rank_is_one_line(tmp_path):
    (tmp_path / "rank0_trace.json").write_text(json.dumps(_doc(0, [])))
    with pytest.raises(ts.TraceError, match=r"expected 2 ranks \(world_size\), missing rank\(s\) \[1\]"):
        ts.load(str(tmp_path))
    (tmp_path / "rank1_trace.json").write_text("{not json")
    assert ts.main(["summary", str(tmp_path)]) == 2


@pytest.mark.mpi
@pytest.mark.parametrize("stage,overlap,zpp", [("2", False, ""), ("2", True, ""), ("3", True, ""),
                                              ("hybrid", True, ""), ("3", True, "qwz,hpz,qgz"),
                                              ("3", False, "qwz,qgz")])
def test_recorded_bytes_are_the_ledgers_across_emulated_nodes(comm, stage, overlap, zpp):
    """Each step's collective bytes in the trace, and their inter-node part, equal the engine's ledger
    (last_step_ledger, last_step_internode) on every rank, on two emulated nodes where n allows; with
    --zeropp the quantized calls (started or blocking) and hpZ's node ring are in both."""
    from conftest import assert_all
    from test_internode import node_layouts
    from test_zero import batches, engine

    from ringzero.comm.trace import RECORDER
    n = comm.size
    lay = [x for x in node_layouts(n) if x[1] == 2] or node_layouts(n)[:1]
    if not lay or (stage == "hybrid" and lay[0][1] < 2):
        pytest.skip(f"no layout of {n} ranks on two nodes")
    labels = lay[0][3]
    RECORDER.enable(comm.rank, n, 2)         # before the engine: its Rings wrap their runs
    try:
        from ringzero.runtime.zeropp import ZeroPPPolicy
        eng = engine(comm, stage, nodes=labels, overlap=overlap, zeropp=ZeroPPPolicy.parse(zpp, block=64))
        if zpp and "hpz" in zpp and eng.topology.zeropp.node_ring.size < 2:
            pytest.skip("hpz needs two ranks a node")
        data = batches(comm, n, comm.rank)
        got, want = [], []
        RECORDER.active = True
        for s in range(3):
            x, y = data.get(s)
            eng.step(x, y, 1e-3)
            want.append((sum(eng.last_step_ledger.values()), sum(eng.last_step_internode.values())))
        eng.wait_params()
        RECORDER.active = False
        ev = [e for e in RECORDER.events()
              if e.get("cat") == "comm" and e["args"]["ring"] in ("shard", "replica", "hpz")]
        for s in range(3):
            mine = [e["args"] for e in ev if e["args"]["step"] == s]
            got.append((sum(a["bytes"] for a in mine), sum(a["inter_node_bytes"] for a in mine)))
    finally:
        RECORDER.disable()
    assert_all(comm, got == want and all(w[1] > 0 for w in want), f"rank {comm.rank}: trace {got}, ledger {want}")


@pytest.mark.mpi
@pytest.mark.standin
def test_a_device_run_records_its_collectives_and_flows(comm, monkeypatch):
    """--device cuda under the strict CuPy stand-in, stage 3 with overlap: the started collectives' jobs are
    wrapped by the stream order and then by the recorder; a step's bytes are still the ledger's."""
    import cupy_standin
    from conftest import assert_all
    from test_standin import _run

    from ringzero.comm.trace import RECORDER
    cupy_standin.install(monkeypatch)
    RECORDER.enable(comm.rank, comm.size)
    RECORDER.active = True
    try:
        _, _, eng = _run(comm, "3", "cuda", steps=2, overlap=True)
        eng.wait_params()
        ev = RECORDER.events()
    finally:
        RECORDER.disable()
    got = sum(e["args"]["bytes"] for e in ev if e.get("cat") == "comm" and e["args"]["step"] == 1
              and e["args"]["ring"] == "shard")
    flows = {e["ph"] for e in ev if e["ph"] in "stf"}
    want = sum(eng.last_step_ledger.values())
    ok = got == want and (comm.size == 1 or (want > 0 and flows == set("stf")))
    assert_all(comm, ok, f"trace {got} B, ledger {want} B, flow phases {flows}")


def test_a_job_started_before_the_window_is_not_counted_in_it():
    """The ledger counts a started collective when it starts: one started before the window opened and run
    inside it belongs to no recorded step, also after a traced job ran on the same thread."""
    r = _rec()

    class Plan:
        name, sent, sent_net, sched, dtype, size = "all_gather", 8, 0, "ring", "float16", 16
    run = r.traced_run(lambda p, bg=False: None, type("R", (), {"size": 2, "trace_name": "shard"})())

    class Pending:
        name, recv, flow = "all_gather", type("B", (), {"nbytes": 16})(), 0
    job = r.started(Pending, lambda: run(Plan, True))   # started in the window: carried to the thread
    seen = []

    def worker():
        job()                      # traced, with its flow
        run(Plan, True)            # started before the window: not recorded
        seen.append(True)
    th = threading.Thread(target=worker)
    th.start()
    th.join()
    comm = [e for e in r.events() if e.get("cat") == "comm"]
    assert seen and len(comm) == 1 and comm[0]["args"]["flow"] == Pending.flow > 0


def test_flows_and_bytes_in_flight_are_made_when_the_file_is_written():
    """Two collectives started (16 B, then 32 B), run on another thread, the first waited for: the file has
    each flow's s, t, f at the middle of its start, run and wait spans, and the in-flight counter a running
    sum computed here by hand: 16, 48, then 32 after the wait."""
    r = _rec()

    class Plan:
        name, sent, sent_net, sched, dtype, size = "all_gather", 8, 0, "ring", "float16", 16
    run = r.traced_run(lambda p, bg=False: None, type("R", (), {"size": 2, "trace_name": "shard"})())
    pend = [type("P", (), {"name": "all_gather", "recv": type("B", (), {"nbytes": b})(), "flow": 0})()
            for b in (16, 32)]
    jobs = [r.started(p, lambda: run(Plan, True)) for p in pend]
    th = threading.Thread(target=lambda: [j() for j in jobs])
    th.start()
    th.join()
    t = time.perf_counter()                      # after the starts (the counter's order is the ends' order)
    r.waited("all_gather", pend[0].flow, t, t + 1e-4, 16)
    ev = r.events()
    counters = sorted((e for e in ev if e["ph"] == "C"), key=lambda e: e["ts"])
    counts = [e["args"]["comm bytes in flight"] for e in counters]
    assert counts == [16, 48, 32]
    spans = {(e["cat"], e["args"].get("flow")): e for e in ev if e["ph"] == "X"}
    for e in ev:
        if e["ph"] in "stf":
            cat = {"s": "comm_start", "t": "comm", "f": "comm_wait"}[e["ph"]]
            sp = spans[(cat, e["id"])]
            assert e["tid"] == sp["tid"] and abs(e["ts"] - (sp["ts"] + sp["dur"] / 2)) < 1.0
    phases = sorted((e["id"], e["ph"]) for e in ev if e["ph"] in "stf")
    f0, f1 = pend[0].flow, pend[1].flow
    assert phases == sorted([(f0, "s"), (f0, "t"), (f0, "f"), (f1, "s"), (f1, "t")])


def test_recording_keeps_no_object_per_event():
    """10,000 spans into a preallocated lane keep only their times: tracemalloc counts what stays allocated,
    two floats an event (24 B each, made by the caller); a tuple or dict kept per event would add 80 B or more."""
    import tracemalloc
    r = _rec(capacity=20_000)
    r.span("forward 0", "compute", 0.0, 1.0)          # the lane, made at the first event
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(10_000):
        r.span("forward 0", "compute", float(i), i + 0.5)
    kept = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert kept / 10_000 < 64 and r.recorded() == 10_001, f"{kept / 10_000:.1f} B kept an event"
