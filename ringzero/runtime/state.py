"""The model state of one rank: five flat buffers, held in full or as a shard.

What it is
    ``ShardedState(layout, policy, shard_rank, storage_dtype, xp)`` allocates
    the only model-state buffers the engine ever has, once:

        buffer   dtype      held in full when            else this rank's shard
        params   storage    policy.full_params (0,1,2)   stage 3, hybrid
        grads    storage    policy.full_grads (0,1)      stages 2, 3, hybrid
        master   fp32       policy.full_optimizer (0)    stages 1-3, hybrid
        adam_m   fp32       as master
        adam_v   fp32       as master
        grad_accum fp32     K > 1 only: full where params are     stage 3, hybrid
                            (stages 0-2)

    The storage dtype is fp16, bf16 (ml_dtypes.bfloat16: ``storage_dtype``)
    or fp32. A full buffer has ``layout.padded`` elements, a shard ``layout.shard_numel``.
    ``piece(name, u, r)`` is piece (u, r) of a buffer whichever way it is held,
    and ``held_ranks(name)`` the pieces this rank holds of it: that is the whole
    API the optimizer pass and the checkpoint use. ``publish`` casts master
    into params (and all-gathers them where they are held in full);
    ``gather`` assembles one class in full on the host.

    Offload (``offload``: an OffloadPolicy, offload.py): a class it moves is a
    FileStore in ``bufs`` (and ``files``) instead of an array, cut into the same
    pieces by the same layout arithmetic; ``piece`` then gives a FileView, read
    and written with offload.read_into / write_from. ``tier(name)`` says where
    a class lives. The hot path never reads a file piece whole: the update
    streams it in tiles (stream.py). On a device run without a DIR an offloaded
    class is a host array instead (``hosted``, from host_tier.PinnedArena);
    ``xp_of(name)`` is then NumPy for it.

    Also here: ``cast_into`` (the one dtype-changing copy),
    ``storage_dtype`` (a precision's dtype) and ``check_budget`` (refuse a
    stage before anything is allocated).

What it is not
    No schedule and no workspaces (workspace.py), no optimizer (optim.py).
"""
from __future__ import annotations

import numpy as np

from ringzero.comm import kernels
from ringzero.comm.backend import get_array_module, to_host
from ringzero.runtime import accounting
from ringzero.runtime.flat import Layout
from ringzero.runtime.limits import zeros
from ringzero.runtime.offload import FileStore, on_disk, read_into, write_from

BUFFERS = ("params", "grads", "master", "adam_m", "adam_v")


class MemoryBudgetError(ValueError):
    """The requested stage's model state does not fit the per-rank budget."""


