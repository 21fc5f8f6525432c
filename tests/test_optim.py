"""AdamW and the loss scaler, against references written out here."""
import math

import numpy as np
import pytest

from ringzero.runtime.optim import AdamConfig, AdamW, LossScaler, clip_coef


def adamw_reference(p, g_seq, lr, cfg, decay_mask):
    """Textbook AdamW (decoupled decay, bias-corrected) in float64."""
    p = p.astype(np.float64).copy()
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    for t, g in enumerate(g_seq, start=1):
        g = g.astype(np.float64)
        m = cfg.beta1 * m + (1 - cfg.beta1) * g
        v = cfg.beta2 * v + (1 - cfg.beta2) * g * g
        p = p - lr * cfg.weight_decay * p * decay_mask
        mh, vh = m / (1 - cfg.beta1 ** t), v / (1 - cfg.beta2 ** t)
        p = p - lr * mh / (np.sqrt(vh) + cfg.eps)
    return p


def test_adamw_matches_float64_reference():
    rng = np.random.default_rng(0)
    n, cfg, lr = 1000, AdamConfig(weight_decay=0.1), 1e-2
    p0 = rng.standard_normal(n).astype(np.float32)
    gs = [rng.standard_normal(n).astype(np.float32) for _ in range(20)]
    mask = np.zeros(n)
    segs = [(100, 400), (700, 1000)]
    for a, b in segs:
        mask[a:b] = 1
    master, m, v = p0.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)
    opt = AdamW(cfg, n, np)
    for g in gs:
        opt.begin_step()
        opt.update(master, m, v, g.copy(), lr, segs)
    ref = adamw_reference(p0, gs, lr, cfg, mask)
    assert np.allclose(master, ref, rtol=1e-5, atol=1e-5), np.abs(master - ref).max()


def test_adamw_result_does_not_depend_on_slicing():
    """Updating a buffer whole or in pieces gives the same bits (what makes
    every ZeRO stage bitwise equal)."""
    rng = np.random.default_rng(1)
    n, cfg = 777, AdamConfig()
    p0 = rng.standard_normal(n).astype(np.float32)
    g = rng.standard_normal(n).astype(np.float32)
    a = [p0.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)]
    b = [p0.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)]
    oa, ob = AdamW(cfg, n, np), AdamW(cfg, n, np)
    for _ in range(3):
        oa.begin_step()
        ob.begin_step()
        oa.update(*a, g, 1e-3, [(0, n)])
        for lo, hi in ((0, 300), (300, 301), (301, n)):
            ob.update(b[0][lo:hi], b[1][lo:hi], b[2][lo:hi], g[lo:hi], 1e-3, [(0, hi - lo)])
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


def test_loss_scaler_backoff_hysteresis_growth_floor():
    s = LossScaler(init=2.0 ** 16, growth_interval=3, hysteresis=2, min_scale=2.0 ** 14)
    assert s.update(True) is True and s.scale == 2.0 ** 16      # first overflow: tolerated (hysteresis)
    assert s.update(True) is True and s.scale == 2.0 ** 15      # second: halve
    assert s.update(True) is True and s.scale == 2.0 ** 14      # third: halve again
    assert s.update(True) is True and s.scale == 2.0 ** 14      # floor
    for _ in range(2):
        assert s.update(False) is False and s.scale == 2.0 ** 14
    assert s.update(False) is False and s.scale == 2.0 ** 15    # 3 clean steps: grow
    st = s.state_dict()
    t = LossScaler()
    t.load_state_dict(st)
    assert t.state_dict() == st


def test_static_scaler_never_changes():
    s = LossScaler(init=1.0, dynamic=False)
    assert s.update(True) is True and s.scale == 1.0
    assert s.update(False) is False and s.scale == 1.0


def test_clip_coef():
    assert clip_coef(0.5, 1.0) == 1.0
    assert math.isclose(clip_coef(4.0, 1.0) * 4.0, 1.0, rel_tol=1e-5)
    assert clip_coef(4.0, 0.0) == 1.0


def test_bad_scaler_args():
    with pytest.raises(ValueError, match="loss scale must be > 0"):
        LossScaler(init=0)
