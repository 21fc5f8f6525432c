"""``python -m ringzero.explain``: precision thresholds found by experiment, checked
against fp16 facts numpy states independently (finfo.smallest_subnormal,
np.spacing), and the traffic explainer on a hand-made metrics file."""
import json

import numpy as np
import pytest

from ringzero.runtime import accounting as acc
from ringzero.tools import explain as ex

f16 = np.float16
SUB = float(np.finfo(f16).smallest_subnormal)      # 2^-24


def test_underflow_threshold_is_half_the_smallest_subnormal():
    u = ex.underflow_threshold()
    assert u["largest_zero"] == SUB / 2                 # 2^-25: a tie, rounds to even 0
    assert u["rounds_to"] == SUB                        # just above it rounds up to 2^-24
    assert u["threshold"] == float(np.nextafter(SUB / 2, 1.0))
    assert u["tie_2^-25_to"] == 0.0
    assert f16(u["threshold"]) != 0 and f16(u["largest_zero"]) == 0


def test_swamp_ratio_at_one_is_2048():
    s = ex.swamp_ratio(1.0)
    assert s["ratio"] == 2 / float(np.spacing(f16(1)))     # 1 / (ulp/2) = 2048
    assert s["ratio"] == 2048


@pytest.mark.parametrize("w", [1.5, 1.25, 3.0, 100.0, 0.25, 1000.0, 0.125])
def test_swamp_ratio_even_significand(w):
    """An even-mantissa w swallows exactly Δw <= ulp(w)/2, so the ratio is w/(ulp/2)."""
    s = ex.swamp_ratio(w)
    assert not s["odd"]
    assert s["ratio"] == w / (float(np.spacing(f16(w))) / 2)


def test_swamp_ratio_across_binades():
    rng = np.random.default_rng(0)
    ws = rng.uniform(-2, 10, 40)            # log2 w: normal weights, Δw normal too
    for w in 2.0 ** ws:
        s = ex.swamp_ratio(w)
        w16 = f16(s["w"])
        lost = f16(s["largest_lost_dw"])
        nxt = np.nextafter(lost, f16(np.inf))
        assert w16 + lost == w16 and w16 + nxt != w16     # exactly the boundary
        assert 2048 <= s["ratio"] <= 4096 * (1 + 2 ** -10)
        assert abs(s["ratio"] / (2048 * s["significand"]) - 1) < 2 ** -9


def test_toy_run_fp16_stalls_master_tracks():
    t = ex.toy_run(n=256, steps=3000, lr=1e-4)
    assert t["fp32_moved"] > 0.05
    assert t["fp16_err"] > 0.9 * t["fp32_moved"]          # fp16 weights barely moved
    assert t["master_err"] < 0.01 * t["fp32_moved"]        # master tracks the fp32 run
    assert t["copy_within_half_ulp"]


def test_loss_scaling_rescues_underflow():
    ls = ex.loss_scaling(scale=2.0 ** 16, n=20000)
    # independent count: gradients <= 2^-25 underflow; log-uniform over [-34, -14]
    assert abs(ls["zero_plain"] - (34 - 25) / 20) < 0.02
    assert ls["zero_scaled"] == 0
    # scaled values reach 2^-18, fp16 subnormal spacing 2^-24: rel. error <= 2^-25 / 2^-18
    assert ls["max_rel_err_scaled"] <= 2.0 ** -7


def test_scaler_backs_off_and_skips():
    pytest.importorskip("ringzero.runtime.optim")
    tr = ex.scaler_trace(steps=12, overflow_at=(3,), grad_max=2.0)
    # real overflows while 2 * scale > 65504 (fp16 max), then the injected one at step 3
    fmax = float(np.finfo(f16).max)
    for r in tr:
        edge = fmax + (fmax - float(np.nextafter(f16(fmax), f16(0)))) / 2   # 65520 ties to Inf
        expect_inf = 2.0 * r["scale"] >= edge or r["step"] == 3
        assert r["found_inf"] == expect_inf
        assert r["skipped"] == r["found_inf"]
        assert r["master_changed"] == (not r["skipped"]) and r["master_finite"]
        if r["found_inf"]:
            assert r["next_scale"] == r["scale"] / 2
    assert tr[3]["scale"] == 2.0 ** 14 and tr[4]["scale"] == 2.0 ** 13


