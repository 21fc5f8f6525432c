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
    head = np.fromfile(out, "<i4", count=256)                   # llm.c's header: magic, version 1, count
    assert list(head[:3]) == [20240520, 1, want.size] and not head[3:].any()
    got = np.fromfile(out, "<u2", offset=1024)
    assert r["tokens"] == want.size and r["dtype"] == "uint16" and np.array_equal(got, want)
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
    for args, want in [((path, str(src), str(tmp_path / "o.txt")), "must end in .bin"),
                       ((str(tmp_path / "nope.json"), str(src), str(tmp_path / "o.bin")), "does not exist"),
                       ((str(tmp_path / "bad.json"), str(src), str(tmp_path / "o.bin")), "not a tokenizers"),
                       ((path, str(tmp_path / "latin1.txt"), str(tmp_path / "o.bin")), "not UTF-8"),
                       ((path, str(src), str(tmp_path / "nodir" / "o.bin")), "does not exist")]:
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


def big_vocab_bpe(folder, text: str, extra: int = 70000) -> str:
    """The small BPE with ``extra`` added tokens <w0> .. <w{extra-1}> after it: ids past 65,535, as Qwen2's
    added tokens (151,643 and up) are; its tokenizer.json path."""
    from tokenizers import Tokenizer
    path = small_bpe(folder, text, 300)
    tok = Tokenizer.from_file(path)
    tok.add_tokens([f"<w{i}>" for i in range(extra)])
    tok.save(path)
    return path


def test_ids_past_uint16_round_trip(tmp_path):
    """encode -> a uint32 token file (version 2) -> the trainer's reader -> decode gives the text back;
    the ids equal the tokenizers library's encoding of the whole text."""
    text = corpus_text()[:20000]
    rng = np.random.default_rng(0)
    words = text.split(" ")
    for i in rng.choice(len(words), 200, replace=False):       # ids up to 70,299 sprinkled in
        words[i] += f"<w{int(rng.integers(65000, 70000))}>"
    text = " ".join(words)
    path = big_vocab_bpe(tmp_path, text)
    src = tmp_path / "in.txt"
    src.write_text(text, encoding="utf-8")
    r = run("ringzero.data", "encode", "--tokenizer", path, str(src), str(tmp_path / "o.bin"))
    assert r.returncode == 0 and "uint32" in r.stdout and "70,300" in r.stdout, (r.stdout, r.stderr)
    tok = tokens.load_tokenizer(path)
    want = np.array(tok.encode(text, add_special_tokens=False).ids)
    assert want.max() > 65535
    head = np.fromfile(tmp_path / "o.bin", "<i4", count=256)
    assert list(head[:3]) == [20240520, 2, want.size]
    assert np.array_equal(np.fromfile(tmp_path / "o.bin", "<u4", offset=1024), want)
    c = file_corpus(str(tmp_path / "o.bin"), 16, vocab=70300)
    ids = np.concatenate([c.train, c.val])
    assert c.train.dtype == np.uint32 and "uint32 tokens, llm.c header" in c.source
    assert np.array_equal(ids, want) and tok.decode(ids.tolist()) == text


def test_sample_decodes_ids_past_uint16(tmp_path):
    """``sample --tokenizer`` with a 70,300-id tokenizer on a GPT-2 of that vocabulary: the greedy
    continuation is the argmax of ringzero's logits, decoded by the tokenizer."""
    path = big_vocab_bpe(tmp_path, corpus_text()[:5000])
    write_gpt2(tmp_path / "m", conf={**CONFIG, "vocab_size": 70300, "n_embd": 16, "n_head": 2})
    r = run("ringzero.sample", str(tmp_path / "m"), "--tokenizer", path, "--prompt", "def<w69999>",
            "--tokens", "3", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    from ringzero.interop.hf_import import load_full
    from ringzero.nn.gpt import GPT
    cfg, L, buf, _ = load_full(str(tmp_path / "m"))
    tok = tokens.load_tokenizer(path)
    ids = tok.encode("def<w69999>", add_special_tokens=False).ids
    assert 70299 in ids                                   # <w69999>: 300 + 69,999
    m, P = GPT(cfg), L.views(buf)
    for _ in range(3):
        ids.append(int(np.argmax(m.logits(P, np.array([ids]))[0, -1])))
    assert r.stdout.rstrip("\n") == tok.decode(ids)


QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")               # Qwen2's tokenizer.json pre-tokenizer regex


@pytest.mark.parametrize("style", ["qwen2", "llama2"])
def test_llama_and_qwen2_style_tokenizers_encode_as_the_whole_text(tmp_path, style):
    """A Qwen2-style tokenizer (NFC, a Split regex, then byte-level) is encoded in pieces; a Llama 2-style
    one (sentencepiece: prepend '▁', no pre-tokenizer) as one piece; both give the whole text's ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    text = corpus_text()[:30000]
    tok = Tokenizer(models.BPE(byte_fallback=style == "llama2"))
    if style == "qwen2":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
        alphabet = []
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=400, initial_alphabet=alphabet,
                                                        show_progress=False))
    tok.save(str(tmp_path / "tokenizer.json"))
    tok = tokens.load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert tokens.splits_at_newlines(tok) == (style == "qwen2")
    (tmp_path / "in.txt").write_text(text, encoding="utf-8")
    tokens.encode_file(tok, str(tmp_path / "in.txt"), str(tmp_path / "o.bin"), size=37)
    want = tok.encode(text, add_special_tokens=False).ids
    assert np.array_equal(np.fromfile(tmp_path / "o.bin", "<u2", offset=1024), want)
