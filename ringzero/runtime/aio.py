"""The offload tier's I/O engine: aligned O_DIRECT requests, several in flight, on a pool of threads.

What it is
    ``IOEngine(threads)`` moves a tile of one class between a FileStore (offload.py) and a
    page-aligned host buffer, bypassing the page cache where the filesystem takes O_DIRECT:

        direct(store)              the store's second descriptor, reopened with O_DIRECT through
                                   /proc/self/fd (its files have no name), probed once with an
                                   aligned read; None where refused (EINVAL: tmpfs on older kernels,
                                   some FUSE and network filesystems), and the page cache is used
        read(store, start, n, raw) elements [start, start + n) into ``raw`` (an ``AlignedBuffer``):
                                   one request over the 4096-byte pages that hold them, landing at
                                   raw's first page; returns the view of the n elements at their
                                   offset in that page (the file's byte offset mod 4096)
        write(store, start, view)  the same elements back from that view: the whole pages in the
                                   middle in one O_DIRECT request, the partial first and last page
                                   (shared with the neighbouring tile) through the page cache
        submit(fn, *args)          a request on the pool: os.preadv / os.pwritev release the GIL,
                                   so ``threads`` requests are in the kernel at once

    Bytes are counted as the store counts them (``bytes_read`` / ``bytes_written``: the elements
    asked for, not the padding of the pages around them). Linux keeps the two paths coherent: a
    direct request first writes back and drops the cached pages of its range, so a page written
    through the cache and then read directly reads what was written (tests/test_aio.py).

    ``AlignedBuffer(nbytes)``: anonymous mmap memory (page aligned), with a page of slack on either
    side of a tile so that any element offset can sit at its file offset mod 4096.

What it is not
    No schedule (which tiles, how far ahead: stream.py), no files (offload.py). Not io_uring or libaio:
    a pool of threads in preadv/pwritev keeps a few requests per rank in flight with nothing to install.
"""
from __future__ import annotations

import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

PAGE = 4096                 # O_DIRECT's alignment of offset, length and address (the logical block, at most)


class AlignedBuffer:
    """``nbytes`` of page-aligned anonymous memory, plus two pages of slack for a tile at any offset."""

    def __init__(self, nbytes: int):
        self.size = -(-(int(nbytes) + 2 * PAGE) // PAGE) * PAGE
        self._map = mmap.mmap(-1, self.size)
        self.raw = np.frombuffer(self._map, np.uint8)

    def view(self, shift: int, dtype, n: int) -> np.ndarray:
        """n elements of dtype starting ``shift`` bytes into the buffer."""
        dtype = np.dtype(dtype)
        return self.raw[shift:shift + n * dtype.itemsize].view(dtype)


def _up(x: int) -> int:
    return -(-x // PAGE) * PAGE


def _down(x: int) -> int:
    return x // PAGE * PAGE


class IOEngine:
    """A pool of I/O threads and each store's O_DIRECT descriptor (module docstring)."""

    def __init__(self, threads: int = 4, direct: bool = True):
        self.threads = int(threads)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="rz-offload-io")
        self._want_direct = direct
        self._direct = {}                     # id(store) -> fd or None
        self._lock = threading.Lock()

    def submit(self, fn, *args):
        return self._pool.submit(fn, *args)

    def direct(self, store):
        """The store's O_DIRECT descriptor, or None where the filesystem refuses it (or it is off)."""
        key = id(store)
        with self._lock:
            if key not in self._direct:
                self._direct[key] = self._open_direct(store) if self._want_direct else None
            return self._direct[key]

    @staticmethod
    def _open_direct(store):
        flag = getattr(os, "O_DIRECT", 0)
        if not flag or store.fd < 0:
            return None
        try:
            fd = os.open(f"/proc/self/fd/{store.fd}", os.O_RDWR | flag | os.O_CLOEXEC)
        except OSError:
            return None
        probe = AlignedBuffer(PAGE)
        try:                                  # some filesystems take the open and refuse the request
            os.preadv(fd, [memoryview(probe.raw[:PAGE])], 0)
        except OSError:
            os.close(fd)
            return None
        return fd

    @property
    def mode(self) -> str:
        """"O_DIRECT", "page cache", or both where stores differ (the start report's word)."""
        kinds = {fd is not None for fd in self._direct.values()}
        if not kinds:
            return "O_DIRECT" if self._want_direct else "page cache"
        return {frozenset({True}): "O_DIRECT", frozenset({False}): "page cache"}.get(
            frozenset(kinds), "O_DIRECT and page cache")

    def read(self, store, start: int, n: int, buf: AlignedBuffer) -> np.ndarray:
        """Elements [start, start + n) of ``store`` into ``buf``; the view of them (module docstring)."""
        from ringzero.runtime.offload import OffloadError
        item = store.dtype.itemsize
        off, end = start * item, (start + n) * item
        a0 = _down(off)
        out = buf.view(off - a0, store.dtype, n)
        mv = memoryview(buf.raw).cast("B")
        got, dfd = a0, self.direct(store)
        if dfd is not None:                   # whole pages, direct; a file's last page may end short
            stop = _up(end)
            while got < stop:
                k = os.preadv(dfd, [mv[got - a0:stop - a0]], got)
                if not k:
                    break
                got += k
                if got % PAGE:                # the file's end: the rest (if any) through the cache
                    break
        else:
            got = off
        while got < end:
            k = os.preadv(store.fd, [mv[got - a0:end - a0]], got)
            if not k:
                raise OffloadError(f"offload file of {store.name}: short read at byte {got} of {store.nbytes}")
            got += k
        store.count(read=end - off)
        return out

    def write(self, store, start: int, src: np.ndarray):
        """Elements [start, start + src.size) of ``store`` from ``src``, a view ``read`` gave (or one at the
        same offset mod 4096 into an AlignedBuffer): its whole pages direct, its partial ends cached."""
        item = store.dtype.itemsize
        off, end = start * item, (start + src.size) * item
        mv = memoryview(src.view(np.uint8)).cast("B")
        dfd = self.direct(store)
        lo, hi = (_up(off), _down(end)) if dfd is not None else (end, end)
        aligned = dfd is not None and hi > lo and (src.ctypes.data + lo - off) % PAGE == 0
        pieces = ([(store.fd, off, lo), (dfd, lo, hi), (store.fd, hi, end)] if aligned
                  else [(store.fd, off, end)])
        for fd, a, b in pieces:
            while a < b:
                a += os.pwritev(fd, [mv[a - off:b - off]], a)
        store.count(written=end - off)

    def forget(self, store):
        """Close the store's direct descriptor (before the store closes)."""
        with self._lock:
            fd = self._direct.pop(id(store), None)
        if fd is not None:
            os.close(fd)

    def close(self):
        self._pool.shutdown(wait=True)
        with self._lock:
            fds, self._direct = list(self._direct.values()), {}
        for fd in fds:
            if fd is not None:
                os.close(fd)
