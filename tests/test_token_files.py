"""Token files (interop/token_files.py): llm.c's header (uint16 / uint32) and nanoGPT's bare uint16,
each written here byte by byte with NumPy (the reference) and read back by ``open_tokens``."""
import numpy as np
import pytest

from ringzero.interop.token_files import MAGIC, TokenFileError, TokenWriter, open_tokens, version_for


def headered(path, ids, version, count=None, magic=MAGIC):
    h = np.zeros(256, "<i4")
    h[:3] = magic, version, len(ids) if count is None else count
    with open(path, "wb") as f:
        f.write(h.tobytes())
        f.write(np.asarray(ids, "<u2" if version == 1 else "<u4").tobytes())


@pytest.mark.parametrize("version", [1, 2])
def test_llmc_header_read(tmp_path, version):
    ids = np.random.default_rng(0).integers(0, 65536 if version == 1 else 1 << 32, 1000)
    headered(tmp_path / "a.bin", ids, version)
    got = open_tokens(str(tmp_path / "a.bin"))
    assert got.dtype == (np.uint16 if version == 1 else np.uint32) and np.array_equal(got, ids)


def test_bare_uint16_and_files_that_fail_the_header_checks(tmp_path):
    ids = np.arange(5000, dtype="<u2")
    ids.tofile(tmp_path / "bare.bin")                               # nanoGPT's
    assert np.array_equal(open_tokens(str(tmp_path / "bare.bin")), ids)
    for name, kw in (("count.bin", {"count": 999}), ("version.bin", {"version": 3}), ("magic.bin", {"magic": 7})):
        kw = {"version": 1, **kw}
        headered(tmp_path / name, ids[:1000], **kw)                 # a wrong field: read as bare uint16
        raw = np.fromfile(tmp_path / name, "<u2")
        got = open_tokens(str(tmp_path / name))
        assert got.dtype == np.uint16 and np.array_equal(got, raw), name
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(TokenFileError, match="no llm.c header .* expected an even byte count, got 3"):
        open_tokens(str(tmp_path / "odd.bin"))
    with pytest.raises(TokenFileError, match="does not exist"):
        open_tokens(str(tmp_path / "nope.bin"))


def test_writer_picks_the_width_and_leaves_no_half_file(tmp_path):
    assert (version_for(65536), version_for(65537), version_for(151936)) == (1, 2, 2)
    for vocab, dt in ((50257, "<u2"), (151936, "<u4")):
        w = TokenWriter(str(tmp_path / "w.bin"), vocab)
        w.write([1, 2, 3])
        w.write([])
        w.write(np.array([vocab - 1]))
        w.close()
        assert list(np.fromfile(tmp_path / "w.bin", "<i4", count=3)) == [MAGIC, 1 if dt == "<u2" else 2, 4]
        assert list(np.fromfile(tmp_path / "w.bin", dt, offset=1024)) == [1, 2, 3, vocab - 1]
    w = TokenWriter(str(tmp_path / "x.bin"), 1000)
    with pytest.raises(TokenFileError, match=r"token id 70000 does not fit uint16 .* expected ids in \[0, 65535\]"):
        w.write([70000])
    w.abort()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.bin"]
