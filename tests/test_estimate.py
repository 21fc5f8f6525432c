"""ringzero.runtime.accounting and ``python -m ringzero.estimate`` against the seed's figures.

The seed's printed figures (120 / 31.4 / 16.6 / 1.88 GB, ...) are the
reference; the code's numbers come from the formulas and are rounded the way
the seed rounds. Ψ of the GPT-2 presets is checked against the closed-form
GPT-2 parameter count, computed here independently of the layout table.
"""
import json

import pytest

from ringzero.nn.gpt import PRESETS, GPTConfig, gpt_units
from ringzero.runtime import accounting as acc
from ringzero.runtime.flat import Layout
from ringzero.sizes import parse_count, parse_size
from ringzero.tools import estimate as est

GB = 1e9
PSI_75B = 7_500_000_000


def gpt2_closed_form(cfg):
    """GPT-2 parameter count, tied head: 12Lh² + 13Lh + (V + T)h + 2h."""
    L, h = cfg.n_layer, cfg.n_embd
    return 12 * L * h * h + 13 * L * h + (cfg.vocab + cfg.block_size) * h + 2 * h


# ---- the seed's table -----------------------------------------------------------
@pytest.mark.parametrize("stage,seed", [("0", "120"), ("1", "31.4"), ("2", "16.6"), ("3", "1.88")])
def test_seed_stage_table(stage, seed):
    psi = parse_count("7.5B")
    assert psi == PSI_75B
    got = acc.model_state_total(stage, psi, 64)
    # the formula written out here, separately from accounting.py's class table
    ref = {"0": 16 * psi, "1": 4 * psi + 12 * psi / 64, "2": 2 * psi + 14 * psi / 64,
           "3": 16 * psi / 64}[stage]
    assert got == ref
    assert est.sig3(got / GB) == seed


def test_seed_table_through_cli(capsys):
    est.main(["--params", "7.5B", "--nd", "64", "--json"])
    r = json.loads(capsys.readouterr().out)
    assert [est.sig3(s["GB"]) for s in r["stages"]] == ["120", "31.4", "16.6", "1.88"]
    assert [s["formula"] for s in r["stages"]] == ["16Ψ", "4Ψ + 12Ψ/Nd", "2Ψ + 14Ψ/Nd", "16Ψ/Nd"]
    s0 = r["stages"][0]["by_class"]
    assert s0["params_fp16"] / GB == 15          # "fp16 weights of a 7.5B model fit in 15 GB"
    assert s0["params_fp16"] / sum(s0.values()) == 0.125          # 12.5 %
    opt = s0["master_fp32"] + s0["adam_m_fp32"] + s0["adam_v_fp32"]
    assert opt / sum(s0.values()) == 0.75                         # 75 %
    # traffic: 2Ψ for stages 0-2 and 3Ψ for stage 3, each x (Nd-1)/Nd for the ring
    el = [s["traffic_elements"] for s in r["stages"]]
    assert el == [2 * PSI_75B * 63 / 64] * 3 + [3 * PSI_75B * 63 / 64]


def test_text_report_prints_seed_figures(capsys):
    est.main(["--params", "7.5B", "--nd", "64"])
    out = capsys.readouterr().out
    for fig in (" 120 ", " 31.4 ", " 16.6 ", " 1.88 "):
        assert fig in out


def test_reduction_limits():
    """Stage 1 -> 4x and stage 2 -> 8x less than stage 0 as Nd grows (the seed's claim)."""
    big = 2 ** 40
    assert round(acc.bytes_per_param("0", big) / acc.bytes_per_param("1", big), 6) == 4
    assert round(acc.bytes_per_param("0", big) / acc.bytes_per_param("2", big), 6) == 8


# ---- GPT-2 1.5B figures ------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_psi_matches_closed_form(name):
    assert est.gpt_psi(PRESETS[name]) == gpt2_closed_form(PRESETS[name])


def test_gpt2_xl_seed_figures():
    psi = est.gpt_psi(PRESETS["gpt2-xl"])
    assert round(psi / 1e9, 1) == 1.6 and round(psi / 1e9) == 2   # "1.5B" is a name, not a count
    exact = parse_count("1.5B")
    assert acc.model_state_bytes("0", exact, 1)["params_fp16"] / GB == 3      # ~3 GB fp16 weights
    assert acc.model_state_total("0", exact, 1) / GB == 24                    # 24 GB model state
    assert acc.model_state_total("0", psi, 1) / GB >= 24
    r = est.estimate(exact, 1)
    assert r["buffers"]["fp32_flat_allreduce_bytes"] / GB == 6                # 6 GB buffer


