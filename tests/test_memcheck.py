"""The trainer's memory check and allocation failures, under a limit the kernel enforces (prlimit --data).

Each case is a real ``mpirun -n N prlimit --data=... python -m mpi4py -m ringzero.train``
(or the shell's ``ulimit -d`` where prlimit cannot run: limits.data_limit_prefix) job (trainer_cli
reads every rank's own exit code):
- the issue's case: stage 0 of an 8 x 512 GPT at Nd = 4 under 500M per rank is refused in one line with
  both numbers and a hint; the run the hint names then trains under the same limit (the kernel is the
  judge of the estimate, not the code under test);
- the same run with the check off (--no-mem-check): the allocation fails in the kernel, and each rank it
  fails on prints one line naming the buffer, its bytes and the limit, exit 4, no traceback.
- an --offload-dir on tmpfs (/dev/shm here, found by statfs f_type) counts its files as the node's
  memory: a node room between the need with the files on a disk and with them on tmpfs passes the disk
  folder and refuses the tmpfs one with a line naming it, in the check's arithmetic and in a real job.
  A run that fits says so in its report.
Serial (each job starts its own mpirun).
"""
import os
import re
import subprocess

import pytest
import trainer_cli as cli

from ringzero.runtime import limits
from ringzero.runtime.limits import Room
from ringzero.sizes import parse_size

MODEL = ["--n-layer", "8", "--n-head", "8", "--n-embd", "512", "--seq-len", "32", "--batch", "2",
         "--eval-batches", "1", "--sample-chars", "0", "--quiet", "--eval-interval", "0", "--warmup", "1"]
LIMIT = "500M"

