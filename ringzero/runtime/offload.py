"""The disk tier: which state classes live in files, and the files themselves.

What it is
    ``OffloadPolicy`` (a frozen record, as FSDP2's ``CPUOffloadPolicy``) says
    which classes of model state leave RAM and where they go::

        OffloadPolicy.parse("optimizer", "/scratch")          master, adam_m, adam_v in files
        OffloadPolicy.parse("optimizer,params", "/scratch")   stage 3/hybrid: the params shard too

    ``FileStore(dir, name, dtype, numel)`` is one class's flat buffer of one
    rank, in a file: the same elements at the same offsets as the RAM buffer
    it replaces. Slicing it (``store[a:b]``) gives a ``FileView``, so the
    layout table's arithmetic (``Layout.piece``, ``unit_shard``, ``own``) cuts
    a file into the same pieces it cuts an array into: an offloaded class
    keeps its pieces, on another tier. ``read_into`` / ``write_from`` move a
    piece between either tier and a host array; nothing else touches a file.

    The files: one per class per rank, created with O_TMPFILE in DIR (or
    created and unlinked at once where the filesystem lacks it), so they take
    space on DIR's filesystem while the run holds them open and the kernel
    frees them when the process ends, however it ends: a crashed run leaves
    no state behind, and the checkpoints (a separate folder) are never
    written through them. Their blocks are reserved up front (posix_fallocate),
    so a full disk is found at start-up, not in the middle of an update.

    ``check_dir`` and ``check_space`` are the start-up refusals (one line each):
    a missing or read-only DIR, a filesystem with less free space than the
    node's ranks will reserve; a file whose blocks cannot be reserved after all is
    a third. The test hooks: ``fault`` (RINGZERO_FAULT_OFFLOAD) and RINGZERO_OFFLOAD_FREE
    (the free bytes check_space sees).

    A device run (``device="cuda"``) may leave out DIR: the offloaded classes are then host
    arrays, pinned up to ``pin_limit`` (host_tier.py); ``where`` says which tier they are on.

What it is not
    No schedule: the update's tiles and threads are stream.py's; which
    buffers a stage holds is state.py's. The update's aligned O_DIRECT requests
    are aio.py's; reads and writes here (checkpoints, gathers) go through the page cache.
"""
from __future__ import annotations

import errno
import os
import threading
import weakref
from dataclasses import dataclass

import numpy as np

from ringzero.runtime.host_tier import DEFAULT_PIN_LIMIT
from ringzero.runtime.limits import existing_above, memory_fs  # noqa: F401  (memory_fs: offload's name too)

OPTIMIZER = ("master", "adam_m", "adam_v")     # the engine buffers "optimizer" moves
FAULT_ENV = "RINGZERO_FAULT_OFFLOAD"            # tests: see fault()


class OffloadError(ValueError):
    """The disk tier cannot be used or failed: a bad DIR, a full disk, an I/O error mid-update."""


class OffloadFailed(OffloadError):
    """The tier failed in use (an update, or the params cast at start or resume), agreed by every rank:
    the state in the files is lost (exit 4), unlike a start-up refusal (a bad DIR: exit 2)."""


