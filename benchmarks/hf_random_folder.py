"""A Hugging Face folder of random weights at a Llama-family preset's shapes, written one tensor at a time.

What it is
    ``python benchmarks/hf_random_folder.py --model smollm2-135m --out smol [--n-layer 2 --n-embd 64 ...]
    [--dtype bf16] [--shard-mb 1024]``: the folder a user brings to ``python -m ringzero.train --init-from``
    when no hub checkpoint can be downloaded (this machine reaches no hub): transformers' own
    ``config.json`` (``LlamaConfig`` or ``Qwen2Config``, written by its ``save_pretrained``, built from
    ringzero/interop's export config of the preset, with the preset's real vocabulary unless ``--vocab``)
    and ``model.safetensors``, or shards of about ``--shard-mb`` MiB with ``model.safetensors.index.json``
    as transformers shards them. The tensors carry transformers' names (interop's name map:
    ``ringzero.interop.llama.sources``) and transformers' init rule: normal(0, 0.02) for every matrix,
    ones for the norms, and for Qwen2's q/k/v bias normal(0, 0.02) too (so an import has a bias to read).
    One tensor is drawn at a time, so a tinyllama-1.1b folder (2.2 GB in bf16) takes no more memory than its
    largest tensor and one shard. It prints one line: the folder, the model, its parameters and files.
What it is not
    A pretrained model (the loss of random weights is about ln(vocab)), or a ringzero dependency:
    transformers and torch are needed here only. tests/smoke/test_benchmarks.py runs it at a tiny size and
    loads the folder with transformers' ``from_pretrained`` (no missing or unexpected key).
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def preset_config(a):
    """The ringzero LlamaConfig of --model with the dimension flags over it; vocab: --vocab or the preset's."""
    from ringzero.nn.llama_config import PRESETS, model_config
    if a.model not in PRESETS:
        raise SystemExit(f"hf_random_folder: --model must be a Llama-family preset ({', '.join(PRESETS)}), "
                         f"got {a.model!r}")
    try:
        return model_config(a.model, a.vocab or PRESETS[a.model].vocab, n_layer=a.n_layer, n_head=a.n_head,
                            n_embd=a.n_embd, n_kv_head=a.n_kv_head)
    except ValueError as e:
        raise SystemExit(f"hf_random_folder: {e}") from None


def tensors(cfg, seed: int):
    """(transformers key, float32 torch tensor (out, in)) one at a time, in the layout's order."""
    import torch

    from ringzero.interop.llama import sources
    from ringzero.nn.llama_config import llama_units
    gen = torch.Generator().manual_seed(seed)
    for unit in llama_units(cfg):
        for spec in unit.params:
            rows = spec.shape[0]
            for part in sources(spec.name, cfg):
                shape = (part.width,) if len(spec.shape) == 1 else \
                    ((part.width, rows) if part.transposed else (rows, part.width))
                if spec.init == "ones":
                    yield part.key, torch.ones(shape)
                else:                       # matrices and Qwen2's q/k/v bias: transformers' normal(0, 0.02)
                    yield part.key, torch.empty(shape).normal_(0.0, 0.02, generator=gen)


def write(cfg, out: str, dtype: str, shard_mb: float, seed: int):
    """config.json (transformers') + the weights; returns (params, [files], bytes)."""
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from torch_llama import hf_config
    os.makedirs(out, exist_ok=True)
    hc = hf_config(cfg)
    hc.architectures = ["Qwen2ForCausalLM" if hc.model_type == "qwen2" else "LlamaForCausalLM"]
    hc.dtype = dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    hc.save_pretrained(out)
    shards, cur, cur_bytes, params = [], {}, 0, 0
    for key, t in tensors(cfg, seed):
        t = t.to(dtype).contiguous()
        params += t.numel()
        if cur and cur_bytes + t.numel() * t.element_size() > shard_mb * 2**20:
            shards.append(cur)
            cur, cur_bytes = {}, 0
        cur[key] = t
        cur_bytes += t.numel() * t.element_size()
    shards.append(cur)
    names = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, total = {}, 0
    for name, shard in zip(names, shards):
        save_file(shard, os.path.join(out, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        total += sum(t.numel() * t.element_size() for t in shard.values())
    if len(shards) > 1:
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return params, names, total


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a Llama-family preset: smollm2-135m, qwen2.5-0.5b, ...")
    ap.add_argument("--out", required=True, help="the folder to write")
    for flag in ("--n-layer", "--n-head", "--n-kv-head", "--n-embd", "--vocab"):
        ap.add_argument(flag, type=int, default=None, help="over the preset's (vocab: its real one)")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"), help="the files' dtype")
    ap.add_argument("--shard-mb", type=float, default=2048, help="the largest shard, MiB (transformers' 2 GB...)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.shard_mb <= 0:
        ap.error(f"--shard-mb must be > 0, got {a.shard_mb}")
    if os.path.exists(os.path.join(a.out, "config.json")):
        ap.error(f"--out {a.out!r} already holds a config.json: choose a new folder")
    cfg = preset_config(a)
    params, names, total = write(cfg, a.out, a.dtype, a.shard_mb, a.seed)
    kind = "Qwen2ForCausalLM" if cfg.qkv_bias else "LlamaForCausalLM"
    print(f"wrote {a.out}: {kind} at {a.model}'s shapes, {cfg.n_layer}L {cfg.n_embd}C {cfg.n_head}H "
          f"{cfg.n_kv_head}KV, vocab {cfg.n_tokens:,}, {params:,} params, {a.dtype}, {len(names)} file(s) "
          f"{total:,} bytes" + (" + model.safetensors.index.json" if len(names) > 1 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
