"""The Hugging Face families ringzero reads and writes, by config.json's ``model_type``.

What it is
    ``Family``: what the reader (interop/hf_import.py) and the writer
    (interop/hf_export.py) need of a family, so that neither branches on it::

        name            "gpt2" | "llama" (the ringzero family: nn/families.py)
        config(hf, src) the ringzero config of a config.json (HFConfigError names the field)
        sources(n, cfg) the file tensors (Parts) ringzero parameter n is made of
        strip(key)      a file key as the family names it (GPT-2: without "transformer.")
        prefix          what an export puts before every key but the head
        ignored(key)    buffers older files carry that are no parameters
        embed           the embedding's key, which a tied lm_head.weight must equal
        untied_head     whether a config's head is a parameter of its own (head.w)
        hf_config(c, b) the config.json of an export

    ``family_of(hf, source)``: the Family of a config.json (model_type gpt2 or
    absent: GPT-2; llama, qwen2, mistral: the Llama family).

What it is not
    No I/O, no model: the names and configs are interop/gpt2.py's and interop/llama.py's.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from ringzero.interop import gpt2, llama
from ringzero.interop.safetensors_files import HFConfigError, Part

HEAD = "lm_head.weight"


class Family(NamedTuple):
    name: str
    config: Callable
    sources: Callable
    strip: Callable
    prefix: str
    ignored: Callable
    embed: str
    untied_head: Callable
    hf_config: Callable


def _gpt2_sources(name, cfg):
    from ringzero.nn.gpt import gpt_units
    shapes = {p.name: p.shape for u in gpt_units(cfg) for p in u.params}
    shape = shapes[name]
    return [Part(gpt2.hf_name(name), shape[-1] if len(shape) == 2 else shape[0], False)]


GPT2 = Family("gpt2", gpt2.gpt_config, _gpt2_sources, gpt2.strip_prefix, gpt2.PREFIX, gpt2.ignored, "wte.weight",
              lambda cfg: False, gpt2.hf_config)
LLAMA = Family("llama", llama.llama_config, llama.sources, lambda k: k, "", lambda k: bool(llama.IGNORED.match(k)),
               llama.EMBED, lambda cfg: not cfg.tied, llama.hf_config)


def family_of(hf: dict, source: str = "config.json") -> Family:
    """The Family of a config.json."""
    mt = hf.get("model_type", "gpt2")
    if mt == "gpt2":
        return GPT2
    if mt in llama.MODEL_TYPES:
        return LLAMA
    raise HFConfigError(f"{source}: model_type {mt!r}: ringzero reads gpt2, {', '.join(llama.MODEL_TYPES)}")


def family_of_config(cfg) -> Family:
    """The Family of a ringzero config object (GPTConfig or LlamaConfig)."""
    from ringzero.nn.families import family_of as fam
    return GPT2 if fam(cfg) == "gpt2" else LLAMA
