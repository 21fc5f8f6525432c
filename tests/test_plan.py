"""The step plan (runtime/plan.py), serially: no MPI, no arrays.

Each property is checked against a brute-force reading of the step's positions
written here, not against the plan's own helpers:
- slots: the number of workspaces equals the peak number of units alive at
  one position (read there), and no two units alive together share a slot;
- the last unit is materialized once per step, every other reading unit twice
  (an embedding whose backward reads no weights: once);
- a tied gradient stays open from the head's backward to the embedding's;
- the per-position tables name exactly the units each position reads/writes.
"""
import pytest

from ringzero.runtime.plan import build_plan


def gpt_like(blocks, tied=True):
    """needs[u] of emb, blocks, head: the head reads the embedding when tied."""
    U = blocks + 2
    needs = [(u,) for u in range(U)]
    if tied:
        needs[-1] = (U - 1, 0)
    return needs


def positions(U):
    return [("F", u) for u in range(U)] + [("B", u) for u in reversed(range(U))]


def reading(needs, bwd_reads):
    """Brute force: the set of units whose params each position reads."""
    return [set(needs[u]) if ph == "F" or bwd_reads[u] else set() for ph, u in positions(len(needs))]


CASES = [(blocks, tied, emb_bwd) for blocks in (0, 1, 2, 5) for tied in (True, False) for emb_bwd in (True, False)]


@pytest.mark.parametrize("blocks, tied, emb_bwd", CASES)
def test_slots_equal_peak_alive(blocks, tied, emb_bwd):
    needs = gpt_like(blocks, tied)
    U = len(needs)
    bwd = [emb_bwd] + [True] * (U - 1)
    plan = build_plan(needs, bwd)
    sets = reading(needs, bwd)
    # a unit is alive (materialized) exactly where it is read: a run of
    # consecutive reads holds one materialization, a gap frees it
    assert plan.param_slots == max(len(r) for r in sets), (plan.param_slots, sets)
    assert plan.forward_slots == max(len(r) for r in sets[:U])
    # no two materializations alive at one position share a slot
    slot_of = {(w, i): s for i, pairs in enumerate(plan.materialize) for w, s, _ in pairs}
    for i in range(2 * U):
        now = [slot_of[(w, a)] for w, a, b in plan.param_runs if a <= i <= b]
        assert len(now) == len(set(now)) == len(sets[i]), (i, now)


@pytest.mark.parametrize("blocks, tied, emb_bwd", CASES)
def test_gathers_per_unit(blocks, tied, emb_bwd):
    needs = gpt_like(blocks, tied)
    U = len(needs)
    plan = build_plan(needs, [emb_bwd] + [True] * (U - 1))
    count = [sum(w == u for pairs in plan.materialize for w, _, _ in pairs) for u in range(U)]
    assert count[U - 1] == 1, count                        # the last unit: forward and backward adjacent
    for u in range(1, U - 1):
        assert count[u] == 2, count                        # a block: forward, then again for backward
    if U > 2:
        # the embedding: forward, then backward if it reads weights; a tied head
        # reads it at positions U-1 and U, adjacent to neither (with a block between)
        want = 1 + (1 if emb_bwd else 0) + (1 if tied else 0)
        assert count[0] == want, (count, want)


@pytest.mark.parametrize("blocks", [0, 1, 3])
def test_tied_gradient_open_from_head_to_embedding(blocks):
    needs = gpt_like(blocks, tied=True)
    U = len(needs)
    plan = build_plan(needs, [False] + [True] * (U - 1))
    opened = {w: i for i, pairs in enumerate(plan.grad_open) for w, _ in pairs}
    closed = {w: i for i, pairs in enumerate(plan.grad_close) for w, _ in pairs}
    assert opened[0] == U and closed[0] == 2 * U - 1        # head's backward .. embedding's backward
    for u in range(1, U):
        b = 2 * U - 1 - u                                  # position of u's backward
        assert opened[u] == b and closed[u] == b
    # the embedding's gradient slot is never shared while it is open
    slot0 = dict(plan.grad_open[U])[0]
    for i in range(U + 1, 2 * U - 1):
        assert all(s != slot0 for w, s in plan.grad_open[i]), (i, plan.grad_open[i])
    # peak open gradients: the embedding's plus one block's (plus the head's at position U)
    assert plan.grad_slots == (2 if U > 1 else 1)


@pytest.mark.parametrize("blocks, tied", [(2, True), (2, False), (0, True)])
def test_tables_name_what_each_position_reads_and_writes(blocks, tied):
    needs = gpt_like(blocks, tied)
    U = len(needs)
    plan = build_plan(needs, [False] + [True] * (U - 1))
    for i, (ph, u) in enumerate(positions(U)):
        reads = {w for w, _ in plan.param_reads[i]}
        if ph == "F" or u != 0:
            assert reads == set(needs[u]), (i, reads)
        else:
            assert reads == set(), (i, reads)                # the embedding's backward reads no weights
        writes = {w for w, _ in plan.grad_writes[i]}
        assert writes == (set(needs[u]) if ph == "B" else set()), (i, writes)
    assert list(plan.positions) == positions(U)


def test_embedding_and_tied_head_alone_gather_once():
    """Two units, tied: the embedding is read at every position, so it is one run."""
    plan = build_plan(gpt_like(0, tied=True), [True, True])
    assert [w for pairs in plan.materialize for w, _, _ in pairs] == [0, 1]
    assert plan.param_slots == 2


