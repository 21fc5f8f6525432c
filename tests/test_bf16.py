"""``precision="bf16"``: bf16 params and grads (ml_dtypes), fp32 master and Adam, no loss scaler.

Checked against references written here: the bytes per class from the
layout's padded sizes; the params against master rounded to bf16 by integer
bit arithmetic (round to nearest even on the fp32 bit pattern, not
ml_dtypes); stages 0-3 bitwise equal; an Inf still skips the step; a
checkpoint saves, reloads at another stage and exports BF16 safetensors.
"""
import json
import os
import struct

import numpy as np
import pytest
from conftest import assert_all
from test_zero import batches, tiny_model, train

ml_dtypes = pytest.importorskip("ml_dtypes", reason="needs ml_dtypes (pip install 'ringzero[bf16]')")
pytestmark = pytest.mark.mpi


def engine(comm, stage, **kw):
    from ringzero.runtime.zero import Zero
    kw.setdefault("seed", 3)
    if stage == "hybrid":
        kw.setdefault("ranks_per_node", comm.size)
    return Zero(tiny_model(), comm, stage, precision="bf16", timeout=60, **kw)


def bf16_bits(x32: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bit patterns (uint16), round to nearest even, by integer arithmetic."""
    u = np.ascontiguousarray(x32, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


@pytest.mark.parametrize("stage", ["0", "1", "2", "3"])
def test_bf16_memory_and_params(comm, stage):
    eng = engine(comm, stage)
    P, n = eng.layout.padded, comm.size
    sharded = {"0": (), "1": ("master", "m", "v"), "2": ("grads", "master", "m", "v"),
               "3": ("params", "grads", "master", "m", "v")}[stage]
    size = lambda name: P // n if name in sharded else P            # noqa: E731
    want = {"params_fp16": 2 * size("params"), "grads_fp16": 2 * size("grads"),
            "master_fp32": 4 * size("master"), "adam_m_fp32": 4 * size("m"), "adam_v_fp32": 4 * size("v")}
    rep = eng.memory_report()["classes"]
    got = {c: d["measured_bytes"] for c, d in rep.items()}
    ok = got == want and all(d["formula_bytes"] == want[c] for c, d in rep.items())
    ok &= eng.bufs["params"].dtype == np.dtype(ml_dtypes.bfloat16) and eng.scaler.scale == 1.0
    train(eng, batches(comm, n, comm.rank), 3)
    master = eng.full_state("master")
    params = eng.state.gather("params", eng.ring, eng.bufs["params"].dtype)   # bf16, unwidened
    ok &= np.array_equal(params.view(np.uint16), bf16_bits(master))
    assert_all(comm, ok, f"stage {stage}: memory {got} vs {want}, or params != bf16(master)")


def test_bf16_stages_bitwise_equal_and_learns(comm):
    data = batches(comm, comm.size, comm.rank)
    runs = {}
    for st in ("0", "1", "2", "3", "hybrid"):
        eng = engine(comm, st)
        runs[st] = (train(eng, data, 12), eng.full_state("master"), eng.full_params())
    ref = runs["0"]
    bad = [st for st, r in runs.items()
           if r[0] != ref[0] or not np.array_equal(r[1], ref[1]) or not np.array_equal(r[2], ref[2])]
    assert_all(comm, not bad, f"bf16: stages {bad} differ bitwise from stage 0")
    assert_all(comm, ref[0][-1] < ref[0][0], f"bf16 loss did not fall: {ref[0][0]} -> {ref[0][-1]}")


def test_bf16_inf_skips_with_static_scale(comm):
    from test_zero import _InfAt
    eng = engine(comm, "3")
    data = batches(comm, comm.size, comm.rank)
    train(eng, data, 2)
    before = eng.full_state("master").copy()
    eng.model = _InfAt(eng.model, comm.size - 1, comm.rank)
    x, y = data.get(2)
    res = eng.step(x, y, 1e-3)
    ok = res.skipped and eng.scaler.scale == 1.0 and np.array_equal(before, eng.full_state("master"))
    assert_all(comm, ok, f"skipped={res.skipped} scale={eng.scaler.scale}")


def test_bf16_checkpoint_reload_and_export(comm, tmp_path_factory):
    pytest.importorskip("safetensors")
    from ringzero.runtime import checkpoint as ck
    d = comm.bcast(str(tmp_path_factory.mktemp("bf16ck")) if comm.rank == 0 else None)
    a = engine(comm, "2")
    train(a, batches(comm, comm.size, comm.rank), 3)
    path = ck.save(a, d, 3)
    b = engine(comm, "3", seed=9)                      # other weights until loaded
    ck.load(b, path)
    ok = np.array_equal(a.full_state("master"), b.full_state("master"))
    ok &= np.array_equal(a.full_params(), b.full_params())
    pa = a.state.gather("params", a.ring, a.bufs["params"].dtype)
    msg = "reloaded state differs"
    if comm.rank == 0 and ok:
        out = os.path.join(d, "w.safetensors")
        r = ck.export(path, out, "bf16")
        raw = open(out, "rb").read()
        n = struct.unpack("<Q", raw[:8])[0]
        head = json.loads(raw[8:8 + n])
        s = a.layout.slots["wte"]
        lo, hi = head["wte"]["data_offsets"]
        body = np.frombuffer(raw[8 + n + lo:8 + n + hi], np.uint16)
        ok &= r["class"] == "params" and head["wte"]["dtype"] == "BF16"
        ok &= np.array_equal(body, pa[s.offset:s.offset + s.spec.numel].view(np.uint16))
        msg = f"export: class {r['class']}, wte {head['wte']}"
    assert_all(comm, ok, msg)
