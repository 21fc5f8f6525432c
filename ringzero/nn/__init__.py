"""Models and layers with hand-written forward/backward on flat-buffer views.

``layers`` holds the layer pairs and the buffer ``Pool`` (``attention``, the
longest, in its own module); ``gpt`` the GPT
declaration (``GPTConfig``, ``gpt_units``) and model; ``mlp`` the MLP. The
sharding runtime imports none of these: it is handed a model object.
"""
from ringzero.nn.gpt import GPT, PRESETS, GPTConfig, gpt_units
from ringzero.nn.layers import Pool, cache_nbytes
from ringzero.nn.mlp import MLP, mlp_units

__all__ = ["GPT", "GPTConfig", "PRESETS", "gpt_units", "MLP", "mlp_units", "Pool", "cache_nbytes"]