def test_bad_flags():
    with pytest.raises(ValueError, match="expected one backward_reads_params flag per unit"):
        build_plan([(0,), (1,)], [True])


@pytest.mark.parametrize("blocks", [0, 1, 3, 6])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("inflight", [0, 1, 2])
def test_gradient_slots_count_the_reductions_in_flight(blocks, tied, inflight):
    """Overlap: a slot stays held `inflight` positions past its close; the count is the peak held
    (counted here by brute force) and no slot is opened for a unit while its last user still holds it."""
    needs = gpt_like(blocks, tied)
    U = len(needs)
    p = build_plan(needs, [True] * U, inflight)
    P, last = 2 * U, 2 * U - 1
    writes = {w: [i for i, (ph, u) in enumerate(positions(U)) if ph == "B" and w in needs[u]] for w in range(U)}
    held = {w: (min(ws), min(max(ws) + inflight, last)) for w, ws in writes.items()}
    peak = max(sum(1 for a, h in held.values() if a <= i <= h) for i in range(P))
    assert p.grad_slots == peak
    slot = {w: s for i in range(P) for w, s in p.grad_open[i]}
    for w in range(U):
        for v in range(U):
            if w != v and slot[w] == slot[v]:
                (a, h), (b, k) = held[w], held[v]
                assert h < b or k < a, f"units {w} and {v} share slot {slot[w]} while both held"
    # every in-flight reduction that ends before the step does is released exactly where its hold ends
    released = {(w, s): i for i in range(P) for w, s in p.grad_release[i]}
    for w, (a, h) in held.items():
        if inflight and h < last:
            assert released[(w, slot[w])] == h + 1
        else:
            assert (w, slot[w]) not in released
    if inflight == 0:
        assert p.grad_slots == build_plan(needs, [True] * U).grad_slots and not released


def test_inflight_must_be_a_count():
    with pytest.raises(ValueError, match="inflight"):
        build_plan(gpt_like(1), [True] * 3, -1)


def brute_runs(sets):
    """[(unit, first, last)]: the maximal runs of consecutive positions reading each unit."""
    out = []
    for w in sorted(set().union(*sets)):
        at = [i for i, s in enumerate(sets) if w in s]
        start = at[0]
        for prev, i in zip(at, at[1:] + [None]):
            if i != prev + 1:
                out.append((w, start, prev))
                start = i
    return out


@pytest.mark.parametrize("blocks", [0, 1, 3, 6])
@pytest.mark.parametrize("tied, emb_bwd", [(True, False), (False, True)])
@pytest.mark.parametrize("prefetch", [0, 1, 2, 3])
@pytest.mark.parametrize("cast", [False, True])
def test_prefetch_starts_gathers_early_and_never_shares_a_busy_buffer(blocks, tied, emb_bwd, prefetch, cast):
    """Prefetch N: every run but the step's first has its gather started at max(first - N, 0), and
    no slot or landing is given to two runs while both are busy. Busy, in half positions (2i: the
    materializations of position i, 2i + 1: its gathers started, its compute): a param slot from
    the gather's start (no cast: the gather lands in it) or from the cast (2·first) to 2·last + 1;
    a landing (cast) from the gather's start to the cast, or only at 2·first when it is gathered there.
    The counts are the peaks of that, counted here."""
    needs = gpt_like(blocks, tied)
    U = len(needs)
    bwd = [emb_bwd] + [True] * (U - 1)
    p = build_plan(needs, bwd, prefetch=prefetch, land_in_slot=not cast)
    rs = brute_runs(reading(needs, bwd))
    at = {(w, i): (s, g) for i, m in enumerate(p.materialize) for w, s, g in m}
    early = 0
    slot_busy, land_busy, land_now = {}, {}, {}
    for w, a, b in rs:
        s, g = at[(w, a)]
        start = a if (prefetch == 0 or a == 0) else max(a - prefetch, 0)
        if start < a:
            assert (w, s, g) in p.gather_start[start], (w, a, b)
            early += 1
        t0 = 2 * start + 1 if start < a else 2 * a
        slot_busy[(w, a)] = (s, range(2 * a if cast else t0, 2 * b + 2))
        if cast and start < a:
            land_busy[(w, a)] = (g, range(t0, 2 * a + 1))
        elif cast:      # gathered and cast at once: one after another, those of a position may share
            land_now.setdefault(2 * a, set()).add(g)
    assert early == sum(len(st) for st in p.gather_start), "a gather started for no run"
    for busy, count in ((slot_busy, p.param_slots), (land_busy, p.land_slots)):
        peak = 0
        for t in range(4 * U):
            now = [k for k, ts in busy.values() if t in ts]
            assert len(now) == len(set(now)), f"time {t}: a buffer given to two busy runs: {now}"
            if busy is land_busy:
                assert not set(now) & land_now.get(t, set()), f"time {t}: a landing still in flight reused"
                now += sorted(land_now.get(t, ()))[:1]
            peak = max(peak, len(now))
        if busy is slot_busy or cast:
            assert count == max(peak, 1), (count, peak)
    if prefetch == 0:
        assert not any(p.gather_start)
        assert p.param_slots == build_plan(needs, bwd).param_slots


def test_prefetch_must_be_a_count():
    with pytest.raises(ValueError, match="prefetch"):
        build_plan(gpt_like(1), [True] * 3, prefetch=-1)
