"""The step-time model (ringzero.tools.simulate) against the α–β formulas, written out here.

References: T = steps·α + wire·β with the ring's step counts worked by hand,
the stage traffic of ringzero.runtime.accounting (Ψ(n-1)/n per pass), and a
two-unit timeline with and without overlap worked out on paper.
"""
import json
import math

import pytest

from ringzero.comm.schedule import steps_wire
from ringzero.nn.gpt import GPTConfig, gpt_units
from ringzero.runtime import accounting as acc
from ringzero.runtime.flat import Layout, ParamSpec, Unit
from ringzero.tools import simulate as sm
from ringzero.tools import simulate_cli as cli

MIB = 1 << 20


NODIRECT = dict(direct_bytes=0)


@pytest.mark.parametrize("op,n,S,knobs,want", [
    ("reduce_scatter", 3, 3000, {}, (1, 2000)),                    # direct: one round, (n-1)/n of S
    ("all_reduce", 6, 1.5 * MIB, {}, (2, 2 * 1.5 * MIB * 5 / 6)),   # direct: two rounds, 2S(n-1)/n
    ("all_reduce", 8, 1 * MIB, {}, (6, 2 * MIB * 7 / 8)),           # 2^k: Rabenseifner, 2 log2 n
    ("all_gather", 4, 16 * MIB, {}, (1, 12 * MIB)),                 # direct: one round
    ("all_gather", 4, 64 * MIB, {}, (1, 48 * MIB)),                 # at any size (no scratch)
    ("reduce_scatter", 4, 32 * MIB, {}, (3, 24 * MIB)),             # above: the ring
    ("all_gather", 32, 1 * MIB, {}, (5, 31 * MIB / 32)),            # more than 16 ranks: never direct
    ("reduce_scatter", 3, 3000, NODIRECT, (2, 2000)),               # ring: n-1 steps, (n-1)/n of S
    ("all_gather", 4, 4 * MIB, NODIRECT, (2, 3 * MIB)),             # power of two, <= 16 MiB: log2 n
    ("all_gather", 4, 32 * MIB, NODIRECT, (3, 24 * MIB)),           # above the tree cutoff: the ring
    ("all_reduce", 4, 1024, NODIRECT, (2, 2048)),                   # recursive doubling: log2 n, S·log2 n
    ("all_reduce", 2, 65536, {}, (1, 65536)),                       # n = 2: recursive doubling to 64 KiB
    ("all_reduce", 2, 131072, {}, (2, 131072)),                     # ... then halving + doubling
    ("all_reduce", 4, 1 * MIB, NODIRECT, (4, 1.5 * MIB)),           # Rabenseifner: 2 log2 n, 2S(n-1)/n
    ("all_reduce", 3, 1 * MIB, NODIRECT, (4, 2 * MIB * 2 / 3)),     # ring: 2(n-1)
    ("reduce_scatter", 1, 100, {}, (0, 0.0)),
])
def test_steps_wire(op, n, S, knobs, want):
    st, w = steps_wire(op, n, S, **knobs)     # the Ring's rule, the one the model calls
    assert st == want[0] and w == pytest.approx(want[1])


def test_link_time_is_alpha_beta():
    lk = sm.Links.given(7e-6, 2e9)
    S, n = 6 * MIB, 3
    assert lk.time("all_gather", n, S) == pytest.approx(1 * 7e-6 + (2 / 3) * S / 2e9)   # direct: one round
    fitted = sm.Links(fits={("all_gather", 2): (1e-6, 1e-9), ("all_gather", 8): (5e-6, 2e-9)})
    assert fitted.ab("all_gather", 8) == (5e-6, 2e-9)
    assert fitted.ab("all_gather", 4) == (1e-6, 1e-9)     # nearest n (log distance, then smaller)


