"""Hugging Face GPT-2 <-> ringzero's GPT: the parameter names and the config, both ways.

What it is
    ``hf_name(name)``: the ``GPT2LMHeadModel`` key of a ringzero parameter,
    without the ``transformer.`` prefix (the hub's files have none,
    ``save_pretrained`` writes it)::

        wte            wte.weight              (V, C)   ringzero pads V to a multiple of 64
        wpe            wpe.weight              (T, C)
        h{i}.ln1.w/b   h.{i}.ln_1.weight/bias  (C,)
        h{i}.attn.w/b  h.{i}.attn.c_attn.*     (C, 3C) / (3C,)   q | k | v, heads contiguous
        h{i}.proj.w/b  h.{i}.attn.c_proj.*     (C, C)  / (C,)
        h{i}.ln2.w/b   h.{i}.ln_2.*            (C,)
        h{i}.fc.w/b    h.{i}.mlp.c_fc.*        (C, 4C) / (4C,)
        h{i}.fc2.w/b   h.{i}.mlp.c_proj.*      (4C, C) / (C,)
        lnf.w/b        ln_f.weight/bias        (C,)

    HF's ``Conv1D`` stores weights (in, out), as ringzero does, so no weight is
    transposed. ``attn.bias`` / ``attn.masked_bias`` (causal-mask buffers of
    older files) are not parameters; ``lm_head.weight`` is the tied head.

    ``gpt_config(hf)``: the GPTConfig of a config.json, or ``HFConfigError``
    (one line naming the field) for anything ringzero does not compute
    exactly. ``hf_config(cfg, base)``: the config.json of an export.
    ``config_from_manifest(m)``: the model config of a ringzero checkpoint's
    manifest (its saved ``model_config``, any family; else a GPT's from its
    layout table and trainer config), for the sampler, the evaluator and the
    export.

What it is not
    No file I/O: reading the shards is ``ringzero.interop.hf_import``'s, writing
    them ``ringzero.interop.hf_export``'s. No tokenizer.
"""
from __future__ import annotations

import re

from ringzero.interop.safetensors_files import HFConfigError
from ringzero.nn.gpt import PRESETS, GPTConfig, vocab_for
from ringzero.runtime.flat import units_from_description

PREFIX = "transformer."
HEAD = "lm_head.weight"
IGNORED = re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$")   # mask buffers, not parameters
_BLOCK = {"ln1": "ln_1", "ln2": "ln_2", "attn": "attn.c_attn", "proj": "attn.c_proj",
          "fc": "mlp.c_fc", "fc2": "mlp.c_proj"}
_SUFFIX = {"w": "weight", "b": "bias"}
_NAME = re.compile(r"^h(\d+)\.(\w+)\.([wb])$")
_BLOCK_RE = re.compile(r"^h(\d+)\.ln1\.w$")

# the tanh approximation under its two names in transformers (ACT2FN: NewGELUActivation and
# PytorchGELUTanh compute 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))), as ringzero's GELU does
GELUS = ("gelu_new", "gelu_pytorch_tanh")
EPS = 1e-5                 # ringzero's LayerNorm epsilon (nn/pointwise.py LN_EPS)




def hf_name(name: str) -> str:
    """The HF key (no ``transformer.`` prefix) of ringzero parameter ``name``."""
    if name in ("wte", "wpe"):
        return f"{name}.weight"
    if name in ("lnf.w", "lnf.b"):
        return f"ln_f.{_SUFFIX[name[-1]]}"
    m = _NAME.match(name)
    if not m or m.group(2) not in _BLOCK:
        raise KeyError(f"{name!r} is no GPT parameter ringzero maps to GPT-2 (expected wte, wpe, lnf.w/b "
                       f"or h<i>.<ln1|attn|proj|ln2|fc|fc2>.<w|b>)")
    i, part, wb = m.groups()
    return f"h.{i}.{_BLOCK[part]}.{_SUFFIX[wb]}"


def strip_prefix(key: str) -> str:
    """A file's key without the ``transformer.`` prefix (the head keeps its own name)."""
    return key[len(PREFIX):] if key.startswith(PREFIX) else key


def ignored(key: str) -> bool:
    """True for the causal-mask buffers older files carry (not parameters)."""
    return bool(IGNORED.match(strip_prefix(key)))


# config.json fields that must hold these values for ringzero's GPT to compute the same function:
# (field, the value transformers assumes when it is absent, the values ringzero computes, why)
_EXACT = (
    ("activation_function", "gelu_new", GELUS, "ringzero's GELU is the tanh approximation"),
    ("scale_attn_weights", True, (True,), "ringzero scales attention scores by 1/sqrt(head dim)"),
    ("scale_attn_by_inverse_layer_idx", False, (False,), "ringzero does not scale scores by 1/(layer + 1)"),
    ("reorder_and_upcast_attn", False, (False,), "ringzero does not reorder the attention products"),
    ("tie_word_embeddings", True, (True,), "ringzero's head is the token embedding"),
    ("add_cross_attention", False, (False,), "ringzero's GPT is a decoder without cross-attention"),
    ("is_encoder_decoder", False, (False,), "ringzero's GPT is a decoder only"),
)


