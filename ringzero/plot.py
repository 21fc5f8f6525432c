"""``python -m ringzero.plot``: plots of metrics and bench files.

A launcher only: the code is ``ringzero.tools.plot``, and this module runs its ``main``.
"""
import sys

from ringzero.tools.plot import main

if __name__ == "__main__":
    sys.exit(main())
