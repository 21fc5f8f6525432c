"""Compatibility name: ``ringzero.plot`` is ``ringzero.tools.plot``.

The module itself, not a copy (patches reach the real globals); `python -m ringzero.plot` runs its `main`.
"""
import sys

from ringzero.tools import plot as _real

if __name__ == "__main__":
    sys.exit(_real.main())
else:
    sys.modules[__name__] = _real
