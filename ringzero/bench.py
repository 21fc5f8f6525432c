"""Compatibility name: ``ringzero.bench`` is ``ringzero.tools.bench``.

The module itself, not a copy (patches reach the real globals); `python -m ringzero.bench` runs its `main`.
"""
import sys

from ringzero.tools import bench as _real

if __name__ == "__main__":
    sys.exit(_real.main())
else:
    sys.modules[__name__] = _real
