"""The torch peer of ringzero's Llama family: transformers' own LlamaForCausalLM / Qwen2ForCausalLM inside.

What it is
    ``TorchLlama(cfg)`` wraps the transformers model of a ringzero ``LlamaConfig`` (its config from
    ``ringzero.interop.llama.hf_config``, the one an export writes: model_type qwen2 when the config
    has the q/k/v bias, else llama; sdpa attention) as ``lm``, so that the peer engines call it as they
    call ``torch_gpt.TorchGPT``: ``model(idx, targets) -> (logits, loss)`` with the loss the mean
    cross-entropy of ``targets`` (ringzero's targets are the next tokens already: transformers'
    ``labels`` would shift them once more). ``model.blocks`` are its decoder layers (the FSDP units).

    ``LlamaInit(layout, seed, cfg)``: ringzero's initial value of one torch parameter at a time
    (``Layout.init_param``, sliced into the transformers tensors by interop's name map
    ``ringzero.interop.llama.sources``: q|k|v and gate|up split into their column blocks and each
    transposed to (out, in)), so that a sharded peer loads its weights without any rank holding them
    all. ``ringzero_weights(weights, cfg)`` goes the other way for the tests: the full torch tensors
    laid out by ringzero's names.

    A model built on the meta device (the sharded modes) has a rotary table of no values and, when
    tied, a head that ``to_empty`` parts from the embedding: ``finish()`` rebuilds the table (no
    parameter: transformers' own ``rotary_emb`` class on the config) and ties the head again.
What it is not
    A model of its own: every forward and backward is transformers'. Only benchmarks/ and tests/ import
    it; ringzero never imports torch.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

PREFIX = "lm."          # TorchLlama's attribute before transformers' own names


def hf_config(cfg):
    """transformers' config of a ringzero LlamaConfig (the export's config.json, sdpa attention)."""
    import transformers

    from ringzero.interop.llama import hf_config as export_config
    d = export_config(cfg)
    cls = transformers.Qwen2Config if d["model_type"] == "qwen2" else transformers.LlamaConfig
    c = cls(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    c._attn_implementation = "sdpa"
    return c


class TorchLlama(nn.Module):
    """transformers' causal LM of ``cfg`` as ``lm``; forward returns (logits, loss) as TorchGPT's does."""

    def __init__(self, cfg):
        super().__init__()
        import transformers
        self.cfg = cfg
        hc = hf_config(cfg)
        self.lm = (transformers.Qwen2ForCausalLM if hc.model_type == "qwen2" else transformers.LlamaForCausalLM)(hc)

    @property
    def blocks(self):
        return self.lm.model.layers             # the decoder layers: one FSDP unit each

    def forward(self, idx, targets=None):      # idx (B, T) int64
        B, T = idx.shape
        logits = self.lm(input_ids=idx, use_cache=False).logits            # (B, T, V) float32
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(B * T))
        return logits, loss

    def finish(self):
        """After a meta-device build is filled: the rotary table recomputed, a tied head tied again."""
        rot = self.lm.model.rotary_emb
        self.lm.model.rotary_emb = type(rot)(config=self.lm.config)
        if self.cfg.tied and self.lm.lm_head.weight is not self.lm.model.embed_tokens.weight:
            self.lm.lm_head.weight = self.lm.model.embed_tokens.weight


class LlamaInit:
    """ringzero's initial value of one transformers tensor at a time (``Layout.init_param``, a pure
    function of the seed and the name). ``names``: torch name -> (ringzero name, first column or element,
    width, transposed?), a tied head's ``lm_head.weight`` read as the embedding. ``own_draw``: a draw by
    the same rules (normal 0.02, ones for the norms, zeros for the biases) instead of ringzero's values."""

    def __init__(self, layout, seed: int, cfg, own_draw: bool = False):
        from ringzero.interop.llama import EMBED, HEAD, sources
        self.layout, self.seed, self.cfg, self.own_draw = layout, seed, cfg, own_draw
        self.names = {}
        for n in layout.slots:
            col = 0
            for part in sources(n, cfg):
                self.names[PREFIX + part.key] = (n, col, part.width, part.transposed)
                col += part.width
        if cfg.tied:
            self.names[PREFIX + HEAD] = self.names[PREFIX + EMBED]
        self._last = (None, None)          # (ringzero name, its full value): q, k, v read one attn.w

    def _full(self, n):
        if self._last[0] != n:
            spec = self.layout.slots[n].spec
            self._last = (n, self.layout.init_param(n, self.seed).reshape(spec.shape))
        return self._last[1]

    def value(self, tname: str):
        """The float32 tensor for torch parameter ``tname`` (torch's (out, in) layout)."""
        n, col, width, transposed = self.names[tname]
        spec = self.layout.slots[n].spec
        if self.own_draw:
            shape = (width, spec.shape[0]) if transposed else ((spec.shape[0], width) if len(spec.shape) == 2
                                                                 else (width,))
            t = torch.empty(shape, dtype=torch.float32)
            if spec.init in ("ones", "zeros"):
                return t.fill_(1.0 if spec.init == "ones" else 0.0)
            return t.normal_(0.0, 0.02)
        a = self._full(n)
        a = a[:, col:col + width] if a.ndim == 2 else a[col:col + width]
        return torch.from_numpy(np.ascontiguousarray(a.T if transposed else a))


def ringzero_weights(weights: dict, cfg, names) -> dict:
    """{ringzero name: float64 array} from {torch name: full tensor} (``LlamaInit.names``: the map)."""
    parts = {}
    for tname, (n, col, _, transposed) in names.items():
        if tname in weights or not (cfg.tied and tname.endswith("lm_head.weight")):
            w = weights[tname].detach().numpy().astype(np.float64)
            parts.setdefault(n, []).append((col, w.T if transposed else w))
    return {n: np.concatenate([w for _, w in sorted(ps, key=lambda cw: cw[0])], axis=-1)
            for n, ps in parts.items()}
