"""The whole training step against optimizers written independently of ringzero.runtime.optim.

The engine (``Zero``, fp32, stages 0-3 and hybrid, any world size) trains a
tiny GPT for 30 steps with weight decay on, global-norm clipping active in
most steps and a learning rate that changes every step. Its loss per step,
reported gradient norm and final weights must match:

- a float64 AdamW written out below from the AdamW paper / torch semantics
  (Loshchilov & Hutter, decoupled decay; Kingma & Ba bias correction, eps
  added to sqrt(v_hat)), with torch's clip_grad_norm_ rule
  (coef = min(1, max_norm / (norm + 1e-6)) over the global norm); decay on
  every matrix (ndim >= 2: weights and embeddings), never on vectors
  (biases, layernorm gains) -- a rule of this file, not the layout's flags;
- ``torch.optim.AdamW`` + ``torch.nn.utils.clip_grad_norm_`` in float64,
  where torch is installed.

Both references start from the engine's initial weights
(``engine.full_state("master")``) and take their gradients from the model's
own single-process ``loss_and_grad`` in float64 on the GLOBAL batch (every
rank's batch, concatenated in rank order), i.e. no sharding, no ring, no
ringzero optimizer. Tolerances: relative error <= 1e-5 for the loss, <= 1e-4
for each weight tensor (L2 norm of the difference over the norm of the
reference tensor).

One slice is left out of the weight comparison: the attention's key bias
(``attn.b[C:2C]``). Its gradient is zero in exact arithmetic (softmax is
invariant to adding the same q.b_k to every score of a row), so the fp32
engine's gradient there is pure rounding noise (~1e-9), which Adam
normalises into O(lr) steps, while the float64 reference's noise (~1e-17)
stays under eps. Comparing it would test rounding, not the optimizer.

The comparison can fail: ``test_comparison_catches_a_broken_engine`` runs it
on the engine with weight decay or clipping switched off (monkeypatched), and
``test_reference_detects_a_wrong_step`` shows that an optimizer without
weight decay, with decay on biases too, without clipping or without bias
correction ends far outside the tolerance.
"""
import importlib.util

import numpy as np
import pytest
from conftest import assert_all

CFG = dict(n_layer=2, n_head=2, n_embd=24, block_size=16, vocab=37)
C = CFG["n_embd"]
B, T = 2, 16              # sequences per rank, tokens per sequence
STEPS = 30
LR, WD = 3e-3, 0.1
BETA1, BETA2, EPS = 0.9, 0.95, 1e-8
TOL_LOSS, TOL_W = 1e-5, 1e-4
STAGES = ["0", "1", "2", "3", "hybrid"]
HAVE_TORCH = importlib.util.find_spec("torch") is not None

# A learnable stream: a permutation cycle with 10% noise tokens.
_DATA = np.arange(4096) * 7 % CFG["vocab"]
_NOISE = np.random.default_rng(0).random(4096) < 0.1
_DATA[_NOISE] = np.random.default_rng(1).integers(0, CFG["vocab"], int(_NOISE.sum()))


def batch(step, rank):
    """Rank ``rank``'s (x, y) at ``step``: (B, T) int64 each, a pure function of both."""
    start = np.random.default_rng([11, step, rank]).integers(0, len(_DATA) - T - 1, B)
    x = np.stack([_DATA[s:s + T] for s in start]).astype(np.int64)
    y = np.stack([_DATA[s + 1:s + T + 1] for s in start]).astype(np.int64)
    return x, y


def global_batch(step, n):
    """Every rank's batch, concatenated in rank order: (n*B, T) each."""
    xs, ys = zip(*[batch(step, r) for r in range(n)])
    return np.concatenate(xs), np.concatenate(ys)


def lr_at(step):
    return LR * min(1.0, (step + 1) / 5)        # a warm-up: lr differs in the first steps


def new_model():
    from ringzero.nn.gpt import GPT, GPTConfig
    return GPT(GPTConfig(**CFG))


def make_engine(comm, stage, clip):
    from ringzero.runtime.optim import AdamConfig
    from ringzero.runtime.zero import Zero
    rpn = None
    if stage == "hybrid":       # a real replica group: the largest proper divisor of n
        rpn = max([d for d in range(1, comm.size) if comm.size % d == 0] or [1])
    adam = AdamConfig(beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=WD, grad_clip=clip)
    return Zero(new_model(), comm, stage, precision="fp32", seed=3, adam=adam, timeout=60,
                ranks_per_node=rpn)


def by_name(engine, flat):
    """{param name: float64 copy} of a full flat state vector."""
    return {k: np.array(v, np.float64) for k, v in engine.layout.views(flat).items()}


def grads_fp64(model, W, step, n):
    """(loss, {name: grad}) of the mean loss over the global batch, float64, one process."""
    G = {k: np.zeros_like(v) for k, v in W.items()}
    x, y = global_batch(step, n)
    loss = model.loss_and_grad(W, G, x, y)
    return float(loss), G


