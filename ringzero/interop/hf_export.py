"""``python -m ringzero.checkpoint export --format hf CKPT OUT/``: a checkpoint as a transformers model.

What it is
    ``export_hf(ckpt, out_dir, dtype, vocab)`` writes OUT/config.json and
    OUT/model.safetensors, which transformers' ``from_pretrained(OUT)`` (GPT2LMHeadModel,
    LlamaForCausalLM, Qwen2ForCausalLM, by the family) loads with no missing and no
    unexpected key. For a GPT-2 (a Llama writes its own names, interop/llama.py: each
    fused parameter split into its q/k/v or gate/up tensors, transposed back to (out, in);
    lm_head.weight only when untied; config.json with model_type llama, or qwen2 with a
    q/k/v bias):

        model.safetensors   transformer.<GPT-2 name> for every parameter
                            (interop/gpt2.py), as save_pretrained writes them; no
                            lm_head.weight (tied to wte, which transformers
                            restores); wte's padding rows left out, so its
                            first dimension is vocab_size again
        config.json         the imported model's own config.json (its token
                            ids, its dropout) with the shapes and the
                            exact-compute fields set from the checkpoint

    The tensors stream one parameter at a time through runtime/export.py's
    writer, from the fp32 master (or the run's fp16/bf16 params with
    --dtype), from any number of shards: memory is one parameter. Both files
    are written beside themselves and renamed into place.

What it is not
    No tokenizer files (bring the tokenizer.json you encoded with), no
    generation config, no torch: transformers is never imported here.
"""
from __future__ import annotations

import dataclasses
import json
import os
import secrets
import time

from ringzero.interop.gpt2 import config_from_manifest
from ringzero.interop.hf_families import HEAD, family_of_config
from ringzero.interop.safetensors_files import HFConfigError
from ringzero.runtime.export import open_export, write_tensors
from ringzero.runtime.flat import Layout
from ringzero.runtime.manifest import CheckpointError, check_layout, fsync_dir

_TORCH_DTYPE = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def hf_tensors(layout, cfg, fam) -> list:
    """write_tensors' entries of an export: (param, file key, shape[, pick]) for every Part of every
    parameter; the padding rows of wte / head.w left out, the transposed Parts picked as views."""
    out = []
    for name, s in layout.slots.items():
        shape = tuple(s.spec.shape)
        parts, c = fam.sources(name, cfg), 0
        for p in parts:
            key = p.key if p.key == HEAD else fam.prefix + p.key
            if len(shape) == 1:
                out.append((name, key, (p.width,), lambda v, c=c, w=p.width: v[c:c + w]))
            elif p.transposed:
                out.append((name, key, (p.width, shape[0]), lambda v, c=c, w=p.width: v[:, c:c + w].T))
            else:
                rows = cfg.n_tokens if name in ("wte", "head.w") else shape[0]
                if len(parts) == 1:           # whole rows: the leading elements, read as they are
                    out.append((name, key, (rows, p.width)))
                else:
                    out.append((name, key, (rows, p.width), lambda v, c=c, w=p.width, r=rows: v[:r, c:c + w]))
            c += p.width
    return out


def export_hf(path: str, out_dir: str, dtype: str = "fp32", vocab: int | None = None) -> dict:
    """Write ``out_dir``/config.json and model.safetensors from checkpoint ``path``. Serial."""
    from ringzero.nn.families import units_of
    ex = open_export(path, dtype)
    try:
        cfg = config_from_manifest(ex.manifest)
    except HFConfigError as e:
        raise CheckpointError(f"{ex.path}: --format hf exports a GPT or a Llama: {e}") from None
    fam = family_of_config(cfg)
    check_layout(ex.manifest, ex.path, Layout(units_of(cfg), shards=1))   # the names are the family's
    if vocab is not None:
        if not 1 <= vocab <= cfg.vocab:
            raise CheckpointError(f"--vocab must be in [1, {cfg.vocab}] (the checkpoint's wte rows), got {vocab}")
        cfg = dataclasses.replace(cfg, real_vocab=vocab)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise CheckpointError(f"{out_dir!r} is a file: --format hf writes a folder (config.json, model.safetensors)")
    os.makedirs(out_dir, exist_ok=True)
    V, C = cfg.n_tokens, cfg.n_embd
    tensors = hf_tensors(ex.layout, cfg, fam)
    weights = os.path.join(out_dir, "model.safetensors")
    write_tensors(ex, tensors, {"format": "pt"}, weights)     # transformers requires format "pt"
    base = (ex.manifest.get("config") or {}).get("hf")
    conf = fam.hf_config(cfg, base if isinstance(base, dict) else None)
    conf.pop("torch_dtype", None)
    conf["dtype"] = _TORCH_DTYPE[dtype]
    conf_path = os.path.join(out_dir, "config.json")
    tmp = f"{conf_path}.tmp-{secrets.token_hex(4)}"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(conf, fh, indent=2, sort_keys=True)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, conf_path)
        fsync_dir(out_dir)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    pad_rows = (cfg.vocab - V) * C * (1 if getattr(cfg, "tied", True) else 2)
    return {"out": out_dir, "source": ex.path, "tensors": len(tensors), "dtype": dtype, "class": ex.cls,
            "bytes": os.path.getsize(weights), "vocab": V, "padded": cfg.vocab, "step": ex.manifest["step"],
            "psi": ex.layout.numel - pad_rows, "model_type": conf["model_type"]}


def cli(ckpt: str, out_dir: str, dtype: str, vocab: int | None) -> str:
    """``export --format hf``: export, and the line the command prints."""
    t0 = time.perf_counter()
    r = export_hf(ckpt, out_dir, dtype, vocab)
    return report(r, time.perf_counter() - t0)


def report(r: dict, seconds: float) -> str:
    """The command's line."""
    pad = f", padding rows {r['vocab']}..{r['padded'] - 1} left out" if r["padded"] > r["vocab"] else ""
    what = "GPT-2" if r["model_type"] == "gpt2" else r["model_type"]
    return (f"exported {r['tensors']} tensors ({r['psi']:,} params, {r['dtype']}, from {r['class']}) of "
            f"{r['source']} (step {r['step']}) as a {what} to {r['out']}: config.json + model.safetensors "
            f"{r['bytes']:,} bytes, vocab_size {r['vocab']}{pad}, in {seconds:.2f} s")
