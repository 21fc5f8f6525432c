"""ringzero.tools.plot renders headless (Agg) PNGs that exist, are non-empty and are PNGs."""
import json
import os
import sys

import pytest

pytest.importorskip("matplotlib")
from ringzero.tools import plot  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from test_fit import synthetic_rows  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def no_display(monkeypatch):
    monkeypatch.delenv("DISPLAY", raising=False)
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)


def _is_png(path):
    assert os.path.getsize(path) > 1000
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC


def test_memory_png(tmp_path):
    out = str(tmp_path / "mem.png")
    assert plot.main(["memory", "--params", "7.5B", "--nd-max", "256", "--ranks-per-node", "8",
                      "--gpu-mem", "32GB", "-o", out]) == 0
    _is_png(out)


def test_busbw_png(tmp_path):
    rows = synthetic_rows()
    rows += [dict(r, impl="mpi", busbw_GBps=1.0 + i % 3) for i, r in enumerate(rows)]
    for i, r in enumerate(rows):
        r["busbw_GBps"] = r["busbw_GBps"] or 0.5 + (i % 7) / 7
    p = tmp_path / "bench.json"
    p.write_text(json.dumps(rows))
    out = str(tmp_path / "bw.png")
    assert plot.main(["busbw", str(p), "-o", out]) == 0
    _is_png(out)


def test_loss_png(tmp_path):
    lines = [{"step": i, "loss": 5.5 / (1 + 0.05 * i), "lr": 1e-3, "loss_scale": 65536.0,
              "grad_norm": 1.0, "tokens_per_s": 1e4, "step_time_s": 0.1, "bytes_sent": 10}
             for i in range(50)]
    lines.append({"summary": True, "params": 1000, "world_size": 2, "stage": "2", "memory": {},
                  "traffic": {}, "train_loss": 2.0, "eval_loss": 2.1, "unigram_entropy": 3.4})
    p = tmp_path / "m.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in lines))
    out = str(tmp_path / "loss.png")
    assert plot.main(["loss", str(p), "-o", out]) == 0
    _is_png(out)


def test_losses_side_by_side(tmp_path, capsys):
    files = []
    for k, final in (("none", 2.1), ("qwz,hpz,qgz", 2.12)):
        lines = [{"step": i, "loss": 5.5 / (1 + 0.05 * i), "eval_loss": 5.0 / (1 + 0.05 * i) if i % 10 == 0 else None}
                 for i in range(50)]
        lines.append({"summary": True, "params": 1000, "world_size": 4, "stage": "3", "eval_loss": final})
        p = tmp_path / f"{k}.jsonl"
        p.write_text("\n".join(json.dumps(x) for x in lines))
        files.append(str(p))
    out = str(tmp_path / "side.png")
    assert plot.main(["loss", *files, "-o", out]) == 0
    _is_png(out)
    text = capsys.readouterr().out
    assert "none: final eval loss 2.1000" in text and "qwz,hpz,qgz: final eval loss 2.1200" in text


def test_eval_points_end_with_the_final_evaluation():
    """The side-by-side plot's held-out curve: the periodic evaluations, then the summary's final one at
    the last step (before, the curve stopped at the last periodic one, 50 steps short)."""
    steps = [{"step": i, "loss": 3.0, **({"eval_loss": 2.5 - i / 1000} if i % 50 == 49 else {})} for i in range(300)]
    xs, ys = plot.eval_points(steps[:-1] + [steps[-1] | {"eval_loss": None}], {"eval_loss": 2.2})
    assert xs == [49, 99, 149, 199, 249, 299] and ys[-1] == 2.2 and ys[0] == 2.5 - 49 / 1000
    assert plot.eval_points(steps[:10], {"eval_loss": 2.2}) == ([9], [2.2])
    assert plot.eval_points(steps[:10], None) == ([], [])


def test_bad_inputs_exit_2(tmp_path):
    p = tmp_path / "empty.jsonl"
    p.write_text("")
    with pytest.raises(SystemExit) as e:
        plot.main(["loss", str(p), "-o", str(tmp_path / "x.png")])
    assert e.value.code == 2
    q = tmp_path / "b.json"
    q.write_text(json.dumps([{"op": "bcast", "impl": "mpi", "n": 2, "bytes": 4, "time_us": 1}]))
    with pytest.raises(SystemExit) as e:
        plot.main(["busbw", str(q), "-o", str(tmp_path / "y.png")])
    assert e.value.code == 2
    assert not (tmp_path / "y.png").exists()
