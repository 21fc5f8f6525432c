"""The schedules, each written once as a function of a ``Builder``: what every Ring call compiles to.

What it is
    Seven constructions, named as comm/schedule.py names the schedules:

        recursive_doubling  all-reduce over the whole buffer, partners r^(n/2) ... r^1
        halving_rs          reduce-scatter by recursive halving (also Rabenseifner's first half)
        doubling_ag         all-gather by recursive doubling (tree; Rabenseifner's second half)
        direct_rs/direct_ag one round: every block straight to its owner
        ring_rs/ring_ag     n-1 steps around the ring, pipelined in segments

    Each takes the Builder ``pb`` first and appends its requests and steps to
    ``pb``'s plan; plan.py picks one per call and hands it the views and the
    scratch. The summation order each follows is the composition contract of
    ring.py's docstring.

What it is not
    No argument checks (checks.py) and no MPI call but the persistent
    requests' ``*_init``.
"""
from __future__ import annotations


def recursive_doubling(pb, buf, tmp):
    """Recursive doubling, partners r^(n/2), ..., r^1: the halving RS's tree.

    After the first level, each add writes into the view the partner's
    vector just arrived in, so the sum alternates between tmp and buf. The
    first level adds in place when the level count is odd, so the last sum
    lands in buf with no copy.
    """
    d, cur, land = pb.n >> 1, buf, tmp
    if pb.n.bit_length() % 2 == 0:   # log2 n odd
        pb.exchange(buf, tmp, pb.r ^ d, pb.ring.eager_bytes)
        pb.add(buf, tmp, buf)
        d >>= 1
    while d:
        pb.exchange(cur, land, pb.r ^ d, pb.ring.eager_bytes)
        pb.add(cur, land, land)
        cur, land = land, cur
        d >>= 1


def halving_rs(pb, send, recv, acc, tmp):
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
    n, r, m = pb.n, pb.r, len(recv)
    lo, hi, d, cur = 0, n, n >> 1, send  # cur holds blocks [lo, hi) from its offset 0
    level = 0
    while d:
        mid = (lo + hi) // 2
        keep, give = ((mid, hi), (lo, mid)) if r & d else ((lo, mid), (mid, hi))
        h = (hi - lo) // 2 * m
        ks, gs = (keep[0] - lo) * m, (give[0] - lo) * m  # offsets inside cur
        land = tmp[:h] if acc is None or level % 2 == 0 else acc[:h]
        pb.exchange(cur[gs:gs + h], land, r ^ d)
        dst = recv if d == 1 else cur[ks:ks + h] if acc is None else land
        pb.add(cur[ks:ks + h], land, dst)
        cur, (lo, hi), d, level = dst, keep, d >> 1, level + 1


def doubling_ag(pb, recv, m, send=None):
    """Recursive doubling: swap the 2^k blocks we hold with partner r^(2^k).

    send (not in place): the first step sends it directly, and the local
    copy into recv runs while that exchange is on the wire.
    """
    r, d = pb.r, 1
    while d < pb.n:
        mine, theirs = (r & ~(d - 1)) * m, ((r ^ d) & ~(d - 1)) * m
        peer, rbuf = r ^ d, recv[theirs:theirs + d * m]
        if d == 1 and send is not None:
            rq, sq = pb.recv(rbuf, peer), pb.send(send, peer)
            pb.start([rq, sq])
            pb.copy(recv[r * m:(r + 1) * m], send)
            pb.wait([rq, sq], peer, [rbuf.nbytes, None])
        else:
            pb.exchange(recv[mine:mine + d * m], rbuf, peer)
        d <<= 1


# ---- direct schedule (n >= 3): one round, every block straight to its owner

def direct_rs(pb, src, out, off, tmp):
    """Block `rank` of the sum over ranks of src into out, in ONE round.

    Rank r sends block p of src to rank p (every p != r) and receives block
    r of every other rank into tmp, slot k-1 holding rank (r+k) % n's. The
    n-1 adds then follow the order of the schedules that share direct's
    sizes, so that a reduce-scatter and an all-reduce of one S agree:
      - n a power of two: the halving tree's, level d = n/2, n/4, ..., 1
        adding x[q] + x[q ^ d] (as tree, rabenseifner and recursive_doubling do);
      - otherwise the ring's: ((x[r+1] + x[r+2]) + ...) + x[r].
    """
    n, r = pb.n, pb.r
    b = off[r + 1] - off[r]
    recvs = [((r + k) % n, pb.recv(tmp[(k - 1) * b:k * b], (r + k) % n)) for k in range(1, n)]
    sends = [(p, pb.send(src[off[p]:off[p + 1]], p)) for p in ((r - k) % n for k in range(1, n))]
    pb.start([q for _, q in recvs] + [q for _, q in sends])
    own, isz = src[off[r]:off[r + 1]], src.itemsize
    # one wait on everything, then the adds: with ranks sharing cores this
    # beat waiting peer by peer to overlap each add (4-10 %, bench sched)
    pb.wait_many([(p, q, b * isz) for p, q in recvs], sends)
    if n & (n - 1) == 0:
        part = {(r + k) % n: tmp[(k - 1) * b:k * b] for k in range(1, n)}   # q -> q's partial
        part[r] = own
        d = n >> 1
        while d:  # the ranks that keep block r at this level agree with r on every bit >= d
            hi = (n - 1) & ~(d - 1)
            for q in [q for q in range(n) if q & hi == r & hi]:
                dst = out if q == r else part[q]   # a peer's partial overwrites its own slot
                pb.add(part[q], part[q ^ d], dst)
                part[q] = dst
            d >>= 1
        return
    acc = tmp[:b]
    for k in range(2, n):  # slot k-1 = acc + x[r+k]: the ring adds in this order too
        nxt = tmp[(k - 1) * b:k * b]
        pb.add(acc, nxt, nxt)
        acc = nxt
    pb.add(acc, own, out)


