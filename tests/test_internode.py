"""What crosses the network per training step, with nodes emulated on one host.

``Zero(..., nodes=labels)`` hands a node label per rank to every Ring of the
engine (runtime/topology.py), so one host stands for N nodes of P ranks and
the node-aware schedule runs as on a cluster. After one warm step, the bytes
each rank sent to other nodes in the next step (the ledger's
``bytes_sent_internode``, read by ``traffic_report``) must equal what the
shapes alone say, written out here from Ψ (padded), N and P:

    one pass across nodes, fp16     2 (Ψ/P)(N-1)/N bytes
    stages 0-2                      2 passes (stage 0's all-reduce is its RS + AG)
    stage 3                         RS of Ψ + AG of 2Ψ - last unit (gathered once at the turn)
    hybrid (shard group = a node)   2 passes: only the replicas' all-reduce crosses

and everything else stays in the node: the total is the flat figure, unchanged.
Exact per rank, except where hybrid's shard does not split into N equal blocks
(the replicas' ring: within 2 elements per unit, the ranks' sum exact).
"""
from fractions import Fraction

import pytest
from conftest import assert_all
from test_zero import batches, engine, train

pytestmark = pytest.mark.mpi


def node_layouts(n):
    """(name, N, P, labels): N nodes of P ranks, by slot for every P | n (P = 1: every rank
    its own node, the flat schedule), and one round-robin map of two nodes."""
    out = [(f"{n // P}x{P}", n // P, P, [r // P for r in range(n)]) for P in range(1, n) if n % P == 0]
    if n >= 4 and n % 2 == 0:
        out.append((f"2x{n // 2} round robin", 2, n // 2, [f"n{r % 2}" for r in range(n)]))
    return out


def one_step(eng, comm):
    data = batches(comm, comm.size, comm.rank)
    train(eng, data, steps=1)
    x, y = data.get(1)
    return eng.step(x, y, 1e-3).skipped, eng.traffic_report()


@pytest.mark.parametrize("stage", ["0", "1", "2", "3", "hybrid"])
def test_internode_bytes_match_formula(comm, stage):
    from ringzero.runtime.optim import LossScaler
    n = comm.size
    layouts = [lay for lay in node_layouts(n) if stage != "hybrid" or lay[1] > 1]
    if not layouts:
        pytest.skip(f"no layout of {n} ranks on several nodes")
    bad = []
    for name, N, P, labels in layouts:
        # hybrid's shard group: the ranks that share a label (no ranks_per_node)
        eng = engine(comm, stage, scaler=LossScaler(init=2.0 ** 8), nodes=labels)
        if stage == "hybrid" and N > 2:
            # the replicas' all-reduce of a small shard would take recursive doubling, which sends
            # S log2 N (not 2S(N-1)/N): the formula is that of the two-pass schedules
            eng.topology.replica_ring.small_bytes = 0
        skipped, rep = one_step(eng, comm)
        L = eng.layout
        psi, last = L.padded, L.unit_padded[-1]
        cross = lambda elems: Fraction(2 * elems * (N - 1), N * P)   # noqa: E731 (fp16 bytes of one pass across)
        want = {"0": 2 * cross(psi), "1": 2 * cross(psi), "2": 2 * cross(psi),
                "3": cross(psi) + cross(2 * psi - last), "hybrid": 2 * cross(psi)}[stage]
        formula = 3 * cross(psi) if stage == "3" else want
        got = rep["measured_internode_bytes_per_step"]
        # hybrid's shard (Ψ_unit/P, a multiple of 32) need not split into N equal blocks: then
        # the replicas' ring sends one block less than the whole per pass, blocks differing by
        # one element, so a rank is within 2 elements per unit of the formula and the
        # replicas' sum (MPI's own) is exact
        uneven = stage == "hybrid" and any(u // P % N for u in L.unit_padded)
        total = comm.allreduce(got)
        if uneven:
            ok = abs(got - want) < 2 * 2 * len(L.units) and total == n * want
        else:
            ok = got == want
        if skipped or not ok:
            bad.append(f"{name}: measured {got} B across nodes (all ranks {total}), expected {want} B "
                       f"(skipped={skipped})")
        if (abs(rep["formula_internode_bytes_per_step"] - formula) >= 1
                or (not uneven and rep["plan_internode_bytes_per_step"] != want)):
            bad.append(f"{name}: report's formula {rep['formula_internode_bytes_per_step']} / plan "
                       f"{rep['plan_internode_bytes_per_step']} B, expected {formula} / {want} B")
        if (rep["nodes"], rep["node_ppn"]) != (N, P):
            bad.append(f"{name}: report says {rep['nodes']} nodes of {rep['ranks_per_node']}")
        # the node-aware schedule moves the rest inside the node: the total is the flat ring's
        flat = 2 * psi * (n - 1) // n if stage != "hybrid" else None
        if stage in ("0", "1", "2") and rep["measured_bytes_per_step"] != 2 * flat:
            bad.append(f"{name}: total {rep['measured_bytes_per_step']} B, expected {2 * flat} B")
        if stage == "hybrid" and sum(v for k, v in rep["by_op_internode"].items() if "@replica" not in k):
            bad.append(f"{name}: hybrid's shard-group traffic crossed nodes: {rep['by_op_internode']}")
    assert_all(comm, not bad, "; ".join(bad))


def test_one_host_sends_nothing_across(comm):
    """Without labels (one host) nothing crosses, and the formula says 0."""
    from ringzero.runtime.optim import LossScaler
    eng = engine(comm, "3", scaler=LossScaler(init=2.0 ** 8))
    _, rep = one_step(eng, comm)
    ok = (rep["nodes"] == 1 and rep["measured_internode_bytes_per_step"] == 0
          and rep["formula_internode_bytes_per_step"] == 0)
    assert_all(comm, ok, f"one host: {rep['nodes']} nodes, {rep['measured_internode_bytes_per_step']} B across")


def test_hybrid_shard_group_across_nodes_has_no_formula(comm):
    """Hybrid's shard group made of consecutive ranks on round-robin nodes spans them: the
    inter-node formula does not apply, and the report says so (None) beside what it measured."""
    from ringzero.runtime.optim import LossScaler
    n = comm.size
    if n < 4 or n % 2:
        pytest.skip("needs an even world size >= 4")
    eng = engine(comm, "hybrid", scaler=LossScaler(init=2.0 ** 8), ranks_per_node=2,
                 nodes=[f"n{r % 2}" for r in range(n)])
    _, rep = one_step(eng, comm)
    ok = rep["formula_internode_bytes_per_step"] is None and rep["measured_internode_bytes_per_step"] > 0
    assert_all(comm, ok, f"formula {rep['formula_internode_bytes_per_step']}, "
                         f"measured {rep['measured_internode_bytes_per_step']} B")
