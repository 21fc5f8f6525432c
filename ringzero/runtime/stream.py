"""The offloaded update: a rank's pieces streamed from their files, in tiles, through a few buffers.

What it is
    ``TileStream(state, policy)`` owns a fixed pool of ``policy.buffers`` host
    slots (each a tile of master, m and v in fp32, and of params where they are
    offloaded; page-aligned, aio.AlignedBuffer), a reader and a writer thread,
    and the I/O engine (aio.IOEngine: O_DIRECT where the filesystem takes it,
    ``policy.io_threads`` requests in flight). ``run(tiles, compute)``
    pipelines a list of tiles through them::

        tile        i-1            i              i+1 .. i+depth
        writer      write back     .              .
        caller      .              compute        .
        reader      .              .              read (every class at once)

    tiles i+1 .. i+depth (depth = buffers - 2) are read while tile i is computed
    and tile i-1 written; each tile's classes are requests of their own, in
    flight together on the engine's threads; slot j is read into again only
    once the write of the tile that last held it has returned. Behind the stream, posix_fadvise(DONTNEED)
    drops the pages a tile read, starts the write-back of those a tile wrote,
    and asks again for the tile written two before (whose write-back has had
    a tile's time to finish); a sweep over the written files at the end drops
    what finished later, so the page cache does not grow to the files' size.

    ``Tile(u, r, lo, hi, runs)``: elements [lo, hi) of piece (u, r), and the
    (start, stop, decayed) runs of the tile that take weight decay or not.
    ``tiles(state, decay, tile)`` cuts every piece this rank updates.

    ``update(engine, coef, lr)`` is the engine's update with offload: per tile,
    AdamW.update_tile (optim.py: the fused C pass, or its NumPy twin) reads the
    gradient from RAM, updates master, m and v in the slot, and writes the new
    params, cast, into the params piece (RAM) or the slot (file). Because AdamW
    is elementwise, the tiles and the fusion change where each element is
    computed, never its bits (tests/test_offload.py). ``cast_params(state)`` is
    the same stream for params = cast(master) alone (start, resume).
    On a device run (``engine.device_link``, host_tier.py) the gradient tile
    comes device->host into a pinned slot and the params tile goes back, on
    a CuPy stream each, beside the host's AdamW of the tile between.
    ``UpdateAhead`` runs ``update`` on a thread of its own, beside the next
    step's forward, which waits for each unit where it gathers it (offload
    ``ahead``, stage 3 and hybrid).

    Errors: the first OSError of a thread is raised by ``run`` in the caller,
    after every started read and write has returned (no thread writes into a
    slot later); ``agree`` turns it into one OffloadError on every rank.

What it is not
    The files (offload.py), the requests (aio.py) or what the update computes
    (optim.py). Not io_uring: preadv/pwritev on a pool of threads release the GIL.
"""
from __future__ import annotations

import errno
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from ringzero.comm.trace import RECORDER
from ringzero.runtime.aio import PAGE, AlignedBuffer, IOEngine
from ringzero.runtime.offload import FAULT_ENV, OPTIMIZER, FileView, OffloadFailed, fault, on_disk


class Tile(NamedTuple):
    u: int          # unit
    r: int          # piece index (the rank it belongs to)
    lo: int         # piece-relative elements [lo, hi)
    hi: int
    runs: tuple     # ((start, stop, decayed), ...) tile-relative, covering [0, hi - lo)


def tiles(state, decay: dict, tile: int) -> list:
    """Every piece this rank updates (held_ranks of master, r outer as the RAM update), cut in tiles."""
    L, out = state.layout, []
    for r in state.held_ranks("master"):
        for u in range(len(L.units)):
            runs = decay[(u, r)]
            for lo in range(0, L.piece_numel[u], tile):
                hi = min(lo + tile, L.piece_numel[u])
                cuts = sorted({0, hi - lo} | {min(max(x - lo, 0), hi - lo) for a, b in runs for x in (a, b)})
                out.append(Tile(u, r, lo, hi, tuple(
                    (a, b, any(ra <= a + lo and b + lo <= rb for ra, rb in runs)) for a, b in zip(cuts, cuts[1:])
                    if b > a)))
    return out


