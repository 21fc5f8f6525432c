"""Which schedule a Ring call takes, and what it costs in rounds and bytes: one table, no MPI.

What it is
    ``choose(op, n, nbytes, length, knobs)`` is the rule ring.py runs on every
    new call; ``steps_wire`` is the same rule as (latency rounds, bytes this
    rank sends) for the models (ringzero.simulate). S = nbytes = the whole
    array (len(buf), len(send) for reduce-scatter, len(recv) for all-gather,
    times the itemsize); length = len(send).

        n          op       S                                  schedule  order
        ---------  -------  ---------------------------------  --------  -----
        N nodes    AR,RS,AG S >= node_bytes (AR: n | length)   node_aware  node, then across
        x P > 1
        not 2^k    AR, RS   S <= direct_bytes, 3 <= n <= 16    direct    ring
                            (all-reduce: also n | length)
                            otherwise                          ring      ring
        not 2^k    AG       3 <= n <= 16 (any S)               direct    -
                            otherwise                          ring      -
        2^k        AR       S <= small_bytes                   recursive_doubling  tree
                            S <= tree_bytes, n | length        rabenseifner        tree
        2^k        RS       S <= latency_bytes                 tree      tree
                            S <= direct_bytes, 3 <= n <= 16    direct    tree
                            S <= tree_bytes                    tree      tree
        2^k        AG       S <= latency_bytes                 tree      -
                            3 <= n <= 16 (any S)               direct    -
                            S <= tree_bytes                    tree      -
        2^k        AR, RS   above tree_bytes (AR: or len % n)  ring      ring
                   AG       above tree_bytes, n = 2 or n > 16  ring      -

        direct_bytes caps what needs scratch, (n-1)/n S for a direct
        reduce-scatter or all-reduce. The all-gather adds nothing and needs no
        scratch, so it has no cap and no order to keep: direct_bytes = 0 turns
        direct off for it too, any other value leaves it on at every S.

        rounds and bytes sent per rank: direct 1 per pass, recursive_doubling
        log2 n (S log2 n bytes), tree/rabenseifner log2 n per pass, ring n-1 per
        pass; every pass but recursive doubling's sends (n-1)/n S. An
        all-reduce is two passes, except recursive doubling.

    Summation order (the composition contract): an all-reduce and a
    reduce-scatter of one S (n | length) must add in one order. For a
    power-of-two n every schedule up to tree_bytes adds in the halving
    tree's order (level d = n/2 ... 1 adds x[q] + x[q ^ d]; the direct
    reduce-scatter replays that tree on the blocks it received), and the
    ring above it; for any other n, direct and the ring both add in the
    ring's order. So each op is free to take its fastest schedule at every
    size: at n = 4 and 8 the all-reduce takes Rabenseifner where the
    reduce-scatter takes direct.

    The defaults were placed with ``python -m ringzero.bench sched`` and
    benchmarks-style side-by-side runs (alternating blocks,
    docs/collectives.md) on this 2-core machine:
      - recursive doubling beats Rabenseifner up to 16 KiB at n = 4 and 8 and
        ties it at 64 KiB (all-reduce 4 KiB at n = 4: 50.6 us against 69.4
        us), and at n = 2 beats it up to 64 KiB too (16 KiB: 8.2 against
        12.0 us, MPI 8.7 us; 256 KiB: 71 against 64 us) (SMALL_BYTES);
      - Rabenseifner (reducing in place) and a direct all-reduce are within
        the launch-to-launch spread from 256 KiB to 16 MiB (16 launches of
        benchmarks/allreduce_schedules.py: 28 cells to 36); Rabenseifner
        needs S/2 of scratch, direct (n-1)/n S;
      - the direct reduce-scatter and all-gather tie the tree up to 64 KiB
        (LATENCY_BYTES) and beat it from 256 KiB (reduce-scatter 1 MiB at
        n = 4: 290 us against 650 us); DIRECT_BYTES caps the reduce-scatter's
        scratch;
      - the direct all-gather beat the ring and the tree at 64 MiB in three
        launches of ``sched -o all_gather -b 4M -e 64M`` each at n = 4 and 8
        (n = 8: 18.7-20.7 ms against ring 28.2-31.3 ms, tree 23.0-29.8 ms).

What it is not
    A cost model of the machine: rounds and bytes only (simulate.py fits α, β).
    The node-aware schedule (``nodes`` > 1) is the first row of the rule: ranks
    that span several nodes with the same number on each sum inside each node,
    cross once, and gather back (plan.node_aware); its passes use this table,
    but for the one across the nodes, which sends one way per pair of ranks
    (PAIR_BYTES across two nodes; across more, the all-gather always and the
    reduce-scatter from CROSS_RING_BYTES).
"""
from __future__ import annotations

