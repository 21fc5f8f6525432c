"""What a Ring says when something is wrong: the limits, and the words of every stall, timeout and bad count.

What it is
    ``Limits.from_env(timeout, stall_warn)``: the seconds after which a
    waiting rank warns (RINGZERO_STALL_WARN, default 60), raises
    (RINGZERO_TIMEOUT, default 600) and, if MPI cannot cancel the wait, aborts
    (``grace`` later). ``Diagnostics(comm, limits)`` words one line for each
    case, naming the op, the context (``set_context``), the peer (with its
    world rank when the communicator is not COMM_WORLD) and a hint:

        stall_line       the inspector's warning (watchdog.py)
        timeout_message  the TimeoutError the waiting rank raises
        count_mismatch   a receive of another size than expected
        truncated        MPI refused a message longer than the receive
        resolve          a wait on several peers narrowed to the requests still open

What it is not
    It decides nothing: the executor raises, the inspector warns and cancels.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from mpi4py import MPI

from ringzero.comm.steps import Waiting
from ringzero.comm.watchdog import get_context

HINT_LEN = "HINT: do all ranks pass the same length?"


def env_seconds(name: str, default: float) -> float:
    v = os.environ.get(name)
    try:
        return float(v) if v not in (None, "") else float(default)
    except ValueError:
        raise ValueError(f"expected {name} in seconds (a number), got {v!r}") from None


@dataclass(frozen=True)
class Limits:
    timeout: float      # a wait without progress for this long raises TimeoutError (0 or less: never)
    stall_warn: float   # ... and for this long prints one line first (0 or less: never)
    grace: float        # after the timeout, a wait MPI could not cancel aborts the job this much later

    @classmethod
    def from_env(cls, timeout: float | None = None, stall_warn: float | None = None) -> "Limits":
        t = env_seconds("RINGZERO_TIMEOUT", 600) if timeout is None else float(timeout)
        w = env_seconds("RINGZERO_STALL_WARN", 60) if stall_warn is None else float(stall_warn)
        return cls(t, w, max(2.0, min(30.0, t / 4)))


class Diagnostics:
    def __init__(self, comm, limits: Limits):
        self.rank, self.limits = comm.rank, limits
        wg = MPI.COMM_WORLD.Get_group()
        self.world = MPI.Group.Translate_ranks(comm.Get_group(), list(range(comm.size)), wg)

    def who(self, peer: int) -> str:
        w = self.world[peer]
        return f"rank {peer}" if w == peer or w == MPI.UNDEFINED else f"rank {peer} (world rank {w})"

    def who_of(self, w: Waiting) -> str:
        if not isinstance(w.peer, tuple):
            return self.who(w.peer)
        return "ranks " + ", ".join(map(str, sorted(set(w.peer))))

    @staticmethod
    def resolve(w: Waiting, done) -> Waiting:
        """A wait on several peers (a MultiWait) narrowed to the requests not yet done (done[i] == 0)."""
        if not isinstance(w.peer, tuple):
            return w
        left = [(p, d) for i, (p, d) in enumerate(zip(w.peer, w.direction)) if done is None or not done[i]]
        if len({p for p, _ in left}) == 1:  # one peer: what a Wait on it would say
            return Waiting(w.op, left[0][0], "recv" if any(d == "recv" for _, d in left) else "send", w.reqs)
        return Waiting(w.op, tuple(p for p, _ in left) or w.peer, tuple(d for _, d in left) or w.direction, w.reqs)

    def _waiting_for(self, w: Waiting) -> tuple:
        """(what the rank waits for, in words; the peers as "rank 3" / "each of ranks 1, 2")."""
        if not isinstance(w.peer, tuple):
            what = "a message from" if w.direction == "recv" else "a send to be taken by"
            return f"{what} {self.who(w.peer)}", f"rank {w.peer}"
        parts = []
        for d, what in (("recv", "messages from"), ("send", "sends to be taken by")):
            ps = sorted({p for p, x in zip(w.peer, w.direction) if x == d})
            if ps:
                parts.append(f"{what} {', '.join(self.who(p) for p in ps)}")
        peers = sorted(set(w.peer))
        return " and ".join(parts), ("rank " if len(peers) == 1 else "each of ranks ") + ", ".join(map(str, peers))

    def stall_line(self, w: Waiting, stalled: float) -> str:
        ctx = get_context()
        waiting, _ = self._waiting_for(w)
        lim = self.limits
        return (f"ringzero | rank {self.world[self.rank]}: {w.op} has made no progress for {stalled:.3g} s"
                f"{' at ' + ctx if ctx else ''}, waiting for {waiting} "
                f"(warning after RINGZERO_STALL_WARN={lim.stall_warn:g} s; error at RINGZERO_TIMEOUT="
                f"{lim.timeout:g} s)")

    def timeout_message(self, w: Waiting, stalled: float) -> str:
        ctx = get_context()
        waiting, peers = self._waiting_for(w)
        return (f"ring {w.op}{' at ' + ctx if ctx else ''}: rank {self.rank} waited {self.limits.timeout:g} s for "
                f"{waiting}; is {peers} in the same call? (RINGZERO_TIMEOUT sets the limit)")

    def count_mismatch(self, op: str, expected: int, peer: int, got: int) -> str:
        return f"ring {op}: rank {self.rank} expected {expected} bytes from {self.who(peer)}, got {got}; {HINT_LEN}"

    def truncated(self, op: str, expect, w: Waiting, err: MPI.Exception) -> str:
        """MPI_ERR_TRUNCATE and kin: a peer sent more than a receive holds. expect: the bytes of each receive."""
        why = err.Get_error_string()
        if not isinstance(w.peer, tuple):
            return (f"ring {op}: rank {self.rank} expected {expect[0] if expect else 0} bytes from "
                    f"{self.who_of(w)}, got more ({why}); {HINT_LEN}")
        peers = sorted({p for p, nb in zip(w.peer, expect) if nb is not None})
        return (f"ring {op}: rank {self.rank} expected {max(x or 0 for x in expect)} bytes from each of ranks "
                f"{', '.join(map(str, peers))}, got more from one of them ({why}); {HINT_LEN}")

    def unusable(self, op: str, why: str) -> str:
        return f"ring {op}: this Ring is unusable after an earlier error ({why}); HINT: make a new Ring"
