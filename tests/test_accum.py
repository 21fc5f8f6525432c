"""Gradient accumulation (``grad_accum=K``) against independent references.

- K micro-batches of B/K rows == one batch of B rows (fp32): loss, the
  reduced gradient and the weights, at every stage;
- which stages stay bitwise equal at K > 1 and which only within rounding
  (stages 0-2 add micro-batches on the rank and then over ranks, stage 3
  over ranks first, once per micro-batch: workspace.py's docstring);
- memory per class and ledger bytes per step vs the stage rules written out
  here from the layout's padded sizes (not from accounting.py);
- an Inf in one micro-batch on one rank skips the whole step everywhere.
"""
import numpy as np
import pytest
from conftest import assert_all
from test_zero import B as MICRO
from test_zero import T, batches, tiny_model

pytestmark = pytest.mark.mpi

K = 4
ROWS = K * MICRO            # rows per rank per optimizer step: K x micro-batch


def engine(comm, stage, **kw):
    from ringzero.runtime.zero import Zero
    kw.setdefault("seed", 3)
    if stage == "hybrid":
        kw.setdefault("ranks_per_node", comm.size)      # one node: no replicas
    return Zero(tiny_model(), comm, stage, timeout=60, **kw)


def step_data(comm, rows=ROWS):
    """Rows per rank of the same (seed, step) global batch as test_zero's stream."""
    from ringzero.app.data import Batches
    return Batches(batches(comm, comm.size, comm.rank).data, rows, T, comm.rank, comm.size, 5)


def train(eng, data, steps=10, lr=3e-3):
    out = []
    for s in range(steps):
        x, y = data.get(s)
        out.append(eng.step(x, y, lr).loss)
    return out


def rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("stage", ["0", "1", "2", "3"])
def test_k_micro_batches_equal_one_batch_fp32(comm, stage):
    """K=4 x 2 rows == K=1 x 8 rows on the same global batch: every step's
    loss and the first step's reduced gradient within 1e-6 relative, the
    weights after 10 steps within 1e-5 (Adam divides by |g|: rounding noise
    on a near-zero gradient element moves it by O(lr), see the report)."""
    data = step_data(comm)
    one, acc = engine(comm, stage, precision="fp32"), engine(comm, stage, precision="fp32", grad_accum=K)
    x, y = data.get(0)
    l1, lk = [one.step(x, y, 3e-3).loss], [acc.step(x, y, 3e-3).loss]
    # after step 0: grads = sum over ranks of the mean over this rank's rows (scale 1)
    g_rel = rel(acc.full_state("grads"), one.full_state("grads"))
    for s in range(1, 10):
        x, y = data.get(s)
        l1.append(one.step(x, y, 3e-3).loss)
        lk.append(acc.step(x, y, 3e-3).loss)
    loss_rel = max(abs(a - b) / abs(a) for a, b in zip(l1, lk))
    w_rel = rel(acc.full_state("master"), one.full_state("master"))
    ok = loss_rel <= 1e-6 and g_rel <= 1e-6 and w_rel <= 1e-5 and lk[-1] < lk[0]
    assert_all(comm, ok, f"stage {stage}: loss rel {loss_rel:.2e}, grad rel {g_rel:.2e}, "
                         f"weights rel {w_rel:.2e}")


def _run(comm, stage, precision, steps=6):
    eng = engine(comm, stage, precision=precision, grad_accum=K)
    losses = train(eng, step_data(comm), steps)
    return losses, eng.full_state("master"), eng.full_params()


