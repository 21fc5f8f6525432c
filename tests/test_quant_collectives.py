"""ZeRO++'s quantized collectives (ringzero.comm.quantized) against a NumPy quantize-then-reduce reference.

References: every rank regenerates every rank's data from its seed; a quantizer written here with
np.pad and whole-array NumPy (checked against test_quant's per-element loop), the documented
summation orders replayed in float32, the exact float64 sum with the half-step error bound, and
the bytes each op must put on the wire written out from the shapes. Run under mpirun at 1, 2, 3,
4 and 8 ranks, on one host and on every emulated uniform node map (test_node_aware.layouts).
"""
import os
import sys
import time

import numpy as np
import pytest
from conftest import assert_all
from test_collectives import lengths
from test_node_aware import layouts
from test_quant import ref_quant, ref_values

from ringzero.comm.qledger import QLedger, zeropp_volume
from ringzero.comm.quant import Quant
from ringzero.comm.quantized import QuantizedComm
from ringzero.comm.ring import Ring

sys.path.insert(0, os.path.dirname(__file__))
import cupy_standin  # noqa: E402

ml_dtypes = pytest.importorskip("ml_dtypes")
DTYPES = ("float32", "float16", "bfloat16")


def qdq(x, bits, block):
    """(dequant(quant(x)) as float32, the step of each element), written with np.pad and whole arrays."""
    x = np.asarray(x, np.float32)
    L = len(x)
    if L == 0:
        return x.copy(), x.copy()
    qmax = np.float32(127 if bits == 8 else 7)
    X = np.pad(x, (0, -L % block)).reshape(-1, block)
    s = (np.abs(X).max(axis=1) / qmax).astype(np.float32)
    ok = np.isfinite(s) & (s > 0)
    c = np.zeros_like(X)
    c[ok] = np.clip(np.rint(X[ok] / s[ok, None]), -qmax, qmax)
    v = (c * s[:, None]).astype(np.float32)
    return v.reshape(-1)[:L], np.repeat(s, block)[:L]


def data(rank, L, dtype, seed=0):
    rng = np.random.default_rng(1000 * seed + rank)
    x = rng.standard_normal(L) * (1 + 3 * (rng.random(L) < 0.01))   # a few outliers
    return x.astype(dtype)


def summed(terms):
    """First term as is, then each added in float32, in the order given."""
    acc = terms[0].copy()
    for t in terms[1:]:
        acc = (acc + t).astype(np.float32)
    return acc


def ref_reduce_scatter(n, r, m, dtype, bits, block, nodes, op="sum", xs=None):
    """Block r of the quantized two-hop (or one-hop) sum, and its error bound against the exact sum."""
    xs = xs or [data(p, n * m, dtype).astype(np.float32) for p in range(n)]
    chunk = [qdq(x[r * m:(r + 1) * m], bits, block) for x in xs]
    if nodes is None or not nodes.uniform:
        out = summed([v for v, _ in chunk])
        bound = sum(s for _, s in chunk) / 2
    else:
        N, P = nodes.count, nodes.ppn
        at = {(nodes.node_of[b], nodes.local_of[b]): b for b in range(n)}
        parts = [summed([chunk[at[k, i]][0] for i in range(P)]) for k in range(N)]
        hop2 = [qdq(p, bits, block) for p in parts]
        out = summed([v for v, _ in hop2])
        bound = sum(s for _, s in chunk) / 2 + sum(s for _, s in hop2) / 2
    exact = np.sum([x[r * m:(r + 1) * m].astype(np.float64) for x in xs], axis=0)
    if op == "avg":
        out = (out / np.float32(n)).astype(np.float32)
        exact, bound = exact / n, bound / n
    return out, exact, bound


def maps(comm):
    """(name, labels or None): one host, every uniform emulated node map of this size, and an uneven one
    (one hop, but some peers across the network)."""
    n = comm.size
    return [("one host", None)] + layouts(n) + ([("uneven", [0] * (n - 1) + [1])] if n >= 3 else [])


def test_reference_quantizer_matches_the_loop():
    rng = np.random.default_rng(2)
    for bits in (8, 4):
        for L, block in ((0, 4), (1, 4), (13, 4), (97, 32), (300, 2048)):
            x = rng.standard_normal(L).astype(np.float32)
            codes, s = ref_quant(x, bits, block)
            assert np.array_equal(qdq(x, bits, block)[0], ref_values(codes, s, block))


