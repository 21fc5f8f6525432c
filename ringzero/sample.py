"""``python -m ringzero.sample``: text from a checkpoint.

A launcher only: the code is ``ringzero.tools.sample``, and this module runs its ``main``.
"""
import sys

from ringzero.tools.sample import main

if __name__ == "__main__":
    sys.exit(main())
