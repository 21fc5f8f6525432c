"""Who shards with whom: the shard group, the replica group, and their rings.

What it is
    A small explicit object passed to whoever needs it (never a global):

        world            every rank of the job (size ``world_size``, this rank ``rank``)
        shard group      the ranks that split a unit into pieces: the world, or (HYBRID)
                         the ranks of one node; this rank holds piece ``shard_rank`` of
                         ``shard_size``
        replica group    HYBRID only: the ranks of other nodes holding the same piece
                         (one per node, ``replicas`` of them); their gradient shards
                         are all-reduced

    ``Topology.build(comm, policy, ranks_per_node)`` makes the sub-communicators
    with ``Split`` and a ``Ring`` over each. Every Ring finds its nodes itself
    (MPI's shared-memory split); ``nodes=`` (a node label per world rank)
    sets them instead, so one host can stand for several nodes in tests:
    each ring gets its members' labels, and hybrid's shard group is then a
    labelled node. ``topology.nodes`` is the world's NodeMap (count, ppn).

What it is not
    No state and no schedule; it only says who talks to whom.
"""
from __future__ import annotations

import numpy as np

from ringzero.comm.nodes import NodeMap
from ringzero.comm.ring import Ring


class Topology:
    """The communicators and rings of one engine."""

    def __init__(self, world, shard, replica=None, *, timeout=None, nodes=None):
        self.world, self.shard, self.replica = world, shard, replica
        self.rank, self.world_size = world.rank, world.size
        self.shard_rank, self.shard_size = shard.rank, shard.size
        self.replicas = replica.size if replica is not None else 1
        self.replica_rank = replica.rank if replica is not None else 0
        label = None if nodes is None else nodes[world.rank]    # each ring: its members' labels
        sub = lambda c: None if label is None else c.allgather(label)  # noqa: E731 (collective)
        self.replica_ring = Ring(replica, timeout=timeout, nodes=sub(replica)) if replica is not None else None
        self.ring = Ring(shard, timeout=timeout, nodes=sub(shard))
        # the world's small exchanges (the step's [loss, sumsq, stop] scalars,
        # eval losses, the trainer's step barrier) go through a Ring too, so the
        # stall inspector watches them; its ledger is not the step's traffic
        self.control = Ring(world, timeout=timeout, nodes=nodes)
        self.nodes = self.control.nodes      # the world's NodeMap: the inter-node formulas' N and P
        for name, r in (("shard", self.ring), ("replica", self.replica_ring), ("control", self.control)):
            if r is not None:
                r.trace_name = name          # the trace's "ring" arg: shard and replica are the ledger's
        self._one, self._all = np.zeros(1, np.float64), np.zeros(world.size, np.float64)
        self._members = None
        self.zeropp = None     # ZeRO++'s collectives (runtime/zeropp.py), set by the engine when on

    def barrier(self):
        """A barrier over the world, through the watched control ring."""
        self.control.all_gather(self._one, self._all)

    @classmethod
    def build(cls, comm, policy, ranks_per_node=None, *, timeout=None, nodes=None) -> "Topology":
        """The shard group is the world, or (hybrid) ``ranks_per_node`` consecutive
        ranks, or (hybrid, ranks_per_node None) the MPI shared-memory node, or
        the ranks that share a label of ``nodes`` (one label per rank, emulated nodes)."""
        if nodes is not None:
            nodes = list(nodes)
            if len(nodes) != comm.size:
                raise ValueError(f"nodes must give one node label per rank: expected {comm.size}, "
                                 f"got {len(nodes)}")
        if not policy.hybrid:
            return cls(comm, comm, None, timeout=timeout, nodes=nodes)
        if ranks_per_node:
            g = int(ranks_per_node)
            if g < 1 or comm.size % g:
                raise ValueError(f"ranks_per_node must divide the world size: expected "
                                 f"{comm.size} % Ng == 0, got Ng={g}")
            shard = comm.Split(comm.rank // g, comm.rank)
        elif nodes is not None:
            shard = comm.Split(NodeMap.from_labels(nodes).node_of[comm.rank], comm.rank)
        else:
            from mpi4py import MPI
            shard = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
        replica = comm.Split(shard.rank, comm.rank)
        return cls(comm, shard, replica, timeout=timeout, nodes=nodes)

    @property
    def writes_checkpoint(self) -> bool:
        """One copy of each shard is written: the first replica's."""
        return self.replica_rank == 0

    def shard_members(self) -> list:
        """World ranks of my shard group, ordered by shard rank."""
        if self._members is None:
            if self.shard is self.world:
                self._members = list(range(self.world_size))
            else:
                from mpi4py import MPI
                wg, sg = self.world.Get_group(), self.shard.Get_group()
                self._members = MPI.Group.Translate_ranks(sg, list(range(self.shard_size)), wg)
        return self._members

    def ledgers(self):
        """(label, ledger) of every byte ledger of this engine's step traffic: the rings', then ZeRO++'s."""
        for name, ring in self.rings():
            yield name, ring.ledger
        if self.zeropp is not None:
            yield from self.zeropp.ledgers()

    def rings(self):
        """(label, ring) of every ring this engine sends on: the ledger's sources."""
        out = [("shard", self.ring)]
        if self.replica_ring is not None:
            out.append(("replica", self.replica_ring))
        return out
