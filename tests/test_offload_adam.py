"""The fused AdamW pass (runtime/csrc/adam.c) and the offload files, against independent references.

- bitwise: AdamW.update_tile (the C pass) equals the NumPy update of optim.py
  (widen, scale, update, cast: four separate NumPy steps), for fp32, fp16 and
  bf16 gradients and params, with weight-decayed and plain runs, over many steps;
- numerically: it follows the float64 textbook AdamW of test_optim.py;
- the casts it writes: fp16 as NumPy's astype, bf16 as integer round-to-nearest-even
  on the fp32 bits (not ml_dtypes), special values included;
- FileStore: slices read and write the elements NumPy slicing names, the file is
  anonymous (nothing left in the folder) and its blocks are reserved up front;
- tiles: the cut of a piece covers it exactly, decay runs intact.
"""
import os

import numpy as np
import pytest
from test_optim import adamw_reference

from ringzero.runtime import optim
from ringzero.runtime.optim import AdamConfig, AdamW

needs_c = pytest.mark.skipif(not optim.HAVE_C, reason="ringzero.runtime._adam was not built")


def storage(name):
    if name == "bf16":
        return np.dtype(pytest.importorskip("ml_dtypes").bfloat16)
    return np.dtype({"fp16": np.float16, "fp32": np.float32}[name])


def numpy_steps(opt, master, m, v, grads, coef, lr, segs, pdtype):
    """The engine's RAM update, as engine.step writes it: widen, scale, AdamW, then publish's cast."""
    g = grads.astype(np.float32)
    g *= np.float32(coef)
    opt.update(master, m, v, g, lr, segs)
    return master.astype(pdtype) if pdtype is not None else None


@needs_c
@pytest.mark.parametrize("gname", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("pname", ["fp32", "fp16", "bf16", None])
def test_fused_is_bitwise_numpy(gname, pname):
    rng = np.random.default_rng(7)
    n, cfg = 5000 + 13, AdamConfig(weight_decay=0.1)
    gd, pd = storage(gname), None if pname is None else storage(pname)
    runs = ((0, 1000, True), (1000, 1003, False), (1003, 4000, True), (4000, None, False))
    segs = [(a, n if b is None else b) for a, b, d in runs if d]
    p0 = rng.standard_normal(n).astype(np.float32)
    # a: the C pass; c: update_tile's NumPy fallback; b: the engine's RAM steps
    a, b, c = ([p0.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)] for _ in range(3))
    oa, ob, oc = AdamW(cfg, n, np), AdamW(cfg, n, np), AdamW(cfg, n, np)
    for t in range(12):
        scale = 10.0 ** rng.integers(-6, 3)                  # tiny to large gradients: every rounding path
        grads = (rng.standard_normal(n) * scale).astype(gd)
        coef, lr = np.float32(rng.uniform(0.2, 1.0)), 1e-3 * (t + 1)
        for o in (oa, ob, oc):
            o.begin_step()
        out, out_c = (None, None) if pd is None else (np.empty(n, pd), np.empty(n, pd))
        oa.update_tile(*a, grads, coef, lr, runs, out, fused=True)
        oc.update_tile(*c, grads, coef, lr, runs, out_c, fused=False)
        want = numpy_steps(ob, *b, grads, coef, lr, segs, pd)
        ok = all(np.array_equal(x.view(np.uint32), y.view(np.uint32)) and
                 np.array_equal(z.view(np.uint32), y.view(np.uint32)) for x, y, z in zip(a, b, c))
        if pd is not None:
            ok &= out.tobytes() == want.tobytes() == out_c.tobytes()
        assert ok, f"step {t}: {gname} grads, {pname} params differ"


@needs_c
def test_fused_and_fallback_follow_float64_adamw():
    rng = np.random.default_rng(0)
    n, cfg, lr = 1000, AdamConfig(weight_decay=0.1), 1e-2
    p0 = rng.standard_normal(n).astype(np.float32)
    gs = [rng.standard_normal(n).astype(np.float32) for _ in range(20)]
    mask = np.zeros(n)
    mask[100:400] = mask[700:1000] = 1
    runs = ((0, 100, False), (100, 400, True), (400, 700, False), (700, 1000, True))
    ref = adamw_reference(p0, gs, lr, cfg, mask)
    for fused in (True, False):
        st = [p0.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)]
        opt = AdamW(cfg, n, np)
        for g in gs:
            opt.begin_step()
            opt.update_tile(*st, g, 1.0, lr, runs, None, fused=fused)
        assert np.allclose(st[0], ref, rtol=1e-5, atol=1e-5), (fused, np.abs(st[0] - ref).max())


