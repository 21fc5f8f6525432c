"""Token files that say their own id width: llm.c's header, and nanoGPT's bare uint16 ``.bin``.

What it is
    The format ``data encode`` writes, llm.c's (``dev/data/data_common.py``)::

        header   256 x int32 (1,024 bytes), little-endian
                   [0] MAGIC = 20240520
                   [1] version: 1 = uint16 tokens, 2 = uint32 tokens
                   [2] the token count N
                   [3..255] zero
        tokens   N x uint16 or N x uint32, little-endian

    ``write_tokens(path, vocab)`` opens such a file for streaming (the count is
    written at the end, then the file is renamed into place); uint16 when
    every id < ``vocab`` fits (vocab <= 65,536), uint32 otherwise.
    ``open_tokens(path)`` maps a token file read-only (never read whole) and
    returns its ids as a 1-D uint16 or uint32 array: a header is believed only
    when the magic, the version and the count all agree with the file's size;
    any other file is nanoGPT's bare uint16 (an even byte count).

What it is not
    No tokenizer (interop/tokens.py encodes), no corpus split (app/data.py).
"""
from __future__ import annotations

import os
import secrets

import numpy as np

MAGIC = 20240520
HEADER_INTS = 256
HEADER_BYTES = 4 * HEADER_INTS
VERSIONS = {1: np.dtype("<u2"), 2: np.dtype("<u4")}      # version -> token dtype
MAX_UINT16_VOCAB = 1 << 16


class TokenFileError(ValueError):
    """A token file that cannot be read or written as asked: one line."""


def version_for(vocab: int) -> int:
    """1 (uint16) when ids < vocab fit 16 bits, else 2 (uint32)."""
    if vocab > 1 << 32:
        raise TokenFileError(f"a vocabulary of {vocab:,} ids does not fit uint32 tokens")
    return 1 if vocab <= MAX_UINT16_VOCAB else 2


def header(version: int, count: int) -> bytes:
    h = np.zeros(HEADER_INTS, "<i4")
    h[0], h[1], h[2] = MAGIC, version, count
    return h.tobytes()


def read_header(path: str, size: int):
    """(version, count) if ``path`` opens with a header that its size agrees with, else None."""
    if size < HEADER_BYTES:
        return None
    with open(path, "rb") as fh:
        h = np.frombuffer(fh.read(HEADER_BYTES), "<i4")
    if h[0] != MAGIC or int(h[1]) not in VERSIONS or h[2] < 0:
        return None
    version, count = int(h[1]), int(h[2])
    if HEADER_BYTES + count * VERSIONS[version].itemsize != size:
        return None
    return version, count


def open_tokens(path: str) -> np.ndarray:
    """(N,) uint16 or uint32 ids of a token file, memory-mapped. Raises TokenFileError."""
    if not os.path.isfile(path):
        raise TokenFileError(f"token file {path!r} does not exist (or is not a file)")
    size = os.path.getsize(path)
    found = read_header(path, size)
    if found is not None:
        version, count = found
        if count == 0:
            return np.zeros(0, VERSIONS[version])
        return np.memmap(path, dtype=VERSIONS[version], mode="r", offset=HEADER_BYTES, shape=(count,))
    if size == 0:
        raise TokenFileError(f"token file {path!r} is empty: expected > 0 bytes, got 0")
    if size % 2:
        raise TokenFileError(f"token file {path!r} has no llm.c header (magic {MAGIC}, version 1 or 2, a count that "
                             f"matches the size) and is read as bare uint16 tokens: expected an even byte count, "
                             f"got {size}")
    return np.memmap(path, dtype=np.dtype("<u2"), mode="r")


def describe(path: str, ids: np.ndarray) -> str:
    """What a token file is, in a few words: 'uint32 tokens, llm.c header' or 'uint16 tokens, no header'."""
    head = read_header(path, os.path.getsize(path)) is not None
    return f"{ids.dtype.name} tokens, {'llm.c header' if head else 'no header'}"


class TokenWriter:
    """A token file written in pieces: ``write(ids)`` as often as needed, then ``close()`` (or ``abort()``).

    It writes beside ``path`` and renames into place on close, so a failed encode leaves no half file."""

    def __init__(self, path: str, vocab: int):
        self.path, self.version = path, version_for(vocab)
        self.dtype = VERSIONS[self.version]
        self.count, self.top = 0, -1
        self.tmp = f"{path}.tmp-{secrets.token_hex(4)}"
        self.fh = open(self.tmp, "wb")
        self.fh.write(header(self.version, 0))          # the count is filled in by close()

    def write(self, ids) -> None:
        ids = np.asarray(ids, np.int64).ravel()
        if ids.size == 0:
            return
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi > np.iinfo(self.dtype).max:
            raise TokenFileError(f"token id {hi if lo >= 0 else lo} does not fit {self.dtype.name} (version "
                                 f"{self.version}): expected ids in [0, {np.iinfo(self.dtype).max}]")
        self.top = max(self.top, hi)
        self.fh.write(ids.astype(self.dtype).tobytes())
        self.count += ids.size

    def close(self) -> None:
        if self.count >= 1 << 31:
            self.abort()
            raise TokenFileError(f"{self.count:,} tokens: llm.c's header holds a count < 2**31")
        self.fh.seek(0)
        self.fh.write(header(self.version, self.count))
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        if not self.fh.closed:
            self.fh.close()
        if os.path.exists(self.tmp):
            os.remove(self.tmp)
