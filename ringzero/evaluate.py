"""``python -m ringzero.evaluate``: a checkpoint's loss and perplexity on a token file.

A launcher only: the code is ``ringzero.tools.evaluate``, and this module runs its ``main``.
"""
import sys

from ringzero.tools.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
