"""Reduction buckets (stages 0-2): consecutive units' gradients reduced by one call.

References: the grouping rule written out by hand for small cases; the
per-unit reductions (``reduce_bucket=0``, checked against NumPy and MPI by
test_zero.py) for the bits of a whole training run; the ring's own call
ledger for the number of reduce-scatters a step makes; the layout's padded
unit sizes for the bucket workspace.
"""
import numpy as np
import pytest
from conftest import assert_all
from test_zero import batches, engine

from ringzero.runtime.plan import reduce_buckets


# ---- the grouping rule (serial) -------------------------------------------------------
@pytest.mark.parametrize("order,nbytes,cap,want", [
    ((3, 2, 1, 0), [10] * 4, 40, ((0, 1, 2, 3),)),          # all in one
    ((3, 2, 1, 0), [10] * 4, 39, ((1, 2, 3), (0,))),        # the cap is inclusive: 30 fits, 40 does not
    ((3, 2, 1, 0), [10] * 4, 25, ((2, 3), (0, 1))),
    ((3, 2, 1, 0), [10] * 4, 0, ((3,), (2,), (1,), (0,))),  # 0: every unit alone
    ((3, 2, 1, 0), [10, 50, 10, 10], 25, ((2, 3), (1,), (0,))),   # a unit over the cap: alone
    ((3, 1, 2, 0), [10] * 4, 40, ((3,), (1,), (2,), (0,))),  # not u, u-1: a new bucket
    ((0, 1), [10] * 2, 40, ((0,), (1,))),                   # ascending closes: never together
])
def test_reduce_buckets_groups_consecutive_closes(order, nbytes, cap, want):
    assert reduce_buckets(order, nbytes, cap) == want


@pytest.mark.parametrize("cap", [-1, 1.5, True])
def test_reduce_buckets_refuses_a_bad_cap(cap):
    with pytest.raises(ValueError, match="bucket cap"):
        reduce_buckets((1, 0), [4, 4], cap)


# ---- the engine (MPI) -------------------------------------------------------------------
def _run(comm, stage, bucket, steps=4, **kw):
    eng = engine(comm, stage, reduce_bucket=bucket, overlap=False, **kw)
    data = batches(comm, comm.size, comm.rank)
    K = kw.get("grad_accum", 1)
    losses, norms, calls = [], [], []
    for s in range(steps):
        x, y = data.get(s)
        if K > 1:
            x, y = np.concatenate([x, x]), np.concatenate([y, y])
        before = [eng.ring.ledger[op]["calls"] for op in ("reduce_scatter", "all_gather")]
        r = eng.step(x, y, 3e-3)
        calls.append(tuple(eng.ring.ledger[op]["calls"] - b for op, b in zip(("reduce_scatter", "all_gather"),
                                                                              before)) + (r.skipped,))
        losses.append(r.loss)
        norms.append(r.grad_norm)
    # every state buffer, but stage 1's grads only where they are read: this rank's pieces (the other
    # blocks hold the partial sums of whichever reduce-scatter ran in place)
    bufs = {k: np.asarray(eng.bufs[k]).tobytes() for k in ("params", "master", "adam_m", "adam_v")}
    g, L = eng.bufs["grads"], eng.layout
    bufs["grads"] = (b"".join(L.own(L.unit_full(g, u), u, comm.rank).tobytes() for u in range(len(L.units)))
                     if stage == "1" else np.asarray(g).tobytes())
    return losses, norms, bufs, calls, eng


def _units_bytes(eng):
    return [n * np.dtype(eng.storage_dtype).itemsize for n in eng.layout.unit_padded]