def test_precision_cli(capsys):
    assert ex.main(["precision"]) == 0
    out = capsys.readouterr().out
    assert "2^-25" in out and "2048" in out and "Loss scaling" in out


# ---- traffic ------------------------------------------------------------------------
def _metrics(tmp_path, psi=1000, n=4, stage="2", measured=None):
    mine = sum(acc.traffic_bytes(stage, psi, n).values())
    lines = [{"step": i, "loss": 5.0 - i, "lr": 1e-3, "loss_scale": 65536.0, "grad_norm": 1.0,
              "tokens_per_s": 1000.0, "step_time_s": 0.1, "bytes_sent": mine} for i in range(3)]
    mem = {c: {"measured_bytes": v, "formula_bytes": v}
           for c, v in acc.model_state_bytes(stage, psi, n).items()}
    lines.append({"summary": True, "params": psi, "world_size": n, "stage": stage, "memory": mem,
                  "traffic": {"measured_bytes_per_step": measured if measured is not None else mine,
                              "formula_bytes_per_step": mine},
                  "train_loss": 2.0, "eval_loss": 2.1, "unigram_entropy": 4.5})
    p = tmp_path / "m.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return str(p), mine


def test_traffic_with_metrics(tmp_path, capsys):
    path, mine = _metrics(tmp_path, psi=1024, n=4, stage="2", measured=None)
    assert mine == 2 * (2 * 1024 * 3 // 4)     # RS + AG of fp16, 2 B each
    assert ex.main(["traffic", "--metrics", path]) == 0
    out = capsys.readouterr().out
    assert f"measured {mine:,} B" in out and "exact match" in out


def test_traffic_metrics_difference_explained(tmp_path, capsys):
    path, mine = _metrics(tmp_path, psi=1000, n=4, stage="3", measured=5000)
    ex.main(["traffic", "--metrics", path])
    out = capsys.readouterr().out
    assert f"{5000 - mine:,} B" in out and "padding" in out


def test_traffic_per_unit_sums_to_padded_total():
    from ringzero.nn.gpt import GPTConfig, gpt_units
    units = gpt_units(GPTConfig(n_layer=3, n_head=2, n_embd=40, block_size=8, vocab=50))
    for row in ex.traffic_rows(10**6, 3, None, units):
        if "per_unit" in row:
            tot = {k: sum(u[3][k] for u in row["per_unit"]) for k in row["per_unit"][0][3]}
            assert tot == acc.traffic_elements(row["stage"], row["padded_psi"], 3)


@pytest.mark.parametrize("body", ["", "not json\n", '{"step": 1}\n', '{"summary": true}\n'])
def test_traffic_bad_metrics_exit_2(tmp_path, body, capsys):
    p = tmp_path / "bad.jsonl"
    p.write_text(body)
    with pytest.raises(SystemExit) as e:
        ex.main(["traffic", "--metrics", str(p)])
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err.strip().splitlines()[-1]


def test_traffic_missing_file_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        ex.main(["traffic", "--metrics", "/nonexistent/m.jsonl"])
    assert e.value.code == 2


# ---- bf16 beside fp16 (ml_dtypes) ----------------------------------------------------
try:                                             # a test dependency (setup.cfg [test])
    import ml_dtypes
    bf16, BF = ml_dtypes.bfloat16, ml_dtypes.finfo(ml_dtypes.bfloat16)
except ImportError:
    ml_dtypes = bf16 = BF = None
needs_bf16 = pytest.mark.skipif(ml_dtypes is None, reason="needs ml_dtypes (pip install 'ringzero[bf16]')")


@needs_bf16
def test_bf16_underflow_and_overflow_by_experiment():
    u = ex.underflow_threshold(bf16)
    assert u["largest_zero"] == float(BF.smallest_subnormal) / 2      # 2^-134: a tie, to even 0
    assert u["rounds_to"] == float(BF.smallest_subnormal)             # 2^-133
    assert u["threshold"] == float(np.nextafter(np.float32(u["largest_zero"]), np.float32(1)))
    o = ex.overflow_threshold(bf16)
    assert o["largest_finite"] == float(BF.max)
    assert np.isinf(np.float32(o["threshold"]).astype(bf16))
    assert np.isfinite(np.float32(o["largest_finite_input"]).astype(bf16))
    o16 = ex.overflow_threshold(f16)                                   # 65504 + ulp/2 = 65520 rounds up
    assert o16["largest_finite"] == float(np.finfo(f16).max)
    top = float(np.finfo(f16).max)
    assert o16["threshold"] == top + float(np.spacing(f16(2 ** 15))) / 2   # 65504 + ulp/2: the tie goes to even, Inf
    with np.errstate(over="ignore"):
        assert np.isinf(f16(o16["threshold"])) and np.isfinite(f16(o16["largest_finite_input"]))


@needs_bf16
@pytest.mark.parametrize("w", [1.0, 1.5, 3.0, 0.25, 100.0])
def test_bf16_swamp_ratio_is_w_over_half_ulp(w):
    s = ex.swamp_ratio(w, bf16)
    wb = np.array(w).astype(bf16)
    assert not s["odd"]
    assert s["ratio"] == w / (float(np.spacing(wb)) / 2)
    assert ex.swamp_ratio(1.0, bf16)["ratio"] == 2 / float(BF.eps) == 256   # vs fp16's 2048


@needs_bf16
def test_cast_gradients_bf16_keeps_what_fp16_flushes():
    from ringzero.tools import bf16 as b
    n, seed = 50000, 3
    g = (2.0 ** np.random.default_rng(seed).uniform(-34, -14, n)).astype(np.float32)
    r16, rb = b.cast_gradients(f16, n, seed), b.cast_gradients(bf16, n, seed)
    assert r16["zero"] == np.mean(g <= 2.0 ** -25)       # below fp16's half-subnormal (ties: measure 0)
    assert rb["zero"] == 0.0
    assert rb["max_rel_err"] <= 2.0 ** -8                # 8 significant bits: half an ulp, relative
    t = ex.toy_run(n=64, steps=500, lr=1e-4, dtype=bf16)
    assert t["fp16_moved"] == 0.0 and t["master_err"] < 0.01 * t["fp32_moved"]


@needs_bf16
def test_precision_cli_shows_bf16(capsys):
    assert ex.main(["precision"]) == 0
    out = capsys.readouterr().out
    assert "bf16 beside fp16" in out and "256x" in out and "2^-133" in out and "no loss scaler" in out


# ---- traffic with gradient accumulation --------------------------------------------------
def test_traffic_grad_accum_cli(capsys):
    psi, nd, k = 8 * 10**6, 8, 4
    assert ex.main(["traffic", "--params", "8M", "--nd", str(nd), "--grad-accum", str(k),
                    "--precision", "bf16"]) == 0
    out = capsys.readouterr().out
    one = psi * (nd - 1) // nd                             # one ring RS or AG over Ψ
    assert f"stage 2: 2Ψ(Nd-1)/Nd = {2 * one:,} elements" in out             # once per step
    assert f"stage 3: 4 x 3Ψ(Nd-1)/Nd = {k * 3 * one:,} elements" in out     # every micro-batch
    assert f"{k * 3 * one * 2 / 1e9:.4f} GB per rank per step" in out        # bf16: 2 B/element
    assert "reduce-scatter bf16 grads" in out
    rows = {r["stage"]: r for r in ex.traffic_rows(psi, nd, None, None, k, "fp32")}
    assert rows["3"]["total_bytes"] == 4 * k * 3 * one and rows["1"]["total_bytes"] == 4 * 2 * one
    with pytest.raises(SystemExit) as e:
        ex.main(["traffic", "--params", "8M", "--grad-accum", "0"])
    assert e.value.code == 2


def test_traffic_metrics_with_grad_accum_and_bf16(tmp_path, capsys):
    psi, n, k = 1024, 4, 3
    path, _ = _metrics(tmp_path, psi=psi, n=n, stage="3")
    lines = [json.loads(x) for x in open(path)]
    want = k * 3 * (psi * (n - 1) // n) * 2                # K x (2 AG + RS), bf16
    lines[-1].update(precision="bf16", grad_accum=k)
    lines[-1]["traffic"] = {"measured_bytes_per_step": want, "formula_bytes_per_step": want}
    with open(path, "w") as fh:
        fh.write("\n".join(json.dumps(x) for x in lines) + "\n")
    ex.main(["traffic", "--metrics", path])
    out = capsys.readouterr().out
    assert f"accounting on unpadded Ψ {want:,} B" in out and "exact match" in out and "K = 3" in out


# ---- traffic across nodes ------------------------------------------------------------
@pytest.mark.parametrize("nd,nodes", [(16, 2), (8, 4), (8, 8)])
def test_traffic_split_within_and_across_nodes(nd, nodes):
    """Per pass of Ψ, a rank sends Ψ(P-1)/P inside its node and (Ψ/P)(N-1)/N across (written out here)."""
    psi, P = 7 * 2**20, nd // nodes
    inside, across = psi * (P - 1) / P, psi / P * (nodes - 1) / nodes
    passes = {"0": (2, 2), "1": (2, 2), "2": (2, 2), "3": (3, 3), "hybrid": (3, 2)}  # (in node, across)
    rows = {r["stage"]: r for r in ex.traffic_rows(psi, nd, P, None, 1, "fp16", nodes)}
    for st, (k_in, k_net) in passes.items():
        r = rows[st]
        assert r["internode_total"] == pytest.approx(k_net * across, rel=1e-12), st
        if st == "hybrid":    # its RS and AG stay in the node; the all-reduce is all it sends across
            assert r["internode"]["all_gather"] == r["internode"]["reduce_scatter"] == 0
            assert r["internode"]["all_reduce"] == r["by_collective"]["all_reduce"]
        assert r["elements"] - r["internode_total"] == pytest.approx(k_in * inside, rel=1e-12), st
    one = {r["stage"]: r["internode_total"] for r in ex.traffic_rows(psi, nd, P)}
    assert set(one.values()) == {0}                 # one host: nothing crosses


def test_traffic_nodes_cli_states_hybrids_point(capsys):
    assert ex.main(["traffic", "--params", "1.5B", "--nd", "16", "--nodes", "2"]) == 0
    out = capsys.readouterr().out
    net = 1_500_000_000 // 8 // 2                   # (Ψ/P)(N-1)/N per pass, P = 8, N = 2
    assert "N = 2 nodes of P = 8" in out and "stage hybrid" in out       # Ng defaults to P
    assert f"across nodes 3(Ψ/P)(N-1)/N = {3 * net:,} el" in out
    assert f"stage 3 sends its all-gathers over the network ({2 * net:,} of its {3 * net:,} el" in out
    assert f"only the all-reduce of the Ψ/Ng shard crosses, {2 * net:,} el" in out


@pytest.mark.parametrize("args", [["--nd", "8", "--nodes", "3"], ["--nd", "8", "--nodes", "0"],
                                  ["--nd", "8", "--nodes", "2", "--ranks-per-node", "8"]])
def test_traffic_bad_nodes_exit_2(args, capsys):
    with pytest.raises(SystemExit) as e:
        ex.main(["traffic", "--params", "8M", *args])
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err.strip().splitlines()[-1]


def test_traffic_metrics_across_nodes(tmp_path, capsys):
    path, mine = _metrics(tmp_path, psi=1024, n=4, stage="3")
    lines = [json.loads(x) for x in open(path)]
    lines[-1]["traffic"].update(nodes=2, node_ppn=2, measured_internode_bytes_per_step=1536,
                                formula_internode_bytes_per_step=1536, internode_formula="3(Ψ/P)(N-1)/N")
    open(path, "w").write("\n".join(json.dumps(x) for x in lines) + "\n")
    ex.main(["traffic", "--metrics", path])
    out = capsys.readouterr().out
    assert "across nodes (2 nodes of 2): measured 1,536 B   formula 3(Ψ/P)(N-1)/N = 1,536 B" in out
