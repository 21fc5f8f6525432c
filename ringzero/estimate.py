"""``python -m ringzero.estimate``: memory per rank for any model size and Nd.

A launcher only: the code is ``ringzero.tools.estimate``, and this module runs its ``main``.
"""
import sys

from ringzero.tools.estimate import main

if __name__ == "__main__":
    sys.exit(main())