class ShardedState:
    """The five state buffers of one rank, and piece-wise access to them."""

    def __init__(self, layout: Layout, policy, shard_rank: int, storage_dtype, xp, grad_accum: int = 1,
                 offload=None, arena=None):
        self.layout, self.policy, self.shard_rank, self.xp = layout, policy, shard_rank, xp
        self.offload = offload
        self.dtypes = {"params": np.dtype(storage_dtype), "grads": np.dtype(storage_dtype)}
        self.dtypes.update({k: np.dtype(np.float32) for k in ("master", "adam_m", "adam_v", "grad_accum")})
        names = BUFFERS + (("grad_accum",) if grad_accum > 1 else ())
        # a class the offload policy moves is a FileStore (offload.py): the same elements at the
        # same offsets, in a file, sliced by the same layout arithmetic
        # a device run's class offloaded without a DIR is a host array from ``arena`` (host_tier.py:
        # pageable: only the update's transfer slots are pinned), in ``hosted``
        self.bufs, self.files, self.hosted = {}, {}, set()
        for name in names:
            n = layout.padded if policy.is_full(name) else layout.shard_numel
            if offload is not None and offload.on_disk(name):
                self.bufs[name] = self.files[name] = FileStore(offload.dir, name, self.dtypes[name], n)
            elif offload is not None and arena is not None and offload.in_host_memory(name):
                self.bufs[name] = arena.zeros(n, self.dtypes[name], name, pin=False)   # no copy reads it
                self.hosted.add(name)
            else:
                self.bufs[name] = zeros(xp, n, self.dtypes[name], name)   # AllocationError names the buffer
        self.params, self.grads = self.bufs["params"], self.bufs["grads"]
        self.master, self.adam_m, self.adam_v = self.bufs["master"], self.bufs["adam_m"], self.bufs["adam_v"]
        self.accum = self.bufs.get("grad_accum")     # (padded,) or (shard_numel,) fp32; None at K = 1

    def tier(self, name: str) -> str:
        """Where buffer ``name`` lives: "ram", "device" or "disk"."""
        return "disk" if name in self.files else ("ram" if self.on_host or name in self.hosted else "device")

    def xp_of(self, name: str):
        """The array module of buffer ``name``: NumPy for a host array or a file (a device run's
        offloaded classes), else xp."""
        return np if name in self.hosted or name in self.files else self.xp

    def close(self):
        """Close the offload files (the kernel frees them: offload.py)."""
        for f in self.files.values():
            f.close()

    @property
    def on_host(self) -> bool:
        return self.xp is np

    def init_master(self, seed: int):
        """master = the initial weights: a pure function of (seed, name), the
        same at any number of shards and any stage. On disk: unit by unit."""
        L = self.layout
        if "master" in self.files:
            for u in range(len(L.units)):
                seg = np.zeros(L.unit_padded[u], np.float32)          # one unit at a time in RAM
                for p in L.units[u].params:
                    s = L.slots[p.name]
                    seg[s.in_unit:s.in_unit + p.numel] = L.init_param(p.name, seed)
                for r in self.held_ranks("master"):
                    write_from(self.piece("master", u, r), L.own(seg, u, r))
            self.files["master"].flush()        # on the disk, and out of the page cache
            return
        host = (L.init_full(np.empty(L.padded, np.float32), seed) if self.policy.is_full("master")
                else L.init_shard(np.empty(L.shard_numel, np.float32), seed, self.shard_rank))
        self.master[...] = host if self.xp_of("master") is np else self.xp.asarray(host)

    def piece(self, name: str, u: int, r: int):
        """Piece (u, r) of buffer ``name``: a view, whether held in full or as the shard."""
        return self.layout.piece(self.bufs[name], u, r)

    def held_ranks(self, name: str):
        """The piece indices r this rank holds of buffer ``name`` (all, or its own)."""
        return range(self.layout.shards) if self.policy.is_full(name) else (self.shard_rank,)

    def publish(self, ring, start: bool = False, buckets=(), cast: bool = True) -> dict:
        """params = cast(master) on the pieces this rank owns; then, where params
        are held in full but master is a shard (stages 1, 2), all-gather them.
        Collective on the shard group. start: the all-gathers are started, not
        waited for (unit u+1's cast runs while unit u's gather is on the wire);
        returns {unit: Pending} for the caller to wait on before reading params.
        buckets: ((units, blocks), ...) of consecutive units gathered by one call
        each (not with start), through (n, P) storage-dtype blocks (_publish_bucket).
        cast=False: the owned pieces hold cast(master) already (the offloaded update wrote
        them); only the gathers run, unit by unit."""
        L, P = self.layout, self.policy
        if not cast:
            buckets = ()
        started = {}
        bucket = {} if start or P.full_optimizer or not P.full_params else {
            u: gb for gb in buckets if gb[1].dtype == self.params.dtype for u in gb[0]}
        for u in range(len(L.units)):
            if u in bucket:
                if u == bucket[u][0][0]:
                    self._publish_bucket(ring, *bucket[u])
                continue
            if P.full_optimizer:
                if cast:
                    cast_into(L.unit_full(self.params, u), L.unit_full(self.master, u))
            elif not P.full_params:
                if cast:
                    cast_into(L.unit_shard(self.params, u), L.unit_shard(self.master, u))
            else:
                seg = L.unit_full(self.params, u)
                own = L.own(seg, u, self.shard_rank)
                if cast:
                    cast_into(own, L.unit_shard(self.master, u))
                if start:
                    started[u] = ring.all_gather_start(own, seg)
                else:
                    ring.all_gather(own, seg)
        return started

    def _publish_bucket(self, ring, units, blocks):
        """Consecutive units' params by one all-gather: their pieces are one run of the master
        shard, cast into this rank's row of the (n, P) blocks (P: the units' piece elements);
        after the gather row j holds rank j's pieces, copied out unit by unit (n rows each)."""
        L, a, m = self.layout, self.layout.shard_offset[units[0]], blocks.shape[1]
        own = blocks[self.shard_rank]
        cast_into(own, self.master[a:a + m])
        ring.all_gather(own, blocks.reshape(-1))
        for u in units:
            off, k = L.shard_offset[u] - a, L.piece_numel[u]
            L.unit_full(self.params, u).reshape(L.shards, k)[...] = blocks[:, off:off + k]

    def gather(self, name: str, ring, dtype=np.float32, root=None):
        """Buffer ``name`` in full, as a host array of ``layout.padded`` elements.
        Collective on the shard group; holds one unit in flight beside the result.
        root: only that shard rank allocates and fills the result; the others return None."""
        L, buf = self.layout, self.bufs[name]
        keep = root is None or root == self.shard_rank
        out = np.empty(L.padded, dtype) if keep else None
        for u in range(len(L.units)):
            if buf.size == L.padded:
                seg = L.unit_full(buf, u)
                if on_disk(seg):
                    seg = seg.read()
            else:
                seg = self.xp_of(name).empty(L.unit_padded[u], buf.dtype)
                own = L.own(seg, u, self.shard_rank)
                read_into(L.unit_shard(buf, u), own)
                ring.all_gather(own, seg)
            if keep:
                out[L.unit_offset[u]:L.unit_offset[u] + L.unit_padded[u]] = to_host(seg)
        return out

    def decay_runs(self, u: int, r: int) -> list:
        """(start, stop) runs of weight-decayed params inside piece (u, r), piece-relative."""
        L = self.layout
        a0 = L.unit_offset[u] + r * L.piece_numel[u]
        b0 = a0 + L.piece_numel[u]
        out = []
        for p in L.units[u].params:
            if not p.decay:
                continue
            s = L.slots[p.name]
            lo, hi = max(s.offset, a0), min(s.offset + p.numel, b0)
            if lo < hi:
                out.append((lo - a0, hi - a0))
        return out


