"""Allocation traces of one training run, from the model's layout: an eager framework's and ringzero's.

What it is
    ``conventional_trace``: the ("alloc", id, nbytes, tag) / ("free", id) events
    an eager framework (PyTorch DDP + mixed-precision Adam) makes: a tensor per
    parameter, gradient and Adam state, the activations the GPT's forward keeps
    (``unit_activations``, checked against the real model's caches in tests),
    transients, all-reduce buckets, optionally activation checkpointing.
    ``ringzero_trace``: the engine's plan, every buffer allocated once
    (``plan_buffers`` mirrors runtime/zero.py; checked against a real engine).

What it is not
    A recording of torch: the events are written from the model's shapes.
    ringzero.tools.fragmentation replays them through ringzero.tools.allocator.
"""
from __future__ import annotations

import functools

from ringzero.comm.schedule import TREE_BYTES
from ringzero.nn.gpt import GPTConfig, gpt_units
from ringzero.runtime.flat import Layout
from ringzero.runtime.plan import close_order, reduce_buckets

MIB = 1 << 20


# ---- the model's own activation sizes ---------------------------------------------
def unit_activations(cfg: GPTConfig, B: int, T: int, itemsize: int = 2, stat_bytes: int = 4,
                     id_bytes: int = 8) -> list:
    """Bytes of each activation array the GPT's forward keeps, per unit: [[nbytes, ...], ...].

    The same arrays ``GPT.forward_unit`` puts in its caches (tests compare
    them with a real forward): per block ln1 (x̂, rstd, output), attention
    (qkv, probabilities (B, H, T, T), pre-projection output), ln2 (x̂, rstd,
    output), fc's output, GELU's two (B, T, 4C) arrays; the head keeps
    lnf's x̂/rstd/output, the softmax (B·T, V) and the targets.
    """
    C, H, V = cfg.n_embd, cfg.n_head, cfg.vocab
    bt, e = B * T, itemsize
    ln = [bt * C * e, bt * stat_bytes, bt * C * e]
    block = ln + [bt * 3 * C * e, B * H * T * T * e, bt * C * e] + ln + [bt * 4 * C * e] * 3
    head = ln + [bt * V * e, bt * id_bytes]
    return [[bt * id_bytes]] + [list(block) for _ in range(cfg.n_layer)] + [head]


def _transients_fwd(cfg, B, T, e):
    return {"scores": B * cfg.n_head * T * T * e, "logits32": B * T * cfg.vocab * 4}


def _transients_bwd(cfg, B, T, e):
    """Gradients of activations in one block's backward, in the order they live."""
    C, bt = cfg.n_embd, B * T
    return [bt * C * e, bt * 4 * C * e, bt * 4 * C * e, bt * C * e,
            B * cfg.n_head * T * T * e, B * cfg.n_head * T * T * e, bt * 3 * C * e, bt * C * e]


# ---- the conventional trace ---------------------------------------------------------
def _block_ops(cfg, B, T, e):
    """A block's forward outputs in the order eager code makes them, when
    nothing is kept for backward (checkpointing): h1, qkv, scores, probs, y,
    proj, x2, h2, fc, gelu, mlp, out. Each is dropped once two later ones
    exist, except x2 (read by the last add) and out (the block's output)."""
    C, bt, att = cfg.n_embd, B * T, B * cfg.n_head * T * T * e
    return [bt * C * e, bt * 3 * C * e, att, att, bt * C * e, bt * C * e, bt * C * e,
            bt * C * e, bt * 4 * C * e, bt * 4 * C * e, bt * C * e, bt * C * e]