@pytest.mark.parametrize("stage", ["0", "1", "2", "3"])
def test_wire_bytes_match_the_stage_traffic(stage):
    """α = 0, β = 1 s/B, no compute: the step is the bytes each rank sends."""
    cfg = GPTConfig(3, 2, 64, 32, 100)
    L1 = Layout(gpt_units(cfg))
    n = 4
    L = Layout(gpt_units(cfg), shards=n)
    zero = sm.Compute([0.0] * len(L.units), [0.0] * len(L.units), 0.0, 0.0)
    got = sm.step_time(L1, stage, n, zero, sm.Links.given(0.0, 1.0))
    want = sum(acc.traffic_bytes(stage, L.padded, n).values())
    if stage == "3":   # the head is gathered once (forward and backward adjacent), not twice
        want -= 2 * L.unit_padded[-1] * (n - 1) // n
    assert got["comm"] == pytest.approx(want) and got["step_s"] == pytest.approx(want)


def test_no_overlap_is_the_sum_of_every_operation():
    cfg = GPTConfig(2, 2, 64, 32, 100)
    L = Layout(gpt_units(cfg), shards=2)
    U = len(L.units)
    comp = sm.Compute([1e-3 * (u + 1) for u in range(U)], [2e-3 * (u + 1) for u in range(U)],
                      1e-9, 3e-9)
    a, b = 5e-6, 1e-9
    r = sm.step_time(Layout(gpt_units(cfg)), "3", 2, comp, sm.Links.given(a, 1 / b))
    P = L.unit_padded
    # materializations: embed twice (its forward, the tied head's run), blocks twice, head once
    mats = [2] + [2] * cfg.n_layer + [1]
    one = lambda S: 1 * a + S / 2 * b                         # n = 2: one step, half the bytes  # noqa: E731
    comm = sum(m * one(2 * p) for m, p in zip(mats, P)) + sum(one(2 * p) for p in P)
    compute = (sum(comp.fwd) + sum(comp.bwd)
               + 1e-9 * (sum(m * p for m, p in zip(mats, P)) + sum(P)))   # casts + grad casts
    update = 3e-9 * L.shard_numel
    assert r["comm"] == pytest.approx(comm)
    assert r["compute"] == pytest.approx(compute)
    assert r["update"] == pytest.approx(update)
    assert r["step_s"] == pytest.approx(comm + compute + update)


def test_overlap_timeline_worked_by_hand():
    """Two units, stage 0, n = 2, every collective α = 0.5 s, forward 1 s, backward 2 s.

    per unit, no overlap: F0 F1 B1 rs1 ag1 B0 rs0 ag0 = 1+1+2+.5+.5+2+.5+.5 = 8 s.
    one bucket (the default without overlap): F0 F1 B1 B0 rs ag = 1+1+2+2+.5+.5 = 7 s.
    overlap (per unit, its default): B1 ends at 4; rs1 4-4.5, ag1 4.5-5 behind B0 (4-6);
    rs0 6-6.5, ag0 6.5-7 -> 7 s.
    """
    L = Layout((Unit("a", (ParamSpec("a.w", (8,)),)), Unit("b", (ParamSpec("b.w", (8,)),))))
    comp = sm.Compute([1.0, 1.0], [2.0, 2.0], 0.0, 0.0)
    lk = sm.Links.given(0.5, math.inf)
    assert sm.step_time(L, "0", 2, comp, lk, reduce_bucket=0)["step_s"] == pytest.approx(8.0)
    assert sm.step_time(L, "0", 2, comp, lk)["step_s"] == pytest.approx(7.0)
    ov = sm.step_time(L, "0", 2, comp, lk, overlap=True)
    assert ov["step_s"] == pytest.approx(7.0) and ov["exposed_comm_s"] == pytest.approx(1.0)


