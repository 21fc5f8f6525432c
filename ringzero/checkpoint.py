"""Compatibility name: ``ringzero.checkpoint`` is ``ringzero.runtime.checkpoint``.

The module itself, not a copy (patches reach the real globals); `python -m ringzero.checkpoint` runs its `main`.
"""
import sys

from ringzero.runtime import checkpoint as _real

if __name__ == "__main__":
    sys.exit(_real.main())
else:
    sys.modules[__name__] = _real
