"""A collective call compiled once: the op and schedule turned into a ``CollectivePlan``.

What it is
    ``build(ring, name, xp, send, recv, sched, scratch)`` turns one collective
    on one pair of buffers into a ``CollectivePlan`` (steps.py): it picks the
    construction of algorithms.py that ``sched`` names (comm/schedule.py
    chose it), cuts the views it works on and hands it the scratch, so that a
    call that reuses its buffers costs a dictionary lookup, then per step one
    ``Startall``, one blocking wait inside MPI (the GIL released) and the add.
    ``sched`` is "ring", "tree" (halving RS / doubling AG),
    "recursive_doubling" (an all-reduce over the whole buffer), "rabenseifner"
    (halving then doubling) or "direct" (every block to its owner at once).

What it is not
    It runs nothing (executor.py does) and checks no argument (checks.py did).
    A plan holds its buffers alive; the Ring's cache keeps plans only for
    buffers it has seen twice and frees them with ``steps.free_plan``.
"""
from __future__ import annotations

from ringzero.comm import algorithms as alg
from ringzero.comm.builder import Builder
from ringzero.comm.steps import CollectivePlan, Copy, Start, blocks


def build(ring, name, xp, send, recv, sched, scratch):
    """The CollectivePlan of one call; `scratch(nbytes, k=2, first=0)` gives grow-only uint8 buffers."""
    plan = CollectivePlan(name, xp)
    # the trace's args (comm/trace.py): the schedule, the dtype, and S (the whole buffer, nccl-tests' size)
    plan.sched, plan.dtype, plan.size = sched, str(send.dtype), int((recv if name == "all_gather" else send).nbytes)
    if sched == "node_aware":
        node_aware(ring, plan, name, send, recv, scratch)
    else:
        passes(ring, plan, ring, name, send, recv, sched, scratch)
    plan.keep += [send, recv]
    return plan


