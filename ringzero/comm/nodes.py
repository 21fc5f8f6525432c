"""Which ranks share a node, found once: the topology the node-aware schedule runs on.

What it is
    ``NodeMap.discover(comm, nodes=None)`` is collective over ``comm`` (the
    Ring's constructor calls it, right after its Dup). Without ``nodes`` it
    asks MPI: ``MPI_COMM_TYPE_SHARED`` splits ``comm`` by node, and one
    allgather tells every rank where every other rank is. ``nodes`` (a node
    label per rank) sets the map instead, which lets one host stand in for
    several nodes in tests.

    ``node_of[r]``  the node index of rank r (nodes numbered in the order of their lowest rank)
    ``local_of[r]`` rank r's index inside its node (by rank)
    ``ppn``         ranks per node when every node has the same number, else None
    ``uniform``     several nodes, the same number (> 1) of ranks on each:
                    only then can the node-aware schedule run

    ``Group``: a sub-communicator seen as a Ring sees itself (comm, rank,
    size, left, right) plus ``parent``, the rank in the Ring's communicator
    of each of its ranks, so a stall or error line names the Ring's rank.
    ``split(comm)`` makes the two a node-aware call runs on: ``node`` (the
    ranks of this node) and ``cross`` (the ranks with this local index, one
    per node, in node order).

What it is not
    A placement policy: ranks stay where the launcher put them. A map that is
    not uniform is reported (``describe``) and the flat schedules run.
"""
from __future__ import annotations

from dataclasses import dataclass

from mpi4py import MPI


@dataclass(frozen=True)
class NodeMap:
    node_of: tuple
    local_of: tuple
    count: int                # number of nodes
    ppn: int | None           # ranks per node, if the same on every node

    @property
    def uniform(self) -> bool:
        return self.count > 1 and self.ppn is not None and self.ppn > 1

    @classmethod
    def from_labels(cls, labels) -> "NodeMap":
        """The map of a node label per rank (any hashable labels)."""
        order = {}
        for lab in labels:
            order.setdefault(lab, len(order))
        node_of = tuple(order[lab] for lab in labels)
        seen = [0] * len(order)
        local_of = []
        for k in node_of:
            local_of.append(seen[k])
            seen[k] += 1
        ppn = seen[0] if len(set(seen)) == 1 else None
        return cls(node_of, tuple(local_of), len(order), ppn)

    @classmethod
    def discover(cls, comm, nodes=None) -> "NodeMap":
        """Collective over comm: MPI's shared-memory split, or the labels given (one per rank)."""
        if nodes is not None:
            labels = list(nodes)
            if len(labels) != comm.size:
                raise ValueError(f"ring: expected nodes to give one node per rank ({comm.size}), got {len(labels)}")
            return cls.from_labels(labels)
        local = comm.Split_type(MPI.COMM_TYPE_SHARED, 0)
        try:
            leader = local.allreduce(comm.rank, op=MPI.MIN)   # the node's lowest rank names it
        finally:
            local.Free()
        return cls.from_labels(comm.allgather(leader))

    def describe(self) -> str:
        if self.count == 1:
            return "one node"
        sizes = [self.node_of.count(k) for k in range(self.count)]
        if self.uniform:
            return f"{self.count} nodes x {self.ppn} ranks"
        if len(set(sizes)) == 1:      # one rank per node: nothing to sum inside a node
            return f"{self.count} nodes x 1 rank (one rank per node, so the flat schedules run)"
        return (f"{self.count} nodes of {', '.join(map(str, sizes))} ranks: not the same number on each, "
                "so the flat schedules run")

    def crosses(self, a: int, b: int) -> bool:
        return self.node_of[a] != self.node_of[b]


class Group:
    """A sub-communicator of a Ring, with the Ring's rank of each member (``parent``)."""

    def __init__(self, comm, parent):
        self.comm, self.parent = comm, tuple(parent)
        self.rank, self.size = comm.rank, comm.size
        self.left, self.right = (self.rank - 1) % self.size, (self.rank + 1) % self.size

    def free(self):
        self.comm.Free()


def split(comm, nm: NodeMap) -> tuple:
    """(node group, cross group) of this rank: collective over comm (two Splits)."""
    me = comm.rank
    node = comm.Split(nm.node_of[me], me)
    cross = comm.Split(nm.local_of[me], me)
    node_ranks = [r for r in range(comm.size) if nm.node_of[r] == nm.node_of[me]]
    cross_ranks = [r for r in range(comm.size) if nm.local_of[r] == nm.local_of[me]]
    return Group(node, node_ranks), Group(cross, cross_ranks)
