"""Build script for the four optional C extensions. Package metadata lives in setup.cfg.

- ringzero.comm._f16 (ringzero/comm/csrc/f16.c): the float16 kernels of the
  ring; without it ringzero.comm.kernels uses NumPy, with bitwise the same results.
- ringzero.comm._quant (ringzero/comm/csrc/quant.c): blockwise int8/int4 quantize and
  dequantize for the quantized collectives; without it ringzero.comm.quant uses NumPy, bitwise the same.
- ringzero.nn._fused (ringzero/nn/csrc/fused.c): the model's single-pass
  elementwise kernels (GELU, LayerNorm, softmax, cross-entropy); without it
  ringzero.nn.fused uses NumPy formulas (the same math, other rounding).
- ringzero.runtime._adam (ringzero/runtime/csrc/adam.c): AdamW in one pass for the
  offloaded update; without it ringzero.runtime.optim uses NumPy, with bitwise the same results.

All four are optional: without a compiler the install still succeeds.
"""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "ringzero.comm._f16",
            sources=["ringzero/comm/csrc/f16.c"],
            depends=["ringzero/comm/csrc/f16_bits.h"],
            extra_compile_args=["-O3", "-fno-fast-math"],
            optional=True,
        ),
        Extension(
            "ringzero.comm._quant",
            sources=["ringzero/comm/csrc/quant.c"],
            depends=["ringzero/comm/csrc/f16_bits.h"],
            # one float32 operation at a time, as quant.py's NumPy path: no contraction, no fast-math
            extra_compile_args=["-O3", "-fno-fast-math", "-ffp-contract=off", "-fno-math-errno"],
            optional=True,
        ),
        Extension(
            "ringzero.nn._fused",
            sources=["ringzero/nn/csrc/fused.c"],
            # no fused multiply-add contraction, no fast-math (so the AVX2 and
            # the baseline clones of each kernel round exactly alike); no traps
            # or errno, so the branch-free exp/tanh can be vectorized
            extra_compile_args=["-O3", "-fno-fast-math", "-ffp-contract=off", "-fno-trapping-math", "-fno-math-errno"],
            optional=True,
        ),
        Extension(
            "ringzero.runtime._adam",
            sources=["ringzero/runtime/csrc/adam.c"],
            depends=["ringzero/comm/csrc/f16_bits.h"],   # the fp16 conversions, shared with f16.c
            # as _fused: no contraction, no fast-math, so it rounds as the NumPy update does
            extra_compile_args=["-O3", "-fno-fast-math", "-ffp-contract=off", "-fno-math-errno"],
            optional=True,
        ),
    ]
)
