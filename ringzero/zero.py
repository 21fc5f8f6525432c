"""Compatibility name: ``ringzero.zero`` is ``ringzero.runtime.zero``.

The module itself, not a copy (patches reach the real globals).
"""
import sys

from ringzero.runtime import zero as _real

sys.modules[__name__] = _real