def direct_ag(pb, buf, m, send=None):
    """Every block of buf from its owner in ONE round: n-1 receives and n-1 sends, one wait.

    send (not in place): our block goes out from it and is copied into buf
    while the messages are on the wire.
    """
    n, r = pb.n, pb.r
    own = buf[r * m:(r + 1) * m]
    src = own if send is None else send
    recvs = [(p, pb.recv(buf[p * m:(p + 1) * m], p), m * buf.itemsize)
             for p in ((r - k) % n for k in range(1, n))]
    sends = [(p, pb.send(src, p)) for p in ((r + k) % n for k in range(1, n))]
    pb.start([q for _, q, _ in recvs] + [q for _, q in sends])
    if send is not None:
        pb.copy(own, send)
    pb.wait_many(recvs, sends)


# ---- ring schedule ------------------------------------------------------

def ring_rs(pb, src, out, off, tmp):
    """Block `rank` of the sum over ranks of src (cut at `off`) into out.

    At step s rank r adds what comes from its left into block (r-s-2) % n
    and sends each reduced segment on at once (the next add overlaps it).
    """
    n, r, isz = pb.n, pb.r, src.itemsize
    left, right = pb.left, pb.right
    b = (r - 1) % n
    sends = [pb.send(src[off[b] + a:off[b] + e], right) for a, e in pb.segs(off[b + 1] - off[b], isz)]
    pb.start(sends)
    for s in range(n - 1):
        bi = (r - s - 2) % n
        lo, length = off[bi], off[bi + 1] - off[bi]
        buf = tmp[s & 1][:length]
        last = s == n - 2
        dst = out if last else buf
        segs = pb.segs(length, isz)
        recvs = [pb.recv(buf[a:e], left) for a, e in segs]
        pb.start(recvs)
        nxt = []
        for (a, e), q in zip(segs, recvs):
            pb.wait([q], left, [(e - a) * isz])
            pb.add(buf[a:e], src[lo + a:lo + e], dst[a:e])
            if not last:
                nxt.append(pb.send(dst[a:e], right))
                pb.start(nxt[-1:])
        pb.wait(sends, right)
        sends = nxt


def ring_ag(pb, buf, off, send=None):
    """Every block of buf from its owner (block i from rank i), in place.

    All receives are posted at the start (they land in distinct blocks), so
    no message ever arrives unexpected; each block is forwarded on arrival.
    send (not in place): our block goes out from it, and the local copy
    into buf runs while the first messages are on the wire.
    """
    n, r, isz = pb.n, pb.r, buf.itemsize
    left, right = pb.left, pb.right
    own = buf[off[r]:off[r + 1]]
    src = own if send is None else send
    # segments let a block be forwarded while it arrives; n = 2 forwards nothing, so
    # there a block is one message (pieces would only add messages and waits), unless
    # the builder cuts for the transport's eager limit (pb.eager: the cross pass)
    cut = pb.segs if n > 2 or pb.eager else (lambda length, _: [(0, length)])
    sends = [pb.send(src[a:e], right) for a, e in cut(len(own), isz)]
    steps = []
    for s in range(n - 1):
        bi = (r - s - 1) % n
        lo, length = off[bi], off[bi + 1] - off[bi]
        steps.append([(buf[lo + a:lo + e], pb.recv(buf[lo + a:lo + e], left)) for a, e in cut(length, isz)])
    pb.start([q for st in steps for _, q in st] + sends)
    if send is not None:
        pb.copy(own, send)
    for s, st in enumerate(steps):
        for view, q in st:
            pb.wait([q], left, [view.nbytes])
            if s < n - 2:  # forward at once; no buffer is reused, so the sends are waited for at the end
                sends.append(pb.send(view, right))
                pb.start(sends[-1:])
    pb.wait(sends, right)