def aligned_empty(xp, n, dtype, align_bytes=64):
    """An n-element buffer whose start is ``align_bytes``-aligned (NumPy), so
    BLAS reductions over it take the same path in every run."""
    if xp is not np:
        return xp.empty(n, dtype)
    item = np.dtype(dtype).itemsize
    raw = np.empty(n + align_bytes // item, dtype)
    off = (-raw.ctypes.data % align_bytes) // item
    return raw[off:off + n]


def storage_dtype(precision: str):
    """The dtype of params and grads at a precision: fp16, bf16 (ml_dtypes), fp32.
    Raises ValueError with one line (and the install hint for bf16)."""
    if precision == "fp16":
        return np.dtype(np.float16)
    if precision == "fp32":
        return np.dtype(np.float32)
    if precision == "bf16":
        try:
            import ml_dtypes
        except ImportError:
            raise ValueError("precision bf16 needs ml_dtypes: pip install 'ringzero[bf16]'") from None
        return np.dtype(ml_dtypes.bfloat16)
    raise ValueError(f"precision must be fp16, bf16 or fp32, got {precision!r}")


def check_budget(layout: Layout, stage: str, world: int, budget: int, ranks_per_node=None,
                 precision: str = "fp16", grad_accum: int = 1, offload=(), device: str = "cpu",
                 offload_to: str = "disk"):
    """Refuse, before anything is allocated, a stage whose model state per rank in memory
    (the stage formula on the padded Ψ, at this precision and K, less the classes ``offload``
    moves to disk: budget.state_by_tier) exceeds ``budget`` bytes. On a device run the memory
    is the device's, and the offloaded classes go to ``offload_to`` ("ram": host memory, or "disk")."""
    from ringzero.runtime.budget import state_by_tier, tier_totals
    kw = dict(precision=precision, grad_accum=grad_accum)
    tiers = tier_totals(state_by_tier(stage, layout.padded, world, ranks_per_node, offload=offload,
                                      device=device, offload_to=offload_to, **kw))
    need = tiers["ram" if device == "cpu" else "device"]
    if need <= budget:
        return
    on_disk = f", {tiers['disk'] / 2**20:.1f} MiB more on disk (--offload)" if tiers["disk"] else ""
    if device != "cpu" and tiers["ram"]:
        on_disk += f", {tiers['ram'] / 2**20:.1f} MiB more in host memory (--offload)"
    head = (f"stage {stage} needs {need / 2**20:.1f} MiB of model state per rank in "
            f"{'memory' if device == 'cpu' else 'device memory'} (Ψ={layout.numel:,}, "
            f"Nd={world}){on_disk}, budget is {budget / 2**20:.1f} MiB")
    fits = accounting.stages_that_fit(budget, layout.padded, world, ranks_per_node, **kw)
    if not fits:
        least = accounting.model_state_total("3", layout.padded, world, **kw)
        raise MemoryBudgetError(
            f"{head}: below the smallest stage's need (stage 3: {least / 2**20:.1f} MiB without offload); "
            "add ranks, offload (--offload optimizer,params) or shrink the model")
    raise MemoryBudgetError(f"{head}; stages that fit: {', '.join(fits)}")


def cast_into(dst, src):
    """dst[...] = src with a dtype change, through the F16C kernel where it applies.

    fp16 <-> fp32 on the host goes through ringzero.comm.kernels (bitwise equal to
    NumPy's round-to-nearest-even); everything else is the array module's copy
    (bf16 <-> fp32: ml_dtypes' casts, round to nearest even).
    """
    if dst.dtype == src.dtype:
        dst[...] = src
    elif isinstance(dst, np.ndarray) and dst.dtype == np.float32 and src.dtype == np.float16:
        kernels.f16_to_f32(src, dst)
    elif isinstance(dst, np.ndarray) and dst.dtype == np.float16 and src.dtype == np.float32:
        kernels.f32_to_f16(src, dst)
    else:
        get_array_module(dst).copyto(dst, src, casting="unsafe")
