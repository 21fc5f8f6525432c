"""The torch peer of ringzero's GPT: the same model as a plain nn.Module.

What it is
    A reference GPT-2-style decoder in PyTorch with exactly the semantics of
    ``ringzero.nn.gpt`` for a given ``GPTConfig``: learned token + position
    embeddings, pre-norm blocks (layernorm eps 1e-5, causal multi-head
    attention with a fused qkv projection, GELU in its tanh form), a final
    layernorm and a head tied to the token embedding. ``load_from_flat`` copies
    ringzero's named float32 views into it, so the two compute the same
    function of the same weights. Benchmarks and tests use it as a peer.

What it is not
    A dependency of ringzero: only benchmarks/ and tests/ import it (tests skip
    when torch is missing). It does not use ringzero's layout to allocate
    anything; its parameters are ordinary torch parameters.

Weight convention: ringzero stores linear weights (in, out) so y = x @ W;
torch's nn.Linear stores (out, in), so load_from_flat transposes.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

LN_EPS = 1e-5  # the same eps as ringzero.nn.layers


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        C = cfg.n_embd
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(C, eps=LN_EPS)
        self.attn = nn.Linear(C, 3 * C)
        self.proj = nn.Linear(C, C)
        self.ln2 = nn.LayerNorm(C, eps=LN_EPS)
        self.fc = nn.Linear(C, 4 * C)
        self.fc2 = nn.Linear(4 * C, C)

    def forward(self, x):                                   # x (B, T, C)
        B, T, C = x.shape
        H = self.n_head
        q, k, v = self.attn(self.ln1(x)).split(C, dim=2)   # each (B, T, C)
        q = q.view(B, T, H, C // H).transpose(1, 2)         # (B, H, T, D)
        k = k.view(B, T, H, C // H).transpose(1, 2)
        v = v.view(B, T, H, C // H).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, C))
        x = x + self.fc2(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))
        return x


@torch.no_grad()
def gpt2_init_(name: str, p, n_layer: int):
    """torch's own draw for one parameter by GPT-2's rules (the same rules as ringzero's, other values)."""
    if name.endswith("bias"):
        nn.init.zeros_(p)
    elif ".ln" in name or name.startswith("lnf"):
        nn.init.ones_(p)
    elif name.endswith(("proj.weight", "fc2.weight")):
        nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layer))
    else:
        nn.init.normal_(p, 0.0, 0.02)


class TorchGPT(nn.Module):
    """GPT with ringzero's config semantics; forward returns (logits, loss)."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.lnf = nn.LayerNorm(cfg.n_embd, eps=LN_EPS)
        # same init rules as ringzero.nn.gpt.gpt_units (values differ: use load_from_flat to match);
        # on the meta device (or under deepspeed.zero.Init) this draws nothing: the caller fills in later
        for name, p in self.named_parameters():
            gpt2_init_(name, p, cfg.n_layer)

    def forward(self, idx, targets=None):                  # idx (B, T) int64
        B, T = idx.shape
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.cfg.block_size}")
        x = self.wte(idx) + self.wpe.weight[:T]             # (B, T, C)
        for blk in self.blocks:
            x = blk(x)
        logits = self.lnf(x) @ self.wte.weight.t()          # (B, T, V), tied head
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(B * T))
        return logits, loss


# ringzero name suffix -> (torch attribute path, transpose?)
_BLOCK_MAP = {
    "ln1.w": ("ln1.weight", False), "ln1.b": ("ln1.bias", False),
    "attn.w": ("attn.weight", True), "attn.b": ("attn.bias", False),
    "proj.w": ("proj.weight", True), "proj.b": ("proj.bias", False),
    "ln2.w": ("ln2.weight", False), "ln2.b": ("ln2.bias", False),
    "fc.w": ("fc.weight", True), "fc.b": ("fc.bias", False),
    "fc2.w": ("fc2.weight", True), "fc2.b": ("fc2.bias", False),
}


def torch_name(name: str):
    """Map a ringzero parameter name to (torch parameter name, transpose?)."""
    if name == "wte":
        return "wte.weight", False
    if name == "wpe":
        return "wpe.weight", False
    if name == "lnf.w":
        return "lnf.weight", False
    if name == "lnf.b":
        return "lnf.bias", False
    if name.startswith("h") and "." in name:
        layer, _, rest = name.partition(".")
        if rest in _BLOCK_MAP and layer[1:].isdigit():
            tn, tr = _BLOCK_MAP[rest]
            return f"blocks.{int(layer[1:])}.{tn}", tr
    raise KeyError(f"no torch parameter for ringzero name {name!r}")


@torch.no_grad()
def load_from_flat(model: TorchGPT, views: dict) -> TorchGPT:
    """Copy ringzero's named views (name -> array, any float dtype) into ``model``.

    Every torch parameter must be covered exactly once; a shape mismatch is a
    ValueError naming both shapes.
    """
    params = dict(model.named_parameters())
    seen = set()
    for name, arr in views.items():
        tn, transpose = torch_name(name)
        a = np.asarray(arr.get() if hasattr(arr, "get") else arr, dtype=np.float32)
        if transpose:
            a = a.T
        p = params[tn]
        if tuple(a.shape) != tuple(p.shape):
            raise ValueError(f"{name}: expected shape {tuple(p.shape)} for {tn}, got {tuple(a.shape)}")
        p.copy_(torch.from_numpy(np.ascontiguousarray(a)))
        seen.add(tn)
    missing = sorted(set(params) - seen)
    if missing:
        raise ValueError(f"load_from_flat: views cover {len(seen)} of {len(params)} torch parameters; "
                         f"missing {missing[:4]}")
    return model


class RingzeroInit:
    """ringzero's initial value of one torch parameter at a time (``Layout.init_param``: a pure function
    of the seed and the name), so that a sharded peer loads its weights without any rank holding them all.
    ``own_draw``: torch's draw by the same rules instead (the peer as it was before it took ringzero's)."""

    def __init__(self, layout, seed: int, n_layer: int, own_draw: bool = False):
        self.layout, self.seed, self.n_layer, self.own_draw = layout, seed, n_layer, own_draw
        self.names = {}                                  # torch name -> (ringzero name, transpose?)
        for n in layout.slots:
            tn, tr = torch_name(n)
            self.names[tn] = (n, tr)

    def value(self, tname: str):
        """The float32 tensor for torch parameter ``tname`` (torch's (out, in) layout)."""
        n, transpose = self.names[tname]
        spec = self.layout.slots[n].spec
        if self.own_draw:
            shape = spec.shape[::-1] if transpose else spec.shape
            t = torch.empty(shape, dtype=torch.float32)
            gpt2_init_(tname, t, self.n_layer)
            return t
        a = self.layout.init_param(n, self.seed).reshape(spec.shape)
        return torch.from_numpy(np.ascontiguousarray(a.T if transpose else a))


def grads_as_flat_names(model: TorchGPT) -> dict:
    """Torch gradients under ringzero names and (in, out) layouts, float32 numpy."""
    params = dict(model.named_parameters())
    names = ["wte", "wpe", "lnf.w", "lnf.b"] + [f"h{i}.{k}" for i in range(model.cfg.n_layer)
                                               for k in _BLOCK_MAP]
    out = {}
    for n in names:
        tn, transpose = torch_name(n)
        g = params[tn].grad
        if g is not None:
            g = g.detach().cpu().numpy()
            out[n] = g.T if transpose else g
    return out
