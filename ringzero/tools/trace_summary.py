"""``python -m ringzero.trace merge|summary DIR``: read the per-rank timelines that ``--trace DIR`` wrote.

What it is
    load(DIR)       the rank{R}_trace.json files, checked (every rank of distributedInfo.world_size present)
    merge(DIR)      one Chrome trace of every rank (pid = rank), for Perfetto's UI
    breakdown(docs) per step and rank (the step's span on the main thread):
                      compute   the compute spans (units' forward/backward, their casts; waits cut out)
                      exposed   collectives the main thread ran or waited for (incl. the step's barrier)
                      hidden    collectives on the progress thread less the waits for them
                      update    the update's span less the collectives inside it (stages 1-2's gathers)
                      offload   the reader's and writer's tile I/O (on their threads, beside the update)
                      idle      the step less compute, exposed, update and the norm's own time
    bandwidth(docs) per op and size S: time, algorithmic bandwidth S/t and bus bandwidth with nccl-tests'
                    factors (all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n)
    straggler       per step, the rank that waited least; the others' wait beyond its own is the time
                    they waited for it

What it is not
    The recorder (comm/trace.py) or the picture (tools/trace_plot.py). No MPI: a reader of files.
"""
from __future__ import annotations

import glob
import json
import os
from collections import defaultdict

MAIN_WAITS = ("comm", "comm_wait", "comm_start", "comm_block")   # nested: counted as their union
FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
          "reduce_scatter": lambda n: (n - 1) / n,
          # ZeRO++'s (comm/quantized.py): S is the unquantized buffer, so algbw and busbw are the effective
          # rates, what the unquantized call would need to keep up (the wire carries a quarter or an eighth)
          "q_all_gather": lambda n: (n - 1) / n, "q_reduce_scatter": lambda n: (n - 1) / n}


class TraceError(ValueError):
    """A trace directory that cannot be read: one line."""


