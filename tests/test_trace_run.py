"""--trace on real trainer runs (mpirun, 2 ranks, a tiny GPT): the files, their bytes, their times, the straggler.

Each check reads the trace files against an independent figure:
- the Chrome trace-event format's required fields, thread names, distributedInfo, flows s -> t -> f;
- a step's collective bytes (the engine's rings) against the ledger's bytes_sent in the metrics file;
- the compute spans' sum against the engine's own compute_s in the metrics file (within 2 %);
- losses and gradient norms with --trace and without it, bit for bit;
- a rank SIGSTOPped by this test for 2 s inside a step is the straggler `summary` names;
- `merge` writes one valid JSON of every rank; bad flags and directories: one line, exit 2.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import trainer_cli as cli

from ringzero.tools import trace_summary as ts

# steps of a few ms (TINY's are ~1 ms, where a few µs of bookkeeping per wait is a percent)
STEPS = ["--steps", "6", "--trace-steps", "2:5", "--seed", "3", "--n-embd", "64", "--seq-len", "64"]


def _run(tmp_path, name, extra, n=2, env=None, trace=True):
    d = tmp_path / name
    args = cli.TINY + STEPS + ["--data", cli.corpus(tmp_path / "c.txt"), "--metrics", str(d) + ".jsonl"] + extra
    if trace:
        args += ["--trace", str(d)]
    rcs, out, err = cli.run(args, tmp_path, n=n, env=env)
    assert rcs == {r: 0 for r in range(n)}, cli.tail(out, err)
    return str(d)


def _metrics(d):
    with open(d + ".jsonl") as fh:
        return {r["step"]: r for r in map(json.loads, fh) if "step" in r and not r.get("summary")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Stage 2 without overlap, stage 3 with overlap (prefetch, flows), stage 2 with overlap (the update's
    gathers across the step boundary), and a stage-3 offloaded run (the reader and writer threads)."""
    tmp = tmp_path_factory.mktemp("trace")
    off = tmp / "off"
    off.mkdir()
    return {"s2": _run(tmp, "s2", ["--stage", "2", "--no-overlap"]),
            "s3o": _run(tmp, "s3o", ["--stage", "3", "--overlap"]),
            "s2o": _run(tmp, "s2o", ["--stage", "2", "--overlap"]),
            "off": _run(tmp, "off", ["--stage", "3", "--offload", "optimizer", "--offload-dir", str(off)])}