@dataclass(frozen=True)
class OffloadPolicy:
    """Which state classes live in files under ``dir``, and how the update streams them."""
    optimizer: bool = False     # fp32 master, Adam m and v in files
    params: bool = False        # the storage-dtype params shard in a file too (params sharded: 3, hybrid)
    dir: str = ""               # the folder the files are made in
    tile: int = 1 << 18         # elements per tile of the update's stream (1 MiB of fp32 per class)
    buffers: int = 4            # tile slots: buffers - 2 tiles read ahead, one updated, one written
    io_threads: int = 8         # requests in the kernel at once per rank (aio.IOEngine's pool)
    direct: bool = True         # O_DIRECT where the filesystem takes it (aio.py), else the page cache
    drop_cache: bool = True     # posix_fadvise(DONTNEED) behind the stream: the page cache stays small
    ahead: bool = False         # params sharded: the update runs beside the next forward, unit by unit
    delay: int | None = None    # DPU (delay.py): after this many exact steps, step t's update beside step t+1
    device: str = "cpu"         # the engine's: on "cuda" without dir, the classes live in host memory
    pin_limit: int = DEFAULT_PIN_LIMIT   # "cuda": host bytes pinned per rank at most, past it pageable

    def __post_init__(self):
        if self.params and not self.optimizer:
            raise OffloadError("offload params needs optimizer too (the update that writes the params "
                               "reads master from the same tier): use --offload optimizer,params")
        if self.enabled and not self.dir and self.device == "cpu":
            raise OffloadError("offload needs a folder for its files: give --offload-dir DIR")
        if self.pin_limit < 0:
            raise OffloadError(f"offload pin_limit must be >= 0 bytes, got {self.pin_limit}")
        if self.io_threads < 1:
            raise OffloadError(f"offload io_threads must be >= 1, got {self.io_threads}")
        if self.delay is not None and (isinstance(self.delay, bool) or int(self.delay) != self.delay
                                       or self.delay < 0):
            raise OffloadError(f"--offload-delay takes the exact warm-up steps, an integer >= 0, got {self.delay!r}")
        if self.tile < 1024 or self.buffers < 3:
            raise OffloadError(f"offload tile must be >= 1024 elements and buffers >= 3, got tile "
                               f"{self.tile}, buffers {self.buffers}")

    @classmethod
    def parse(cls, spec: str, dir: str = "", **kw) -> "OffloadPolicy":
        """"" / "none" (RAM only), "optimizer", "optimizer,params" (any order)."""
        words = [w.strip() for w in (spec or "").split(",") if w.strip()]
        if words in ([], ["none"]):
            return cls(dir=dir, **kw)
        bad = [w for w in words if w not in ("optimizer", "params")]
        if bad or len(set(words)) != len(words):
            raise OffloadError(f"--offload takes optimizer or optimizer,params, got {spec!r}")
        return cls(optimizer="optimizer" in words, params="params" in words, dir=dir, **kw)

    @property
    def enabled(self) -> bool:
        return self.optimizer

    @property
    def buffers_offloaded(self) -> tuple:
        """The engine buffers this policy moves off their tier (to files, or to the host of a device run)."""
        return (OPTIMIZER if self.optimizer else ()) + (("params",) if self.params else ())

    @property
    def buffers_on_disk(self) -> tuple:
        """The engine buffers this policy keeps in files."""
        return self.buffers_offloaded if self.dir else ()

    def on_disk(self, buffer: str) -> bool:
        return buffer in self.buffers_on_disk

    def in_host_memory(self, buffer: str) -> bool:
        """A device run without --offload-dir: the class is a host array (host_tier.py)."""
        return not self.dir and self.device != "cpu" and buffer in self.buffers_offloaded

    @property
    def where(self) -> str:
        """The tier the offloaded classes are on: "disk" (files under dir) or "ram" (host memory)."""
        return "disk" if self.dir else "ram"

    @property
    def tiers(self) -> tuple:
        """The --offload words in effect, budget.py's terms: (), ("optimizer",) or ("optimizer", "params")."""
        return tuple(w for w, on in (("optimizer", self.optimizer), ("params", self.params)) if on)

    def describe(self) -> str:
        return "+".join(self.tiers) or "none"

    def check(self, stage_policy, device: str = "cpu"):
        """Refuse what the stage or device cannot offload, in one line."""
        if not self.enabled:
            return
        if device == "cpu" and not self.dir:
            raise OffloadError("offload needs a folder for its files: give --offload-dir DIR")
        if device != "cpu" and self.params:
            raise OffloadError(f"--offload params runs on --device cpu only (on --device {device} the params "
                               "stay on the device, sharded at stage 3): use --offload optimizer")
        if device != "cpu" and self.ahead:
            raise OffloadError(f"--offload-ahead runs on --device cpu only, got --device {device}: drop it")
        if self.delay is not None:      # what the delayed update (delay.py) does not run beside
            for hit, why in ((device != "cpu", f"runs on --device cpu only, got --device {device}: drop it"),
                             (self.params, "with --offload optimizer,params: the next forward would read the "
                                           "params file the delayed update writes; use --offload optimizer"),
                             (self.ahead, "and --offload-ahead both run the update beside the next forward "
                                          "(delayed: one step stale; ahead: exact): give one of them")):
                if hit:
                    raise OffloadError(f"--offload-delay {why}")
        if self.ahead and stage_policy.full_params:
            raise OffloadError(f"offload ahead needs the params sharded (stage 3 or hybrid), got stage "
                               f"{stage_policy.stage}: the stages 1-2 all-gather every updated piece first")
        if self.params and stage_policy.full_params:
            raise OffloadError(f"--offload params needs the params sharded (stage 3 or hybrid); stage "
                               f"{stage_policy.stage} holds them in full: use --offload optimizer, or --stage 3")


