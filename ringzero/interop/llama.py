"""Hugging Face Llama / Qwen2 / Mistral <-> ringzero's Llama: the parameter names and the config, both ways.

What it is
    ``sources(name, cfg)``: the Hugging Face tensors a ringzero parameter is
    made of, as column blocks (``Part(key, width, transposed)``). HF's
    ``nn.Linear`` stores (out, in); ringzero stores (in, out), so every
    projection is a transpose, and the fused q|k|v and gate|up matrices are
    their parts side by side; rotary is in HF's ``rotate_half`` layout on both
    sides, so no row is permuted::

        wte             model.embed_tokens.weight                      (V, C)   rows, padded to 64
        h{i}.ln1.w      model.layers.{i}.input_layernorm.weight        (C,)
        h{i}.attn.w     self_attn.{q,k,v}_proj.weight, each .T         (C, (H+2K)·D) = [q | k | v]
        h{i}.attn.b     self_attn.{q,k,v}_proj.bias                    ((H+2K)·D,)   Qwen2 only
        h{i}.proj.w     self_attn.o_proj.weight .T                     (H·D, C)
        h{i}.ln2.w      model.layers.{i}.post_attention_layernorm.weight
        h{i}.mlp.w      mlp.{gate,up}_proj.weight, each .T             (C, 2F) = [gate | up]
        h{i}.down.w     mlp.down_proj.weight .T                        (F, C)
        lnf.w           model.norm.weight                              (C,)
        head.w          lm_head.weight                                 (V, C)   untied only

    ``llama_config(hf)``: the LlamaConfig of a config.json whose model_type is
    llama, qwen2 or mistral, or ``HFConfigError`` naming the first field that
    ringzero does not compute exactly (an MLP or o_proj bias, an activation
    other than SiLU, a sliding window shorter than the context, a rope type
    other than default / llama3). ``hf_config(cfg, base)``: the config.json of
    an export (model_type llama, or qwen2 with q/k/v bias).

What it is not
    No file I/O (interop/hf_import.py reads, interop/hf_export.py writes).
"""
from __future__ import annotations

import re

from ringzero.interop.safetensors_files import HFConfigError, Part
from ringzero.nn.gpt import vocab_for
from ringzero.nn.llama_config import LlamaConfig, RopeScaling

MODEL_TYPES = ("llama", "qwen2", "mistral")
HEAD = "lm_head.weight"
EMBED = "model.embed_tokens.weight"
IGNORED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")   # older files' buffers
_NAME = re.compile(r"^h(\d+)\.(\w+\.[wb])$")


def sources(name: str, cfg: LlamaConfig) -> list:
    """The Parts of ringzero parameter ``name``, left to right."""
    H, K, D, C, F = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.n_embd, cfg.ffn
    if name == "wte":
        return [Part(EMBED, C, False)]
    if name == "head.w":
        return [Part(HEAD, C, False)]
    if name == "lnf.w":
        return [Part("model.norm.weight", C, False)]
    m = _NAME.match(name)
    if not m:
        raise KeyError(f"{name!r} is no Llama parameter (expected wte, lnf.w, head.w or h<i>.<part>)")
    b, rest = f"model.layers.{m.group(1)}.", m.group(2)
    a = b + "self_attn."
    table = {
        "ln1.w": [Part(b + "input_layernorm.weight", C, False)],
        "ln2.w": [Part(b + "post_attention_layernorm.weight", C, False)],
        "attn.w": [Part(a + "q_proj.weight", H * D, True), Part(a + "k_proj.weight", K * D, True),
                   Part(a + "v_proj.weight", K * D, True)],
        "attn.b": [Part(a + "q_proj.bias", H * D, False), Part(a + "k_proj.bias", K * D, False),
                   Part(a + "v_proj.bias", K * D, False)],
        "proj.w": [Part(a + "o_proj.weight", C, True)],
        "mlp.w": [Part(b + "mlp.gate_proj.weight", F, True), Part(b + "mlp.up_proj.weight", F, True)],
        "down.w": [Part(b + "mlp.down_proj.weight", C, True)],
    }
    if rest not in table:
        raise KeyError(f"{name!r} is no Llama parameter ringzero maps to Hugging Face names")
    return table[rest]