@pytest.mark.parametrize("stage", ["0", "1", "2"])
def test_buckets_are_the_engines_and_keep_the_bytes(stage):
    """The model's buckets are plan.reduce_buckets of the engine's own close order (Zero.plan), and a
    step with buckets sends the same bytes in fewer calls: α = 1 s, β = 0 counts the calls."""
    from mpi4py import MPI

    from ringzero.nn.gpt import GPT
    from ringzero.runtime import plan as pl
    from ringzero.runtime.zero import Zero
    cfg = GPTConfig(3, 2, 32, 16, 64)
    eng = Zero(GPT(cfg), MPI.COMM_SELF, stage, device="cpu")
    L2 = Layout(gpt_units(cfg), shards=2)
    for cap in (1 << 40, 2 * max(L2.unit_padded) * 2):
        want = tuple(g for g in pl.reduce_buckets(pl.close_order(eng.plan), [n * 2 for n in L2.unit_padded], cap)
                     if len(g) > 1)
        assert sm.reduce_buckets(L2, stage, reduce_bucket=cap) == want and want
    assert sm.reduce_buckets(L2, stage, overlap=True) == () and sm.reduce_buckets(L2, "3") == ()
    L1, zero = Layout(gpt_units(cfg)), sm.Compute([0.0] * len(L2.units), [0.0] * len(L2.units), 0.0, 0.0)
    bytes_ = [sm.step_time(L1, stage, 2, zero, sm.Links.given(0.0, 1.0), reduce_bucket=b)["comm"] for b in (0, None)]
    assert bytes_[0] == pytest.approx(bytes_[1])
    calls = [sm.step_time(L1, stage, 2, zero, sm.Links.given(1.0, math.inf), reduce_bucket=b)["comm"]
             for b in (0, None)]
    U = len(L2.units)
    # per unit: its rs and an ag (stage 0: of its gradient; 1-2: the update's); one bucket: one of each
    assert calls[0] == 2 * U and calls[1] == 2


def test_contention_scales_compute_past_the_cores():
    comp = sm.Compute([1.0], [2.0], 0.0, 0.0, cores=2)
    assert comp.slow(2) == 1.0 and comp.slow(8) == 4.0


def test_flops_compute_is_six_tokens_psi_plus_attention():
    cfg = GPTConfig(2, 2, 64, 32, 100)
    c = sm.flops_compute(cfg, 4, 32, 1e12)
    L = Layout(gpt_units(cfg))
    tok = 4 * 32
    want = 3 * (2 * tok * L.numel + 2 * 4 * 4 * 32 * 32 * 64 + 2 * tok * 100 * 64) / 1e12
    assert sum(c.fwd) + sum(c.bwd) == pytest.approx(want)


def test_cli_given_link_and_bad_input(capsys):
    assert cli.main(["--model", "gpt-7.5b", "--nd", "64", "--flops", "40T", "--link", "nvlink"]) == 0
    out = capsys.readouterr().out
    assert "Ψ = 7,459,729,408" in out and "no overlap" in out
    with pytest.raises(SystemExit) as e:
        cli.main(["--model", "gpt-7.5b", "--flops", "lots", "--link", "ib"])
    assert e.value.code == 2
    assert "cannot read --flops" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["--model", "gpt-7.5b", "--flops", "40T"])
    assert e.value.code == 2


def test_measure_compute_runs_the_model():
    c = sm.measure_compute(GPTConfig(1, 2, 32, 16, 64), 2, 16, reps=1)
    assert len(c.fwd) == len(c.bwd) == 3
    assert all(t > 0 for t in c.fwd + c.bwd) and c.cast_s > 0 and c.update_s > 0


def test_step_ops_gather_what_the_engine_plans():
    """Stage 3: one gather per run of the real engine's plan (Zero.plan.param_runs)."""
    from mpi4py import MPI

    from ringzero.nn.gpt import GPT
    from ringzero.runtime.zero import Zero
    cfg = GPTConfig(3, 2, 32, 16, 64)
    eng = Zero(GPT(cfg), MPI.COMM_SELF, "3", device="cpu")
    want = sorted(w for w, _, _ in eng.plan.param_runs)
    for ov in (False, True):
        got = sorted(u for k, u in sm.step_ops(eng.layout, "3", overlap=ov) if k == "gather")
        assert got == want
    rs = [u for k, u in sm.step_ops(eng.layout, "3") if k == "rs"]
    assert sorted(rs) == list(range(len(eng.layout.units)))      # every unit reduced once


