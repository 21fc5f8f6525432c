"""Compatibility name: ``ringzero.explain`` is ``ringzero.tools.explain``.

The module itself, not a copy (patches reach the real globals); `python -m ringzero.explain` runs its `main`.
"""
import sys

from ringzero.tools import explain as _real

if __name__ == "__main__":
    sys.exit(_real.main())
else:
    sys.modules[__name__] = _real