def _run(args, tmp_path, n):
    cmd = cli.command(args, n)
    i = cmd.index("sh")                     # each rank: prlimit --data=... (or ulimit -d) sh -c 'python ...'
    cmd[i:i] = limits.data_limit_prefix(parse_size(LIMIT))
    p = subprocess.Popen(cmd, cwd=tmp_path, env=cli._clean_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    return cli.finish(p)


def test_refused_up_front_then_the_hint_trains(tmp_path):
    data = cli.corpus(tmp_path / "corpus.txt")
    base = MODEL + ["--data", data, "--steps", "2"]
    rcs, out, err = _run(base + ["--stage", "0"], tmp_path, 4)
    assert rcs == {r: 2 for r in range(4)}, cli.tail(out, err)
    ours = [ln for ln in err.splitlines() if ln.startswith("ringzero")]
    assert len(ours) == 1 and "Traceback" not in err + out, cli.tail(out, err)
    line = ours[0]
    m = re.search(r"stage 0 needs ([\d,.]+) MiB per rank .* RLIMIT_DATA leaves ([\d,.]+) MiB "
                  r"\(limit 500\.0 MiB, ([\d,.]+) MiB in use\)", line)
    assert m, line
    need, room, used = (float(g.replace(",", "")) for g in m.groups())
    assert need > room and abs(room + used - 500) < 0.2, line
    hint = re.search(r"HINT: (.*?) fits", line)
    assert hint and "nodes" not in hint.group(1), line
    flags = hint.group(1).split()
    rcs, out, err = _run(base + ["--stage", "0"] + flags, tmp_path, 4)
    assert rcs == {r: 0 for r in range(4)}, f"the hint {flags} did not train under {LIMIT}:\n" + cli.tail(out, err)


def test_allocation_failure_one_line_per_rank(tmp_path):
    data = cli.corpus(tmp_path / "corpus.txt")
    rcs, out, err = _run(MODEL + ["--data", data, "--steps", "2", "--stage", "0", "--no-mem-check"], tmp_path, 2)
    lines = [ln for ln in err.splitlines() if ln.startswith("ringzero")]
    assert lines and "Traceback" not in err + out, cli.tail(out, err)
    assert set(rcs.values()) <= {4} and 4 in rcs.values(), cli.tail(out, err)   # others: ended by mpirun
    for ln in lines:
        assert re.match(r"ringzero\.train: error: rank \d: cannot allocate ((params|grads|master|adam_m|adam_v) "
                        r"\([\d,]+ x float(16|32)\)|the initial weights .*?): [\d,.]+ MiB \([\d,]+ B\); "
                        r"RLIMIT_DATA leaves", ln), ln
        assert "limit 500.0 MiB" in ln


# ---- an --offload-dir held in memory (tmpfs, ramfs) ------------------------------------------------
SHM = "/dev/shm"
OFF = ["--stage", "3", "--offload", "optimizer", "--sample-chars", "0", "--batch", "1", "--seq-len", "32"]


def _shm_dir(tmp_path):
    from ringzero.runtime.offload import memory_fs
    if not os.path.isdir(SHM) or memory_fs(SHM) != "tmpfs":
        pytest.skip(f"no tmpfs at {SHM} (stat -f {SHM})")
    d = os.path.join(SHM, f"rz-test-{os.getpid()}-{tmp_path.name}")
    os.makedirs(d, exist_ok=True)
    return d


def _needs(tmp_path, shm):
    from ringzero.app import memcheck
    from ringzero.app.config import gpt_config, parse_config
    from ringzero.nn.gpt import GPT
    cfgs = {}
    for name, d in (("disk", str(tmp_path)), ("shm", shm)):
        cfgs[name], _ = parse_config(MODEL + OFF + ["--offload-dir", d])
    model = GPT(gpt_config(cfgs["disk"], 256))
    needs = {k: memcheck.need_of(c, model, memcheck.base_run(c, 2, 2)) for k, c in cfgs.items()}
    return memcheck, cfgs, model, needs


def test_tmpfs_offload_dir_counts_as_memory(tmp_path):
    from ringzero.runtime.flat import Layout
    from ringzero.runtime.offload import memory_fs
    shm = _shm_dir(tmp_path)
    try:
        assert memory_fs(str(tmp_path)) is None or pytest.skip(f"{tmp_path} is itself in memory")
        memcheck, cfgs, model, needs = _needs(tmp_path, shm)
        disk, mem = needs["disk"], needs["shm"]
        L = Layout(model.units, shards=2)
        # master, m, v (fp32) of this rank's shard: 12 bytes a parameter / Nd, in files either way
        assert disk.disk == mem.disk == 12 * L.shard_numel and disk.shm == 0 and mem.shm == mem.disk
        assert mem.node(2) - disk.node(2) == 2 * mem.disk and mem.total == disk.total   # the node's, not a rank's
        room = Room(mem_available=(disk.node(2) + mem.node(2)) // 2, cgroup=None, rlimit=None, data_used=0)
        assert memcheck.verdict(cfgs["disk"], model, [room, room], [0, 0], 2) is None
        line = memcheck.verdict(cfgs["shm"], model, [room, room], [0, 0], 2)
        assert line and f"--offload-dir {shm}, a tmpfs (memory, not disk)" in line and "MemAvailable" in line, line
    finally:
        os.rmdir(shm)


def test_tmpfs_offload_dir_refused_by_the_trainer(tmp_path):
    """A real job: the same room (RINGZERO_MEM_AVAILABLE) refuses the tmpfs folder in one line naming it."""
    shm = _shm_dir(tmp_path)
    try:
        _, _, _, needs = _needs(tmp_path, shm)
        room = (needs["disk"].node(2) + needs["shm"].node(2)) // 2
        data = cli.corpus(tmp_path / "corpus.txt")
        args = MODEL + OFF + ["--data", data, "--steps", "1", "--offload-dir", shm]
        rcs, out, err = cli.run(args, tmp_path, env={"RINGZERO_MEM_AVAILABLE": str(room)})
        ours = [ln for ln in err.splitlines() if ln.startswith("ringzero")]
        assert rcs == {0: 2, 1: 2} and len(ours) == 1, cli.tail(out, err)
        assert "a tmpfs (memory, not disk): counted in the node's memory" in ours[0], ours[0]
        assert os.listdir(shm) == [] and "Traceback" not in err
        # a run that fits says where its files are
        rcs, out, err = cli.run(cli.TINY + ["--data", data, "--steps", "1", "--stage", "3", "--offload", "optimizer",
                                            "--offload-dir", shm], tmp_path)
        assert rcs == {0: 0, 1: 0}, cli.tail(out, err)
        assert f"note: {shm} is a tmpfs: the offloaded files are held in memory, not on disk" in out, out
    finally:
        os.rmdir(shm)


def test_offload_delay_buffer_is_counted(tmp_path):
    """--offload-delay's buffer (runtime/delay.py): the storage dtype x Ψ/Nd more in RAM, nothing else."""
    from ringzero.app import memcheck
    from ringzero.app.config import gpt_config, parse_config
    from ringzero.nn.gpt import GPT
    from ringzero.runtime.flat import Layout
    base = MODEL + OFF + ["--offload-dir", str(tmp_path), "--precision", "bf16"]
    off, _ = parse_config(base)
    on, _ = parse_config(base + ["--offload-delay", "2"])
    model = GPT(gpt_config(off, 256))
    a, b = (memcheck.need_of(c, model, memcheck.base_run(c, 2, 2)) for c in (off, on))
    assert b.model_state - a.model_state == 2 * Layout(model.units, shards=2).shard_numel > 0
    assert (b.workspace, b.activations, b.disk) == (a.workspace, a.activations, a.disk)
