"""The step's static plan: when each unit is materialized and reduced, and in which slot.

What it is
    A pure function of the model's unit graph, made once at start-up:

        build_plan(needs, backward_reads_params, inflight=0, prefetch=0, land_in_slot=True) -> StepPlan

    ``needs[u]`` lists the units whose parameters unit u reads (itself first;
    a head tied to the token embedding also needs unit 0), and
    ``backward_reads_params[u]`` says whether u's backward reads them again.
    A step visits its *positions* in order: forward 0..U-1, then backward U-1..0::

        position   0    1    2    3  |  4    5    6    7        (U = 4: emb, b1, b2, head)
        visits     F0   F1   F2   F3 |  B3   B2   B1   B0

    - A unit's params are *materialized* (gathered at stage 3, cast to the
      compute dtype) once per maximal run of consecutive positions that read
      them. A block is materialized for its forward and again for its
      backward; the last unit's forward and backward are adjacent, so it is
      materialized once (as FSDP does).
    - A unit's gradient is *open* (zeroed) from its first write to its last;
      then it is closed (cast, reduced). A tied gradient stays open from the
      head's backward (position U) to the embedding's (position 2U-1).
    - Runs get unit-sized slots greedily, reusing freed ones, so the number of
      slots is the peak number of units alive at once.
    - ``inflight`` (overlap: a closed gradient's reduction runs while the next
      ``inflight`` positions compute): a gradient slot stays held for that many
      positions after its close, so the slot count is the peak alive including
      the in-flight reductions, and no slot is zeroed for another unit while
      its reduction may still read it. ``grad_release[i]`` lists the slots
      whose reduction must be done before position i runs (the engine waits
      there; a slot freed at the end of the backward is waited for then).
    - ``prefetch`` (overlap, params gathered: stage 3, hybrid; FSDP's
      forward/backward prefetch, DeepSpeed's stage-3 prefetch): the gather
      of a run that begins at position a is *started* at position a - N
      (the step's first run is gathered where it is read; runs before N
      start at position 0), after that position's own materializations and
      before its compute, and waited for at a. A gather lands in a
      *landing*: the param slot itself when nothing is cast
      (``land_in_slot``), so that slot is held from the start; else a
      storage-dtype buffer of its own, held from the start to the cast at
      a, and the param slot only from a. Times within a position are
      counted in halves (2p: materialize, 2p+1: start gathers, compute),
      so a landing cast at p is free for a gather started at p. Every
      started gather is waited for within its step: nothing is in flight
      between steps.

            N = 1, no cast     position  0    1    2    3  (F0 F1 F2 F3 ...)
                               gathers   g0   g2   g3   ...
                               slot held by unit 1 from position 0, compute 1

    - ``reduce_buckets`` (stages 0-2, DDP's buckets, DeepSpeed's
      reduce_bucket_size): gradients that close one after the other, of
      units next to each other in the layout, share one reduction of at most
      ``cap`` bytes. A blocking reduction waits for the slowest rank, so a
      step pays that wait once per bucket rather than once per unit::

            close order   B3   B2   B1   B0      (units 3, 2, 1, 0)
            cap = all     [0 1 2 3]               one reduce-scatter
            cap = 2 units [2 3] [0 1]             two

    (Not to be confused with the collective plans of ringzero/comm: which
    algorithm a Ring call runs is comm/schedule.py; this plan says when a
    unit is gathered and reduced.)

What it is not
    No MPI, no arrays, no dtypes: indices only. The engine turns slots into
    workspaces and views (slots.py); tests/test_plan.py checks the plan
    serially.
"""
from __future__ import annotations

from dataclasses import dataclass

FORWARD, BACKWARD = "F", "B"


@dataclass(frozen=True)
class StepPlan:
    """Everything the step loop needs to know, per position of the step.

    Runs are (unit, first position, last position), ordered by first position.
    Per-position tables are tuples of (unit, slot) pairs.
    """
    positions: tuple            # ((phase, unit), ...): forward 0..U-1, then backward U-1..0
    param_runs: tuple           # maximal runs of positions reading a unit's params
    forward_runs: tuple         # the same for a forward pass alone (evaluation)
    grad_runs: tuple            # (unit, first write, last write): one per unit
    param_slots: int            # param workspaces a training step needs
    forward_slots: int          # param workspaces a forward-only pass needs
    grad_slots: int             # gradient workspaces
    materialize: tuple          # position -> (unit, slot, landing) to materialize there
    param_reads: tuple          # position -> materialized units its unit reads, and their slot
    forward_materialize: tuple  # the same two for a forward-only pass (positions 0..U-1)
    forward_reads: tuple
    grad_open: tuple            # position -> gradients opened (zeroed) before it runs
    grad_close: tuple           # position -> gradients closed (cast, reduced) after it runs
    grad_writes: tuple          # position -> the open gradients its backward adds into
    grad_inflight: int = 0      # positions a closed gradient's reduction may stay in flight
    grad_release: tuple = ()    # position -> (unit, slot) whose in-flight reduction ends before it
    prefetch: int = 0           # positions ahead a run's gather is started (overlap, params gathered)
    gather_start: tuple = ()    # position -> (unit, slot, landing) whose gather starts there, before its compute
    land_slots: int = 1         # landing buffers of a training step (param slots when land_in_slot)
    forward_land_slots: int = 1

    @property
    def units(self) -> int:
        return len(self.positions) // 2


