"""Compatibility name: ``ringzero.sample`` is ``ringzero.tools.sample``.

The module itself, not a copy (patches reach the real globals); `python -m ringzero.sample` runs its `main`.
"""
import sys

from ringzero.tools import sample as _real

if __name__ == "__main__":
    sys.exit(_real.main())
else:
    sys.modules[__name__] = _real
