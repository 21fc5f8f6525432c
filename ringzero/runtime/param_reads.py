"""Stage 3 with the params shard in a file: each gather's disk read done ahead, on an I/O thread.

What it is
    ``ParamReads(layout, state)``: where a gather (gather.py's ``start`` and ``materialize``)
    needs this rank's params piece of unit w from its file, ``take(w, own)`` copies it from a
    read that an I/O thread already did, or reads it now when none was started. Which unit is
    read next is the plan's, and the plan is static: the first pass of each kind (``begin``:
    "train" forward+backward, "forward" alone) records the order of its reads, and every later
    pass of that kind, as it takes read k, starts read k + 1 into a staging buffer (one piece,
    storage dtype) on the thread, so the disk part of the next gather runs beside this
    unit's compute::

        compute thread   take(w_k): copy staging -> own, start read k+1; all-gather w_k; compute
        I/O thread                                  read w_{k+1} from its file -> staging

    A pass's first read is always done where it is taken: the update runs between passes and
    rewrites the params, so no read is started across it. With the update running ahead
    (UpdateAhead), the thread first waits for unit w's update to be written (``final(w)``).
    A pass that takes another unit than the one recorded (a different plan) stops reading
    ahead for the rest of it (the started read is waited for and left unused).
    ``ahead`` / ``now``: reads taken from the thread / done on the caller (tests count them).

What it is not
    No gather (gather.py), no O_DIRECT (the params piece goes through the page cache, as every
    read outside the update's stream: offload.py), no plan (plan.py).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ringzero.runtime.offload import read_into


class ParamReads:
    """The params piece of the next unit read ahead, in the order the first pass of a kind read them."""

    def __init__(self, layout, state):
        self.layout, self.state = layout, state
        self._ex = ThreadPoolExecutor(1, thread_name_prefix="rz-offload-params")
        self._stage = np.empty(max(layout.piece_numel), state.params.dtype)
        self._orders = {}                 # kind -> [unit, ...] its first pass read
        self._kind, self._k, self._rec = None, 0, None
        self._pending = None              # (k, unit, future) of the read started ahead
        self.ahead = self.now = 0

    def begin(self, kind: str, final=None):
        """A pass of ``kind`` starts; final(w) (or None): wait until unit w's params are written."""
        self._settle()
        self._kind, self._k, self._final = kind, 0, final
        self._rec = None if kind in self._orders else self._orders.setdefault(kind, [])

    def take(self, w: int, own):
        """own[:] = this rank's params piece of unit w (from the read started ahead, or read now)."""
        src = self.layout.unit_shard(self.state.params, w)
        order = self._orders.get(self._kind)
        if self._rec is not None or order is None:           # recording (or no pass begun): read now
            if self._rec is not None:
                self._rec.append(w)
            self._read_now(src, own)
            return
        p, self._pending = self._pending, None
        if p is not None and p[:2] == (self._k, w):
            p[2].result()
            own[...] = self._stage[:own.size]
            self.ahead += 1
        else:
            if p is not None:                                  # not the unit recorded: stop reading ahead
                p[2].exception()
                self._kind = None
            self._read_now(src, own)
        if self._kind is None or self._k >= len(order) or order[self._k] != w:
            self._kind = None
            return
        self._k += 1
        if self._k < len(order):
            nxt = order[self._k]
            self._pending = (self._k, nxt, self._ex.submit(self._read_ahead, nxt))

    def nbytes(self) -> int:
        """The staging buffer (the memory report counts it with the offload buffers)."""
        return int(self._stage.nbytes)

    def _read_now(self, src, own):
        read_into(src, own)
        self.now += 1

    def _read_ahead(self, w: int):
        if self._final is not None:
            self._final(w)
        src = self.layout.unit_shard(self.state.params, w)
        read_into(src, self._stage[:src.size])

    def _settle(self):
        """Wait for a read started ahead and not taken (its error is the next read's to meet)."""
        p, self._pending = self._pending, None
        if p is not None:
            p[2].exception()

    def close(self):
        self._settle()
        self._ex.shutdown(wait=True)