def check_dir(path: str, may_make: bool = False):
    """A missing, non-folder or unwritable DIR, in one line (probed by creating a file: permission
    bits alone do not tell a read-only filesystem, nor stop root). may_make: a missing DIR passes
    when its nearest existing folder above can take it (the trainer makes it: ``make_dir``)."""
    if not path:
        raise OffloadError("--offload-dir is empty")
    if not os.path.exists(path) and may_make:
        up = existing_above(path)
        if not os.path.isdir(up) or not os.access(up, os.W_OK | os.X_OK):
            raise OffloadError(f"--offload-dir {path!r} does not exist and cannot be made: {up!r} is "
                               f"{'not a folder' if not os.path.isdir(up) else 'not writable'}")
        return
    if not os.path.exists(path):
        raise OffloadError(f"--offload-dir {path!r} does not exist; HINT: mkdir -p it on every node")
    if not os.path.isdir(path):
        raise OffloadError(f"--offload-dir {path!r} is not a folder")
    try:
        fd = _open_tmp(path)
    except OSError as e:
        raise OffloadError(f"--offload-dir {path!r} is not writable: {e.strerror or e}") from None
    os.close(fd)


def make_dir(path: str) -> bool:
    """mkdir -p DIR (as DeepSpeed makes its swap folder), then check_dir; True if it was made here.
    On every rank: each node makes its own (a race between a node's ranks is harmless)."""
    made = not os.path.exists(path)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise OffloadError(f"--offload-dir {path!r} cannot be made: {e.strerror or e}") from None
    check_dir(path)
    return made


def check_space(path: str, need: int, ranks: int = 1):
    """Refuse a filesystem with less free space than ``need`` bytes (the ``ranks`` of this node together)."""
    st = os.statvfs(path)
    free = int(st.f_bavail) * int(st.f_frsize)
    free = int(os.environ.get("RINGZERO_OFFLOAD_FREE", free))     # tests: a small disk, without one
    if need > free:
        raise OffloadError(f"--offload-dir {path!r}: the offloaded state needs {need / 2**20:,.1f} MiB "
                           f"({ranks} rank{'s' if ranks > 1 else ''} on this node), its filesystem has "
                           f"{free / 2**20:,.1f} MiB free; HINT: a larger disk, more nodes, or --offload optimizer")


