"""The node-aware schedule against independent references, with nodes emulated on one host.

``Ring(comm, nodes=labels)`` takes the topology from a label per rank instead of
MPI's shared-memory split, so one host can stand for N nodes of P ranks: the
schedule, its groups and its ledger are the ones a real cluster runs (the
cluster group, launch/test-cluster, runs them across real node boundaries).
References: NumPy sums in float64 of every rank's data (regenerated from its
seed), MPI's own Allreduce, the composition contract, and the bytes that must
leave a node written out here from the shapes alone.
"""
import numpy as np
import pytest
from conftest import assert_all
from test_collectives import data, exact_sum

from ringzero.comm.nodes import NodeMap
from ringzero.comm.ring import Ring
from ringzero.comm.steps import MultiWait, Wait


def layouts(n):
    """(name, labels) of the uniform multi-node maps n ranks can form: by slot and round robin."""
    out = []
    for P in range(2, n // 2 + 1):
        if n % P == 0:
            N = n // P
            out.append((f"{N}x{P} by slot", [r // P for r in range(n)]))
            out.append((f"{N}x{P} round robin", [f"node{r % N}" for r in range(n)]))
    if n % 2 == 0 and n > 2:      # two nodes, ranks 0 1 1 0 0 1 ...: one local index's ranks not in node order
        out.append((f"2x{n // 2} crossed", [(r & 1) ^ (r >> 1 & 1) for r in range(n)]))
    return out


def uniform_rings(comm):
    maps = layouts(comm.size)
    if not maps:
        pytest.skip(f"no uniform multi-node map of {comm.size} ranks with > 1 rank per node")
    rings = []
    for name, labels in maps:
        rings.append((name, labels, Ring(comm, nodes=labels)))
        other = Ring(comm, nodes=labels)   # the other cross pass at every size the test takes
        if labels.count(labels[0]) * 2 == len(labels):   # two nodes: the group's exchange (no Pair)
            other.pair_bytes = -1
            rings.append((name + ", no pair", labels, other))
        else:                                           # more: the group's ring, and the flat rule
            other.cross_ring_bytes = 0
            other.cross_seg_bytes = 200
            rings.append((name + ", cross ring, cut", labels, other))
            flat = Ring(comm, nodes=labels)
            flat.cross_ring_bytes = -1
            rings.append((name + ", no cross ring", labels, flat))
        chunked = Ring(comm, nodes=labels)               # the pipeline, in chunks of 4 KiB, and the
        chunked.chunk_bytes = 4096                       # cross pass's messages cut to 200 bytes
        chunked.cross_seg_bytes = 200
        rings.append((name + ", chunked, cut", labels, chunked))
    return rings


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ["float32", "float64", "int64", "float16"])
def test_node_aware_sums_against_numpy(comm, dtype):
    n, r = comm.size, comm.rank
    bad = []
    for name, _, ring in uniform_rings(comm):
        for L in (n, 7 * n, 4099 * n):
            exact, m = exact_sum(n, L, dtype), L // n
            x = data(r, L, dtype)
            if ring.schedule("all_reduce", x.nbytes, L) != "node_aware":
                bad.append(f"{name}: L={L} not node_aware")
            for _ in range(3):                      # the kept plan runs too
                y = x.copy()
                ring.all_reduce(y)
                rs = np.empty(m, x.dtype)
                ring.reduce_scatter(x, rs)
                ag = np.empty(L, x.dtype)
                ring.all_gather(rs, ag)
                if not np.array_equal(y.astype(np.float64), exact):
                    bad.append(f"{name}: all_reduce L={L} wrong")
                if not np.array_equal(rs.astype(np.float64), exact[r * m:(r + 1) * m]):
                    bad.append(f"{name}: reduce_scatter L={L} is not block {r}")
                if not np.array_equal(y, ag):
                    bad.append(f"{name}: all_reduce != reduce_scatter + all_gather, L={L}")
        ring.free()
    assert_all(comm, not bad, "; ".join(sorted(set(bad))[:4]))


@pytest.mark.mpi
def test_node_aware_chunks_change_no_bit(comm):
    """The pipelined chunks, and the cross pass's messages cut small, add in the unchunked schedule's
    order: random float32, every op, bitwise."""
    n, r = comm.size, comm.rank
    bad = []
    for name, labels in layouts(comm.size):
        whole, cut = Ring(comm, nodes=labels), Ring(comm, nodes=labels)
        whole.chunk_bytes, cut.chunk_bytes = 0, 4096
        whole.cross_seg_bytes, cut.cross_seg_bytes = 0, 200
        for L in (4099 * n, 10000 * n):
            x, m = data(r, L, "float32", ints=False), L // n
            outs = []
            for ring in (whole, cut):
                y, rs, ag = x.copy(), np.empty(m, x.dtype), np.empty(L, x.dtype)
                ring.all_reduce(y)
                ring.reduce_scatter(x, rs)
                ring.all_gather(x[:m], ag)
                outs.append((y, rs, ag))
            for what, a, b in zip(("all_reduce", "reduce_scatter", "all_gather"), *outs):
                if not np.array_equal(a, b):
                    bad.append(f"{name}: {what} L={L} chunked differs from one chunk")
        whole.free()
        cut.free()
    assert_all(comm, not bad, "; ".join(bad[:4]))


@pytest.mark.mpi
def test_node_aware_float_sums_match_mpi_and_agree_bitwise(comm):
    """Random float32 (rounding matters): close to MPI's Allreduce, bitwise equal on every rank."""
    from mpi4py import MPI
    n, r = comm.size, comm.rank
    bad = []
    for name, _, ring in uniform_rings(comm):
        x = data(r, 3000 * n, "float32", ints=False)
        y = x.copy()
        ring.all_reduce(y)
        ref = np.empty_like(x)
        comm.Allreduce(x, ref, op=MPI.SUM)
        if not np.allclose(y, ref, rtol=1e-5, atol=1e-5):
            bad.append(f"{name}: far from MPI's Allreduce")
        every = comm.allgather(y.tobytes())
        if any(e != every[0] for e in every):
            bad.append(f"{name}: ranks disagree")
        ring.free()
    assert_all(comm, not bad, "; ".join(bad))


@pytest.mark.mpi
def test_node_aware_ledger_counts_what_crosses_the_network(comm):
    """Per call, a rank sends (N-1)/N of one super-block (S/P) to other nodes per pass: exactly."""
    n = comm.size
    bad = []
    for name, labels, ring in uniform_rings(comm):
        N = len(set(labels))
        P = n // N
        L = 64 * n
        x = np.ones(L, np.float32)
        S = x.nbytes
        ring.ledger.reset()
        for op, passes in (("all_reduce", 2), ("reduce_scatter", 1), ("all_gather", 1)):
            if op == "all_reduce":
                ring.all_reduce(x.copy())
            elif op == "reduce_scatter":
                ring.reduce_scatter(x, np.empty(L // n, np.float32))
            else:
                ring.all_gather(np.ones(L // n, np.float32), np.empty(L, np.float32))
            want = passes * (S // P) * (N - 1) // N
            got = ring.ledger[op]["bytes_sent_internode"]
            if got != want:
                bad.append(f"{name}: {op} sent {got} bytes to other nodes, expected {want}")
        ring.free()
    assert_all(comm, not bad, "; ".join(bad))


@pytest.mark.mpi
def test_node_aware_waits_name_the_rings_ranks(comm):
    """Every wait of a node-aware plan names peers by the Ring's rank: the stall lines stay true."""
    n, r = comm.size, comm.rank
    bad = []
    for name, labels, ring in uniform_rings(comm):
        x = np.ones(16 * n, np.float32)
        for _ in range(2):                          # kept from the second call on
            ring.all_reduce(x)
        plan = next(iter(ring.cache.plans.values()))
        mates = set(ring.node_group.parent) | set(ring.cross_group.parent)
        if ring.cross_pair is not None:             # two nodes: the cross pass's own two peers
            mates |= {ring.cross_pair.left, ring.cross_pair.right}
        for st in plan.steps:
            if isinstance(st, (Wait, MultiWait)) or hasattr(st, "waiting"):
                peers = st.waiting.peer if isinstance(st.waiting.peer, tuple) else (st.waiting.peer,)
                if not set(peers) <= mates - {r}:
                    bad.append(f"{name}: a wait names {peers}, not among this rank's group mates")
        ring.free()
    assert_all(comm, not bad, "; ".join(bad))


@pytest.mark.mpi
def test_one_host_and_uneven_maps_keep_the_flat_schedules(comm):
    n = comm.size
    ring = Ring(comm)                              # one host: MPI finds one node
    flat = ring.nodes.count == 1 and ring.schedule("all_reduce", 1 << 20, n * 1024) != "node_aware"
    uneven = Ring(comm, nodes=[0] * (n - 1) + [1]) if n >= 3 else None
    ok_uneven = uneven is None or (not uneven.nodes.uniform and "flat schedules" in uneven.nodes.describe()
                                   and uneven.schedule("all_reduce", 1 << 20, n * 1024) != "node_aware")
    x = np.ones(4 * n, np.float32)
    if uneven is not None:
        uneven.all_reduce(x)
        uneven.free()
    ring.free()
    assert_all(comm, flat and ok_uneven and (uneven is None or np.all(x == n)), "flat schedule expected")


def test_node_map_from_labels():
    m = NodeMap.from_labels(["b", "a", "b", "a", "c", "c"])
    assert m.node_of == (0, 1, 0, 1, 2, 2) and m.local_of == (0, 0, 1, 1, 0, 1)
    assert m.count == 3 and m.ppn == 2 and m.uniform
    assert not NodeMap.from_labels([0, 0, 1]).uniform          # 2 + 1 ranks
    assert not NodeMap.from_labels([0, 1, 2]).uniform          # one rank per node: nothing to sum inside
    assert not NodeMap.from_labels([0, 0, 0]).uniform          # one node
    assert "2 nodes of 2, 1 ranks" in NodeMap.from_labels([0, 0, 1]).describe()