class TileStream:
    """A pool of tile slots and a reader and a writer thread (module docstring)."""

    def __init__(self, state, policy):
        self.state, self.policy = state, policy
        n = self.tile = min(policy.tile, max(state.layout.piece_numel))   # no slot larger than a piece
        # each slot: a page-aligned buffer per class (aio.AlignedBuffer), and the tile's views into it,
        # bound per tile at the tile's file offset mod 4096 (so its whole pages go O_DIRECT)
        self.bufs = [{name: AlignedBuffer(n * state.dtypes[name].itemsize) for name in state.files}
                     for _ in range(policy.buffers)]
        self.slots = [{name: b.view(0, state.dtypes[name], n) for name, b in bufs.items()} for bufs in self.bufs]
        self.io = IOEngine(policy.io_threads, direct=policy.direct)
        self._rd = ThreadPoolExecutor(1, thread_name_prefix="rz-offload-read")      # tiles in order,
        self._wr = ThreadPoolExecutor(1, thread_name_prefix="rz-offload-write")     # classes on self.io
        # tests: RINGZERO_FAULT_OFFLOAD's mode and the stream it strikes ("update", "cast", "resume")
        self.fault, self.fault_at = fault(int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0"))))
        self.fault_at = self.fault_at or "update"
        self.casts = 0                                     # params casts run (the first at start)
        # seconds: read_s / write_s on the I/O threads (a tile's requests, all classes at once); on the
        # caller's, the arithmetic (compute_s) and what it waited for: a tile's read (read_wait_s), a slot
        # whose write had not returned (slot_wait_s), the last writes and the sweep (drain_s); exposed_s is
        # those three together. read_bytes / write_bytes: what the stream moved (the engine's rate: / read_s)
        self.timeline = dict.fromkeys(("read_s", "write_s", "exposed_s", "compute_s", "read_wait_s",
                                       "slot_wait_s", "drain_s", "read_bytes", "write_bytes"), 0.0)

    @property
    def depth(self) -> int:
        """Tiles read ahead of the one computed (the slots less the one computed and the one written)."""
        return len(self.slots) - 2

    def nbytes(self) -> int:
        return sum(b.size for bufs in self.bufs for b in bufs.values())

    def _views(self, t: Tile, names):
        return [(name, self.state.piece(name, t.u, t.r)[t.lo:t.hi]) for name in names]

    def _bind(self, t: Tile, j: int, names):
        """Slot j's views for tile t: each class at its file offset mod 4096 in its buffer."""
        slot, n = self.slots[j], t.hi - t.lo
        for name, view in self._views(t, names):
            slot[name] = self.bufs[j][name].view(view.start * view.dtype.itemsize % PAGE, view.dtype, n)

    def _read(self, t: Tile, j: int, names, strike=None):
        t0 = time.perf_counter()
        if strike == "short":                             # tests: the file ends before this tile
            store = self.state.files[names[0]]
            os.ftruncate(store.fd, self.state.piece(names[0], t.u, t.r).start * store.dtype.itemsize)
        views = self._views(t, names)
        reqs = [self.io.submit(self.io.read, v.store, v.start, v.size, self.bufs[j][name])
                for name, v in views]                     # every class's request in flight at once
        _results(reqs)
        for name, view in views:
            if self.policy.drop_cache:
                view.store.drop(view.start, view.size)     # pages the cached path read: dropped at once
        self.timeline["read_bytes"] += sum(v.nbytes for _, v in views)
        self.timeline["read_s"] += time.perf_counter() - t0
        if RECORDER.active:                               # --trace: the read on the reader thread, its bytes
            RECORDER.span(f"read u{t.u} r{t.r}", "offload_read", t0, time.perf_counter(),
                          nbytes=sum(v.nbytes for _, v in views))

    def _write(self, t: Tile, slot, names, strike, behind, written=None):
        t0 = time.perf_counter()
        if strike == "crash":                             # tests: the process dies mid-stream
            os._exit(86)
        if strike == "enospc":                            # tests: the disk fills mid-stream
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"offload file ({self.policy.dir})")
        views = self._views(t, names)
        _results([self.io.submit(self.io.write, v.store, v.start, slot[name][:v.size]) for name, v in views])
        for name, view in views:
            if self.policy.drop_cache:
                view.store.drop(view.start, view.size)     # starts the write-back of the cached pages
        if self.policy.drop_cache and behind is not None:  # two tiles back: written back by now, dropped
            for name, view in self._views(behind, names):
                view.store.drop(view.start, view.size)
        self.timeline["write_bytes"] += sum(v.nbytes for _, v in views)
        self.timeline["write_s"] += time.perf_counter() - t0
        if RECORDER.active:
            RECORDER.span(f"write u{t.u} r{t.r}", "offload_write", t0, time.perf_counter(),
                          nbytes=sum(v.nbytes for _, v in views))
        if written is not None:
            written(t)

    def run(self, tiles: list, compute, reads=OPTIMIZER, writes=None, armed: str | None = None, written=None):
        """compute(tile, slot) on every tile, its ``reads`` classes read before and ``writes`` (default:
        the offloaded ones it reads, and params when they are offloaded) written after.
        armed: which stream this is ("update", "cast", "resume"), where RINGZERO_FAULT_OFFLOAD strikes
        (tests: at the second tile). written(tile): called (on the writer thread) once a tile's writes
        have returned."""
        writes = tuple(w for w in (writes if writes is not None else reads + ("params",)) if w in self.state.files)
        reads = tuple(r for r in reads if r in self.state.files)
        nb, pending_r, pending_w = len(self.slots), {}, {}
        mode = self.fault if armed is not None and armed == self.fault_at else None

        def strike(i, modes):
            return mode if i == 1 and mode in modes else None

        def start_read(i):
            if i - nb in pending_w:                        # slot i % nb: the write of its last tile returned
                t0 = time.perf_counter()
                pending_w.pop(i - nb).result()
                self._waited("slot_wait_s", time.perf_counter() - t0)   # the disk's writes hold the update here
            self._bind(tiles[i], i % nb, set(reads) | set(writes))
            pending_r[i] = self._rd.submit(self._read, tiles[i], i % nb, reads, strike(i, ("short",)))
        try:
            for i in range(min(self.depth, len(tiles))):      # read ahead: as deep as the slots allow
                start_read(i)
            for i, t in enumerate(tiles):
                if i + self.depth < len(tiles):
                    start_read(i + self.depth)
                t0 = time.perf_counter()
                pending_r.pop(i).result()
                t1 = time.perf_counter()
                if strike(i, ("value", "error")):         # tests: the arithmetic raises
                    raise (ValueError if mode == "value" else RuntimeError)(f"injected by {FAULT_ENV}={mode}")
                compute(t, self.slots[i % nb])
                if RECORDER.active:                        # the read waited for, then the tile's arithmetic
                    RECORDER.span("tile wait", "offload_wait", t0, t1)
                    RECORDER.span(f"adam u{t.u} r{t.r} [{t.lo}:{t.hi}]", "update_piece", t1, time.perf_counter())
                self._waited("read_wait_s", t1 - t0)
                self.timeline["compute_s"] += time.perf_counter() - t1
                pending_w[i] = self._wr.submit(self._write, t, self.slots[i % nb], writes,
                                               strike(i, ("enospc", "crash")), tiles[i - 2] if i >= 2 else None,
                                               written)
            t0 = time.perf_counter()
            for i in sorted(pending_w):
                pending_w.pop(i).result()
            if self.policy.drop_cache:     # a sweep: the pages whose write-back ended after their tile's drop
                for name in writes:
                    self.state.files[name].drop(0, self.state.files[name].size)
            self._waited("drain_s", time.perf_counter() - t0)
        finally:                                           # an error: every thread done with the slots first
            for f in (*pending_r.values(), *pending_w.values()):
                f.exception()

    def _waited(self, key: str, dt: float):
        self.timeline[key] += dt
        self.timeline["exposed_s"] += dt

    def reset_timeline(self) -> dict:
        out, self.timeline = self.timeline, dict.fromkeys(self.timeline, 0.0)
        return out

    def close(self):
        self._rd.shutdown(wait=True)
        self._wr.shutdown(wait=True)
        self.io.close()


