"""Small Python objects exchanged over a Ring: agreement that the stall inspector watches.

What it is
    ``allgather_obj(ring, obj)`` -> [obj of rank 0, obj of rank 1, ...] and
    ``bcast_obj(ring, obj, root=0)`` -> root's obj, on every rank. Each is two
    Ring all-gathers (the pickled lengths, then the pickles padded to the
    longest), so a rank that never arrives is named by the stall line after
    RINGZERO_STALL_WARN and raises TimeoutError at RINGZERO_TIMEOUT, as any
    Ring call does. MPI's own object collectives (``comm.bcast``) are not
    watched: a partition in one of them hangs without a word.

What it is not
    A data path: for verdicts, paths and manifests (bytes to kilobytes), never
    for buffers. Only objects every rank produced itself are unpickled.
"""
from __future__ import annotations

import pickle

import numpy as np


def allgather_obj(ring, obj) -> list:
    """Every rank's obj, in rank order (collective over the ring)."""
    if ring.size == 1:
        return [obj]
    mine = np.frombuffer(pickle.dumps(obj), np.uint8)
    lens = np.zeros(ring.size, np.int64)
    ring.all_gather(np.array([mine.size], np.int64), lens)
    cap = -(-int(lens.max()) // 8) * 8          # the Ring moves int64 words: pad each pickle to 8 bytes
    out = np.zeros(ring.size * cap, np.uint8)
    send = np.zeros(cap, np.uint8)
    send[:mine.size] = mine
    ring.all_gather(send.view(np.int64), out.view(np.int64))
    return [pickle.loads(out[r * cap:r * cap + int(lens[r])].tobytes()) for r in range(ring.size)]


def bcast_obj(ring, obj, root: int = 0):
    """root's obj on every rank (collective over the ring; other ranks' obj is ignored)."""
    return allgather_obj(ring, obj if ring.rank == root else None)[root]
