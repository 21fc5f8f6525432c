"""Overlap changes timing, never arithmetic: the engine with and without it, bit for bit.

Every stage, precision and grad_accum trains a few steps twice from the same
seed, once with the closed gradients' reductions started on the progress
thread (``overlap=True``, the default) and once blocking; losses, gradient
norms and every state buffer must be identical bytes. With
RINGZERO_CHECK_OWNERSHIP=1 every buffer the workspaces write is checked
against the ring's started calls, so a missing wait raises instead of racing.
"""
import time

import numpy as np
import pytest
from conftest import assert_all
from test_zero import batches, engine

pytestmark = pytest.mark.mpi


@pytest.fixture(autouse=True)
def check_ownership(monkeypatch):
    """Every write checked against the started calls, and every started call held 20 ms before it
    runs, so that a reduction is still in flight wherever a missing wait would let the step race it."""
    from ringzero.comm import progress
    monkeypatch.setenv("RINGZERO_CHECK_OWNERSHIP", "1")
    submit = progress.Progress.submit

    def slow_submit(self, job, pending):
        def late():
            time.sleep(0.02)
            job()
        return submit(self, late, pending)
    monkeypatch.setattr(progress.Progress, "submit", slow_submit)


def run(comm, stage, overlap, **kw):
    eng = engine(comm, stage, overlap=overlap, **kw)
    data = batches(comm, comm.size, comm.rank)
    losses, norms = [], []
    for s in range(4):
        x, y = data.get(s)
        if kw.get("grad_accum", 1) > 1:
            x, y = np.concatenate([x, x]), np.concatenate([y, y])
        r = eng.step(x, y, 3e-3)
        losses.append(r.loss)
        norms.append(r.grad_norm)
    bufs = {k: np.asarray(v).tobytes() for k, v in eng.bufs.items()}
    return losses, norms, bufs, eng


# per-unit reductions (bucket 0) at every stage; buckets of every unit (16 MiB) at stages 0-2, theirs
STAGE_BUCKETS = [(st, 0) for st in ("0", "1", "2", "3", "hybrid")] + [(st, 1 << 24) for st in ("0", "1", "2")]


@pytest.mark.parametrize("stage,bucket", STAGE_BUCKETS)
@pytest.mark.parametrize("precision", ["fp16", "fp32"])
@pytest.mark.parametrize("grad_accum", [1, 2])
def test_overlap_is_bitwise_the_blocking_step(comm, stage, bucket, precision, grad_accum):
    """Each stage with and without overlap, at the same bucket size."""
    if stage == "hybrid" and (comm.size % 2 or comm.size < 4):
        pytest.skip("hybrid needs an even world size >= 4")
    kw = dict(precision=precision, grad_accum=grad_accum, reduce_bucket=bucket)
    if stage == "hybrid":
        kw["ranks_per_node"] = 2
    on = run(comm, stage, True, **kw)
    off = run(comm, stage, False, **kw)
    same = on[0] == off[0] and on[1] == off[1] and on[2] == off[2]
    tl = on[3].timeline
    sane = all(tl[k] >= 0 for k in ("reduce_s", "reduce_exposed_s", "reduce_hidden_s", "compute_s"))
    assert_all(comm, same and sane, f"stage {stage} {precision} K={grad_accum}: losses {on[0]} vs {off[0]}, "
                                    f"norms {on[1]} vs {off[1]}, buffers equal {on[2] == off[2]}; {tl}")


def test_overlap_holds_one_more_gradient_slot_and_two_buckets(comm):
    """The in-flight reduction's slot is workspace the memory report counts (fp32: a slot; fp16: a bucket)."""
    e32 = [engine(comm, "2", precision="fp32", overlap=o) for o in (True, False)]
    e16 = [engine(comm, "2", precision="fp16", overlap=o, reduce_bucket=0) for o in (True, False)]
    slots = [e.plan.grad_slots for e in e32]
    buckets = [len(e.work["grad_bucket"]) for e in e16]
    work = [e.memory_report() for e in e16]
    ok = slots[0] == slots[1] + 1 and buckets == [2, 1] and work[0] != work[1]
    assert_all(comm, ok, f"grad slots {slots}, fp16 buckets {buckets}")


@pytest.mark.parametrize("stage", ["3", "hybrid"])
@pytest.mark.parametrize("precision", ["fp16", "fp32"])
@pytest.mark.parametrize("prefetch", [2, 3])
def test_deeper_prefetch_is_bitwise_the_blocking_step(comm, stage, precision, prefetch):
    """Gathers started two and three positions ahead (more landings in flight): the same bits."""
    if stage == "hybrid" and (comm.size % 2 or comm.size < 4):
        pytest.skip("hybrid needs an even world size >= 4")
    kw = dict(precision=precision, **({"ranks_per_node": 2} if stage == "hybrid" else {}))
    on = run(comm, stage, True, prefetch=prefetch, **kw)
    off = run(comm, stage, False, **kw)
    same = on[0] == off[0] and on[1] == off[1] and on[2] == off[2]
    tl = on[3].timeline
    assert_all(comm, same and tl["gather_s"] > 0 and on[3].plan.prefetch == prefetch,
               f"stage {stage} {precision} prefetch {prefetch}: losses {on[0]} vs {off[0]}; {tl}")


def test_prefetch_needs_overlap(comm):
    with pytest.raises(ValueError, match="prefetch 1 needs overlap"):
        engine(comm, "3", overlap=False, prefetch=1)
