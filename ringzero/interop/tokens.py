"""BPE tokens: ``python -m ringzero.data encode --tokenizer tokenizer.json IN.txt OUT.bin``.

What it is
    ``load_tokenizer(path)``: a ``tokenizers`` tokenizer.json (GPT-2's own, or
    any the user trained), with one-line errors. ``encode_file`` turns a text
    file into the nanoGPT ``.bin`` the trainer reads (app/data.py): flat
    uint16 token ids, no header. The text is read and encoded in pieces of
    about ``PIECE`` bytes, each cut just after a newline between two non-space
    characters; GPT-2's byte-level pre-tokenizer splits on both sides of such
    a newline anyway (it is a pre-token of its own), so the ids are those
    of encoding the whole text at once (tests/test_tokens.py checks it), while
    memory stays one piece. The output is written beside itself and renamed.

    A vocabulary over 65,535 ids does not fit uint16: it is refused (the
    trainer reads uint16 only), as nanoGPT's format is.

What it is not
    No tokenizer training (the tests build small BPEs with the ``tokenizers``
    trainer), no download (the user brings tokenizer.json: GPT-2's is in
    the same hub folder as its weights), no tiktoken.
"""
from __future__ import annotations

import argparse
import os
import re
import secrets
import sys

import numpy as np

PIECE = 1 << 20                    # bytes of text encoded at a time
MAX_UINT16 = 65535
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


def encode_file(tok, src: str, out: str, size: int = PIECE) -> dict:
    """Write ``out``: the uint16 ids of ``src``'s text. Returns {tokens, vocab, max_id, bytes}."""
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if vocab > MAX_UINT16 + 1:
        raise TokenizerError(f"the tokenizer has {vocab:,} ids: the .bin format holds uint16 ids < 65,536 "
                             "(the trainer reads uint16 only)")
    if not os.path.isfile(src):
        raise TokenizerError(f"{src!r} does not exist: expected a UTF-8 text file")
    d = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(d):
        raise TokenizerError(f"cannot write {out!r}: folder {d!r} does not exist")
    tmp = f"{out}.tmp-{secrets.token_hex(4)}"
    n, top = 0, -1
    try:
        with open(src, encoding="utf-8") as fi, open(tmp, "wb") as fo:
            for text in pieces(fi, size):
                ids = np.asarray(tok.encode(text, add_special_tokens=False).ids, np.int64)
                if ids.size:
                    top = max(top, int(ids.max()))
                    fo.write(ids.astype(np.uint16).tobytes())
                    n += ids.size
            fo.flush()
            os.fsync(fo.fileno())
        if n == 0:
            raise TokenizerError(f"{src!r} encodes to no tokens: expected a non-empty text")
        os.replace(tmp, out)
    except UnicodeDecodeError as e:
        raise TokenizerError(f"{src!r} is not UTF-8 text: {e}") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return {"tokens": n, "vocab": vocab, "max_id": top, "bytes": os.path.getsize(out)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ringzero.data encode",
                                 description="Encode a UTF-8 text file with a tokenizer.json into a "
                                             "nanoGPT uint16 .bin for --data.")
    ap.add_argument("--tokenizer", required=True, help="a tokenizers tokenizer.json (GPT-2's, or your own)")
    ap.add_argument("src", metavar="IN.txt")
    ap.add_argument("out", metavar="OUT.bin")
    a = ap.parse_args(argv)
    try:
        if not a.out.endswith(".bin"):
            raise TokenizerError(f"the output must end in .bin (the trainer reads *.bin as uint16 ids), got {a.out!r}")
        tok = load_tokenizer(a.tokenizer)
        r = encode_file(tok, a.src, a.out)
    except (TokenizerError, OSError) as e:
        print(f"ringzero.data encode: error: {e}", file=sys.stderr)
        return 2
    print(f"encoded {a.src} with {a.tokenizer} (vocab {r['vocab']:,}): {r['tokens']:,} tokens, ids 0..{r['max_id']}, "
          f"uint16 -> {a.out} ({r['bytes']:,} bytes)")
    return 0
