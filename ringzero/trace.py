"""``python -m ringzero.trace merge|summary DIR``: the per-rank timelines of ``--trace DIR``.

A launcher only: the code is ``ringzero.tools.trace_summary``, and this module runs its ``main``.
"""
import sys

from ringzero.tools.trace_summary import main

if __name__ == "__main__":
    sys.exit(main())
