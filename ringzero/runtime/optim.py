"""Mixed-precision AdamW on a flat fp32 slice, and the dynamic loss scaler.

What it is
    ``AdamW.update(master, m, v, g, lr, decay_mask)`` updates one contiguous
    fp32 slice in place, elementwise, with temporaries allocated once. Because
    every operation is elementwise and IEEE-rounded, the result for an element
    does not depend on which rank or which slice it is updated in: that is
    what lets stages 0-3 produce bitwise identical weights.

    ``AdamW.update_tile(master, m, v, grads, coef, lr, runs, params)`` is the
    same update fused with what surrounds it in the offloaded update: the
    storage-dtype gradient widened and scaled by ``coef``, and the new master
    cast into the params, in one pass over memory by the optional C extension
    ``ringzero.runtime._adam`` (runtime/csrc/adam.c), else by the NumPy steps
    above in the same order. Both give the bits of ``update`` (tests/test_offload_adam.py).

    ``LossScaler`` is the dynamic scaler of mixed-precision training: start
    at 2**16, halve on overflow (after ``hysteresis`` overflows in a row),
    double after ``growth_interval`` clean steps, never below ``min_scale``.

What it is not
    It knows nothing of shards or communication; zero.py hands it slices.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from ringzero.runtime.state import cast_into

try:  # the optional C extension (setup.py, optional=True)
    from ringzero.runtime import _adam as _c
except ImportError:  # no compiler at install time: NumPy does the work
    _c = None
if os.environ.get("RINGZERO_NO_C", "0") == "1":
    _c = None
HAVE_C = _c is not None


@dataclass
class AdamConfig:
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1   # decoupled (AdamW); biases and norms excluded by the layout
    grad_clip: float = 1.0      # global-norm clipping; 0 disables


class AdamW:
    """Elementwise AdamW over fp32 slices, with preallocated scratch.

    Shapes: master, m, v, g are 1-D fp32 slices of equal length k <= capacity.
    """

    def __init__(self, cfg: AdamConfig, capacity: int, xp):
        self.cfg = cfg
        self.t = 0                                   # steps taken (skipped steps don't count)
        self._tmp = xp.empty(capacity, xp.float32)   # sqrt(v_hat) + eps, then the update
        self.xp = xp

    @property
    def scratch_nbytes(self) -> int:
        """Bytes of the preallocated scratch (a memory report's optimizer line)."""
        return int(self._tmp.nbytes)

    def begin_step(self):
        self.t += 1
        c = self.cfg
        # Bias corrections as Python floats, identical on every rank and stage.
        self._bc1 = 1.0 - c.beta1 ** self.t
        self._bc2 = 1.0 - c.beta2 ** self.t

    def update(self, master, m, v, g, lr: float, decay_segments=()):
        """One AdamW step on a slice; ``g`` is the unscaled, clipped fp32 gradient.

        decay_segments: (start, stop) runs of this slice that take weight decay.
        """
        xp, c, k = self.xp, self.cfg, master.size
        tmp = self._tmp[:k]
        f32 = xp.float32
        # m = b1*m + (1-b1)*g ; v = b2*v + (1-b2)*g*g
        m *= f32(c.beta1)
        xp.multiply(g, f32(1.0 - c.beta1), out=tmp)
        m += tmp
        v *= f32(c.beta2)
        xp.multiply(g, g, out=tmp)
        tmp *= f32(1.0 - c.beta2)
        v += tmp
        # decoupled weight decay first: p -= lr*wd*p on the decayed runs
        if c.weight_decay:
            shrink = f32(1.0 - lr * c.weight_decay)
            for a, b in decay_segments:
                master[a:b] *= shrink
        # p -= (lr/bc1) * m / (sqrt(v/bc2) + eps)
        xp.multiply(v, f32(1.0 / self._bc2), out=tmp)
        xp.sqrt(tmp, out=tmp)
        tmp += f32(c.eps)
        xp.divide(m, tmp, out=tmp)
        tmp *= f32(lr / self._bc1)
        master -= tmp

    def update_tile(self, master, m, v, grads, coef, lr: float, runs=((0, None, True),), params=None,
                    fused: bool | None = None):
        """``update`` fused with its neighbours, on one tile of host arrays:

            g = float32(grads) * coef;  AdamW(master, m, v, g);  params = cast(master)

        grads: the storage-dtype gradient (fp32, fp16, bf16) of the tile; runs:
        (start, stop, decayed) runs covering the tile (stop None: its end); params: the
        storage-dtype output, or None. fused: the C pass (None: when it was built)."""
        c, f32 = self.cfg, np.float32
        if fused is None:
            fused = _c is not None
        if fused and _c is None:
            raise RuntimeError("update_tile(fused=True): ringzero.runtime._adam was not built")
        if not fused:
            return self._tile_numpy(master, m, v, grads, coef, lr, runs, params)
        gk, pk = _kind(grads.dtype), 3 if params is None else _kind(params.dtype)
        consts = [float(f32(x)) for x in (coef, c.beta1, 1.0 - c.beta1, c.beta2, 1.0 - c.beta2,
                                          1.0 - lr * c.weight_decay, 1.0 / self._bc2, c.eps, lr / self._bc1)]
        for a, b, decayed in runs:
            b = master.size if b is None else b
            _c.adamw(master[a:b], m[a:b], v[a:b], grads[a:b], None if params is None else params[a:b],
                     gk, pk, *consts, bool(decayed and c.weight_decay))

    def _tile_numpy(self, master, m, v, grads, coef, lr, runs, params):
        k = master.size
        if not hasattr(self, "_g") or self._g.size < k:
            self._g = np.empty(max(k, self._tmp.size), np.float32)   # once: the widened gradient
        g = self._g[:k]
        cast_into(g, grads)
        g *= np.float32(coef)
        self.update(master, m, v, g, lr, [(a, k if b is None else b) for a, b, d in runs if d])
        if params is not None:
            cast_into(params, master)


def _kind(dtype) -> int:
    """adam.c's dtype code: 0 float32, 1 float16, 2 bfloat16."""
    dt = np.dtype(dtype)
    if dt == np.float32:
        return 0
    if dt == np.float16:
        return 1
    if dt.name == "bfloat16":
        return 2
    raise TypeError(f"update_tile: expected float32, float16 or bfloat16 arrays, got {dt}")


class LossScaler:
    """Dynamic loss scaling with growth window, hysteresis and a floor.

    ``update(found_inf)`` returns True if the step must be skipped. A static
    scaler (``dynamic=False``) keeps its scale and still skips non-finite steps.
    """

    def __init__(self, init: float = 2.0 ** 16, growth_factor: float = 2.0, backoff: float = 0.5,
                 growth_interval: int = 1000, hysteresis: int = 2, min_scale: float = 1.0,
                 dynamic: bool = True):
        if init <= 0 or min_scale <= 0:
            raise ValueError(f"loss scale must be > 0, got init={init}, min_scale={min_scale}")
        self.scale = float(init)
        self.growth_factor, self.backoff = growth_factor, backoff
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self.min_scale, self.dynamic = float(min_scale), dynamic
        self._good = 0                  # clean steps since the last change
        self._hyst = hysteresis         # overflows still tolerated before backing off
        self.overflows = 0

    def update(self, found_inf: bool) -> bool:
        if found_inf:
            self.overflows += 1
            self._good = 0
            if self.dynamic:
                if self._hyst <= 1:
                    self.scale = max(self.scale * self.backoff, self.min_scale)
                else:
                    self._hyst -= 1
            return True
        if self.dynamic:
            self._good += 1
            if self._good >= self.growth_interval:
                self.scale *= self.growth_factor
                self._good = 0
                self._hyst = self.hysteresis
        return False

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good": self._good, "hyst": self._hyst, "overflows": self.overflows}

    def load_state_dict(self, d: dict):
        self.scale, self._good, self._hyst = float(d["scale"]), int(d["good"]), int(d["hyst"])
        self.overflows = int(d.get("overflows", 0))


def clip_coef(norm: float, max_norm: float) -> float:
    """Global-norm clipping factor (1.0 when within bounds or disabled)."""
    if max_norm <= 0 or not math.isfinite(norm) or norm <= max_norm:
        return 1.0
    return max_norm / (norm + 1e-6)
