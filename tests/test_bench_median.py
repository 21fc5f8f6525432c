"""python -m ringzero.bench median: the median over launches of the Ring/MPI ratio, per cell (serial)."""
import json

import pytest

from ringzero.tools import bench


def _file(tmp_path, name, ratios):
    rows = []
    for (op, n, b), x in ratios.items():
        rows.append({"op": op, "impl": "ring", "n": n, "bytes": b, "time_us": 1.0, "busbw_ratio": x})
        rows.append({"op": op, "impl": "mpi", "n": n, "bytes": b, "time_us": 1.0})
    p = tmp_path / name
    p.write_text(json.dumps({"rows": rows, "meta": {"n": 4}}))
    return str(p)


def test_median_and_range_per_cell(tmp_path, capsys):
    runs = [{("all_reduce", 4, 4096): 0.8, ("all_reduce", 4, 1 << 20): 1.3, ("all_gather", 2, 4096): 0.5},
            {("all_reduce", 4, 4096): 1.2, ("all_reduce", 4, 1 << 20): 0.9, ("all_gather", 2, 4096): 0.7},
            {("all_reduce", 4, 4096): 1.0, ("all_reduce", 4, 1 << 20): 1.1}]
    files = [_file(tmp_path, f"r{i}.json", r) for i, r in enumerate(runs)]
    assert bench.main(["median", *files, "--target", "1.0"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "| op | n | 4K | 1M |"
    assert out[2] == "| all_reduce | 4 | **1.00 (0.80–1.20)** | **1.10 (0.90–1.30)** |"
    assert out[3] == "| all_gather | 2 | 0.60 (0.50–0.70) |  |"      # two runs: their mean; no 1M cell


def test_unreadable_or_empty_files_say_so_in_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    with pytest.raises(SystemExit, match="bad.json"):
        bench.main(["median", str(bad)])
    empty = _file(tmp_path, "empty.json", {})
    with pytest.raises(SystemExit, match="no ring rows"):
        bench.main(["median", empty])
