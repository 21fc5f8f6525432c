"""``python -m ringzero.explain quantized`` (ringzero.tools.quant_error) against independent arithmetic.

References: the fp16 / bf16 errors recomputed here with NumPy and ml_dtypes casts; the int8 / int4
errors bounded by half a step per block (max|block| / 254, / 14) computed here; the gradient
against float64 central differences on a few coordinates; the CLI's exit code 2 on bad input.
"""
import subprocess
import sys

import numpy as np
import pytest

from ringzero.tools import quant_error as qe


@pytest.fixture(scope="module")
def wg():
    return qe.weights_and_grad(steps=2)


def test_fp16_and_bf16_figures_are_the_casts(wg):
    w, g = wg
    for x in (w, g):
        back = x.astype(np.float16).astype(np.float32)
        want = np.sqrt(np.sum((back - x).astype(np.float64) ** 2) / np.sum(x.astype(np.float64) ** 2))
        assert qe.errors(x, "fp16")["rel_rms"] == pytest.approx(want, rel=1e-12)
        assert 0 < want < 2.0 ** -11          # fp16 keeps 11 significant bits
    ml_dtypes = pytest.importorskip("ml_dtypes")
    back = w.astype(ml_dtypes.bfloat16).astype(np.float32)
    assert qe.errors(w, "bf16")["max_rel_to_absmax"] == pytest.approx(
        float(np.max(np.abs(back - w)) / np.max(np.abs(w))), rel=1e-6)


@pytest.mark.parametrize("fmt,qmax", [("int8", 127), ("int4", 7)])
def test_int_errors_within_half_a_step_per_block(wg, fmt, qmax):
    w, g = wg
    for x in (w, g):
        block = 512
        e = qe.errors(x, fmt, block)
        pad = np.pad(np.abs(x), (0, -len(x) % block)).reshape(-1, block).max(axis=1)
        half = np.repeat(pad / qmax / 2, block)[:len(x)].astype(np.float64)
        # the worst element's error cannot exceed the largest half step, over max|x|
        assert e["max_rel_to_absmax"] <= half.max() * (1 + 1e-5) / np.max(np.abs(x))
        assert e["wire_bytes"] == pytest.approx((-(-len(x) * (8 if fmt == "int8" else 4) // 8) // 4 * 4
                                                 + 4 * -(-len(x) // block)) / len(x), abs=4 / len(x))
    assert qe.errors(g, "int4", 512)["rel_rms"] > qe.errors(g, "int8", 512)["rel_rms"] > \
        qe.errors(g, "fp16", 512)["rel_rms"]


def test_the_gradient_is_the_models(wg):
    """A few coordinates of the gradient against float64 central differences of the same batch's loss."""
    from ringzero.nn import GPT, GPTConfig
    from ringzero.runtime.flat import Layout
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab=256)
    w, g = qe.weights_and_grad(steps=1, cfg=cfg, batch=2)
    m = GPT(cfg)
    lay = Layout(m.units, 1)
    buf = np.zeros(lay.padded, np.float64)
    lay.init_full(buf, 0)
    keep = np.concatenate([np.arange(o, o + n) for o, n in zip(lay.unit_offset, lay.unit_numel)])
    assert np.array_equal(buf[keep].astype(np.float32), w)    # step 1 takes the gradient at init
    tok = qe._text_tokens()
    at = np.random.default_rng(0).integers(0, len(tok) - cfg.block_size - 1, 2)
    x = np.stack([tok[a:a + 8] for a in at])
    y = np.stack([tok[a + 1:a + 9] for a in at])
    P = lay.views(buf)
    for i in np.argsort(-np.abs(g))[:5]:
        j, h = keep[i], 1e-5
        buf[j] += h
        up = m.loss(P, x, y)
        buf[j] -= 2 * h
        down = m.loss(P, x, y)
        buf[j] += h
        assert (up - down) / (2 * h) == pytest.approx(g[i], rel=2e-3, abs=1e-6)


def test_cli_prints_the_table_and_refuses_bad_input():
    ok = subprocess.run([sys.executable, "-m", "ringzero.explain", "quantized", "--steps", "1", "--block", "256"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    for word in ("weights", "gradient", "fp16", "int8", "int4", "nonzero -> 0"):
        assert word in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "ringzero.explain", "quantized", "--block", "0"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "got --steps 3 --block 0" in bad.stderr.strip().splitlines()[-1]


def test_volume_table_is_the_formula(capsys):
    qe.print_volume(1024)
    out = capsys.readouterr().out
    assert "none (stage 3)" in out and "3.0000Ψ" in out
    last = [ln for ln in out.splitlines() if ln.strip().startswith("qwZ + hpZ + qgZ")][0].split()
    # int8 and int4 at one fp32 scale per 1024 elements, over fp16's 2 bytes; hpZ: nothing crosses
    want = [(1 + 4 / 1024) / 2, 0.0, (0.5 + 4 / 1024) / 2]
    assert [float(t.rstrip("Ψ")) for t in last[-4:]] == pytest.approx(want + [sum(want)], abs=5e-5)
