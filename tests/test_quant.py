"""Blockwise int8 / int4 quantization (ringzero.comm.quant) against an independent NumPy formulation.

References: a per-block loop written here (float32 scalars, NumPy's rint, codes packed with bit
operations rather than the module's arithmetic), the exact error bound |value - x| <= scale / 2,
and ml_dtypes' own bf16 casts. The first test is DeepSpeed's bf16 bug (PR #8215): bf16 weights
quantized and dequantized must come back within half a step, not silently corrupted.
"""
import os
import sys

import numpy as np
import pytest

from ringzero.comm import quant
from ringzero.comm.quant import Quant, Quantizer, wire_views

sys.path.insert(0, os.path.dirname(__file__))
import cupy_standin  # noqa: E402

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
LENGTHS = (0, 1, 2, 7, 13, 31, 97, 4099)


@pytest.fixture(params=["c", "numpy"])
def qpath(request, monkeypatch):
    """Both host paths: the C kernels (comm/csrc/quant.c) and the NumPy fallback."""
    if request.param == "c" and not quant.HAVE_C:
        pytest.skip("ringzero.comm._quant was not built")
    if request.param == "numpy":
        monkeypatch.setattr(quant, "HAVE_C", False)
    return request.param


def ref_quant(x, bits, block):
    """(codes as ints, scales) by a loop over blocks, float32 arithmetic throughout."""
    qmax = np.float32(127 if bits == 8 else 7)
    x = np.asarray(x, np.float32)
    codes, scales = [], []
    for j in range(0, len(x), block):
        blk = x[j:j + block]
        s = np.float32(np.max(np.abs(blk))) / qmax
        scales.append(s)
        if not np.isfinite(s) or s == 0:
            codes += [0] * len(blk)
            continue
        for v in blk:
            c = np.rint(np.float32(v) / s)
            codes.append(int(min(max(c, -qmax), qmax)))
    return codes, np.array(scales, np.float32)


def ref_pack(codes, bits):
    if bits == 8:
        return np.array(codes, np.int8)
    c = list(codes) + [0] * (len(codes) & 1)
    return np.array([(c[i] & 0xF) | ((c[i + 1] & 0xF) << 4) for i in range(0, len(c), 2)], np.uint8)


