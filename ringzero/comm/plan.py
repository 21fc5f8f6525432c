"""Schedules compiled once into persistent MPI requests: what a Ring call runs.

What it is
    ``build(ring, name, xp, send, recv, sched)`` turns one collective on one
    pair of buffers into a ``Plan``: a flat list of steps over persistent
    requests (``Send_init`` / ``Recv_init``, made once) and precomputed views,
    so a call that reuses its buffers costs a dictionary lookup, then per step
    one ``Startall``, one blocking ``Waitall`` inside MPI (the GIL released)
    and the add. The steps, as tuples:

        (START, [req, ...])                       Prequest.Startall
        (WAIT,  [req, ...], statuses, checks, w)  Request.Waitall; every recv's
                                                  count checked; w = (op, peer,
                                                  "recv"|"send", reqs) for the
                                                  stall inspector and errors
        (XCHG,  [req, ...], statuses, checks, w)  START then WAIT on the same
                                                  requests (one exchange)
        (MWAIT, [req, ...], statuses, expect, w, done)
                                                  Request.Waitsome until all are
                                                  done; expect[i] = bytes req i
                                                  receives (None: a send); w =
                                                  (op, peers, dirs, reqs), one
                                                  peer and direction per req;
                                                  done[i] = 1 once req i is
        (ADD,   a, b, out, fn)                    fn(a, b, out): out = a + b
        (COPY,  dst, src)                         dst[...] = src

    A WAIT waits on ONE peer, so a stall names the rank it waits for. The
    direct schedule's MWAIT waits on every peer at once, by Waitsome: each
    return marks what completed, so the stall inspector names the peers
    still open (Ring.resolve). (MPI_Request_get_status cannot tell it from
    another thread: Open MPI reports a request complete while a wait in
    another thread holds it.)
    The schedules and their summation order are the module docstring of
    ring.py; ``sched`` is "ring", "tree" (halving RS / doubling AG), "recursive_doubling"
    (recursive-doubling all-reduce), "rabenseifner" (halving then doubling) or
    "direct" (every block to its owner at once, summed in the halving tree's
    order for a power-of-two n and in the ring's otherwise).

What it is not
    It runs nothing (Ring._run does) and checks no argument (Ring._check did).
    A plan holds its buffers alive; the Ring keeps plans only for buffers it
    has seen twice and frees them with ``free_plan``.
"""
from __future__ import annotations

from mpi4py import MPI

START, WAIT, ADD, COPY, XCHG, MWAIT = 0, 1, 2, 3, 4, 5
TAGS = {"all_reduce": 0, "reduce_scatter": 4, "all_gather": 8}  # + phase: ops never match each other


def blocks(length: int, n: int) -> list:
    """Block offsets (n+1 of them) of a length-L buffer cut for the ring."""
    q, rem = divmod(length, n)
    return [i * q + min(i, rem) for i in range(n + 1)]


class Plan:
    """One compiled call: its steps, requests, buffers kept alive and ledger increments."""

    __slots__ = ("name", "steps", "reqs", "keep", "sent", "recvd", "msgs", "xp", "post", "runs",
                 "hot", "guard")

    def __init__(self, name, xp):
        self.name, self.xp = name, xp
        self.steps, self.reqs, self.keep = [], [], []
        self.sent = self.recvd = self.msgs = 0   # per run: the ledger adds runs * these (Ledger.fold)
        self.runs = 0
        self.post = None   # "avg": divide recv by n after the steps
        self.hot = None    # the Ring's id-key for this plan's own send/recv objects, once kept
        self.guard = None  # (send.dtype, send.shape, recv.shape): what the id-key cannot see


