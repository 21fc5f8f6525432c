"""The model families, by name: preset -> config, config -> layout table and model, config <-> plain dict.

What it is
    One registry the trainer, the tools and the checkpoint code ask, so none
    of them branches on the family itself::

        preset_names()                  every --model name: gpt2 ... , smollm2-135m ...
        family_of(cfg_or_preset)        "gpt2" | "llama"
        model_config(name, vocab, **o)  the config of a preset (None: the GPT default) with overrides
        units_of(cfg)                   the layout table (gpt_units / llama_units)
        build(cfg, checkpoint, pool)    the model object (GPT / Llama)
        to_dict(cfg) / from_dict(d)     a manifest's plain dict, {"family": ..., fields ...}

    A Llama-family config also stands for Qwen2 (qkv_bias) and Mistral
    (no sliding window): the family is the computation, not the HF model_type.

What it is not
    Hugging Face names, config.json reading or writing (the interop modules').
"""
from __future__ import annotations

import dataclasses

from ringzero.nn import gpt, llama_config

GPT2, LLAMA = "gpt2", "llama"
_CONFIG = {GPT2: gpt.GPTConfig, LLAMA: llama_config.LlamaConfig}
_PRESETS = {GPT2: gpt.PRESETS, LLAMA: llama_config.PRESETS}


def preset_names() -> tuple:
    """Every preset name, the GPT-2 ones first."""
    return tuple(gpt.PRESETS) + tuple(llama_config.PRESETS)


def family_of(x) -> str:
    """The family of a config object or a preset name."""
    if isinstance(x, str):
        for fam, presets in _PRESETS.items():
            if x in presets:
                return fam
        raise ValueError(f"unknown model {x!r}: expected one of {', '.join(preset_names())}")
    for fam, cls in _CONFIG.items():
        if isinstance(x, cls):
            return fam
    raise TypeError(f"not a model config: {type(x).__name__} (expected one of "
                    f"{', '.join(c.__name__ for c in _CONFIG.values())})")


def model_config(name: str | None = None, vocab: int | None = None, **overrides):
    """A preset's config (name None: the small GPT default) with the data's vocab and overrides
    (None values keep the preset's). Each family's own ``model_config`` checks the field names."""
    fam = GPT2 if name is None else family_of(name)
    make = gpt.model_config if fam == GPT2 else llama_config.model_config
    return make(name, vocab, **overrides)


def units_of(cfg) -> tuple:
    """The layout table of a config."""
    return gpt.gpt_units(cfg) if family_of(cfg) == GPT2 else llama_config.llama_units(cfg)


def model_class(cfg):
    """The model class of a config (imported here, so declaring a layout imports no model)."""
    if family_of(cfg) == GPT2:
        return gpt.GPT
    from ringzero.nn.llama import Llama
    return Llama


def build(cfg, checkpoint: bool = False, pool=None):
    """The model object of a config."""
    return model_class(cfg)(cfg, checkpoint=checkpoint, pool=pool)


def to_dict(cfg) -> dict:
    """A config as a plain (JSON-able) dict, its family recorded under "family"."""
    return {"family": family_of(cfg), **dataclasses.asdict(cfg)}


def from_dict(d: dict):
    """The config a ``to_dict`` wrote. A dict without "family" is a GPT's (older manifests)."""
    d = dict(d)
    fam = d.pop("family", GPT2)
    if fam not in _CONFIG:
        raise ValueError(f"unknown model family {fam!r}: expected one of {', '.join(_CONFIG)}")
    cls = _CONFIG[fam]
    names = {f.name for f in dataclasses.fields(cls)}
    bad = sorted(set(d) - names)
    if bad:
        raise ValueError(f"{fam} config has unknown field(s) {bad}: expected some of {sorted(names)}")
    return cls(**d)