def test_hybrid_wire_bytes_match_the_accounting():
    """HYBRID_SHARD at Nd = 4, Ng = 2: stage 3 inside a node plus the shard's all-reduce
    across the Nn = 2 nodes, 3Ψ(Ng-1)/Ng + 2(Ψ/Ng)(Nn-1)/Nn elements."""
    cfg = GPTConfig(3, 2, 64, 32, 100)
    nd, ng = 4, 2
    L = Layout(gpt_units(cfg), shards=ng)
    zero = sm.Compute([0.0] * len(L.units), [0.0] * len(L.units), 0.0, 0.0)
    got = sm.step_time(Layout(gpt_units(cfg)), "hybrid", nd, zero, sm.Links.given(0.0, 1.0),
                       ranks_per_node=ng)
    want = sum(acc.traffic_bytes("hybrid", L.padded, nd, ng).values())
    want -= 2 * L.unit_padded[-1] * (ng - 1) // ng          # the head: gathered once
    assert got["comm"] == pytest.approx(want)


# ---- two links: inside a node, across nodes ------------------------------------------------------
def _zero(L):
    return sm.Compute([0.0] * len(L.units), [0.0] * len(L.units), 0.0, 0.0)


@pytest.mark.parametrize("stage", ["0", "1", "2", "3", "hybrid"])
@pytest.mark.parametrize("nd,N", [(4, 2), (8, 2), (8, 4), (4, 4)])
def test_two_links_split_the_bytes(stage, nd, N):
    """α = 0; a network of P B/s per node (1 s/B per rank) and a free intra-node link: the step is
    the bytes a rank sends across nodes, (Ψ/P)(N-1)/N per pass; the other way round it is the
    bytes that stay inside, Ψ(P-1)/P per pass (both written out here)."""
    cfg = GPTConfig(3, 2, 64, 32, 100)
    L1, P = Layout(gpt_units(cfg)), nd // N
    L = Layout(gpt_units(cfg), shards=P if stage == "hybrid" else nd)
    psi, last = L.padded, L.unit_padded[-1]
    across = lambda el: 2 * el * (N - 1) / nd        # fp16 bytes of one pass across nodes   # noqa: E731
    inside = lambda el: 2 * el * (P - 1) / P         # ... and of one inside a node          # noqa: E731
    net = {"3": 3 * across(psi) - across(last), "hybrid": 2 * across(psi)}.get(stage, 2 * across(psi))
    ins = {"3": 3 * inside(psi) - inside(last), "hybrid": 3 * inside(psi) - inside(last)}.get(stage, 2 * inside(psi))
    if stage == "hybrid":   # the shard's all-reduce among N ranks, one per node, unit by unit: a shard
        # of up to 64 KiB takes recursive doubling at N = 4 (S log2 N, not 2S(N-1)/N; the same at N = 2)
        shard = [2 * u // P for u in L.unit_padded]
        net = sum(S * 2 if N == 4 and S <= 64 * 1024 else 2 * S * (N - 1) / N for S in shard)
    rpn = P if stage == "hybrid" else None
    got = sm.step_time(L1, stage, nd, _zero(L), sm.Links.given(0.0, math.inf), ranks_per_node=rpn,
                       nodes=sm.Nodes(N, 0.0, float(P)))
    assert got["comm"] == pytest.approx(net) and got["internode_bytes"] == pytest.approx(net)
    got = sm.step_time(L1, stage, nd, _zero(L), sm.Links.given(0.0, 1.0), ranks_per_node=rpn,
                       nodes=sm.Nodes(N, 0.0, math.inf))
    assert got["comm"] == pytest.approx(ins)


def test_node_aware_time_by_hand():
    """A reduce-scatter of 4 MiB over 2 nodes x 2: the halving tree inside (1 round, S/2 on the
    intra link), then across on S/P (1 round, S/4, the node's link shared by its P = 2 ranks)."""
    S, a1, bw1, a2, bw2 = 4 * MIB, 3e-6, 50e9, 20e-6, 1e9
    t = sm.Nodes(2, a2, bw2).time("reduce_scatter", 4, S, sm.Links.given(a1, bw1))
    assert t == pytest.approx(a1 + S / 2 / bw1 + a2 + (S / 4) * 2 / bw2)
    # one rank per node: the flat schedule, all of it on the network
    assert sm.Nodes(4, a2, bw2).time("all_gather", 4, S, sm.Links.given(a1, bw1)) == pytest.approx(
        a2 + S * 3 / 4 / bw2)


def test_one_node_is_the_one_host_model():
    cfg = GPTConfig(2, 2, 64, 32, 100)
    L = Layout(gpt_units(cfg))
    comp = sm.Compute([1e-3] * 4, [2e-3] * 4, 1e-9, 3e-9)
    lk = sm.Links.given(5e-6, 1e9)
    for st in ("0", "2", "3"):
        for ov in (False, True):
            assert (sm.step_time(L, st, 4, comp, lk, ov, nodes=sm.Nodes(1, 1.0, 1.0))
                    == sm.step_time(L, st, 4, comp, lk, ov))


@pytest.mark.parametrize("args", [["--nodes", "2"], ["--nodes", "3", "--inter-bandwidth", "1GB/s"],
                                  ["--inter-bandwidth", "1GB/s"], ["--nodes", "0"],
                                  ["--nodes", "2", "--inter-bandwidth", "1GB/s", "--stages", "hybrid",
                                   "--ranks-per-node", "2"]])
def test_cli_nodes_bad_input_exit_2(args, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--block-size", "32", "--vocab", "100",
                  "--nd", "8", "--flops", "1T", "--link", "nvlink", *args])
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err.strip().splitlines()[-1]


