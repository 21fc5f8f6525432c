"""Compatibility name: ``ringzero.estimate`` is ``ringzero.tools.estimate``.

The module itself, not a copy (patches reach the real globals); `python -m ringzero.estimate` runs its `main`.
"""
import sys

from ringzero.tools import estimate as _real

if __name__ == "__main__":
    sys.exit(_real.main())
else:
    sys.modules[__name__] = _real