@pytest.mark.mpi
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_gather_against_numpy(comm, bits, dtype):
    n, r, bad = comm.size, comm.rank, []
    for name, labels in maps(comm):
        ring = Ring(comm, nodes=labels)
        qc = QuantizedComm(ring, weights=Quant(bits, 5))
        for m in lengths(n):
            recv = np.full(n * m, 7, dtype)
            qc.all_gather(data(r, m, dtype), recv)
            want = np.concatenate([qdq(data(p, m, dtype), bits, 5)[0] for p in range(n)] + [np.zeros(0)])
            if not np.array_equal(recv, want.astype(np.float32).astype(dtype)):
                bad.append(f"{name} m={m}: {int(np.sum(recv != want.astype(dtype)))} wrong")
        qc.free()
        ring.free()
    assert_all(comm, not bad, "; ".join(bad))


@pytest.mark.mpi
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_scatter_bitwise_and_within_half_a_step(comm, bits, dtype):
    n, r, bad = comm.size, comm.rank, []
    for name, labels in maps(comm):
        ring = Ring(comm, nodes=labels)
        qc = QuantizedComm(ring, grads=Quant(bits, 3))
        for m in lengths(n):
            for op in ("sum", "avg"):
                recv = np.full(m, 7, dtype)
                qc.reduce_scatter(data(r, n * m, dtype), recv, op=op)
                want, exact, bound = ref_reduce_scatter(n, r, m, dtype, bits, 3, ring.nodes, op)
                if not np.array_equal(recv, want.astype(dtype)):
                    bad.append(f"{name} m={m} {op}: {int(np.sum(recv != want.astype(dtype)))} wrong")
                slack = 1e-5 * np.abs(exact) + (np.abs(exact) * 2.0 ** -7 if dtype != "float32" else 0)
                if not np.all(np.abs(want - exact) <= bound * (1 + 1e-5) + slack + 1e-30):
                    bad.append(f"{name} m={m} {op}: beyond half a step of the exact sum")
        qc.free()
        ring.free()
    assert_all(comm, not bad, "; ".join(bad))


@pytest.mark.mpi
def test_reduce_scatter_in_place_and_error_feedback(comm):
    n, r, m, bits, block = comm.size, comm.rank, 50, 4, 8
    bad = []
    for name, labels in maps(comm):
        ring = Ring(comm, nodes=labels)
        qc = QuantizedComm(ring, grads=Quant(bits, block))
        res = np.zeros(n * m, np.float32)
        res_all = [np.zeros(n * m, np.float32) for _ in range(n)]
        for step in range(3):
            buf = data(r, n * m, "float32", seed=step)
            qc.reduce_scatter(buf, buf[r * m:(r + 1) * m], residual=res)          # in place
            xs = []
            for p in range(n):                       # the reference's error feedback, per rank
                x = (data(p, n * m, "float32", seed=step) + res_all[p]).astype(np.float32)
                v = np.concatenate([qdq(x[b * m:(b + 1) * m], bits, block)[0] for b in range(n)])
                res_all[p] = (x - v).astype(np.float32)
                xs.append(x)
            want, _, _ = ref_reduce_scatter(n, r, m, "float32", bits, block, ring.nodes, xs=xs)
            if not np.array_equal(buf[r * m:(r + 1) * m], want):
                bad.append(f"{name} step {step}: result")
            if not np.array_equal(res, res_all[r]):
                bad.append(f"{name} step {step}: residual")
        qc.free()
        ring.free()
    assert_all(comm, not bad, "; ".join(bad))