def runs(sets, units: int) -> list:
    """[(unit, first, last)]: maximal runs of consecutive positions i with
    ``unit in sets[i]``, ordered by (first, unit)."""
    out = []
    for w in range(units):
        start = prev = None
        for i in (i for i, s in enumerate(sets) if w in s):
            if start is None or i != prev + 1:
                if start is not None:
                    out.append((w, start, prev))
                start = i
            prev = i
        if start is not None:
            out.append((w, start, prev))
    return sorted(out, key=lambda r: (r[1], r[0]))


def assign_slots(rs) -> tuple:
    """Greedy slot assignment of runs ordered by first position: a slot is
    free again after its run's last position. Returns ({(unit, first): slot}, slots)."""
    slots, n = _greedy([(a, b) for _, a, b in rs])
    return {(w, a): s for (w, a, _), s in zip(rs, slots)}, n


def _tables(rs, slots, lands, order, needs, count):
    """Per position: ((unit, slot, landing) materialized there, (unit, slot) its unit reads)."""
    at = [[] for _ in range(count)]
    for w, a, _ in rs:
        at[a].append((w, slots[(w, a)], lands[(w, a)]))
    ends = {(w, a): b for w, a, b in rs}
    live, reads = {}, []
    for i in range(count):
        for w, s, _ in at[i]:
            live[w] = (s, ends[(w, i)])
        u = order[i][1]
        reads.append(tuple((w, live[w][0]) for w in needs[u] if w in live and live[w][1] >= i))
    return tuple(tuple(x) for x in at), tuple(reads)


def _greedy(intervals) -> tuple:
    """Greedy slots of (first, last) intervals (ends inclusive): [slot per interval, in input order], count."""
    out, free, live, n = [None] * len(intervals), [], [], 0
    for k in sorted(range(len(intervals)), key=lambda k: intervals[k][0]):   # stable: ties keep their order
        a, b = intervals[k]
        for item in [x for x in live if x[0] < a]:
            live.remove(item)
            free.append(item[1])
        out[k] = free.pop() if free else n
        n = max(n, out[k] + 1)
        live.append((b, out[k]))
    return out, n


def _param_slots(rs, prefetch: int, land_in_slot: bool):
    """Slots and landings of param runs, in half-position times (see the module docstring).

    Returns ({(unit, first): slot}, slots, {(unit, first): landing}, landings,
    {position: [(unit, first)] of the runs whose gather is started there})."""
    first = min((a for _, a, _ in rs), default=0)
    starts, held, land = {}, [], []
    for w, a, b in rs:
        p = max(a - prefetch, first) if prefetch and a > first else a
        t = 2 * p + 1 if p < a else 2 * a          # its gather starts: early, before p's compute; or at a
        if p < a:
            starts.setdefault(p, []).append((w, a))
        held.append((t if land_in_slot else 2 * a, 2 * b + 1))
        # a landing is free once cast: a gather made where it is read (gather, cast, next) holds
        # its landing for no time at all, so those of one position share one
        land.append((t, 2 * a) if p < a else (2 * a, 2 * a - 0.5))
    keys = [(w, a) for w, a, _ in rs]
    slots, n = _greedy(held)
    if land_in_slot:
        return dict(zip(keys, slots)), n, dict(zip(keys, slots)), n, starts
    lands, m = _greedy(land)
    return dict(zip(keys, slots)), n, dict(zip(keys, lands)), max(m, 1), starts


