"""Training data: the default offline corpus, ``--data FILE``, and sharded batches.

What it is
    * ``stdlib_corpus()``: the default corpus, which exists wherever Python is
      installed. It is the bytes of the standard library's own ``.py`` files
      (``sysconfig.get_paths()["stdlib"]``), chosen by one fixed rule:

        1. walk the stdlib tree; skip directories named ``site-packages``,
           ``dist-packages``, ``__pycache__``, ``test``, ``tests``,
           ``idle_test``; skip files named ``test_*.py`` and the
           machine-specific ``_sysconfigdata*.py``;
        2. order the files by ``(crc32(relative posix path), path)``, a fixed
           shuffle so the size cap samples the whole library instead of its
           alphabetical head (which is a quarter ``encodings/`` tables);
        3. take whole files in that order while the total stays <= ``cap``
           (4 MiB by default); stop at the first file that would exceed it;
        4. file k of the taken list (k = 0, 1, ...) is held out when
           ``k % holdout_every == holdout_every - 1`` (every 20th file, ~5%).
           The split is by file, so no file is in both halves.

      Train and held-out are each the concatenation of their files' bytes in
      that order; vocab 256 (one token per byte). Nothing is cached on disk.
    * ``file_corpus(path)``: ``--data FILE``. ``*.bin`` is a token file
      (np.memmap, never read whole): llm.c's header with uint16 or uint32 ids
      (what ``data encode`` writes), or nanoGPT's bare uint16; anything else is
      raw bytes (np.memmap as uint8, vocab 256). The held-out part is the last
      5% of the tokens (at least seq_len + 1 of them), or, for a file named
      ``train.bin`` with a ``val.bin`` beside it, the whole of ``val.bin``.
    * ``Batches``: rank r's rows of a global batch that is a pure function of
      (seed, step), so it is the same at any world size with the same global
      batch size, and a resumed run sees the same batches.
    * ``unigram_entropy``: the token-frequency entropy in nats, the loss a
      model that ignores context can reach; the trainer's target is below it.

What it is not
    No tokenizer (bytes or pre-tokenized ids only: ``python -m ringzero.data
    encode`` makes the ids, interop/tokens.py), no device copies (the
    trainer stages x, y to the device), no MPI: rank and world are numbers.
"""
from __future__ import annotations

import math
import os
import sys
import sysconfig
import zlib
from dataclasses import dataclass

import numpy as np

from ringzero.interop.token_files import describe, open_tokens

DEFAULT_CAP = 4 << 20          # bytes of stdlib source in the default corpus
HOLDOUT_EVERY = 20             # every 20th file is held out (~5%)
HOLDOUT_FRACTION = 0.05        # held-out tail of a --data file
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})


@dataclass
class Corpus:
    """Token arrays of one data source, split into train and held-out."""
    train: np.ndarray       # (N_train,) uint8, uint16 or uint32 (may be an np.memmap)
    val: np.ndarray         # (N_val,)
    vocab: int              # tokens are in [0, vocab)
    source: str             # one line: what the data is
    n_files: tuple = (0, 0)  # (train, held-out) files, default corpus only

    @property
    def byte_level(self) -> bool:
        return self.train.dtype == np.uint8

    def describe(self) -> str:
        files = f", {self.n_files[0]} + {self.n_files[1]} files" if self.n_files[0] else ""
        return (f"{self.source}: {self.train.size:,} train + {self.val.size:,} held-out tokens"
                f"{files}, vocab {self.vocab}")

    def encode(self, text: str) -> np.ndarray:
        """Prompt text to token ids (byte-level corpora only)."""
        if not self.byte_level:
            raise ValueError(f"encode needs a byte-level corpus (vocab 256), this one is "
                             f"{self.source} with vocab {self.vocab}")
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int64)

    def decode(self, ids) -> str:
        """Token ids to text: UTF-8 bytes for byte-level data, else the ids."""
        ids = np.asarray(ids).ravel()
        if self.byte_level:
            return bytes(ids.astype(np.uint8)).decode("utf-8", errors="replace")
        return " ".join(str(int(i)) for i in ids)


# ---- the default corpus -----------------------------------------------------

def stdlib_files(root: str | None = None) -> list:
    """(relative posix path, absolute path) of every eligible stdlib .py file,
    in the corpus order (rule steps 1 and 2 of the module docstring)."""
    root = root or sysconfig.get_paths()["stdlib"]
    found = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS)
        for f in files:
            if f.endswith(".py") and not f.startswith(("test_", "_sysconfigdata")):
                full = os.path.join(d, f)
                rel = os.path.relpath(full, root).replace(os.sep, "/")
                found.append((rel, full))
    found.sort(key=lambda rf: (zlib.crc32(rf[0].encode()), rf[0]))
    return found


