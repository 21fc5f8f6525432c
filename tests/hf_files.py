"""Test helpers: GPT-2 checkpoints in Hugging Face's file layout, written with NumPy (no torch).

What it is
    ``write_gpt2(folder, ...)`` writes config.json and random weights under
    GPT2LMHeadModel's own key names, spelled out here from transformers'
    modeling_gpt2 (not from ringzero's map, which the tests check): as the
    hub's files (no ``transformer.`` prefix, with the ``attn.bias`` /
    ``attn.masked_bias`` buffers) or as save_pretrained's (with the prefix),
    in one file or sharded with an index. ``small_bpe(folder, text, vocab)``
    trains a byte-level BPE with the ``tokenizers`` trainer and saves its
    tokenizer.json: nothing is downloaded.

What it is not
    transformers itself: tests/test_hf_interop.py builds real GPT2LMHeadModels.
"""
from __future__ import annotations

import json
import os

import numpy as np

CONFIG = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 300, "n_positions": 32,
          "n_embd": 32, "n_layer": 2, "n_head": 4, "n_inner": None, "activation_function": "gelu_new",
          "layer_norm_epsilon": 1e-05, "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1,
          "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
          "bos_token_id": 299, "eos_token_id": 299, "initializer_range": 0.02}


def gpt2_tensors(conf: dict, seed: int = 0, dtype=np.float32) -> dict:
    """{GPT-2 key without prefix: array} of random weights for config ``conf``."""
    rng = np.random.default_rng(seed)
    V, T, C, L = conf["vocab_size"], conf["n_positions"], conf["n_embd"], conf["n_layer"]

    def r(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(dtype)
    out = {"wte.weight": r(V, C), "wpe.weight": r(T, C)}
    for i in range(L):
        h = f"h.{i}."
        out.update({h + "ln_1.weight": 1 + r(C), h + "ln_1.bias": r(C),
                    h + "attn.c_attn.weight": r(C, 3 * C), h + "attn.c_attn.bias": r(3 * C),
                    h + "attn.c_proj.weight": r(C, C), h + "attn.c_proj.bias": r(C),
                    h + "ln_2.weight": 1 + r(C), h + "ln_2.bias": r(C),
                    h + "mlp.c_fc.weight": r(C, 4 * C), h + "mlp.c_fc.bias": r(4 * C),
                    h + "mlp.c_proj.weight": r(4 * C, C), h + "mlp.c_proj.bias": r(C)})
    out.update({"ln_f.weight": 1 + r(C), "ln_f.bias": r(C)})
    return out


def write_gpt2(folder, conf: dict | None = None, tensors: dict | None = None, prefix: bool = False,
               buffers: bool = False, shards: int = 1, head: str | None = None, seed: int = 0) -> dict:
    """Write a GPT-2 folder; returns the tensors (keys without prefix).

    prefix: save_pretrained's ``transformer.`` keys; buffers: the mask buffers of older hub files;
    shards > 1: model-0000k-of-0000n.safetensors + model.safetensors.index.json;
    head: None (tied, left out), "tied" (lm_head.weight = wte) or "untied" (lm_head.weight != wte)."""
    from safetensors.numpy import save_file
    conf = dict(CONFIG if conf is None else conf)
    tensors = gpt2_tensors(conf, seed) if tensors is None else tensors
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(conf, f)
    keyed = {("transformer." if prefix else "") + k: v for k, v in tensors.items()}
    if buffers:
        T = conf["n_positions"]
        for i in range(conf["n_layer"]):
            keyed[f"h.{i}.attn.bias"] = np.tril(np.ones((T, T), np.float32))[None, None]
            keyed[f"h.{i}.attn.masked_bias"] = np.array(-1e4, np.float32)
    if head == "tied":
        keyed["lm_head.weight"] = tensors["wte.weight"].copy()
    elif head == "untied":
        keyed["lm_head.weight"] = tensors["wte.weight"] + np.float32(1e-3)
    keys = list(keyed)
    if shards == 1:
        save_file(keyed, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        return tensors
    wm = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: keyed[k] for k in keys[s::shards]}
        save_file(part, os.path.join(folder, name), metadata={"format": "pt"})
        wm.update({k: name for k in part})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": wm}, f)
    return tensors


def small_bpe(folder, text: str, vocab: int = 300) -> str:
    """A byte-level BPE (GPT-2's pre-tokenizer and decoder) trained on ``text``; its tokenizer.json path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    tok.train_from_iterator([text], trainer)
    path = os.path.join(str(folder), "tokenizer.json")
    tok.save(path)
    return path
