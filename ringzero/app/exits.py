"""How the trainer ends when something goes wrong after MPI has started.

What it is
    ``ConfigError``: bad input, one line, exit code 2 (config.py raises it
    and re-exports it). ``agree(comm, fn)``: run a start-up check on every rank and turn a
    failure on any rank into the same one-line ConfigError on all of them,
    before any rank waits in a collective for one that has gone. ``leave``:
    the agreed end, one line from rank 0, then every rank finalizes MPI and
    exits with the code itself (``python -m mpi4py`` would turn a non-zero
    ``sys.exit`` into MPI_Abort and its banner).

    Exit codes of ``python -m ringzero.train``: 0 done; 2 bad input (flags,
    config, data, device, metrics file, a checkpoint that fails its checks
    on resume, an offload folder missing, read-only or too small); 3 a checkpoint
    save failed, the previous one intact; 4 the offload tier failed in use (a full
    disk, a short read, any exception of an offloaded update or of the params cast
    at start or resume: the same line from every rank), the newest checkpoint intact; 128+N
    stopped by signal N after saving (SIGINT 130, SIGUSR1 138, SIGTERM 143);
    4 an allocation failed on a rank (one line from each rank it failed on,
    naming the buffer, its bytes and the limits; mpirun ends the others);
    anything else is a bug and comes with its traceback.

What it is not
    Not for the step: agree() is one small allgather, for start-up checks.
    The signals are preempt.py's; what is checked is train.py's and startup.py's.
"""
from __future__ import annotations

import os
import sys


class ConfigError(ValueError):
    """A bad flag or config value: reported in one line, exit code 2."""


def agree(comm, fn):
    """``fn()`` on every rank; if it raised ConfigError (or OSError) on any
    rank, every rank raises one ConfigError naming the first such rank.
    One small allgather: for start-up checks, never the step."""
    res, err = None, None
    try:
        res = fn()
    except (ConfigError, OSError) as e:
        err = str(e).replace("\n", " ")
    errs = comm.allgather(err) if comm.size > 1 else [err]
    bad = [(r, e) for r, e in enumerate(errs) if e]
    if not bad:
        return res
    r, e = bad[0]
    if len(bad) == comm.size and len({x for _, x in bad}) == 1:
        raise ConfigError(e)                         # every rank alike: no rank to name
    more = f" (and {len(bad) - 1} more rank{'s' if len(bad) > 2 else ''})" if len(bad) > 1 else ""
    raise ConfigError(f"rank {r}{more}: {e}")


def under_mpi() -> bool:
    """True under an MPI launcher (or with MPI already started): then ranks agree on errors."""
    return "mpi4py.MPI" in sys.modules or any(
        k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "PMI_RANK"))


def leave(comm, code: int, msg: str | None, every_rank: bool = False) -> int:
    """End an agreed failure: one line from rank 0 (every_rank: one from each rank,
    its own), then every rank finalizes MPI and exits ``code`` itself, so that
    ``python -m mpi4py`` does not turn the exit into MPI_Abort (and its banner).
    All ranks must be here."""
    from mpi4py import MPI
    if msg and (every_rank or comm.rank == 0):
        print(msg, file=sys.stderr)
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return code
    sys.stdout.flush()
    sys.stderr.flush()
    MPI.Finalize()
    os._exit(code)


def out_of_memory(comm, e: MemoryError) -> int:
    """One line from the rank whose allocation failed (limits.AllocationError names the buffer, its bytes and
    the limits), then exit 4 at once: the other ranks may wait in a collective for this one, and mpirun ends
    them when it sees this rank go. No MPI_Finalize (it would wait for them too)."""
    from ringzero.runtime.limits import AllocationError, Room, failed_bytes
    if not isinstance(e, AllocationError):   # activations or another buffer outside the state and workspaces
        n = failed_bytes(e)
        e = f"out of memory{f' allocating {n / 2**20:,.1f} MiB ({n:,} B)' if n else ''}: {Room.read().describe()}"
    print(f"ringzero.train: error: rank {comm.rank}: {e}; HINT: a higher --stage, --activation-checkpointing "
          "or more ranks hold less per rank (the start-up check estimates it unless --no-mem-check)",
          file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(4)


def newest_note(cfg) -> str:
    """The tail of a failed run's line: the newest complete checkpoint in --save-dir, or that there is none."""
    from ringzero.runtime.checkpoint import latest
    prev = latest(cfg.save_dir)
    return f"; the newest complete checkpoint is {prev}" if prev else "; no earlier checkpoint"


def fail(msg):
    """A serial run's one error line (no MPI to agree with): from rank 0 of the launcher only."""
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
    if rank == 0:
        print(f"ringzero.train: error: {msg}", file=sys.stderr)
