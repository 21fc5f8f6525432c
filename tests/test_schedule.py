"""The schedule rule (ringzero.comm.schedule), serial: the composition contract's precondition.

For every n and S, a reduce-scatter and an all-reduce (n | len) must sum in the
same order: both in the ring's order (direct, ring) or both in the halving
tree's (recursive_doubling, tree, rabenseifner); at n = 2 there is one pair, so any pairing holds. The
families are written out here, apart from the code under test.
"""
import pytest

from ringzero.comm import schedule as sch

# direct: the tree's order at 2^k, else the ring's
RING_ORDER, TREE_ORDER = {"ring"}, {"recursive_doubling", "tree", "rabenseifner"}
SIZES = [0, 1, 4096, 8192, 16384, 65536, 65540, 262144, 262145, 4 << 20, (4 << 20) + 8, 16 << 20, 64 << 20]


def family(name, n):
    if name == "direct":
        return "tree" if n & (n - 1) == 0 else "ring"
    return "ring" if name in RING_ORDER else "tree" if name in TREE_ORDER else pytest.fail(name)


@pytest.mark.parametrize("n", list(range(2, 20)) + [32, 64])
def test_reduce_scatter_and_all_reduce_sum_in_one_order(n):
    k = sch.defaults(n)
    for knobs in (k, {**k, "direct_bytes": 0}, {**k, "small_bytes": 1 << 40}, {**k, "tree_bytes": 0},
                  {**k, "latency_bytes": 0}, {**k, "latency_bytes": 1 << 40}, {**k, "direct_bytes": 1 << 40},
                  {**k, "direct_bytes": 1 << 40, "tree_bytes": 1 << 20}):
        for S in SIZES:
            rs = sch.choose("reduce_scatter", n, S, n * 4, **knobs)
            ar = sch.choose("all_reduce", n, S, n * 4, **knobs)
            assert n == 2 or family(rs, n) == family(ar, n), (n, S, knobs, rs, ar)


def test_direct_only_where_the_table_says():
    assert sch.choose("reduce_scatter", 8, 16 << 20, 8, **sch.defaults(8)) == "direct"
    assert sch.choose("reduce_scatter", 8, (16 << 20) + 8, 8, **sch.defaults(8)) == "ring"
    assert sch.choose("all_gather", 8, 64 << 20, 8, **sch.defaults(8)) == "direct"   # no scratch: no cap
    assert sch.choose("all_gather", 6, 1 << 30, 6, **sch.defaults(6)) == "direct"
    assert sch.choose("all_gather", 8, 64 << 20, 8, **{**sch.defaults(8), "direct_bytes": 0}) == "ring"
    assert sch.choose("all_gather", 6, 4096, 6, **{**sch.defaults(6), "direct_bytes": 0}) == "ring"
    assert sch.choose("all_gather", 8, 1 << 20, 8, **{**sch.defaults(8), "direct_bytes": 1024}) == "direct"
    assert sch.choose("all_gather", 2, 64 << 20, 2, **sch.defaults(2)) == "ring"    # n = 2: above tree_bytes
    assert sch.choose("all_gather", 2, 4096, 2, **sch.defaults(2)) == "tree"        # n = 2: never direct
    assert sch.choose("all_gather", 17, 4096, 17, **sch.defaults(17)) == "ring"     # n > 16: never direct
    assert sch.choose("all_reduce", 3, 4096, 7, **sch.defaults(3)) == "ring"        # 3 does not divide 7
    assert sch.choose("all_reduce", 4, 4096, 7, **sch.defaults(4)) == "recursive_doubling"


def test_power_of_two_schedules_per_op():
    for n in (4, 8, 16):
        k = sch.defaults(n)
        assert (k["small_bytes"], k["latency_bytes"], k["tree_bytes"]) == (64 << 10, 64 << 10, 16 << 20)
        sizes = (4096, 65536, 65540, 1 << 20, 16 << 20, (16 << 20) + 8)
        pick = {op: [sch.choose(op, n, S, n * 4, **k) for S in sizes] for op in sch.OPS}
        assert pick["all_reduce"] == ["recursive_doubling", "recursive_doubling", "rabenseifner", "rabenseifner",
                                      "rabenseifner", "ring"]
        assert pick["reduce_scatter"] == ["tree", "tree", "direct", "direct", "direct", "ring"]
        assert pick["all_gather"] == ["tree", "tree", "direct", "direct", "direct", "direct"]
    for n in (3, 5, 6, 7):   # no halving tree: direct from the first byte
        assert sch.choose("all_reduce", n, 4096, n * 4, **sch.defaults(n)) == "direct"
    assert sch.choose("reduce_scatter", 32, 1 << 20, 128, **sch.defaults(32)) == "tree"   # n > 16: no direct
