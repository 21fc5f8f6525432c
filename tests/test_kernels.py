"""float16 kernels against NumPy, bit for bit, on every float16 pattern.

Each test runs on every path this machine has: the C extension's F16C/AVX
path, its portable scalar path, and the NumPy fallback (kernels._c = None).
"""
import numpy as np
import pytest

from ringzero.comm import kernels

ALL_H = np.arange(1 << 16, dtype=np.uint16).view(np.float16)  # incl. NaN, Inf, subnormals, -0


def paths():
    out = ["numpy"]
    if kernels._c is not None:
        out.append("c-scalar")
        if kernels._c.HAVE_F16C:
            out.append("c-f16c")
    return out


@pytest.fixture(params=paths())
def path(request, monkeypatch):
    if request.param == "numpy":
        monkeypatch.setattr(kernels, "_c", None)
    else:
        kernels._c.set_simd(request.param == "c-f16c")
        yield request.param
        kernels._c.set_simd(True)
        return
    yield request.param


def bits16(x):
    return x.view(np.uint16)


def test_f16_to_f32_all_patterns(path):
    out = np.empty(len(ALL_H), np.float32)
    kernels.f16_to_f32(ALL_H, out)
    assert np.array_equal(out.view(np.uint32), ALL_H.astype(np.float32).view(np.uint32))


def test_f32_to_f16_patterns_and_random_bits(path):
    rng = np.random.default_rng(0)
    wide = ALL_H.astype(np.float32).view(np.uint32)
    src = np.concatenate([
        wide,                                            # exact values
        wide + np.uint32(0x1000), wide + np.uint32(0x0fff), wide + np.uint32(0x1001),  # ties and near-ties
        rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32),       # any float32 bits
        np.array([0x477fefff, 0x477ff000, 0x33000000, 0x33000001, 0x387fe000, 0x7f800001, 0xffc00000], np.uint32),
    ]).view(np.float32)
    out = np.empty(len(src), np.float16)
    kernels.f32_to_f16(src, out)
    with np.errstate(over="ignore", invalid="ignore"):
        want = src.astype(np.float16)
    bad = np.flatnonzero(bits16(out) != bits16(want))
    assert len(bad) == 0, f"{len(bad)} differ, first src bits {src.view(np.uint32)[bad[:4]]}"


def test_add_f16_all_patterns_and_random_pairs(path):
    rng = np.random.default_rng(1)
    a = np.concatenate([ALL_H, rng.integers(0, 1 << 16, 1 << 20).astype(np.uint16).view(np.float16),
                        rng.standard_normal(1 << 16).astype(np.float16)])
    b = np.concatenate([ALL_H[::-1], rng.integers(0, 1 << 16, 1 << 20).astype(np.uint16).view(np.float16),
                        rng.standard_normal(1 << 16).astype(np.float16)])
    with np.errstate(over="ignore", invalid="ignore"):
        want = a + b  # NumPy's float16 add: widen, add in float32, round once
        # the rule written out, independent of NumPy's float16 loop (NaN payloads aside)
        rule = (a.astype(np.float32) + b.astype(np.float32)).astype(np.float16)
    out = np.empty_like(a)
    kernels.add_f16(a, b, out)
    bad = np.flatnonzero(bits16(out) != bits16(want))
    assert len(bad) == 0, f"{len(bad)} differ, first pairs {bits16(a)[bad[:3]]} {bits16(b)[bad[:3]]}"
    finite = ~np.isnan(want)
    assert np.array_equal(bits16(out)[finite], bits16(rule)[finite])
    # in place (the ring adds into its receive buffer)
    c = a.copy()
    kernels.add_f16(c, b, c)
    assert np.array_equal(bits16(c), bits16(want))


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 15, 17])
def test_ragged_lengths(path, n):
    rng = np.random.default_rng(n)
    a = rng.standard_normal(n).astype(np.float16)
    b = rng.standard_normal(n).astype(np.float16)
    out = np.empty(n, np.float16)
    kernels.add_f16(a, b, out)
    w = np.empty(n, np.float32)
    kernels.f16_to_f32(a, w)
    h = np.empty(n, np.float16)
    kernels.f32_to_f16(w, h)
    assert np.array_equal(bits16(out), bits16(a + b)) and np.array_equal(bits16(h), bits16(a))


def test_bad_input_one_line_errors():
    h, f = np.zeros(8, np.float16), np.zeros(8, np.float32)
    cases = [
        (TypeError, lambda: kernels.f16_to_f32(f, f)),
        (TypeError, lambda: kernels.f32_to_f16(f, f)),
        (TypeError, lambda: kernels.add_f16(h, f, h)),
        (ValueError, lambda: kernels.add_f16(h, h[:4], h)),
        (ValueError, lambda: kernels.f16_to_f32(h, np.zeros(7, np.float32))),
        (ValueError, lambda: kernels.add_f16(h[::2], h[::2], np.zeros(4, np.float16))),
        (ValueError, lambda: kernels.add_f16(np.zeros((2, 4), np.float16), np.zeros((2, 4), np.float16),
                                             np.zeros((2, 4), np.float16))),
    ]
    for exc, call in cases:
        with pytest.raises(exc) as e:
            call()
        assert "\n" not in str(e.value) and "expected" in str(e.value)


def test_c_is_faster_than_numpy_add():
    """The reason the kernel exists (ANCHORS: NumPy's float16 add runs at ~0.18 G elements/s)."""
    if not kernels.HAVE_F16C:
        pytest.skip("the C extension with F16C is not built or the CPU lacks F16C")
    import time
    a = np.ones(1 << 21, np.float16)
    out = np.empty_like(a)
    best = {}
    for name, fn in (("c", lambda: kernels.add_f16(a, a, out)), ("numpy", lambda: np.add(a, a, out=out))):
        ts = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        best[name] = min(ts)
    assert best["c"] * 4 < best["numpy"], best
