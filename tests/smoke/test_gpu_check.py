"""launch/gpu-check's dry run: every row it can fill without a GPU says ok.

What it is
    ``RINGZERO_GPUCHECK_NO_GPU_OK=1 launch/gpu-check OUTDIR`` on this machine:
    its tests, its Ring benchmark and its training runs on ``--device cpu``,
    and its GPU scripts (copies, the model beside torch, the engine's pool)
    under the CuPy stand-in at tiny shapes. A device session is short and
    rare; a script that has rotted (a renamed argument, a moved module) must
    fail here, not on the device.
What it is not
    A GPU check: the stand-in's numbers mean nothing, and the table's GPU rows
    say DRY RUN.
"""
from __future__ import annotations

import os
import subprocess

import pytest
from smoke_run import PY, ROOT

pytestmark = pytest.mark.smoke

OK = {"ok", "DRY RUN", "n/a"}


def test_gpu_check_dry_run_fills_every_row(tmp_path):
    out = tmp_path / "gc"
    env = dict(os.environ, RINGZERO_GPUCHECK_NO_GPU_OK="1", RINGZERO_GPUCHECK_MAXBYTES="4M", PYTHON=PY,
               PATH=os.path.dirname(PY) + os.pathsep + os.environ.get("PATH", ""))
    r = subprocess.run([os.path.join(ROOT, "launch", "gpu-check"), str(out)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    table = (out / "table.tsv").read_text() if (out / "table.tsv").exists() else ""
    rows = [ln.split("\t") for ln in table.splitlines() if ln.strip()]
    bad = [f"{row[0]}: {row[1]} ({row[3]})" for row in rows if row[3] not in OK]
    assert r.returncode == 0 and rows and not bad, (
        f"launch/gpu-check dry run: rc {r.returncode}, rows not ok: {bad}\n{r.stdout[-3000:]}\n{r.stderr[-2000:]}")
    names = {row[0] for row in rows}
    for want in ("tests, serial (gpu, standin)", "model + engine script", "total time"):
        assert any(n.startswith(want) for n in names), f"no row {want!r} in {sorted(names)}"
