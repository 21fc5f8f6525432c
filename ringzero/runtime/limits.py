"""How much memory this rank and its node may still take, read from the kernel; and allocations that say who failed.

What it is
    Three ceilings, each read where the kernel keeps it:

        MemAvailable        /proc/meminfo: what the node can still give without swapping (shared by its ranks)
        memory cgroup       v2 ``memory.max`` - ``memory.current``, v1 ``memory.limit_in_bytes`` -
                            ``memory.usage_in_bytes`` (page cache that can be dropped, ``inactive_file``,
                            counted as free), the tightest of this process's cgroup and its ancestors
                            (shared by the ranks in it)
        RLIMIT_DATA         this process's soft limit (``prlimit --data``, ``ulimit -d``) less what its data
                            segment already holds (``VmData`` of /proc/self/status): per rank

    ``Room.read()`` reads them all for this rank; ``node_room`` and ``rank_room`` are what a start-up check
    compares with. ``RINGZERO_MEM_AVAILABLE=SIZE`` (e.g. ``2GiB``) caps the node's figure: tests, and a
    node known to have less than it reports.

    ``memory_fs(path)``: "tmpfs" or "ramfs" where a path's bytes are the node's memory, not a disk's (an
    --offload-dir there is counted as memory by the start-up check).

    ``zeros(xp, n, dtype, what)`` and ``alloc_guard(what)`` turn a MemoryError (NumPy's
    ``_ArrayMemoryError``, CuPy's ``OutOfMemoryError``) into an ``AllocationError``: one line that names
    the buffer, its bytes and the limits above, for the trainer to print on the rank that failed.

What it is not
    No arithmetic of what a run needs (runtime/budget.py) and no MPI: the trainer gathers the ranks'
    figures (app/memcheck.py). Linux only; elsewhere a figure that cannot be read is None (no limit known).
"""
from __future__ import annotations

import contextlib
import os
import resource
from dataclasses import dataclass

MEM_AVAILABLE_ENV = "RINGZERO_MEM_AVAILABLE"    # cap the node's figure (tests, or a node that over-reports)
_UNLIMITED = 1 << 60                            # cgroup "max" / v1's 2^63 - page: no limit


def _mib(b) -> str:
    return f"{b / 2**20:,.1f} MiB"


def _read(path: str):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def mem_available(path: str = "/proc/meminfo") -> int | None:
    """MemAvailable in bytes (the kernel's estimate of what can be allocated without swapping)."""
    text = _read(path)
    for line in (text or "").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024           # "MemAvailable:   20312340 kB"
    return None


def data_in_use(path: str = "/proc/self/status") -> int:
    """VmData in bytes: what RLIMIT_DATA counts now (private writable mappings: heap, arrays, stacks)."""
    text = _read(path)
    for line in (text or "").splitlines():
        if line.startswith("VmData:"):
            return int(line.split()[1]) * 1024
    return 0


def rlimit_data() -> int | None:
    """This process's soft RLIMIT_DATA in bytes, or None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_DATA)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def _stat_value(text, *keys) -> int:
    for line in (text or "").splitlines():
        k, _, v = line.partition(" ")
        if k in keys:
            return int(v)
    return 0


def cgroup_room(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup"):
    """(room, limit, where) of the tightest memory cgroup over this process, or None when none limits it.

    room = limit - usage + inactive page cache. Reads cgroup v2 (``0::/path``, files under ``root``)
    or v1 (the ``memory`` controller, under ``root/memory``), at the process's cgroup and each ancestor
    that the mount shows (inside a container the path may not exist under the mount: its root is used).
    """
    best = None
    for line in (_read(proc_cgroup) or "").splitlines():
        hid, ctrl, path = (line.split(":", 2) + ["", ""])[:3]
        v2 = hid == "0" and ctrl == ""
        if not v2 and "memory" not in ctrl.split(","):
            continue
        base = root if v2 else os.path.join(root, "memory")
        files = (("memory.max", "memory.current", ("inactive_file",)) if v2 else
                 ("memory.limit_in_bytes", "memory.usage_in_bytes", ("total_inactive_file", "inactive_file")))
        parts = [p for p in path.strip().split("/") if p]
        for k in range(len(parts), -1, -1):               # the cgroup itself, then each ancestor
            d = os.path.join(base, *parts[:k])
            lim = (_read(os.path.join(d, files[0])) or "").strip()
            if not lim or lim == "max" or int(lim) >= _UNLIMITED:
                continue
            use = int((_read(os.path.join(d, files[1])) or "0").strip() or 0)
            cache = _stat_value(_read(os.path.join(d, "memory.stat")), *files[2])
            room = max(0, int(lim) - use + cache)
            where = f"{os.path.join(d, files[0])} {_mib(int(lim))}"
            if best is None or room < best[0]:
                best = (room, int(lim), where)
    return best


@dataclass(frozen=True)
class Room:
    """What this rank and its node can still take, and where each figure came from."""
    mem_available: int | None        # /proc/meminfo, or RINGZERO_MEM_AVAILABLE if smaller
    cgroup: tuple | None             # (room, limit, where) of cgroup_room
    rlimit: int | None               # soft RLIMIT_DATA (None: unlimited)
    data_used: int                   # VmData now
    forced: bool = False             # mem_available came from RINGZERO_MEM_AVAILABLE

    @classmethod
    def read(cls) -> "Room":
        avail, forced = mem_available(), False
        env = os.environ.get(MEM_AVAILABLE_ENV)
        if env:
            from ringzero.sizes import parse_size
            cap = parse_size(env)
            if avail is None or cap < avail:
                avail, forced = cap, True
        return cls(avail, cgroup_room(), rlimit_data(), data_in_use(), forced)

    @property
    def rank_room(self) -> int | None:
        """Bytes this rank may still add to its data segment (None: no RLIMIT_DATA)."""
        return None if self.rlimit is None else max(0, self.rlimit - self.data_used)

    @property
    def node_room(self) -> int | None:
        """Bytes the ranks of this node may still take together: the smaller of MemAvailable and the cgroup's."""
        xs = [x for x in (self.mem_available, self.cgroup[0] if self.cgroup else None) if x is not None]
        return min(xs) if xs else None

    def describe_rank(self) -> str:
        return f"RLIMIT_DATA leaves {_mib(self.rank_room)} (limit {_mib(self.rlimit)}, {_mib(self.data_used)} in use)"

    def describe_node(self) -> str:
        cg = self.cgroup
        if cg is not None and (self.mem_available is None or cg[0] <= self.mem_available):
            return f"the memory cgroup leaves {_mib(cg[0])} ({cg[2]})"
        src = MEM_AVAILABLE_ENV if self.forced else "MemAvailable"
        return f"{src} is {_mib(self.mem_available)}"

    def describe(self) -> str:
        """Every limit known, for an allocation-failure line."""
        out = []
        if self.rlimit is not None:
            out.append(self.describe_rank())
        if self.cgroup is not None:
            out.append(f"cgroup {self.cgroup[2]}, {_mib(self.cgroup[0])} free")
        if self.mem_available is not None:
            out.append(f"MemAvailable {_mib(self.mem_available)}")
        return "; ".join(out) or "no limit known"