def check_offload(engine, off: OffloadPolicy, device: str):
    """Refuse, on every rank alike and before any file is made, a stage or device that cannot
    offload, a missing or read-only DIR, or a filesystem with less free space than this node's
    ranks will reserve. Collective over the engine's control ring."""
    from ringzero.comm.objects import allgather_obj
    L, P, topo = engine.layout, engine.policy, engine.topology
    err = None
    try:
        off.check(P, device)
        if off.dir:                     # a device run without DIR: the host tier, no files
            check_dir(off.dir)
            item = {"params": np.dtype(engine.storage_dtype).itemsize}
            per_rank = sum((L.padded if P.is_full(b) else L.shard_numel) * item.get(b, 4) for b in off.buffers_on_disk)
            here = topo.nodes.node_of.count(topo.nodes.node_of[engine.comm.rank])
            check_space(off.dir, per_rank * here, here)
    except OffloadError as e:
        err = str(e)
    first = next((e for e in allgather_obj(topo.control, err) if e), None)
    if first:
        raise OffloadError(first)


def fault(rank: int) -> tuple:
    """``RINGZERO_FAULT_OFFLOAD=MODE[@WHERE][:RANK]`` (tests), on world rank RANK or every rank:
    (mode, where), or (None, None). MODE strikes at the second tile of a stream: ``enospc`` its write
    fails with ENOSPC, ``crash`` the process ends there (os._exit); ``short`` its read comes back short
    (the file is truncated under it), ``value`` / ``error`` its compute raises ValueError /
    RuntimeError. WHERE: ``update`` (the default), ``cast`` (the params cast at start) or ``resume``
    (any later cast: the one after a checkpoint is loaded)."""
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return None, None
    what, _, who = spec.partition(":")
    mode, _, where = what.partition("@")
    if mode not in FAULT_MODES or (where or "update") not in ("update", "cast", "resume"):
        raise OffloadError(f"{FAULT_ENV}={spec!r}: expected MODE[@update|cast|resume][:RANK], MODE one of "
                           f"{', '.join(FAULT_MODES)}")
    return (mode, where or "update") if not who or int(who) == rank else (None, None)


FAULT_MODES = ("enospc", "crash", "short", "value", "error")


