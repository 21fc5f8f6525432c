"""The host tier of a device run: offloaded state in (pinned) host memory, and the update's copies over the link.

What it is
    ZeRO-Offload's split on a GPU (DeepSpeed's ``offload_optimizer: {device: cpu, pin_memory: true}``,
    FSDP's ``CPUOffloadPolicy(pin_memory=True)``): with ``--device cuda --offload optimizer`` the fp32
    master, Adam m and v leave the device. Without ``--offload-dir`` they are host arrays here; with it
    they are offload.py's files. The storage-dtype params and grads stay on the device.

    ``PinnedArena(limit)`` hands out host arrays: page-locked (``cupy.cuda.alloc_pinned_memory``, so
    a copy to or from the device is a DMA that can run beside other work) while the bytes pinned stay
    within ``limit``, ordinary pageable memory past it. Pinned memory cannot be swapped or reclaimed:
    too much of it starves the host (DeepSpeed#4571's runs killed with -9), hence a bound per rank
    (``--offload-pin-limit``, default ``DEFAULT_PIN_LIMIT``). Only the transfer slots are pinned
    (DeviceLink's grads and params tiles, the only host memory a device copy reads or writes);
    master, m and v, which no device copy touches, are pageable host arrays whatever the bound
    (ZeRO-Offload pins them too; pinned host memory exhausting RAM is its most reported failure).

    ``DeviceLink(dtype, tile, buffers, arena).bind(state)``: the update's copies, per tile of a rank's pieces::

        tile        i-1              i                  i+1
        d2h         .                .                  grads -> pinned slot
        host        .                fused AdamW        .
        h2d         params -> device .                  .

    grads of tile i+1 are copied device->host on one CuPy stream while tile i is updated on the
    host (the fused AdamW of optim.py, the same pass as the CPU path), and the params of tile i-1
    go host->device on a second stream. A slot's params buffer is written again only once its
    last copy has completed (an event per slot). ``finish()`` makes the compute stream wait for
    the last copy, so whatever reads params next (a gather, the forward) reads the new ones.
    Every buffer is allocated once, at start-up.

What it is not
    No arithmetic (optim.py, csrc/adam.c), no files (offload.py), no tile schedule of its own: it
    rides the TileStream's (stream.py), whose reader/writer threads move the file tier's tiles.
    Not checked on a GPU yet: the CuPy stand-in (tests/cupy_standin/) holds it to CuPy's rules
    (streams, events, async copies from pinned memory), not to a device's speed.
"""
from __future__ import annotations

import numpy as np

DEFAULT_PIN_LIMIT = 2 << 30          # bytes pinned per rank at most (2 GiB): past it, pageable


def parse_pin_limit(text) -> int:
    """Bytes from '0' (pin nothing), '512MiB', '2GiB', '4G'...; ValueError with one line."""
    from ringzero.sizes import parse_size
    if str(text).strip() in ("0", "0B"):
        return 0
    try:
        return parse_size(text)
    except ValueError as e:
        raise ValueError(f"--offload-pin-limit: {e}") from None


class PinnedArena:
    """Host arrays, pinned up to ``limit`` bytes in all, pageable past it (module docstring)."""

    def __init__(self, limit: int):
        self.limit = int(limit)
        self.pinned = self.pageable = 0          # bytes handed out of each kind
        self.kinds = {}                          # name -> "pinned" | "pageable"

    def empty(self, n: int, dtype, name: str = "", pin: bool = True) -> np.ndarray:
        """pin=False: pageable whatever the room (state no device copy reads: master, m, v)."""
        dt = np.dtype(dtype)
        nbytes = int(n) * dt.itemsize
        mem = self._pin(nbytes) if pin and nbytes and self.pinned + nbytes <= self.limit else None
        if mem is not None:
            out = np.ndarray((int(n),), dt, buffer=mem)       # the array keeps the pinned block alive
            self.pinned += nbytes
            kind = "pinned"
        else:
            from ringzero.runtime.limits import zeros
            out = zeros(np, int(n), dt, name or "a host buffer")
            self.pageable += nbytes
            kind = "pageable"
        if name:
            self.kinds[name] = kind
        return out

    @staticmethod
    def _pin(nbytes: int):
        """A page-locked block, or None where the driver refuses one (the host's locked-memory limit
        reached: the array is then pageable, as past the bound)."""
        import cupy
        try:
            return cupy.cuda.alloc_pinned_memory(nbytes)
        except (MemoryError, RuntimeError):         # CuPy's OutOfMemoryError, CUDARuntimeError
            return None

    def zeros(self, n: int, dtype, name: str = "", pin: bool = True) -> np.ndarray:
        out = self.empty(n, dtype, name, pin)
        out[...] = 0
        return out


