"""Build script for the one optional C extension (ringzero._f16, the float16
kernel in ringzero/csrc). Package metadata lives in setup.cfg.

The extension is optional: without a compiler the install still succeeds and
ringzero.kernels falls back to NumPy with bitwise the same results.
"""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "ringzero._f16",
            sources=["ringzero/csrc/f16.c"],
            extra_compile_args=["-O3", "-fno-fast-math"],
            optional=True,
        )
    ]
)
