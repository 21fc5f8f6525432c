"""``python -m ringzero.explain``: ZeRO's arithmetic, derived step by step.

A launcher only: the code is ``ringzero.tools.explain``, and this module runs its ``main``.
"""
import sys

from ringzero.tools.explain import main

if __name__ == "__main__":
    sys.exit(main())