def ref_values(codes, scales, block):
    return np.array([np.float32(c) * scales[i // block] for i, c in enumerate(codes)], np.float32)


def run(x, bits, block, out_dtype=None):
    s = Quant(bits, block)
    q = Quantizer(s)
    codes = np.full(s.code_bytes(len(x)), 99, s.codes_dtype())
    scales = np.full(s.nblocks(len(x)), -1, np.float32)
    q.quantize(x, codes, scales)
    out = np.empty(len(x), out_dtype or x.dtype)
    q.dequantize(codes, scales, out)
    return codes, scales, out


@pytest.mark.parametrize("bits", [8, 4])
def test_bf16_weights_come_back_within_half_a_step(bits, qpath):
    """DeepSpeed's bf16 bug: bf16 in, bf16 out, each element within half a quantization step (+ the bf16 cast)."""
    rng = np.random.default_rng(1)
    w = (rng.standard_normal(5000) * 0.02).astype(BF16)       # weights at init scale
    w[100:200] *= 50                                          # a block with outliers
    codes, scales, back = run(w, bits, 256)
    x, y = w.astype(np.float32), back.astype(np.float32)
    step = np.repeat(scales, 256)[:len(w)]
    ulp = np.abs(np.spacing(y.astype(BF16)).astype(np.float32))     # bf16's spacing at the result
    err = np.abs(y - x)
    assert np.all(err <= step / 2 * (1 + 1e-6) + ulp / 2), f"max excess {np.max(err - step / 2 - ulp / 2)}"
    assert np.corrcoef(x, y)[0, 1] > 0.99                    # not garbage of the right size
    want, _ = ref_quant(x, bits, 256)
    assert np.array_equal(codes, ref_pack(want, bits))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [1, 3, 64, 2048])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_quantize_matches_reference_bitwise(bits, block, dtype, qpath):
    rng = np.random.default_rng(7)
    for L in LENGTHS:
        x = (rng.standard_normal(L) * 3).astype(dtype)
        codes, scales, back = run(x, bits, block, np.float32)
        want, ws = ref_quant(x, bits, block)
        assert np.array_equal(codes, ref_pack(want, bits)), f"codes L={L}"
        assert np.array_equal(scales, ws), f"scales L={L}"
        assert np.array_equal(back, ref_values(want, ws, block)), f"values L={L}"
        step = np.repeat(ws, block)[:L]
        x32 = x.astype(np.float32)
        assert np.all(np.abs(back - x32) <= step / 2 + 4 * np.spacing(np.abs(x32))), f"bound L={L}"


def test_ties_round_to_even_and_clamp(qpath):
    # block of 7 with absmax 7: scale 1 (int4), so the codes are the values rounded half to even
    x = np.array([7, 0.5, 1.5, 2.5, -0.5, -1.5, -3.5], np.float32)
    codes, scales, back = run(x, 4, 7)
    assert scales[0] == 1
    assert back.tolist() == [7, 0, 2, 2, 0, -2, -4]
    x8 = np.array([127, 0.5, 1.5, -126.5], np.float32)
    c8, s8, _ = run(x8, 8, 4)
    assert c8.tolist() == [127, 0, 2, -126] and s8[0] == 1
    assert np.all(np.abs(c8) <= 127)


def test_zero_and_nonfinite_blocks(qpath):
    x = np.zeros(10, np.float32)
    x[5] = np.inf
    x[8] = 3
    codes, scales, back = run(x, 8, 5)
    assert scales[0] == 0 and not np.any(codes[:5]) and np.array_equal(back[:5], np.zeros(5, np.float32))
    assert not np.isfinite(scales[1]) and not np.any(codes[5:])
    assert np.all(np.isnan(back[5:]))                     # an overflow stays visible, never a silent 0
    xn = np.array([1, np.nan, 2, 4], np.float32)
    _, s, b = run(xn, 4, 2)
    assert np.isnan(s[0]) and np.all(np.isnan(b[:2])) and s[1] == np.float32(4) / np.float32(7)
    assert np.all(np.abs(b[2:] - xn[2:]) <= s[1] / 2)


def test_dequantize_accumulates_in_float32(qpath):
    rng = np.random.default_rng(3)
    x = rng.standard_normal(300).astype(np.float32)
    s = Quant(4, 32)
    q = Quantizer(s)
    codes, scales = np.empty(s.code_bytes(300), np.uint8), np.empty(s.nblocks(300), np.float32)
    q.quantize(x, codes, scales)
    acc = rng.standard_normal(300).astype(np.float32)
    want = acc + ref_values(ref_quant(x, 4, 32)[0], scales, 32)
    q.dequantize(codes, scales, acc, add=True)
    assert np.array_equal(acc, want)


def test_wire_layout_and_views():
    s = Quant(4, 4)
    c, at, end = s.wire_layout(9)               # 5 code bytes, scales from byte 8, 3 scales
    assert (c, at, end) == (5, 8, 20)
    buf = np.zeros(end, np.uint8)
    codes, scales = wire_views(s, buf, 9)
    assert codes.dtype == np.uint8 and len(codes) == 5 and len(scales) == 3
    assert Quant(8, 2048).bytes_per_element() == 1 + 4 / 2048


def test_hot_path_allocates_once(qpath):
    s = Quant(8, 64)
    q = Quantizer(s)
    x = np.ones(1000, np.float16)
    codes, scales, out = np.empty(1000, np.int8), np.empty(16, np.float32), np.empty(1000, np.float16)
    for _ in range(3):
        q.quantize(x, codes, scales)
        q.dequantize(codes, scales, out)
    q.quantize(x[:500], codes[:500], scales[:8])
    assert q.growths == 1


def test_bad_arguments_one_line_each():
    for bad in (lambda: Quant(3, 64), lambda: Quant(8, 0), lambda: Quant(4, -5)):
        with pytest.raises(ValueError) as e:
            bad()
        assert "\n" not in str(e.value)
    q = Quantizer(Quant(8, 4))
    x = np.ones(10, np.float32)
    cases = [(lambda: q.quantize(x, np.empty(9, np.int8), np.empty(3, np.float32)), "len(codes) == 10, got 9"),
             (lambda: q.quantize(x, np.empty(10, np.int8), np.empty(2, np.float32)), "len(scales) == 3, got 2"),
             (lambda: q.quantize(x, np.empty(10, np.uint8), np.empty(3, np.float32)), "dtype int8"),
             (lambda: q.quantize(x.astype(np.float64), np.empty(10, np.int8), np.empty(3, np.float32)), "float64"),
             (lambda: q.dequantize(np.empty(10, np.int8), np.empty(3, np.float32), np.empty(10, np.float16),
                                   add=True), "dtype float32"),
             (lambda: q.quantize(np.ones((2, 5), np.float32), np.empty(10, np.int8), np.empty(3, np.float32)),
              "1-D")]
    for f, words in cases:
        with pytest.raises((ValueError, TypeError)) as e:
            f()
        assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.standin
@pytest.mark.parametrize("kernels", [True, False], ids=["cuda-kernels", "xp"])
@pytest.mark.parametrize("bits", [8, 4])
def test_cupy_standin_gives_the_numpy_bits(monkeypatch, bits, kernels):
    if kernels and not cupy_standin._kernel.have_compiler():
        pytest.skip("the stand-in's ElementwiseKernel needs a C++ compiler")
    cp = cupy_standin.install(monkeypatch)
    rng = np.random.default_rng(5)
    for L in (1, 13, 4099):
        for dt in ("float32", "float16"):
            x = (rng.standard_normal(L) * 2).astype(dt)
            x[L // 2] = 0.5 * x.max()                 # whatever the max, some ties
            if L > 200:
                x[100:200] = 0                        # a zero block
                x[300] = np.inf                       # a non-finite block
                x[450] = np.nan
                x[500:503] = [127 if bits == 8 else 7, 2.5, -3.5]   # scale 1: exact ties, to even
            codes, scales, back = run(x, bits, 100)
            s = Quant(bits, 100)
            q = Quantizer(s)
            q.use_cuda = kernels
            dc, ds = cp.empty(s.code_bytes(L), s.codes_dtype()), cp.empty(s.nblocks(L), cp.float32)
            q.quantize(cp.asarray(x), dc, ds)
            out = cp.empty(L, dt)
            q.dequantize(dc, ds, out)
            assert dc.get().tobytes() == codes.tobytes() and ds.get().tobytes() == scales.tobytes()
            assert out.get().tobytes() == back.tobytes()
            acc = cp.ones(L, cp.float32)
            q.dequantize(dc, ds, acc, add=True)
            assert acc.get().tobytes() == (np.ones(L, np.float32) + back.astype(np.float32)).tobytes() \
                or dt == "float16"
            with pytest.raises(TypeError, match="all NumPy or all CuPy"):
                q.quantize(x, dc, ds)


def test_c_and_numpy_agree_on_every_bit(monkeypatch):
    """The C kernels against the NumPy path on hard inputs: subnormals, huge values, NaN, Inf, -0, ties."""
    if not quant.HAVE_C:
        pytest.skip("ringzero.comm._quant was not built")
    rng = np.random.default_rng(11)
    x = (rng.standard_normal(20000) * np.exp(rng.uniform(-90, 80, 20000))).astype(np.float32)
    x[::97] = 0
    x[5::101] = -0.0
    x[7::499] = np.float32(1e-45)
    x[3000:3010] = [np.inf, 1, 2, 3, -np.inf, 5, 6, 7, 8, 9]
    x[5000:5005] = [np.nan, 1, 2, 3, 4]
    x[7000:7064] = np.arange(64) * 0.5           # ties
    for bits in (8, 4):
        for block in (1, 7, 64, 2048):
            for dt in ("float32", "float16", "bfloat16"):
                xd = x.astype(dt) if dt != "float16" else np.clip(x, -6e4, 6e4).astype(dt)
                got = []
                for c in (True, False):
                    monkeypatch.setattr(quant, "HAVE_C", c)
                    got.append(run(xd, bits, block, np.float32) + run(xd, bits, block)[2:])
                for a, b in zip(*got):
                    assert a.tobytes() == b.tobytes(), f"bits={bits} block={block} {dt}"
                monkeypatch.setattr(quant, "HAVE_C", True)
                q, s = Quantizer(Quant(bits, block)), Quant(bits, block)
                codes, scales = np.empty(s.code_bytes(len(x)), s.codes_dtype()), np.empty(s.nblocks(len(x)), np.float32)
                q.quantize(xd, codes, scales)
                acc_c = np.ones(len(x), np.float32)
                q.dequantize(codes, scales, acc_c, add=True)
                q.use_c = False
                acc_n = np.ones(len(x), np.float32)
                q.dequantize(codes, scales, acc_n, add=True)
                assert acc_c.tobytes() == acc_n.tobytes()