def _open_tmp(path: str) -> int:
    """An anonymous read-write file on ``path``'s filesystem: O_TMPFILE, else create + unlink."""
    try:
        return os.open(path, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except (AttributeError, OSError) as e:
        if isinstance(e, OSError) and e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
    for k in range(100):
        name = os.path.join(path, f".ringzero-offload-{os.getpid()}-{threading.get_ident()}-{k}")
        try:
            fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            continue
        os.unlink(name)
        return fd
    raise OSError(errno.EEXIST, "no free temporary name", path)


class FileStore:
    """One class's flat buffer of one rank, in a file: ``numel`` elements of ``dtype``.

    Array-like where the layout needs it (``dtype``, ``size``, ``nbytes``, slicing);
    ``bytes_read`` / ``bytes_written`` count every byte that crossed (the reports read them).
    """

    def __init__(self, dir: str, name: str, dtype, numel: int):
        self.name, self.dtype, self.size = name, np.dtype(dtype), int(numel)
        self.nbytes = self.size * self.dtype.itemsize
        try:
            self.fd = _open_tmp(dir)
        except OSError as e:
            raise OffloadError(f"--offload-dir {dir!r}: cannot make the file of {name}: {e.strerror or e}") from None
        try:
            if self.nbytes:
                try:
                    os.posix_fallocate(self.fd, 0, self.nbytes)    # reserve the blocks now (reads as zeros)
                except OSError as e:
                    if e.errno != errno.EOPNOTSUPP:
                        raise
                    os.ftruncate(self.fd, self.nbytes)
        except OSError as e:                  # another tenant took the space since check_space
            os.close(self.fd)
            raise OffloadError(f"--offload-dir {dir!r}: cannot reserve {self.nbytes / 2**20:,.1f} MiB for {name}: "
                               f"{e.strerror or e}") from None
        self.bytes_read = self.bytes_written = 0
        self._lock = threading.Lock()
        self._closer = weakref.finalize(self, os.close, self.fd)     # an engine dropped unclosed: freed at GC

    @property
    def disk_bytes(self) -> int:
        """Bytes the file takes on its filesystem (st_blocks), as the kernel reports them."""
        return int(os.fstat(self.fd).st_blocks) * 512

    def __getitem__(self, sl):
        return FileView(self, 0, self.size)[sl]

    def read(self, start: int, out: np.ndarray):
        """out[:] = elements [start, start + out.size) (out: C-contiguous, of this dtype)."""
        mv = memoryview(out.view(np.uint8)).cast("B")
        off, n = start * self.dtype.itemsize, 0
        while n < mv.nbytes:
            got = os.preadv(self.fd, [mv[n:]], off + n)
            if not got:
                raise OffloadError(f"offload file of {self.name}: short read at byte {off + n} of {self.nbytes}")
            n += got
        self.count(read=n)

    def count(self, read: int = 0, written: int = 0):
        """Add to the byte counters (thread-safe: the I/O engine's threads call it too)."""
        with self._lock:
            self.bytes_read += read
            self.bytes_written += written

    def write(self, start: int, src: np.ndarray):
        """Elements [start, start + src.size) = src."""
        mv = memoryview(np.ascontiguousarray(src).view(np.uint8)).cast("B")
        off, n = start * self.dtype.itemsize, 0
        while n < mv.nbytes:
            n += os.pwritev(self.fd, [mv[n:]], off + n)
        self.count(written=n)

    def drop(self, start: int, count: int):
        """Let the kernel drop these elements' pages from the page cache (clean ones at once)."""
        item = self.dtype.itemsize
        os.posix_fadvise(self.fd, start * item, count * item, os.POSIX_FADV_DONTNEED)

    def flush(self):
        """Write every dirty page to the disk (fdatasync), then drop the file's pages from the page cache."""
        os.fdatasync(self.fd)
        self.drop(0, self.size)

    def close(self):
        """Close the file: the kernel frees its blocks (it has no name)."""
        self._closer()
        self.fd = -1


class FileView:
    """Elements [start, start + size) of a FileStore: what slicing a file-tier buffer gives."""

    def __init__(self, store: FileStore, start: int, size: int):
        self.store, self.start, self.size = store, start, size
        self.dtype = store.dtype

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __getitem__(self, sl):
        if not isinstance(sl, slice) or sl.step not in (None, 1):
            raise TypeError(f"a file-tier buffer takes contiguous slices only, got {sl!r}")
        a, b, _ = sl.indices(self.size)
        return FileView(self.store, self.start + a, max(0, b - a))

    def read(self, out: np.ndarray | None = None) -> np.ndarray:
        out = np.empty(self.size, self.dtype) if out is None else out
        if out.size != self.size or out.dtype != self.dtype:
            raise ValueError(f"read of {self.store.name}: expected out of {self.size} {self.dtype}, "
                             f"got {out.size} {out.dtype}")
        self.store.read(self.start, out)
        return out

    def write(self, src: np.ndarray):
        if src.size != self.size or src.dtype != self.dtype:
            raise ValueError(f"write of {self.store.name}: expected {self.size} {self.dtype}, "
                             f"got {src.size} {src.dtype}")
        self.store.write(self.start, src)


def drop_pages(fd: int):
    """Let the kernel drop a whole file's clean pages from the page cache (after its fsync: all of them)."""
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def on_disk(x) -> bool:
    return isinstance(x, (FileView, FileStore))


def read_into(x, out):
    """out[...] = x, from a RAM (or device) view or a file view; returns out."""
    if isinstance(x, FileStore):
        x = x[:]
    if isinstance(x, FileView):
        return x.read(out)
    out[...] = x
    return out


def write_from(x, src):
    """x[...] = src, into a RAM view or a file view."""
    if isinstance(x, FileStore):
        x = x[:]
    if isinstance(x, FileView):
        x.write(src)
    else:
        x[...] = src
