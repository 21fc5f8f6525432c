"""The trainer's start-up memory check: refuse, in one line, a run that will not fit, and say what would.

What it is
    ``check(cfg, model, comm)`` runs on every rank after the flags and the data are checked and before
    the engine allocates anything. Each rank reads its room (runtime/limits.py: MemAvailable, the
    memory cgroup, RLIMIT_DATA) and its node (comm/nodes.py); one allgather shares them, and every
    rank reaches the same verdict from the same figures:

        a rank     model state in RAM + workspace + activations  <=  RLIMIT_DATA - VmData
        a node     its ranks' sum (+ the files of a tmpfs/ramfs --offload-dir)  <=  min(MemAvailable, cgroup's room)

    The need is runtime/budget.py's (the engine's own layout, plan and stage table; offloaded classes
    count on disk; on --device cuda the need is the device's, and the offloaded classes leave it:
    ``host_verdict`` checks those against the host's room instead, where they are host arrays)
    plus the GPT's activation estimate (tools/activations.py ``training_bytes``). A run
    that does not fit raises ConfigError: one line with both numbers and the first run that would fit
    (``budget.first_fit``), printed once by rank 0 (exits.py). ``need_of(cfg, model, run)`` is the
    arithmetic alone, for ``python -m ringzero.estimate`` and the tests.

    ``--no-mem-check`` or ``RINGZERO_MEM_CHECK=0`` skips it (as DeepSpeed and FSDP never check): for a
    node whose memory the kernel over-reports, or to let the kernel be the judge (benchmarks/capacity.py).

What it is not
    A guarantee: the activations are an estimate, and another tenant may take memory after the check.
    An allocation that fails anyway is limits.AllocationError's one line.
"""
from __future__ import annotations

import os
from dataclasses import fields

import numpy as np

from ringzero.app.config import Config, ConfigError
from ringzero.runtime import budget

CHECK_ENV = "RINGZERO_MEM_CHECK"         # "0": skip the check, as --no-mem-check
RUNTIME_SLACK = 16 << 20                 # what Python, MPI and the metrics add to a rank once it runs


def _mib(b) -> str:
    return f"{b / 2**20:,.1f} MiB"


def enabled(cfg: Config) -> bool:
    return bool(getattr(cfg, "mem_check", True)) and os.environ.get(CHECK_ENV, "1") != "0"


def offload_flag() -> bool:
    """Whether this trainer has --offload (the offload tiers): only then is it suggested."""
    return "offload" in {f.name for f in fields(Config)}


def base_run(cfg: Config, nd: int, ppn: int) -> budget.Run:
    return budget.Run(cfg.stage, nd, ppn, bool(cfg.activation_checkpointing),
                      budget.parse_offload(getattr(cfg, "offload", ())), bool(cfg.sample_chars))