@pytest.mark.mpi
def test_started_calls_give_the_reference_bits_in_one_order(comm):
    """The nonblocking forms (the engine's overlap): a plain all-reduce, a quantized all-gather and an
    error-feedback reduce-scatter started on one Ring, then a blocking quantized call made while they
    are in flight (it waits its turn). Each against NumPy: MPI's own Allreduce, qdq, the two-hop sums;
    ``ring.owner`` names a started call over its buffers until it is waited for."""
    n, r, m, bits, block = comm.size, comm.rank, 37, 4, 8
    bad = []
    for name, labels in maps(comm):
        ring = Ring(comm, nodes=labels)
        qc = QuantizedComm(ring, weights=Quant(8, block), grads=Quant(bits, block))
        ar = data(r, 5000, "float32", seed=3)
        want_ar = np.empty_like(ar)
        comm.Allreduce(ar, want_ar)
        ag_send, ag = data(r, m, "float16", seed=4), np.full(n * m, 7, np.float16)
        g, mine, res = data(r, n * m, "float32", seed=5), np.full(m, 7, np.float32), np.zeros(n * m, np.float32)
        p_ar = ring.all_reduce_start(ar)
        p_ag = qc.all_gather_start(ag_send, ag)
        p_rs = qc.reduce_scatter_start(g, mine, residual=res)
        if ring.owner(mine) is not p_rs:
            bad.append(f"{name}: ring.owner does not name the started reduce-scatter")
        late, late_recv = data(r, m, "float32", seed=6), np.full(n * m, 7, np.float32)
        qc.all_gather(late, late_recv)                # blocking, while the three may still run
        for p in (p_ar, p_ag, p_rs):
            p.wait()
        # MPI's Allreduce sums in its own order: within fp32 rounding of it
        if not np.allclose(ar, want_ar, rtol=1e-5, atol=1e-5 * n):
            bad.append(f"{name}: all-reduce")
        want_ag = np.concatenate([qdq(data(p, m, "float16", seed=4), 8, block)[0] for p in range(n)])
        if not np.array_equal(ag, want_ag.astype(np.float16)):
            bad.append(f"{name}: started all-gather")
        want_late = np.concatenate([qdq(data(p, m, "float32", seed=6), 8, block)[0] for p in range(n)])
        if not np.array_equal(late_recv, want_late):
            bad.append(f"{name}: the blocking all-gather behind them")
        xs = [data(p, n * m, "float32", seed=5) for p in range(n)]
        want_rs, _, _ = ref_reduce_scatter(n, r, m, "float32", bits, block, ring.nodes, xs=xs)
        want_res = xs[r] - np.concatenate([qdq(xs[r][b * m:(b + 1) * m], bits, block)[0] for b in range(n)])
        if not np.array_equal(mine, want_rs):
            bad.append(f"{name}: started reduce-scatter")
        if not np.array_equal(res, want_res):
            bad.append(f"{name}: started reduce-scatter's residual")
        if ring.owner(mine) is not None:
            bad.append(f"{name}: a waited call still owns its buffers")
        qc.free()
        ring.free()
    assert_all(comm, not bad, "; ".join(bad))


@pytest.mark.mpi
def test_ledger_counts_codes_and_scales_inside_and_across(comm):
    n, r, m, bad = comm.size, comm.rank, 1000, []
    wq, gq = Quant(8, 64), Quant(4, 64)
    for name, labels in maps(comm):
        ring = Ring(comm, nodes=labels)
        qc = QuantizedComm(ring, weights=wq, grads=gq)
        qc.all_gather(np.ones(m, np.float16), np.empty(n * m, np.float16))
        qc.reduce_scatter(np.ones(n * m, np.float16), np.empty(m, np.float16))
        nm = ring.nodes
        for op, spec in (("q_all_gather", wq), ("q_reduce_scatter", gq)):
            c, at, end = spec.wire_layout(m)
            if nm.uniform:
                N, P = nm.count, nm.ppn
                inter, intra = N - 1, (P - 1) * N            # wire buffers sent across / inside
            else:
                inter = sum(nm.crosses(r, p) for p in range(n))
                intra = n - 1 - inter
            want = {"codes_inter": inter * at, "scales_inter": inter * (end - at),
                    "codes_intra": intra * at, "scales_intra": intra * (end - at),
                    "bytes_sent": (inter + intra) * end, "bytes_sent_internode": inter * end, "calls": 1}
            got = qc.ledger[op]
            for k, v in want.items():
                if got[k] != v:
                    bad.append(f"{name} {op} {k}: expected {v}, got {got[k]}")
        qc.free()
        ring.free()
    assert_all(comm, not bad, "; ".join(bad))