def conventional_trace(cfg: GPTConfig, shapes, bucket: int = 25 * MIB, act_bytes: int = 2,
                       checkpoint: bool = False) -> list:
    """("alloc", id, nbytes, tag) / ("free", id) events of len(shapes) training steps.

    shapes: [(B, T), ...], one micro-batch shape per step. checkpoint=True:
    each block keeps only its input (a long-lived fp16 (B, T, C) checkpoint
    made between short-lived intermediates) and recomputes its activations
    in backward, as activation checkpointing does.
    """
    L = Layout(gpt_units(cfg))
    ev, n = [], [0]

    def alloc(nbytes, tag):
        n[0] += 1
        ev.append(("alloc", n[0], int(nbytes), tag))
        return n[0]

    def free(i):
        ev.append(("free", i))

    params = [(u, p.name, p.numel) for u, unit in enumerate(L.units) for p in unit.params]
    for _, _, k in params:                       # model construction, .half(), master copy
        alloc(2 * k, "param16")
        alloc(4 * k, "master32")
    adam = False
    for B, T in shapes:
        acts = []
        for u, sizes in enumerate(unit_activations(cfg, B, T, act_bytes)):
            tr = _transients_fwd(cfg, B, T, act_bytes)
            if 1 <= u <= cfg.n_layer:            # scores, softmaxed into the kept probabilities
                s = alloc(tr["scores"], "transient")
            if checkpoint and 1 <= u <= cfg.n_layer:
                ops, win, x2 = _block_ops(cfg, B, T, act_bytes), [], None
                for k, x in enumerate(ops):
                    i = ck = alloc(x, "checkpoint" if k == len(ops) - 1 else "transient")
                    if k == 6:
                        x2 = i
                    elif k < len(ops) - 1:
                        win.append(i)
                    if len(win) > 2:
                        free(win.pop(0))
                for i in win + [x2]:
                    free(i)
                acts.append([ck])
            else:
                acts.append([alloc(x, "activation") for x in sizes])
            if 1 <= u <= cfg.n_layer:
                free(s)
            if u == len(L.units) - 1:            # the fp32 loss over the logits
                lg = alloc(tr["logits32"], "fp32 logits")
                free(lg)
        grads, ready = {}, []
        for u in reversed(range(len(L.units))):
            live = []
            if checkpoint and 1 <= u <= cfg.n_layer:   # recompute the block's activations
                live_re = [alloc(x, "recompute") for x in unit_activations(cfg, B, T, act_bytes)[u]]
            else:
                live_re = []
            for x in (_transients_bwd(cfg, B, T, act_bytes) if 1 <= u <= cfg.n_layer else []):
                live.append(alloc(x, "transient"))
                if len(live) > 2:
                    free(live.pop(0))
            for uu, name, k in params:           # this unit's weight gradients
                if uu == u:
                    grads[name] = alloc(2 * k, "grad16")
                    ready.append(2 * k)
            for i in live + live_re[::-1]:
                free(i)
            for i in reversed(acts[u]):          # the unit's activations, freed in reverse
                free(i)
            if sum(ready) >= bucket or u == 0:   # a full bucket: flatten, all-reduce, unflatten
                b = alloc(sum(ready), "bucket")
                free(b)
                ready = []
        if not adam:                             # Adam's state, made at the first step
            for _, name, k in params:
                alloc(4 * k, "adam_m")
                alloc(4 * k, "adam_v")
            adam = True
        for _, name, k in params:                # unscale in fp32, update, drop the copy
            t = alloc(4 * k, "transient")
            free(t)
        for name in list(grads):                 # zero_grad(set_to_none=True)
            free(grads.pop(name))
    return ev


# ---- ringzero's plan -------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _plan(n_layer: int, inflight: int, prefetch: int, land_in_slot: bool):
    """The engine's step plan (runtime/plan.py) for a GPT of n_layer blocks: its slot counts
    depend only on the units' order and needs, not on their sizes, so a tiny GPT of that depth
    gives them."""
    from ringzero.nn.gpt import GPT
    from ringzero.runtime.plan import build_plan
    m = GPT(GPTConfig(n_layer, 1, 8, 4, 8))
    L = Layout(m.units)
    U = len(L.units)
    return build_plan([L.needs(u) for u in range(U)], [bool(m.backward_reads_params(u)) for u in range(U)],
                      inflight, prefetch, land_in_slot)


