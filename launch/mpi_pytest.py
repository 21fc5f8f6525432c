"""Run pytest on every rank of an MPI job; only rank 0 talks.

Used by launch/test as ``mpirun -n N python -m mpi4py launch/mpi_pytest.py DIR ARGS``.
Ranks other than 0 write their output to DIR/rank-K.log, and every rank
writes its exit code to DIR/rank-K.rc, so the runner can show the log of a
rank that failed while rank 0 passed. The job's exit code is non-zero if
any rank's pytest failed.
"""
import os
import sys

from mpi4py import MPI

logdir, args = sys.argv[1], sys.argv[2:]
rank = MPI.COMM_WORLD.rank
if rank != 0:
    fd = os.open(os.path.join(logdir, f"rank-{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)

import pytest  # noqa: E402  (after the redirect, so its output lands in the log)

rc = int(pytest.main(args))
rc = 0 if rc == 5 and os.environ.get("RINGZERO_ALLOW_EMPTY") else rc
with open(os.path.join(logdir, f"rank-{rank}.rc"), "w") as f:
    f.write(str(rc))
# Every rank agrees on the verdict (a scalar check, not the work), so a
# failure on any rank is a failure of the job.
bad = MPI.COMM_WORLD.allreduce(1 if rc not in (0,) else 0)
sys.stdout.flush()
sys.exit(1 if bad else 0)