def data_limit_prefix(nbytes: int) -> list:
    """A command prefix that runs a command under RLIMIT_DATA = ``nbytes`` (rounded down to KiB): util-linux's
    ``prlimit --data`` where it runs, else the shell's ``ulimit -d`` (which sets the hard limit too).
    For the tests and benchmarks/capacity.py; nothing here is privileged."""
    import shutil
    import subprocess
    kib = int(nbytes) // 1024
    global _PRLIMIT_OK
    if _PRLIMIT_OK is None:            # one build of prlimit crashed (SIGSEGV) on "500M", not on bytes: bytes it is
        _PRLIMIT_OK = shutil.which("prlimit") is not None and subprocess.run(
            ["prlimit", f"--data={1 << 30}", "true"], capture_output=True).returncode == 0
    if _PRLIMIT_OK:
        return ["prlimit", f"--data={kib * 1024}"]
    return ["sh", "-c", f'ulimit -d {kib} && exec "$@"', "sh"]


_PRLIMIT_OK = None


class AllocationError(MemoryError):
    """A buffer could not be allocated: its name, its bytes and the limits, in one line."""

    def __init__(self, what: str, nbytes: int | None, detail: str = ""):
        self.what, self.nbytes = what, nbytes
        size = f"{_mib(nbytes)} ({nbytes:,} B)" if nbytes else "its bytes"
        super().__init__(f"cannot allocate {what}: {size}{': ' + detail if detail else ''}; "
                         f"{Room.read().describe()}")


def failed_bytes(e: BaseException) -> int | None:
    """Bytes a failed allocation asked for: NumPy's _ArrayMemoryError knows them; CuPy's message says them."""
    n = getattr(e, "_total_size", None)
    if n is not None:
        return int(n)
    size = getattr(e, "size", None)               # cupy.cuda.memory.OutOfMemoryError
    return int(size) if isinstance(size, int) else None


@contextlib.contextmanager
def alloc_guard(what: str):
    """Allocations inside raise AllocationError naming ``what`` instead of a bare MemoryError."""
    try:
        yield
    except AllocationError:
        raise
    except MemoryError as e:
        raise AllocationError(what, failed_bytes(e)) from None
    except Exception as e:                        # CuPy's OutOfMemoryError is not a MemoryError
        if type(e).__name__ != "OutOfMemoryError":
            raise
        raise AllocationError(what, failed_bytes(e), "device memory") from None


def zeros(xp, n: int, dtype, what: str):
    """xp.zeros(n, dtype), or AllocationError naming ``what`` (its length and dtype), its bytes and the limits."""
    import numpy as np
    dt = np.dtype(dtype)
    with alloc_guard(f"{what} ({n:,} x {dt.name})"):
        return xp.zeros(n, dtype)


def existing_above(path: str) -> str:
    """``path`` itself or its nearest existing folder above (of an absolute path)."""
    p = os.path.abspath(path)
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    return p


# statfs f_type of the filesystems whose "files" are pages of memory (linux/magic.h)
MEMORY_FS = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}


def memory_fs(path: str) -> str | None:
    """"tmpfs" or "ramfs" when ``path`` is on a filesystem held in memory (statfs f_type), else None
    (also where statfs cannot say): offloading there moves bytes from one name of RAM to another."""
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        buf = ctypes.create_string_buffer(256)              # struct statfs: f_type first (a long on Linux)
        if libc.statfs(os.fsencode(existing_above(path)), buf) != 0:     # a DIR still to make: its parent's
            return None
    except (OSError, AttributeError):
        return None
    f_type = ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF
    return MEMORY_FS.get(f_type)
