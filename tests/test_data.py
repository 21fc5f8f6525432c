"""Tests of ringzero/app/data.py: corpus rule, --data formats, batches, entropy, errors.

Serial only. References are independent of the code under test: windows are
located in the raw data by their content (token == position), entropy comes
from collections.Counter and math.log, and the split rule is checked on a
synthetic stdlib tree whose files each carry a unique marker.
"""
import collections
import math
import zlib

import numpy as np
import pytest

from ringzero.app.data import Batches, file_corpus, load_corpus, stdlib_corpus, unigram_entropy


@pytest.fixture
def pos_bin(tmp_path):
    """A .bin file whose token at position i is i, so a window names its offset."""
    n = 20_000
    path = tmp_path / "pos.bin"
    np.arange(n, dtype=np.uint16).tofile(path)
    return str(path), n


# ---- batches ----------------------------------------------------------------

def test_batches_deterministic_by_seed_and_step(pos_bin):
    c = file_corpus(pos_bin[0], 16)
    a, b = Batches(c.train, 4, 16, 0, 1, seed=7), Batches(c.train, 4, 16, 0, 1, seed=7)
    x5 = a.get(5)[0].copy()
    b.get(9)                                     # a different history ...
    assert np.array_equal(b.get(5)[0], x5)       # ... gives the same step 5 (resume)
    assert not np.array_equal(a.get(6)[0], x5)
    other = Batches(c.train, 4, 16, 0, 1, seed=8)
    assert not np.array_equal(other.get(5)[0], x5)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_rank_slices_tile_the_global_batch(pos_bin, world):
    c = file_corpus(pos_bin[0], 32)
    B, T = 3, 32
    whole = Batches(c.train, B * world, T, 0, 1, seed=3)   # one rank, global batch
    for step in (0, 1, 17):
        gx, gy = (a.copy() for a in whole.get(step))
        xs, ys = [], []
        for r in range(world):
            x, y = Batches(c.train, B, T, r, world, seed=3).get(step)
            assert x.shape == (B, T) and y.shape == (B, T)
            xs.append(x.copy())
            ys.append(y.copy())
        assert np.array_equal(np.concatenate(xs), gx)
        assert np.array_equal(np.concatenate(ys), gy)


def test_y_is_x_shifted_by_one_in_the_raw_data(pos_bin):
    path, n = pos_bin
    raw = np.fromfile(path, np.uint16).astype(np.int64)    # independent read
    c = file_corpus(path, 64)
    b = Batches(c.train, 8, 64, 1, 2, seed=0)
    for step in range(5):
        x, y = b.get(step)
        for row_x, row_y in zip(x, y):
            o = int(row_x[0])                              # token == position
            assert np.array_equal(row_x, raw[o:o + 64])
            assert np.array_equal(row_y, raw[o + 1:o + 65])
            assert o + 64 < c.train.size                   # window inside train part


def test_batches_reuse_buffers(pos_bin):
    c = file_corpus(pos_bin[0], 8)
    b = Batches(c.train, 2, 8, 0, 1, seed=0)
    x0, _ = b.get(0)
    x1, _ = b.get(1)
    assert x0 is x1 and x0.flags.c_contiguous


def test_batches_bad_arguments(pos_bin):
    c = file_corpus(pos_bin[0], 8)
    with pytest.raises(ValueError, match="rank must be < world = 2, got 2"):
        Batches(c.train, 2, 8, 2, 2)
    with pytest.raises(TypeError, match="batch_per_rank must be an int, got float"):
        Batches(c.train, 2.0, 8)
    with pytest.raises(ValueError, match="seq_len must be >= 1, got 0"):
        Batches(c.train, 2, 0)
    with pytest.raises(ValueError, match=r">= seq_len \+ 1 = 11 tokens, got shape \(10,\)"):
        Batches(np.zeros(10, np.uint8), 1, 10)
    with pytest.raises(ValueError, match="step must be >= 0, got -1"):
        Batches(c.train, 2, 8).get(-1)


# ---- --data formats ------------------------------------------------------------

def test_bin_round_trip(tmp_path):
    toks = np.random.default_rng(0).integers(0, 50257, size=5000).astype(np.uint16)
    path = tmp_path / "tokens.bin"
    toks.tofile(path)
    c = file_corpus(str(path), 128)
    assert isinstance(c.train, np.memmap) or isinstance(c.train.base, np.memmap)
    assert np.array_equal(np.concatenate([c.train, c.val]), toks)
    assert c.vocab == int(toks.max()) + 1
    assert c.val.size == max(129, math.ceil(0.05 * toks.size))
    assert file_corpus(str(path), 128, vocab=50257).vocab == 50257
    with pytest.raises(ValueError, match=f"holds token {int(toks.max())}: expected tokens < vocab = 1000"):
        file_corpus(str(path), 128, vocab=1000)


def test_train_bin_uses_val_bin_beside_it(tmp_path):
    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    np.arange(2000, 2300, dtype=np.uint16).tofile(tmp_path / "val.bin")
    c = file_corpus(str(tmp_path / "train.bin"), 64)
    assert np.array_equal(c.train, np.arange(1000)) and np.array_equal(c.val, np.arange(2000, 2300))
    assert c.vocab == 2300


def test_text_file_is_bytes(tmp_path):
    text = ("héllo wörld, ringzero reads bytes.\n" * 200).encode()
    path = tmp_path / "corpus.txt"
    path.write_bytes(text)
    c = file_corpus(str(path), 32)
    assert c.vocab == 256 and c.train.dtype == np.uint8
    assert bytes(c.train) + bytes(c.val) == text
    assert c.decode(c.encode("héllo")) == "héllo"
    with pytest.raises(ValueError, match="read as bytes: expected vocab >= 256, got 100"):
        file_corpus(str(path), 32, vocab=100)