def _results(futures):
    """Wait for every request; then raise the first one's error (no request left writing a slot)."""
    for f in futures:
        f.exception()
    for f in futures:
        f.result()


def update(engine, coef, lr: float, unit_done=None, held=None):
    """AdamW on every piece this rank updates, master/m/v streamed from their files (module docstring).
    unit_done(u): called once every tile of unit u is written (its params final). held(u, r): the
    delayed update's piece (delay.py), its gradient read and its new params written in place of
    the grads' and params' pieces."""
    st, adam, stream = engine.state, engine.adam, engine.offload_stream
    left = {}
    for t in engine.offload_tiles:
        left[t.u] = left.get(t.u, 0) + 1

    def written(t: Tile):
        left[t.u] -= 1
        if not left[t.u] and unit_done is not None:
            unit_done(t.u)

    link = engine.device_link            # a device run: grads come over, params go back (host_tier.py)

    def compute(t: Tile, slot):
        n = t.hi - t.lo
        if link is not None:
            g, out = link.take(t)
        elif held is not None:              # delay.py: the tile's gradient, then its params
            g = out = held(t.u, t.r)[t.lo:t.hi]
        else:
            g = st.piece("grads", t.u, t.r)[t.lo:t.hi]
            p = st.piece("params", t.u, t.r)[t.lo:t.hi]
            out = slot["params"][:n] if isinstance(p, FileView) else p
        mvs = [slot[c][:n] if c in slot else st.piece(c, t.u, t.r)[t.lo:t.hi] for c in OPTIMIZER]
        adam.update_tile(*mvs, g, coef, lr, t.runs, out)
        if link is not None:
            link.give(t)
    before = {n: (f.bytes_read, f.bytes_written) for n, f in st.files.items()}
    if link is not None:
        link.begin(engine.offload_tiles)
    try:
        stream.run(engine.offload_tiles, compute, armed="update", written=written)
    finally:
        if link is not None:
            link.finish()
    # what the update itself moved (with ahead, the forward reads params from the same file meanwhile)
    engine.last_update_io = {n: (f.bytes_read - before[n][0], f.bytes_written - before[n][1])
                             for n, f in st.files.items()}


