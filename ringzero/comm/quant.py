"""Blockwise symmetric int8 / int4 quantization: the arithmetic of ZeRO++'s quantized collectives.

What it is
    ``Quant(bits, block)`` (frozen) names a format; ``Quantizer(spec)`` does the work with
    grow-only scratch, so a call on buffers of a size seen before allocates nothing new:

        q = Quantizer(Quant(bits=8, block=2048))
        q.quantize(x, codes, scales)                  # x: float32/float16/bfloat16 (L,)
        q.dequantize(codes, scales, out)              # out = the values, cast to out's dtype
        q.dequantize(codes, scales, acc, add=True)    # acc (float32) += the values

    The format, for x of L elements cut into nb = ceil(L / block) blocks (the last one may be
    short; it is padded with zeros, which change no absmax):

        scale[j] = fp32(max |x| over block j) / qmax            qmax = 127 (int8), 7 (int4)
        code[i]  = clip(rint(fp32(x[i]) / scale[j]), -qmax, qmax)  (0: scale 0 or not finite)
        value[i] = fp32(code[i] * scale[j])

    Every operation is one IEEE float32 operation (the division and the product correctly
    rounded, no fused multiply-add), so NumPy, CuPy and C give the same bits. Ties round to
    even (rint), so 2.5 -> 2 and -3.5 -> -4. |value - x| <= scale / 2 (plus float32's own
    rounding of the division, a few ulps of x); a bf16 or fp16 ``out`` adds the cast's half
    ulp (round to nearest even). A zero block has scale 0 and codes 0 (no NaN). A block with
    a NaN or an Inf gets a non-finite scale and codes 0, so its values come back NaN: an
    fp16 overflow stays visible to the loss scaler after a quantized reduce.

    Codes: int8 one per byte (``codes`` int8 (L,)); int4 two per byte, packed as uint8
    (ceil(L / 2),): element 2i in the low nibble, 2i+1 in the high one, each as its
    two's-complement nibble (-7..7 -> 9..15, 0..7). ``wire_bytes`` / ``wire_layout`` give the
    one-buffer wire form the collectives send: the codes, zero-padded to 4 bytes, then the
    scales as float32.

    bf16 arrives as ml_dtypes.bfloat16 (the dtype the runtime stores bf16 in, runtime/state.py)
    and is widened exactly to float32 first: DeepSpeed's bf16 bug (its quantizer silently
    corrupted bf16 weights until PR #8215) is the first test of tests/test_quant.py.

    On the host the work is done by the optional C extension ``ringzero.comm._quant``
    (comm/csrc/quant.c, built beside _f16) when it was built, and by NumPy otherwise; both give
    the same bits (tests/test_quant.py runs both). ``HAVE_C`` says which; RINGZERO_NO_C=1 forces
    NumPy, as in comm/kernels.py. CuPy arrays of float32 / float16 go to the CUDA kernels of
    comm/quant_cuda.py (the same bits again); ``use_cuda = False`` takes the xp path instead.

What it is not
    Asymmetric (zero-point) or stochastic rounding, or fp8.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ringzero.comm import kernels, quant_cuda
from ringzero.comm.backend import get_array_module

try:  # the optional C extension (setup.py, optional=True): the same bits as the NumPy path below
    from ringzero.comm import _quant as _c
except ImportError:
    _c = None
if os.environ.get("RINGZERO_NO_C", "0") == "1":   # force the NumPy path (as comm/kernels.py)
    _c = None
HAVE_C = _c is not None
_DT = {"float32": 0, "float16": 1, "bfloat16": 2}    # quant.c's dtype codes

_QMAX = {8: 127, 4: 7}
_IN = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class Quant:
    """A quantization format: bits 8 or 4, one fp32 scale per `block` elements."""
    bits: int = 8            # 8: int8 codes; 4: int4 codes, two per byte
    block: int = 2048        # elements per scale (DeepSpeed's ZeRO++ uses a few thousand)

    def __post_init__(self):
        if self.bits not in _QMAX:
            raise ValueError(f"quant: expected bits 8 or 4, got {self.bits!r}")
        if not isinstance(self.block, (int, np.integer)) or self.block < 1:
            raise ValueError(f"quant: expected a block size >= 1, got {self.block!r}; HINT: DeepSpeed uses 2048")

    @property
    def qmax(self) -> int:
        return _QMAX[self.bits]

    def nblocks(self, L: int) -> int:
        return -(-L // self.block)

    def code_bytes(self, L: int) -> int:
        return L if self.bits == 8 else (L + 1) // 2

    def codes_dtype(self):
        return np.dtype(np.int8) if self.bits == 8 else np.dtype(np.uint8)

    def wire_layout(self, L: int) -> tuple:
        """(code bytes, offset of the scales, total bytes) of L elements' wire buffer."""
        c = self.code_bytes(L)
        at = -(-c // 4) * 4
        return c, at, at + 4 * self.nblocks(L)

    def wire_bytes(self, L: int) -> int:
        return self.wire_layout(L)[2]

    def bytes_per_element(self) -> float:
        """Wire bytes per element for long buffers: codes plus the scales' share."""
        return self.bits / 8 + 4 / self.block


def _narrow(w, out):
    """out[...] = w (float32), rounded to nearest even: fp16 on the host by kernels.f32_to_f16 (F16C, NumPy's bits)."""
    if out.dtype == np.float16 and isinstance(out, np.ndarray):
        kernels.f32_to_f16(w, out)
    else:
        out[...] = w


def wire_views(spec: Quant, buf, L: int) -> tuple:
    """(codes, scales) views of a uint8 wire buffer holding L elements (wire_layout)."""
    c, at, end = spec.wire_layout(L)
    if buf.dtype != np.uint8 or buf.ndim != 1 or len(buf) < end:
        raise ValueError(f"quant: expected a 1-D uint8 wire buffer of >= {end} bytes for {L} elements, "
                         f"got {buf.dtype} shape {buf.shape}")
    return buf[:c].view(spec.codes_dtype()), buf[at:end].view(np.float32)


def _check_1d(what, a, dtypes, n):
    if not (hasattr(a, "dtype") and hasattr(a, "ndim")):
        raise TypeError(f"quant: expected {what} to be a NumPy or CuPy array, got {type(a).__name__}")
    if a.dtype.name not in dtypes:
        raise TypeError(f"quant: expected {what} of dtype {' or '.join(dtypes)}, got {a.dtype}")
    if a.ndim != 1 or not a.flags.c_contiguous:
        raise ValueError(f"quant: expected {what} 1-D contiguous, got shape {a.shape}")
    if n is not None and len(a) != n:
        raise ValueError(f"quant: expected len({what}) == {n}, got {len(a)}")


class Quantizer:
    """quantize / dequantize in one format, with grow-only float32 scratch (one set per array module)."""

    def __init__(self, spec: Quant):
        self.spec = spec
        self._ws = {}         # array module name -> (w, a, d): float32 work buffers, grow-only
        self.growths = 0      # how many times the scratch grew (a hot path's test reads it)
        self.use_c = HAVE_C   # the host's C kernels (False: the NumPy path, as RINGZERO_NO_C=1)
        self.use_cuda = True  # CuPy arrays: quant_cuda's kernels (False: the xp path, a dozen CuPy passes)

    def _scratch(self, xp, L):
        nb = self.spec.nblocks(L)
        P = nb * self.spec.block
        P += P & 1                         # int4: an even count to pack in pairs
        have = self._ws.get(xp.__name__)
        if have is None or len(have[0]) < P or len(have[2]) < nb:
            cap = max(P, 0 if have is None else len(have[0]))
            ncap = max(nb, 0 if have is None else len(have[2]))
            have = (xp.empty(cap, xp.float32), xp.empty(cap, xp.float32), xp.empty(ncap, xp.float32))
            self._ws[xp.__name__] = have
            self.growths += 1
        w, a, d = have
        return w[:P], a[:P], d[:nb], nb, P

    def quantize(self, x, codes, scales):
        """codes, scales = the blockwise quantization of x (module docstring); returns (codes, scales)."""
        with np.errstate(invalid="ignore", divide="ignore"):    # NaN / Inf blocks: handled, not warned
            return self._quantize(x, codes, scales)

    def _quantize(self, x, codes, scales):
        s = self.spec
        _check_1d("x", x, _IN, None)
        L = len(x)
        _check_1d("codes", codes, (s.codes_dtype().name,), s.code_bytes(L))
        _check_1d("scales", scales, ("float32",), s.nblocks(L))
        xp = get_array_module(x, codes, scales)
        if L == 0:
            return codes, scales
        if xp is np and self.use_c:
            if x.dtype == np.float16 and kernels.HAVE_F16C:     # widen with F16C first (exact): faster
                x = kernels.f16_to_f32(x, self._scratch(xp, L)[0][:L])
            _c.quantize(x if x.dtype.name != "bfloat16" else x.view(np.uint16), _DT[x.dtype.name], s.block,
                        s.bits, codes, scales)
            return codes, scales
        if xp is not np and self.use_cuda and quant_cuda.takes(x):
            quant_cuda.quantize(s, x, codes, scales)
            return codes, scales
        w, a, d, nb, P = self._scratch(xp, L)
        B, qmax = s.block, float(s.qmax)
        w[:L] = x                                   # exact widening (fp16, bf16 -> fp32)
        w[L:] = 0                                   # the short block's padding: no effect on its absmax
        W, A = w[:nb * B].reshape(nb, B), a[:nb * B].reshape(nb, B)
        xp.abs(W, out=A)
        xp.max(A, axis=1, out=scales)               # absmax per block (NaN if the block has one)
        xp.divide(scales, qmax, out=scales)         # scale = absmax / qmax, one rounding
        # divisor d: the scale where it is finite and > 0, else Inf (codes of a zero block are 0/Inf = 0)
        xp.copyto(d, scales)
        xp.copyto(d, np.inf, where=scales <= 0)     # zero blocks
        xp.copyto(d, np.inf, where=xp.isnan(scales))
        xp.divide(W, d[:, None], out=A)
        xp.round(A, out=A)                          # rint: ties to even
        xp.clip(A, -qmax, qmax, out=A)
        xp.copyto(A, 0.0, where=(d == np.inf)[:, None])   # zero and non-finite blocks: codes 0
        a[nb * B:] = 0                              # int4's pairing pad (odd nb * block)
        if s.bits == 8:
            codes[...] = a[:L]                      # exact: integers in [-127, 127]
        else:                                       # nibble = code mod 16, then lo + 16 * hi per byte
            xp.add(a, 16.0, out=w[:P])
            xp.copyto(a, w[:P], where=a < 0)
            lo, hi = a[0:P:2], a[1:P:2]
            half = w[:P // 2]
            xp.multiply(hi, 16.0, out=half)
            xp.add(half, lo, out=half)
            codes[...] = half[:len(codes)]
        return codes, scales

    def dequantize(self, codes, scales, out, add: bool = False):
        """out = values (cast to out's dtype, round to nearest even), or with add=True out (float32) += values."""
        with np.errstate(invalid="ignore", over="ignore"):
            return self._dequantize(codes, scales, out, add)

    def _dequantize(self, codes, scales, out, add):
        s = self.spec
        _check_1d("out", out, ("float32",) if add else _IN, None)
        L = len(out)
        _check_1d("codes", codes, (s.codes_dtype().name,), s.code_bytes(L))
        _check_1d("scales", scales, ("float32",), s.nblocks(L))
        xp = get_array_module(codes, scales, out)
        if L == 0:
            return out
        if xp is np and self.use_c:
            if add or out.dtype == np.float32:
                _c.dequantize(codes, scales, s.block, s.bits, out, add)
            else:                                   # fp16 / bf16: float32 values, then NumPy's cast
                w = self._scratch(xp, L)[0][:L]
                _c.dequantize(codes, scales, s.block, s.bits, w, False)
                _narrow(w, out)
            return out
        if xp is not np and self.use_cuda and quant_cuda.takes(out):
            quant_cuda.dequantize(s, codes, scales, out, add)
            return out
        w, a, d, nb, P = self._scratch(xp, L)
        B = s.block
        if s.bits == 8:
            w[:L] = codes
        else:                                       # byte -> hi = floor(b / 16), lo = b - 16 hi; >= 8 means -16
            nbyt = len(codes)
            b, hi = a[:nbyt], a[P // 2:P // 2 + nbyt]
            b[...] = codes
            xp.divide(b, 16.0, out=hi)
            xp.floor(hi, out=hi)
            lo, odd = w[0:2 * nbyt:2], w[1:2 * nbyt:2]
            xp.copyto(odd, hi)
            xp.multiply(hi, 16.0, out=hi)
            xp.subtract(b, hi, out=lo)
            v = w[:2 * nbyt]
            xp.subtract(v, 16.0, out=a[:2 * nbyt])
            xp.copyto(v, a[:2 * nbyt], where=v >= 8)
        w[L:] = 0
        W = w[:nb * B].reshape(nb, B)
        xp.multiply(W, scales[:, None], out=W)      # value = code * scale, one rounding
        if add:
            xp.add(out, w[:L], out=out)
        else:
            _narrow(w[:L], out)
        return out