def _same(a, b) -> bool:
    return a[0] == b[0] and np.array_equal(a[1], b[1]) and np.array_equal(a[2], b[2])


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_which_stages_stay_bitwise_at_k(comm, precision):
    """At K > 1: stages 0, 1, 2 bitwise equal (one local fp32 sum, one RS);
    stage 3 bitwise equal to hybrid on one node; stage 3 vs 0 within rounding,
    and bitwise at Nd = 1 in fp32 (no reduce-scatter to regroup the sums)."""
    runs = {st: _run(comm, st, precision) for st in ("0", "1", "2", "3", "hybrid")}
    bad = [st for st in ("1", "2") if not _same(runs[st], runs["0"])]
    ok = not bad and _same(runs["hybrid"], runs["3"])
    l0, l3 = np.array(runs["0"][0]), np.array(runs["3"][0])
    tol = 2e-3 if precision == "fp16" else 1e-5
    close = np.allclose(l3, l0, rtol=tol, atol=tol)
    if comm.size == 1 and precision == "fp32":
        close &= _same(runs["3"], runs["0"])
    assert_all(comm, ok, f"{precision}: stages {bad} differ from 0, or hybrid(one node) differs from 3")
    assert_all(comm, close, f"{precision}: stage 3 vs 0 losses {l3[-2:]} vs {l0[-2:]}")


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("stage", ["0", "1", "2", "3", "hybrid"])
def test_memory_and_ledger_at_k(comm, stage, k):
    """Bytes per class (fp32 accumulator: full at 0-2, a shard at 3/hybrid,
    none at K=1) and bytes sent per step (0-2 as K=1, stage 3 K times)."""
    from ringzero.runtime.optim import LossScaler
    rpn = None
    if stage == "hybrid":
        if comm.size % 2 or comm.size < 4:
            pytest.skip("hybrid with replicas needs an even world size >= 4")
        rpn = comm.size // 2        # two nodes: every all-reduce algorithm sends 2S(Nn-1)/Nn here
    eng = engine(comm, stage, grad_accum=k, ranks_per_node=rpn, scaler=LossScaler(init=2.0 ** 8))
    L, n = eng.layout, comm.size
    g = rpn or n                                    # the sharding group
    P, last = L.padded, L.unit_padded[-1]
    sharded = {"0": (), "1": ("master", "m", "v"), "2": ("grads", "master", "m", "v")}.get(
        stage, ("params", "grads", "master", "m", "v", "accum"))
    size = lambda name: P // g if name in sharded else P            # noqa: E731
    want = {"params_fp16": 2 * size("params"), "grads_fp16": 2 * size("grads"),
            "master_fp32": 4 * size("master"), "adam_m_fp32": 4 * size("m"), "adam_v_fp32": 4 * size("v")}
    if k > 1:
        want["grad_accum_fp32"] = 4 * size("accum")
    rep = eng.memory_report()["classes"]
    got = {c: d["measured_bytes"] for c, d in rep.items()}
    ok_mem = got == want and all(d["formula_bytes"] == want[c] for c, d in rep.items())

    data = step_data(comm, rows=k * MICRO)
    train(eng, data, 1)
    x, y = data.get(1)
    skipped = eng.step(x, y, 1e-3).skipped
    hop = lambda elems, m: 2 * elems * (m - 1) // m          # noqa: E731  fp16 bytes of one ring pass
    if stage in ("0", "1", "2"):
        sent = 2 * hop(P, n)                                  # RS + AG once per step, any K
    else:
        sent = k * (hop(P, g) + hop(2 * P - last, g))         # per micro-batch: RS + AG fwd + AG bwd
        if stage == "hybrid":
            sent += 2 * hop(P // g, n // g)                   # all-reduce of the summed shard, once
    meas = eng.traffic_report()["measured_bytes_per_step"]
    ok_led = meas == sent and not skipped
    assert_all(comm, ok_mem, f"stage {stage} K={k}: memory {got}, expected {want}")
    assert_all(comm, ok_led, f"stage {stage} K={k}: ledger {meas} B, expected {sent} B (skipped={skipped})")


class _InfAtMicro:
    """Wraps a model: on rank ``who``, micro-batch ``when`` puts +Inf into one gradient."""

    def __init__(self, model, who, rank, when):
        self.m, self.armed, self.when, self.calls = model, who == rank, when, 0
        self.units = model.units

    def __getattr__(self, k):
        return getattr(self.m, k)

    def backward_unit(self, u, dy, cache, P, G):
        dx = self.m.backward_unit(u, dy, cache, P, G)
        if u == 1:
            if self.armed and self.calls == self.when:
                next(iter(G.values())).flat[0] = np.inf
            self.calls += 1
        return dx


@pytest.mark.parametrize("stage", ["0", "3"])
def test_inf_in_one_micro_batch_skips_the_step(comm, stage):
    from ringzero.runtime.optim import LossScaler
    eng = engine(comm, stage, grad_accum=K, scaler=LossScaler(init=2.0 ** 12, hysteresis=1))
    data = step_data(comm)
    train(eng, data, 2)
    before = eng.full_state("master").copy()
    wrapped = _InfAtMicro(eng.model, comm.size - 1, comm.rank, when=2)   # micro-batch 2 of 4
    eng.model = wrapped
    x, y = data.get(2)
    res = eng.step(x, y, 1e-3)
    after = eng.full_state("master")
    ok = res.skipped and eng.scaler.scale == 2.0 ** 11 and np.array_equal(before, after)
    eng.model = wrapped.m
    ok &= not eng.step(x, y, 1e-3).skipped
    assert_all(comm, ok, f"stage {stage}: skipped={res.skipped} scale={eng.scaler.scale}")


def test_batch_must_split_into_k(comm):
    eng = engine(comm, "0", grad_accum=3)
    x, y = step_data(comm, rows=4).get(0)
    try:
        eng.step(x, y, 1e-3)
        msg = ""
    except ValueError as e:
        msg = str(e)
    assert_all(comm, "B % 3 == 0, got B = 4" in msg, f"got {msg!r}")


@pytest.mark.parametrize("stage", ["2", "3"])
def test_accumulator_allocated_once(comm, stage):
    """The accumulator is made at start-up: no buffer moves and traced memory
    does not grow over steps of K micro-batches."""
    import gc
    import tracemalloc
    eng = engine(comm, stage, grad_accum=K)
    data = step_data(comm)
    train(eng, data, 2)
    ptrs = lambda: {**{k: v.ctypes.data for k, v in eng.bufs.items()},          # noqa: E731
                    **{f"{k}{i}": b.ctypes.data for k, v in eng.work.items() for i, b in enumerate(v)}}
    before = ptrs()
    tracemalloc.start()
    x, y = data.get(2)
    eng.step(x, y, 1e-3)
    gc.collect()            # cyclic garbage (a recursive closure per cache walk) is not growth
    base = tracemalloc.get_traced_memory()[0]
    for s in range(3, 6):
        x, y = data.get(s)
        eng.step(x, y, 1e-3)
    gc.collect()
    grown = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    ok = "grad_accum" in eng.bufs and ptrs() == before and grown < 64 * 1024
    assert_all(comm, ok, f"buffers moved: {ptrs() != before}; traced memory grew {grown} B")
