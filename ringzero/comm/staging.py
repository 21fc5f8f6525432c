"""Device buffers through the host: a Ring call on CuPy arrays when the MPI is not CUDA-aware.

What it is
    ``staged_call(ring, name, send, recv, op)`` copies the device buffers
    into the Ring's grow-only pinned host buffers (``backend.Staging``: slots
    "a" and "b", page-locked when CuPy is there, so the copies are DMA with
    no bounce), runs the same op on the host (the host plan, its sums and
    its ledger), and copies the result back. The device stream is synchronized
    before the host reads and after the result is set, since the pinned
    buffers are reused by the next call.

What it is not
    The CUDA-aware path: with a CUDA-aware MPI the Ring hands device
    pointers to MPI itself (ring.py). And no copy on the host path: NumPy
    arrays never come here.
"""
from __future__ import annotations

from ringzero.comm.backend import sync


def staged_call(ring, name, send, recv, op):
    """recv of `name` over the ranks, computed on the host through ring.staging; returns recv."""
    sync(send)
    dt, st = send.dtype, ring.staging
    if name == "all_reduce":
        h = st.host("a", send.nbytes).view(dt)
        send.get(out=h)
        ring.all_reduce(h, op)
        recv.set(h)
    elif name == "reduce_scatter":
        hs = st.host("a", send.nbytes).view(dt)
        hr = st.host("b", recv.nbytes).view(dt)
        send.get(out=hs)
        ring.reduce_scatter(hs, hr, op)
        recv.set(hr)
    else:
        m, r = len(send), ring.rank
        hr = st.host("a", recv.nbytes).view(dt)
        send.get(out=hr[r * m:(r + 1) * m])
        ring.all_gather(hr[r * m:(r + 1) * m], hr)
        recv.set(hr)
    sync(recv)  # the pinned buffer is reused by the next call: the copy must be done
    return recv
