"""Compatibility name: ``ringzero.fit`` is ``ringzero.tools.fit``.

The module itself, not a copy (patches reach the real globals); `python -m ringzero.fit` runs its `main`.
"""
import sys

from ringzero.tools import fit as _real

if __name__ == "__main__":
    sys.exit(_real.main())
else:
    sys.modules[__name__] = _real