def build_plan(needs, backward_reads_params, inflight: int = 0, prefetch: int = 0,
               land_in_slot: bool = True) -> StepPlan:
    """The plan of a model with ``len(needs)`` units (see the module docstring)."""
    U = len(needs)
    for name, v in (("inflight", inflight), ("prefetch", prefetch)):
        if isinstance(v, bool) or int(v) != v or v < 0:
            raise ValueError(f"expected {name} to be an int >= 0, got {v!r}")
    if len(backward_reads_params) != U:
        raise ValueError(f"expected one backward_reads_params flag per unit ({U}), "
                         f"got {len(backward_reads_params)}")
    order = tuple([(FORWARD, u) for u in range(U)] + [(BACKWARD, u) for u in reversed(range(U))])
    reads = [set(needs[u]) if (ph == FORWARD or backward_reads_params[u]) else set() for ph, u in order]
    writes = [set(needs[u]) if ph == BACKWARD else set() for ph, u in order]

    param_runs = runs(reads, U)
    forward_runs = runs(reads[:U], U)
    # a gradient accumulates from its first write to its last (the tied
    # embedding is written by the head's backward and again by its own)
    grad_runs = sorted(((w, min(i for i, ws in enumerate(writes) if w in ws),
                         max(i for i, ws in enumerate(writes) if w in ws)) for w in range(U)),
                       key=lambda r: (r[1], r[0]))
    pslot, n_param, pland, n_land, starts = _param_slots(param_runs, prefetch, land_in_slot)
    fslot, n_forward, fland, n_fland, _ = _param_slots(forward_runs, 0, land_in_slot)
    # a slot is held past its close while its reduction is in flight (to the end at most)
    last = 2 * U - 1
    held = [(w, a, min(b + inflight, last)) for w, a, b in grad_runs]
    gslot, n_grad = assign_slots(held)
    materialize, param_reads = _tables(param_runs, pslot, pland, order, needs, len(order))
    forward_materialize, forward_reads = _tables(forward_runs, fslot, fland, order, needs, U)

    P = len(order)
    gather_start = tuple(tuple((w, pslot[(w, a)], pland[(w, a)]) for w, a in starts.get(i, ()))
                         for i in range(P))
    grad_open, grad_close = [[] for _ in range(P)], [[] for _ in range(P)]
    for w, a, b in grad_runs:
        grad_open[a].append((w, gslot[(w, a)]))
        grad_close[b].append((w, gslot[(w, a)]))
    grad_release = [[] for _ in range(P)]
    for (w, a, b), (_, _, h) in zip(grad_runs, held):
        if inflight and h < last:        # the reduction started after b is done before h + 1 runs
            grad_release[h + 1].append((w, gslot[(w, a)]))
    live, grad_writes = {}, []
    for i, (ph, u) in enumerate(order):
        for w, s in grad_open[i]:
            live[w] = s
        grad_writes.append(tuple((w, live[w]) for w in needs[u]) if ph == BACKWARD else ())
    return StepPlan(positions=order, param_runs=tuple(param_runs), forward_runs=tuple(forward_runs),
                grad_runs=tuple(grad_runs), param_slots=n_param, forward_slots=n_forward,
                grad_slots=n_grad, materialize=materialize, param_reads=param_reads,
                forward_materialize=forward_materialize, forward_reads=forward_reads,
                grad_open=tuple(map(tuple, grad_open)), grad_close=tuple(map(tuple, grad_close)),
                grad_writes=tuple(grad_writes), grad_inflight=int(inflight),
                grad_release=tuple(map(tuple, grad_release)), prefetch=int(prefetch),
                gather_start=gather_start, land_slots=n_land, forward_land_slots=n_fland)


def close_order(plan: StepPlan) -> tuple:
    """The units in the order their gradients close (the backward's, U-1 .. 0 for a chain)."""
    return tuple(w for closes in plan.grad_close for w, _ in closes)


def reduce_buckets(order, nbytes, cap: int) -> tuple:
    """Consecutive closes grouped into buckets: ((units ascending), ...) in close order.

    A bucket is a run of closes whose units are consecutive and descending
    (u, u-1, ...), so that its units' pieces lie side by side in every shard,
    and whose ``nbytes[u]`` sum to at most ``cap``; a unit over ``cap`` has a
    bucket of its own. ``cap`` 0 puts every unit alone.
    """
    if isinstance(cap, bool) or int(cap) != cap or cap < 0:
        raise ValueError(f"expected the bucket cap to be an int >= 0 bytes, got {cap!r}")
    out, cur, size = [], [], 0
    for w in order:
        if cur and cur[-1] - 1 == w and size + nbytes[w] <= cap:
            cur.append(w)
            size += nbytes[w]
            continue
        if cur:
            out.append(tuple(sorted(cur)))
        cur, size = [w], nbytes[w]
    if cur:
        out.append(tuple(sorted(cur)))
    return tuple(out)
