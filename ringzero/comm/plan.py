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
from ringzero.comm.steps import CollectivePlan, Copy, blocks


def build(ring, name, xp, send, recv, sched, scratch):
    """The CollectivePlan of one call; `scratch(nbytes, k=2)` gives k grow-only uint8 buffers."""
    plan = CollectivePlan(name, xp)
    n, r = ring.size, ring.rank
    if name == "all_reduce":
        L = len(send)
        if n > 1 and L:
            if sched == "recursive_doubling":
                t0, = scratch(send.nbytes, 1)
                alg.recursive_doubling(Builder(ring, plan, 0), send, t0.view(send.dtype)[:L])
            elif sched == "direct":
                off = blocks(L, n)
                t0, = scratch((L - (off[r + 1] - off[r])) * send.itemsize, 1)
                alg.direct_rs(Builder(ring, plan, 0), send, send[off[r]:off[r + 1]], off, t0.view(send.dtype))
                alg.direct_ag(Builder(ring, plan, 1), send, L // n)
            elif sched == "rabenseifner":
                m = L // n
                t0, = scratch(send.nbytes // 2, 1)
                alg.halving_rs(Builder(ring, plan, 0), send, send[r * m:(r + 1) * m], None, t0.view(send.dtype))
                alg.doubling_ag(Builder(ring, plan, 1), send, m)
            else:
                off = blocks(L, n)
                t0, t1 = scratch(max(off[i + 1] - off[i] for i in range(n)) * send.itemsize)
                tmp = (t0.view(send.dtype), t1.view(send.dtype))
                alg.ring_rs(Builder(ring, plan, 0), send, send[off[r]:off[r + 1]], off, tmp)
                alg.ring_ag(Builder(ring, plan, 1), send, off)
    elif name == "reduce_scatter":
        m = len(recv)
        if n == 1 or m == 0:
            if m and ring.addr(send) != ring.addr(recv):
                plan.steps.append(Copy(recv, send))
        elif sched == "direct":
            off = blocks(len(send), n)
            t0, = scratch((n - 1) * m * send.itemsize, 1)
            alg.direct_rs(Builder(ring, plan, 0), send, recv, off, t0.view(send.dtype))
        elif sched == "tree":
            t0, t1 = scratch(send.nbytes // 2)
            alg.halving_rs(Builder(ring, plan, 0), send, recv, t0.view(send.dtype), t1.view(send.dtype))
        else:
            off = blocks(len(send), n)
            t0, t1 = scratch(max(off[i + 1] - off[i] for i in range(n)) * send.itemsize)
            alg.ring_rs(Builder(ring, plan, 0), send, recv, off, (t0.view(send.dtype), t1.view(send.dtype)))
    else:
        m = len(send)
        apart = m and ring.addr(send) != ring.addr(recv[r * m:(r + 1) * m])  # not in place: one local copy
        if n == 1 or not m:
            if apart:
                plan.steps.append(Copy(recv, send))
        elif sched == "direct":
            alg.direct_ag(Builder(ring, plan, 0), recv, m, send if apart else None)
        elif sched == "tree":
            alg.doubling_ag(Builder(ring, plan, 0), recv, m, send if apart else None)
        else:
            alg.ring_ag(Builder(ring, plan, 0), recv, blocks(len(recv), n), send if apart else None)
    plan.keep += [send, recv]
    return plan
