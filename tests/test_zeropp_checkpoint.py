"""qgZ's error-feedback residual in checkpoints (runtime/zeropp_state.py), against the uninterrupted run.

- Train 6 steps (past the first fp16 overflows), save, go on: a fresh engine (another init seed)
  that loads the checkpoint and takes the same steps gives the same losses and the same fp32
  master bits as the run that never stopped,
  at stage 3 and hybrid, at 2 ranks (one node) and 4 (2 emulated nodes x 2: the two-hop schedule).
  A load that does not restore the residual (checkpoint.py without ``zeropp_state.read``) fails it.
- The saved file is the rank's residual as the engine held it (the bytes, read back with NumPy).
- fp16 overflows clear the residual (zeropp.py ``after_step``), so an error-feedback run trains.
- Another node map: the residual is dropped (zeros) with a note, the rest loads.
- The trainer: --save-every, then --resume step-NNNNNN, 4 ranks as 2 emulated nodes
  (RINGZERO_EMULATE_NODES=2): the resumed steps' losses are the uninterrupted run's.
"""
import json
import os

import numpy as np
import pytest
from conftest import assert_all
from test_checkpoint import shared_dir
from test_zero import batches, engine, train
from test_zeropp import labels_of, policy


def mk(comm, stage, seed, nodes=None):
    return engine(comm, stage, seed=seed, nodes=labels_of(comm.size) if nodes is None else nodes,
                  zeropp=policy("qwz,qgz" if stage == "hybrid" else "qwz,hpz,qgz", error_feedback=True))


@pytest.mark.mpi
@pytest.mark.parametrize("stage", ["3", "hybrid"])
def test_resume_with_error_feedback_is_the_uninterrupted_run(comm, tmp_path_factory, stage):
    from ringzero.runtime import checkpoint as ck
    from ringzero.runtime.zeropp_state import residual_file
    if stage == "hybrid" and labels_of(comm.size)[-1] != 1:
        pytest.skip(f"hybrid needs 2 emulated nodes (an even world size >= 4), have {comm.size}")
    d = shared_dir(comm, tmp_path_factory, "zppres")
    data = batches(comm, comm.size, comm.rank)
    a = mk(comm, stage, 3)
    train(a, data, steps=6)            # past the first fp16 overflows (each clears the residual)
    path = ck.save(a, d, 6)
    held = a.topology.zeropp.residual.copy()
    ref = [a.step(*data.get(s), 3e-3).loss for s in range(6, 10)]
    ref_master = a.full_state("master")

    on_disk = np.fromfile(os.path.join(path, residual_file(comm.rank)), np.float32)
    assert_all(comm, np.any(held != 0) and np.array_equal(on_disk, held),
               "the saved residual file is not the rank's residual (or the residual is all zeros)")
    b = mk(comm, stage, 77)
    m = ck.load(b, path)
    got = [b.step(*data.get(s), 3e-3).loss for s in range(6, 10)]
    got_master = b.full_state("master")
    assert_all(comm, m["notes"] == [], f"notes on a same-world resume: {m['notes']}")
    assert_all(comm, got == ref and np.array_equal(got_master, ref_master),
               f"stage {stage}: resumed losses {got} vs uninterrupted {ref}; master differs in "
               f"{int((got_master != ref_master).sum())} elements")


@pytest.mark.mpi
def test_another_node_map_drops_the_residual_with_a_note(comm, tmp_path_factory):
    from ringzero.runtime import checkpoint as ck
    if labels_of(comm.size)[-1] != 1:
        pytest.skip(f"needs 2 emulated nodes to change the node map, have {comm.size}")
    d = shared_dir(comm, tmp_path_factory, "zppmap")
    data = batches(comm, comm.size, comm.rank)
    a = mk(comm, "3", 3)
    train(a, data, steps=6)
    ck.save(a, d, 6)
    saved = a.full_state("master")
    b = mk(comm, "3", 77, nodes=[0] * comm.size)       # one node now
    b.topology.zeropp.residual[...] = 1.0               # the load must clear it, not keep it
    m = ck.load(b, "latest", d)
    ok = np.array_equal(b.full_state("master"), saved) and not np.any(b.topology.zeropp.residual)
    note = m["notes"][0] if m["notes"] else ""
    assert_all(comm, ok and "node map" in note and "dropped" in note, f"notes {m['notes']}")


def _trainer(comm, d, data, steps, extra, name):
    from test_train import TINY

    from ringzero.app.train import parse_config, run
    metrics = os.path.join(d, name)
    cfg, _ = parse_config(TINY + ["--data", data, "--stage", "3", "--steps", str(steps), "--lr", "1e-2",
                                  "--warmup", "2", "--eval-interval", "0", "--metrics", metrics,
                                  "--zeropp", "qwz,hpz,qgz", "--zeropp-block", "256", "--zeropp-error-feedback",
                                  "--save-dir", os.path.join(d, "ck"), "--quiet"] + extra)
    run(cfg, comm)
    if comm.rank != 0:
        return None
    lines = [json.loads(ln) for ln in open(metrics)]
    return {s["step"]: s["loss"] for s in lines if "loss" in s and "step" in s}


@pytest.mark.mpi
def test_trainer_resume_two_emulated_nodes(comm, tmp_path_factory, monkeypatch):
    if comm.size != 4:
        pytest.skip("4 ranks in 2 emulated nodes")
    from test_train import _text
    monkeypatch.setenv("RINGZERO_EMULATE_NODES", "2")
    d = comm.bcast(str(tmp_path_factory.mktemp("zpptr")) if comm.rank == 0 else None)
    data = comm.bcast(_text(os.path.join(d, "corpus.txt")) if comm.rank == 0 else None)
    whole = _trainer(comm, d, data, 8, ["--save-every", "4"], "whole.jsonl")
    part = _trainer(comm, d, data, 8, ["--resume", os.path.join(d, "ck", "step-000004")], "part.jsonl")
    ok, msg = True, ""
    if comm.rank == 0:
        resumed = sorted(part)
        ok = resumed and resumed[0] >= 4 and all(part[s] == whole[s] for s in resumed) and len(whole) == 8
        msg = f"uninterrupted {whole}, resumed {part}"
    assert_all(comm, ok, msg)


@pytest.mark.mpi
def test_error_feedback_survives_fp16_overflows(comm):
    """fp16 at a loss scale of 2^20: the first steps overflow (inf in the gradients, so in hop 1's
    residual). The residual is cleared on each skipped step, so the run then trains: the later steps
    are taken, the residual is finite, and the loss falls. (Kept, the inf made every step overflow.)"""
    from ringzero.runtime.optim import LossScaler
    eng = engine(comm, "3", nodes=labels_of(comm.size), scaler=LossScaler(init=2.0 ** 20),
                 zeropp=policy("qwz,hpz,qgz", error_feedback=True))
    data = batches(comm, comm.size, comm.rank)
    res = [eng.step(*data.get(s), 3e-3) for s in range(30)]
    skipped = [r.skipped for r in res]
    finite = bool(np.all(np.isfinite(eng.topology.zeropp.residual)))
    ok = skipped[0] and not any(skipped[-8:]) and finite and res[-1].loss < res[0].loss
    assert_all(comm, ok, f"skipped {skipped}, residual finite {finite}, loss {res[0].loss} -> {res[-1].loss}")
