"""The Llama-family decoder (Llama, Qwen2, SmolLM2, TinyLlama): the model over ``llama_units``.

What it is
    For now the declaration only, re-exported from ``ringzero.nn.llama_config``
    (``LlamaConfig``, ``RopeScaling``, ``PRESETS``, ``llama_units``,
    ``model_config``): the names a checkpoint importer codes against.

What it is not
    Hugging Face names or file I/O (the interop modules').
"""
from ringzero.nn.llama_config import PRESETS, LlamaConfig, RopeScaling, llama_units, model_config

__all__ = ["LlamaConfig", "RopeScaling", "PRESETS", "llama_units", "model_config"]
