"""``python -m ringzero.simulate``: the step-time model of each stage.

A launcher only: the code is ``ringzero.tools.simulate_cli``, and this module runs its ``main``.
"""
import sys

from ringzero.tools.simulate_cli import main

if __name__ == "__main__":
    sys.exit(main())
