"""The base class of every model here: the contract's defaults and whole-model conveniences.

What it is
    ``UnitModel`` gives a model that implements ``units``, ``last``,
    ``forward_unit`` and ``backward_unit`` (the contract, nn/contract.py):
    the defaults ``cache_nbytes`` (count the arrays a cache holds) and
    ``backward_reads_params`` (True), and single-process ``loss_and_grad``
    and ``loss`` built on the unit calls.

What it is not
    A runtime: the sharding engine calls the unit methods itself.
"""
from ringzero.nn.layers import cache_nbytes as _cache_nbytes


class UnitModel:
    @staticmethod
    def cache_nbytes(cache) -> int:
        """Bytes of activations a unit's cache holds."""
        return _cache_nbytes(cache)

    def backward_reads_params(self, u) -> bool:
        """Whether unit u's backward reads its weights (default: it does)."""
        return True

    def loss_and_grad(self, P, G, x, targets, scale=1.0):
        """Forward and backward through every unit; adds scale * d(loss) into G."""
        caches = []
        for u in range(self.last + 1):
            x, c = self.forward_unit(u, P, x, targets if u == self.last else None)
            caches.append(c)
        dy = scale
        for u in range(self.last, -1, -1):
            dy = self.backward_unit(u, dy, caches[u], P, G)
        return x

    def loss(self, P, x, targets):
        """Forward through every unit: the mean loss."""
        for u in range(self.last + 1):
            x, _ = self.forward_unit(u, P, x, targets if u == self.last else None)
        return x
