"""--offload-delay (runtime/delay.py, ZeRO-Offload's DPU) against the exact run and a float64 reference.

- warm-up (stages 1-3, fp32; bf16 with K = 2 micro-batches): with delay N, the losses of steps 0..N
  (the forward of step N reads the params of N exact updates) are bitwise those of the exact
  offloaded run; step N+1's is not (it reads stale params);
- the delayed schedule: fp32, clipping active, weight decay on, 12 steps; the engine's losses,
  gradient norms and final weights against a float64 AdamW written out in test_step_reference.py's
  terms, whose step t > N takes its gradient at the weights before step t-1's update (one step
  stale) and whose weights after step t are AdamW of step t's gradient on the weights of t updates;
- it can fail: an engine whose delayed update is joined at once (the undelayed update, a mutant
  monkeypatched here) ends far outside the tolerance, and so does the exact reference;
- resume: a run saved at step 6 (the save drains the pending update) and resumed to step 10 is
  bitwise the run that saved at 6 and went on;
- a failure on the update's thread (an injected ValueError on the last rank) is one OffloadFailed
  on every rank at the next step's join;
- the buffer: allocated once, counted in memory_report beside its formula (storage bytes x Ψ/Nd);
- refusals, one line each: N < 0, with params offload, with --offload-ahead, on a device.
"""
import numpy as np
import pytest
from conftest import assert_all
from test_step_reference import (
    BETA1,
    BETA2,
    EPS,
    TOL_LOSS,
    TOL_W,
    WD,
    batch,
    by_name,
    grads_fp64,
    loss_error,
    lr_at,
    new_model,
    weight_errors,
)

pytestmark = pytest.mark.mpi
STEPS, WARMUP = 12, 3


def shared(comm, tmp_path):
    """One folder for every rank (rank 0's tmp_path)."""
    return comm.bcast(str(tmp_path), root=0)


def make(comm, tmp_path, delay, stage="3", clip=0.0, tile=1024, precision="fp32", grad_accum=1):
    from ringzero.runtime.offload import OffloadPolicy
    from ringzero.runtime.optim import AdamConfig
    from ringzero.runtime.zero import Zero
    adam = AdamConfig(beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=WD, grad_clip=clip)
    off = OffloadPolicy(optimizer=True, dir=str(tmp_path), tile=tile, delay=delay)
    return Zero(new_model(), comm, stage, precision=precision, seed=3, adam=adam, timeout=60, offload=off,
                grad_accum=grad_accum)


def train(eng, comm, steps, start=0):
    losses, norms = [], []
    for s in range(start, start + steps):
        x, y = batch(s, comm.rank)
        r = eng.step(x, y, lr_at(s))
        assert not r.skipped
        losses.append(r.loss)
        norms.append(r.grad_norm)
    return losses, norms


def reference(w0, n, clip, warmup, steps=STEPS):
    """(losses, norms, final weights) of the delayed schedule, float64 (module docstring)."""
    model = new_model()
    W = {k: v.copy() for k, v in w0.items()}
    prev = W                                           # the weights before the last update
    m = {k: np.zeros_like(v) for k, v in W.items()}
    v = {k: np.zeros_like(v) for k, v in W.items()}
    losses, norms = [], []
    for step in range(steps):
        read = W if warmup is None or step <= warmup else prev     # one step stale after the warm-up
        loss, G = grads_fp64(model, read, step, n)
        norm = np.sqrt(sum(float(np.sum(g * g)) for g in G.values()))
        coef = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
        lr, t = lr_at(step), step + 1
        new = {}
        for k in W:
            g = G[k] * coef
            m[k] = BETA1 * m[k] + (1 - BETA1) * g
            v[k] = BETA2 * v[k] + (1 - BETA2) * g * g
            w = W[k] * (1 - lr * WD) if W[k].ndim >= 2 else W[k].copy()
            new[k] = w - lr * (m[k] / (1 - BETA1 ** t)) / (np.sqrt(v[k] / (1 - BETA2 ** t)) + EPS)
        prev, W = W, new
        losses.append(loss)
        norms.append(norm)
    return losses, norms, W


@pytest.mark.parametrize("stage, precision, k", [("1", "fp32", 1), ("2", "fp32", 1), ("3", "fp32", 1),
                                                 ("3", "bf16", 2)])
def test_warmup_is_bitwise_the_exact_run(comm, stage, precision, k, tmp_path):
    if precision == "bf16":
        pytest.importorskip("ml_dtypes")
    d = shared(comm, tmp_path)
    exact, _ = train(make(comm, d, None, stage, precision=precision, grad_accum=k), comm, WARMUP + 3)
    eng = make(comm, d, WARMUP, stage, precision=precision, grad_accum=k)
    delayed, _ = train(eng, comm, WARMUP + 3)
    ok = delayed[:WARMUP + 1] == exact[:WARMUP + 1] and delayed[WARMUP + 1] != exact[WARMUP + 1]
    ok = ok and eng.timeline["update_exposed_s"] >= 0 and bool(eng.delayed)    # a pending update, timed
    assert_all(comm, ok, f"stage {stage}: delayed {delayed} vs exact {exact}")
    assert_all(comm, eng.memory_report()["offload_delay_bytes"] == eng.memory_report()["offload_delay_formula_bytes"]
               == eng.state.grads.itemsize * eng.layout.shard_numel > 0, "the delay buffer beside its formula")


