"""Compatibility name: ``ringzero.simulate`` is ``ringzero.tools.simulate``.

The module itself, not a copy (patches reach the real globals); `python -m ringzero.simulate` runs its `main`.
"""
import sys

from ringzero.tools import simulate as _real

if __name__ == "__main__":
    sys.exit(_real.main())
else:
    sys.modules[__name__] = _real
