"""The model contract: what the sharding runtime needs from a model, written once.

What it is
    ``ShardableModel``, a ``typing.Protocol``. A model that has these members
    shards at every stage, whatever it computes::

        units                        tuple of flat.Unit: the layout declaration
                                     (params, grouped into units gathered together)
        last                         index of the last unit (len(units) - 1)
        forward_unit(u, P, x, targets=None) -> (y, cache)
                                     P: {param name: view} of the units u needs;
                                     the last unit, given targets, returns (loss, cache)
        backward_unit(u, dy, cache, P, G) -> dx
                                     adds d(loss)/d(param) into the views G
                                     (zeroed by the runtime); returns d(loss)/dx
        cache_nbytes(cache) -> int   activation bytes a cache holds (the report's peak)
        backward_reads_params(u) -> bool
                                     False if u's backward reads no weights, so a
                                     sharded runtime need not gather them again

    ``UnitModel`` (units.py) gives the last two their defaults (count the
    arrays in the cache; True), and whole-model ``loss``/``loss_and_grad``.

What it is not
    No behaviour: a description a type checker (and a reader) can hold a model
    against. ``isinstance(model, ShardableModel)`` checks the names only.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class ShardableModel(Protocol):
    units: tuple
    last: int

    def forward_unit(self, u: int, P: dict, x, targets=None) -> tuple: ...

    def backward_unit(self, u: int, dy, cache, P: dict, G: dict): ...

    def cache_nbytes(self, cache) -> int: ...

    def backward_reads_params(self, u: int) -> bool: ...