class _Builder:
    def __init__(self, ring, plan, phase):
        self.ring, self.p = ring, plan
        self.comm, self.n, self.r = ring.comm, ring.size, ring.rank
        self.tag = TAGS[plan.name] + phase

    def send(self, x, peer):
        q = self.comm.Send_init([x, MPI.BYTE], peer, self.tag)
        self.p.reqs.append(q)
        self.p.keep.append(x)
        self.p.sent += x.nbytes
        self.p.msgs += 1
        return q

    def recv(self, x, peer):
        q = self.comm.Recv_init([x, MPI.BYTE], peer, self.tag)
        self.p.reqs.append(q)
        self.p.keep.append(x)
        self.p.recvd += x.nbytes
        return q

    def start(self, reqs):
        if reqs:
            self.p.steps.append((START, list(reqs)))

    def wait(self, reqs, peer, recv_sizes=None):
        """Wait for reqs (all with `peer`); recv_sizes[i] = expected bytes of reqs[i] (recvs)."""
        if not reqs:
            return
        if recv_sizes is None:
            self.p.steps.append((WAIT, list(reqs), None, (), (self.p.name, peer, "send", list(reqs))))
        else:
            sts = [MPI.Status() for _ in reqs]
            checks = tuple((sts[i], nb) for i, nb in enumerate(recv_sizes) if nb is not None)
            self.p.steps.append((WAIT, list(reqs), sts, checks, (self.p.name, peer, "recv", list(reqs))))

    def add(self, a, b, out):
        self.p.steps.append((ADD, a, b, out, self.ring.adder(self.p.xp, a.dtype)))

    def copy(self, dst, src):
        self.p.steps.append((COPY, dst, src))

    def segs(self, length, itemsize):
        seg = max(1, self.ring.seg_bytes // itemsize)
        return [(a, min(a + seg, length)) for a in range(0, length, seg)]

    # ---- latency schedules (n a power of two) ------------------------------
    def exchange(self, sendbuf, recvbuf, peer, piece=0):
        """One START + WAIT pair with `peer`, as a single XCHG step.

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
        self.p.steps.append((XCHG, rqs + sqs, sts, checks, (self.p.name, peer, "recv", rqs + sqs)))

    def wait_many(self, recvs, sends):
        """One MWAIT on every (peer, req, nbytes) of recvs and (peer, req) of sends."""
        if len(recvs) + len(sends) == 1:  # one peer: a plain WAIT
            p, q, nb = recvs[0] if recvs else (*sends[0], None)
            return self.wait([q], p, None if nb is None else [nb])
        reqs = [q for _, q, _ in recvs] + [q for _, q in sends]
        expect = tuple(nb for _, _, nb in recvs) + (None,) * len(sends)
        peers = tuple(p for p, _, _ in recvs) + tuple(p for p, _ in sends)
        dirs = ("recv",) * len(recvs) + ("send",) * len(sends)
        self.p.steps.append((MWAIT, reqs, [MPI.Status() for _ in reqs], expect,
                             (self.p.name, peers, dirs, reqs), bytearray(len(reqs))))

    def rd_allreduce(self, buf, tmp):
        """Recursive doubling, partners r^(n/2), ..., r^1: the halving RS's tree.

        After the first level, each add writes into the view the partner's
        vector just arrived in, so the sum alternates between tmp and buf. The
        first level adds in place when the level count is odd, so the last sum
        lands in buf with no copy.
        """
        d, cur, land = self.n >> 1, buf, tmp
        if self.n.bit_length() % 2 == 0:   # log2 n odd
            self.exchange(buf, tmp, self.r ^ d, self.ring.eager_bytes)
            self.add(buf, tmp, buf)
            d >>= 1
        while d:
            self.exchange(cur, land, self.r ^ d, self.ring.eager_bytes)
            self.add(cur, land, land)
            cur, land = land, cur
            d >>= 1

    def halving_rs(self, send, recv, acc, tmp):
        """Recursive halving: keep the half of the blocks whose bit d matches ours.

        The reduce-scatter (acc given): each level but the last adds into the
        view the partner's half has just arrived in, alternating between tmp
        and acc, and the last into recv; no add writes the lines a peer read
        at the level before (the reduce-scatter at n = 8, 64 KiB, gained
        about 10 %; docs/collectives.md).

        The all-reduce (acc None, recv = send's block r, Rabenseifner): each
        partial sum goes back into send's kept half, so scratch is tmp alone
        (S/2). Alternating with the half of send given away at the first
        level kept S/2 as well, but over TCP it cost 4-10 % from 1 MiB at
        n = 4 in one side-by-side launch and gained nothing on shared memory
        there, so it was not kept.

        The adds and their operands are the same either way, so the bits are
        too.
        """
        n, r, m = self.n, self.r, len(recv)
        lo, hi, d, cur = 0, n, n >> 1, send  # cur holds blocks [lo, hi) from its offset 0
        level = 0
        while d:
            mid = (lo + hi) // 2
            keep, give = ((mid, hi), (lo, mid)) if r & d else ((lo, mid), (mid, hi))
            h = (hi - lo) // 2 * m
            ks, gs = (keep[0] - lo) * m, (give[0] - lo) * m  # offsets inside cur
            land = tmp[:h] if acc is None or level % 2 == 0 else acc[:h]
            self.exchange(cur[gs:gs + h], land, r ^ d)
            dst = recv if d == 1 else cur[ks:ks + h] if acc is None else land
            self.add(cur[ks:ks + h], land, dst)
            cur, (lo, hi), d, level = dst, keep, d >> 1, level + 1

    def doubling_ag(self, recv, m, send=None):
        """Recursive doubling: swap the 2^k blocks we hold with partner r^(2^k).

        send (not in place): the first step sends it directly, and the local
        copy into recv runs while that exchange is on the wire.
        """
        r, d = self.r, 1
        while d < self.n:
            mine, theirs = (r & ~(d - 1)) * m, ((r ^ d) & ~(d - 1)) * m
            peer, rbuf = r ^ d, recv[theirs:theirs + d * m]
            if d == 1 and send is not None:
                rq, sq = self.recv(rbuf, peer), self.send(send, peer)
                self.start([rq, sq])
                self.copy(recv[r * m:(r + 1) * m], send)
                self.wait([rq, sq], peer, [rbuf.nbytes, None])
            else:
                self.exchange(recv[mine:mine + d * m], rbuf, peer)
            d <<= 1

    # ---- direct schedule (n >= 3): one round, every block straight to its owner
    def direct_rs(self, src, out, off, tmp):
        """Block `rank` of the sum over ranks of src into out, in ONE round.

        Rank r sends block p of src to rank p (every p != r) and receives block
        r of every other rank into tmp, slot k-1 holding rank (r+k) % n's. The
        n-1 adds then follow the order of the schedules that share direct's
        sizes, so that a reduce-scatter and an all-reduce of one S agree:
          - n a power of two: the halving tree's, level d = n/2, n/4, ..., 1
            adding x[q] + x[q ^ d] (as tree, rabenseifner and recursive_doubling do);
          - otherwise the ring's: ((x[r+1] + x[r+2]) + ...) + x[r].
        """
        n, r = self.n, self.r
        b = off[r + 1] - off[r]
        recvs = [((r + k) % n, self.recv(tmp[(k - 1) * b:k * b], (r + k) % n)) for k in range(1, n)]
        sends = [(p, self.send(src[off[p]:off[p + 1]], p)) for p in ((r - k) % n for k in range(1, n))]
        self.start([q for _, q in recvs] + [q for _, q in sends])
        own, isz = src[off[r]:off[r + 1]], src.itemsize
        # one wait on everything, then the adds: with ranks sharing cores this
        # beat waiting peer by peer to overlap each add (4-10 %, bench sched)
        self.wait_many([(p, q, b * isz) for p, q in recvs], sends)
        if n & (n - 1) == 0:
            part = {(r + k) % n: tmp[(k - 1) * b:k * b] for k in range(1, n)}   # q -> q's partial
            part[r] = own
            d = n >> 1
            while d:  # the ranks that keep block r at this level agree with r on every bit >= d
                hi = (n - 1) & ~(d - 1)
                for q in [q for q in range(n) if q & hi == r & hi]:
                    dst = out if q == r else part[q]   # a peer's partial overwrites its own slot
                    self.add(part[q], part[q ^ d], dst)
                    part[q] = dst
                d >>= 1
            return
        acc = tmp[:b]
        for k in range(2, n):  # slot k-1 = acc + x[r+k]: the ring adds in this order too
            nxt = tmp[(k - 1) * b:k * b]
            self.add(acc, nxt, nxt)
            acc = nxt
        self.add(acc, own, out)

    def direct_ag(self, buf, m, send=None):
        """Every block of buf from its owner in ONE round: n-1 receives and n-1 sends, one wait.

        send (not in place): our block goes out from it and is copied into buf
        while the messages are on the wire.
        """
        n, r = self.n, self.r
        own = buf[r * m:(r + 1) * m]
        src = own if send is None else send
        recvs = [(p, self.recv(buf[p * m:(p + 1) * m], p), m * buf.itemsize)
                 for p in ((r - k) % n for k in range(1, n))]
        sends = [(p, self.send(src, p)) for p in ((r + k) % n for k in range(1, n))]
        self.start([q for _, q, _ in recvs] + [q for _, q in sends])
        if send is not None:
            self.copy(own, send)
        self.wait_many(recvs, sends)

    # ---- ring schedule ------------------------------------------------------
    def ring_rs(self, src, out, off, tmp):
        """Block `rank` of the sum over ranks of src (cut at `off`) into out.

        At step s rank r adds what comes from its left into block (r-s-2) % n
        and sends each reduced segment on at once (the next add overlaps it).
        """
        n, r, isz = self.n, self.r, src.itemsize
        left, right = self.ring.left, self.ring.right
        b = (r - 1) % n
        sends = [self.send(src[off[b] + a:off[b] + e], right) for a, e in self.segs(off[b + 1] - off[b], isz)]
        self.start(sends)
        for s in range(n - 1):
            bi = (r - s - 2) % n
            lo, length = off[bi], off[bi + 1] - off[bi]
            buf = tmp[s & 1][:length]
            last = s == n - 2
            dst = out if last else buf
            segs = self.segs(length, isz)
            recvs = [self.recv(buf[a:e], left) for a, e in segs]
            self.start(recvs)
            nxt = []
            for (a, e), q in zip(segs, recvs):
                self.wait([q], left, [(e - a) * isz])
                self.add(buf[a:e], src[lo + a:lo + e], dst[a:e])
                if not last:
                    nxt.append(self.send(dst[a:e], right))
                    self.start(nxt[-1:])
            self.wait(sends, right)
            sends = nxt

    def ring_ag(self, buf, off, send=None):
        """Every block of buf from its owner (block i from rank i), in place.

        All receives are posted at the start (they land in distinct blocks), so
        no message ever arrives unexpected; each block is forwarded on arrival.
        send (not in place): our block goes out from it, and the local copy
        into buf runs while the first messages are on the wire.
        """
        n, r, isz = self.n, self.r, buf.itemsize
        left, right = self.ring.left, self.ring.right
        own = buf[off[r]:off[r + 1]]
        src = own if send is None else send
        # segments let a block be forwarded while it arrives; n = 2 forwards nothing,
        # so there a block is one message (pieces would only add messages and waits)
        cut = self.segs if n > 2 else (lambda length, _: [(0, length)])
        sends = [self.send(src[a:e], right) for a, e in cut(len(own), isz)]
        steps = []
        for s in range(n - 1):
            bi = (r - s - 1) % n
            lo, length = off[bi], off[bi + 1] - off[bi]
            steps.append([(buf[lo + a:lo + e], self.recv(buf[lo + a:lo + e], left)) for a, e in cut(length, isz)])
        self.start([q for st in steps for _, q in st] + sends)
        if send is not None:
            self.copy(own, send)
        for s, st in enumerate(steps):
            for view, q in st:
                self.wait([q], left, [view.nbytes])
                if s < n - 2:  # forward at once; no buffer is reused, so the sends are waited for at the end
                    sends.append(self.send(view, right))
                    self.start(sends[-1:])
        self.wait(sends, right)


def build(ring, name, xp, send, recv, sched, scratch):
    """The Plan of one call; `scratch(nbytes, k=2)` gives k grow-only uint8 buffers."""
    plan = Plan(name, xp)
    n, r = ring.size, ring.rank
    if name == "all_reduce":
        L = len(send)
        if n > 1 and L:
            if sched == "recursive_doubling":
                t0, = scratch(send.nbytes, 1)
                _Builder(ring, plan, 0).rd_allreduce(send, t0.view(send.dtype)[:L])
            elif sched == "direct":
                off = blocks(L, n)
                t0, = scratch((L - (off[r + 1] - off[r])) * send.itemsize, 1)
                _Builder(ring, plan, 0).direct_rs(send, send[off[r]:off[r + 1]], off, t0.view(send.dtype))
                _Builder(ring, plan, 1).direct_ag(send, L // n)
            elif sched == "rabenseifner":
                m = L // n
                t0, = scratch(send.nbytes // 2, 1)
                _Builder(ring, plan, 0).halving_rs(send, send[r * m:(r + 1) * m], None, t0.view(send.dtype))
                _Builder(ring, plan, 1).doubling_ag(send, m)
            else:
                off = blocks(L, n)
                t0, t1 = scratch(max(off[i + 1] - off[i] for i in range(n)) * send.itemsize)
                tmp = (t0.view(send.dtype), t1.view(send.dtype))
                _Builder(ring, plan, 0).ring_rs(send, send[off[r]:off[r + 1]], off, tmp)
                _Builder(ring, plan, 1).ring_ag(send, off)
    elif name == "reduce_scatter":
        m = len(recv)
        if n == 1 or m == 0:
            if m and ring.addr(send) != ring.addr(recv):
                plan.steps.append((COPY, recv, send))
        elif sched == "direct":
            off = blocks(len(send), n)
            t0, = scratch((n - 1) * m * send.itemsize, 1)
            _Builder(ring, plan, 0).direct_rs(send, recv, off, t0.view(send.dtype))
        elif sched == "tree":
            t0, t1 = scratch(send.nbytes // 2)
            _Builder(ring, plan, 0).halving_rs(send, recv, t0.view(send.dtype), t1.view(send.dtype))
        else:
            off = blocks(len(send), n)
            t0, t1 = scratch(max(off[i + 1] - off[i] for i in range(n)) * send.itemsize)
            _Builder(ring, plan, 0).ring_rs(send, recv, off, (t0.view(send.dtype), t1.view(send.dtype)))
    else:
        m = len(send)
        apart = m and ring.addr(send) != ring.addr(recv[r * m:(r + 1) * m])  # not in place: one local copy
        if n == 1 or not m:
            if apart:
                plan.steps.append((COPY, recv, send))
        elif sched == "direct":
            _Builder(ring, plan, 0).direct_ag(recv, m, send if apart else None)
        elif sched == "tree":
            _Builder(ring, plan, 0).doubling_ag(recv, m, send if apart else None)
        else:
            _Builder(ring, plan, 0).ring_ag(recv, blocks(len(recv), n), send if apart else None)
    plan.keep += [send, recv]
    return plan


def free_plan(plan):
    """Free a plan's requests (all inactive: the plan finished)."""
    for q in plan.reqs:
        q.Free()
    plan.reqs = []
