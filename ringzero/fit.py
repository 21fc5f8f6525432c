"""``python -m ringzero.fit``: an alpha-beta model fitted to bench runs.

A launcher only: the code is ``ringzero.tools.fit``, and this module runs its ``main``.
"""
import sys

from ringzero.tools.fit import main

if __name__ == "__main__":
    sys.exit(main())