def test_cli_reports_entropy_and_fails_in_one_line(tmp_path):
    import subprocess
    import sys
    (tmp_path / "t.txt").write_bytes(b"abab" * 100)
    ok = subprocess.run([sys.executable, "-m", "ringzero.data", "--data", str(tmp_path / "t.txt"),
                         "--seq-len", "8"], capture_output=True, text=True)
    assert ok.returncode == 0 and f"{math.log(2):.4f} nats" in ok.stdout, ok.stdout + ok.stderr
    bad = subprocess.run([sys.executable, "-m", "ringzero.data", "--data", str(tmp_path / "no.txt")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert "does not exist" in bad.stderr


def test_data_file_errors(tmp_path):
    with pytest.raises(ValueError, match=r"'.*nope\.txt' does not exist"):
        load_corpus(str(tmp_path / "nope.txt"), 8)
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.txt' is empty: expected > 0 bytes, got 0"):
        load_corpus(str(tmp_path / "empty.txt"), 8)
    (tmp_path / "short.txt").write_bytes(b"x" * 8)
    with pytest.raises(ValueError, match=r"short\.txt' is shorter than seq_len \+ 1: expected >= 9 tokens, got 8"):
        load_corpus(str(tmp_path / "short.txt"), 8)
    np.arange(8, dtype=np.uint16).tofile(tmp_path / "short.bin")
    with pytest.raises(ValueError, match=r"short\.bin' is shorter than seq_len \+ 1: expected >= 9 tokens, got 8"):
        load_corpus(str(tmp_path / "short.bin"), 8)
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(ValueError, match="expected an even byte count, got 3"):
        load_corpus(str(tmp_path / "odd.bin"), 1)
    (tmp_path / "tight.txt").write_bytes(b"x" * 12)   # >= seq_len+1, too short to split
    with pytest.raises(ValueError, match=r"tight\.txt' is too short.*expected >= 18 tokens, got 12"):
        load_corpus(str(tmp_path / "tight.txt"), 8)
    with pytest.raises(ValueError, match=r"default corpus train part is shorter than seq_len \+ 1"):
        load_corpus(None, 10**9)


# ---- the default corpus ----------------------------------------------------------

def _fake_stdlib(root):
    """A small stdlib tree; each file's content is a unique marker line."""
    names = ["os.py", "json/__init__.py", "json/decoder.py", "email/parser.py", "abc.py",
             "asyncio/events.py", "typing.py", "zipfile.py", "ast.py", "dis.py",
             "test/test_os.py", "unittest/test/helper.py", "lib2to3/tests/data.py",
             "site-packages/pkg.py", "idlelib/idle_test/x.py", "http/test_client.py",
             "_sysconfigdata__linux.py", "__pycache__/os.py", "README.txt"]
    for n in names:
        p = root / n
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(f"# FILE {n}\n".encode())
    return names


def test_stdlib_rule_on_a_fake_tree(tmp_path):
    _fake_stdlib(tmp_path)
    kept = ["os.py", "json/__init__.py", "json/decoder.py", "email/parser.py", "abc.py",
            "asyncio/events.py", "typing.py", "zipfile.py", "ast.py", "dis.py"]
    order = sorted(kept, key=lambda n: (zlib.crc32(n.encode()), n))
    c = stdlib_corpus(cap=10**6, holdout_every=3, root=str(tmp_path))
    train, val = bytes(c.train).decode(), bytes(c.val).decode()
    want_val = [n for k, n in enumerate(order) if k % 3 == 2]
    want_train = [n for n in order if n not in want_val]
    assert train == "".join(f"# FILE {n}\n" for n in want_train)
    assert val == "".join(f"# FILE {n}\n" for n in want_val)
    assert c.n_files == (len(want_train), len(want_val))
    # the cap takes whole files in order and stops at the first that overflows
    sizes = [len(f"# FILE {n}\n") for n in order]
    cap = sum(sizes[:7]) + 1
    c = stdlib_corpus(cap=cap, holdout_every=3, root=str(tmp_path))
    assert c.train.size + c.val.size == sum(sizes[:7])


def test_default_corpus_is_deterministic_and_split_by_file():
    a, b = stdlib_corpus(), stdlib_corpus()
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)
    assert a.vocab == 256 and a.train.dtype == np.uint8
    assert a.train.size + a.val.size <= 4 << 20
    assert a.n_files[1] >= 1 and 0.02 < a.val.size / (a.train.size + a.val.size) < 0.15
    # no held-out file appears in the train bytes (split by file, no leakage)
    train = bytes(a.train)
    for chunk in bytes(a.val).split(b"\n\n\n")[:50]:
        if len(chunk) > 2000:
            assert chunk not in train


# ---- entropy ---------------------------------------------------------------------

def _counter_entropy(seq):
    cnt = collections.Counter(seq)
    n = sum(cnt.values())
    return -sum(v / n * math.log(v / n) for v in cnt.values())


def test_unigram_entropy_matches_counter():
    c = stdlib_corpus()
    held = bytes(c.val)
    assert unigram_entropy(c.val) == pytest.approx(_counter_entropy(held), rel=1e-12)
    toks = np.random.default_rng(1).integers(0, 3000, size=20000).astype(np.uint16)
    assert unigram_entropy(toks, chunk=999) == pytest.approx(_counter_entropy(toks.tolist()), rel=1e-12)
    assert unigram_entropy(np.full(50, 7, np.uint8)) == 0.0
    assert unigram_entropy(np.arange(256, dtype=np.uint8)) == pytest.approx(math.log(256))
    with pytest.raises(ValueError, match="at least one token, got 0"):
        unigram_entropy(np.zeros(0, np.uint8))
