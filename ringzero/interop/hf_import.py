"""``--init-from PATH``: a Hugging Face GPT-2 checkpoint read straight into each rank's shards.

What it is
    ``HFSource(path)`` opens, lazily, what PATH names:

        DIR/                        config.json and model.safetensors, or
                                    config.json and model.safetensors.index.json (sharded)
        FILE.safetensors            one file; its config.json beside it
        FILE.safetensors.index.json a sharded index; config.json beside it

    and checks it against the GPT its config.json describes (interop/gpt2.py):
    every key once, with or without the ``transformer.`` prefix, no key left
    over (the ``attn.bias`` / ``attn.masked_bias`` mask buffers aside), every
    shape and dtype; a ``lm_head.weight`` must equal ``wte`` (``check_head``,
    each rank comparing its share of the rows), else it is an untied head and
    refused. Only headers are read for these checks.

    ``fill_master(state)`` is the engine's ``init`` (runtime/engine.py): for
    every master piece this rank holds it reads the unit-local elements that
    piece covers, parameter by parameter, through safetensors' lazy slices
    (``TensorFile(...).get_slice``, interop/safetensors_files.py; fp32, fp16
    and bf16 files alike): rows of a 2-D tensor, at most ``CHUNK``
    elements at a time, cast to float32 into the piece. No process reads more
    of the file than its own pieces (plus two partial rows per parameter),
    and nothing model-sized is ever allocated beside the engine's buffers.
    The rows of ``wte`` past ``vocab_size`` (the padding to a multiple of 64)
    are zero, and stay zero: the head scores only the real rows (GPTConfig.real_vocab).

What it is not
    No collectives: errors are raised (or, inside ``fill_master``, kept in
    ``error``) for the trainer to agree on (app/exits.py). No pytorch_model.bin
    (pickles are not read): refused with a hint.
"""
from __future__ import annotations

import json
from contextlib import ExitStack

import numpy as np

from ringzero.interop.gpt2 import HEAD, PREFIX, gpt_config, hf_name, ignored, strip_prefix
from ringzero.interop.safetensors_files import HFConfigError, TensorFile, locate

CHUNK = 1 << 22                    # elements per read (16 MiB of float32)


