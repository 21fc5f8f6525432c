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
    per node, in node order). ``block_order`` says where this node keeps each
    rank's block, and across two nodes gives the ``Pair`` that replaces
    ``cross`` there.

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


class Pair:
    """Two nodes' cross pass as one directed cycle over every rank: a ring of two, with left != right.

    Between two nodes a same-local-index pair would send both ways at once on one
    connection, and over Open MPI's TCP that ran at about half the link's rate
    (docs/multinode.md). Here every pair of ranks carries one direction only:
    node 0's local l sends to node 1's l and hears from node 1's l+1; node 1's
    l sends to node 0's l-1 and hears from node 0's l (mod ppn), the reduce-
    scatter's direction; ``reversed()`` is the all-gather's. ``rank`` is the
    node index (0 or 1), ``parent`` None: left and right are the Ring's ranks.
    """

    size, parent = 2, None

    def __init__(self, comm, rank, left, right):
        self.comm, self.rank, self.left, self.right = comm, rank, left, right

    def reversed(self) -> "Pair":
        return Pair(self.comm, self.rank, self.right, self.left)


def block_order(nm: NodeMap, me: int, comm=None, pair: bool = True) -> tuple:
    """(pos, pair): where rank me's node keeps each rank's block in its local-index-major buffer.

    pos[b] = the slot of block b; local rank l's super-block is slots [l*N, (l+1)*N). With N > 2
    nodes, super-block l holds the blocks of the ranks with local index l, in node order (the
    cross pass is a group of those ranks) and pair is None. With two nodes the cross pass is a
    ``Pair``: node 0's super-block l holds [block (0, l), block (1, l)], node 1's super-block l
    holds [block (0, l-1), block (1, l)], which is what each rank's two Pair peers send and need.
    pair=False: the group layout at N = 2 too (pair None).
    """
    n, N, P = len(nm.node_of), nm.count, nm.ppn
    if N != 2 or not pair:
        lo = nm.local_of
        return tuple(lo[b] * N + sum(1 for q in range(b) if lo[q] == lo[b]) for b in range(n)), None
    at = {(nm.node_of[b], nm.local_of[b]): b for b in range(n)}   # (node, local) -> rank
    k, loc = nm.node_of[me], nm.local_of[me]
    pos = [0] * n
    for j in range(P):
        pos[at[1, j]] = 2 * j + 1
        pos[at[0, j]] = 2 * j if k == 0 else 2 * ((j + 1) % P)
    left, right = (at[1, (loc + 1) % P], at[1, loc]) if k == 0 else (at[0, loc], at[0, (loc - 1) % P])
    return tuple(pos), Pair(comm, k, left, right)


def split(comm, nm: NodeMap) -> tuple:
    """(node group, cross group) of this rank: collective over comm (two Splits)."""
    me = comm.rank
    node = comm.Split(nm.node_of[me], me)
    cross = comm.Split(nm.local_of[me], me)
    node_ranks = [r for r in range(comm.size) if nm.node_of[r] == nm.node_of[me]]
    cross_ranks = [r for r in range(comm.size) if nm.local_of[r] == nm.local_of[me]]
    return Group(node, node_ranks), Group(cross, cross_ranks)