def bf16_bits(x32):
    u = x32.view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


@needs_c
def test_casts_of_special_values():
    """Params written by the pass: fp16 as NumPy's astype (overflow to Inf, subnormals, ties),
    bf16 as integer round-to-nearest-even of the fp32 bits. A zero-step update leaves master as it was."""
    vals = np.array([0.0, -0.0, 1.0, 65504.0, 65520.0, 70000.0, -1e6, 6e-8, 3e-8, 1e-40, 2.0 ** -24 * 1.5,
                     1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, np.inf, -np.inf, 3.4e38, 1.00390625, 1.01171875],
                    np.float32)
    rng = np.random.default_rng(3)
    vals = np.concatenate([vals, rng.standard_normal(1000).astype(np.float32) * 1e3,
                           rng.integers(0, 2**31, 1000, dtype=np.uint32).view(np.float32)])
    vals = vals[np.isfinite(vals) | np.isinf(vals)]
    n = vals.size
    cfg = AdamConfig(weight_decay=0.0)
    for pname in ("fp16", "bf16"):
        pd = storage(pname)
        opt = AdamW(cfg, n, np)
        opt.begin_step()
        master = vals.copy()
        out = np.empty(n, pd)
        # lr = 0: master unchanged (p - 0 * x = p for finite p); the cast is what is checked
        with np.errstate(all="ignore"):
            opt.update_tile(master, np.zeros(n, np.float32), np.zeros(n, np.float32), np.zeros(n, np.float32),
                            1.0, 0.0, ((0, None, False),), out, fused=True)
        fin = np.isfinite(vals)
        assert np.array_equal(master[fin].view(np.uint32), vals[fin].view(np.uint32))
        with np.errstate(over="ignore"):
            want = master.astype(np.float16).view(np.uint16) if pname == "fp16" else bf16_bits(master)
        got = out.view(np.uint16)
        assert np.array_equal(got, want), pname


def test_filestore_slices_read_and_write_what_numpy_slices(tmp_path):
    from ringzero.runtime.offload import FileStore, read_into, write_from
    rng = np.random.default_rng(1)
    ref = rng.standard_normal(10_000).astype(np.float32)
    fs = FileStore(str(tmp_path), "master", np.float32, ref.size)
    assert os.listdir(tmp_path) == []                        # anonymous: freed when closed, however the run ends
    assert fs.disk_bytes >= ref.nbytes                       # reserved up front
    assert np.array_equal(fs[:].read(), np.zeros_like(ref))
    write_from(fs, ref)
    for a, b, c, d in ((0, 10_000, 0, 10), (123, 4567, 100, 200), (9000, 10_000, 999, 1000)):
        view = fs[a:b][c:d]
        assert np.array_equal(read_into(view, np.empty(view.size, np.float32)), ref[a:b][c:d])
    new = rng.standard_normal(50).astype(np.float32)
    write_from(fs[200:300][10:60], new)
    ref[210:260] = new
    assert np.array_equal(fs[:].read(), ref)
    assert fs.bytes_written == 4 * (10_000 + 50) and fs.bytes_read > 0
    fs.close()


def test_tiles_cover_each_piece_with_its_decay_runs():
    from types import SimpleNamespace

    from ringzero.runtime.stream import tiles
    layout = SimpleNamespace(units=[0, 1], piece_numel=[2500, 700])
    state = SimpleNamespace(layout=layout, held_ranks=lambda name: (1,))
    decay = {(0, 1): [(100, 1200), (1300, 2500)], (1, 1): []}
    ts = tiles(state, decay, 1024)
    assert [(t.u, t.lo, t.hi) for t in ts] == [(0, 0, 1024), (0, 1024, 2048), (0, 2048, 2500), (1, 0, 700)]
    for t in ts:
        mask = np.zeros(t.hi - t.lo, bool)
        covered = np.zeros(t.hi - t.lo, int)
        for a, b, d in t.runs:
            covered[a:b] += 1
            mask[a:b] = d
        want = np.zeros(layout.piece_numel[t.u], bool)
        for a, b in decay[(t.u, 1)]:
            want[a:b] = True
        assert (covered == 1).all() and np.array_equal(mask, want[t.lo:t.hi])
