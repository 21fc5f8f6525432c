"""A model of a GPU caching allocator (PyTorch's and CuPy's pools), for replaying traces.

What it is
    A device of ``cap`` bytes hands out *segments* (cudaMalloc). The pool
    carves each segment into *blocks*; a request is served by the best-fitting
    free block (smallest size that fits, lowest address on a tie), which is
    split when the rest is big enough to be worth keeping; a freed block is
    merged with its free neighbours in the same segment. When no cached block
    fits, a new segment is requested from the device; if the device is full,
    every segment that is entirely free is released and the request retried
    once; then it is an out-of-memory error (OOM). Two policies:

        policy    rounding  pools                     segment for a request of s bytes       split if rest
        pytorch   512 B     small (<= 1 MiB), large   small: 2 MiB; s < 10 MiB: 20 MiB;    small: >= 512 B
                                                      else s rounded up to 2 MiB           large: > 1 MiB
        cupy      512 B     one                       s (rounded)                          > 0

    (PyTorch: c10/cuda/CUDACachingAllocator.cpp, kMinBlockSize, kSmallSize,
    kSmallBuffer, kLargeBuffer, kMinLargeAlloc, kRoundLarge, with the default
    max_split_size; CuPy: cupy/cuda/memory.pyx, MemoryPool's 512-byte unit,
    best-fit bins, split and merge of chunks.) Free memory is therefore of two
    kinds: free blocks inside reserved segments (usable only by requests that
    fit one of them) and the device's unreserved rest (usable only by a new
    segment). Fragmentation is a request that fits neither while their sum is large.

What it is not
    The real allocator: no streams, no events, no garbage-collection threshold,
    no expandable segments, and the device itself never fragments (cudaMalloc
    maps virtual memory). ``Allocator.replay`` runs a trace of
    ("alloc", id, nbytes) / ("free", id) events and reports peaks and the OOM.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

KIB, MIB = 1 << 10, 1 << 20


@dataclass(frozen=True)
class Policy:
    name: str
    round_to: int = 512             # every request is rounded up to a multiple of this
    small_size: int = 1 * MIB       # requests <= this go to the small pool (0: one pool)
    small_segment: int = 2 * MIB    # segment size for the small pool
    large_buffer: int = 20 * MIB    # segment for a large request below min_large_alloc
    min_large_alloc: int = 10 * MIB
    round_large: int = 2 * MIB      # larger requests: segment rounded up to this
    exact_segments: bool = False    # cupy: a segment is exactly the rounded request
    split_small: int = 512          # split a small block if the rest is >= this
    split_large: int = 1 * MIB      # split a large block if the rest is > this

    def round(self, n: int) -> int:
        r = self.round_to
        return max(r, -(-int(n) // r) * r)

    def pool_of(self, size: int) -> str:
        return "small" if self.small_size and size <= self.small_size else "large"

    def segment_size(self, size: int) -> int:
        """Bytes asked of the device when no cached block fits ``size`` (rounded)."""
        if self.exact_segments:
            return size
        if self.pool_of(size) == "small":
            return self.small_segment
        if size < self.min_large_alloc:
            return self.large_buffer
        return -(-size // self.round_large) * self.round_large

    def should_split(self, pool: str, rest: int) -> bool:
        if self.exact_segments:
            return rest > 0
        return rest >= self.split_small if pool == "small" else rest > self.split_large


PYTORCH = Policy("pytorch")
CUPY = Policy("cupy", small_size=0, exact_segments=True)
POLICIES = {"pytorch": PYTORCH, "cupy": CUPY}


class OutOfMemory(Exception):
    """A request no cached block and no new segment could serve."""


@dataclass
class Block:
    seg: int        # segment id
    addr: int       # absolute address (segments are laid end to end in a virtual space)
    size: int
    pool: str
    free: bool = True
    prev: "Block | None" = field(default=None, repr=False)
    next: "Block | None" = field(default=None, repr=False)

    def key(self):
        return (self.size, self.addr)


class Allocator:
    """The pool over a device of ``cap`` bytes. alloc(n) -> Block, free(Block)."""

    def __init__(self, cap: int, policy: Policy = PYTORCH):
        if cap < 1:
            raise ValueError(f"cap must be >= 1 byte, got {cap}")
        self.cap, self.policy = int(cap), policy
        self.free_sets = {"small": [], "large": []}   # sorted [(size, addr, Block)] per pool
        self.segments = {}            # seg id -> first Block
        self.seg_size = {}            # seg id -> bytes
        self._next_seg = 0
        self._next_addr = 0
        self.reserved = self.allocated = 0
        self.peak_reserved = self.peak_allocated = 0
        self.device_mallocs = self.releases = 0

    # ---- the free sets (best fit: smallest size, then lowest address) ----------
    def _insert(self, b: Block):
        bisect.insort(self.free_sets[b.pool], (b.size, b.addr, id(b), b))

    def _remove(self, b: Block):
        s = self.free_sets[b.pool]
        i = bisect.bisect_left(s, (b.size, b.addr))
        while s[i][3] is not b:
            i += 1
        s.pop(i)

    def _best_fit(self, pool: str, size: int):
        s = self.free_sets[pool]
        i = bisect.bisect_left(s, (size, -1))
        return s[i][3] if i < len(s) else None

    # ---- device --------------------------------------------------------------------
    def _new_segment(self, pool: str, size: int):
        seg_bytes = self.policy.segment_size(size)
        if self.reserved + seg_bytes > self.cap:
            return None
        sid = self._next_seg
        self._next_seg += 1
        b = Block(sid, self._next_addr, seg_bytes, pool)
        self._next_addr += seg_bytes
        self.segments[sid], self.seg_size[sid] = b, seg_bytes
        self.reserved += seg_bytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.device_mallocs += 1
        return b

    def release_cached(self) -> int:
        """Give every entirely free segment back to the device (empty_cache); bytes freed."""
        out = 0
        for sid, b in list(self.segments.items()):
            if b.free and b.next is None:
                self._remove(b)
                del self.segments[sid]
                out += self.seg_size.pop(sid)
        self.reserved -= out
        self.releases += out > 0
        return out

    # ---- alloc / free ---------------------------------------------------------------
    def alloc(self, nbytes: int) -> Block:
        size = self.policy.round(nbytes)
        pool = self.policy.pool_of(size)
        b = self._best_fit(pool, size)
        if b is not None:
            self._remove(b)
        else:
            b = self._new_segment(pool, size)
            if b is None and self.release_cached():
                b = self._new_segment(pool, size)
            if b is None:
                raise OutOfMemory(size)
        rest = b.size - size
        if self.policy.should_split(pool, rest):
            tail = Block(b.seg, b.addr + size, rest, pool, True, b, b.next)
            if b.next is not None:
                b.next.prev = tail
            b.next, b.size = tail, size
            self._insert(tail)
        b.free = False
        self.allocated += b.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return b

    def free(self, b: Block):
        if b.free:
            raise ValueError(f"double free of the block at {b.addr}")
        b.free = True
        self.allocated -= b.size
        for nb in (b.prev, b.next):          # coalesce with free neighbours in the segment
            if nb is not None and nb.free:
                self._remove(nb)
                lo, hi = (nb, b) if nb is b.prev else (b, nb)
                lo.size += hi.size
                lo.next = hi.next
                if hi.next is not None:
                    hi.next.prev = lo
                if self.segments.get(lo.seg) is hi:
                    self.segments[lo.seg] = lo
                b = lo
        self._insert(b)

    # ---- views ---------------------------------------------------------------------
    def largest_free_block(self) -> int:
        return max((s[-1][0] for s in self.free_sets.values() if s), default=0)

    def cached_free(self) -> int:
        return sum(e[0] for s in self.free_sets.values() for e in s)

    def blocks(self):
        """[(seg, addr, size, free)] of every block, in address order."""
        out = []
        for sid in sorted(self.segments):
            b = self.segments[sid]
            while b is not None:
                out.append((sid, b.addr, b.size, b.free))
                b = b.next
        return out


def replay(trace, cap: int, policy: Policy = PYTORCH, record: bool = False) -> dict:
    """Run a trace of ("alloc", id, nbytes[, tag]) and ("free", id) events.

    Returns peaks (record=True: the usage after every event), and at an OOM the state of the pool at that moment: the
    request, bytes allocated and reserved, the largest cached free block, the
    device's unreserved rest, and the share of ``cap`` not held by live blocks.
    """
    a = Allocator(cap, policy)
    live = {}
    out = {"cap": cap, "policy": policy.name, "events": len(trace), "oom": None}
    usage = out["usage"] = [] if record else None     # (allocated, reserved, largest free) per event
    for i, ev in enumerate(trace):
        if usage is not None and i:
            usage.append((a.allocated, a.reserved, a.largest_free_block()))
        if ev[0] == "alloc":
            try:
                live[ev[1]] = a.alloc(ev[2])
            except OutOfMemory:
                out["oom"] = {
                    "event": i, "id": ev[1], "tag": ev[3] if len(ev) > 3 else "",
                    "request": policy.round(ev[2]), "allocated": a.allocated,
                    "reserved": a.reserved, "largest_free_block": a.largest_free_block(),
                    "cached_free": a.cached_free(), "device_free": cap - a.reserved,
                    "free_share": (cap - a.allocated) / cap,
                    "segment_needed": policy.segment_size(policy.round(ev[2]))}
                break
        elif ev[0] == "free":
            a.free(live.pop(ev[1]))
        else:
            raise ValueError(f"trace event {i}: expected 'alloc' or 'free', got {ev[0]!r}")
    out.update(peak_allocated=a.peak_allocated, peak_reserved=a.peak_reserved,
               largest_free_block=a.largest_free_block(), device_mallocs=a.device_mallocs)
    return out


def smallest_cap(trace, policy: Policy = PYTORCH, lo: int | None = None, hi: int | None = None,
                 quantum: int = 512) -> int:
    """The smallest cap (a multiple of ``quantum``) at which the trace runs, by bisection.

    Runs at least need the trace's peak of live rounded bytes (``lo``); ``hi``
    defaults to the sum of every allocation's segment (always enough). A
    caching allocator need not be monotone in the cap; the caller checks the
    answer runs and ``answer - quantum`` does not.
    """
    if lo is None:
        lo = peak_live(trace, policy)
    if hi is None:
        hi = sum(policy.segment_size(policy.round(e[2])) for e in trace if e[0] == "alloc")
    lo, hi = -(-lo // quantum), -(-hi // quantum)
    if replay(trace, hi * quantum, policy)["oom"]:
        raise ValueError(f"trace does not run even at {hi * quantum} bytes")
    while lo < hi:
        mid = (lo + hi) // 2
        if replay(trace, mid * quantum, policy)["oom"]:
            lo = mid + 1
        else:
            hi = mid
    return lo * quantum


def peak_live(trace, policy: Policy = PYTORCH) -> int:
    """Peak of the live rounded bytes: what any allocator must hold at once."""
    cur = peak = 0
    sizes = {}
    for ev in trace:
        if ev[0] == "alloc":
            sizes[ev[1]] = policy.round(ev[2])
            cur += sizes[ev[1]]
            peak = max(peak, cur)
        else:
            cur -= sizes.pop(ev[1])
    return peak