def test_activations_seed():
    cfg = PRESETS["gpt2-xl"]
    a = est.activations(cfg, 32, 1024)
    b, s, h, L = 32, 1024, cfg.n_embd, cfg.n_layer
    assert a["zero_paper"] == 2 * 12 * h * b * s * L
    assert round(a["zero_paper"] / GB, -1) == 60                               # "about 60 GB"
    # the seed's ~8 GB lies between the layer-input checkpoints alone and
    # checkpoints + one recomputed layer + logits, as the tool says
    assert 2 * b * s * h * L < 8 * GB < a["zero_ckpt"] + a["logits"]
    assert a["korthikanti"] > a["zero_paper"]   # counts the attention scores ZeRO leaves out


def test_fit_gpt2_xl_plain_dp_does_not_fit_32gb():
    cfg = PRESETS["gpt2-xl"]
    psi = est.gpt_psi(cfg)
    r = est.estimate(psi, 1, cfg=cfg, batch=32, seq=1024, gpu_mem=parse_size("32GB"))
    f0 = r["fit"]["stages"][0]
    assert f0["stage"] == "0" and not f0["no_ckpt"]["fits"] and not f0["ckpt"]["fits"]
    assert f0["no_ckpt"]["smallest_group"] is None      # stage 0 never divides its state


@pytest.mark.parametrize("stage", ["1", "2", "3", "hybrid"])
def test_smallest_group_brute_force(stage):
    psi, budget, extra = 10**9, 5 * 10**9, 10**9
    got = est.smallest_group(stage, psi, budget, extra)
    brute = next((n for n in range(1, 10**4)
                  if acc.model_state_total(stage, psi, n, n if stage == "hybrid" else None)
                  + extra <= budget), None)
    assert got == brute


# ---- accounting ----------------------------------------------------------------------
def test_padded_psi_matches_layout_shards():
    """With the padded Ψ, the sharded classes are exactly one Layout shard per rank."""
    units = gpt_units(GPTConfig(n_layer=2, n_head=2, n_embd=48, block_size=16, vocab=77))
    for nd in (1, 2, 3, 4, 8):
        lay = Layout(units, nd)
        b = acc.model_state_bytes("3", lay.padded, nd)
        assert b == {c: acc.CLASS_BYTES[c] * lay.shard_numel for c in acc.CLASSES}
        b1 = acc.model_state_bytes("1", lay.padded, nd)
        assert b1["params_fp16"] == 2 * lay.padded and b1["master_fp32"] == 4 * lay.shard_numel
        assert all(isinstance(v, int) for v in b.values())


def test_hybrid_limits():
    """Ng = Nd is stage 3; Ng = 1 is plain data parallelism (an all-reduce of 2Ψ(n-1)/n)."""
    psi, nd = 4096 * 24, 8
    assert acc.model_state_bytes("hybrid", psi, nd, nd) == acc.model_state_bytes("3", psi, nd)
    assert acc.traffic_elements("hybrid", psi, nd, nd) == {
        **acc.traffic_elements("3", psi, nd), "all_reduce": 0}
    assert acc.model_state_total("hybrid", psi, nd, 1) == 16 * psi
    el = acc.traffic_elements("hybrid", psi, nd, 1)
    assert el == {"reduce_scatter": 0, "all_gather": 0, "all_reduce": 2 * psi * (nd - 1) / nd}
    el = acc.traffic_elements("hybrid", psi, 8, 4)       # 2 nodes of 4
    assert el["all_reduce"] == 2 * (psi / 4) * (2 - 1) / 2
    assert acc.traffic_bytes("hybrid", psi, 8, 4)["all_gather"] == 2 * el["all_gather"]


def test_stage_aliases_and_errors():
    for alias, st in (("NO_SHARD", "0"), ("SHARD_GRAD_OP", "2"), ("FULL_SHARD", "3"),
                      ("HYBRID_SHARD", "hybrid"), (0, "0"), (3, "3"), ("hybrid", "hybrid")):
        assert acc.parse_stage(alias) == st
    with pytest.raises(ValueError, match="FULL_SHARD"):
        acc.parse_stage("4")
    with pytest.raises(ValueError, match="nd % Ng"):
        acc.model_state_bytes("hybrid", 100, 6, 4)
    with pytest.raises(ValueError, match="ranks_per_node"):
        acc.traffic_elements("hybrid", 100, 4)
    with pytest.raises(ValueError, match="nd must be"):
        acc.model_state_bytes("2", 100, 0)