@pytest.mark.mpi
@pytest.mark.standin
def test_cupy_standin_gives_the_numpy_bits(comm, monkeypatch):
    cp = cupy_standin.install(monkeypatch)
    n, r, m, bad = comm.size, comm.rank, 97, []
    for name, labels in maps(comm):
        ring = Ring(comm, nodes=labels)
        qc = QuantizedComm(ring, weights=Quant(8, 16), grads=Quant(4, 16))
        for dt in ("float32", "float16"):
            x = data(r, n * m, dt)
            host_rs, host_ag = np.empty(m, dt), np.empty(n * m, dt)
            res_h = np.zeros(n * m, np.float32)
            qc.reduce_scatter(x, host_rs, residual=res_h)
            qc.all_gather(x[:m], host_ag)
            dev_rs, dev_ag, res_d = cp.empty(m, dt), cp.empty(n * m, dt), cp.zeros(n * m, cp.float32)
            qc.reduce_scatter(cp.asarray(x), dev_rs, residual=res_d)
            qc.all_gather(cp.asarray(x[:m]), dev_ag)
            cp.cuda.get_current_stream().synchronize()
            for what, h, d in (("rs", host_rs, dev_rs), ("ag", host_ag, dev_ag), ("residual", res_h, res_d)):
                if not np.array_equal(h, d.get()):
                    bad.append(f"{name} {dt} {what}")
        qc.free()
        ring.free()
    assert_all(comm, not bad, "; ".join(bad))


@pytest.mark.mpi
def test_bad_arguments_one_line_before_any_message(comm):
    n = comm.size
    ring = Ring(comm)
    qc = QuantizedComm(ring)
    cases = [(lambda: qc.all_gather(np.ones(4, np.float32), np.empty(4 * n + 1, np.float32)),
              f"expected len(recv) == {n}*len(send)"),
             (lambda: qc.reduce_scatter(np.ones(4 * n, np.float32), np.empty(5, np.float32)),
              f"expected len(send) == {n}*len(recv)"),
             (lambda: qc.reduce_scatter(np.ones(4 * n, np.float64), np.empty(4, np.float64)), "got float64"),
             (lambda: qc.reduce_scatter(np.ones(4 * n, np.float32), np.empty(4, np.float32), op="max"),
              "got 'max'"),
             (lambda: qc.reduce_scatter(np.ones(4 * n, np.float32), np.empty(4, np.float32),
                                        residual=np.zeros(4 * n + 1, np.float32)), "expected residual float32"),
             (lambda: qc.all_gather(np.ones((2, 2), np.float32), np.empty(4 * n, np.float32)), "1-D"),
             # the started forms check on the caller's thread too, before anything is queued
             (lambda: qc.all_gather_start(np.ones(4, np.float32), np.empty(4 * n + 1, np.float32)),
              f"expected len(recv) == {n}*len(send)"),
             (lambda: qc.reduce_scatter_start(np.ones(4 * n, np.float32), np.empty(4, np.float32), op="max"),
              "got 'max'")]
    bad = []
    for f, words in cases:
        try:
            f()
            bad.append(f"no error for {words}")
        except (ValueError, TypeError) as e:
            if words not in str(e) or "\n" in str(e):
                bad.append(f"{words!r} not in {e}")
    qc.all_gather(np.ones(3, np.float32), np.empty(3 * n, np.float32))   # still in step
    out = np.empty(3 * n, np.float32)
    qc.all_gather_start(np.ones(3, np.float32), out).wait()             # ... started too
    if not np.array_equal(out, np.ones(3 * n, np.float32)):
        bad.append("the started call after the refusals")
    qc.free()
    ring.free()
    assert_all(comm, not bad, "; ".join(bad))


def test_volume_formula_gives_the_seed_and_zeropp():
    assert zeropp_volume()["total"] == 3.0
    v = zeropp_volume(True, True, True, Quant(8, 2048), Quant(4, 2048))
    assert v["backward_all_gather"] == 0
    assert v["forward_all_gather"] == (1 + 4 / 2048) / 2 and v["reduce_scatter"] == (0.5 + 4 / 2048) / 2
    assert abs(v["total"] - 0.75) < 2.5e-3
    assert zeropp_volume(qwz=True, elem_bytes=4)["forward_all_gather"] == (1 + 4 / 2048) / 4
    led = QLedger()
    led.sent("q_all_gather", 8, 4, True)
    led.sent("q_all_gather", 8, 4, False)
    assert led.total_sent() == 24 and led.total_sent_internode() == 12
    assert set(led.as_dict()) == {"q_all_gather", "q_reduce_scatter"}


