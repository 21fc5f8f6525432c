"""The model ``benchmarks/train_peer.py`` trains on both sides: its shapes from the flags, its data's vocabulary.

What it is
    ``resolve_model(a)`` fills the driver's a.n_layer, a.n_head, a.n_embd, a.block (and a.n_kv_head
    for a Llama-family preset) from ``--model`` and the dimension flags, as the trainer's
    ``model_config`` does (``ringzero.nn.families``: a GPT-2 preset or the small GPT default, or a
    Llama-family preset: smollm2-135m, qwen2.5-0.5b, tinyllama-1.1b, ...). ``peer_flags(a)`` is what the
    torch ranks need besides those to build the same model. ``vocab_data(a, work)`` writes the
    default corpus's bytes as ids of an N-token vocabulary (``--vocab N``).
What it is not
    A model: the torch side is torch_gpt.TorchGPT or torch_llama.TorchLlama (transformers' own),
    the ringzero side the trainer's.
"""
from __future__ import annotations

import os


def is_llama(a) -> bool:
    """Whether --model names a Llama-family preset."""
    from ringzero.nn.families import LLAMA, family_of, preset_names
    return bool(a.model) and a.model in preset_names() and family_of(a.model) == LLAMA


def resolve_model(a):
    """Fill a.n_layer, a.n_head, a.n_embd and a.block (and a.n_kv_head) from --model (the presets of
    ringzero.nn.families, the one source of their shapes) and the flags given, as the trainer's
    model_config does; the vocabulary is the data's (bytes: 256; --vocab N: N rounded up to a multiple
    of 64). Returns the config (GPTConfig, or LlamaConfig for a Llama-family preset); ValueError on
    shapes that do not fit."""
    from ringzero.nn.families import model_config
    from ringzero.nn.gpt import GPTConfig, vocab_for
    vocab = vocab_for(a.vocab - 1) if a.vocab else 256
    if is_llama(a):             # a preset's context; the flags over its shapes (head size re-derived)
        cfg = model_config(a.model, vocab, n_layer=a.n_layer, n_head=a.n_head, n_embd=a.n_embd,
                           n_kv_head=a.n_kv_head)
        a.n_kv_head = cfg.n_kv_head
    else:
        if a.n_kv_head is not None:
            raise ValueError(f"--n-kv-head applies to a Llama-family --model, got --model {a.model!r}")
        small = GPTConfig()                  # this benchmark's small default: 4 x 256, 4 heads
        dims = {k: getattr(a, k) if getattr(a, k) is not None else (None if a.model else getattr(small, k))
                for k in ("n_layer", "n_head", "n_embd")}
        cfg = model_config(a.model or None, vocab, block_size=None if a.model else a.seq_len, **dims)
    a.n_layer, a.n_head, a.n_embd, a.block = cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size
    return cfg


def peer_flags(a) -> list:
    """The torch ranks' flags for a Llama-family preset (none for a GPT: its shapes are the dimension flags)."""
    return ["--model", a.model, "--n-kv-head", str(a.n_kv_head)] if is_llama(a) else []


def describe(a) -> str:
    """The model in the driver's first line."""
    if is_llama(a):
        return f"Llama {a.model} n_layer={a.n_layer} n_head={a.n_head} n_kv_head={a.n_kv_head} n_embd={a.n_embd}"
    return f"GPT {a.model + ' ' if a.model else ''}n_layer={a.n_layer} n_head={a.n_head} n_embd={a.n_embd}"


def vocab_data(a, work):
    """--vocab N: the default corpus's bytes as a uint16 token file (nanoGPT's .bin) whose last token is
    N - 1, so that both sides build an embedding and a head of that size (``vocab_for``: N rounded up
    to a multiple of 64, 50257 -> 50304) and train on the same bytes. Sets a.data."""
    import numpy as np

    from ringzero.app.data import stdlib_corpus
    c = stdlib_corpus()
    tokens = np.concatenate([c.train, c.val]).astype(np.uint16)
    tokens[-1] = a.vocab - 1                # in the held-out tail (the last 5 %): never a training target
    a.data = os.path.join(work, f"bytes-as-{a.vocab}-ids.bin")
    tokens.tofile(a.data)
