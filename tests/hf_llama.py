"""Test helper: small random transformers Llama/Qwen2 models, and their weights laid out by ringzero's names.

``tiny(case)`` builds ``LlamaForCausalLM`` or ``Qwen2ForCausalLM`` from a small config with
random weights (norms too), and the matching ``LlamaConfig``. ``hf_tensor(sd, name)`` is
the independent mapping from transformers' state dict onto ringzero's parameter names
(each nn.Linear transposed to (in, out); q|k|v and gate|up concatenated), written here
from transformers' module names, not imported from the code under test.
"""
import re

import numpy as np

V, T, B = 61, 16, 2
# (name, q/k/v bias (Qwen2), tied, llama3 rope scaling)
CASES = [("llama-tied", False, True, False), ("llama-untied-scaled", False, False, True),
         ("qwen2-tied", True, True, False), ("qwen2-untied-scaled", True, False, True)]


def tiny(case, seed=0, dtype="float64"):
    """(transformers model in eval mode, ringzero LlamaConfig) for one of CASES."""
    import torch
    import transformers

    from ringzero.nn.llama import LlamaConfig, RopeScaling
    name, bias, tied, scaled = case
    torch.manual_seed(seed)
    kw = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=T, rope_theta=1000.0, rms_norm_eps=1e-6,
              tie_word_embeddings=tied)
    if scaled:
        kw["rope_scaling"] = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                  original_max_position_embeddings=8)
    cls = (transformers.Qwen2ForCausalLM, transformers.Qwen2Config) if bias else \
        (transformers.LlamaForCausalLM, transformers.LlamaConfig)
    m = cls[0](cls[1](**kw)).to(getattr(torch, dtype)).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    cfg = LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn=48, vocab=V, block_size=T, rope_theta=1000.0,
                      rms_eps=1e-6, qkv_bias=bias, tied=tied,
                      rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8) if scaled else None)
    return m, cfg


def hf_tensor(sd, name):
    """transformers' tensor for ringzero parameter ``name``, in ringzero's (in, out) orientation."""
    import torch
    if name == "wte":
        return sd["model.embed_tokens.weight"]
    if name == "lnf.w":
        return sd["model.norm.weight"]
    if name == "head.w":
        return sd["lm_head.weight"]
    i, rest = re.fullmatch(r"h(\d+)\.(.+)", name).groups()
    b = f"model.layers.{i}."
    one = {"ln1.w": "input_layernorm.weight", "ln2.w": "post_attention_layernorm.weight"}
    if rest in one:
        return sd[b + one[rest]]
    if rest == "attn.w":
        return torch.cat([sd[b + f"self_attn.{x}_proj.weight"] for x in "qkv"]).T
    if rest == "attn.b":
        return torch.cat([sd[b + f"self_attn.{x}_proj.bias"] for x in "qkv"])
    if rest == "proj.w":
        return sd[b + "self_attn.o_proj.weight"].T
    if rest == "mlp.w":
        return torch.cat([sd[b + "mlp.gate_proj.weight"], sd[b + "mlp.up_proj.weight"]]).T
    if rest == "down.w":
        return sd[b + "mlp.down_proj.weight"].T
    raise KeyError(name)


def fill(views, m):
    """Copy the model's weights into ringzero's named views."""
    sd = dict(m.named_parameters())
    for n, v in views.items():
        v[...] = hf_tensor(sd, n).detach().numpy()


def hf_loss(m, x, y):
    """transformers' logits (B, T, V) and torch's mean cross-entropy against y (the targets of x)."""
    import torch
    out = m(torch.from_numpy(x)).logits
    return out, torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), torch.from_numpy(y).reshape(-1))


def batch(seed, rows):
    rng = np.random.default_rng(seed)
    return rng.integers(0, V, (rows, T)), rng.integers(0, V, (rows, T))
