"""The caching-allocator model (ringzero.tools.allocator) against hand-worked cases.

Each expected figure below was worked out by hand from the policy table in
the module docstring (rounding, segment sizes, split thresholds, best fit,
coalescing, release of free segments before an OOM), not read off the code.
"""
import pytest

from ringzero.tools import allocator as al

MIB = 1 << 20


def test_rounding_and_small_pool():
    a = al.Allocator(1 << 30, al.PYTORCH)
    x = a.alloc(1)                       # -> 512 B, from a fresh 2 MiB small segment
    y = a.alloc(513)                     # -> 1024 B, split from the same segment
    assert (x.size, y.size) == (512, 1024)
    assert a.allocated == 1536 and a.reserved == 2 * MIB and a.device_mallocs == 1
    assert y.addr == x.addr + 512        # carved end to end
    assert a.largest_free_block() == 2 * MIB - 1536


def test_large_request_segments():
    p = al.PYTORCH
    assert p.segment_size(p.round(5 * MIB)) == 20 * MIB       # below 10 MiB: a 20 MiB segment
    assert p.segment_size(p.round(10 * MIB + 1)) == 12 * MIB  # above: rounded up to 2 MiB
    assert p.segment_size(p.round(600 * 1024)) == 2 * MIB     # small pool
    assert al.CUPY.segment_size(al.CUPY.round(1000)) == 1024  # cupy: exactly the rounded size


def test_best_fit_takes_the_smallest_block_and_does_not_split_a_small_rest():
    a = al.Allocator(1 << 30, al.PYTORCH)
    big, small = a.alloc(24 * MIB), a.alloc(12 * MIB)          # two exact segments
    a.free(big)
    a.free(small)
    b = a.alloc(11 * MIB)
    # best fit is the 12 MiB block; the 1 MiB rest is not > 1 MiB, so it is not split off
    assert b.addr == small.addr and b.size == 12 * MIB
    assert a.allocated == 12 * MIB and a.reserved == 36 * MIB


def test_split_and_coalesce():
    a = al.Allocator(1 << 30, al.PYTORCH)
    A, B, C = a.alloc(5 * MIB), a.alloc(5 * MIB), a.alloc(5 * MIB)   # one 20 MiB segment
    assert a.reserved == 20 * MIB and a.device_mallocs == 1
    assert [s for _, _, s, _ in a.blocks()] == [5 * MIB] * 4
    a.free(B)
    assert a.largest_free_block() == 5 * MIB                          # B and the tail are apart
    a.free(A)
    assert a.largest_free_block() == 10 * MIB                         # A + B merged
    assert [(s, f) for _, _, s, f in a.blocks()] == [(10 * MIB, True), (5 * MIB, False), (5 * MIB, True)]
    a.free(C)
    assert [(s, f) for _, _, s, f in a.blocks()] == [(20 * MIB, True)]  # whole segment again
    assert a.release_cached() == 20 * MIB and a.reserved == 0


def test_oom_with_memory_free():
    """cap 4096 B, cupy policy: a 2048 B segment pinned by a 1024 B block
    leaves 1024 B free that a 1536 B request cannot use."""
    a = al.Allocator(4096, al.CUPY)
    x = a.alloc(2048)
    a.free(x)
    a.alloc(1024)                       # reuses x's segment, split: 1024 used + 1024 free
    a.alloc(2048)                       # a new segment: reserved = 4096 = cap
    with pytest.raises(al.OutOfMemory):
        a.alloc(1536)
    assert a.allocated == 3072 and a.reserved == 4096
    assert a.cached_free() == 1024 and a.largest_free_block() == 1024


def test_release_before_oom_rescues_free_segments():
    a = al.Allocator(3072, al.CUPY)
    xs = [a.alloc(1024) for _ in range(3)]       # three exact segments, cap reached
    a.free(xs[0])
    a.free(xs[2])
    b = a.alloc(2048)                  # fits no cached block; the two free segments go back first
    assert b.size == 2048 and a.reserved == 3072 and a.releases == 1


def test_replay_reports_the_oom_and_smallest_cap():
    trace = [("alloc", 1, 2048), ("free", 1), ("alloc", 2, 1024), ("alloc", 3, 2048),
             ("alloc", 4, 1536, "late")]
    r = al.replay(trace, 4096, al.CUPY)
    o = r["oom"]
    assert o["event"] == 4 and o["tag"] == "late" and o["request"] == 1536
    assert o["allocated"] == 3072 and o["free_share"] == pytest.approx(1024 / 4096)
    assert o["device_free"] == 0 and o["largest_free_block"] == 1024
    # live peak 1024 + 2048 + 1536 = 4608; the pinned 2048 B segment makes it 2048 + 2048 + 1536
    assert al.peak_live(trace, al.CUPY) == 4608
    assert al.smallest_cap(trace, al.CUPY) == 5632
    assert al.replay(trace, 5632, al.CUPY)["oom"] is None
    assert al.replay(trace, 5632 - 512, al.CUPY)["oom"] is not None


def test_bad_input():
    with pytest.raises(ValueError, match="cap must be"):
        al.Allocator(0)
    a = al.Allocator(1 << 20, al.CUPY)
    b = a.alloc(100)
    a.free(b)
    with pytest.raises(ValueError, match="double free"):
        a.free(b)
    with pytest.raises(ValueError, match="expected 'alloc' or 'free'"):
        al.replay([("malloc", 1, 10)], 1 << 20)