def errors(comm, tmp_path, stage, mutant=None, monkeypatch=None):
    """Rank 0: the engine's errors against the delayed and the exact reference. Collective."""
    probe = make(comm, shared(comm, tmp_path), WARMUP, stage)
    w0 = by_name(probe, probe.full_state("master"))
    probe.close()
    clip = 0.0
    if comm.rank == 0:
        clip = float(np.quantile(reference(w0, comm.size, 0.0, None)[1], 0.3))   # clipping acts in most steps
    clip = comm.bcast(clip, root=0)
    if mutant:
        mutant(monkeypatch)
    eng = make(comm, shared(comm, tmp_path), WARMUP, stage, clip)
    losses, norms = train(eng, comm, STEPS)
    final = by_name(eng, eng.full_state("master"))
    if comm.rank:
        return None
    out = {}
    for name, warm in (("delayed", WARMUP), ("exact", None)):
        r_loss, r_norm, r_w = reference(w0, comm.size, clip, warm)
        we = weight_errors(final, r_w)
        out[name] = (loss_error(losses, r_loss), loss_error(norms, r_norm), max(we.values()))
    return out


def within(e) -> bool:
    return e[0] <= TOL_LOSS and e[1] <= TOL_LOSS * 10 and e[2] <= TOL_W


@pytest.mark.parametrize("stage", ["2", "3"])
def test_delayed_schedule_matches_float64_reference(comm, stage, tmp_path):
    err = errors(comm, tmp_path, stage)
    ok = err is None or (within(err["delayed"]) and not within(err["exact"]))
    assert_all(comm, ok, f"stage {stage}: (loss, norm, weights) errors {err}")


def _undelayed(monkeypatch):
    """The mutant: the delayed update joined as soon as it is started (the exact schedule)."""
    from ringzero.runtime.delay import DelayedUpdate
    start = DelayedUpdate.start

    def start_and_join(self, engine, coef, lr):
        start(self, engine, coef, lr)
        self.join(engine)
    monkeypatch.setattr(DelayedUpdate, "start", start_and_join)


def test_the_comparison_catches_an_undelayed_update(comm, tmp_path, monkeypatch):
    err = errors(comm, tmp_path, "3", _undelayed, monkeypatch)
    ok = err is None or (not within(err["delayed"]) and within(err["exact"]))
    assert_all(comm, ok, f"the undelayed mutant: errors {err}")


def test_resume_is_bitwise_the_run_that_saved(comm, tmp_path):
    from ringzero.runtime import checkpoint as ck
    d = shared(comm, tmp_path)
    ckd = comm.bcast(str(tmp_path / "ck"), root=0)
    a = make(comm, d, 2)
    la, _ = train(a, comm, 6)
    ck.save(a, ckd, 6)                                 # drains the pending update of step 5
    la += train(a, comm, 4, 6)[0]
    state_a = a.full_state("master").tobytes()
    b = make(comm, d, 2)
    ck.load(b, "latest", save_dir=ckd)
    lb = la[:6] + train(b, comm, 4, 6)[0]
    assert_all(comm, lb == la and b.full_state("master").tobytes() == state_a, f"resumed {lb} vs {la}")


@pytest.mark.parametrize("kw, says", [
    (dict(delay=-1), "--offload-delay takes the exact warm-up steps"),
    (dict(delay=2, params=True), "--offload-delay with --offload optimizer,params"),
    (dict(delay=2, ahead=True), "--offload-delay and --offload-ahead"),
])
def test_refusals(kw, says, tmp_path):
    from ringzero.runtime.offload import OffloadError, OffloadPolicy
    from ringzero.runtime.policy import StagePolicy
    with pytest.raises(OffloadError, match=says.replace("-", "\\-")):
        OffloadPolicy(optimizer=True, dir=str(tmp_path), **kw).check(StagePolicy.of("3"))
    with pytest.raises(OffloadError, match="runs on --device cpu only"):
        OffloadPolicy(optimizer=True, dir=str(tmp_path), delay=1, device="cuda").check(StagePolicy.of("3"), "cuda")


@pytest.mark.parametrize("argv, says", [
    (["--offload-delay", "2"], "--offload-delay 2 is given without --offload"),
    (["--offload", "optimizer", "--offload-delay", "-1"], "--offload-delay takes the exact warm-up steps"),
    (["--offload", "optimizer,params", "--stage", "3", "--offload-delay", "2"], "optimizer,params"),
    (["--offload", "optimizer", "--stage", "3", "--zeropp", "qwz", "--offload-delay", "2"], "--zeropp qwz with"),
])
def test_trainer_refuses_in_one_line(argv, says, tmp_path):
    from ringzero.app.config import ConfigError, parse_config
    with pytest.raises(ConfigError, match=says.replace("-", "\\-")) as e:
        parse_config(argv + (["--offload-dir", str(tmp_path)] if "--offload" in argv else []))
    assert "\n" not in str(e.value)


def test_a_failure_on_the_thread_is_agreed_at_the_join(comm, tmp_path, monkeypatch):
    """A ValueError in the delayed update on the last rank: one OffloadFailed on every rank, at the next
    step's join (the step that started it has returned)."""
    from ringzero.runtime.offload import FAULT_ENV, OffloadFailed
    monkeypatch.setenv(FAULT_ENV, f"value:{comm.size - 1}")
    eng = make(comm, shared(comm, tmp_path), 0, tile=1024)
    train(eng, comm, 1)                                # step 0's update starts, fails on its thread
    with pytest.raises(OffloadFailed, match=f"rank {comm.size - 1}: the offloaded update failed: ValueError"):
        train(eng, comm, 1, 1)
    eng.close()