@pytest.mark.parametrize("argv", [
    ["--params", "7.5X"], ["--params", "1B", "--nd", "0"], ["--model", "gpt2", "--params", "1B"],
    ["--params", "1B", "--batch", "4"], ["--model", "gpt2", "--batch", "1", "--seq", "4096"],
    ["--params", "1B", "--nd", "6", "--ranks-per-node", "4"], ["--params", "1B", "--gpu-mem", "3XB"],
    [], ["--n-layer", "2", "--n-embd", "100", "--n-head", "3"], ["--nd", "x", "--params", "1B"],
])
def test_cli_bad_input_exits_2_with_one_line(argv, capsys):
    with pytest.raises(SystemExit) as e:
        est.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("python -m ringzero.estimate: error:")


def test_cli_full_report_runs(capsys):
    est.main(["--model", "gpt2-xl", "--nd", "8", "--ranks-per-node", "4", "--batch", "32",
              "--seq", "1024", "--gpu-mem", "32GB"])
    out = capsys.readouterr().out
    assert "HYBRID_SHARD" in out and "Fits in 32 GB" in out and "Korthikanti" in out


def test_stages_that_fit():
    psi, nd = 10**9, 8
    need = {"0": 16 * psi, "1": 4 * psi + 12 * psi / nd, "2": 2 * psi + 14 * psi / nd,
            "3": 16 * psi / nd, "hybrid": 16 * psi / 4}
    for budget in (1e9, 3e9, 5e9, 6e9, 9e9, 20e9):
        want = [s for s in acc.STAGES if need[s] + 10**8 <= budget]
        assert acc.stages_that_fit(budget, psi, nd, 4, extra_bytes=10**8) == want
    assert "hybrid" not in acc.stages_that_fit(1e12, psi, nd)


def test_numpy_ints_accepted():
    import numpy as np
    assert acc.model_state_total("2", np.int64(1024), np.int32(4)) == 2 * 1024 + 14 * 1024 // 4
    with pytest.raises(ValueError, match="psi must be"):
        acc.model_state_bytes("2", 1.5, 4)


# ---- precision and gradient accumulation ---------------------------------------------
# What each stage keeps on a rank, written out from the design: (bytes per element,
# sharded?) for params, grads, master, m, v, and the fp32 accumulator when K > 1.
def hand_state(stage, psi, nd, ng, precision, k):
    sb = {"fp16": 2, "bf16": 2, "fp32": 4}[precision]
    group = ng if stage == "hybrid" else nd
    shard = {"0": (False, False, False), "1": (False, False, True), "2": (False, True, True),
             "3": (True, True, True), "hybrid": (True, True, True)}[stage]   # params, grads, optimizer
    per = lambda b, sh: b * psi / group if sh else b * psi                   # noqa: E731
    total = per(sb, shard[0]) + per(sb, shard[1]) + 3 * per(4, shard[2])
    if k > 1:   # fp32 accumulator: full Ψ where grads are reduced once per step, a shard at 3/hybrid
        total += per(4, stage in ("3", "hybrid"))
    return total


def hand_traffic(stage, psi, nd, ng, k):
    """Elements one rank sends per optimizer step, by replaying the step's collectives:
    a ring RS or AG over n ranks sends (n-1) blocks of Ψ/n; an all-reduce is RS + AG."""
    ring = lambda n, size: (n - 1) * size / n              # noqa: E731
    events = []
    if stage in ("0", "1", "2"):
        events += [("RS", nd, psi), ("AG", nd, psi)]       # once per step, whatever K
    else:
        g = ng if stage == "hybrid" else nd
        for _ in range(k):                                 # every micro-batch
            events += [("AG", g, psi), ("AG", g, psi), ("RS", g, psi)]
        if stage == "hybrid":                              # the accumulated shard, once per step
            nn = nd // ng
            events += [("RS", nn, psi / ng), ("AG", nn, psi / ng)]
    return sum(ring(n, size) for _, n, size in events)