class DeviceLink:
    """The update's device<->host copies: pinned grads and params slots, a CuPy stream per direction."""

    @staticmethod
    def slot_elements(tile: int, largest_piece: int) -> int:
        """Elements of one slot: a tile, or the largest piece where pieces are smaller."""
        return min(int(tile), int(largest_piece))

    @staticmethod
    def nbytes_for(dtype, tile: int, buffers: int) -> int:
        """Host bytes of the slots a link of this shape allocates (grads and params, ``buffers`` each)."""
        return 2 * int(buffers) * int(tile) * np.dtype(dtype).itemsize

    def __init__(self, dtype, tile: int, buffers: int, arena: PinnedArena):
        import cupy
        self.cp, self.state = cupy, None          # the state: bind(), once it is allocated
        # made before the state, so the tile buffers are the first bytes pinned
        self.g = [arena.empty(tile, dtype, f"grads tile {j}") for j in range(buffers)]
        self.p = [arena.empty(tile, dtype, f"params tile {j}") for j in range(buffers)]
        self.d2h = cupy.cuda.Stream(non_blocking=True)
        self.h2d = cupy.cuda.Stream(non_blocking=True)
        self.got = [cupy.cuda.Event() for _ in range(buffers)]     # grads of the slot's tile on the host
        self.put = [None] * buffers                                 # the slot's last params copy (an Event)
        self.tiles, self.i = [], 0

    def bind(self, state):
        self.state = state
        return self

    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (*self.g, *self.p))

    def _piece(self, name, t):
        return self.state.piece(name, t.u, t.r)[t.lo:t.hi]

    def _fetch(self, i: int):
        """Start the copy of tile i's grads into slot i % buffers, on the d2h stream."""
        t, j = self.tiles[i], i % len(self.g)
        with self.d2h:
            self._piece("grads", t).get(stream=self.d2h, out=self.g[j][:t.hi - t.lo], blocking=False)
            self.got[j].record(self.d2h)

    def begin(self, tiles, grads: bool = True):
        """A pass over ``tiles`` starts: the d2h stream waits for the compute stream's work so far
        (the gradients' last reduction), then fetches tile 0's grads."""
        self.tiles, self.i, self.grads = tiles, 0, grads
        if grads and tiles:
            self.d2h.wait_event(self.cp.cuda.get_current_stream().record())
            self._fetch(0)

    def take(self, t):
        """(grads tile on the host or None, the params slot to write) for the next tile, ``t``;
        starts the fetch of the tile after it."""
        i, j, n = self.i, self.i % len(self.g), t.hi - t.lo
        if self.grads and i + 1 < len(self.tiles):
            self._fetch(i + 1)
        if self.put[j] is not None:              # the slot's last params copy has read it
            self.put[j].synchronize()
        if not self.grads:
            return None, self.p[j][:n]
        self.got[j].synchronize()
        return self.g[j][:n], self.p[j][:n]

    def give(self, t):
        """The params slot of tile ``t`` is final: copy it to the device on the h2d stream."""
        j, n = self.i % len(self.p), t.hi - t.lo
        with self.h2d:
            self._piece("params", t).set(self.p[j][:n], stream=self.h2d)
            self.put[j] = self.h2d.record()
        self.i += 1

    def finish(self):
        """The compute stream waits for the last params copy (work queued after this sees them)."""
        if self.tiles:
            self.cp.cuda.get_current_stream().wait_event(self.h2d.record())
        self.tiles = []