class UpdateAhead:
    """The offloaded update on a thread of its own, unit by unit, while the next step's forward runs.

    ``OffloadPolicy(ahead=True)``, params sharded (stage 3, hybrid: the forward gathers each
    unit's params, and every rank's piece of unit u is final once its own update of u is). The
    step ``start``s the update and returns; the next forward ``wait``s for unit u's last tile
    to be written before it gathers u (units are updated in the order the forward reads them),
    so its first units compute while later ones are still read, updated and written. ``drain``
    (after that backward, or before anything reads the whole state) waits for the rest; the
    ranks then agree on any error, one OffloadError on every rank. The arithmetic is the
    blocking update's, element for element: bitwise the same (tests/test_offload.py).
    """

    def __init__(self, units: int):
        self._ex = ThreadPoolExecutor(1, thread_name_prefix="rz-offload-update")
        self._done = [threading.Event() for _ in range(units)]
        self._future = None

    def __bool__(self) -> bool:
        return self._future is not None

    def start(self, engine, coef, lr: float):
        for e in self._done:
            e.clear()
        self._future = self._ex.submit(self._run, engine, coef, lr)

    def _run(self, engine, coef, lr):
        try:
            update(engine, coef, lr, lambda u: self._done[u].set())
        finally:                  # a failure: no wait hangs; the error is agreed at drain
            for e in self._done:
                e.set()

    def wait(self, units):
        for u in units:
            self._done[u].wait()

    def drain(self) -> str | None:
        """Wait for the whole update; its error as one line, or None."""
        f, self._future = self._future, None
        if f is None:
            return None
        e = f.exception()
        return None if e is None else error_text(e)

    def close(self):
        self._ex.shutdown(wait=True)


def cast_params(state, stream, tiles_, link=None):
    """params = cast(master) on every piece this rank owns, master read from its file or host array
    (publish's cast); a device run's params go to the device through ``link`` (host_tier.DeviceLink)."""
    from ringzero.runtime.state import cast_into

    def compute(t: Tile, slot):
        n = t.hi - t.lo
        m = slot["master"][:n] if "master" in slot else state.piece("master", t.u, t.r)[t.lo:t.hi]
        if link is not None:
            cast_into(link.take(t)[1], m)
            link.give(t)
            return
        p = state.piece("params", t.u, t.r)[t.lo:t.hi]
        cast_into(slot["params"][:n] if on_disk(p) else p, m)
    if link is not None:
        link.begin(tiles_, grads=False)
    try:
        armed, stream.casts = ("cast" if stream.casts == 0 else "resume"), stream.casts + 1
        stream.run(tiles_, compute, reads=("master",), writes=("params",), armed=armed)
    finally:
        if link is not None:
            link.finish()


def error_text(e: BaseException) -> str:
    """An exception as the one line the ranks agree on: an OSError's strerror, the
    tier's own OffloadError as written, anything else with its type (a ValueError, a bug)."""
    from ringzero.runtime.offload import OffloadError
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    if isinstance(e, OffloadError):
        return str(e)
    return f"{type(e).__name__}: {e}".replace("\n", " ")


def agree(engine, err: str | None, what: str = "", failed: bool = False):
    """One OffloadError on every rank if the update (or ``what``) failed on any (a small all-gather on
    the control ring). failed (and always for the update): an OffloadFailed, the tier's state lost,
    rather than a start-up refusal."""
    from ringzero.comm.objects import allgather_obj
    from ringzero.runtime.offload import OffloadError
    if err and not what:
        err = f"rank {engine.comm.rank}: the offloaded update failed: {err} ({engine.offload.dir})"
    elif err:
        err = f"rank {engine.comm.rank}: {what}: {err}"
    first = next((e for e in allgather_obj(engine.topology.control, err) if e), None)
    if first and not what:
        raise OffloadFailed(first + "; the offloaded state is lost: resume from the last checkpoint")
    if first:
        raise (OffloadFailed if failed else OffloadError)(first)
