"""``python -m ringzero.sample CHECKPOINT_DIR --prompt "def " --tokens 200``: text from a checkpoint.

What it is
    One process, no MPI. It reads a checkpoint saved at any rank count and
    stage (ringzero.runtime.checkpoint: manifest, per-rank files, unit-local
    offsets), rebuilds the GPT from the manifest's layout table (shapes) and
    config (heads), gathers the weights into ONE full fp32 buffer at Nd = 1 by
    slicing the old files parameter by parameter, and generates.

        memory: 4 B x Ψ (the model, fp32) + one parameter in the file's dtype
                + the hash buffer of the sha256 check (<= 4 MiB); never a whole
                shard file, never master/Adam when sampling from params.

    ``generate(model, params, prompt_ids, n, temperature, top_k, rng)`` is the
    decoding loop, shared with the trainer's end-of-run sample. It is
    deterministic for a NumPy Generator: temperature 0 is greedy (argmax, no
    draws), else one ``rng.random()`` per token, inverted through the CDF of
    softmax(logits / temperature) restricted to the top-k logits.

What it is not
    No KV cache (each token reruns the forward over the last block_size
    tokens: fine for the sizes trained here, O(n·T) forwards). No tokenizer
    of its own: ``--tokenizer tokenizer.json`` (interop/tokens.py) encodes the
    prompt and decodes the output; without it a byte-level model (vocab <= 256)
    reads the prompt as UTF-8 bytes and prints bytes (errors="replace"), and a
    token-id model takes ``--prompt-ids`` and prints ids. DIR may also be a
    Hugging Face folder of any family ringzero reads (interop/hf_import.py's
    ``load_full``), and the model any family's (nn/families.py).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from ringzero.interop.gpt2 import HFConfigError
from ringzero.interop.gpt2 import config_from_manifest as gpt_from_manifest
from ringzero.nn.families import build
from ringzero.runtime import checkpoint as ck
from ringzero.runtime.flat import Layout


class SampleError(ValueError):
    """Bad input to the sampler: one line, exit 2."""


# ---------------------------------------------------------------- the model
def config_from_manifest(m: dict):
    """The model config of a checkpoint (interop/gpt2.py's ``config_from_manifest``), or SampleError."""
    try:
        return gpt_from_manifest(m)
    except HFConfigError as e:
        raise SampleError(str(e)) from None


def load(path: str, weights: str = "params"):
    """(model, P, manifest, path) of a checkpoint; P = named fp32 views of one full buffer.

    ``weights="params"``: the storage-dtype params the run computed with (fp16
    rounding included, what the trainer's own sample uses), widened to fp32;
    ``"master"``: the fp32 master. Only that class's files are verified and read.
    """
    if weights not in ("params", "master"):
        raise SampleError(f"weights must be params or master, got {weights!r}")
    p = ck.resolve(path)
    m = ck.read_manifest(p)
    ck.check_layout(m, p)                         # a well-formed manifest before reading it
    cfg = config_from_manifest(m)
    model = build(cfg)
    new = Layout(model.units, shards=1)
    old = ck.check_layout(m, p, new)              # and the rebuilt model matches its table
    err = ck.verify(p, m, [ck.shard_file(weights, k) for k in range(old.shards)])
    if err:
        raise ck.CheckpointError(err)
    src = np.dtype(m["classes"][weights])
    full = np.zeros(new.padded, np.float32)      # (Ψ padded at Nd = 1,) the only model-sized buffer
    stage = np.empty(max(s.spec.numel for s in old.slots.values()), src)   # one parameter
    fhs = {}
    try:
        for name, s in old.slots.items():
            n, d = s.spec.numel, new.slots[name].offset
            if n:   # unit-local [in_unit, in_unit + n) of unit s.unit, from the files that hold it
                ck.read_range(fhs, p, weights, old, s.unit, s.in_unit, s.in_unit + n, stage)
                full[d:d + n] = stage[:n]                  # widen fp16 -> fp32 (exact)
    finally:
        for fh in fhs.values():
            fh.close()
    return model, new.views(full), m, p


# ----------------------------------------------------------------- decoding
def next_token(logits, temperature: float, top_k: int | None, rng) -> int:
    """One token from (V,) logits: argmax at temperature 0, else a draw from
    softmax(logits / temperature) over the top_k largest (ties at the k-th kept)."""
    z = np.asarray(logits, np.float64)
    if temperature == 0:
        return int(np.argmax(z))
    z = z / temperature
    if top_k is not None and top_k < z.size:
        kth = np.partition(z, z.size - top_k)[z.size - top_k]
        z = np.where(z >= kth, z, -np.inf)
    z = np.exp(z - z.max())                              # (V,) unnormalised probabilities
    cdf = np.cumsum(z)
    u = rng.random() * cdf[-1]                           # in [0, total)
    return int(min(np.searchsorted(cdf, u, side="right"), z.size - 1))


def generate(model, params, prompt_ids, n: int, temperature: float = 0.8, top_k: int | None = None,
             rng=None) -> np.ndarray:
    """The prompt followed by n generated tokens: (T0 + n,) int64.

    model: a GPT (``model.logits(P, idx)`` and ``model.cfg``); params: its
    named views (``layout.views(full)``). The context is the last block_size
    tokens. rng: a NumPy Generator, needed when temperature > 0.
    """
    from ringzero.comm.backend import to_host
    ids = np.asarray(prompt_ids).ravel()
    V, T = model.cfg.vocab, model.cfg.block_size
    if ids.size < 1:
        raise ValueError("the prompt is empty: expected at least one token")
    if not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0 or ids.max() >= V:
        raise ValueError(f"prompt ids must be integers in [0, {V}), got {ids.dtype} in "
                         f"[{ids.min()}, {ids.max()}]")
    if int(n) != n or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    if not np.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and (int(top_k) != top_k or top_k < 1):
        raise ValueError(f"top_k must be an int >= 1 or None, got {top_k!r}")
    if temperature > 0 and rng is None:
        raise ValueError("sampling (temperature > 0) needs rng, a numpy Generator: the output "
                         "is a function of its seed")
    out = np.empty(ids.size + int(n), np.int64)
    out[:ids.size] = ids
    for t in range(ids.size, out.size):
        ctx = out[max(0, t - T):t][None, :]                         # (1, <= T)
        lg = to_host(model.logits(params, ctx))[0, -1]              # (V,) last position
        out[t] = next_token(lg, temperature, top_k, rng)
    return out


# ------------------------------------------------------------------ text
def byte_level(cfg, m: dict) -> bool:
    """Token ids are bytes: vocab <= 256 and the run did not train on a token .bin."""
    data = str((m.get("config") or {}).get("data", ""))
    return cfg.vocab <= 256 and not data.endswith(".bin")


def encode(text: str, vocab: int) -> np.ndarray:
    """UTF-8 bytes of text as ids, each checked against the vocabulary."""
    ids = np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int64)
    if ids.size == 0:
        raise SampleError('the prompt is empty: expected at least one byte, e.g. --prompt "def "')
    bad = np.flatnonzero(ids >= vocab)
    if bad.size:
        i = int(bad[0])
        raise SampleError(f"prompt byte {ids[i]} at position {i} is outside the model's vocabulary: "
                          f"expected ids < {vocab}, got {ids[i]} (a model trained on ids < {vocab}: "
                          f"give --prompt-ids)")
    return ids


