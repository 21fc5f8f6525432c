"""ringzero.tools.fit: the α–β model recovers known α and β from a synthetic bench file and
predicts held-out points within the stated tolerance.

The synthetic times are written here from the Ring's schedule table as the docs state it
(not from ringzero.comm.schedule.steps_wire), with ±10 % deterministic noise, in the
bench's row format.
"""
import json
import math

import numpy as np
import pytest

from ringzero.runtime import accounting as acc
from ringzero.tools import fit

ALPHA, BETA = 20e-6, 1 / 4e9          # 20 us per step, 4 GB/s
MIB = 1 << 20


def rounds_bytes(op, n, S, small=None):
    """(rounds, bytes sent per rank) of one call, from docs/collectives.md's table (defaults:
    recursive doubling to 64 KiB; tree RS/AG to 64 KiB; direct to 16 MiB, for the all-gather
    at every size; n = 2 the tree to 16 MiB)."""
    small = 64 << 10 if small is None else small
    ar, lg, per = op == "allreduce", math.log2(n), S * (n - 1) / n
    passes = 2 if ar else 1
    ag_direct = op == "allgather" and n >= 3
    if n & (n - 1):                                   # n = 3: direct up to 16 MiB, then the ring
        return passes * (1 if S <= 16 * MIB or ag_direct else n - 1), passes * per
    if ag_direct and S > 64 << 10:                    # the all-gather: direct at any size
        return 1, per
    if S > 16 * MIB:                                  # the ring
        return passes * (n - 1), passes * per
    if ar:                                            # recursive doubling, then Rabenseifner
        return (lg, S * lg) if S <= small else (2 * lg, 2 * per)
    if n == 2 or S <= 64 << 10:                       # halving / doubling
        return lg, per
    return 1, per                                     # direct


def synthetic_rows(noise=0.10, seed=0, small=None):
    rng = np.random.default_rng(seed)
    rows = []
    for n in (2, 3, 4, 8):
        for k in range(12, 27):                     # 4 KiB .. 64 MiB
            S = 2 ** k
            for op in ("allreduce", "reduce_scatter", "all_gather"):
                steps, wire = rounds_bytes(op.replace("_", ""), n, S, small)
                t = (steps * ALPHA + wire * BETA) * (1 + noise * rng.uniform(-1, 1))
                rows.append({"op": op, "impl": "ring", "n": n, "bytes": S, "count": S // 4,
                             "dtype": "float32", "redop": "sum", "time_us": t * 1e6,
                             "algbw_GBps": S / t / 1e9, "busbw_GBps": 0.0, "wrong": False})
    return rows


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter", "all_gather"])
def test_recovers_alpha_beta_and_predicts_held_out(op):
    r = fit.report(synthetic_rows(), impl="ring", op=op)
    for m in [r["pooled_fit_on_half"]] + [d["fit_on_half"] for d in r["fit_per_n"].values()]:
        assert abs(m["alpha_s"] / ALPHA - 1) < 0.3
        assert abs(m["beta_s_per_byte"] / BETA - 1) < 0.15   # 8 points, +-10 % noise
    # held-out points: within the noise plus a margin, far inside the stated tolerance
    assert r["max_abs_rel_err"] < 0.25
    assert r["within_tolerance"] and r["tolerance"] == fit.TOLERANCE


def test_exact_data_exact_fit():
    r = fit.report(synthetic_rows(noise=0.0), op="all_reduce")
    assert r["max_abs_rel_err"] < 1e-9
    assert math.isclose(r["predict_model"]["alpha_s"], ALPHA, rel_tol=1e-9)
    assert r["predict_from_n"] == 2 and r["pooled_median_abs_rel_err"] < 1e-9


def test_wrong_model_is_caught():
    """Times that grow as S² are not an α–β ring: the held-out error must be large."""
    rows = synthetic_rows(noise=0.0)
    for r in rows:
        r["time_us"] = 1e-9 * float(r["bytes"]) ** 2 / 1e3 + 1.0
    rep = fit.report(rows, op="all_reduce")
    assert rep["max_abs_rel_err"] > 1.0


def test_per_n_fit_handles_alpha_growing_with_n():
    """α that grows with n (ranks sharing cores) breaks one pooled fit, not the per-n check."""
    rows = synthetic_rows(noise=0.0)
    for r in rows:
        if r["op"] == "allreduce":
            steps, _ = rounds_bytes("allreduce", r["n"], r["bytes"])
            r["time_us"] += steps * ALPHA * 1e6 * (r["n"] ** 2 - 1)     # extra latency ~ n²
    rep = fit.report(rows, op="all_reduce")
    assert rep["max_abs_rel_err"] < 1e-6
    assert rep["pooled_median_abs_rel_err"] > 0.1
    assert math.isclose(rep["fit_per_n"]["8"]["fit_on_all"]["alpha_s"], ALPHA * 64, rel_tol=1e-6)


def test_step_time_matches_hand_formula():
    m = {"alpha_s": ALPHA, "beta_s_per_byte": BETA}
    psi, n, U = 10**9, 64, 50
    # stage 2: one RS and one AG per unit; fp16 elements
    hand = U * 2 * (n - 1) * ALPHA + 2 * 2 * psi * (n - 1) / n * BETA
    assert math.isclose(fit.step_time(m, "2", psi, n, U), hand)
    hand3 = U * 3 * (n - 1) * ALPHA + 2 * 3 * psi * (n - 1) / n * BETA
    assert math.isclose(fit.step_time(m, "3", psi, n, U), hand3)
    assert fit.step_time(m, "0", psi, 1, U) == 0


def test_cli_reads_wrapped_file(tmp_path, capsys):
    p = tmp_path / "bench.json"
    p.write_text(json.dumps({"rows": synthetic_rows()}))
    assert fit.main([str(p)]) == 0
    out = capsys.readouterr().out
    assert "Held-out" in out and "1024" in out and "Ψ=100B" in out


@pytest.mark.parametrize("body,msg", [
    ("not json", "not JSON"), ('{"x": 1}', "expected a JSON list"),
    ('[{"op": "allreduce"}]', "lacks"), ("[]", "need >= 2 sizes"),
])
def test_cli_bad_files_exit_2(tmp_path, capsys, body, msg):
    p = tmp_path / "b.json"
    p.write_text(body)
    with pytest.raises(SystemExit) as e:
        fit.main([str(p)])
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


def test_ignores_wrong_and_other_impl_rows():
    rows = synthetic_rows(noise=0.0)
    bad = [dict(r, impl="mpi", time_us=1e9) for r in rows] + \
          [dict(r, wrong=True, time_us=1e9) for r in rows]
    r = fit.report(rows + bad, op="all_reduce")
    assert r["max_abs_rel_err"] < 1e-9
    assert acc.parse_stage("FULL_SHARD") in r["predict_step_comm_s"]


def test_thresholds_from_bench_meta(tmp_path):
    """A file made with a 256 KiB recursive-doubling cutoff is fitted with it, read from its meta."""
    rows = synthetic_rows(noise=0.0, small=256 * 1024)
    p = tmp_path / "b.json"
    p.write_text(json.dumps({"rows": rows, "meta": {"small_bytes": 256 * 1024, "tree_bytes": 16 * MIB}}))
    r = fit.report(fit.load_rows(str(p)), op="all_reduce")
    assert r["max_abs_rel_err"] < 1e-9
    wrong = fit.report(synthetic_rows(noise=0.0, small=256 * 1024), op="all_reduce")
    assert wrong["max_abs_rel_err"] > 0.05          # the default cutoff misreads 128-256 KiB