def passes(ring, plan, g, name, send, recv, sched, scratch, phase=0, seg_bytes=0):
    """Append to `plan` the steps of op `name` among group g (the Ring, or a nodes.Group) by `sched`.

    seg_bytes > 0: the ring's messages are at most this (Builder), the node-aware cross pass's.
    """
    n, r = g.size, g.rank

    def pb(ph):
        return Builder(ring, plan, ph, g, seg_bytes)
    if name == "all_reduce":
        L = len(send)
        if n > 1 and L:
            if sched == "recursive_doubling":
                t0, = scratch(send.nbytes, 1)
                alg.recursive_doubling(pb(phase), send, t0.view(send.dtype)[:L])
            elif sched == "direct":
                off = blocks(L, n)
                t0, = scratch((L - (off[r + 1] - off[r])) * send.itemsize, 1)
                alg.direct_rs(pb(phase), send, send[off[r]:off[r + 1]], off, t0.view(send.dtype))
                alg.direct_ag(pb(phase + 1), send, L // n)
            elif sched == "rabenseifner":
                m = L // n
                t0, = scratch(send.nbytes // 2, 1)
                alg.halving_rs(pb(phase), send, send[r * m:(r + 1) * m], None, t0.view(send.dtype))
                alg.doubling_ag(pb(phase + 1), send, m)
            else:
                off = blocks(L, n)
                t0, t1 = scratch(max(off[i + 1] - off[i] for i in range(n)) * send.itemsize)
                tmp = (t0.view(send.dtype), t1.view(send.dtype))
                alg.ring_rs(pb(phase), send, send[off[r]:off[r + 1]], off, tmp)
                alg.ring_ag(pb(phase + 1), send, off)
    elif name == "reduce_scatter":
        m = len(recv)
        if n == 1 or m == 0:
            if m and ring.addr(send) != ring.addr(recv):
                plan.steps.append(Copy(recv, send))
        elif sched == "direct":
            off = blocks(len(send), n)
            t0, = scratch((n - 1) * m * send.itemsize, 1)
            alg.direct_rs(pb(phase), send, recv, off, t0.view(send.dtype))
        elif sched == "tree":
            t0, t1 = scratch(send.nbytes // 2)
            alg.halving_rs(pb(phase), send, recv, t0.view(send.dtype), t1.view(send.dtype))
        else:
            off = blocks(len(send), n)
            t0, t1 = scratch(max(off[i + 1] - off[i] for i in range(n)) * send.itemsize)
            alg.ring_rs(pb(phase), send, recv, off, (t0.view(send.dtype), t1.view(send.dtype)))
    else:
        m = len(send)
        apart = m and ring.addr(send) != ring.addr(recv[r * m:(r + 1) * m])  # not in place: one local copy
        if n == 1 or not m:
            if apart:
                plan.steps.append(Copy(recv, send))
        elif sched == "direct":
            alg.direct_ag(pb(phase), recv, m, send if apart else None)
        elif sched == "tree":
            alg.doubling_ag(pb(phase), recv, m, send if apart else None)
        else:
            alg.ring_ag(pb(phase), recv, blocks(len(recv), n), send if apart else None)


def node_aware(ring, plan, name, send, recv, scratch):
    """Sum inside each node, cross the network on 1/ppn of the buffer, gather inside again.

    With N nodes of P ranks, the n = N*P blocks are laid out in ``perm`` (one
    scratch buffer of S) local-index-major: block b at position
    ``ring.node_order[b]`` (nodes.block_order). Local rank l's super-block,
    perm[l*N*m:(l+1)*N*m], then holds N blocks, one per node, so:

        reduce-scatter  copy send into perm; RS inside the node, in place, to
                        super-block l; RS of it across the N nodes (one rank per
                        node, ppn such streams) to block r = the caller's recv
        all-gather      AG of block r across the nodes into super-block l; AG
                        inside the node, in place; copy perm back into recv
        all-reduce      the two (so it is bitwise the reduce-scatter, then the
                        all-gather)

    Each pass takes the flat schedule comm/schedule.py picks for its group
    and size, except the pass across the nodes, where a pair of ranks that
    sends both ways at once halves the link's rate over TCP (docs/multinode.md):
    across two nodes from ``ring.pair_bytes`` (S) up it is the ring of two
    over ``ring.cross_pair`` (nodes.Pair), whose every pair of ranks sends
    one way only (reversed for the all-gather), and node 1's super-block l
    holds the block of node 0's l-1, not l; across more nodes the group's
    ring, for the all-gather at every size and for the reduce-scatter from
    ``ring.cross_ring_bytes`` up (below it direct is faster: its adds wait
    for one round, not N-1). The cross pass's ring cuts its messages to
    ``ring.cross_seg_bytes`` (63 KiB, under Open MPI's TCP eager limit), even
    across two nodes where a block is forwarded nowhere: a rendezvous would
    wait for the far rank to be inside MPI, which a rank busy with its own
    node pass is not (docs/multinode.md). What leaves a node per
    pass is S (N-1)/N, the least any schedule can send; the intra-node passes
    move (P-1)/P S over shared memory.

    From 2 x ``ring.chunk_bytes`` of S up, the call runs in K chunks (chunk c:
    the same slice of every block, so its own K-th of perm) as a pipeline,
    one chunk's pass across the nodes on the wire while the next (or, for
    the all-gather, the last) chunk's pass inside the node runs.
    """
    node, cross, isz = ring.node_group, ring.cross_group, send.itemsize
    L = len(recv) if name == "all_gather" else len(send)
    n, N, m, r = ring.size, cross.size, L // ring.size, ring.rank
    pair = ring.cross_pair if ring.cross_pair is not None and 0 <= ring.pair_bytes <= L * isz else None
    pos = ring.node_order if pair is None else ring.pair_order
    K = max(1, min(m, L * isz // ring.chunk_bytes)) if ring.chunk_bytes > 0 else 1
    sub = blocks(m, K)      # chunk c: elements [sub[c], sub[c+1]) of every block

    def sc(first):          # every pass its own scratch slots: 0 is perm, then 2 apiece
        return lambda nb, k=2: scratch(nb, k, first)

    def steps_of(fn, *args):  # the steps fn appends to the plan, taken out
        saved, plan.steps = plan.steps, []
        fn(*args)
        out, plan.steps = plan.steps, saved
        return out

    def across(op, a, b, phase):   # the pass across the nodes, on super-block mid
        if pair is None:
            ring_from = ring.cross_ring_bytes     # the ring: each pair of ranks sends one way
            one_way = 0 <= ring_from and (op == "all_gather" or ring_from <= L * isz)
            sched = "ring" if one_way else ring.sub_schedule(op, cross, whole_mid)   # the unchunked call's rule
            passes(ring, plan, cross, op, a, b, sched, sc(4), phase, ring.cross_seg_bytes)
        else:
            passes(ring, plan, pair if op == "reduce_scatter" else pair.reversed(), op, a, b, "ring", sc(4), phase,
                   ring.cross_seg_bytes)

    perm = scratch(L * isz, 1, 0)[0].view(send.dtype)[:L]
    whole_mid = perm[:N * m]
    node_pass, cross_pass = [], []   # per chunk: its steps inside the node, and across
    for c in range(K):
        a, e = sub[c], sub[c + 1]
        w = e - a
        pc = perm[n * a:n * e]                                  # chunk c of perm: its n sub-blocks, as pos says
        mid = pc[node.rank * N * w:(node.rank + 1) * N * w]     # super-block l of the chunk
        own = (recv[a:e] if name == "reduce_scatter" else send[a:e] if name == "all_gather"
               else send[r * m + a:r * m + e])
        if name != "all_gather":
            ins = [Copy(pc[pos[b] * w:(pos[b] + 1) * w], send[b * m + a:b * m + e]) for b in range(n)]
            ins += steps_of(passes, ring, plan, node, "reduce_scatter", pc, mid,
                            ring.sub_schedule("reduce_scatter", node, perm), sc(2))
            node_pass.append(ins)
            cross_pass.append(steps_of(across, "reduce_scatter", mid, own, 0))
        if name != "reduce_scatter":
            out = recv if name == "all_gather" else send
            gather = steps_of(passes, ring, plan, node, "all_gather", mid, pc,
                              ring.sub_schedule("all_gather", node, perm), sc(2), 1)
            gather += [Copy(out[b * m + a:b * m + e], pc[pos[b] * w:(pos[b] + 1) * w]) for b in range(n)]
            node_pass.append(gather)
            cross_pass.append(steps_of(across, "all_gather", own, mid, 1))
    pipeline(plan, name, node_pass, cross_pass)


def _starts(st):
    """(the Start steps a pass opens with, the rest)."""
    k = 0
    while k < len(st) and isinstance(st[k], Start):
        k += 1
    return st[:k], st[k:]


def pipeline(plan, name, node_pass, cross_pass):
    """Append the chunks' steps in pipeline order; node_pass[i] / cross_pass[i]: pass i's steps.

    A chunk's pass across the nodes is started, then the next chunk's pass inside the node runs
    (its waits inside MPI move the network's bytes too), then the one across is finished:

        reduce-scatter  node(0) | start cross(0), node(1), end cross(0) | start cross(1), node(2), ...
        all-gather      cross(0) | start cross(1), node(0), end cross(1) | ... | node(K-1)

    An all-reduce's passes alternate RS, AG per chunk; all its RS run first. Every chunk keeps the
    whole buffer's block owners and summation order, so the bits are the unchunked schedule's, and
    an all-reduce is still its reduce-scatter, then its all-gather.
    """
    step = 2 if name == "all_reduce" else 1
    if name != "all_gather":
        rs = list(zip(node_pass[::step], cross_pass[::step]))
        plan.steps += rs[0][0]
        for c, (_, x) in enumerate(rs):
            head, rest = _starts(x)
            plan.steps += head + (rs[c + 1][0] if c + 1 < len(rs) else []) + rest
    if name != "reduce_scatter":
        first = 1 if name == "all_reduce" else 0
        ag = list(zip(node_pass[first::step], cross_pass[first::step]))
        plan.steps += ag[0][1]
        for c in range(1, len(ag)):
            head, rest = _starts(ag[c][1])
            plan.steps += head + ag[c - 1][0] + rest
        plan.steps += ag[-1][0]
