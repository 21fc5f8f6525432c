"""runtime/aio.py: the offload I/O engine's reads and writes against NumPy's bytes, O_DIRECT and its fallback.

Serial (no MPI): a FileStore in tmp_path, tiles at offsets that are and are not page-aligned, through
O_DIRECT and through the page cache, compared with a NumPy array that had the same writes; the pages
O_DIRECT moved are not in the page cache (the kernel's mincore); a filesystem that refuses O_DIRECT
falls back to the page cache and says so.
"""
from __future__ import annotations

import os
from concurrent.futures import wait

import numpy as np
import pytest

from ringzero.runtime import aio
from ringzero.runtime.aio import PAGE, AlignedBuffer, IOEngine
from ringzero.runtime.offload import FileStore, OffloadError
from tests.test_offload import resident_pages

# (start, count) in fp32 elements: page-aligned, within one page, across pages at both ends, to the end
SPANS = [(0, 1024), (5, 7), (1000, 3000), (32, 2048 * 3 + 17), (4096 * 3 - 96, 96)]


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "page_cache"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_reads_and_writes_match_numpy(tmp_path, direct, dtype):
    n = 4096 * 3
    store = FileStore(str(tmp_path), "master", dtype, n)
    ref = np.random.default_rng(0).standard_normal(n).astype(dtype)
    store.write(0, ref)
    io = IOEngine(3, direct=direct)
    try:
        buf = AlignedBuffer(n * ref.itemsize)
        for k, (a, c) in enumerate(SPANS):
            got = io.read(store, a, c, buf)
            assert got.tobytes() == ref[a:a + c].tobytes(), (a, c)
            assert (got.ctypes.data - buf.raw.ctypes.data) == a * ref.itemsize % PAGE   # at its page offset
            new = np.random.default_rng(k + 1).standard_normal(c).astype(dtype)
            got[:] = new
            io.write(store, a, got)
            ref[a:a + c] = new
            assert store[:].read().tobytes() == ref.tobytes(), (a, c)
        assert io.mode == ("O_DIRECT" if direct else "page cache")
        assert store.bytes_read >= sum(c for _, c in SPANS) * ref.itemsize
    finally:
        io.close()
        store.close()


def test_requests_in_flight_at_once_stay_apart(tmp_path):
    """Neighbouring tiles (sharing a partial page) written and read by several threads at once."""
    n, tile = 40_000, 1000                       # 4000 B a tile: every tile boundary inside a page
    store = FileStore(str(tmp_path), "adam_m", "float32", n)
    ref = np.arange(n, dtype=np.float32)
    io = IOEngine(4)
    bufs = [AlignedBuffer(tile * 4) for _ in range(n // tile)]
    try:
        views = []
        for i, b in enumerate(bufs):
            v = b.view(i * tile * 4 % PAGE, np.float32, tile)
            v[:] = ref[i * tile:(i + 1) * tile]
            views.append(v)
        wait([io.submit(io.write, store, i * tile, v) for i, v in enumerate(views)])
        assert store[:].read().tobytes() == ref.tobytes()
        for v in views:
            v[:] = -1
        fs = [io.submit(io.read, store, i * tile, tile, b) for i, b in enumerate(bufs)]
        assert b"".join(f.result().tobytes() for f in fs) == ref.tobytes()
    finally:
        io.close()
        store.close()


def test_direct_pages_bypass_the_page_cache(tmp_path):
    """A page-aligned MiB written and read through O_DIRECT leaves no page of it cached; through the
    page cache it does (the check can tell the two apart)."""
    n = 1 << 18
    for direct in (True, False):
        store = FileStore(str(tmp_path), "adam_v", "float32", n)
        os.posix_fadvise(store.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        io = IOEngine(2, direct=direct)
        try:
            buf = AlignedBuffer(n * 4)
            v = buf.view(0, np.float32, n)
            v[:] = 1.5
            io.write(store, 0, v)
            io.read(store, 0, n, buf)
            cached = resident_pages(store.fd)
            if io.mode != "O_DIRECT":
                assert not direct
            assert (cached == 0) if direct else (cached == n * 4 // PAGE), (direct, cached)
        finally:
            io.close()
            store.close()


def test_refused_o_direct_falls_back_to_the_page_cache(tmp_path, monkeypatch):
    """A filesystem whose O_DIRECT open fails (tmpfs on older kernels: EINVAL): the page cache, the same bytes."""
    real_open = os.open

    def no_direct(path, flags, *a, **k):
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *a, **k)
    monkeypatch.setattr(aio.os, "open", no_direct)
    store = FileStore(str(tmp_path), "master", "float32", 5000)
    io = IOEngine(2)
    try:
        buf = AlignedBuffer(5000 * 4)
        v = buf.view(0, np.float32, 5000)
        v[:] = np.arange(5000)
        io.write(store, 0, v)
        assert io.mode == "page cache"
        assert io.read(store, 0, 5000, buf).tobytes() == np.arange(5000, dtype=np.float32).tobytes()
    finally:
        io.close()
        store.close()


def test_a_short_file_is_one_error_line(tmp_path):
    store = FileStore(str(tmp_path), "master", "float32", 4096)
    os.ftruncate(store.fd, 1000 * 4)
    io = IOEngine(1)
    try:
        with pytest.raises(OffloadError, match=r"offload file of master: short read at byte 4000 of 16384"):
            io.read(store, 512, 2048, AlignedBuffer(2048 * 4))
    finally:
        io.close()
        store.close()