@pytest.mark.parametrize("stage", acc.STAGES)
@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_state_and_traffic_with_precision_and_grad_accum(stage, precision, k):
    psi, nd, ng = 3 * 5 * 7 * 8 * 1000, 8, 4
    rpn = ng if stage == "hybrid" else None
    tot = acc.model_state_total(stage, psi, nd, rpn, precision, k)
    assert tot == pytest.approx(hand_state(stage, psi, nd, ng, precision, k), rel=1e-12)
    assert acc.bytes_per_param(stage, nd, rpn, precision, k) * psi == pytest.approx(tot, rel=1e-12)
    el = acc.traffic_elements(stage, psi, nd, rpn, k)
    assert sum(el.values()) == pytest.approx(hand_traffic(stage, psi, nd, ng, k), rel=1e-12)
    b = acc.traffic_bytes(stage, psi, nd, rpn, grad_accum=k, precision=precision)
    assert sum(b.values()) == {"fp16": 2, "bf16": 2, "fp32": 4}[precision] * sum(el.values())
    # the printed formula, evaluated at this Nd, is the same number
    f = acc.bytes_per_param_formula(stage, precision, k)
    val = sum(float(t.split("Ψ")[0]) / (ng if "/Ng" in t else nd if "/Nd" in t else 1)
              for t in f.split(" + "))
    assert val == pytest.approx(acc.bytes_per_param(stage, nd, rpn, precision, k), rel=1e-12)


def test_bf16_is_fp16_bytes_and_k1_is_unchanged():
    psi, nd = 1_234_560, 4
    for st in ("0", "1", "2", "3"):
        old = acc.model_state_bytes(st, psi, nd)                      # the existing call
        assert tuple(old) == acc.CLASSES                               # no accumulator key at K = 1
        assert acc.model_state_bytes(st, psi, nd, precision="bf16") == old
        assert acc.model_state_bytes(st, psi, nd, None, "fp16", 1) == old
        assert acc.traffic_elements(st, psi, nd, None, 1) == acc.traffic_elements(st, psi, nd)
        k4 = acc.model_state_bytes(st, psi, nd, grad_accum=4)
        assert k4[acc.ACCUM_CLASS] == (psi if st in "012" else psi // nd) * 4
    assert acc.traffic_formula("3", 4) == "4 x 3Ψ(Nd-1)/Nd" and acc.traffic_formula("2", 4) == "2Ψ(Nd-1)/Nd"
    assert acc.class_name("params_fp16", "bf16") == "params_bf16"
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="grad_accum must be"):
            acc.traffic_elements("3", psi, nd, grad_accum=bad)
    with pytest.raises(ValueError, match="unknown precision"):
        acc.model_state_bytes("0", psi, nd, precision="fp8")


def test_estimate_padded_state_is_layout_shards():
    """With a GPT shape, ringzero's own buffers: one Layout shard per sharded class per rank."""
    cfg = GPTConfig(n_layer=3, n_head=2, n_embd=40, block_size=24, vocab=101)
    for nd in (2, 3):
        lay = Layout(gpt_units(cfg), nd)
        r = est.estimate(lay.numel, nd, cfg=cfg, precision="bf16", grad_accum=3)
        full, sh = lay.padded, lay.shard_numel
        held = {"0": (full, full, full, full), "1": (full, full, sh, full),
                "2": (full, sh, sh, full), "3": (sh, sh, sh, sh)}   # params, grads, optimizer, accumulator
        for row in r["stages"]:
            p, g, o, a = held[row["stage"]]
            assert row["psi_padded"] == full
            assert row["bytes_padded"] == 2 * p + 2 * g + 12 * o + 4 * a


def test_cli_precision_and_grad_accum(capsys):
    est.main(["--params", "1B", "--nd", "8", "--precision", "bf16", "--grad-accum", "4", "--json"])
    r = json.loads(capsys.readouterr().out)
    assert r["precision"] == "bf16" and r["grad_accum"] == 4 and r["loss_scaler"] is False
    s3 = next(x for x in r["stages"] if x["stage"] == "3")
    assert s3["traffic_elements"] == 4 * 3 * 10**9 * 7 // 8
    est.main(["--params", "1B", "--nd", "8", "--precision", "bf16"])
    out = capsys.readouterr().out
    assert "same bytes as fp16" in out and "params_bf16" in out
    with pytest.raises(SystemExit) as e:
        est.main(["--params", "1B", "--grad-accum", "0"])
    assert e.value.code == 2 and "--grad-accum must be >= 1" in capsys.readouterr().err
