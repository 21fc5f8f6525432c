"""Build script for the one optional C extension (ringzero.comm._f16, the float16
kernel in ringzero/comm/csrc). Package metadata lives in setup.cfg.

The extension is optional: without a compiler the install still succeeds and
ringzero.comm.kernels falls back to NumPy with bitwise the same results.
"""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "ringzero.comm._f16",
            sources=["ringzero/comm/csrc/f16.c"],
            extra_compile_args=["-O3", "-fno-fast-math"],
            optional=True,
        )
    ]
)
