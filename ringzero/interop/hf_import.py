"""``--init-from PATH``: a Hugging Face checkpoint (GPT-2, Llama, Qwen2, Mistral) read into each rank's shards.

What it is
    ``HFSource(path)`` opens, lazily, what PATH names:

        DIR/                        config.json and model.safetensors, or
                                    config.json and model.safetensors.index.json (sharded)
        FILE.safetensors            one file; its config.json beside it
        FILE.safetensors.index.json a sharded index; config.json beside it

    and checks it against the model its config.json describes, by
    ``model_type`` (interop/hf_families.py: interop/gpt2.py, interop/llama.py):
    every key once (GPT-2's with or without the ``transformer.`` prefix), no
    key left over (buffers of older files aside), every shape; a
    ``lm_head.weight`` of a tied model must equal the embedding (``check_head``,
    each rank comparing its share of the rows), else it is refused; an untied
    Llama's is its ``head.w``. Only headers are read for these checks.

    ``fill_master(state)`` is the engine's ``init`` (runtime/engine.py): for
    every master piece this rank holds it reads the unit-local elements that
    piece covers, parameter by parameter, through zero-copy views of the mapped
    files (``TensorFile(...).get_slice``, interop/safetensors_files.py; fp32,
    fp16 and bf16 alike), whole rows of the parameter at most ``CHUNK``
    elements at a time, cast to float32 into the piece. A parameter is its
    Parts side by side (a Llama's q|k|v and gate|up): a Part stored as the
    parameter's rows is read by rows, so a process reads its own pieces plus
    two partial rows per parameter; a transposed Part (HF's (out, in)
    projections) is read by columns, which touches every file row's page for
    the columns it needs. Nothing model-sized is allocated beside the
    engine's buffers. The embedding's (and an untied head's) rows past
    ``vocab_size`` (the padding to a multiple of 64) are zero, and stay zero:
    the head scores only the real rows (``real_vocab``).

What it is not
    No collectives: errors are raised (or, inside ``fill_master``, kept in
    ``error``) for the trainer to agree on (app/exits.py). No pytorch_model.bin
    (pickles are not read): refused with a hint.
"""
from __future__ import annotations

import json
from contextlib import ExitStack

import numpy as np

from ringzero.interop.hf_families import HEAD, family_of
from ringzero.interop.safetensors_files import HFConfigError, TensorFile, locate

CHUNK = 1 << 22                    # elements per read (16 MiB of float32)