# --------------------------------------------------------------------------
# Reference 1: AdamW + global-norm clipping, float64, written out.
# --------------------------------------------------------------------------
def reference_adamw(w0, n, clip, wd=WD, decay_vectors=False, bias_correction=True):
    """Returns (losses, pre-clip global grad norms, final weights)."""
    model = new_model()
    W = {k: v.copy() for k, v in w0.items()}
    m = {k: np.zeros_like(v) for k, v in W.items()}
    v = {k: np.zeros_like(v) for k, v in W.items()}
    losses, norms = [], []
    for step in range(STEPS):
        loss, G = grads_fp64(model, W, step, n)
        norm = np.sqrt(sum(float(np.sum(g * g)) for g in G.values()))
        coef = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
        lr, t = lr_at(step), step + 1
        for k in W:
            g = G[k] * coef
            m[k] = BETA1 * m[k] + (1 - BETA1) * g
            v[k] = BETA2 * v[k] + (1 - BETA2) * g * g
            if W[k].ndim >= 2 or decay_vectors:
                W[k] *= 1 - lr * wd                       # decoupled decay, before the step
            if bias_correction:
                m_hat, v_hat = m[k] / (1 - BETA1 ** t), v[k] / (1 - BETA2 ** t)
            else:
                m_hat, v_hat = m[k], v[k]
            W[k] -= lr * m_hat / (np.sqrt(v_hat) + EPS)
        losses.append(loss)
        norms.append(norm)
    return losses, norms, W


