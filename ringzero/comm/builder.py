"""The primitives the schedules are written in: persistent requests and the steps that run them.

What it is
    ``Builder(ring, plan, phase, group)`` appends to one ``CollectivePlan``
    the messages among ``group`` (the Ring itself, or one of its node-aware
    sub-groups, nodes.Group: peers are then the group's ranks, and every
    Waiting names the Ring's rank of the peer):
    ``send``/``recv`` make a persistent request (and count the ledger's bytes
    and messages), ``start``/``wait``/``exchange``/``wait_many`` add the steps
    that start and wait for them, ``add``/``copy`` the local work between.
    Every message of a phase carries one tag (``TAGS[op] + phase``), so two
    ops, or the two passes of an all-reduce, never match each other's
    messages. algorithms.py writes each schedule with these.

What it is not
    It runs nothing and checks no argument.
"""
from __future__ import annotations

from mpi4py import MPI

from ringzero.comm.steps import Add, Copy, Exchange, MultiWait, Start, Wait, Waiting

TAGS = {"all_reduce": 0, "reduce_scatter": 4, "all_gather": 8}  # + phase: ops never match each other


class Builder:
    def __init__(self, ring, plan, phase, group=None, seg_bytes=0):
        """seg_bytes > 0: the ring's messages are at most this (segs), even where nothing is forwarded."""
        g = ring if group is None else group
        self.ring, self.p = ring, plan
        self.seg_bytes = seg_bytes if seg_bytes > 0 else ring.seg_bytes
        self.eager = seg_bytes > 0
        self.comm, self.n, self.r, self.left, self.right = g.comm, g.size, g.rank, g.left, g.right
        self.tag = TAGS[plan.name] + phase
        self._parent = getattr(g, "parent", None)   # group rank -> the Ring's rank
        self._remote = ring.remote                  # the Ring's ranks on other nodes

    def peer(self, p):
        """The Ring's rank of group rank p (what Waiting records and errors name)."""
        return p if self._parent is None else self._parent[p]

    def send(self, x, peer):
        q = self.comm.Send_init([x, MPI.BYTE], peer, self.tag)
        self.p.reqs.append(q)
        self.p.keep.append(x)
        self.p.sent += x.nbytes
        self.p.msgs += 1
        if self.peer(peer) in self._remote:
            self.p.sent_net += x.nbytes
        return q

    def recv(self, x, peer):
        q = self.comm.Recv_init([x, MPI.BYTE], peer, self.tag)
        self.p.reqs.append(q)
        self.p.keep.append(x)
        self.p.recvd += x.nbytes
        return q

    def start(self, reqs):
        if reqs:
            self.p.steps.append(Start(list(reqs)))

    def wait(self, reqs, peer, recv_sizes=None):
        """Wait for reqs (all with `peer`); recv_sizes[i] = expected bytes of reqs[i] (receives)."""
        if not reqs:
            return
        reqs = list(reqs)
        if recv_sizes is None:
            self.p.steps.append(Wait(reqs, None, (), Waiting(self.p.name, self.peer(peer), "send", reqs)))
        else:
            sts = [MPI.Status() for _ in reqs]
            checks = tuple((sts[i], nb) for i, nb in enumerate(recv_sizes) if nb is not None)
            self.p.steps.append(Wait(reqs, sts, checks, Waiting(self.p.name, self.peer(peer), "recv", reqs)))

    def add(self, a, b, out):
        self.p.steps.append(Add(a, b, out, self.ring.adder(self.p.xp, a.dtype)))

    def copy(self, dst, src):
        self.p.steps.append(Copy(dst, src))

    def segs(self, length, itemsize):
        """[(start, end), ...] cutting `length` elements into the ring's pipeline segments."""
        seg = max(1, self.seg_bytes // itemsize)
        return [(a, min(a + seg, length)) for a in range(0, length, seg)]

    def exchange(self, sendbuf, recvbuf, peer, piece=0):
        """One Exchange step with `peer`: receive recvbuf while sending sendbuf.

        piece > 0: a buffer of up to 4 pieces is cut into messages of at most
        `piece` bytes, so that a buffer just above the MPI's eager limit goes
        as eager messages instead of paying a rendezvous round trip.
        """
        isz, L = sendbuf.itemsize, len(sendbuf)
        k = -(-sendbuf.nbytes // piece) if 0 < piece < sendbuf.nbytes <= 4 * piece else 1  # messages, cut evenly
        step = max(1, -(-L // k))
        cuts = [(a, min(a + step, L)) for a in range(0, L, step)] or [(0, 0)]
        rqs = [self.recv(recvbuf[a:e], peer) for a, e in cuts]
        sqs = [self.send(sendbuf[a:e], peer) for a, e in cuts]
        sts = [MPI.Status() for _ in rqs + sqs]
        checks = tuple((sts[i], (e - a) * isz) for i, (a, e) in enumerate(cuts))
        reqs = rqs + sqs
        self.p.steps.append(Exchange(reqs, sts, checks, Waiting(self.p.name, self.peer(peer), "recv", reqs)))

    def wait_many(self, recvs, sends):
        """One MultiWait on every (peer, req, nbytes) of recvs and (peer, req) of sends."""
        if len(recvs) + len(sends) == 1:  # one peer: a plain Wait
            p, q, nb = recvs[0] if recvs else (*sends[0], None)
            return self.wait([q], p, None if nb is None else [nb])
        reqs = [q for _, q, _ in recvs] + [q for _, q in sends]
        expect = tuple(nb for _, _, nb in recvs) + (None,) * len(sends)
        peers = tuple(self.peer(p) for p, _, _ in recvs) + tuple(self.peer(p) for p, _ in sends)
        dirs = ("recv",) * len(recvs) + ("send",) * len(sends)
        self.p.steps.append(MultiWait(reqs, [MPI.Status() for _ in reqs], expect,
                                      Waiting(self.p.name, peers, dirs, reqs), bytearray(len(reqs))))
