"""The torch-side peers of ``benchmarks/train_peer.py``: how each mode is built, stepped and read back.

What it is
    ``build(a, torch, cfg, rz_init, groups_of)`` wraps ``torch_gpt.TorchGPT`` for one mode and returns a
    ``Peer``: the callable model (x, y) -> (logits, loss), its ``backward(loss)``, its ``update(lr)``
    (global-norm clip at ``a.grad_clip``, the AdamW step at this lr, gradients zeroed) and ``weights()``
    (every parameter in full, one gathered at a time; for tests). The modes, all fp32 on gloo:

      ddp           DistributedDataParallel; the whole model on every rank (as DDP is)
      fsdp-grad-op  FSDP (1) SHARD_GRAD_OP, one unit per Block, built on the meta device: each unit is
                    materialized (``param_init_fn``: ``to_empty`` + ringzero's values) just before FSDP
                    flattens and shards it, so a rank holds at most one unit in full
      fsdp-full     the same with FULL_SHARD
      fsdp2-full    FSDP2 ``fully_shard`` on each Block, then the root, on the meta device; then
                    ``to_empty`` and each rank copies its own Shard(0) rows of every parameter
      ds-zero1/2/3  DeepSpeed ZeRO stage 1/2/3 (``deepspeed.initialize`` with a config dict: fp32,
                    ``gradient_clipping``, DeepSpeed's defaults otherwise), its CPU Adam
                    (DeepSpeedCPUAdam, adamw_mode) where the op builds, else torch's AdamW. Stage 3 is
                    built under ``deepspeed.zero.Init`` (each module partitioned as it is constructed),
                    then loaded module by module: ``GatheredParameters(module's own params,
                    modifier_rank=0)``, rank 0 writes ringzero's values, DeepSpeed re-partitions them

    A Llama-family config is built the same way with ``torch_llama.TorchLlama`` (transformers' own model)
    in place of TorchGPT, its decoder layers as the units (``torch_model_class``). Built on the meta device,
    its root unit (embedding, final norm, head) is filled before FSDP (1) wraps it and its rotary table
    and tied head are restored (``finish``) once the values are in.

    Every mode takes ringzero's initial weights (``torch_gpt.RingzeroInit`` or ``torch_llama.LlamaInit``:
    one parameter at a time),
    AdamW's two groups by the layout's decay flags (``groups_of(model)``) and the same schedule, set
    on the optimizer's groups before each step.
What it is not
    A launcher or a timer (train_peer_worker.py is), or a ringzero dependency: only the torch ranks of
    the peer benchmark and the peer tests import it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

DS_MODES = {"ds-zero1": 1, "ds-zero2": 2, "ds-zero3": 3}
FSDP1 = ("fsdp-grad-op", "fsdp-full")
MODES = ("ddp",) + FSDP1 + ("fsdp2-full",) + tuple(DS_MODES)


@dataclass
class Peer:
    model: Callable          # (x, y) int64 (B, T) -> (logits, loss)
    backward: Callable       # loss -> None
    update: Callable         # lr -> None: clip, AdamW step, zero the gradients
    weights: Callable        # () -> {torch name: float32 tensor in full} (gathers; for tests)
    optimizer: str           # which AdamW ran (DeepSpeed's CPU Adam or torch's)


STALE_LOCK_S = 900      # a build of DeepSpeed's cpu_adam takes about 3 minutes on 2 cores, contended


def clear_stale_build_lock(torch, name: str = "cpu_adam", older_than_s: float = STALE_LOCK_S) -> str | None:
    """torch's JIT build (cpp_extension) takes a ``lock`` file in the op's build folder and every other
    process waits for it to go, with no end; a build killed midway leaves it behind, and every later
    DeepSpeed run hangs there. A lock older than any build is removed (the path, or None)."""
    import sys
    import time

    from torch.utils.cpp_extension import get_default_build_root
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    acc = "cpu" if torch.version.cuda is None else "cu" + torch.version.cuda.replace(".", "")
    folder = os.path.join(root, name) if root else os.path.join(
        get_default_build_root(), f"py{sys.version_info.major}{sys.version_info.minor}_{acc}", name)
    lock = os.path.join(folder, "lock")
    try:
        if time.time() - os.path.getmtime(lock) > older_than_s:
            os.remove(lock)
            print(f"train_peer_worker: removed {lock}, left by a build killed midway "
                  f"(older than {older_than_s:.0f} s; torch's build would wait for it forever)", flush=True)
            return lock
    except FileNotFoundError:            # no lock, or another rank removed it first
        pass
    return None


def adamw(torch, groups, a, adam, prefer_ds: bool):
    """(optimizer, its name): DeepSpeed's CPU Adam where asked and its op builds, else torch's AdamW."""
    if prefer_ds:
        clear_stale_build_lock(torch)
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam
            opt = DeepSpeedCPUAdam(groups, lr=a.lr, betas=(adam.beta1, adam.beta2), eps=adam.eps, adamw_mode=True)
            return opt, "DeepSpeedCPUAdam"
        except Exception as e:      # the op did not build (no compiler, ...): say so and fall back
            print(f"train_peer_worker: DeepSpeedCPUAdam unavailable ({type(e).__name__}: {e}); torch's AdamW")
    return torch.optim.AdamW(groups, lr=a.lr, betas=(adam.beta1, adam.beta2), eps=adam.eps), "torch.optim.AdamW"


def torch_model_class(cfg):
    """The torch model of a ringzero config: torch_gpt.TorchGPT for a GPTConfig, torch_llama.TorchLlama
    (transformers' LlamaForCausalLM / Qwen2ForCausalLM inside) for a LlamaConfig. Both have ``blocks``
    (the FSDP units) and are called (x, y) -> (logits, loss); a Llama built on the meta device is
    ``finish``ed (its rotary table, its tied head) once its values are in."""
    from ringzero.nn.families import LLAMA, family_of
    if family_of(cfg) == LLAMA:
        from torch_llama import TorchLlama
        return TorchLlama
    from torch_gpt import TorchGPT
    return TorchGPT


def _finish(model):
    if hasattr(model, "finish"):
        model.finish()


def _set_lr(groups, lr):
    for g in groups:
        g["lr"] = lr


def _torch_peer(torch, model, opt, name, clip_fn, grad_clip, weights):
    def update(lr):
        if grad_clip > 0:
            clip_fn()
        _set_lr(opt.param_groups, lr)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return Peer(model, lambda loss: loss.backward(), update, weights, name)


def _plain_weights(model):
    return lambda: {n: p.detach().clone() for n, p in model.named_parameters()}


def build_ddp(a, torch, cfg, rz, groups_of, adam):
    model = torch_model_class(cfg)(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(rz.value(n))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt, name = adamw(torch, groups_of(ddp), a, adam, False)
    return _torch_peer(torch, ddp, opt, name, lambda: torch.nn.utils.clip_grad_norm_(ddp.parameters(), a.grad_clip),
                       a.grad_clip, _plain_weights(model))


def build_fsdp1(a, torch, cfg, rz, groups_of, adam):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    with torch.device("meta"):
        model = torch_model_class(cfg)(cfg)
    prefix = {id(m): (p + "." if p else "") for p, m in model.named_modules()}

    def materialize(module):            # FSDP calls this on each module of a unit before sharding it
        if not any(t.is_meta for t in (*module.parameters(recurse=False), *module.buffers(recurse=False))):
            return                      # filled already (a Llama's root unit, below)
        module.to_empty(device=torch.device("cpu"), recurse=False)
        with torch.no_grad():
            for n, p in module.named_parameters(recurse=False):
                p.copy_(rz.value(prefix[id(module)] + n))

    if hasattr(model, "finish"):        # a Llama: the root unit (embedding, final norm, head, rotary table)
        in_blocks = {id(m) for b in model.blocks for m in b.modules()}     # filled here, tied, then wrapped
        for m in model.modules():
            if id(m) not in in_blocks:
                materialize(m)
        model.finish()
    strategy = {"fsdp-grad-op": ShardingStrategy.SHARD_GRAD_OP, "fsdp-full": ShardingStrategy.FULL_SHARD}[a.mode]
    # device_id=cpu: without it FSDP looks for an accelerator and refuses to start;
    # use_orig_params: the optimizer sees each parameter (by name) for its decay group
    fsdp = FSDP(model, sharding_strategy=strategy, auto_wrap_policy=ModuleWrapPolicy({type(model.blocks[0])}),
                device_id=torch.device("cpu"), use_orig_params=True, param_init_fn=materialize)
    opt, name = adamw(torch, groups_of(fsdp), a, adam, False)

    def weights():
        with FSDP.summon_full_params(fsdp):
            return {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in fsdp.named_parameters()}
    # FSDP's method reduces the norm over the shards: the whole gradient's norm
    return _torch_peer(torch, fsdp, opt, name, lambda: fsdp.clip_grad_norm_(a.grad_clip), a.grad_clip, weights)


def build_fsdp2(a, torch, cfg, rz, groups_of, adam):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with torch.device("meta"):
        model = torch_model_class(cfg)(cfg)
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for n, p in model.named_parameters():       # DTensors, Shard(0): this rank's rows only, no traffic
            p.to_local().copy_(distribute_tensor(rz.value(n), mesh, p.placements, src_data_rank=None).to_local())
    _finish(model)
    opt, name = adamw(torch, groups_of(model), a, adam, False)

    def weights():
        return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    # clip_grad_norm_ over DTensor gradients: the norm of the whole gradient
    return _torch_peer(torch, model, opt, name,
                       lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip), a.grad_clip, weights)


def ds_config(a, stage: int, largest: int = 0) -> dict:
    """DeepSpeed's config for one rank: fp32, the global-norm clip, ZeRO at ``stage``, its defaults else.
    ``a.ds_offload`` nvme (ZeRO-Infinity): the optimizer state and (stage 3) the parameters swapped to files
    under ``a.ds_nvme_dir`` through DeepSpeed's async_io op, its swap buffers sized to the largest parameter
    (``largest`` elements; DeepSpeed's default of 1e8 elements a buffer would take 400 MB before any model),
    unpinned; cpu (ZeRO-Offload): both held in host memory by DeepSpeed's CPU Adam. ``a.ds_buckets`` hf: the
    bucket sizes Transformers' DeepSpeed integration derives from the width (a memory-bound user's setting;
    benchmarks/capacity.py); deepspeed: DeepSpeed's own defaults (train_peer.py)."""
    zero = {"stage": stage}
    if a.ds_buckets == "hf":    # Transformers' "auto" values (hidden^2 buckets) instead of 5e8 elements (2 GB fp32)
        C = a.n_embd
        zero.update(reduce_bucket_size=C * C, allgather_bucket_size=C * C)
        if stage == 3:
            zero.update(stage3_prefetch_bucket_size=int(0.9 * C * C), stage3_param_persistence_threshold=10 * C)
    if a.ds_offload:
        dev = {"device": a.ds_offload, "pin_memory": False}
        if a.ds_offload == "nvme":
            dev["nvme_path"] = a.ds_nvme_dir
        zero["offload_optimizer"] = dict(dev)
        if stage == 3:
            zero["offload_param"] = dict(dev, **({"buffer_size": largest, "max_in_cpu": largest}
                                                 if a.ds_offload == "nvme" else {}))
            zero["sub_group_size"] = max(largest, 1)
    return {"train_micro_batch_size_per_gpu": a.batch, "gradient_accumulation_steps": 1,
            "gradient_clipping": a.grad_clip, "zero_optimization": zero,
            "fp16": {"enabled": False}, "bf16": {"enabled": False}, "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9, "wall_clock_breakdown": False}


def build_ds(a, torch, cfg, rz, groups_of, adam):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # zero.Init names its device by LOCAL_RANK (DeepSpeed's launcher sets it; mpirun sets Open MPI's)
    os.environ.setdefault("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"))
    import logging

    import deepspeed
    Model = torch_model_class(cfg)      # TorchGPT or TorchLlama
    deepspeed.utils.logger.setLevel(logging.WARNING)
    stage = DS_MODES[a.mode]
    largest = max(s.spec.numel for s in rz.layout.slots.values())
    config = ds_config(a, stage, largest)
    if stage == 3:
        # fp32 from the config (fp16 and bf16 off); not dtype=torch.float32: DeepSpeed 0.19.8 reads that as
        # `dtype or (fp16 if supported else bf16 ...)` and makes bf16 parameters on its CPU accelerator
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = Model(cfg)               # each module partitioned as it is built: no rank holds it all
        rank = torch.distributed.get_rank()
        for prefix, m in model.named_modules():
            own = list(m.named_parameters(recurse=False))
            if not own:
                continue
            with deepspeed.zero.GatheredParameters([p for _, p in own], modifier_rank=0):
                if rank == 0:
                    with torch.no_grad():
                        for n, p in own:
                            p.copy_(rz.value((prefix + "." if prefix else "") + n))
    else:
        model = Model(cfg)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(rz.value(n))
    opt, name = adamw(torch, groups_of(model), a, adam, True)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config, dist_init_required=False)

    def update(lr):                     # engine.step: clip (gradient_clipping), AdamW, zero the gradients
        _set_lr(engine.optimizer.param_groups, lr)
        engine.step()

    def weights():
        out = {}
        for n, p in engine.module.named_parameters():
            if stage == 3:
                with deepspeed.zero.GatheredParameters([p]):
                    out[n] = p.detach().clone()
            else:
                out[n] = p.detach().clone()
        return out
    return Peer(engine, engine.backward, update, weights, name)


def build(a, torch, cfg, rz, groups_of, adam) -> Peer:
    """The Peer of ``a.mode`` (the process group is up; ``rz``: a torch_gpt.RingzeroInit)."""
    if a.mode == "ddp":
        return build_ddp(a, torch, cfg, rz, groups_of, adam)
    if a.mode in FSDP1:
        return build_fsdp1(a, torch, cfg, rz, groups_of, adam)
    if a.mode == "fsdp2-full":
        return build_fsdp2(a, torch, cfg, rz, groups_of, adam)
    if a.mode in DS_MODES:
        return build_ds(a, torch, cfg, rz, groups_of, adam)
    raise ValueError(f"peer mode must be one of {', '.join(MODES)}, got {a.mode!r}")
