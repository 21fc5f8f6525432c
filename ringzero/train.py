"""``python -m ringzero.train``: the trainer (the main job).

A launcher only: the code is ``ringzero.app.train``, and this module runs its ``main``.
"""
import sys

from ringzero.app.train import main

if __name__ == "__main__":
    sys.exit(main())