def decode(ids, as_bytes: bool) -> str:
    ids = np.asarray(ids).ravel()
    if as_bytes:
        return bytes(ids.astype(np.uint8)).decode("utf-8", errors="replace")
    return " ".join(str(int(i)) for i in ids)


# ------------------------------------------------------------------- CLI
def build_parser():
    ap = argparse.ArgumentParser(
        prog="python -m ringzero.sample",
        description="Generate from a ringzero checkpoint saved at any rank count (one process, no "
                    "MPI). Prints the prompt and its continuation on stdout; what was loaded on stderr.",
        epilog='Example: python -m ringzero.sample checkpoints --prompt "def " --tokens 200 '
               "--temperature 0.8 --top-k 40 --seed 1")
    ap.add_argument("dir", help="a step-NNNNNN checkpoint, a save directory (its latest), or a Hugging Face "
                                "Hugging Face folder (config.json + model.safetensors)")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--prompt", default="\n", help='text, read as UTF-8 bytes (default "\\n")')
    src.add_argument("--prompt-ids", help="comma-separated token ids, for a token-id model")
    ap.add_argument("--tokenizer", help="a tokenizers tokenizer.json: encodes --prompt, decodes the output")
    ap.add_argument("--tokens", type=int, default=200, help="tokens to generate (default 200)")
    ap.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    ap.add_argument("--top-k", type=int, default=None, help="sample among the k most likely")
    ap.add_argument("--seed", type=int, default=0, help="NumPy Generator seed (default 0)")
    ap.add_argument("--weights", choices=("params", "master"), default="params",
                    help="the run's storage-dtype params (default) or its fp32 master")
    return ap