@pytest.mark.mpi
def test_lengths_that_differ_between_ranks_raise_on_every_rank(comm):
    n, r = comm.size, comm.rank
    if n < 2:
        pytest.skip("needs 2 ranks")
    ring = Ring(comm)
    qc = QuantizedComm(ring, weights=Quant(8, 2048))
    m = 5 if r == 0 else 4                      # rank 0 is out of step with the rest
    try:
        qc.all_gather(np.ones(m, np.float32), np.empty(n * m, np.float32))
        msg = "no error"
    except ValueError as e:
        msg = str(e)
    ok = "HINT: every rank must pass the same lengths" in msg and "\n" not in msg
    try:
        qc.all_gather(np.ones(4, np.float32), np.empty(4 * n, np.float32))
        ok = False                              # refused after the error
    except RuntimeError as e:
        ok = ok and "out of step" in str(e)
    qc.free()
    ring.free()
    assert_all(comm, ok, msg)


@pytest.mark.mpi
def test_steady_state_allocates_nothing_new(comm):
    n, m = comm.size, 300
    for name, labels in maps(comm):
        ring = Ring(comm, nodes=labels)
        qc = QuantizedComm(ring, weights=Quant(8, 64), grads=Quant(4, 64))
        x, full, mine = np.ones(m, np.float16), np.empty(n * m, np.float16), np.empty(m, np.float16)
        g, res = np.ones(n * m, np.float16), np.zeros(n * m, np.float32)
        qc.all_gather(x, full)
        qc.reduce_scatter(g, mine, residual=res)
        before = {k: v for k, v in qc._ws.items()}, qc.wq.growths, qc.gq.growths
        for _ in range(3):
            qc.all_gather(x, full)
            qc.reduce_scatter(g, mine, residual=res)
        after = qc._ws, qc.wq.growths, qc.gq.growths
        ok = before[1:] == after[1:] and all(after[0][k] is v for k, v in before[0].items()) \
            and set(before[0]) == set(after[0])
        qc.free()
        ring.free()
        assert_all(comm, ok, f"{name}: scratch grew after the first call")


@pytest.mark.mpi
def test_a_late_peer_gets_one_stall_line_from_each_waiting_rank(comm, capsys):
    """RINGZERO_STALL_WARN for a quantized call: its waits are its own, not the Ring's, so the stall
    inspector cannot see them; each rank left waiting says so once, naming the op, the step and rank 0."""
    import re
    n, r = comm.size, comm.rank
    if n < 2:
        pytest.skip("needs 2 ranks")
    ring = Ring(comm, timeout=30, stall_warn=0.3)
    qc = QuantizedComm(ring)
    Ring.set_context("step 5")
    out = np.empty(8 * n, np.float32)
    comm.Barrier()
    if r == 0:
        time.sleep(1.5)
    qc.all_gather(np.full(8, r + 1, np.float32), out)
    time.sleep(0.1)
    err = capsys.readouterr().err
    Ring.set_context("")
    qc.free()
    ring.free()
    lines = re.findall(r"ringzero \| rank (\d+): q_all_gather has made no progress for ([\d.]+) s at step 5, "
                       r"waiting for messages from ranks? ([\d, ]+) \(warning after RINGZERO_STALL_WARN=0.3 s; "
                       r"error at RINGZERO_TIMEOUT=30 s\)", err)
    want = np.repeat(np.arange(1, n + 1, dtype=np.float32), 8)
    ok = np.allclose(out, want, rtol=1 / 127)
    if r == 0:
        ok = ok and not lines
    else:
        ok = ok and len(lines) == 1 and int(lines[0][0]) == r and float(lines[0][1]) >= 0.3 \
            and 0 in [int(p) for p in lines[0][2].split(",")]
    assert_all(comm, ok, f"rank {r}: stderr {err!r}")


@pytest.mark.mpi
def test_a_peer_that_never_comes_is_a_timeout_not_a_hang(comm):
    n, r = comm.size, comm.rank
    if n < 2:
        pytest.skip("needs 2 ranks")
    ring = Ring(comm, timeout=1.0)
    qc = QuantizedComm(ring)
    msg = "not asked"
    if r == 0:                                   # the others never make the call
        try:
            qc.all_gather(np.ones(8, np.float32), np.empty(8 * n, np.float32))
            msg = "no error"
        except TimeoutError as e:
            msg = str(e)
    comm.Barrier()
    qc.free()
    ring.free()
    ok = r != 0 or ("no message within 1 s" in msg and "HINT" in msg and "\n" not in msg)
    assert_all(comm, ok, msg)
