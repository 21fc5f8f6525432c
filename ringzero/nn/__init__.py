"""Models and layers with hand-written forward/backward on flat-buffer views.

``layers`` names every layer pair and the buffer ``Pool``: ``base`` holds the
pool, the ``Layer`` plumbing and ``Linear``; ``pointwise`` layernorm, GELU,
residual and cross-entropy; ``attention`` the attention block; ``fused`` the
elementwise passes they call (single-pass C kernels from ``csrc/fused.c``
on the host, NumPy/CuPy formulas otherwise). ``gpt`` the GPT declaration
(``GPTConfig``, ``gpt_units``) and model; ``mlp`` the MLP (the Hugging Face
names and configs are ``ringzero.interop``'s). The Llama family
(docs/llama.md): ``llama_config`` its declaration (``LlamaConfig``,
presets, ``llama_units``), ``llama`` the model, its layers ``rmsnorm``,
``rotary``, ``swiglu`` and ``gqa``; ``families`` the registry the trainer and
tools ask (preset -> config -> units and model). The sharding
runtime imports none of these: it is handed a model object.
"""
from ringzero.nn.gpt import GPT, PRESETS, GPTConfig, gpt_units
from ringzero.nn.layers import Pool, cache_nbytes
from ringzero.nn.llama import Llama, LlamaConfig, llama_units
from ringzero.nn.mlp import MLP, mlp_units

__all__ = ["GPT", "GPTConfig", "PRESETS", "gpt_units", "Llama", "LlamaConfig", "llama_units", "MLP", "mlp_units",
           "Pool", "cache_nbytes"]