import math

SMALL_BYTES = 64 * 1024    # all_reduce at or below: recursive doubling (power-of-two n)
LATENCY_BYTES = 64 * 1024  # RS and AG at or below, for a power-of-two n: the tree, not direct
TREE_BYTES = 16 << 20      # at or below: halving/doubling (power-of-two n); above: the ring
SEG_BYTES = 1 << 20        # the ring's pipeline segment
DIRECT_BYTES = 16 << 20    # RS/AR at or below, for 3 <= n <= DIRECT_RANKS: direct (scratch (n-1)/n S);
                           # the all-gather (no scratch) ignores it, except that 0 turns direct off
DIRECT_RANKS = 16          # more ranks than this never take it (n-1 messages in flight per rank)
EAGER_BYTES = 4000         # recursive doubling cuts a buffer of up to 4x this evenly into messages
                           # of at most this: Open MPI's shared-memory eager limit is 4096 bytes,
                           # header included, and a 4 KiB message pays a rendezvous round trip
NODE_BYTES = 0             # at or above, on ranks that span N > 1 nodes of P > 1 ranks each: node_aware
                           # (RINGZERO_NODE_BYTES; -1: never)
PAIR_BYTES = 0             # at or above, across two nodes: the cross pass as one directed cycle (nodes.Pair);
                           # -1: the group's exchange. 2x2 at 1 Gbit/s: as fast from 256 KiB, 1.3-1.5x faster
                           # from 4 MiB (docs/multinode.md)
CHUNK_BYTES = 2 << 20      # the node-aware schedule cuts S into chunks of about this and pipelines them
                           # (a chunk's pass across the nodes runs beside the next one's inside the node);
                           # 0: one chunk
CROSS_SEG_BYTES = 63 << 10  # the node-aware cross pass's ring cuts its messages to at most this (0: the ring's
                            # SEG_BYTES, and one message a block across two nodes), under Open MPI's TCP eager
                            # limit (64 KiB, header included): a rendezvous waits for the far rank to be inside
                            # MPI. 2x2 at 1 Gbit/s, reduce-scatter 4-64 MiB: 1.10-1.17x the link's limit -> 1.04-1.05x
                            # (docs/multinode.md)
CROSS_RING_BYTES = 4 << 20  # at or above, across N > 2 nodes: the RS's cross pass takes the ring (each pair one
                            # way; the AG's always does; -1: neither). 4x2 at 1 Gbit/s: RS and AR 14-30 % faster
                            # at 4-16 MiB, AG at 1 MiB 8.9 ms against 23.3 (docs/multinode.md)
OPS = ("all_reduce", "reduce_scatter", "all_gather")
KNOBS = ("small_bytes", "tree_bytes", "direct_bytes", "latency_bytes")  # choose()'s thresholds, by name


def defaults(n: int) -> dict:
    """The knobs a Ring over n ranks starts with (before RINGZERO_* variables)."""
    return dict(zip(KNOBS, (SMALL_BYTES, TREE_BYTES, DIRECT_BYTES, LATENCY_BYTES)))