def need_of(cfg: Config, model, run: budget.Run, nodes: int = 1) -> budget.Need:
    """One rank's bytes for ``run`` of this model (a GPT: its cfg gives the activations)."""
    from ringzero.comm.schedule import TREE_BYTES
    from ringzero.runtime.flat import Layout
    from ringzero.runtime.policy import StagePolicy
    from ringzero.runtime.state import storage_dtype
    from ringzero.tools.activations import training_bytes
    P = StagePolicy.of(run.stage)
    group = (cfg.ranks_per_node or run.ppn) if P.hybrid else run.nd
    rpn = group if P.hybrid else None
    L = Layout(model.units, shards=group)
    sd = storage_dtype(cfg.precision)
    cd = np.dtype(np.float32) if cfg.device == "cpu" else sd
    zpp = bool(getattr(cfg, "zeropp", "")) and P.gather_params
    blocks = zpp and cfg.device == "cuda"      # --zeropp on a device runs without overlap (zeropp.check)
    overlap = ((max(1, run.nd // run.ppn) > 1 or nodes > 1) and not blocks) if cfg.overlap is None \
        else bool(cfg.overlap)
    prefetch = (1 if cfg.prefetch is None else cfg.prefetch) if overlap and P.gather_params else 0
    rb = cfg.reduce_bucket_mb
    bucket = (0 if overlap or P.gather_params else TREE_BYTES) if rb is None else int(rb * 2 ** 20)
    cuda = cfg.device == "cuda"
    if cuda and "params" in run.offload:
        raise ValueError("--offload params runs on --device cpu only")    # first_fit passes over it
    to = "disk" if getattr(cfg, "offload_dir", "") else "ram"
    by = budget.state_by_tier(run.stage, L.padded, run.nd, rpn, cfg.precision, cfg.grad_accum, run.offload,
                              cfg.device, to)
    tiers = budget.tier_totals(by)
    extra = zeropp_bytes(cfg, L, P, run.ppn, sd) if zpp else 0    # held all run, beside the state classes
    tiers = {**tiers, "ram" if not cuda else "device": tiers["ram" if not cuda else "device"] + extra}
    ws = budget.workspace_bytes(L, P, sd, cd, cfg.grad_accum, overlap, prefetch, bucket,
                                [model.backward_reads_params(u) for u in range(len(L.units))])
    ws += budget.comm_scratch_bytes(L, P, sd, bucket) + RUNTIME_SLACK
    act = training_bytes(model.cfg, cfg.batch // cfg.grad_accum, cfg.seq_len, run.checkpointing, cd.itemsize)
    init = 4 * (L.padded if P.full_optimizer else L.shard_numel)     # ShardedState.init_master's fp32 host copy
    end = 4 * L.padded if run.sample else 0                           # the sample's engine.full_params()
    if cuda:
        # the device's need (the rooms are free device bytes): the offloaded classes, AdamW's scratch and
        # the update's pinned tile buffers are host memory (host_tier.py), so is the initial weights' copy
        if run.offload:
            ws -= 4 * max(L.piece_numel)
            init = 0
        return budget.Need(tiers["device"], ws, act, tiers["disk"], init, end)
    # the streamed update's host buffers (stream.TileStream): at most `buffers` tiles of each offloaded class
    staging = _stream_bytes(tiers["disk"], np.dtype(sd).itemsize, getattr(cfg, "offload_depth", 2) + 2)
    if tiers["disk"] and "params" in run.offload:       # param_reads.ParamReads: one piece read ahead
        staging += max(L.piece_numel) * np.dtype(sd).itemsize
    if run.offload and getattr(cfg, "offload_delay", None) is not None:   # delay.py's buffer: the master's size
        staging += np.dtype(sd).itemsize * (L.padded if P.full_optimizer else L.shard_numel)
    # an --offload-dir on tmpfs/ramfs: its "disk" bytes are the node's memory (counted by Need.node)
    shm = tiers["disk"] if tiers["disk"] and _memory_fs(getattr(cfg, "offload_dir", "")) else 0
    return budget.Need(tiers["ram"] + staging, ws, act, tiers["disk"], init, end, shm)


def _memory_fs(path: str) -> str | None:
    from ringzero.runtime.offload import memory_fs
    return memory_fs(path) if path else None


def _stream_bytes(on_disk: int, storage_itemsize: int, buffers: int) -> int:
    """An upper bound of the update's tile buffers (--offload-depth + 2 of them): every tile full, of
    master, m, v (fp32) and params, each with aio.AlignedBuffer's two pages of slack."""
    if not on_disk:
        return 0
    from ringzero.runtime.aio import PAGE
    from ringzero.runtime.offload import OffloadPolicy
    tile = OffloadPolicy().tile
    return buffers * (tile * (3 * 4 + storage_itemsize) + 4 * 3 * PAGE)


def _room_on_device():
    """Free device memory of this rank's GPU (None where CuPy cannot say)."""
    try:
        import cupy
        return int(cupy.cuda.runtime.memGetInfo()[0])
    except Exception:                    # the CuPy stand-in, or no device: no figure
        return None


def zeropp_bytes(cfg: Config, L, P, ppn: int, sd) -> int:
    """--zeropp's buffers per rank (runtime/zeropp.py): hpZ's secondary shard, the padded Ψ over the ranks
    of a node in the storage dtype (2Ψ/P at fp16), and qgZ's error-feedback residual (4Ψ, fp32)."""
    from ringzero.comm.quant import Quant
    words = {w.strip() for w in cfg.zeropp.split(",")}
    hpz = L.padded // max(1, ppn) * np.dtype(sd).itemsize if "hpz" in words and not P.hybrid else 0
    ef = "qgz" in words and cfg.zeropp_error_feedback
    # comm/quantized.py's grow-only scratch at the largest unit (n pieces of m): the all-gather's wire area,
    # the reduce-scatter's two wire areas, its fp32 sum, partials (<= n*m) and error-feedback copy
    n, m = L.shards, max(L.piece_numel)
    scratch = n * Quant(8, cfg.zeropp_block).wire_bytes(m) if "qwz" in words else 0
    if "qgz" in words:
        g = Quant(cfg.zeropp_bits, cfg.zeropp_grad_block).wire_bytes(m)
        scratch += 4 * n * g + 4 * m + 4 * n * m + (4 * n * m if ef else 0)
    return hpz + (4 * L.padded if ef else 0) + scratch


def verdict(cfg: Config, model, rooms: list, node_of: list, n: int):
    """The refusal line (str) for these ranks' rooms, or None when the run fits. Pure: the same on every rank."""
    from collections import Counter
    count = Counter(node_of)
    ppn, nodes = max(count.values()), len(count)
    base = base_run(cfg, n, ppn)
    need = need_of(cfg, model, base, nodes)
    cuda = cfg.device == "cuda"            # rooms: free device bytes per rank; else limits.Room
    per_rank = [x if cuda else x.rank_room for x in rooms]
    worst_rank = min(((v, r) for r, v in enumerate(per_rank) if v is not None), default=None)
    short = min(((v - need.at(r), r) for r, v in enumerate(per_rank) if v is not None), default=None)
    node_rooms = {}
    if not cuda:
        for r, x in enumerate(rooms):
            if x.node_room is not None:
                k = node_of[r]
                node_rooms[k] = min(node_rooms.get(k, x.node_room), x.node_room)
    def node_need(k):              # rank 0's node also holds the sample's gather
        return need.node(count[k], with_rank0=node_of[0] == k)
    worst_node = min(((room - node_need(k), k) for k, room in node_rooms.items()), default=None)
    if need.init > need.workspace + need.activations + need.end:     # the peak is at start-up
        parts = f"model state {_mib(need.model_state)} + the initial weights' fp32 copy {_mib(need.init)}"
    else:
        parts = (f"model state {_mib(need.model_state)} + workspace {_mib(need.workspace)} + activations "
                 f"{_mib(need.activations)}" + (f" + the sample's fp32 gather {_mib(need.end)}" if need.end else ""))
    if need.shm:
        parts += (f"; {_mib(need.disk)} offloaded to --offload-dir {cfg.offload_dir}, a "
                  f"{_memory_fs(cfg.offload_dir)} (memory, not disk): counted in the node's memory")
    elif need.disk:
        parts += f"; {_mib(need.disk)} offloaded to disk"
    what = (f"stage {base.stage} needs {_mib(need.total)} per rank ({parts}; Ψ = {model_psi(model):,}, Nd = {n})")
    if short is not None and short[0] < 0:
        r = short[1]
        where = (f"rank {r}'s GPU has {_mib(rooms[r])} free" if cuda else f"on rank {r} {rooms[r].describe_rank()}")
        if r != 0 and need.end:
            what += f"; {_mib(need.rest)} on a rank other than 0"
        line = f"{what}, more than there is: {where}"
    elif worst_node is not None and worst_node[0] < 0:
        k = worst_node[1]
        r = node_of.index(k)
        on = f"node {k}'s" if nodes > 1 else "this node's"
        line = (f"{what}; {on} {count[k]} ranks need {_mib(node_need(k))}, more than there is: "
                f"{rooms[r].describe_node()}")
    else:
        return None
    rank_room = worst_rank[0] if worst_rank else None
    node_room = min(node_rooms.values()) if node_rooms else None
    hit = budget.first_fit(lambda run: need_of(cfg, model, run, max(nodes, run.nd // run.ppn)), base,
                           rank_room, node_room, offload_flag())
    if hit:
        run, nd = hit
        hint = f"HINT: {run.flags(base)} fits ({_mib(nd.total)} per rank)"
    else:
        hint = "HINT: no stage, checkpointing, offload or node count tried fits: shrink the model or the batch"
    return f"memory: {line}; {hint}; --no-mem-check skips this check"


def host_tier_need(cfg: Config, model, run: budget.Run) -> int:
    """One rank's host bytes for a device run's host tier (--offload optimizer on cuda, no --offload-dir):
    master, Adam m and v, then the larger of the initial weights' fp32 copy and the update's buffers
    (the pinned grads and params tiles, AdamW's scratch): host_tier.py's allocations."""
    from ringzero.runtime.flat import Layout
    from ringzero.runtime.host_tier import DeviceLink
    from ringzero.runtime.offload import OffloadPolicy
    from ringzero.runtime.policy import StagePolicy
    from ringzero.runtime.state import storage_dtype
    P = StagePolicy.of(run.stage)
    group = (cfg.ranks_per_node or run.ppn) if P.hybrid else run.nd
    L = Layout(model.units, shards=group)
    by = budget.state_by_tier(run.stage, L.padded, run.nd, group if P.hybrid else None, cfg.precision,
                              cfg.grad_accum, run.offload, "cuda", "ram")
    pol, piece = OffloadPolicy(), max(L.piece_numel)
    tiles = DeviceLink.nbytes_for(storage_dtype(cfg.precision), DeviceLink.slot_elements(pol.tile, piece),
                                  getattr(cfg, "offload_depth", 2) + 2)
    init = 4 * (L.padded if P.full_optimizer else L.shard_numel)
    return budget.tier_totals(by)["ram"] + max(init, tiles + 4 * piece)


def host_verdict(cfg: Config, model, hosts: list, node_of: list, n: int):
    """The refusal line (str) when a device run's host tier does not fit its host (a rank's RLIMIT_DATA,
    a node's MemAvailable or cgroup), or None. ``hosts``: each rank's limits.Room. Pure."""
    from collections import Counter
    count = Counter(node_of)
    run = base_run(cfg, n, max(count.values()))
    need = host_tier_need(cfg, model, run)
    what = (f"memory: --offload {','.join(sorted(run.offload))} on --device cuda keeps {_mib(need)} per rank in "
            "host memory (master, Adam m and v, the update's buffers)")
    hint = "HINT: --offload-dir DIR keeps them on disk; --no-mem-check skips this check"
    for r, h in enumerate(hosts):
        if h.rank_room is not None and need > h.rank_room:
            return f"{what}, more than there is: on rank {r} {h.describe_rank()}; {hint}"
    for k in sorted(count):
        on = [hosts[r] for r in range(n) if node_of[r] == k and hosts[r].node_room is not None]
        room = min(on, key=lambda h: h.node_room) if on else None
        if room is not None and count[k] * need > room.node_room:
            where = f"node {k}'s" if len(count) > 1 else "this node's"
            return (f"{what}; {where} {count[k]} ranks need {_mib(count[k] * need)}, more than there is: "
                    f"{room.describe_node()}; {hint}")
    return None


def model_psi(model) -> int:
    from ringzero.runtime.flat import Layout
    return Layout(model.units).numel


def check(cfg: Config, model, comm):
    """Collective: raise ConfigError (the same line on every rank) if the run will not fit. See the docstring."""
    if not enabled(cfg):
        return
    from ringzero.comm.nodes import NodeMap
    from ringzero.runtime.limits import MEM_AVAILABLE_ENV, Room
    err = host = None
    # a device run's host tier (--offload without --offload-dir on cuda): the host's room too
    host_tier = cfg.device == "cuda" and bool(getattr(cfg, "offload", "")) and not getattr(cfg, "offload_dir", "")
    try:                                  # read before any collective; a bad figure travels with the others
        mine = _room_on_device() if cfg.device == "cuda" else Room.read()
        host = Room.read() if host_tier else None
    except ValueError as e:
        mine, err = None, f"{MEM_AVAILABLE_ENV}: {e}"
    nm = NodeMap.discover(comm) if comm.size > 1 else NodeMap.from_labels([0])
    got = comm.allgather((mine, host, err)) if comm.size > 1 else [(mine, host, err)]
    errs = [e for _, _, e in got if e]
    if errs:
        raise ConfigError(errs[0])
    if host_tier:
        line = host_verdict(cfg, model, [h for _, h, _ in got], list(nm.node_of), comm.size)
        if line:
            raise ConfigError(line)
    rooms = [x for x, _, _ in got]
    if cfg.device == "cuda" and any(x is None for x in rooms):
        return                            # no figure to compare with
    line = verdict(cfg, model, rooms, list(nm.node_of), comm.size)
    if line:
        raise ConfigError(line)