def _rope(hf: dict, source: str):
    """(theta, RopeScaling or None) from transformers 5's rope_parameters or the older rope_theta/rope_scaling."""
    rp = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else None
    rs = hf.get("rope_scaling") if isinstance(hf.get("rope_scaling"), dict) else None
    theta = (rp or {}).get("rope_theta", hf.get("rope_theta", 10000.0))
    spec = rs or rp or {}
    kind = spec.get("rope_type", spec.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise HFConfigError(f"{source}: rope_type {kind!r}: ringzero computes 'default' and 'llama3' rotary "
                            f"positions only")
    try:
        return float(theta), RopeScaling(float(spec["factor"]), float(spec["low_freq_factor"]),
                                         float(spec["high_freq_factor"]),
                                         int(spec["original_max_position_embeddings"]))
    except (KeyError, TypeError, ValueError) as e:
        raise HFConfigError(f"{source}: llama3 rope scaling {spec!r} is incomplete or invalid ({e})") from None


def llama_config(hf: dict, source: str = "config.json") -> LlamaConfig:
    """The LlamaConfig of a Llama / Qwen2 / Mistral config.json. The vocabulary is padded to a
    multiple of 64 as for GPT-2 (``real_vocab`` keeps the true count)."""
    mt = hf.get("model_type")
    if mt not in MODEL_TYPES:
        raise HFConfigError(f"{source}: model_type {mt!r}: expected one of {', '.join(MODEL_TYPES)}")

    def need(k):
        v = hf.get(k)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise HFConfigError(f"{source}: field {k!r} = {v!r}: expected an integer >= 1")
        return v
    C, H, L = need("hidden_size"), need("num_attention_heads"), need("num_hidden_layers")
    K = hf.get("num_key_value_heads") or H
    D = hf.get("head_dim") or C // H
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise HFConfigError(f"{source}: field 'hidden_act' = {act!r}: ringzero's SwiGLU uses 'silu'")
    if hf.get("mlp_bias"):
        raise HFConfigError(f"{source}: field 'mlp_bias' = true: ringzero's MLP has no bias")
    bias = mt == "qwen2"
    if mt == "llama" and hf.get("attention_bias"):
        raise HFConfigError(f"{source}: field 'attention_bias' = true: Llama's puts a bias on o_proj too, which "
                            f"ringzero does not compute (Qwen2's q/k/v bias it does)")
    T = need("max_position_embeddings")
    sw = hf.get("sliding_window")
    sliding = hf.get("use_sliding_window", mt == "mistral") and sw is not None
    if sliding and sw < T:
        raise HFConfigError(f"{source}: field 'sliding_window' = {sw} < max_position_embeddings = {T}: ringzero's "
                            f"attention sees the whole context")
    if hf.get("pretraining_tp", 1) != 1:
        raise HFConfigError(f"{source}: field 'pretraining_tp' = {hf['pretraining_tp']}: expected 1")
    theta, scaling = _rope(hf, source)
    V = need("vocab_size")
    try:
        return LlamaConfig(n_layer=L, n_head=H, n_kv_head=K, n_embd=C, head_dim=D, ffn=need("intermediate_size"),
                           vocab=vocab_for(V - 1), real_vocab=V, block_size=T, rope_theta=theta,
                           rms_eps=float(hf.get("rms_norm_eps", 1e-6)), qkv_bias=bias,
                           tied=bool(hf.get("tie_word_embeddings", True)), rope_scaling=scaling)
    except ValueError as e:
        raise HFConfigError(f"{source}: {e}") from None


def hf_config(cfg: LlamaConfig, base: dict | None = None) -> dict:
    """The config.json of an exported Llama (``model_type`` qwen2 when it has the q/k/v bias):
    ``base`` (the imported config, for its token ids) with every shape and computing field set."""
    out = {k: v for k, v in (base or {}).items() if not k.startswith("_")}
    mt = "qwen2" if cfg.qkv_bias else (out.get("model_type") if out.get("model_type") in ("llama", "mistral")
                                       else "llama")
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}[mt]
    for k in ("rope_scaling", "rope_theta", "rope_parameters", "layer_types"):
        out.pop(k, None)                   # rewritten below; layer_types: transformers derives it
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        rope.update(rope_type="llama3", factor=s.factor, low_freq_factor=s.low_freq_factor,
                    high_freq_factor=s.high_freq_factor, original_max_position_embeddings=s.original_max_position)
    out.update({
        "architectures": [arch], "model_type": mt, "vocab_size": cfg.n_tokens, "hidden_size": cfg.n_embd,
        "intermediate_size": cfg.ffn, "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head, "head_dim": cfg.head_dim, "max_position_embeddings": cfg.block_size,
        "rms_norm_eps": cfg.rms_eps, "hidden_act": "silu", "tie_word_embeddings": cfg.tied,
        "rope_parameters": rope, "rope_theta": cfg.rope_theta,
    })
    if cfg.rope_scaling is not None:
        out["rope_scaling"] = dict(rope)
    if mt == "llama":
        out.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    else:
        out.update(use_sliding_window=False, sliding_window=None)
    out.setdefault("initializer_range", 0.02)
    return out
