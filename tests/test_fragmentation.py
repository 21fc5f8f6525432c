"""``python -m ringzero.explain fragmentation``: the traces come from the real model,
and the headline holds (a conventional step OOMs with >= 30 % free; ringzero's
plan needs exactly its buffers).

References: the real GPT's forward caches (activation sizes), a real Zero
engine's buffers (the plan), Ψ from the closed-form GPT-2 count (what stays
live after a step), and the allocator policies' rounding written out here.
"""
import numpy as np
import pytest

from ringzero.nn.gpt import GPT, PRESETS, GPTConfig
from ringzero.runtime.flat import Layout
from ringzero.tools import allocator as al
from ringzero.tools import fragmentation as fr
from ringzero.tools import traces as tr


def _cache_arrays(c, out):
    if c is None or isinstance(c, (dict, int, float, str)):
        return
    if isinstance(c, (tuple, list)):
        for e in c:
            _cache_arrays(e, out)
        return
    if not (hasattr(c, "shape") and hasattr(c, "nbytes")):
        return                           # dtypes and other scalars in a cache
    out[(c.__array_interface__["data"][0], c.nbytes)] = c.nbytes


@pytest.mark.parametrize("B,T", [(3, 16), (2, 7)])
def test_unit_activations_match_the_real_forward(B, T):
    cfg = GPTConfig(2, 4, 64, 32, 96)
    m = GPT(cfg)
    L = Layout(m.units)
    P = L.views(L.init_full(np.empty(L.padded, np.float32), 0))
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 96, (B, T)), rng.integers(0, 96, (B, T))
    want = tr.unit_activations(cfg, B, T, itemsize=4, stat_bytes=4, id_bytes=8)
    h = x
    for u in range(len(m.units)):
        h, c = m.forward_unit(u, P, h, y if u == len(m.units) - 1 else None)
        got = {}
        _cache_arrays(c, got)
        assert sorted(got.values()) == sorted(want[u]), f"unit {u}"
        assert sum(want[u]) == m.cache_nbytes(c)


@pytest.mark.parametrize("stage", ["0", "1", "2", "3"])
@pytest.mark.parametrize("precision", ["fp16", "fp32"])
@pytest.mark.parametrize("overlap", [False, True])
def test_plan_matches_a_real_engine(stage, precision, overlap):
    from mpi4py import MPI

    from ringzero.runtime.zero import Zero
    cfg = GPTConfig(3, 2, 32, 16, 64)
    eng = Zero(GPT(cfg), MPI.COMM_SELF, stage, device="cpu", precision=precision, overlap=overlap)
    plan = tr.plan_buffers(cfg, stage, 1, device="cpu", precision=precision, overlap=overlap)
    for k in ("params", "grads", "master", "adam_m", "adam_v"):
        assert plan[k] == eng.bufs[k].nbytes, k
    for k, bufs in eng.work.items():
        assert sorted(v for n, v in plan.items() if n.rstrip("0123456789") == k) == \
            sorted(b.nbytes for b in bufs), k
    assert plan["adam_tmp"] + plan["grad_scratch"] == eng.memory_report()["optimizer_scratch"]


def test_conventional_trace_is_well_formed_and_keeps_14_bytes_per_param():
    cfg = GPTConfig(2, 2, 64, 32, 100)
    psi = 12 * 2 * 64 * 64 + 13 * 2 * 64 + (100 + 32) * 64 + 2 * 64   # GPT-2 closed form
    for ckpt in (False, True):
        trace = tr.conventional_trace(cfg, [(2, 16), (1, 32)], checkpoint=ckpt)
        live = {}
        for e in trace:
            if e[0] == "alloc":
                assert e[1] not in live
                live[e[1]] = e[2]
            else:
                live.pop(e[1])          # KeyError if freed twice or never made
        # after the last step: fp16 weight + fp32 master, m, v per parameter; grads freed
        assert sum(live.values()) == 14 * psi


def test_headline_conventional_ooms_with_30pct_free_ringzero_needs_its_bytes():
    r = fr.demo(PRESETS["gpt2-medium"], fr.DEMO_SHAPES, checkpoint=True)
    plan = list(r["plan"].values())
    assert sum(plan) == r["planned_bytes"]
    for name, d in r["by_policy"].items():
        pol = al.POLICIES[name]
        cv, rz = d["conventional"], d["ringzero"]
        w = cv["worst_oom"]
        # the cap holds the trace's live peak (a perfect allocator runs), yet it OOMs with >= 30 % free
        assert w is not None and w["cap"] >= cv["peak_live"], name
        assert w["free_share"] >= 0.30, (name, w["free_share"])
        assert w["largest_free_block"] < w["request"] and w["device_free"] < w["segment_needed"]
        # ringzero's plan runs at exactly its buffers rounded to the allocator's segments, not below
        rounded = sum(512 * -(-b // 512) for b in plan)
        if name == "cupy":
            assert rz["smallest_cap"] == rounded
        else:
            segs = sum(max(2 << 20, -(-b // (2 << 20)) * (2 << 20)) if b >= 10 << 20 else 20 << 20
                       for b in (512 * -(-b // 512) for b in plan))
            assert rz["smallest_cap"] == segs
        assert rz["runs_at_smallest"] and rz["fails_below"]
        # fragmentation is the cap above the live bytes: >= 10 % for the conventional
        # step, the segment rounding alone (< 0.2 %) for ringzero's flat plan
        assert cv["smallest_cap"] >= 1.10 * cv["peak_live"], (name, cv["smallest_cap"], cv["peak_live"])
        assert rz["smallest_cap"] <= 1.002 * rz["peak_live"], (name, rz["smallest_cap"], rz["peak_live"])
        assert pol.name == name


def test_cli(capsys):
    from ringzero.tools import explain
    assert explain.main(["fragmentation", "--model", "gpt2", "--shapes", "4x64,4x128",
                         "--policy", "cupy"]) == 0
    out = capsys.readouterr().out
    assert "allocator model: cupy" in out and "ringzero" in out
    assert explain.main(["fragmentation", "--shapes", "8x"]) == 2
    assert "expected BxT" in capsys.readouterr().err
