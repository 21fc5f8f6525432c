"""Run pytest on every rank of an MPI job; only rank 0 talks.

Used by launch/test as ``mpirun -n N python -m mpi4py launch/mpi_pytest.py DIR ARGS``.

- Ranks other than 0 write their output to DIR/rank-K.log, and every rank
  writes its pytest exit code to DIR/rank-K.rc, so the runner can show the
  log of a rank that failed while rank 0 passed (or died without an rc).
- Every rank records each test's outcome; rank 0 merges them into one verdict
  per test (failed if it failed on ANY rank, passed if it passed on all),
  writes the counts to DIR/summary ("passed failed skipped error") and prints
  one line naming the tests that failed and on which ranks.
- "No test selected" (pytest's exit 5, e.g. ``-k`` matching only serial
  tests) is not a failure here; launch/test fails a run in which no test
  ran at all.

The job exits non-zero on every rank if any rank's pytest failed.
"""
import os
import sys

from mpi4py import MPI

logdir, args = sys.argv[1], sys.argv[2:]
comm = MPI.COMM_WORLD
rank = comm.rank
if rank != 0:
    fd = os.open(os.path.join(logdir, f"rank-{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)

import pytest  # noqa: E402  (after the redirect, so its output lands in the log)

WORST = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}


class Outcomes:
    """nodeid -> the worst outcome over setup, call and teardown on this rank."""

    def __init__(self):
        self.by_test = {}

    def pytest_runtest_logreport(self, report):
        if report.failed:
            out = "failed" if report.when == "call" else "error"
        elif report.skipped:
            out = "skipped"
        elif report.when == "call":
            out = "passed"
        else:
            return
        old = self.by_test.get(report.nodeid)
        if old is None or WORST[out] > WORST[old]:
            self.by_test[report.nodeid] = out

    def pytest_collectreport(self, report):
        if report.failed:                       # an import error in a test module
            self.by_test[f"{report.nodeid} (collection)"] = "error"


rec = Outcomes()
rc = int(pytest.main(args, plugins=[rec]))
rc = 0 if rc == 5 else rc                       # nothing selected on this world size
with open(os.path.join(logdir, f"rank-{rank}.rc"), "w") as f:
    f.write(str(rc))
sys.stdout.flush()
sys.stderr.flush()

# One verdict per test over all ranks (scalar bookkeeping, not the work).
every = comm.gather(rec.by_test, root=0)
if rank == 0:
    merged, bad_ranks = {}, {}
    for r, d in enumerate(every):
        for t, out in d.items():
            if t not in merged or WORST[out] > WORST[merged[t]]:
                merged[t] = out
            if out in ("failed", "error"):
                bad_ranks.setdefault(t, []).append(r)
    counts = {k: sum(1 for v in merged.values() if v == k) for k in WORST}
    with open(os.path.join(logdir, "summary"), "w") as f:
        f.write(f"{counts['passed']} {counts['failed']} {counts['skipped']} {counts['error']}\n")
    print(f"ringzero | world size {comm.size}, all ranks: {counts['passed']} passed, "
          f"{counts['failed']} failed, {counts['skipped']} skipped, {counts['error']} errors")
    for t, rs in sorted(bad_ranks.items()):
        print(f"ringzero |   {merged[t].upper()} {t} on rank{'s' if len(rs) > 1 else ''} "
              f"{', '.join(map(str, rs))}")
    sys.stdout.flush()
bad = comm.allreduce(1 if rc != 0 else 0)
# Leave through MPI_Finalize and a plain exit code: a non-zero sys.exit under
# `python -m mpi4py` would call MPI_Abort, whose banner buries the results.
MPI.Finalize()
os._exit(1 if bad else 0)
