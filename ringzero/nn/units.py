"""Whole-model conveniences built only on the per-unit contract.

A model that follows the contract (``units``, ``last``, ``forward_unit``,
``backward_unit``) gets single-process ``loss_and_grad`` and ``loss`` from
this mixin; the sharding runtime calls the unit methods itself.
"""


class UnitModel:
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
