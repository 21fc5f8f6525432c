"""ringzero.sizes: the one reader of sizes, counts and rates, against values computed by hand."""
import argparse

import pytest

from ringzero.sizes import QuantityError, human, parse_count, parse_link, parse_quantity, parse_rate, parse_size


@pytest.mark.parametrize("text,want", [
    ("4096", 4096), ("1e9", 1_000_000_000), ("512B", 512), (" 7 ", 7),
    ("4K", 4 * 1024), ("4k", 4096), ("4KiB", 4096), ("4kib", 4096), ("4KB", 4000),
    ("16M", 16 * 1024 * 1024), ("16MiB", 16_777_216), ("16MB", 16_000_000),
    ("1.5G", 1_610_612_736), ("1.5GiB", 1_610_612_736), ("32GB", 32_000_000_000),
    ("80GiB", 85_899_345_920), ("1T", 1_099_511_627_776), ("2TB", 2_000_000_000_000),
    ("0.5K", 512), ("2.5e3", 2500), ("0.25M", 262144), ("0.001GB", 1_000_000),
])
def test_parse_size(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("bad", ["", "K", "4X", "4 K B", "-1K", "0", "0.1K", "1.5", "4K/s", "1e-3"])
def test_parse_size_rejects_in_one_line(bad):
    with pytest.raises(ValueError) as e:
        parse_size(bad)
    assert "\n" not in str(e.value) and repr(bad) in str(e.value)


def test_parse_count_is_decimal():
    assert parse_count("7.5B") == 7_500_000_000 and parse_count("0.1B") == 10**8
    assert parse_count("125M") == 125_000_000 and parse_count("3K") == 3000 and parse_count("2T") == 2 * 10**12
    for bad in ("7.5X", "", "B", "-1B"):
        with pytest.raises(ValueError, match="expected a number"):
            parse_count(bad)
    with pytest.raises(ValueError, match="whole number"):
        parse_count("1.5")


def test_parse_rate():
    assert parse_rate("100GB/s") == 1e11 and parse_rate("100GBps") == 1e11 and parse_rate("900GB/s") == 9e11
    assert parse_rate("25GiB/s") == 25 * 2.0**30 and parse_rate("1e9") == 1e9
    with pytest.raises(ValueError, match="rate"):
        parse_rate("fast")


def test_parse_quantity_other_units():
    us = {"": 1, "S": 1, "MS": 10**-3, "US": 10**-6}
    assert float(parse_quantity("10us", us, "time", "10us")) == pytest.approx(1e-5)
    assert float(parse_quantity("3ms", us, "time", "10us")) == pytest.approx(3e-3)


@pytest.mark.parametrize("n,want", [(4096, "4K"), (64 << 20, "64M"), (1 << 30, "1G"), (3 << 30, "3G"),
                                    (1536, "1536"), (1000, "1000"), (0, "0"), ((1 << 20) + 1024, "1025K")])
def test_human_reads_back(n, want):
    assert human(n) == want
    if n:
        assert parse_size(want) == n


def test_argparse_prints_the_line(capsys):
    ap = argparse.ArgumentParser()
    ap.add_argument("-b", type=parse_size)
    assert ap.parse_args(["-b", "4K"]).b == 4096
    assert issubclass(QuantityError, argparse.ArgumentTypeError)
    with pytest.raises(SystemExit):
        ap.parse_args(["-b", "4X"])
    err = capsys.readouterr().err.strip().splitlines()
    assert "cannot read size '4X'" in err[-1]


@pytest.mark.parametrize("text, want", [("1gbit", 125e6), ("10gbit", 1.25e9), ("500mbit", 62.5e6),
                                        ("125mbps", 125e6), ("125MB/s", 125e6), ("8kbit", 1e3)])
def test_parse_link_reads_tc_rates(text, want):
    """tc's units: ...bit are bits per second, ...bps BYTES per second."""
    assert parse_link(text) == want


def test_parse_link_rejects_in_one_line():
    with pytest.raises(QuantityError) as e:
        parse_link("fast")
    assert "\n" not in str(e.value) and "1gbit" in str(e.value)


def test_bench_link_limit_is_the_bytes_that_leave_a_node():
    from ringzero.tools.bench import link_limit_s
    S, rate = 16 << 20, 125e6
    assert link_limit_s("reduce_scatter", S, 2, rate) == pytest.approx(S / 2 / rate)      # 67.1 ms
    assert link_limit_s("all_gather", S, 4, rate) == pytest.approx(S * 3 / 4 / rate)
    assert link_limit_s("all_reduce", S, 2, rate) == pytest.approx(S / rate)              # two passes
    assert link_limit_s("all_reduce", S, 1, rate) is None and link_limit_s("all_gather", S, 2, None) is None