def stdlib_corpus(cap: int = DEFAULT_CAP, holdout_every: int = HOLDOUT_EVERY,
                  root: str | None = None) -> Corpus:
    """The default corpus: stdlib .py bytes, capped, every k-th file held out."""
    if cap < 1 or holdout_every < 2:
        raise ValueError(f"need cap >= 1 and holdout_every >= 2, got cap={cap}, "
                         f"holdout_every={holdout_every}")
    root = root or sysconfig.get_paths()["stdlib"]
    chosen, total = [], 0
    for rel, full in stdlib_files(root):
        size = os.path.getsize(full)
        if total + size > cap:
            break
        chosen.append(full)
        total += size
    train_parts, val_parts = [], []
    for k, full in enumerate(chosen):
        with open(full, "rb") as f:
            blob = f.read()
        (val_parts if k % holdout_every == holdout_every - 1 else train_parts).append(blob)
    if not val_parts:
        raise ValueError(f"default corpus under {root} has {len(chosen)} files within cap {cap} "
                         f"bytes, need >= {holdout_every} for a held-out file")
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    return Corpus(np.frombuffer(b"".join(train_parts), np.uint8),
                  np.frombuffer(b"".join(val_parts), np.uint8), 256,
                  f"Python {py} stdlib source ({root}, cap {cap:,} B)",
                  (len(train_parts), len(val_parts)))


# ---- --data FILE ------------------------------------------------------------

def _open_tokens(path: str) -> np.ndarray:
    """np.memmap of a token file: *.bin through interop/token_files.py (llm.c's header: uint16 or
    uint32; no header: nanoGPT's uint16), bytes otherwise."""
    if not os.path.isfile(path):
        raise ValueError(f"data file {path!r} does not exist (or is not a file)")
    if path.endswith(".bin"):
        data = open_tokens(path)
        if data.size == 0:
            raise ValueError(f"token file {path!r} holds no tokens: expected > 0, got 0")
        return data
    if os.path.getsize(path) == 0:
        raise ValueError(f"data file {path!r} is empty: expected > 0 bytes, got 0")
    return np.memmap(path, dtype=np.uint8, mode="r")


def _max_token(a: np.ndarray, chunk: int = 1 << 22) -> int:
    return max(int(a[i:i + chunk].max()) for i in range(0, a.size, chunk))


def file_corpus(path: str, seq_len: int, vocab: int | None = None) -> Corpus:
    """``--data FILE``: a text file (bytes) or a nanoGPT uint16 ``.bin`` file."""
    data = _open_tokens(path)
    need = seq_len + 1
    if data.size < need:
        raise ValueError(f"data file {path!r} is shorter than seq_len + 1: expected >= {need} "
                         f"tokens, got {data.size}")
    val_path = os.path.join(os.path.dirname(path), "val.bin")
    if os.path.basename(path) == "train.bin" and os.path.isfile(val_path):
        train, val = data, _open_tokens(val_path)
        if val.size < need:
            raise ValueError(f"held-out file {val_path!r} is shorter than seq_len + 1: "
                             f"expected >= {need} tokens, got {val.size}")
    else:
        n_val = max(need, math.ceil(HOLDOUT_FRACTION * data.size))
        if data.size - n_val < need:
            raise ValueError(f"data file {path!r} is too short for train and held-out parts of "
                             f"seq_len + 1 tokens each: expected >= {n_val + need} tokens, "
                             f"got {data.size}")
        train, val = data[:data.size - n_val], data[data.size - n_val:]
    if data.dtype == np.uint8:                 # bytes: any of the 256 may appear
        if vocab is not None and vocab < 256:
            raise ValueError(f"text file {path!r} is read as bytes: expected vocab >= 256, got {vocab}")
        vocab = 256 if vocab is None else vocab
    else:
        top = max(_max_token(train), _max_token(val))
        vocab = top + 1 if vocab is None else vocab
        if top >= vocab:
            raise ValueError(f"data file {path!r} holds token {top}: expected tokens < vocab = {vocab}")
    kind = describe(path, data) if path.endswith(".bin") else "bytes"
    return Corpus(train, val, int(vocab), f"{path} ({kind})")


