"""Compatibility name: ``ringzero.train`` is ``ringzero.app.train``.

The module itself, not a copy (patches reach the real globals); `python -m ringzero.train` runs its `main`.
"""
import sys

from ringzero.app import train as _real

if __name__ == "__main__":
    sys.exit(_real.main())
else:
    sys.modules[__name__] = _real