def test_events_have_the_format_fields_and_flows_join(runs):
    for key, d in runs.items():
        docs = ts.load(d)
        assert len(docs) == 2
        for r, doc in enumerate(docs):
            info = doc["distributedInfo"]
            assert info["rank"] == r and info["world_size"] == 2 and info["backend"] == "mpi" and info["nodes"] == 1
            ev = doc["traceEvents"]
            named = {e["tid"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
            flows = {}
            for e in ev:
                for f in ("ph", "name", "pid", "tid"):
                    assert f in e, (key, f, e)
                assert e["pid"] == r
                if e["ph"] == "M":
                    continue
                assert e["tid"] in named, (key, "no thread name", e)
                assert isinstance(e["ts"], float) and e["ts"] > 1e15, e        # µs since the epoch
                if e["ph"] == "X":
                    assert e["dur"] >= 0 and "step" in e["args"], e
                if e["cat"] == "comm":
                    for f in ("op", "schedule", "bytes", "size", "dtype", "group_size", "intra_node_bytes",
                              "inter_node_bytes"):
                        assert f in e["args"], (f, e)
                    assert e["args"]["intra_node_bytes"] + e["args"]["inter_node_bytes"] == e["args"]["bytes"]
                if e["ph"] in "stf":
                    flows.setdefault(e["id"], {})[e["ph"]] = e
            if key in ("s3o", "s2o"):
                assert flows, f"{key}: a run with overlap has started collectives"
                main = ts.main_tid(doc)
                for fid, f in flows.items():
                    assert set(f) == {"s", "t", "f"}, (key, fid, f)
                    assert f["s"]["ts"] <= f["t"]["ts"] and f["s"]["ts"] <= f["f"]["ts"], f
                    assert f["s"]["tid"] == f["f"]["tid"] == main != f["t"]["tid"], f
                    assert f["f"]["bp"] == "e"


def test_step_collective_bytes_equal_the_ledger(runs):
    for key, d in runs.items():
        m = _metrics(d)
        doc = ts.load(d)[0]                          # the metrics are rank 0's
        steps = sorted({e["args"]["step"] for e in doc["traceEvents"] if e.get("cat") == "step"})
        assert steps == [2, 3, 4], (key, steps)
        for s in steps:
            b = sum(e["args"]["bytes"] for e in doc["traceEvents"] if e.get("cat") == "comm"
                    and e["args"]["step"] == s and e["args"]["ring"] in ("shard", "replica"))
            assert b == m[s]["bytes_sent"], f"{key} step {s}: trace {b} B, ledger {m[s]['bytes_sent']} B"


def test_compute_spans_sum_to_the_engine_compute_time(runs):
    for key in ("s2", "s3o", "s2o"):
        d = runs[key]
        m, bd = _metrics(d), ts.breakdown(ts.load(d))
        for s, rows in bd.items():
            want = m[s]["compute_s"] * 1e6
            assert abs(rows[0]["compute"] - want) <= 0.02 * want, f"{key} step {s}: {rows[0]['compute']} vs {want} µs"


def test_offload_tiles_on_reader_and_writer_threads(runs):
    for doc in ts.load(runs["off"]):
        main = ts.main_tid(doc)
        io = [e for e in doc["traceEvents"] if e.get("cat") in ("offload_read", "offload_write")]
        assert {e["cat"] for e in io} == {"offload_read", "offload_write"}
        assert all(e["tid"] != main and e["args"]["bytes"] > 0 for e in io)
        # every tile the update computed was read (master, m, v in fp32: 12 B an element) before it
        reads = sum(e["args"]["bytes"] for e in io if e["cat"] == "offload_read")
        assert reads % 12 == 0 and reads > 0


def test_tracing_on_and_off_train_bitwise_alike(runs, tmp_path):
    off = _metrics(_run(tmp_path, "plain", ["--stage", "2", "--no-overlap"], trace=False))
    on = _metrics(runs["s2"])
    assert [(r["loss"], r["grad_norm"]) for r in on.values()] == [(r["loss"], r["grad_norm"]) for r in off.values()]


def test_merge_writes_every_rank(runs, tmp_path):
    out = tmp_path / "m.json"
    p = subprocess.run([sys.executable, "-m", "ringzero.trace", "merge", runs["s3o"], "-o", str(out)],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    per = [len(d["traceEvents"]) for d in ts.load(runs["s3o"])]
    assert {e["pid"] for e in doc["traceEvents"]} == {0, 1} and len(doc["traceEvents"]) == sum(per)


def test_a_stopped_rank_is_the_straggler(tmp_path):
    flag = tmp_path / "paused.pid"
    d = tmp_path / "slow"
    args = cli.TINY + STEPS + ["--data", cli.corpus(tmp_path / "c.txt"), "--trace", str(d)]
    p = cli.start(args, tmp_path, n=2, env={"RINGZERO_FAULT_TRACE_PAUSE": f"1:3:{flag}"})
    t0 = time.time()
    while not flag.exists() and p.poll() is None and time.time() - t0 < 120:
        time.sleep(0.02)
    assert flag.exists(), cli.tail(*p.communicate())
    pid = int(flag.read_text())
    os.kill(pid, signal.SIGSTOP)                 # rank 1, inside step 3 (Recorder.at_step)
    time.sleep(2.0)
    os.kill(pid, signal.SIGCONT)
    flag.unlink()
    rcs, out, err = cli.finish(p)
    assert rcs == {0: 0, 1: 0}, cli.tail(out, err)
    r = subprocess.run([sys.executable, "-m", "ringzero.trace", "summary", str(d)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("step 3: straggler")]
    assert line and line[0].startswith("step 3: straggler rank 1;"), r.stdout
    waited = float(line[0].split("waited for it ")[1].split(" ms")[0])
    assert waited >= 1900, r.stdout             # rank 0 waited the 2 s rank 1 stood still


def test_bad_flags_and_directories_exit_2(tmp_path):
    rcs, out, err = cli.run(cli.TINY + ["--steps", "4", "--trace", str(tmp_path / "t"), "--trace-steps", "5"],
                            tmp_path)
    assert set(rcs.values()) == {2} and "--trace-steps: expected A:B" in err and "Traceback" not in err, err
    rcs, out, err = cli.run(cli.TINY + ["--steps", "4", "--trace", str(tmp_path / "t"), "--trace-steps", "4:6"],
                            tmp_path)
    assert set(rcs.values()) == {2} and "expected A < --steps 4" in err, err
    r = subprocess.run([sys.executable, "-m", "ringzero.trace", "summary", str(tmp_path)], capture_output=True,
                       text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no rank*_trace.json" in r.stderr, r.stderr


def test_plot_trace_draws_a_step_and_refuses_one_not_recorded(runs, tmp_path):
    pytest.importorskip("matplotlib")
    from ringzero.tools import plot
    out = tmp_path / "step.png"
    assert plot.main(["trace", runs["off"], "--step", "3", "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    with pytest.raises(SystemExit) as e:
        plot.main(["trace", runs["off"], "--step", "9", "-o", str(out)])
    assert e.value.code == 2


def test_the_default_window_counts_from_a_resumed_step(tmp_path):
    base = cli.TINY + ["--data", cli.corpus(tmp_path / "c.txt"), "--save-dir", str(tmp_path / "ck")]
    rcs, out, err = cli.run(base + ["--steps", "4", "--save-every", "4"], tmp_path)
    assert rcs == {0: 0, 1: 0}, cli.tail(out, err)
    rcs, out, err = cli.run(base + ["--steps", "10", "--resume", "latest", "--trace", str(tmp_path / "t")], tmp_path)
    assert rcs == {0: 0, 1: 0}, cli.tail(out, err)
    assert sorted(ts.breakdown(ts.load(str(tmp_path / "t")))) == [9]     # steps 4 + 5 .. 4 + 8, cut at the run's end
