"""The Llama family's declaration: ``LlamaConfig``, its presets and ``llama_units`` (the layout table).

What it is
    ``LlamaConfig``: the shapes of a Llama-style decoder (RMSNorm, rotary
    positions, SwiGLU MLP, grouped-query attention), which also covers Qwen2
    (``qkv_bias=True``) and Mistral without a sliding window. ``RopeScaling``:
    Llama 3's ``rope_type: llama3`` frequency rescaling. ``PRESETS``: the
    published shapes (each from its ``config.json``, sources in docs/llama.md).
    ``llama_units(cfg)``: the parameters, once, grouped into units::

        embed      wte (V, C)
        block{i}   h{i}.ln1.w (C,)            RMSNorm weight, ones, no decay
                   h{i}.attn.w (C, (H+2K)·D)  columns [q | k | v], HF's rotary layout
                   h{i}.attn.b ((H+2K)·D,)    only when qkv_bias (Qwen2), zeros, no decay
                   h{i}.proj.w (H·D, C)
                   h{i}.ln2.w (C,)            ones, no decay
                   h{i}.mlp.w (C, 2F)         columns [gate | up]
                   h{i}.down.w (F, C)
        head       lnf.w (C,); head.w (V, C) when not tied (else the unit needs "embed")

    Weights are stored (in, out) so y = x @ W (HF's nn.Linear stores (out,
    in): an import transposes, nothing more). q and k are in HF's rotary
    layout (``rotate_half`` pairs dimension j with j + D/2 in each head), so no
    row permutation is needed either. ``head.w`` is stored (V, C) like ``wte``
    so the one unembedding reads both.

What it is not
    The model (``ringzero.nn.llama``), nor the Hugging Face names
    (the interop module maps them onto these).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ringzero.runtime.flat import ParamSpec as P
from ringzero.runtime.flat import Unit


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3's rotary rescaling (transformers' ``_compute_llama3_parameters``): wavelengths
    longer than original_max_position / low_freq_factor are slowed by ``factor``, shorter than
    original_max_position / high_freq_factor kept, and those between blended smoothly."""
    factor: float = 32.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self):
        if not (self.factor >= 1 and self.low_freq_factor > 0 and self.high_freq_factor > self.low_freq_factor
                and self.original_max_position >= 1):
            raise ValueError(f"RopeScaling needs factor >= 1, 0 < low_freq_factor < high_freq_factor and "
                             f"original_max_position >= 1, got {self}")


