"""BLAS/OpenMP threads per rank: the cores of a node shared by the ranks on it.

What it is
    ``set_blas_threads(comm)`` is called once at the start of every MPI entry
    point (trainer, bench, benchmarks), before the first matmul. It gives each
    rank ``max(1, cores // sharing)`` BLAS/OpenMP threads through
    threadpoolctl, so a plain ``mpirun -n 8 python -m ringzero.train`` runs as
    fast as ``./launch/train``: without it every rank's OpenBLAS starts one
    thread per core, and 8 ranks x 2 threads on 2 cores spin against each other
    (about 12x slower per step).

    - cores: this process's CPU affinity (``os.sched_getaffinity``), so a
      launcher that binds ranks to cores is respected;
    - sharing: the ranks on this node (MPI's shared-memory split of ``comm``,
      MPI_COMM_TYPE_SHARED) whose affinity overlaps this rank's: all of them
      when the launcher does not bind, 1 when each rank has cores of its own
      (``srun --cpus-per-task=4`` gives each rank 4 threads). Without MPI, the
      launcher's environment (Open MPI, MPICH, Slurm), else 1;
    - a thread variable the user set (``OMP_NUM_THREADS``,
      ``OPENBLAS_NUM_THREADS``, ``MKL_NUM_THREADS``, ...) wins: nothing is
      changed then.

    Rank 0 prints the choice once, with the thread count each loaded library
    reports back (threadpoolctl's own reading, not the number asked for).

What it is not
    It does not bind ranks to cores (that is the launcher's job) and does not
    touch CuPy or GPU streams.
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field

# Variables through which a user (or a launcher) chooses the thread count.
USER_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
             "BLIS_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")
# Set for libraries that load later (they read these at load time).
_SET_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


@dataclass
class ThreadChoice:
    threads: int | None      # threads per rank we set; None when the user chose
    cores: int               # CPUs this process may run on
    sharing: int             # ranks on this node whose CPUs overlap these (itself included)
    user_set: dict           # the user's thread variables, if any ({} when we chose)
    libraries: list = field(default_factory=list)   # [(library, num_threads)] as threadpoolctl reads them

    def describe(self) -> str:
        libs = ", ".join(f"{lib} {n}" for lib, n in self.libraries) or "no BLAS/OpenMP library loaded"
        if self.threads is None:
            given = " ".join(f"{k}={v}" for k, v in self.user_set.items())
            return f"ringzero | BLAS/OpenMP threads per rank: as set in the environment ({given}); {libs}"
        return (f"ringzero | BLAS/OpenMP threads per rank: {self.threads} ({self.cores} cores shared by "
                f"{self.sharing} ranks; {libs}); set OMP_NUM_THREADS to choose")


def _affinity() -> set:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):          # not Linux: every CPU
        return set(range(os.cpu_count() or 1))


def cores_available() -> int:
    """CPUs this process may run on (its affinity mask), at least 1."""
    return max(1, len(_affinity()))


def _slurm_tasks_on_node(env) -> int | None:
    """Tasks of this Slurm step on this node, from SLURM_STEP_TASKS_PER_NODE
    (or SLURM_TASKS_PER_NODE) like "8(x2),4" indexed by SLURM_NODEID."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not spec:
        return None
    per_node = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            return None
        per_node += [int(m.group(1))] * int(m.group(2) or 1)
    node = int(env.get("SLURM_NODEID", "0") or 0)
    return per_node[node] if 0 <= node < len(per_node) else None


def ranks_on_node_from_env(env=None) -> int | None:
    """Ranks on this node as the launcher tells them, or None."""
    env = os.environ if env is None else env
    for k in ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"):   # Open MPI; MPICH (Hydra)
        v = env.get(k, "")
        if v.isdigit() and int(v) > 0:
            return int(v)
    if "SLURM_STEP_ID" in env or "SLURM_JOB_ID" in env:
        return _slurm_tasks_on_node(env)
    return None


def ranks_sharing_cores(comm=None) -> int:
    """Ranks of ``comm`` on this node whose CPU sets overlap this rank's (itself included).

    Unbound ranks all share every core, so that is every rank on the node;
    ranks bound to their own cores (srun --cpus-per-task, mpirun --bind-to
    core) share none. Found with MPI's shared-memory split and an allgather of
    the affinity masks; without MPI, the launcher's count of ranks on the node.
    """
    if comm is not None:
        try:
            from mpi4py import MPI
            node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
            try:
                masks = node.allgather(sorted(_affinity()))
            finally:
                node.Free()
            mine = set(_affinity())
            return max(1, sum(1 for m in masks if mine.intersection(m)))
        except Exception:                      # an MPI without shared-memory split types
            pass
    return ranks_on_node_from_env() or 1


def _report_libraries() -> list:
    from threadpoolctl import threadpool_info
    return [(d.get("internal_api", d.get("prefix", "?")), int(d["num_threads"])) for d in threadpool_info()]


def set_blas_threads(comm=None, *, quiet: bool = False) -> ThreadChoice:
    """Give this rank its share of the node's cores as BLAS/OpenMP threads.

    Collective over ``comm`` (the shared-memory split): call it on every rank,
    once, at start-up. Rank 0 prints one line unless ``quiet``.
    """
    user = {k: os.environ[k] for k in USER_VARS if os.environ.get(k, "").strip()}
    n_local = ranks_sharing_cores(comm)
    cores = cores_available()
    threads = None
    if not user:
        threads = max(1, cores // n_local)
        from threadpoolctl import threadpool_limits
        threadpool_limits(limits=threads)      # every loaded BLAS and OpenMP runtime, now
        for k in _SET_VARS:                    # and libraries loaded later (torch, ...)
            os.environ[k] = str(threads)
        torch = sys.modules.get("torch")
        if torch is not None:                  # torch's intra-op pool is its own
            torch.set_num_threads(threads)
    choice = ThreadChoice(threads, cores, n_local, user, _report_libraries())
    rank = comm.rank if comm is not None else 0
    if rank == 0 and not quiet:
        print(choice.describe(), flush=True)
    return choice