def load_corpus(path: str | None, seq_len: int, vocab: int | None = None) -> Corpus:
    """The trainer's entry point: ``--data FILE`` if given, else the default."""
    if path:
        return file_corpus(path, seq_len, vocab)
    corpus = stdlib_corpus()
    for name, part in (("train", corpus.train), ("held-out", corpus.val)):
        if part.size < seq_len + 1:
            raise ValueError(f"default corpus {name} part is shorter than seq_len + 1: expected "
                             f">= {seq_len + 1} tokens, got {part.size}")
    if vocab is not None and vocab < 256:
        raise ValueError(f"the default corpus is bytes: expected vocab >= 256, got {vocab}")
    return corpus


def unigram_entropy(data, vocab: int | None = None, chunk: int = 1 << 22) -> float:
    """Entropy in nats of the token frequencies of ``data`` (chunked, so a big
    memmap is never copied whole). A model that ignores context can reach
    exactly this cross-entropy, so a loss below it means the model learned."""
    data = np.asarray(data).ravel()
    if data.size == 0:
        raise ValueError("unigram_entropy needs at least one token, got 0")
    counts = np.zeros(vocab or 1, np.int64)
    for i in range(0, data.size, chunk):
        c = np.bincount(data[i:i + chunk], minlength=counts.size)
        if c.size > counts.size:
            counts = np.concatenate([counts, np.zeros(c.size - counts.size, np.int64)])
        counts[:c.size] += c
    p = counts[counts > 0] / data.size
    return float(-(p * np.log(p)).sum())


# ---- batches ------------------------------------------------------------------

def _check_int(name, v, lo):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(v).__name__} {v!r}")
    if v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")


class Batches:
    """Rank ``rank``'s slice of a deterministic global batch.

    The global batch at ``step`` is ``world * batch_per_rank`` windows of
    ``seq_len + 1`` tokens at offsets drawn by ``default_rng([seed, step])``;
    rank r takes rows [r*B, (r+1)*B). x is a window's first T tokens, y its
    last T (the next-token targets). The (B, T) buffers are allocated once
    and refilled by every ``get``: copy them if you keep them past the next.
    """

    def __init__(self, data, batch_per_rank: int, seq_len: int, rank: int = 0, world: int = 1,
                 seed: int = 0, dtype=np.int64):
        _check_int("batch_per_rank", batch_per_rank, 1)
        _check_int("seq_len", seq_len, 1)
        _check_int("world", world, 1)
        _check_int("rank", rank, 0)
        _check_int("seed", seed, 0)
        if rank >= world:
            raise ValueError(f"rank must be < world = {world}, got {rank}")
        data = np.asarray(data)
        if data.ndim != 1 or data.size < seq_len + 1:
            raise ValueError(f"data must be 1-D with >= seq_len + 1 = {seq_len + 1} tokens, "
                             f"got shape {data.shape}")
        self.data, self.B, self.T = data, batch_per_rank, seq_len
        self.rank, self.world, self.seed = rank, world, seed
        self.global_batch = world * batch_per_rank
        self.x = np.empty((batch_per_rank, seq_len), dtype)  # (B, T) inputs
        self.y = np.empty((batch_per_rank, seq_len), dtype)  # (B, T) targets

    def offsets(self, step: int) -> np.ndarray:
        """(world*B,) start offsets of the global batch at ``step``."""
        _check_int("step", step, 0)
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, self.data.size - self.T, size=self.global_batch)

    def get(self, step: int):
        """(x, y), each (B, T): this rank's rows of the global batch at ``step``."""
        offs = self.offsets(step)[self.rank * self.B:(self.rank + 1) * self.B]
        d, T = self.data, self.T
        for i, o in enumerate(offs):
            self.x[i] = d[o:o + T]
            self.y[i] = d[o + 1:o + 1 + T]
        return self.x, self.y


def main(argv=None):
    """``python -m ringzero.data [--data FILE]``: describe a corpus and its entropy.
    ``python -m ringzero.data encode --tokenizer FILE IN.txt OUT.bin``: BPE tokens (interop/tokens.py)."""
    import argparse
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["encode"]:
        from ringzero.interop.tokens import main as encode
        return encode(argv[1:])
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--data", default=None, help="text file or token .bin (default: stdlib corpus)")
    ap.add_argument("--seq-len", type=int, default=128)
    a = ap.parse_args(argv)
    try:
        c = load_corpus(a.data, a.seq_len)
    except ValueError as e:
        ap.exit(2, f"ringzero.data: error: {e}\n")
    print(c.describe())
    print(f"held-out unigram entropy: {unigram_entropy(c.val, c.vocab):.4f} nats "
          f"({unigram_entropy(c.val, c.vocab) / math.log(2):.4f} bits) per token")
    print(f"train unigram entropy:    {unigram_entropy(c.train, c.vocab):.4f} nats")


if __name__ == "__main__":
    sys.exit(main())