@dataclass(frozen=True)
class LlamaConfig:
    n_layer: int = 4            # decoder blocks
    n_head: int = 4             # query heads H
    n_kv_head: int = 2          # key/value heads K; H % K == 0, each serves H/K query heads
    n_embd: int = 128           # model width C
    head_dim: int | None = None     # D (None: n_embd // n_head); the q/k/v width is (H + 2K)·D
    ffn: int = 256              # the MLP's intermediate size F
    vocab: int = 256            # rows of wte (and head.w)
    block_size: int = 128       # longest sequence T (max_position_embeddings)
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    qkv_bias: bool = False      # Qwen2: a bias on q, k and v (and nowhere else)
    tied: bool = True           # the head reads wte; else its own head.w (V, C)
    rope_scaling: RopeScaling | None = None
    real_vocab: int | None = None   # the rows that are tokens (GPTConfig.real_vocab's rule)

    def __post_init__(self):
        if self.head_dim is None:
            if self.n_head >= 1 and self.n_embd % self.n_head:
                raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}) "
                                 f"when head_dim is not given")
            object.__setattr__(self, "head_dim", self.n_embd // max(1, self.n_head))
        if isinstance(self.rope_scaling, dict):       # from a manifest's plain dict
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        for k in ("n_layer", "n_head", "n_kv_head", "n_embd", "head_dim", "ffn", "vocab", "block_size"):
            v = getattr(self, k)
            if isinstance(v, bool) or int(v) != v or v < 1:
                raise ValueError(f"LlamaConfig.{k} must be an int >= 1, got {v!r}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head ({self.n_head}) must be a multiple of n_kv_head ({self.n_kv_head})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (rotary pairs its two halves), got {self.head_dim}")
        if not (self.rope_theta > 0 and self.rms_eps > 0):
            raise ValueError(f"rope_theta and rms_eps must be > 0, got {self.rope_theta} and {self.rms_eps}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"rope_scaling must be None or a RopeScaling, got {self.rope_scaling!r}")
        if self.real_vocab is not None and not 1 <= self.real_vocab <= self.vocab:
            raise ValueError(f"LlamaConfig.real_vocab must be in [1, vocab = {self.vocab}], got {self.real_vocab}")

    @property
    def n_tokens(self) -> int:
        """Token ids the model reads and scores: [0, n_tokens)."""
        return self.vocab if self.real_vocab is None else self.real_vocab

    @property
    def qkv_width(self) -> int:
        """Columns of attn.w: H query heads, then K key heads, then K value heads, D each."""
        return (self.n_head + 2 * self.n_kv_head) * self.head_dim


# Published shapes, each from its config.json on the Hugging Face hub (docs/llama.md lists the
# files): layers, heads, KV heads, width, MLP, vocab, context, θ, ε, tied, q/k/v bias, scaling.
PRESETS = {
    # HuggingFaceTB/SmolLM2-135M
    "smollm2-135m": LlamaConfig(n_layer=30, n_head=9, n_kv_head=3, n_embd=576, ffn=1536, vocab=49152,
                                block_size=8192, rope_theta=100000.0, rms_eps=1e-5, tied=True),
    # HuggingFaceTB/SmolLM2-360M
    "smollm2-360m": LlamaConfig(n_layer=32, n_head=15, n_kv_head=5, n_embd=960, ffn=2560, vocab=49152,
                                block_size=8192, rope_theta=100000.0, rms_eps=1e-5, tied=True),
    # Qwen/Qwen2.5-0.5B
    "qwen2.5-0.5b": LlamaConfig(n_layer=24, n_head=14, n_kv_head=2, n_embd=896, ffn=4864, vocab=151936,
                                block_size=32768, rope_theta=1000000.0, rms_eps=1e-6, qkv_bias=True, tied=True),
    # TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T (and -Chat-v1.0: the same shapes)
    "tinyllama-1.1b": LlamaConfig(n_layer=22, n_head=32, n_kv_head=4, n_embd=2048, ffn=5632, vocab=32000,
                                  block_size=2048, rope_theta=10000.0, rms_eps=1e-5, tied=False),
    # meta-llama/Llama-3.2-1B
    "llama-3.2-1b": LlamaConfig(n_layer=16, n_head=32, n_kv_head=8, n_embd=2048, head_dim=64, ffn=8192,
                                vocab=128256, block_size=131072, rope_theta=500000.0, rms_eps=1e-5, tied=True,
                                rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192)),
}


def llama_units(cfg: LlamaConfig) -> tuple:
    """The layout table of a Llama: the embedding, one unit per block, the head.

    Init: normal(0.02) (HF's initializer_range) for the matrices, except the two
    that write into the residual stream (proj, down), scaled by 1/sqrt(2L) as
    GPT-2's are; norms ones; the q/k/v bias zeros.
    """
    C, L, F, V = cfg.n_embd, cfg.n_layer, cfg.ffn, cfg.vocab
    HD = cfg.n_head * cfg.head_dim
    res_std = f"normal:{0.02 / math.sqrt(2 * L)}"
    units = [Unit("embed", (P("wte", (V, C)),))]
    for i in range(L):
        h = f"h{i}."
        ps = [P(h + "ln1.w", (C,), "ones", False), P(h + "attn.w", (C, cfg.qkv_width))]
        if cfg.qkv_bias:
            ps.append(P(h + "attn.b", (cfg.qkv_width,), "zeros", False))
        ps += [P(h + "proj.w", (HD, C), res_std), P(h + "ln2.w", (C,), "ones", False),
               P(h + "mlp.w", (C, 2 * F)), P(h + "down.w", (F, C), res_std)]
        units.append(Unit(f"block{i}", tuple(ps)))
    if cfg.tied:
        units.append(Unit("head", (P("lnf.w", (C,), "ones", False),), needs=("embed",)))
    else:
        units.append(Unit("head", (P("lnf.w", (C,), "ones", False), P("head.w", (V, C)))))
    return tuple(units)


def model_config(name: str | None = None, vocab: int | None = None, **overrides) -> LlamaConfig:
    """A LlamaConfig from a preset name (or the small default), the data's vocab, and overrides.

    ``overrides`` are LlamaConfig fields; None means "not given". Changing
    n_embd or n_head re-derives head_dim unless head_dim is given too.
    """
    if name is not None and name not in PRESETS:
        raise ValueError(f"unknown Llama model {name!r}: expected one of {', '.join(sorted(PRESETS))}")
    base = dict(PRESETS[name].__dict__ if name is not None else LlamaConfig().__dict__)
    bad = sorted(set(overrides) - set(base))
    if bad:
        raise ValueError(f"unknown LlamaConfig field(s) {bad}: expected some of {sorted(base)}")
    given = {k: v for k, v in overrides.items() if v is not None}
    if ("n_embd" in given or "n_head" in given) and "head_dim" not in given:
        base["head_dim"] = None
    if vocab is not None:
        given["vocab"] = int(vocab)
        base["real_vocab"] = None
    return LlamaConfig(**{**base, **given})