class HFSource:
    """A Hugging Face checkpoint on disk (GPT-2 or the Llama family): its config, and lazy ranged reads."""

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
        self.family = family_of(self.hf, self.config_path)
        self.cfg = self.family.config(self.hf, self.config_path)
        self._stack = ExitStack()
        self._open = {}              # file -> TensorFile
        self.keys = {}               # key as the family names it -> (file, key as stored)
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
                s = k if k == HEAD else self.family.strip(k)
                if s in self.keys:
                    self.close()
                    raise HFConfigError(f"{f}: key {k!r} appears twice ({self.keys[s][1]!r} in {self.keys[s][0]})")
                self.keys[s] = (f, k)
        # a head the config ties to the embedding: a copy of it (checked bitwise), not a parameter
        self.head = self.keys.get(HEAD) if not self.family.untied_head(self.cfg) else None

    def close(self):
        self._stack.close()
        self._open.clear()

    # ---- checks (headers only) ------------------------------------------------------
    def _slice(self, f, k):
        return self._open[f].get_slice(k)

    @property
    def model_name(self) -> str:
        return {"gpt2": "GPT2LMHeadModel"}.get(self.family.name, f"{self.hf.get('model_type')} (Llama family)")

    def expected(self, layout) -> dict:
        """{file key (as the family names it): (ringzero name, file shape)} of every parameter of ``layout``."""
        out = {}
        for name, s in layout.slots.items():
            shape = tuple(s.spec.shape)
            real = self.cfg.n_tokens if name in ("wte", "head.w") else shape[0]    # padding rows: not in the file
            for p in self.family.sources(name, self.cfg):
                out[p.key] = (name, (p.width,) if len(shape) == 1 else
                              (p.width, shape[0]) if p.transposed else (real, p.width))
        return out

    def check(self, layout):
        """Every key and shape the layout needs; nothing left over. Raises HFConfigError."""
        want = self.expected(layout)
        extra = sorted(k for k in self.keys if k not in want and k != HEAD and not self.family.ignored(k))
        if extra:
            f, k = self.keys[extra[0]]
            raise HFConfigError(f"{f}: unexpected key {k!r} ({len(extra)} in all): expected {self.model_name}'s "
                                f"keys only (config {self.config_path})")
        for key, (name, shape) in want.items():
            if key not in self.keys:
                alt = f" (or {self.family.prefix + key!r})" if self.family.prefix and key != HEAD else ""
                raise HFConfigError(f"{self.path}: missing key {key!r}{alt}: the config describes "
                                    f"{self.cfg.n_layer} layers of width {self.cfg.n_embd}")
            f, k = self.keys[key]
            got = tuple(self._slice(f, k).get_shape())
            if got != shape:
                raise HFConfigError(f"{f}: {k!r} has shape {got}, expected {shape} from {self.config_path}")
        if self.head is not None:
            f, k = self.head
            sl, emb = self._slice(f, k), self._slice(*self.keys[self.family.embed])
            if sl.get_shape() != emb.get_shape() or sl.get_dtype() != emb.get_dtype():
                raise HFConfigError(f"{f}: {k!r} is {sl.get_dtype()} {tuple(sl.get_shape())}, "
                                    f"{self.family.embed} is not: an untied head, {self._untied_hint()}")

    def _untied_hint(self) -> str:
        if self.family.name == "gpt2":
            return "which ringzero does not compute for a GPT-2 (its head is the embedding)"
        return f"while {self.config_path} says tie_word_embeddings (HINT: set it to false)"

    def check_head(self, rank: int = 0, size: int = 1):
        """A tied head present in the file equals the embedding, bitwise, on this rank's share of the rows."""
        if self.head is None:
            return
        hs, ws = self._slice(*self.head), self._slice(*self.keys[self.family.embed])
        V, C = ws.get_shape()
        step = max(1, CHUNK // max(C, 1))
        lo, hi = V * rank // size, V * (rank + 1) // size
        for a in range(lo, hi, step):
            b = min(hi, a + step)
            h, w = hs[a:b], ws[a:b]
            if not np.array_equal(h.view(np.uint32), w.view(np.uint32)):
                row = a + int(np.flatnonzero((h.view(np.uint32) != w.view(np.uint32)).any(axis=1))[0])
                raise HFConfigError(f"{self.head[0]}: 'lm_head.weight' differs from {self.family.embed} (first at "
                                    f"row {row}): an untied head, {self._untied_hint()}")

    # ---- reads ------------------------------------------------------------------------
    def read(self, name: str, lo: int, hi: int, out):
        """out[:hi-lo] = flat elements [lo, hi) of ringzero parameter ``name`` (padding rows: 0), as float32.

        The parameter is its Parts side by side: a 1-D one their concatenation, a 2-D one (R, N)
        their column blocks, each the file's rows (padding rows past the file: 0) or, transposed,
        the file's columns. Whole rows of the parameter are built at most CHUNK elements at a time."""
        parts = self.family.sources(name, self.cfg)
        sls = [self._slice(*self.keys[p.key]) for p in parts]
        if len(sls[0].get_shape()) == 1:                     # 1-D: the parts one after another
            at = 0
            for p, sl in zip(parts, sls):
                a, b = max(lo, at), min(hi, at + p.width)
                if a < b:
                    out[a - lo:b - lo] = sl[a - at:b - at]
                at += p.width
            return
        N = sum(p.width for p in parts)                      # columns of the parameter
        rows = max(1, CHUNK // N)
        r = lo // N
        while r * N < hi:
            r2 = min(r + rows, -(-hi // N))
            blk = np.zeros((r2 - r, N), np.float32)          # rows [r, r2) of the parameter
            c = 0
            for p, sl in zip(parts, sls):
                if p.transposed:                             # the file: (width, R)
                    blk[:, c:c + p.width] = sl[:, r:r2].T
                else:                                        # the file: (real rows, width); past them: 0
                    real = sl.get_shape()[0]
                    if r < real:
                        blk[:min(r2, real) - r, c:c + p.width] = sl[r:min(r2, real)]
                c += p.width
            flat = blk.reshape(-1)
            a, b = max(lo, r * N), min(hi, r2 * N)
            out[a - lo:b - lo] = flat[a - r * N:b - r * N]
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
    """(config, Layout at one shard, full fp32 buffer, config.json) of a Hugging Face checkpoint, in one
    process: for tests, sampling and evaluation; it holds the whole model (4 B x Ψ)."""
    from ringzero.nn.families import units_of
    from ringzero.runtime.flat import Layout
    src = HFSource(path)
    try:
        L = Layout(units_of(src.cfg), shards=1)
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
    from ringzero.nn.families import units_of
    from ringzero.runtime.flat import Layout
    src = HFSource(cfg.init_from)
    try:
        g = src.cfg
        if cfg.model:
            raise HFConfigError(f"--model {cfg.model} and --init-from both give the shapes: drop --model "
                                f"({src.config_path} has n_layer {g.n_layer}, n_embd {g.n_embd})")
        for k, have in (("n_layer", g.n_layer), ("n_head", g.n_head), ("n_embd", g.n_embd),
                        ("n_kv_head", getattr(g, "n_kv_head", None))):
            if have is None:
                if getattr(cfg, k, None) is not None:
                    raise HFConfigError(f"--{k.replace('_', '-')} applies to a Llama-family model; "
                                        f"{src.config_path} is a GPT-2: drop the flag")
                continue
            v = getattr(cfg, k)
            if v is not None and v != have:
                raise HFConfigError(f"--{k.replace('_', '-')} {v} differs from {k} = {have} in {src.config_path}: "
                                    f"drop the flag (the imported model gives the shapes)")
        if cfg.seq_len > g.block_size:
            what = "n_positions" if src.family.name == "gpt2" else "max_position_embeddings"
            raise HFConfigError(f"--seq-len must be <= the imported model's context: expected <= {what} = "
                                f"{g.block_size} ({src.config_path}), got {cfg.seq_len}")
        if cfg.steps and not cfg.data.endswith(".bin"):      # --steps 0 (a conversion) reads no data
            raise HFConfigError(f"--init-from needs token ids of the model's tokenizer, got --data "
                                f"{cfg.data or '(the byte-level default corpus)'!r}; HINT: python -m ringzero.data "
                                f"encode --tokenizer tokenizer.json IN.txt OUT.bin, then --data OUT.bin")
        src.check(Layout(units_of(g), shards=max(1, n)))
        src.check_head(0, 1) if rank is None else src.check_head(rank, n)
        return src, g
    except BaseException:
        src.close()
        raise