def _prompt(a, model, m, tok, as_bytes) -> np.ndarray:
    """The prompt's ids: --prompt-ids, or --prompt through the tokenizer, or as UTF-8 bytes."""
    n = model.n_tokens
    if a.prompt_ids is not None:
        try:
            ids = np.array([int(t) for t in a.prompt_ids.split(",")], np.int64)
        except ValueError:
            raise SampleError(f"--prompt-ids must be comma-separated integers, got {a.prompt_ids!r}") from None
    elif tok is not None:
        ids = np.array(tok.encode(a.prompt, add_special_tokens=False).ids, np.int64)
        if ids.size == 0:
            raise SampleError(f"--prompt {a.prompt!r} encodes to no tokens: expected at least one")
    elif not as_bytes:
        raise SampleError(f"this model reads token ids (vocab {n}, data "
                          f"{(m.get('config') or {}).get('data')!r}), not text: give --tokenizer or --prompt-ids")
    else:
        return encode(a.prompt, n)
    if ids.min() < 0 or ids.max() >= n:
        what = "--prompt-ids" if a.prompt_ids is not None else f"--prompt's ids ({a.tokenizer})"
        raise SampleError(f"{what} must be in [0, {n}) (the model's vocabulary), got [{ids.min()}, {ids.max()}]")
    return ids


def load_any(path: str, weights: str):
    """(model, P, manifest, path, what) of a ringzero checkpoint or a Hugging Face folder (GPT-2, Llama,
    Qwen2, Mistral)."""
    if os.path.isfile(os.path.join(path, "config.json")):      # a Hugging Face folder (interop/hf_import.py)
        from ringzero.interop.hf_import import HFConfigError, load_full
        try:
            cfg, L, buf, hf = load_full(path)
            model_type = hf.get("model_type", "gpt2")
        except HFConfigError as e:
            raise SampleError(str(e)) from None
        return build(cfg), L.views(buf), {"config": {}}, path, f"a Hugging Face {model_type} (fp32)"
    model, P, m, p = load(path, weights)
    return model, P, m, p, (f"step {m['step']}, Ψ = {m['psi']:,}, saved as {m['shards']} shard(s), stage "
                            f"{m['stage']}, {weights} ({m['classes'][weights]})")


def main(argv=None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    try:
        if a.tokens < 0:
            raise SampleError(f"--tokens must be >= 0, got {a.tokens}")
        if not (a.temperature >= 0 and np.isfinite(a.temperature)):
            raise SampleError(f"--temperature must be >= 0 (0 = greedy), got {a.temperature}")
        if a.top_k is not None and a.top_k < 1:
            raise SampleError(f"--top-k must be >= 1, got {a.top_k}")
        if not os.path.exists(a.dir):
            raise SampleError(f"{a.dir!r} does not exist: expected a checkpoint directory "
                              f"(step-NNNNNN), a save directory or a Hugging Face folder")
        tok = None
        if a.tokenizer:
            from ringzero.interop.tokens import TokenizerError, load_tokenizer
            try:
                tok = load_tokenizer(a.tokenizer)
            except TokenizerError as e:
                raise SampleError(str(e)) from None
        t0 = time.perf_counter()
        model, P, m, path, what = load_any(a.dir, a.weights)
        as_bytes = tok is None and byte_level(model.cfg, m)
        ids = _prompt(a, model, m, tok, as_bytes)
        c = model.cfg
        print(f"ringzero.sample: {path}: {type(model).__name__} L={c.n_layer} C={c.n_embd} H={c.n_head} "
              f"T={c.block_size} V={c.n_tokens}{f' (padded {c.vocab})' if c.vocab != c.n_tokens else ''}, {what}, "
              f"read in {time.perf_counter() - t0:.2f} s", file=sys.stderr)
    except (SampleError, ck.CheckpointError, OSError) as e:
        print(f"ringzero.sample: error: {ck.error_line(e)}", file=sys.stderr)
        return 2
    out = generate(model, P, ids, a.tokens, a.temperature, a.top_k, np.random.default_rng(a.seed))
    print(tok.decode(out.tolist()) if tok is not None else decode(out, as_bytes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
