"""The base class of every model here: the contract's defaults and whole-model conveniences.

What it is
    ``UnitModel`` gives a model that implements ``units``, ``last``,
    ``forward_unit`` and ``backward_unit`` (the contract, nn/contract.py):
    the defaults ``cache_nbytes`` (count the arrays a cache holds) and
    ``backward_reads_params`` (True), and single-process ``loss_and_grad``
    and ``loss`` built on the unit calls.

    ``Decoder(UnitModel)`` is the contract written once for a decoder-only
    language model laid out as embed, blocks, head (the GPT and the Llama):
    ``forward_unit``/``backward_unit`` dispatch to the embedding, the blocks
    (``_block_forward``/``_block_backward``, with activation checkpointing)
    and the final norm + head + loss; ``logits`` and ``generate`` sample from
    it. A subclass supplies those layers, ``_params``/``_params_like`` (its
    parameter names) and its blocks.

What it is not
    A runtime: the sharding engine calls the unit methods itself.
"""
import numpy as np

from ringzero.nn.layers import array_module, check_ids
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


class Decoder(UnitModel):
    """Unit 0 embeds, units 1..last-1 are blocks, the last unit is the final norm, the head and the loss.

    A subclass sets ``cfg`` (with ``block_size``), ``last``, ``n_tokens``, ``checkpoint``, ``pool`` and the
    layers ``embed``, ``lnf``, ``head``, ``ce``, a dict ``_pd``, and defines ``_fill_params(u, P, d)`` and
    ``_params_like(u, G)`` (per-layer dicts of views) and ``_block_forward(u, pd, x, recompute)`` /
    ``_block_backward(u, dy, cache, gd)``.
    checkpoint=True: a block's cache is only its input, and backward recomputes the block's forward first.
    """

    def _params(self, u, P):
        """Per-layer param dicts for unit u, refilled in place from P (``_fill_params``).

        Caches keep references to these same dicts, so refilling them before
        backward makes every layer read the views handed to backward (stage 3
        may have re-gathered the unit into another buffer).
        """
        d = self._pd.setdefault(u, {})
        try:
            self._fill_params(u, P, d)
        except KeyError as e:
            raise KeyError(f"unit {u} ({self.units[u].name}) needs parameter {e.args[0]!r}, "
                           f"not in the dict given (has {len(P)} names)") from None
        return d

    def _check_unit(self, u):
        if not 0 <= u <= self.last:
            raise ValueError(f"unit index must be in [0, {self.last}], got {u}")

    # ---- the contract used by the runtime ------------------------------------
    def forward_unit(self, u, P, x, targets=None):
        """Unit u's forward. Returns (y, cache); the last unit returns (loss, cache)
        with targets, or (logits (B, T, V), None) without them."""
        self._check_unit(u)
        pd = self._params(u, P)
        if u == 0:
            if x.ndim == 2 and x.shape[1] > self.cfg.block_size:
                raise ValueError(f"sequence length T={x.shape[1]} exceeds block_size={self.cfg.block_size}")
            return self.embed.forward(pd["embed"], x)           # (B, T) -> (B, T, C)
        if u == self.last:
            B, T, C = x.shape
            xl, c_lnf = self.lnf.forward(pd["lnf"], x)
            logits, c_head = self.head.forward(pd["head"], xl)  # (B, T, V)
            if targets is None:
                return logits, None
            if tuple(targets.shape) != (B, T):
                raise ValueError(f"targets must have shape {(B, T)}, got {tuple(targets.shape)}")
            loss, c_ce = self.ce.forward(None, (logits.reshape(B * T, -1), targets.reshape(B * T)))
            return float(loss), (c_lnf, c_head, c_ce)
        if self.checkpoint:
            y, _ = self._block_forward(u, pd, x)
            return y, (x,)
        return self._block_forward(u, pd, x)

    def backward_unit(self, u, dy, cache, P, G):
        """Unit u's backward: adds into G, returns d(input) (None for unit 0)."""
        self._check_unit(u)
        if cache is None:
            raise ValueError(f"unit {u} has no cache: run forward_unit (with targets for the last unit) first")
        gd = self._params_like(u, G)
        if u == 0:                  # reads no weights: see backward_reads_params
            return self.embed.backward(dy, cache, gd["embed"])
        pd = self._params(u, P)     # refill the dicts the caches point at
        if u == self.last:
            c_lnf, c_head, c_ce = cache
            dl = self.ce.backward(dy, c_ce, None)               # (B*T, V)
            dxl = self.head.backward(dl, c_head, gd["head"])    # (B, T, C)
            return self.lnf.backward(dxl, c_lnf, gd["lnf"])
        if self.checkpoint:
            _, cache = self._block_forward(u, pd, cache[0], recompute=True)
        return self._block_backward(u, dy, cache, gd)

    def check_tokens(self, *arrays):
        """Host check that token ids (and targets) lie in [0, n_tokens), before they
        move to the device: on a GPU the layers do not check (a check there is a
        blocking reduction per step, and CuPy's take wraps a bad id silently)."""
        for a in arrays:
            check_ids(a, self.n_tokens, "token ids")

    def backward_reads_params(self, u) -> bool:
        """False for the embedding unit: its backward scatters dy by token id
        and reads no weights, so a sharded runtime need not gather it again."""
        return u != 0

    # ---- conveniences built on the unit calls ---------------------------------
    def logits(self, P, idx):
        """(B, T, V) logits; buffers are not reused (T may vary)."""
        reuse, self.pool.reuse = self.pool.reuse, False
        try:
            x = idx
            for u in range(self.last + 1):
                x, _ = self.forward_unit(u, P, x)
            return x
        finally:
            self.pool.reuse = reuse

    def generate(self, P, idx, n_new, temperature=1.0, rng=None):
        """Append n_new sampled tokens to idx (B, T0); temperature 0 is greedy."""
        xp = array_module(P["wte"])
        rng = rng if rng is not None else np.random.default_rng()
        out = idx
        for _ in range(int(n_new)):
            ctx = out[:, -self.cfg.block_size:]
            lg = self.logits(P, ctx)[:, -1, :].astype(np.float64)  # (B, V)
            if temperature <= 0:
                nxt = lg.argmax(axis=1)
            else:
                lg = lg / temperature
                lg -= lg.max(axis=1, keepdims=True)
                pr = xp.exp(lg)
                cdf = xp.cumsum(pr, axis=1)
                u = xp.asarray(rng.random(lg.shape[0])) * cdf[:, -1]
                nxt = xp.minimum((cdf < u[:, None]).sum(axis=1), lg.shape[1] - 1)
            out = xp.concatenate([out, nxt[:, None].astype(out.dtype)], axis=1)
        return out
