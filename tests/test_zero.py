"""The sharding runtime against independent references.

- memory: the bytes each state buffer really holds vs the stage formula,
  recomputed here from the layout's padded sizes (not from accounting.py);
- traffic: the ring ledger vs the element counts of the schedule;
- equivalence: stages 0-3 bitwise equal at the same Nd; HYBRID and Nd = 1
  on the global batch within tolerance;
- the loss scaler on an Inf injected on one rank; clipping vs the norm of
  the full gradient summed with MPI's own Allreduce; the memory budget.
"""
import numpy as np
import pytest
from conftest import assert_all

pytestmark = pytest.mark.mpi

TINY = dict(n_layer=2, n_head=2, n_embd=24, block_size=16, vocab=37)   # Ψ not divisible by 2, 3, 4, 8
B, T = 2, 16


def tiny_model(checkpoint=False):
    from ringzero.nn.gpt import GPT, GPTConfig
    return GPT(GPTConfig(**TINY), checkpoint=checkpoint)


def batches(comm, n_world, rank, seed=5):
    from ringzero.app.data import Batches
    # a learnable stream: a fixed permutation cycle with 10% noise tokens
    rng = np.random.default_rng(0)
    data = (np.arange(4096) * 7 % TINY["vocab"]).astype(np.uint8)
    noise = rng.random(4096) < 0.1
    data[noise] = rng.integers(0, TINY["vocab"], int(noise.sum()))
    return Batches(data, B, T, rank, n_world, seed)


def engine(comm, stage, **kw):
    from ringzero.runtime.zero import Zero
    kw.setdefault("seed", 3)
    return Zero(tiny_model(kw.pop("checkpoint", False)), comm, stage, timeout=60, **kw)


def train(eng, data, steps=20, lr=3e-3):
    losses = []
    for s in range(steps):
        x, y = data.get(s)
        losses.append(eng.step(x, y, lr).loss)
    return losses


@pytest.mark.parametrize("stage", ["0", "1", "2", "3"])
def test_memory_matches_formula(comm, stage):
    """Measured buffer bytes per class == the stage's rule on the padded Ψ."""
    eng = engine(comm, stage)
    n, L = comm.size, eng.layout
    P = L.padded                              # padded Ψ: units padded to a multiple of n * align
    full, shard = P, P // n
    sharded = {"0": (), "1": ("master", "m", "v"), "2": ("grads", "master", "m", "v"),
               "3": ("params", "grads", "master", "m", "v")}[stage]
    want = {"params_fp16": 2 * (shard if "params" in sharded else full),
            "grads_fp16": 2 * (shard if "grads" in sharded else full),
            "master_fp32": 4 * (shard if "master" in sharded else full),
            "adam_m_fp32": 4 * (shard if "m" in sharded else full),
            "adam_v_fp32": 4 * (shard if "v" in sharded else full)}
    rep = eng.memory_report()["classes"]
    got = {c: rep[c]["measured_bytes"] for c in want}
    ok = got == want and all(rep[c]["formula_bytes"] == want[c] for c in want)
    # padding: each unit rounds up to a multiple of n * align, no more
    pad = P - L.numel
    ok &= 0 <= pad < len(L.units) * n * L.align
    assert_all(comm, ok, f"stage {stage}: measured {got}, expected {want}")