def plan_buffers(cfg: GPTConfig, stage: str = "0", nd: int = 1, device: str = "cuda",
                 precision: str = "fp16", overlap: bool = False, reduce_bucket: int | None = None) -> dict:
    """{name: bytes} of the buffers ``Zero`` allocates at start-up for this GPT.

    Mirrors zero.py: five state buffers (full or shard by stage), the unit-sized
    workspaces of its plan, the optimizer's scratch. On the GPU the compute
    dtype is the storage dtype, so no param cast workspace; gradients still
    accumulate in fp32 workspaces wherever storage is 2 bytes (runtime/slots.py).
    With overlap (the engine's default across nodes) 2-byte storage alternates two gradient
    buckets, and fp32 storage holds one more gradient slot, while a reduction runs; stage 3 and
    hybrid prefetch one unit's gather (the plan's landings, or its param slots held early).
    Stages 0-2 on more than one rank reduce consecutive units in buckets of up to
    ``reduce_bucket`` bytes (None: the engine's default, 16 MiB without overlap, none with).
    """
    L = Layout(gpt_units(cfg), shards=nd)
    sb = 2 if precision == "fp16" else 4
    cb = sb if device == "cuda" else 4
    full, shard, cap = L.padded, L.shard_numel, L.max_unit_padded
    st = stage
    out = {"params": sb * (shard if st in ("3", "hybrid") else full),
           "grads": sb * (full if st in ("0", "1") else shard)}
    for k in ("master", "adam_m", "adam_v"):
        out[k] = 4 * (full if st == "0" else shard)
    pcast, gcast = cb != sb, sb < 4
    sharded_grads = st not in ("0", "1")
    gathers = st in ("3", "hybrid")
    p = _plan(cfg.n_layer, int(overlap and not gcast and sharded_grads), int(overlap and gathers), not pcast)
    n_param_slots, n_grad_slots = max(p.param_slots, p.forward_slots), p.grad_slots
    n_land = max(p.land_slots, p.forward_land_slots) if pcast else n_param_slots
    for i in range(n_param_slots if pcast else 0):
        out[f"param_compute{i}"] = cb * cap
    for i in range(n_grad_slots if gcast else 0):
        out[f"grad_compute{i}"] = 4 * cap
    for i in range(n_land if gathers else 0):
        out[f"gather{i}"] = sb * cap
    if reduce_bucket is None:
        reduce_bucket = 0 if overlap else TREE_BYTES
    groups = []
    if reduce_bucket and not gathers and nd > 1:
        groups = [g for g in reduce_buckets(close_order(p), [sb * n for n in L.unit_padded], reduce_bucket)
                  if len(g) > 1]
        for i in range(2 if overlap else 1) if groups else ():
            out[f"reduce_bucket{i}"] = sb * nd * max(sum(L.piece_numel[u] for u in g) for g in groups)
    alone = sum(len(g) for g in groups) < len(L.units)      # a unit reduced by itself
    for i in range(((2 if overlap else 1) if gcast else n_grad_slots) if sharded_grads and (alone or not gcast)
                   else 0):
        out[f"grad_bucket{i}"] = sb * cap
    out["adam_tmp"] = 4 * max(L.piece_numel)
    out["grad_scratch"] = 4 * max(L.piece_numel)
    return out


def activation_arena(cfg: GPTConfig, shapes, act_bytes: int = 2, checkpoint: bool = False) -> int:
    """Bytes of one activation arena with fixed offsets, at the run's largest shape.

    Two regions. The first holds what lives across the step: the token ids
    and every block's kept activations (with checkpointing, one (B, T, C)
    input per block). The second is reused by whatever lives for one phase:
    the head's arrays and the fp32 loss in forward and the head's backward;
    one block's forward scratch; one block's recomputed activations and its
    backward's gradients of activations (three alive at a time).
    """
    def need(B, T):
        e, units = act_bytes, unit_activations(cfg, B, T, act_bytes)
        tr, bwd = _transients_fwd(cfg, B, T, e), sorted(_transients_bwd(cfg, B, T, e))[-3:]
        head = sum(units[-1]) + tr["logits32"]
        if checkpoint:
            first = sum(units[0]) + cfg.n_layer * B * T * cfg.n_embd * e
            ops = sorted(_block_ops(cfg, B, T, e))[-4:]
            second = max(head, sum(ops) + tr["scores"], sum(units[1]) + sum(bwd))
        else:
            first = sum(sum(u) for u in units[:-1])
            second = max(head, tr["scores"], sum(bwd))
        return first + second
    return max(need(B, T) for B, T in shapes)


def ringzero_trace(cfg: GPTConfig, shapes, stage: str = "0", nd: int = 1, act_bytes: int = 2,
                   checkpoint: bool = False) -> list:
    """The plan as a trace: every buffer allocated once at start-up, nothing after."""
    bufs = dict(plan_buffers(cfg, stage, nd))
    bufs["activations"] = activation_arena(cfg, shapes, act_bytes, checkpoint)
    return [("alloc", i + 1, b, k) for i, (k, b) in enumerate(bufs.items())]
