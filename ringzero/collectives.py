"""Compatibility name: ``ringzero.collectives`` is ``ringzero.comm.ring``.

The module itself, not a copy (patches reach the real globals).
"""
import sys

from ringzero.comm import ring as _real

sys.modules[__name__] = _real