def gpt_config(hf: dict, source: str = "config.json") -> GPTConfig:
    """The GPTConfig of a Hugging Face GPT-2 config.json; HFConfigError names the first field
    ringzero cannot compute exactly. The vocabulary is padded as the trainer pads token data
    (50257 -> 50304); ``real_vocab`` keeps the true count, so the head scores only real tokens."""
    def field(name, default=None, required=False):
        if name not in hf or hf[name] is None:
            if required:
                raise HFConfigError(f"{source}: field {name!r} is missing: expected GPT-2's config.json "
                                    f"(n_layer, n_head, n_embd, n_positions, vocab_size)")
            return default
        return hf[name]

    mt = field("model_type", "gpt2")
    if mt != "gpt2":
        raise HFConfigError(f"{source}: model_type {mt!r}: expected 'gpt2' (GPT2LMHeadModel's config)")
    dims = {}
    for k in ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size"):
        v = field(k, required=True)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise HFConfigError(f"{source}: field {k!r} = {v!r}: expected an integer >= 1")
        dims[k] = v
    C = dims["n_embd"]
    if C % dims["n_head"]:
        raise HFConfigError(f"{source}: field 'n_embd' = {C} is not divisible by n_head = {dims['n_head']}")
    inner = field("n_inner")
    if inner is not None and inner != 4 * C:
        raise HFConfigError(f"{source}: field 'n_inner' = {inner}: ringzero's MLP is 4 * n_embd = {4 * C} wide")
    eps = field("layer_norm_epsilon", EPS)
    if not isinstance(eps, (int, float)) or float(eps) != EPS:
        raise HFConfigError(f"{source}: field 'layer_norm_epsilon' = {eps!r}: ringzero's LayerNorm uses {EPS}")
    for name, default, ok, why in _EXACT:
        v = field(name, default)
        if v not in ok:
            raise HFConfigError(f"{source}: field {name!r} = {v!r}: expected {' or '.join(map(repr, ok))} "
                                f"({why})")
    V = dims["vocab_size"]
    return GPTConfig(n_layer=dims["n_layer"], n_head=dims["n_head"], n_embd=C, block_size=dims["n_positions"],
                     vocab=vocab_for(V - 1), real_vocab=V)


def hf_config(cfg: GPTConfig, base: dict | None = None) -> dict:
    """The config.json of an exported model: ``base`` (the imported model's own config.json,
    for its token ids and dropout settings) with the shapes and the exact-compute fields set
    from ``cfg``. vocab_size is the real vocabulary: the padding rows are not exported."""
    out = {k: v for k, v in (base or {}).items() if not k.startswith("_")}
    out.update({
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": cfg.n_tokens, "n_positions": cfg.block_size, "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": None,
        "activation_function": out.get("activation_function") if out.get("activation_function") in GELUS
        else "gelu_new",
        "layer_norm_epsilon": EPS, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False, "tie_word_embeddings": True,
    })
    out.pop("n_ctx", None)             # an old alias of n_positions
    if "bos_token_id" not in out and "eos_token_id" not in out:
        last = cfg.n_tokens - 1        # GPT-2's <|endoftext|> is its last id (50256)
        out.update(bos_token_id=last, eos_token_id=last)
    out.setdefault("initializer_range", 0.02)
    return out


def config_from_manifest(m: dict):
    """The model config of a checkpoint: the one the trainer saved with its family (``model_config``,
    nn/families.py's ``to_dict``), else a GPT's: shapes from its layout table, heads from its config.

    The layout gives vocab and width (wte is (V, C)), the context (wpe is
    (T, C)) and the block count; it cannot give the head count, which comes
    from the trainer's config (``n_head``) or its preset name (``model``).
    """
    mc = (m.get("config") or {}).get("model_config")
    if isinstance(mc, dict):
        from ringzero.nn.families import from_dict
        try:
            return from_dict(mc)
        except (ValueError, TypeError) as e:
            raise HFConfigError(f"the manifest's model_config makes no model: {e}") from None
    shapes = {p.name: p.shape for u in units_from_description(m["layout"]) for p in u.params}
    if "wte" not in shapes or "wpe" not in shapes:
        raise HFConfigError(f"the checkpoint holds no GPT (no 'wte'/'wpe' among its {len(shapes)} "
                            f"parameters): expected a model built by ringzero.nn.gpt")
    (V, C), (T, _) = shapes["wte"], shapes["wpe"]
    L = sum(1 for n in shapes if _BLOCK_RE.match(n))
    conf = m.get("config") or {}
    gpt = conf.get("gpt") if isinstance(conf.get("gpt"), dict) else {}
    # the effective GPTConfig if the run saved it, else its preset, else the trainer's flag
    if gpt.get("n_head"):
        H = int(gpt["n_head"])
    elif conf.get("model") in PRESETS:
        H = PRESETS[conf["model"]].n_head
    elif conf.get("n_head"):
        H = int(conf["n_head"])
    else:
        raise HFConfigError("the manifest's config has no n_head (nor gpt.n_head, nor a preset model "
                            f"name): expected one to rebuild the attention heads, got keys {sorted(conf)}")
    try:
        real = gpt.get("real_vocab")      # an imported GPT-2: the head scores its real rows only
        return GPTConfig(n_layer=L, n_head=H, n_embd=C, block_size=T, vocab=V,
                         real_vocab=int(real) if real else None)
    except ValueError as e:
        raise HFConfigError(f"the manifest's shapes make no GPT: {e}") from None