def test_cli_nodes_prints_the_bytes_across(capsys):
    assert cli.main(["--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--block-size", "32", "--vocab", "100",
                     "--nd", "8", "--flops", "1T", "--link", "nvlink", "--stages", "2,3,hybrid",
                     "--nodes", "2", "--inter-bandwidth", "125MB/s"]) == 0
    out = capsys.readouterr().out
    assert "nodes: 2" in out and "across nodes" in out and "0.125 GB/s leaving each node" in out


def test_cli_reduce_bucket_mb_reaches_the_model(tmp_path, capsys):
    """--reduce-bucket-mb is the trainer's flag: 0 reduces each unit alone, as step_time(reduce_bucket=0)."""
    base = ["--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--block-size", "32", "--vocab", "100",
            "--nd", "8", "--flops", "1T", "--alpha", "1ms", "--bandwidth", "1TB/s", "--stages", "2"]
    comm = {}
    for mb in (None, "0", "16"):
        out = tmp_path / f"b{mb}.json"
        assert cli.main(base + ["--json", str(out)] + ([] if mb is None else ["--reduce-bucket-mb", mb])) == 0
        rows = json.loads(out.read_text())["rows"]
        comm[mb] = rows[0]["comm"]                       # stage 2, no overlap
        L = Layout(gpt_units(GPTConfig(2, 2, 64, 32, 100)))
        comp = sm.flops_compute(GPTConfig(2, 2, 64, 32, 100), 8, 32, 1e12)
        want = sm.step_time(L, "2", 8, comp, sm.Links.given(1e-3, 1e12), False,
                            reduce_bucket=None if mb is None else int(mb) << 20)["comm"]
        assert comm[mb] == pytest.approx(want)
    # one 1 ms latency per reduce call at least: four units alone cost more than one bucket
    assert comm["0"] >= comm["16"] + 3e-3 and comm[None] == pytest.approx(comm["16"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        cli.main(base + ["--reduce-bucket-mb", "-1"])
    assert e.value.code == 2
    assert "--reduce-bucket-mb must be >= 0" in capsys.readouterr().err.strip().splitlines()[-1]
