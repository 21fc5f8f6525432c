"""BPE tokens: ``python -m ringzero.data encode --tokenizer tokenizer.json IN.txt OUT.bin``.

What it is
    ``load_tokenizer(path)``: a ``tokenizers`` tokenizer.json (GPT-2's own, or
    any the user trained: Llama 3's and Qwen2's included), with one-line errors.
    ``encode_file`` turns a text file into the token file the trainer reads
    (interop/token_files.py: llm.c's header, then uint16 ids when the
    vocabulary fits 16 bits, uint32 when it does not, as Qwen2's 151,936 and
    Llama 3's 128,256). The text is read and encoded in pieces of
    about ``PIECE`` bytes, each cut just after a newline between two non-space
    characters; a byte-level or regex-split pre-tokenizer (GPT-2's, Llama 3's,
    Qwen2's) splits on both sides of such a newline anyway, so the ids are
    those of encoding the whole text at once (tests/test_tokens.py checks it),
    while memory stays one piece. A tokenizer that prepends to every input
    (sentencepiece-style, Llama 2's) encodes the whole text as one piece.
    The output is written beside itself and renamed.

What it is not
    No tokenizer training (the tests build small BPEs with the ``tokenizers``
    trainer), no download (the user brings tokenizer.json: GPT-2's is in
    the same hub folder as its weights), no tiktoken.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

from ringzero.interop.token_files import TokenFileError, TokenWriter

PIECE = 1 << 20                    # bytes of text encoded at a time
_CUT = re.compile(r"(?<=\S)\n(?=\S)")     # a newline between two non-space characters


class TokenizerError(ValueError):
    """A tokenizer or a text that cannot be encoded as asked: one line."""


def load_tokenizer(path: str):
    """A ``tokenizers.Tokenizer`` from a tokenizer.json. Raises TokenizerError."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise TokenizerError("--tokenizer needs the tokenizers package: pip install 'ringzero[hf]'") from None
    if not os.path.isfile(path):
        raise TokenizerError(f"--tokenizer {path!r} does not exist: expected a tokenizers tokenizer.json "
                             "(GPT-2's is in the hub folder beside its model.safetensors)")
    try:
        return Tokenizer.from_file(path)
    except Exception as e:        # tokenizers raises its own Exception types, with long messages
        raise TokenizerError(f"--tokenizer {path!r} is not a tokenizers tokenizer.json: "
                             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def pieces(fh, size: int = PIECE):
    """The text of ``fh`` in pieces of about ``size`` characters, each ending just after a
    newline between two non-space characters (or at the end)."""
    rest = ""
    while True:
        chunk = fh.read(size)
        text = rest + chunk
        if not chunk:
            if text:
                yield text
            return
        cut = None
        for m in _CUT.finditer(text):
            cut = m.end()
        if cut is None or cut == len(text):
            rest = text                 # no cut yet: read on
            continue
        yield text[:cut]
        rest = text[cut:]


def vocab_size(tok) -> int:
    """1 + the largest id the tokenizer can emit (added tokens included): the width the ids need."""
    ids = tok.get_vocab(with_added_tokens=True).values()
    return max(max(ids, default=-1) + 1, tok.get_vocab_size(with_added_tokens=True))


def splits_at_newlines(tok) -> bool:
    """True when encoding in pieces cut after a newline gives the ids of the whole text: a pre-tokenizer
    that splits there (byte-level, or a Split regex as Llama 3's and Qwen2's) and no normalizer that
    prepends to every input (sentencepiece-style Llama 2 tokenizers prepend '▁' to each piece)."""
    import json
    conf = json.loads(tok.to_str())
    text = json.dumps(conf.get("normalizer")) + json.dumps(conf.get("pre_tokenizer"))
    pre = conf.get("pre_tokenizer") or {}
    kinds = {pre.get("type")} | {p.get("type") for p in pre.get("pretokenizers", []) if isinstance(p, dict)}
    return bool(kinds & {"ByteLevel", "Split"}) and '"Prepend"' not in text and '"Metaspace"' not in text


def encode_file(tok, src: str, out: str, size: int = PIECE) -> dict:
    """Write ``out``: the ids of ``src``'s text, as a token file with llm.c's header (uint16 when the
    vocabulary fits, else uint32). Returns {tokens, vocab, max_id, bytes, dtype}."""
    vocab = vocab_size(tok)
    if not os.path.isfile(src):
        raise TokenizerError(f"{src!r} does not exist: expected a UTF-8 text file")
    d = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(d):
        raise TokenizerError(f"cannot write {out!r}: folder {d!r} does not exist")
    whole = not splits_at_newlines(tok)
    w = TokenWriter(out, vocab)
    try:
        with open(src, encoding="utf-8") as fi:
            for text in ([fi.read()] if whole else pieces(fi, size)):     # whole: one piece, the text
                w.write(tok.encode(text, add_special_tokens=False).ids)
        if w.count == 0:
            raise TokenizerError(f"{src!r} encodes to no tokens: expected a non-empty text")
        w.close()
    except UnicodeDecodeError as e:
        w.abort()
        raise TokenizerError(f"{src!r} is not UTF-8 text: {e}") from None
    except BaseException:
        w.abort()
        raise
    return {"tokens": w.count, "vocab": vocab, "max_id": w.top, "bytes": os.path.getsize(out),
            "dtype": w.dtype.name}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ringzero.data encode",
                                 description="Encode a UTF-8 text file with a tokenizer.json into a "
                                             "token .bin for --data (llm.c's header; uint16 ids when the "
                                             "vocabulary fits, else uint32).")
    ap.add_argument("--tokenizer", required=True, help="a tokenizers tokenizer.json (GPT-2's, or your own)")
    ap.add_argument("src", metavar="IN.txt")
    ap.add_argument("out", metavar="OUT.bin")
    a = ap.parse_args(argv)
    try:
        if not a.out.endswith(".bin"):
            raise TokenizerError(f"the output must end in .bin (the trainer reads *.bin as token ids), got {a.out!r}")
        tok = load_tokenizer(a.tokenizer)
        r = encode_file(tok, a.src, a.out)
    except (TokenizerError, TokenFileError, OSError) as e:
        print(f"ringzero.data encode: error: {e}", file=sys.stderr)
        return 2
    print(f"encoded {a.src} with {a.tokenizer} (vocab {r['vocab']:,}): {r['tokens']:,} tokens, ids 0..{r['max_id']}, "
          f"{r['dtype']} with llm.c's header -> {a.out} ({r['bytes']:,} bytes)")
    return 0
