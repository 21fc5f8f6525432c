"""``python -m ringzero.bench``: the collectives benchmark against the MPI library's own.

A launcher only: the code is ``ringzero.tools.bench``, and this module runs its ``main``.
"""
import sys

from ringzero.tools.bench import main

if __name__ == "__main__":
    sys.exit(main())
