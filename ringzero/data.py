"""Compatibility name: ``ringzero.data`` is ``ringzero.app.data``.

The module itself, not a copy (patches reach the real globals); `python -m ringzero.data` runs its `main`.
"""
import sys

from ringzero.app import data as _real

if __name__ == "__main__":
    sys.exit(_real.main())
else:
    sys.modules[__name__] = _real
