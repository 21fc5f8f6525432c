"""Which schedule a Ring call takes, and what it costs in rounds and bytes: one table, no MPI.

What it is
    ``choose(op, n, nbytes, length, knobs)`` is the rule ring.py runs on every
    new call; ``steps_wire`` is the same rule as (latency rounds, bytes this
    rank sends) for the models (ringzero.simulate). S = nbytes = the whole
    array (len(buf), len(send) for reduce-scatter, len(recv) for all-gather,
    times the itemsize); length = len(send).

        schedule  taken when                                     rounds         bytes sent
        direct    3 <= n <= DIRECT_RANKS, S <= direct_bytes      1 per pass     (n-1)/n S per pass
                  (all-reduce: also n | length), and for a
                  power-of-two n also S > latency_bytes
        rd        all-reduce, n a power of two, S <= small_bytes log2 n        S log2 n
        tree      n a power of two, S <= tree_bytes              log2 n / pass  (n-1)/n S per pass
                  (all-reduce "rab": also n | length)
        ring      otherwise                                      n-1 per pass   (n-1)/n S per pass

    An all-reduce is two passes (reduce-scatter then all-gather) except rd.
    The defaults were placed with ``python -m ringzero.bench sched`` (alternating
    blocks, docs/collectives.md) on this 2-core machine:
      - at n = 4 and 8, up to 256 KiB, the halving tree's log2 n rounds beat
        direct's n-1 messages per pass (all-reduce 4 KiB at n = 4: rd 34.5 us,
        direct 63.8 us), and recursive doubling beats Rabenseifner up to
        64 KiB only (LATENCY_BYTES, SMALL_BYTES);
      - from 1 MiB to 16 MiB direct wins the reduce-scatter and all-gather (at
        64 MiB the all-gather lost to the ring, 0.70 against 0.81-0.93 of
        MPI's busbw); a direct reduce-scatter needs (n-1)/n S of scratch;
      - at n = 2 recursive doubling loses to halving/doubling from 16 KiB
        (SMALL_BYTES_2).

    Summation order (the composition contract): direct and ring add in the
    ring's order, rd/tree/rab in the halving tree's; a reduce-scatter and an
    all-reduce of one S always take the same family (latency_bytes and
    direct_bytes bound both ops alike), and at n = 2 there is only one pair
    to add.

What it is not
    A cost model of the machine: rounds and bytes only (simulate.py fits α, β).
"""
from __future__ import annotations

import math

SMALL_BYTES = 64 * 1024    # all_reduce at or below: recursive doubling (power-of-two n > 2)
LATENCY_BYTES = 256 * 1024 # at or below, for a power-of-two n: the halving tree, not direct
SMALL_BYTES_2 = 8 * 1024   # the same at n = 2
TREE_BYTES = 16 << 20      # at or below: halving/doubling (power-of-two n); above: the ring
SEG_BYTES = 1 << 20        # the ring's pipeline segment
DIRECT_BYTES = 16 << 20    # at or below, for 3 <= n <= DIRECT_RANKS: direct (RS scratch (n-1)/n S)
DIRECT_RANKS = 16          # more ranks than this never take it (n-1 messages in flight per rank)
EAGER_BYTES = 4000         # recursive doubling cuts a buffer of up to 4x this evenly into messages
                           # of at most this: Open MPI's shared-memory eager limit is 4096 bytes,
                           # header included, and a 4 KiB message pays a rendezvous round trip
OPS = ("all_reduce", "reduce_scatter", "all_gather")


def defaults(n: int) -> dict:
    """The knobs a Ring over n ranks starts with (before RINGZERO_* variables)."""
    return dict(small_bytes=SMALL_BYTES_2 if n == 2 else SMALL_BYTES, tree_bytes=TREE_BYTES,
                direct_bytes=DIRECT_BYTES, latency_bytes=LATENCY_BYTES)


def choose(op: str, n: int, nbytes: int, length: int, small_bytes: int, tree_bytes: int,
           direct_bytes: int, latency_bytes: int) -> str:
    """"direct" | "rd" | "tree" | "rab" | "ring" for one call (the table above)."""
    pow2 = n & (n - 1) == 0
    if (3 <= n <= DIRECT_RANKS and nbytes <= direct_bytes and not (pow2 and nbytes <= latency_bytes)
            and (op != "all_reduce" or length % n == 0)):
        return "direct"
    tree = pow2 and nbytes <= tree_bytes
    if op != "all_reduce":
        return "tree" if tree else "ring"
    if tree and nbytes <= small_bytes:
        return "rd"
    return "rab" if tree and length % n == 0 else "ring"


def steps_wire(op: str, n: int, S: float, **knobs) -> tuple:
    """(latency rounds, bytes sent per rank) of one call on S bytes; knobs default to ``defaults(n)``.

    The length is taken as a multiple of n (what the engine passes).
    """
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if n < 2:
        return 0, 0.0
    k = {**defaults(n), **knobs}
    sched = choose(op, n, S, n, k["small_bytes"], k["tree_bytes"], k["direct_bytes"], k["latency_bytes"])
    passes = 2 if op == "all_reduce" else 1
    if sched == "rd":
        lg = int(math.log2(n))
        return lg, S * lg
    per = {"direct": 1, "ring": n - 1}.get(sched) or int(math.log2(n))
    return passes * per, passes * S * (n - 1) / n
