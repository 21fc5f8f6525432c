"""``python -m ringzero.data``: the corpus: check a text file, print its split; ``encode`` BPE tokens.

A launcher only: the code is ``ringzero.app.data``, and this module runs its ``main``.
"""
import sys

from ringzero.app.data import main

if __name__ == "__main__":
    sys.exit(main())
