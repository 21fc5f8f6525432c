"""The tiers of ``estimate --ram/--disk/--device-mem``, ``simulate --disk-bw`` and ``explain offload``,
against arithmetic written out here (16Ψ's classes by hand, the I/O and its seconds by hand).
"""
import json
import re

import pytest

from ringzero.tools import estimate as est
from ringzero.tools import tiers

GiB = 2**30
PSI, ND = 1_500_000_000, 8


def _row(rows, stage, off):
    return next(r for r in rows if r["stage"] == stage and r["offload"] == off)


def test_cpu_tiers_by_hand():
    rows = tiers.tier_rows(PSI, ND, ram=24 * GiB, disk=80 * 10**9)
    r = _row(rows, "3", "-")
    assert r["per_rank"] == {"ram": 16 * PSI // ND, "device": 0, "disk": 0}
    assert r["fits"]                                      # 8 x 16Ψ/8 = 24e9 B < 24 GiB = 25.8e9 B
    r = _row(rows, "3", "optimizer")
    assert r["per_rank"] == {"ram": 4 * PSI // ND, "device": 0, "disk": 12 * PSI // ND}
    assert r["per_node"]["disk"] == 12 * PSI and r["fits"]
    r = _row(rows, "0", "optimizer")
    assert r["per_rank"]["ram"] == 4 * PSI and r["per_node"]["ram"] == ND * 4 * PSI
    assert r["short_of"] == ["RAM", "disk"]                   # 8 x 12Ψ = 144 GB of disk > 80 GB
    assert {x["offload"] for x in rows if x["stage"] != "3"} == {"-", "optimizer"}


def test_state_only_fits_24_gib():
    """16Ψ = 24e9 B < 24 GiB = 25.77e9 B: stage 3 holds the state alone; the trainer adds workspace and activations."""
    rows = tiers.tier_rows(PSI, ND, ram=24 * GiB)
    assert _row(rows, "3", "-")["fits"] is True and _row(rows, "0", "-")["fits"] is False


def test_gpu_tiers_pinned_or_disk():
    rows = tiers.tier_rows(PSI, ND, ram=64 * GiB, device_mem=2 * GiB, extra_per_rank=100 * 2**20)
    r = _row(rows, "3", "optimizer")
    assert r["per_rank"] == {"device": 4 * PSI // ND + 100 * 2**20, "ram": 12 * PSI // ND, "disk": 0}
    assert r["fits"]                                      # 0.85 GB on device; 18 GB pinned in 64 GiB
    rows = tiers.tier_rows(PSI, ND, ram=8 * GiB, device_mem=2 * GiB)
    r = _row(rows, "3", "optimizer")
    assert r["per_rank"]["ram"] == 0 and r["per_rank"]["disk"] == 12 * PSI // ND   # 18 GB > 8 GiB: on disk


def test_estimate_cli_prints_tiers(capsys):
    # the trainer's byte-level GPT-2 XL (vocab 256): with GPT-2's 50257 the embedding unit alone makes the
    # workspaces and the head's gradient staging 2 GiB a rank
    est.main(["--model", "gpt2-xl", "--vocab", "256", "--nd", "8", "--ram", "24GiB", "--disk", "80GB", "--batch", "1",
              "--seq", "64"])
    out = capsys.readouterr().out
    assert "Tiers: Ψ = 1,477,609,600, Nd = 8" in out
    line = next(ln for ln in out.splitlines() if re.match(r"\s+3\s+optimizer\s", ln))
    assert line.rstrip().endswith("yes")
    est.main(["--params", "1.5B", "--nd", "8", "--ram", "24GiB", "--json"])
    r = json.loads(capsys.readouterr().out)
    assert _row(r["tiers"], "3", "optimizer,params")["per_rank"]["disk"] == 14 * PSI // ND


def test_offload_time_by_hand():
    step = {"step_s": 10.0, "update": 2.0}
    io = {"optimizer": 12 * 10**9, "params_per_gather": 2 * 10**9}
    t = tiers.offload_time(step, io, 4e9, sharing=2)
    opt, par = 2 * 2 * 12e9 / 4e9, 2 * 3 * 2e9 / 4e9             # 12 s and 3 s
    assert t["io_s"] == pytest.approx(opt + par)
    assert t["blocking_s"] == pytest.approx(10 + opt + par)
    assert t["streamed_s"] == pytest.approx(max(8, par) + max(2, opt))


def test_simulate_disk_bw_prints_offload(capsys):
    from ringzero.tools.simulate_cli import main
    main(["--model", "gpt2-xl", "--nd", "8", "--stages", "2,3", "--flops", "1T", "--link", "nvlink",
          "--batch", "1", "--seq", "64", "--disk-bw", "2GB/s"])
    out = capsys.readouterr().out
    rows = [ln.split() for ln in out.splitlines() if re.match(r"\s+3\s+8\s+optimizer\s", ln)]
    assert rows and rows[0][2] == "optimizer"
    assert "with offload, disk 2 GB/s" in out


def test_explain_offload_numbers(capsys):
    from ringzero.tools.explain import main
    main(["offload", "--params", "1.5B", "--nd", "8", "--disk-bw", "2GB/s"])
    out = capsys.readouterr().out
    gb = 12 * PSI / ND / 1e9                                     # 12Ψ/Nd each way per rank
    assert f"12Ψ/Nd = {gb:.3f} GB per rank per step each way" in out
    assert f"{ND * 2 * gb / 2:.2f} s of I/O per step at 2 GB/s" in out
