"""The minimal model: a multi-layer perceptron classifier over the unit contract.

What it is
    ``MLP(sizes)`` with sizes = (D_in, H1, ..., Hk, n_classes): k hidden units
    of Linear + GELU, then a head unit of Linear + softmax cross-entropy over
    class labels. One unit per layer, so a sharding runtime gathers and frees
    one layer at a time. It follows exactly the contract of ``GPT``:

        forward_unit(u, P, x, targets=None) -> (y, cache)
            u < last:  x float (B, D_in or H) -> h (B, H)
            u == last: x (B, H), targets int (B,) -> mean cross-entropy (float)
                       (without targets: logits (B, n_classes), cache None)
        backward_unit(u, dy, cache, P, G) -> dx  (None for unit 0)

What it is not
    A parameter owner: P and G are named views the caller hands in.
"""
from __future__ import annotations

import math

from ringzero.nn.layers import GELU, Linear, Pool, SoftmaxCrossEntropy, cache_nbytes
from ringzero.nn.units import UnitModel
from ringzero.runtime.flat import ParamSpec, Unit


def mlp_units(sizes) -> tuple:
    """Layout table of an MLP: unit i holds fc{i}.w (in, out) and fc{i}.b; the last is the head."""
    sizes = tuple(int(s) for s in sizes)
    if len(sizes) < 2 or min(sizes) < 1:
        raise ValueError(f"MLP sizes must be >= 2 positive widths (D_in, ..., n_classes), got {sizes}")
    units = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        name = "head" if i == len(sizes) - 2 else f"fc{i}"
        units.append(Unit(name, (ParamSpec(f"{name}.w", (a, b), f"normal:{1.0 / math.sqrt(a)}"),
                                 ParamSpec(f"{name}.b", (b,), "zeros", False))))
    return tuple(units)


class MLP(UnitModel):
    """Classifier over ``mlp_units(sizes)``; see the module docstring for the contract."""

    def __init__(self, sizes, pool: Pool | None = None):
        self.units = mlp_units(sizes)
        self.sizes = tuple(int(s) for s in sizes)
        self.pool = pool if pool is not None else Pool()
        self.last = len(self.units) - 1
        self.lin = [Linear(self.pool, f"unit{u}.fc") for u in range(self.last + 1)]
        self.act = [GELU(self.pool, f"unit{u}.gelu") for u in range(self.last)]
        self.ce = SoftmaxCrossEntropy(self.pool, "ce")
        self._pd = {}

    def _params(self, u, P):
        """Unit u's param dict, refilled in place (caches refer to it)."""
        n = self.units[u].name
        d = self._pd.setdefault(u, {})
        try:
            d.update(w=P[n + ".w"], b=P[n + ".b"])
            return d
        except KeyError as e:
            raise KeyError(f"unit {u} ({n}) needs parameter {e.args[0]!r}, not in the dict given") from None

    def forward_unit(self, u, P, x, targets=None):
        if not 0 <= u <= self.last:
            raise ValueError(f"unit index must be in [0, {self.last}], got {u}")
        y, c_lin = self.lin[u].forward(self._params(u, P), x)  # (B, out)
        if u < self.last:
            y, c_act = self.act[u].forward(None, y)
            return y, (c_lin, c_act)
        if targets is None:
            return y, None
        loss, c_ce = self.ce.forward(None, (y, targets))
        return float(loss), (c_lin, c_ce)

    def backward_unit(self, u, dy, cache, P, G):
        if not 0 <= u <= self.last:
            raise ValueError(f"unit index must be in [0, {self.last}], got {u}")
        if cache is None:
            raise ValueError(f"unit {u} has no cache: run forward_unit (with targets for the head) first")
        self._params(u, P)
        n = self.units[u].name
        g = {"w": G[n + ".w"], "b": G[n + ".b"]}
        if u < self.last:
            c_lin, c_act = cache
            dy = self.act[u].backward(dy, c_act, None)
        else:
            c_lin, c_ce = cache
            dy = self.ce.backward(dy, c_ce, None)
        dx = self.lin[u].backward(dy, c_lin, g)
        return None if u == 0 else dx

    @staticmethod
    def cache_nbytes(cache) -> int:
        return cache_nbytes(cache)
