"""The stage policy: what a ZeRO stage means to the engine, as one frozen record.

What it is
    ``StagePolicy.of(stage)`` turns a stage name into the handful of facts the
    engine acts on, all derived from the one stage table in accounting.py
    (``STAGE_TABLE``: which state classes are partitioned, and whether the
    sharding group is a node replicated across nodes):

        stage   full_params  full_grads  full_optimizer  gather_params  grad_bucket  hybrid
        0       yes          yes         yes             no             no           no
        1       yes          yes         no              no             no           no
        2       yes          no          no              no             yes          no
        3       no           no          no              yes            yes          no
        hybrid  no           no          no              yes            yes          yes

    With gradient accumulation (K > 1 micro-batches per step) the fp32
    accumulator ``grad_accum`` is held in full where params are (stages 0-2
    sum locally and reduce once per step, as DDP's no_sync) and as a shard
    where params are sharded (stage 3, hybrid reduce-scatter every
    micro-batch into it, as FSDP does): ``accumulate_locally``.

    The engine, its state and its reports ask these questions; none of them
    compares a stage string. (The ``FSDP2`` way: a frozen, documented policy
    record instead of names tested in many places.)

What it is not
    No arithmetic of bytes (accounting.py) and no communication (topology.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from ringzero.runtime import accounting

# accounting's class name of each engine buffer
BUFFER_CLASS = {"params": "params_fp16", "grads": "grads_fp16", "master": "master_fp32",
                "adam_m": "adam_m_fp32", "adam_v": "adam_v_fp32"}
# the K > 1 accumulator's class (never partitioned by STAGE_TABLE; see is_full)
ACCUM_BUFFER = {"grad_accum": accounting.ACCUM_CLASS}


@dataclass(frozen=True)
class StagePolicy:
    """What one stage holds in full, what it gathers and how it reduces."""
    stage: str             # "0" | "1" | "2" | "3" | "hybrid" (accounting.STAGES)
    sharded: frozenset     # engine buffers held as this rank's shard: {"grads", "master", ...}
    full_params: bool      # params held in full; else gathered unit by unit before use
    full_grads: bool       # grads held in full and reduced in place; else reduced into a shard
    full_optimizer: bool   # master, m and v held in full: every rank updates every piece (stage 0)
    hybrid: bool           # the sharding group is a node; shards replicated across nodes

    @classmethod
    def of(cls, stage) -> "StagePolicy":
        """The policy of a stage name ("0".."3", "hybrid", FSDP names, ints)."""
        st = accounting.parse_stage(stage)
        classes = accounting.sharded_classes(st)
        sharded = frozenset(b for b, c in BUFFER_CLASS.items() if c in classes)
        return cls(stage=st, sharded=sharded,
                   full_params="params" not in sharded,
                   full_grads="grads" not in sharded,
                   full_optimizer="master" not in sharded,
                   hybrid=accounting.replicated_across_nodes(st))

    def is_full(self, buffer: str) -> bool:
        """True if the engine buffer ("params", "grads", "master", ...) is held in full.
        The K > 1 accumulator ("grad_accum") is held in full exactly where params are."""
        if buffer == "grad_accum":
            return self.full_params
        return buffer not in self.sharded

    @property
    def gather_params(self) -> bool:
        """Params are all-gathered before a unit's forward and again before its backward."""
        return not self.full_params

    @property
    def grad_bucket(self) -> bool:
        """A unit's gradient is reduced from a unit-sized bucket into the grads shard."""
        return not self.full_grads

    @property
    def all_reduce_grads(self) -> bool:
        """Every rank needs every reduced gradient piece (stage 0): RS + AG."""
        return self.full_optimizer

    @property
    def all_gather_after_update(self) -> bool:
        """Params are held in full but updated as a shard (stages 1, 2): AG after the update."""
        return self.full_params and not self.full_optimizer

    @property
    def accumulate_locally(self) -> bool:
        """K > 1: micro-batch gradients are summed on the rank in full fp32 and
        reduced once per step (stages 0-2); else each micro-batch is
        reduce-scattered into an fp32 shard accumulator (stage 3, hybrid)."""
        return self.full_params

    def ranks_per_node(self, shard_size: int):
        """The accounting's ``ranks_per_node`` argument: the group size for hybrid, else None."""
        return shard_size if self.hybrid else None