@pytest.mark.mpi
@pytest.mark.parametrize("stage", ["0", "1", "2"])
@pytest.mark.parametrize("precision", ["fp16", "fp32"])
@pytest.mark.parametrize("grad_accum", [1, 2])
@pytest.mark.parametrize("split", ["all", "pairs"])
def test_buckets_are_bitwise_the_per_unit_reductions(comm, stage, precision, grad_accum, split):
    """Buckets of every unit, or of about two units, train bit for bit as per-unit reductions, with one
    reduce-scatter per bucket (stage 0: per bucket and per all-gather of the gradients' pieces)."""
    if comm.size == 1:
        pytest.skip("one rank reduces nothing: no buckets")
    kw = dict(precision=precision, grad_accum=grad_accum)
    ref = _run(comm, stage, 0, **kw)
    units = _units_bytes(ref[4])
    cap = sum(units) if split == "all" else 2 * max(units)
    got = _run(comm, stage, cap, **kw)
    eng = got[4]
    n_buckets = len(eng.workspaces.buckets) + sum(1 for u in range(len(units))
                                                   if u not in eng.workspaces._group)
    # the shard ring's own count of reduce-scatters and all-gathers, one of each per bucket per step
    # (stage 0: the gradients' all-gather; 1-2: the update's of the params, none in a step an fp16
    # overflow skipped), per unit without buckets (stage 3 is not here: each of its calls is a unit's);
    # the scalars go through the control ring
    def want(n):
        return [(n, n if stage == "0" or not skipped else 0, skipped) for _, _, skipped in ref[3]]
    ok = (got[0] == ref[0] and got[1] == ref[1] and got[2] == ref[2] and got[3] == want(n_buckets)
          and ref[3] == want(len(units)) and (split == "pairs") == (n_buckets > 1))
    assert_all(comm, ok, f"stage {stage} {precision} K={grad_accum} {split}: losses {got[0]} vs {ref[0]}, "
                         f"buffers equal {got[2] == ref[2]}, (reduce-scatters, all-gathers) per step {got[3]} "
                         f"(want {want(n_buckets)}; per unit {ref[3]}), buckets {eng.workspaces.buckets}")


@pytest.mark.mpi
def test_bucket_workspace_is_its_blocks(comm):
    """The reduce_bucket workspace holds the largest bucket's pieces from every rank, and
    ringzero.tools.traces.plan_buffers says the same bytes."""
    if comm.size == 1:
        pytest.skip("one rank reduces nothing: no buckets")
    from test_zero import TINY

    from ringzero.nn.gpt import GPTConfig
    from ringzero.tools import traces
    eng = engine(comm, "2", overlap=False)               # default cap: every unit of the tiny GPT
    L = eng.layout
    want = 2 * comm.size * sum(L.piece_numel)             # fp16: one bucket of all units
    got = [b.nbytes for b in eng.work.get("reduce_bucket", [])]
    plan = traces.plan_buffers(GPTConfig(**TINY), "2", comm.size, device="cpu", precision="fp16")
    ok = got == [want] and plan.get("reduce_bucket0") == want and "reduce_bucket1" not in plan
    none = engine(comm, "2", overlap=True)                # overlap: per unit, no bucket
    ok &= "reduce_bucket" not in none.work and "reduce_bucket0" not in traces.plan_buffers(
        GPTConfig(**TINY), "2", comm.size, device="cpu", precision="fp16", overlap=True)
    assert_all(comm, ok, f"reduce_bucket {got} B, want [{want}]; plan_buffers {plan.get('reduce_bucket0')}")


@pytest.mark.mpi
def test_buckets_refused_at_stage_3(comm):
    with pytest.raises(ValueError, match="reduce_bucket applies to stages 0-2"):
        engine(comm, "3", reduce_bucket=1 << 20)
    with pytest.raises(ValueError, match="reduce_bucket must be an int >= 0"):
        engine(comm, "2", reduce_bucket=-1)


@pytest.mark.mpi
@pytest.mark.parametrize("stage", ["0", "1", "2", "3"])
@pytest.mark.parametrize("precision", ["fp16", "fp32"])
@pytest.mark.parametrize("overlap", [False, True])
def test_plan_buffers_match_the_engine_on_every_rank_count(comm, stage, precision, overlap):
    """Every workspace the engine allocates on this many ranks, as tools.traces.plan_buffers predicts it
    (with buckets, 2-byte storage makes no unit-sized grad_bucket: no unit is reduced alone)."""
    from test_zero import TINY

    from ringzero.nn.gpt import GPTConfig
    from ringzero.tools import traces
    eng = engine(comm, stage, precision=precision, overlap=overlap)
    plan = traces.plan_buffers(GPTConfig(**TINY), stage, comm.size, device="cpu", precision=precision,
                               overlap=overlap)
    bad = [k for k, bufs in eng.work.items()
           if sorted(v for n, v in plan.items() if n.rstrip("0123456789") == k) != sorted(b.nbytes for b in bufs)]
    bad += [n for n in plan if n.rstrip("0123456789") not in eng.work
            and n not in ("params", "grads", "master", "adam_m", "adam_v", "adam_tmp", "grad_scratch")]
    assert_all(comm, not bad, f"stage {stage} {precision} overlap {overlap} n={comm.size}: {bad} differ; "
                              f"engine {({k: [b.nbytes for b in v] for k, v in eng.work.items()})}, plan {plan}")
