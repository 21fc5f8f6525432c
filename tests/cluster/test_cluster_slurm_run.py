"""``./launch/cluster --slurm ... -- sbatch --wait launch/slurm.sbatch ...``: the run form.

It builds the nodes, starts munged, slurmctld and the slurmds, runs the
command on the head (here the script as documented, from a folder of its
own, its output in ringzero-JOBID.out there), and removes everything after:
no Slurm or munge daemon of the cluster left on the machine, no state or
spool folder, and /etc/slurm/slurm.conf not left pointing at it. The
trained losses are those of the same 4-rank run on one host, bit for bit.
Without munged on the PATH, ``up --slurm`` says so in one line and builds
nothing.
"""
import os
import subprocess
import sys

import cluster_cli as cc
import pytest
import slurm_cli as sc
from trainer_cli import TINY, corpus, losses

pytestmark = pytest.mark.cluster


def _daemons_of(state_dir):
    """pids of live processes whose command line names the cluster's state folder."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if state_dir.encode() in f.read():
                        out.append(int(d))
            except OSError:
                continue
    return out


@pytest.mark.timeout(sc.TIMEOUT + 60)       # it may install Slurm itself (when run alone)
def test_run_form_trains_and_leaves_nothing_behind(tmp_path):
    cc.skip_unless_possible()
    base = TINY + ["--data", corpus(tmp_path / "corpus.txt"), "--stage", "hybrid", "--precision", "fp32",
                "--steps", "3"]
    cmd = [cc.CLUSTER, "--slurm", "--nodes", "2", "--ranks-per-node", "2", "--link", "none", "--prefix", sc.PREFIX,
           "--net", str(sc.NET)]
    install = os.environ.get("RINGZERO_SLURM_INSTALL") == "1"
    if install:
        cmd.append("--install")
    env = {k: v for k, v in cc.env().items() if not k.startswith("SLURM_")}
    env["RINGZERO_VENV"] = sys.prefix
    p = subprocess.run(cmd + ["--", "sbatch", "--wait", sc.SCRIPT, *base, "--metrics", "run.jsonl"], env=env,
                       cwd=tmp_path, capture_output=True, text=True, timeout=280 + (sc.INSTALL_S if install else 0))
    state = os.path.join(sc.STATE, sc.PREFIX)
    if p.returncode != 0 and ("needs Slurm and munge" in p.stderr or "could not install Slurm" in p.stderr):
        cc.skip_or_fail(p.stderr.strip().splitlines()[-1])
    outs = sorted(tmp_path.glob("ringzero-*.out"))
    assert p.returncode == 0 and len(outs) == 1, cc.tail(p) + "".join(o.read_text() for o in outs)
    assert "Slurm is up" in p.stdout, cc.tail(p)
    assert not _daemons_of(state), f"left running: {_daemons_of(state)}"
    assert not os.path.exists(state), os.listdir(state)
    conf = "/etc/slurm/slurm.conf"
    assert not (os.path.islink(conf) and os.readlink(conf).startswith(state)), os.readlink(conf)
    ref = cc.one_host(base + ["--ranks-per-node", "2", "--metrics", "ref.jsonl"], 4, tmp_path)
    assert ref.returncode == 0, cc.tail(ref)
    a, b = losses(tmp_path / "ref.jsonl"), losses(tmp_path / "run.jsonl")
    assert len(a) == 3 and a == b, f"one host {a}\nunder Slurm {b}"


def test_missing_slurm_is_one_line_and_builds_nothing(tmp_path):
    """munged out of reach (a PATH without /usr/sbin, where Debian puts it): one line, exit 2, no node."""
    cc.skip_unless_possible()
    shim = tmp_path / "bin"
    shim.mkdir()
    for c in ("ip", "tc", "unshare"):
        real = subprocess.run(["sh", "-c", f"command -v {c}"], capture_output=True, text=True).stdout.strip()
        os.symlink(real, shim / c)
    env = dict(cc.env(), PATH=f"{shim}:{os.path.dirname(sys.executable)}:/usr/bin:/bin", RINGZERO_VENV=sys.prefix)
    if os.path.exists("/usr/bin/munged"):
        pytest.skip("munged is in /usr/bin here")
    p = subprocess.run([cc.CLUSTER, "up", "--slurm", "--nodes", "2", "--prefix", sc.PREFIX, "--net", str(sc.NET)],
                       env=env, capture_output=True, text=True, timeout=120)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, cc.tail(p)
    assert "--slurm needs Slurm and munge, and 'munged' is missing (add --install" in lines[0], lines
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"{sc.PREFIX}-n" not in ns and not os.path.exists(os.path.join(sc.STATE, sc.PREFIX)), ns