class HFSource:
    """A GPT-2 checkpoint on disk: its config, and lazy ranged reads of its tensors."""

    def __init__(self, path: str):
        self.path = path
        self.config_path, self.files = locate(path)
        try:
            with open(self.config_path, encoding="utf-8") as fh:
                self.hf = json.load(fh)
        except (OSError, ValueError) as e:
            raise HFConfigError(f"{self.config_path}: unreadable config ({e})") from None
        if not isinstance(self.hf, dict):
            raise HFConfigError(f"{self.config_path}: expected a JSON object, got {type(self.hf).__name__}")
        self.cfg = gpt_config(self.hf, self.config_path)
        self._stack = ExitStack()
        self._open = {}              # file -> TensorFile
        self.keys = {}               # stripped key -> (file, key as stored)
        self.head = None             # (file, key) of lm_head.weight, if the file has one
        self.error = None            # fill_master's error, for the caller to agree on
        for f in self.files:
            try:
                h = self._open[f] = self._stack.enter_context(TensorFile(f))
            except OSError as e:
                self.close()
                raise HFConfigError(f"{f}: not readable ({e})") from None
            except HFConfigError:
                self.close()
                raise
            for k in h.keys():
                if k == HEAD:
                    self.head = (f, k)
                    continue
                s = strip_prefix(k)
                if s in self.keys:
                    self.close()
                    raise HFConfigError(f"{f}: key {k!r} appears twice ({self.keys[s][1]!r} in {self.keys[s][0]})")
                self.keys[s] = (f, k)

    def close(self):
        self._stack.close()
        self._open.clear()

    # ---- checks (headers only) ------------------------------------------------------
    def _slice(self, f, k):
        return self._open[f].get_slice(k)

    def expected(self, layout) -> dict:
        """{HF key (no prefix): (ringzero name, file shape)} of every parameter of ``layout``."""
        V = self.cfg.n_tokens
        out = {}
        for name, s in layout.slots.items():
            shape = (V,) + tuple(s.spec.shape[1:]) if name == "wte" else tuple(s.spec.shape)
            out[hf_name(name)] = (name, shape)
        return out

    def check(self, layout):
        """Every key, shape and dtype the layout needs; nothing left over. Raises HFConfigError."""
        want = self.expected(layout)
        extra = sorted(k for k in self.keys if k not in want and not ignored(k))
        if extra:
            f, k = self.keys[extra[0]]
            raise HFConfigError(f"{f}: unexpected key {k!r} ({len(extra)} in all): expected GPT2LMHeadModel's "
                                f"keys only (config {self.config_path})")
        for key, (name, shape) in want.items():
            if key not in self.keys:
                raise HFConfigError(f"{self.path}: missing key {key!r} (or {PREFIX + key!r}): the config "
                                    f"describes {self.cfg.n_layer} layers of width {self.cfg.n_embd}")
            f, k = self.keys[key]
            sl = self._slice(f, k)
            got = tuple(sl.get_shape())
            if got != shape:
                raise HFConfigError(f"{f}: {k!r} has shape {got}, expected {shape} from {self.config_path}")
        if self.head is not None:
            f, k = self.head
            sl = self._slice(f, k)
            wte = want["wte.weight"][1]
            if tuple(sl.get_shape()) != wte or sl.get_dtype() != self._slice(*self.keys["wte.weight"]).get_dtype():
                raise HFConfigError(f"{f}: {k!r} is {sl.get_dtype()} {tuple(sl.get_shape())}, wte.weight is not: an "
                                    f"untied head, which ringzero does not compute (its head is the embedding)")

    def check_head(self, rank: int = 0, size: int = 1):
        """A present lm_head.weight equals wte.weight, bitwise, on this rank's share of the rows."""
        if self.head is None:
            return
        hs, ws = self._slice(*self.head), self._slice(*self.keys["wte.weight"])
        V, C = ws.get_shape()
        step = max(1, CHUNK // max(C, 1))
        lo, hi = V * rank // size, V * (rank + 1) // size
        for a in range(lo, hi, step):
            b = min(hi, a + step)
            h, w = hs[a:b], ws[a:b]
            if not np.array_equal(h, w):
                row = a + int(np.flatnonzero((h != w).any(axis=1))[0])
                raise HFConfigError(f"{self.head[0]}: 'lm_head.weight' differs from wte.weight (first at row "
                                    f"{row}): an untied head, which ringzero does not compute (its head is the "
                                    f"token embedding)")

    # ---- reads ------------------------------------------------------------------------
    def read(self, name: str, lo: int, hi: int, out):
        """out[:hi-lo] = flat elements [lo, hi) of ringzero parameter ``name`` (padding rows: 0), as float32."""
        f, k = self.keys[hf_name(name)]
        sl = self._slice(f, k)
        shape = tuple(sl.get_shape())
        total = int(np.prod(shape))
        real = min(hi, total)
        out[max(0, real - lo):hi - lo] = 0          # wte's padding rows
        if real <= lo:
            return
        if len(shape) == 1:
            for a in range(lo, real, CHUNK):
                b = min(real, a + CHUNK)
                out[a - lo:b - lo] = sl[a:b]
            return
        cols = total // shape[0]
        rows = max(1, CHUNK // cols)
        r = lo // cols
        while r * cols < real:                      # whole rows, at most CHUNK elements a read
            r2 = min(shape[0], r + rows, -(-real // cols))
            blk = sl[r:r2].reshape(-1)              # (r2 - r) * cols elements of the file's dtype
            a, b = max(lo, r * cols), min(real, r2 * cols)
            out[a - lo:b - lo] = blk[a - r * cols:b - r * cols]
            r = r2

    def fill_master(self, state):
        """The engine's ``init``: every master piece this rank holds, read from the file.

        An error is kept in ``self.error`` (the pieces left zero) instead of raised, so that every
        rank reaches the engine's first collective; the trainer agrees on it just after."""
        from ringzero.runtime.offload import on_disk, write_from
        L = state.layout
        # master a host array (RAM, or a device run's host tier): filled in place; on the device or
        # in an offload file: each piece through one host staging buffer
        in_place = state.xp_of("master") is np and "master" not in state.files
        staging = None if in_place else np.empty(max(L.piece_numel), np.float32)
        try:
            for u in range(len(L.units)):
                pn = L.piece_numel[u]
                for r in state.held_ranks("master"):
                    dst = state.piece("master", u, r)
                    host = dst if in_place else staging[:pn]
                    fill_piece(self, L, u, r, host)
                    if on_disk(dst):
                        write_from(dst, host)
                    elif not in_place:
                        dst.set(host)          # from pageable memory: copied before set returns
            if "master" in state.files:
                state.files["master"].flush()   # on the disk, and out of the page cache (as init_master)
        except Exception as e:
            self.error = f"--init-from {self.path!r}: reading the weights: {type(e).__name__}: {e}".replace("\n", " ")


def fill_piece(src: HFSource, L, u: int, r: int, host):
    """host (piece_numel[u],) = piece (u, r) of the layout, from ``src``; padding zero."""
    pn = L.piece_numel[u]
    lo_u, hi_u = r * pn, (r + 1) * pn           # unit-local elements this piece covers
    host[...] = 0
    for p in L.units[u].params:
        s = L.slots[p.name]
        a, b = s.in_unit, s.in_unit + p.numel
        lo, hi = max(a, lo_u), min(b, hi_u)
        if lo < hi:
            src.read(p.name, lo - a, hi - a, host[lo - lo_u:hi - lo_u])


def load_full(path: str):
    """(GPTConfig, Layout at one shard, full fp32 buffer) of a GPT-2 checkpoint, in one process:
    for tests and sampling; it holds the whole model (4 B x Ψ)."""
    from ringzero.nn.gpt import gpt_units
    from ringzero.runtime.flat import Layout
    src = HFSource(path)
    try:
        L = Layout(gpt_units(src.cfg), shards=1)
        src.check(L)
        src.check_head()
        buf = np.zeros(L.padded, np.float32)
        for u in range(len(L.units)):
            fill_piece(src, L, u, 0, L.unit_full(buf, u))
        return src.cfg, L, buf, src.hf
    finally:
        src.close()


def context_of(path: str) -> int | None:
    """The context (n_positions, or max_position_embeddings) of the config.json of an --init-from PATH;
    None when there is none to read (the full checks say why, later)."""
    try:
        with open(locate(path)[0], encoding="utf-8") as fh:
            hf = json.load(fh)
        v = hf.get("n_positions", hf.get("max_position_embeddings"))
    except (HFConfigError, OSError, ValueError, AttributeError):
        return None
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else None


def for_training(cfg, n: int, rank: int | None):
    """The --init-from source of a trainer Config, checked against its flags, its data and the
    layout at ``n`` ranks (``rank``: this rank's share of the head check; None: all of it).
    Returns (source, GPTConfig). Raises HFConfigError (the trainer's ConfigError turns it into one line)."""
    from ringzero.nn.gpt import gpt_units
    from ringzero.runtime.flat import Layout
    src = HFSource(cfg.init_from)
    try:
        g = src.cfg
        if cfg.model:
            raise HFConfigError(f"--model {cfg.model} and --init-from both give the shapes: drop --model "
                                f"({src.config_path} has n_layer {g.n_layer}, n_embd {g.n_embd})")
        for k, have in (("n_layer", g.n_layer), ("n_head", g.n_head), ("n_embd", g.n_embd)):
            v = getattr(cfg, k)
            if v is not None and v != have:
                raise HFConfigError(f"--{k.replace('_', '-')} {v} differs from {k} = {have} in {src.config_path}: "
                                    f"drop the flag (the imported model gives the shapes)")
        if cfg.seq_len > g.block_size:
            raise HFConfigError(f"--seq-len must be <= the imported model's context: expected <= n_positions = "
                                f"{g.block_size} ({src.config_path}), got {cfg.seq_len}")
        if cfg.steps and not cfg.data.endswith(".bin"):      # --steps 0 (a conversion) reads no data
            raise HFConfigError(f"--init-from needs token ids of the model's tokenizer, got --data "
                                f"{cfg.data or '(the byte-level default corpus)'!r}; HINT: python -m ringzero.data "
                                f"encode --tokenizer tokenizer.json IN.txt OUT.bin, then --data OUT.bin")
        src.check(Layout(gpt_units(g), shards=max(1, n)))
        src.check_head(0, 1) if rank is None else src.check_head(rank, n)
        return src, g
    except BaseException:
        src.close()
        raise