def load(d: str) -> list:
    """[doc of rank 0, doc of rank 1, ...]. Raises TraceError."""
    paths = glob.glob(os.path.join(d, "rank*_trace.json"))
    if not paths:
        raise TraceError(f"{d}: no rank*_trace.json files; HINT: run the trainer with --trace {d}")
    docs = {}
    for p in paths:
        try:
            with open(p) as fh:
                doc = json.load(fh)
            rank = int(doc["distributedInfo"]["rank"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise TraceError(f"{p}: not a ringzero trace ({e})") from None
        docs[rank] = doc
    n = int(docs[min(docs)]["distributedInfo"]["world_size"])
    missing = sorted(set(range(n)) - set(docs))
    if missing:
        raise TraceError(f"{d}: expected {n} ranks (world_size), missing rank(s) {missing}")
    return [docs[r] for r in range(n)]


def merge(d: str, out: str | None = None) -> str:
    """Write every rank's events into one file (default DIR/merged_trace.json); returns its path."""
    docs = load(d)
    out = out or os.path.join(d, "merged_trace.json")
    merged = {"traceEvents": [e for doc in docs for e in doc["traceEvents"]], "displayTimeUnit": "ms",
              "distributedInfo": {**docs[0]["distributedInfo"], "ranks": len(docs)}}
    tmp = out + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(merged, fh)
    os.replace(tmp, out)
    return out


def main_tid(doc) -> int:
    for e in doc["traceEvents"]:
        if e["ph"] == "M" and e["name"] == "thread_name" and e["args"]["name"] == "MainThread":
            return e["tid"]
    raise TraceError(f"rank {doc['distributedInfo']['rank']}: no MainThread in the trace")


def _inside(e, a, b) -> bool:
    return e["ts"] >= a and e["ts"] + e.get("dur", 0) <= b


def _union(spans) -> float:
    """µs covered by the spans (nested and overlapping ones counted once)."""
    tot, end = 0.0, float("-inf")
    for a, b in sorted((e["ts"], e["ts"] + e["dur"]) for e in spans):
        if b > end:
            tot += b - max(a, end)
            end = b
    return tot


def breakdown(docs) -> dict:
    """{step: {rank: {wall, compute, exposed, barrier, hidden, comm, update, norm, offload, idle}}} in µs."""
    out = defaultdict(dict)
    for doc in docs:
        rank, tid = doc["distributedInfo"]["rank"], main_tid(doc)
        ev = [e for e in doc["traceEvents"] if e["ph"] == "X"]
        by_step = defaultdict(list)
        for e in ev:
            by_step[e["args"]["step"]].append(e)
        for e in ev:
            if e["cat"] != "step":
                continue
            s, a, b = e["args"]["step"], e["ts"], e["ts"] + e["dur"]
            es = by_step[s]
            main = [x for x in es if x["tid"] == tid]
            row = dict.fromkeys(("compute", "exposed", "barrier", "hidden", "comm", "update", "norm", "offload"),
                                0.0)
            row["wall"] = e["dur"]
            waits = [x for x in main if x["cat"] in MAIN_WAITS]
            row["exposed"] = _union([x for x in waits if _inside(x, a, b)])
            row["barrier"] = _union([x for x in waits if not _inside(x, a, b)])
            for x in main:
                if x["cat"] == "compute" and _inside(x, a, b):
                    row["compute"] += x["dur"]
                elif x["cat"] in ("update", "norm"):
                    lo, hi = x["ts"], x["ts"] + x["dur"]
                    row[x["cat"]] += x["dur"] - _union([w for w in waits if _inside(w, lo, hi)])
            bg = sum(x["dur"] for x in es if x["cat"] == "comm" and x["tid"] != tid)
            row["comm"] = sum(x["dur"] for x in es if x["cat"] == "comm")
            row["hidden"] = max(0.0, bg - sum(x["dur"] for x in main if x["cat"] == "comm_wait"))
            row["offload"] = sum(x["dur"] for x in es if x["cat"] in ("offload_read", "offload_write"))
            row["idle"] = max(0.0, row["wall"] - row["compute"] - row["exposed"] - row["update"] - row["norm"])
            out[s][rank] = row
    return dict(sorted(out.items()))


def _merged(spans) -> list:
    """[(start, end)] of the spans' union, in order."""
    out = []
    for a, b in sorted((e["ts"], e["ts"] + e["dur"]) for e in spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def overlap(doc) -> float:
    """The fraction of this rank's collective time (every collective, on any thread) during which its main
    thread computed: HTA's computation/communication overlap, over the whole recorded window."""
    tid = main_tid(doc)
    ev = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    comm = _merged([e for e in ev if e["cat"] == "comm"])
    comp = _merged([e for e in ev if e["cat"] == "compute" and e["tid"] == tid])
    both, j = 0.0, 0
    for a, b in comm:
        while j < len(comp) and comp[j][1] <= a:
            j += 1
        k = j
        while k < len(comp) and comp[k][0] < b:
            both += min(b, comp[k][1]) - max(a, comp[k][0])
            k += 1
    total = sum(b - a for a, b in comm)
    return both / total if total else 0.0


def stragglers(bd: dict) -> dict:
    """{step: (straggler rank, the others' mean wait for it µs, their max µs)}: the rank that waited least
    (in collectives and the step's barrier); the others waited that much longer for it."""
    out = {}
    for s, rows in bd.items():
        if len(rows) < 2:
            continue
        w = {r: v["exposed"] + v["barrier"] for r, v in rows.items()}
        slow = min(w, key=w.get)
        extra = [w[r] - w[slow] for r in w if r != slow]
        out[s] = (slow, sum(extra) / len(extra), max(extra))
    return out


def bandwidth(docs) -> list:
    """[(op, group size, S bytes, calls, mean µs, algbw GB/s, busbw GB/s)] over every rank's collectives of the
    engine's rings (shard, replica, hpZ's node ring), on whichever thread ran them."""
    acc = defaultdict(lambda: [0, 0.0])
    for doc in docs:
        for e in doc["traceEvents"]:
            if e["ph"] == "X" and e["cat"] == "comm" and e["args"].get("ring") in ("shard", "replica", "hpz"):
                a = e["args"]
                k = (a["op"], a["group_size"], a["size"])
                acc[k][0] += 1
                acc[k][1] += e["dur"]
    rows = []
    for (op, n, size), (calls, us) in sorted(acc.items()):
        t = us / calls
        alg = size / (t * 1e3) if t > 0 else 0.0      # bytes/µs / 1e3 = GB/s
        rows.append((op, n, size, calls, t, alg, alg * FACTOR.get(op, lambda n: 1.0)(n)))
    return rows


def summary_text(d: str) -> str:
    docs = load(d)
    bd = breakdown(docs)
    if not bd:
        raise TraceError(f"{d}: no step spans in the traces (was the window past the run's last step?)")
    info = docs[0]["distributedInfo"]
    ms = lambda us: f"{us / 1e3:9.2f}"  # noqa: E731
    lines = [f"ringzero trace {d}: {len(docs)} ranks, {info.get('nodes', 1)} node(s), stage {info.get('stage')}, "
             f"{info.get('precision')}, overlap {'on' if info.get('overlap') else 'off'}",
             "step rank      wall   compute   exposed    hidden    update   offload   barrier      idle   (ms)"]
    for s, rows in bd.items():
        for r, v in sorted(rows.items()):
            lines.append(f"{s:4d} {r:4d} " + " ".join(ms(v[k]) for k in ("wall", "compute", "exposed", "hidden",
                                                                         "update", "offload", "barrier", "idle")))
    lines.append("collective         n           S   calls    mean us   algbw GB/s   busbw GB/s")
    for op, n, size, calls, t, alg, bus in bandwidth(docs):
        lines.append(f"{op:16s} {n:3d} {size:11,d} {calls:7d} {t:10.1f} {alg:12.3f} {bus:12.3f}")
    for doc in docs:
        lines.append(f"rank {doc['distributedInfo']['rank']}: computation ran during {100 * overlap(doc):.1f} % of "
                     "the collectives' time (the comm/comp overlap)")
    st = stragglers(bd)
    for s, (slow, mean, mx) in st.items():
        lines.append(f"step {s}: straggler rank {slow}; the others waited for it {mean / 1e3:.2f} ms "
                     f"(mean), {mx / 1e3:.2f} ms (max)")
    if st:               # over the window: the rank the others waited for longest in all
        waited = defaultdict(float)
        for slow, mean, _ in st.values():
            waited[slow] += mean
        r = max(waited, key=waited.get)
        k = sum(1 for v in st.values() if v[0] == r)
        lines.append(f"straggler over steps {min(st)}-{max(st)}: rank {r} ({k} of {len(st)} steps; the others "
                     f"waited for it {waited[r] / 1e3:.2f} ms in all, mean over them)")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse
    import sys
    ap = argparse.ArgumentParser(prog="python -m ringzero.trace",
                                 description="Read the per-rank timelines of `python -m ringzero.train --trace DIR`.")
    sub = ap.add_subparsers(dest="what", required=True)
    m = sub.add_parser("merge", help="one Chrome trace of every rank, for Perfetto (ui.perfetto.dev)")
    m.add_argument("dir")
    m.add_argument("-o", "--out", help="the merged file (default DIR/merged_trace.json)")
    s = sub.add_parser("summary", help="per step and rank: compute, communication hidden and exposed, update, "
                                       "offload I/O, idle; bandwidth per op; the straggler")
    s.add_argument("dir")
    a = ap.parse_args(argv)
    try:
        if a.what == "merge":
            print(f"wrote {merge(a.dir, a.out)}")
        else:
            print(summary_text(a.dir))
    except TraceError as e:
        print(f"ringzero.trace: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:          # `summary DIR | head`: the reader left; no traceback at exit either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