def test_memory_hybrid(comm):
    if comm.size % 2 or comm.size < 4:
        pytest.skip("hybrid test needs an even world size >= 4")
    eng = engine(comm, "hybrid", ranks_per_node=2)
    P = eng.layout.padded
    rep = eng.memory_report()["classes"]
    want = {"params_fp16": 2 * P // 2, "grads_fp16": 2 * P // 2, "master_fp32": 4 * P // 2,
            "adam_m_fp32": 4 * P // 2, "adam_v_fp32": 4 * P // 2}
    got = {c: rep[c]["measured_bytes"] for c in want}
    assert_all(comm, got == want, f"hybrid: measured {got}, expected {want}")


@pytest.mark.parametrize("stage", ["0", "1", "2", "3"])
def test_traffic_matches_schedule(comm, stage):
    """Ledger bytes of one step == the element counts of the stage's schedule."""
    from ringzero.runtime.optim import LossScaler
    eng = engine(comm, stage, scaler=LossScaler(init=2.0 ** 8))   # no overflow-skipped step
    data = batches(comm, comm.size, comm.rank)
    train(eng, data, steps=1)
    x, y = data.get(1)
    skipped = eng.step(x, y, 1e-3).skipped
    n, L = comm.size, eng.layout
    P, last = L.padded, L.unit_padded[-1]
    hop = lambda elems: 2 * elems * (n - 1) // n         # noqa: E731 (fp16 bytes a ring pass sends per rank)
    want = {"0": hop(P) * 2,                              # all-reduce = RS + AG of every unit
            "1": hop(P) * 2, "2": hop(P) * 2,             # RS grads + AG params
            "3": hop(P) + hop(2 * P - last)}[stage]       # RS + AG fwd + AG bwd (last unit once)
    rep = eng.traffic_report()
    ok = rep["measured_bytes_per_step"] == want and not skipped
    if stage != "3":
        ok &= rep["formula_bytes_per_step"] == want
    assert_all(comm, ok, f"stage {stage}: ledger {rep['measured_bytes_per_step']} B, expected {want} B")


def _global(eng, name):
    return eng.full_state(name)


def test_stages_bitwise_equal(comm):
    """20 steps at the same Nd and seed: stages 0-3 give identical losses and weights."""
    data = batches(comm, comm.size, comm.rank)
    runs = {}
    for st in ("0", "1", "2", "3"):
        eng = engine(comm, st)
        losses = train(eng, data)
        runs[st] = (losses, _global(eng, "master"), eng.full_params())
    ref = runs["0"]
    bad = [st for st, r in runs.items()
           if r[0] != ref[0] or not np.array_equal(r[1], ref[1]) or not np.array_equal(r[2], ref[2])]
    assert_all(comm, not bad, f"stages {bad} differ bitwise from stage 0")
    # padding stays out of the update: every padded element is still exactly 0
    L = engine(comm, "0").layout
    pad = [(L.unit_offset[u] + L.unit_numel[u], L.unit_offset[u] + L.unit_padded[u]) for u in range(len(L.units))]
    dirty = [st for st, r in runs.items() for a, b in pad if np.any(r[1][a:b]) or np.any(r[2][a:b])]
    assert_all(comm, not dirty, f"padding of stages {sorted(set(dirty))} is not zero after training")
    assert_all(comm, ref[0][-1] < ref[0][0], f"loss did not fall: {ref[0][0]} -> {ref[0][-1]}")


@pytest.mark.parametrize("precision,K", [("fp16", 1), ("fp32", 1), ("fp16", 2)])
def test_fused_ram_update_is_the_numpy_update(comm, monkeypatch, precision, K):
    """The update in RAM runs the C pass (optim.update_tile) where it was built: 8 steps of it give
    the bits of the NumPy AdamW it replaces (widen, scale, ten passes), at every stage."""
    from ringzero.runtime import optim
    if not optim.HAVE_C:
        pytest.skip("ringzero.runtime._adam was not built")
    data = batches(comm, comm.size, comm.rank)
    calls, tile = [], optim.AdamW.update_tile
    monkeypatch.setattr(optim.AdamW, "update_tile", lambda self, *a, **k: calls.append(1) or tile(self, *a, **k))
    bad = []
    for st in ("0", "1", "2", "3"):
        got = []
        for have_c in (True, False):
            monkeypatch.setattr(optim, "HAVE_C", have_c)
            eng = engine(comm, st, precision=precision, grad_accum=K)
            got.append((train(eng, data, 8), _global(eng, "master"), _global(eng, "adam_v")))
        (la, ma, va), (lb, mb, vb) = got
        if la != lb or not np.array_equal(ma.view(np.uint32), mb.view(np.uint32)) \
                or not np.array_equal(va.view(np.uint32), vb.view(np.uint32)):
            bad.append(st)
    assert_all(comm, calls, "the RAM update never ran the fused pass")
    assert_all(comm, not bad, f"{precision} K={K}: the fused update differs from NumPy's at stages {bad}")


def test_two_runs_bitwise_equal(comm):
    data = batches(comm, comm.size, comm.rank)
    a, b = engine(comm, "3"), engine(comm, "3")
    la, lb = train(a, data, 5), train(b, data, 5)
    assert_all(comm, la == lb and np.array_equal(_global(a, "master"), _global(b, "master")),
               "two runs with one seed differ")


def test_hybrid_close_and_deterministic(comm):
    if comm.size % 2 or comm.size < 4:
        pytest.skip("hybrid needs an even world size >= 4")
    data = batches(comm, comm.size, comm.rank)
    h1, h2, s0 = engine(comm, "hybrid", ranks_per_node=2), engine(comm, "hybrid", ranks_per_node=2), engine(comm, "0")
    l1, l2, l0 = train(h1, data), train(h2, data), train(s0, data)
    m1, m2 = _global(h1, "master"), _global(h2, "master")
    ok = l1 == l2 and np.array_equal(m1, m2)
    # a different summation grouping: equal within fp16-gradient tolerance
    close = np.allclose(l1, l0, rtol=2e-3, atol=2e-3)
    assert_all(comm, ok, "two HYBRID runs differ bitwise")
    assert_all(comm, close, f"HYBRID vs stage 0 losses: {l1[-3:]} vs {l0[-3:]}")


@pytest.mark.parametrize("stage", ["0", "2", "3"])
def test_matches_one_process_on_global_batch(comm, stage):
    """Every stage tracks a single process (COMM_SELF) training on the global batch."""
    from mpi4py import MPI
    dist = engine(comm, stage, precision="fp32")
    one = engine(MPI.COMM_SELF, "0", precision="fp32")
    d_data = batches(comm, comm.size, comm.rank)
    from ringzero.app.data import Batches
    g_data = Batches(d_data.data, B * comm.size, T, 0, 1, d_data.seed)   # the same global batch
    ld, lo = train(dist, d_data, 10), train(one, g_data, 10)
    md = _global(dist, "master")
    mo = one.full_state("master")
    L = dist.layout
    # compare real parameters by name (the two layouts pad differently)
    worst = 0.0
    for name, s in L.slots.items():
        so = one.layout.slots[name]
        a = md[s.offset:s.offset + s.spec.numel]
        b = mo[so.offset:so.offset + so.spec.numel]
        worst = max(worst, float(np.max(np.abs(a - b))))
    ok = np.allclose(ld, lo, rtol=1e-4, atol=1e-5) and worst < 1e-4
    assert_all(comm, ok, f"stage {stage} vs one process: losses {ld[-1]} vs {lo[-1]}, max |Δw| {worst}")


class _InfAt:
    """Wraps a model; at step ``when`` on rank ``who`` one gradient becomes +Inf."""

    def __init__(self, model, who, rank):
        self.m, self.armed = model, who == rank
        self.units = model.units

    def __getattr__(self, k):
        return getattr(self.m, k)

    def backward_unit(self, u, dy, cache, P, G):
        dx = self.m.backward_unit(u, dy, cache, P, G)
        if self.armed and u == 1:
            next(iter(G.values())).flat[0] = np.inf
        return dx


@pytest.mark.parametrize("stage", ["0", "2", "3"])
def test_overflow_on_one_rank_skips_everywhere(comm, stage):
    from ringzero.runtime.optim import LossScaler
    from ringzero.runtime.zero import Zero
    data = batches(comm, comm.size, comm.rank)
    eng = Zero(tiny_model(), comm, stage, seed=3, timeout=60,
               scaler=LossScaler(init=2.0 ** 12, hysteresis=1))
    train(eng, data, 2)
    before = _global(eng, "master").copy()
    wrapped = _InfAt(eng.model, comm.size - 1, comm.rank)
    eng.model = wrapped
    x, y = data.get(2)
    res = eng.step(x, y, 1e-3)
    after = _global(eng, "master")
    ok = res.skipped and eng.scaler.scale == 2.0 ** 11 and np.array_equal(before, after)
    ok &= bool(np.isfinite(after).all())
    assert_all(comm, ok, f"skipped={res.skipped} scale={eng.scaler.scale} "
                         f"unchanged={np.array_equal(before, after)}")
    # the traffic report reads the last step taken (step 1), not the skipped one; the skipped step's own
    # ledger lacks the params' all-gather at stage 2 (no update to publish), as a ring pass counts it
    n, P, last = comm.size, eng.layout.padded, eng.layout.unit_padded[-1]
    hop = lambda elems: 2 * elems * (n - 1) // n         # noqa: E731 (fp16 bytes a ring pass sends per rank)
    want = {"0": hop(P) * 2, "2": hop(P) * 2, "3": hop(P) + hop(2 * P - last)}[stage]
    rep = eng.traffic_report()
    own = sum(eng.last_step_ledger.values())
    ok = rep["measured_step"] == 1 and rep["steps_run"] == 3 and rep["measured_bytes_per_step"] == want
    ok &= own == (hop(P) if stage == "2" else want)
    assert_all(comm, ok, f"stage {stage}: report of step {rep['measured_step']} {rep['measured_bytes_per_step']} B, "
                         f"the skipped step's {own} B, expected {want} B")
    eng.model = wrapped.m
    res = eng.step(x, y, 1e-3)
    assert_all(comm, not res.skipped, "the step after an overflow should proceed")


def test_clipping_norm_is_global_norm(comm):
    """grad_norm == the norm of every rank's fp32 gradient averaged by MPI's Allreduce."""
    from mpi4py import MPI

    from ringzero.runtime.flat import Layout
    eng = engine(comm, "3")
    data = batches(comm, comm.size, comm.rank)
    x, y = data.get(0)
    full = eng.full_params()                            # the fp16 weights the step will use
    model = tiny_model()
    L1 = Layout(model.units, 1)
    p = np.zeros(L1.padded, np.float64)
    g = np.zeros(L1.padded, np.float64)
    P1, G1 = L1.views(p), L1.views(g)
    for name, s in eng.layout.slots.items():
        P1[name][...] = full[s.offset:s.offset + s.spec.numel].reshape(s.spec.shape)
    model.loss_and_grad(P1, G1, x, y)
    comm.Allreduce(MPI.IN_PLACE, g, op=MPI.SUM)
    ref = float(np.linalg.norm(g / comm.size))
    res = eng.step(x, y, 1e-3)
    ok = abs(res.grad_norm - ref) <= 5e-3 * ref
    assert_all(comm, ok, f"engine grad_norm {res.grad_norm} vs reference {ref}")


def test_memory_budget_refuses_stage0_runs_stage3(comm):
    from ringzero.runtime.flat import Layout
    from ringzero.runtime.zero import MemoryBudgetError
    if comm.size == 1:
        pytest.skip("at Nd = 1 every stage needs the same 16Ψ")
    P = Layout(tiny_model().units, comm.size).padded
    budget = 16 * P // comm.size + 1                    # stage 3 fits, stage 0 (16Ψ) does not
    try:
        engine(comm, "0", mem_budget=budget)
        msg = None
    except MemoryBudgetError as e:
        msg = str(e)
    ok = msg is not None and "budget" in msg and "3" in msg.split("fit:")[-1]
    eng = engine(comm, "3", mem_budget=budget)
    data = batches(comm, comm.size, comm.rank)
    train(eng, data, 1)
    assert_all(comm, ok, f"stage 0 under budget {budget}: {msg!r}")


def test_no_allocation_after_first_step(comm):
    """After step 1 the runtime's buffers are fixed and memory does not grow."""
    import tracemalloc
    eng = engine(comm, "3")
    data = batches(comm, comm.size, comm.rank)
    train(eng, data, 2)
    ptrs = {k: v.ctypes.data for k, v in eng.bufs.items()}
    ptrs.update({f"{k}{i}": b.ctypes.data for k, v in eng.work.items() for i, b in enumerate(v)})
    tracemalloc.start()
    x, y = data.get(2)
    eng.step(x, y, 1e-3)
    base = tracemalloc.get_traced_memory()[0]
    for s in range(3, 6):
        x, y = data.get(s)
        eng.step(x, y, 1e-3)
    grown = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    now = {k: v.ctypes.data for k, v in eng.bufs.items()}
    now.update({f"{k}{i}": b.ctypes.data for k, v in eng.work.items() for i, b in enumerate(v)})
    assert_all(comm, now == ptrs and grown < 64 * 1024,
               f"buffers moved: {now != ptrs}; traced memory grew {grown} B over 3 steps")
