"""What one rank finds out about its node, for test_cluster_ring.py (not a test module).

Run under mpirun: every rank computes its BLAS threads (ringzero.comm.threads)
and its GPU (ringzero.comm.backend.select_device, with the CuPy stand-in
showing RINGZERO_STANDIN_DEVICES devices), and rank 0 prints one JSON line
"NODE_INFO [...]" with one record per rank.
"""
import json
import os
import socket
import sys

import pytest
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cupy_standin  # noqa: E402

from ringzero.comm import backend  # noqa: E402
from ringzero.comm.threads import set_blas_threads  # noqa: E402

comm = MPI.COMM_WORLD
choice = set_blas_threads(comm, quiet=True)
with pytest.MonkeyPatch.context() as mp:
    cupy_standin.install(mp)
    dev = backend.select_device(comm)
shared = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
rec = {"rank": comm.rank, "host": socket.gethostname(), "node_size": shared.size, "local_rank": shared.rank,
       "threads": choice.threads, "sharing": choice.sharing, "cores": choice.cores,
       "libraries": [n for _, n in choice.libraries], "device": dev}
shared.Free()
recs = comm.gather(rec)
if comm.rank == 0:
    print("NODE_INFO " + json.dumps(recs), flush=True)