def choose(op: str, n: int, nbytes: int, length: int, small_bytes: int, tree_bytes: int,
           direct_bytes: int, latency_bytes: int, *, nodes: int = 1, node_bytes: int = NODE_BYTES) -> str:
    """"direct" | "recursive_doubling" | "tree" | "rabenseifner" | "ring" | "node_aware" for one call.

    nodes: the number of nodes when the n ranks span several with the same number (> 1) on each,
    else 1 (nodes.NodeMap.uniform); the node-aware schedule's passes then take this rule
    themselves, each over its own group (plan.node_aware).
    """
    if nodes > 1 and 0 <= node_bytes <= nbytes and (op != "all_reduce" or length % n == 0):
        return "node_aware"
    direct = (3 <= n <= DIRECT_RANKS and direct_bytes > 0 and (op == "all_gather" or nbytes <= direct_bytes)
              and (op != "all_reduce" or length % n == 0))
    if n & (n - 1):           # no halving tree: direct, else the ring (both in the ring's order)
        return "direct" if direct else "ring"
    if op == "all_gather" and direct and nbytes > latency_bytes:   # no sums: free of tree_bytes
        return "direct"
    if nbytes > tree_bytes:   # the ring's order from here up, for every op
        return "ring"
    if op == "all_reduce":    # the halving tree's order
        return "recursive_doubling" if nbytes <= small_bytes else "rabenseifner" if length % n == 0 else "ring"
    return "direct" if direct and nbytes > latency_bytes else "tree"


def steps_wire(op: str, n: int, S: float, nodes: int = 1, **knobs) -> tuple:
    """(latency rounds, bytes sent per rank) of one call on S bytes; knobs default to ``defaults(n)``.

    The length is taken as a multiple of n (what the engine passes). nodes > 1 (n/nodes ranks on
    each): the node-aware schedule's rounds and bytes, its passes' summed (``internode_bytes`` gives
    the part of the bytes that leaves the node).
    """
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if n < 2:
        return 0, 0.0
    across = ("node_bytes", "pair_bytes", "cross_ring_bytes")
    if nodes > 1 and n % nodes == 0 and n // nodes > 1 and knobs.get("node_bytes", NODE_BYTES) >= 0:
        P, k = n // nodes, {x: v for x, v in knobs.items() if x not in across}
        ring_from = knobs.get("cross_ring_bytes", CROSS_RING_BYTES)
        rounds, sent = 0, 0.0
        for sub in ("reduce_scatter", "all_gather") if op == "all_reduce" else (op,):
            one_way = nodes > 2 and 0 <= ring_from and (sub == "all_gather" or ring_from <= S)
            kx = {**k, "direct_bytes": 0, "tree_bytes": 0} if one_way else k    # the ring (plan.node_aware)
            a = steps_wire(sub, P, S, **k)               # inside the node, on the whole buffer
            b = steps_wire(sub, nodes, S / P, **kx)      # across the nodes, on one super-block
            rounds, sent = rounds + a[0] + b[0], sent + a[1] + b[1]
        return rounds, sent
    k = {**defaults(n), **{x: v for x, v in knobs.items() if x not in across}}
    sched = choose(op, n, S, n, k["small_bytes"], k["tree_bytes"], k["direct_bytes"], k["latency_bytes"])
    passes = 2 if op == "all_reduce" else 1
    if sched == "recursive_doubling":
        lg = int(math.log2(n))
        return lg, S * lg
    per = {"direct": 1, "ring": n - 1}.get(sched) or int(math.log2(n))
    return passes * per, passes * S * (n - 1) / n


def internode_bytes(op: str, n: int, S: float, nodes: int) -> float:
    """Bytes one rank sends to other nodes in a node-aware call on S bytes (n/nodes ranks per node).

    Only the passes across the nodes leave a node: (N-1)/N of one super-block (S/P) per pass, so a
    node sends (N-1)/N S per pass, the least that must cross for a reduce-scatter or an all-gather.
    """
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if nodes < 2:
        return 0.0
    P = n // nodes
    return (2 if op == "all_reduce" else 1) * S / P * (nodes - 1) / nodes
