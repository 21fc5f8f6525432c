"""``python -m ringzero.checkpoint``: inspect and export a checkpoint (serial).

A launcher only: the code is ``ringzero.runtime.export``, and this module runs its ``main``.
"""
import sys

from ringzero.runtime.export import main

if __name__ == "__main__":
    sys.exit(main())