# --------------------------------------------------------------------------
# Reference 2: torch.optim.AdamW + clip_grad_norm_, float64.
# --------------------------------------------------------------------------
def reference_torch(w0, n, clip):
    import torch
    model = new_model()
    params = {k: torch.tensor(v, dtype=torch.float64) for k, v in w0.items()}
    groups = [{"params": [p for k, p in params.items() if p.ndim >= 2], "weight_decay": WD},
              {"params": [p for k, p in params.items() if p.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=(BETA1, BETA2), eps=EPS)
    losses = []
    for step in range(STEPS):
        W = {k: p.detach().numpy().copy() for k, p in params.items()}
        loss, G = grads_fp64(model, W, step, n)
        for k, p in params.items():
            p.grad = torch.from_numpy(G[k])
        torch.nn.utils.clip_grad_norm_(list(params.values()), clip)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        opt.step()
        losses.append(loss)
    return losses, {k: p.detach().numpy().copy() for k, p in params.items()}


def weight_errors(got, ref):
    """{name: ||got - ref|| / ||ref||} per tensor, the key bias left out (docstring)."""
    out = {}
    for k in ref:
        a, r = np.array(got[k], np.float64), np.array(ref[k], np.float64)
        if k.endswith("attn.b"):
            a[C:2 * C] = 0
            r[C:2 * C] = 0
        out[k] = float(np.linalg.norm(a - r) / np.linalg.norm(r))
    return out


def loss_error(got, ref):
    return max(abs(a - b) / abs(b) for a, b in zip(got, ref))


_REFS = {}


def references(comm, engine):
    """(clip, float64 reference, torch reference or None) for this world size.

    Rank 0 computes them once per world size (they do not depend on the
    stage); the other ranks get only the clip threshold. The threshold is
    the 30th percentile of an unclipped run's gradient norms, so that
    clipping acts in most steps and some steps stay below it.
    """
    n = comm.size
    if n not in _REFS:
        w0 = by_name(engine, engine.full_state("master"))
        clip = None
        if comm.rank == 0:
            _, free_norms, _ = reference_adamw(w0, n, clip=0.0)
            clip = float(np.quantile(free_norms, 0.3))
        clip = comm.bcast(clip, root=0)
        ref = reference_adamw(w0, n, clip) if comm.rank == 0 else None
        tref = reference_torch(w0, n, clip) if (comm.rank == 0 and HAVE_TORCH) else None
        _REFS[n] = (clip, w0, ref, tref)
    return _REFS[n]


def train_and_compare(comm, stage):
    """Train the engine for STEPS steps; on rank 0, its errors against the references.

    Returns (errors dict or None on ranks != 0, clip). Collective.
    """
    probe = make_engine(comm, stage, clip=1.0)              # for the initial weights only
    clip, w0_ref, ref, tref = references(comm, probe)
    eng = make_engine(comm, stage, clip)
    w0 = by_name(eng, eng.full_state("master"))
    losses, norms, skipped = [], [], 0
    for step in range(STEPS):
        x, y = batch(step, comm.rank)
        res = eng.step(x, y, lr_at(step))
        losses.append(res.loss)
        norms.append(res.grad_norm)
        skipped += res.skipped
    final = by_name(eng, eng.full_state("master"))
    if comm.rank != 0:
        return None, clip
    r_loss, r_norm, r_w = ref
    we = weight_errors(final, r_w)
    err = {"same_start": all(np.array_equal(w0[k], w0_ref[k]) for k in w0), "skipped": skipped,
           "loss": loss_error(losses, r_loss), "norm": loss_error(norms, r_norm),
           "worst": max(we, key=we.get), "clipped": sum(nm > clip for nm in r_norm),
           "moved": float(np.sqrt(sum(np.sum((r_w[k] - w0[k]) ** 2) for k in r_w)
                                  / sum(np.sum(w0[k] ** 2) for k in w0)))}
    err["weights"] = we[err["worst"]]
    if tref is not None:
        twe = weight_errors(final, tref[1])
        err["torch_loss"], err["torch_worst"] = loss_error(losses, tref[0]), max(twe, key=twe.get)
        err["torch_weights"] = twe[err["torch_worst"]]
    return err, clip


@pytest.mark.mpi
@pytest.mark.parametrize("stage", STAGES)
def test_step_matches_independent_adamw(comm, stage):
    """30 fp32 steps of the engine == float64 AdamW (and torch's) on the global batch."""
    e, clip = train_and_compare(comm, stage)
    ok, msg = True, ""
    if comm.rank == 0:
        ok = (e["same_start"] and not e["skipped"] and e["loss"] <= TOL_LOSS and e["norm"] <= 1e-4
              and e["weights"] <= TOL_W and STEPS // 2 <= e["clipped"] < STEPS and e["moved"] > 100 * TOL_W)
        msg = (f"stage {stage}, n={comm.size}: loss rel err {e['loss']:.2e} (<= {TOL_LOSS}), grad norm rel "
               f"err {e['norm']:.2e} (<= 1e-4), worst weight {e['worst']} rel err {e['weights']:.2e} "
               f"(<= {TOL_W}); clipped {e['clipped']}/{STEPS} steps at clip {clip:.3f}; weights moved "
               f"{e['moved']:.2e}; same initial weights {e['same_start']}; skipped steps {e['skipped']}")
        if "torch_loss" in e:
            ok &= e["torch_loss"] <= TOL_LOSS and e["torch_weights"] <= TOL_W
            msg += (f"; vs torch AdamW: loss {e['torch_loss']:.2e}, worst weight {e['torch_worst']} "
                    f"{e['torch_weights']:.2e}")
        print(msg)                         # the measured errors: pytest -rP shows them
    assert_all(comm, ok, msg)


def _no_decay(monkeypatch):
    from ringzero.runtime import optim
    update, tile = optim.AdamW.update, optim.AdamW.update_tile
    monkeypatch.setattr(optim.AdamW, "update",
                        lambda self, master, m, v, g, lr, decay_segments=(): update(self, master, m, v, g, lr, ()))
    # the fused pass (the RAM update where the C extension was built): every run undecayed
    monkeypatch.setattr(optim.AdamW, "update_tile", lambda self, master, m, v, grads, coef, lr, runs, *a, **k:
                        tile(self, master, m, v, grads, coef, lr, tuple((x, y, False) for x, y, _ in runs), *a, **k))


def _no_clip(monkeypatch):
    from ringzero.runtime import engine
    monkeypatch.setattr(engine, "clip_coef", lambda norm, max_norm: 1.0)


@pytest.mark.mpi
@pytest.mark.parametrize("broken", [_no_decay, _no_clip], ids=["no-weight-decay", "no-clipping"])
def test_comparison_catches_a_broken_engine(comm, monkeypatch, broken):
    """The same comparison fails an engine that skips weight decay or clipping."""
    broken(monkeypatch)
    e, _ = train_and_compare(comm, "2")
    ok, msg = True, ""
    if comm.rank == 0:
        ok = e["weights"] > 10 * TOL_W
        msg = f"{broken.__name__}: worst weight {e['worst']} differs by {e['weights']:.2e} (> {10 * TOL_W})"
        print(msg)
    assert_all(comm, ok, msg)


def test_torch_adamw_agrees_with_written_reference():
    """The two references agree to float64 precision (skips where torch is absent)."""
    pytest.importorskip("torch")
    from mpi4py import MPI
    eng = make_engine(MPI.COMM_SELF, "0", clip=1.0)
    w0 = by_name(eng, eng.full_state("master"))
    losses, _, W = reference_adamw(w0, 2, clip=1.0)
    t_losses, tW = reference_torch(w0, 2, clip=1.0)
    err = {k: float(np.max(np.abs(W[k] - tW[k]))) for k in W}
    assert loss_error(losses, t_losses) < 1e-12 and max(err.values()) < 1e-12, (losses[-1], t_losses[-1], err)


def test_reference_detects_a_wrong_step():
    """Plausible optimizer bugs move the result far outside TOL_W: the check can fail."""
    from mpi4py import MPI
    eng = make_engine(MPI.COMM_SELF, "0", clip=1.0)
    w0 = by_name(eng, eng.full_state("master"))
    _, free_norms, _ = reference_adamw(w0, 2, clip=0.0)
    clip = float(np.quantile(free_norms, 0.3))
    _, _, good = reference_adamw(w0, 2, clip)
    wrong = {"no weight decay": dict(wd=0.0), "decay on biases and norms": dict(decay_vectors=True),
             "no clipping": dict(clip=0.0), "no bias correction": dict(bias_correction=False)}
    for what, kw in wrong.items():
        kw.setdefault("clip", clip)
        _, _, bad = reference_adamw(w0, 2, **kw)
        worst = max(weight_errors(bad, good).values())
        assert worst > 10 * TOL_W, f"{what}: worst tensor differs by only {worst:.2e}"
