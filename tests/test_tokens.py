"""BPE tokens (interop/tokens.py): ``python -m ringzero.data encode`` and ``ringzero.sample --tokenizer``.

References: the ``tokenizers`` library encoding the whole text at once (the encoder reads
and encodes it in pieces), the bytes of the .bin read back as uint16, and the trainer's
own reader (app/data.py). The tokenizer is a small byte-level BPE trained here (nothing
is downloaded).
"""
import os
import subprocess
import sys

import numpy as np
import pytest
from hf_files import CONFIG, small_bpe, write_gpt2

from ringzero.app.data import file_corpus
from ringzero.interop import tokens

pytest.importorskip("tokenizers", reason="BPE tokens need the tokenizers package: pip install 'ringzero[hf]'")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def corpus_text() -> str:
    """Text with every kind of whitespace run: the source of two ringzero modules."""
    out = []
    for f in ("app/train.py", "runtime/flat.py"):
        with open(os.path.join(ROOT, "ringzero", f), encoding="utf-8") as fh:
            out.append(fh.read())
    return "\n\n".join(out) + "  \n\t\n  trailing   \n\n"


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    d = tmp_path_factory.mktemp("bpe")
    text = corpus_text()
    return small_bpe(d, text, 300), text


@pytest.mark.parametrize("piece", [37, 500, 1 << 20])
def test_encode_in_pieces_equals_encoding_the_whole_text(bpe, tmp_path, piece):
    path, text = bpe
    tok = tokens.load_tokenizer(path)
    src = tmp_path / "in.txt"
    src.write_text(text, encoding="utf-8")
    out = tmp_path / "out.bin"
    r = tokens.encode_file(tok, str(src), str(out), size=piece)
    want = np.array(tok.encode(text, add_special_tokens=False).ids)
    got = np.fromfile(out, np.uint16)
    assert r["tokens"] == want.size and np.array_equal(got, want)
    assert tok.decode(got.tolist()) == text                     # byte-level BPE is lossless
    c = file_corpus(str(out), 16, vocab=300)                  # the trainer reads it as written
    assert c.vocab == 300 and np.array_equal(np.concatenate([c.train, c.val]), want)


def run(*args):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=120)


def test_cli_encode_and_refusals(bpe, tmp_path):
    path, text = bpe
    src = tmp_path / "in.txt"
    src.write_text(text, encoding="utf-8")
    r = run("ringzero.data", "encode", "--tokenizer", path, str(src), str(tmp_path / "o.bin"))
    assert r.returncode == 0 and "tokens" in r.stdout and "uint16" in r.stdout, r.stderr
    (tmp_path / "bad.json").write_text("{}")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9\n")
    big = tmp_path / "big.json"
    from tokenizers import Tokenizer, models
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(70000)}, unk_token="w0")).save(str(big))
    for args, want in [((path, str(src), str(tmp_path / "o.txt")), "must end in .bin"),
                       ((str(tmp_path / "nope.json"), str(src), str(tmp_path / "o.bin")), "does not exist"),
                       ((str(tmp_path / "bad.json"), str(src), str(tmp_path / "o.bin")), "not a tokenizers"),
                       ((path, str(tmp_path / "latin1.txt"), str(tmp_path / "o.bin")), "not UTF-8"),
                       ((str(big), str(src), str(tmp_path / "o.bin")), "70,000 ids")]:
        r = run("ringzero.data", "encode", "--tokenizer", *args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and want in lines[0], (args, r.stderr)
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f], "no half-written file left"


def test_sample_with_a_tokenizer(bpe, tmp_path):
    """``ringzero.sample DIR --tokenizer`` on a GPT-2 folder: the prompt is encoded, the output
    decoded, and the greedy continuation is the argmax of ringzero's own logits (checked by hand)."""
    path, _ = bpe
    write_gpt2(tmp_path / "m", conf={**CONFIG, "vocab_size": 300})
    r = run("ringzero.sample", str(tmp_path / "m"), "--tokenizer", path, "--prompt", "def step",
            "--tokens", "4", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("def step") and "GPT L=2" in r.stderr, (r.stdout, r.stderr)
    from ringzero.interop.hf_import import load_full
    from ringzero.nn.gpt import GPT
    cfg, L, buf, _ = load_full(str(tmp_path / "m"))
    tok = tokens.load_tokenizer(path)
    ids = tok.encode("def step", add_special_tokens=False).ids
    m, P = GPT(cfg), L.views(buf)
    for _ in range(4):
        ids.append(int(np.argmax(m.logits(P, np.array([ids]))[0, -1])))
    assert r.stdout.rstrip("\n") == tok.decode(ids)
    r = run("ringzero.sample", str(tmp_path / "m"), "--tokenizer", path, "--prompt", "")
    assert r.returncode == 2 and "encodes to no tokens" in r.stderr, r.stderr
