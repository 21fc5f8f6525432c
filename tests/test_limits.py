"""runtime/limits.py against values set here: fake /proc and cgroup files, RLIMIT_DATA set in a subprocess
(by resource.setrlimit and by the real prlimit), and a MemoryError the kernel forces.

Serial. The references are the numbers each test writes or sets itself, never the readers' own output.
"""
import os
import subprocess
import sys
import textwrap

from ringzero.runtime import limits

MiB = 2**20


def test_meminfo_and_status_parsing(tmp_path):
    mi = tmp_path / "meminfo"
    mi.write_text("MemTotal:       25165824 kB\nMemFree:         1000000 kB\nMemAvailable:   20312340 kB\n")
    assert limits.mem_available(str(mi)) == 20312340 * 1024
    mi.write_text("MemTotal: 1 kB\n")                  # an old kernel without the line
    assert limits.mem_available(str(mi)) is None
    st = tmp_path / "status"
    st.write_text("Name:\tpython\nVmPeak:\t  900000 kB\nVmData:\t  254321 kB\nVmStk:\t132 kB\n")
    assert limits.data_in_use(str(st)) == 254321 * 1024
    assert limits.mem_available(str(tmp_path / "absent")) is None


def _cg(d, **files):
    os.makedirs(d, exist_ok=True)
    for k, v in files.items():
        with open(os.path.join(d, k.replace("_", ".", 1)), "w") as f:
            f.write(v)


def test_cgroup_v2_tightest_ancestor(tmp_path):
    root = str(tmp_path / "cg")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/jobs/job7/step0\n")
    # the job's parent limits at 8 GiB with 2 GiB used; the step itself at 6 GiB with 5 GiB used,
    # 512 MiB of it inactive page cache: the step's room is 6 - 5 + 0.5 = 1.5 GiB, the tightest
    _cg(os.path.join(root, "jobs", "job7"), memory_max=str(8 << 30), memory_current=str(2 << 30),
        memory_stat="anon 1\ninactive_file 0\n")
    _cg(os.path.join(root, "jobs", "job7", "step0"), memory_max=str(6 << 30), memory_current=str(5 << 30),
        memory_stat=f"anon 5\ninactive_file {512 * MiB}\nactive_file 9\n")
    _cg(os.path.join(root, "jobs"), memory_max="max\n", memory_current="1\n")
    room, lim, where = limits.cgroup_room(str(proc), root)
    assert (room, lim) == ((6 << 30) - (5 << 30) + 512 * MiB, 6 << 30)
    assert where.startswith(os.path.join(root, "jobs", "job7", "step0", "memory.max"))


def test_cgroup_v1_and_unlimited(tmp_path):
    root = str(tmp_path / "cg")
    proc = tmp_path / "cgroup"
    proc.write_text("9:pids:/x\n4:memory:/box/inner\n0::/\n")
    # v1 under root/memory; the unlimited value is 2^63 rounded down to a page
    _cg(os.path.join(root, "memory"), memory_limit_in_bytes="9223372036854771712\n")
    _cg(os.path.join(root, "memory", "box", "inner"), memory_limit_in_bytes=str(3 << 30),
        memory_usage_in_bytes=str(1 << 30), memory_stat="total_inactive_file 0\n")
    assert limits.cgroup_room(str(proc), root)[:2] == (2 << 30, 3 << 30)
    proc.write_text("4:memory:/free\n")
    _cg(os.path.join(root, "memory", "free"), memory_limit_in_bytes="9223372036854771712\n")
    assert limits.cgroup_room(str(proc), root) is None


def test_room_env_cap_and_describe(monkeypatch):
    monkeypatch.setenv(limits.MEM_AVAILABLE_ENV, "3GiB")
    r = limits.Room.read()
    assert r.mem_available <= 3 << 30 and r.node_room <= 3 << 30
    fake = limits.Room(mem_available=10 << 30, cgroup=(2 << 30, 4 << 30, "/cg/memory.max 4,096.0 MiB"),
                       rlimit=500 * MiB, data_used=250 * MiB)
    assert fake.node_room == 2 << 30 and fake.rank_room == 250 * MiB
    assert "the memory cgroup leaves 2,048.0 MiB" in fake.describe_node()
    assert fake.describe_rank() == "RLIMIT_DATA leaves 250.0 MiB (limit 500.0 MiB, 250.0 MiB in use)"


READ = "from ringzero.runtime import limits; print(limits.rlimit_data(), limits.data_in_use())"


def test_rlimit_data_set_by_setrlimit_and_by_the_prefix():
    code = ("import resource; resource.setrlimit(resource.RLIMIT_DATA, (1234567168, resource.RLIM_INFINITY)); "
            + READ)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert int(out[0]) == 1234567168 and int(out[1]) > 0
    # prlimit --data=700M, or the shell's ulimit -d where this prlimit cannot run
    out = subprocess.run(limits.data_limit_prefix(700 * MiB) + [sys.executable, "-c", READ],
                         capture_output=True, text=True, check=True).stdout.split()
    assert int(out[0]) == 700 * MiB
    out = subprocess.run([sys.executable, "-c", READ], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "None" or int(out[0]) > 700 * MiB


def test_allocation_failure_names_buffer_bytes_and_limit():
    """A real MemoryError under a small RLIMIT_DATA: ShardedState's one line names the buffer and its bytes."""
    code = textwrap.dedent("""
        import resource, numpy as np
        from ringzero.runtime import limits
        from ringzero.runtime.flat import Layout, ParamSpec, Unit
        from ringzero.runtime.policy import StagePolicy
        from ringzero.runtime.state import ShardedState
        L = Layout((Unit("u", (ParamSpec("w", (4096, 4096)),)),), shards=1)   # 16.8M elements
        lim = limits.data_in_use() + 100 * 2**20                               # 100 MiB more than now
        resource.setrlimit(resource.RLIMIT_DATA, (lim, resource.RLIM_INFINITY))
        try:
            ShardedState(L, StagePolicy.of("0"), 0, np.float16, np)
        except limits.AllocationError as e:
            print("LINE", e)
            print("LIM", lim)
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "Traceback" not in p.stderr, p.stderr
    line = next(x for x in p.stdout.splitlines() if x.startswith("LINE "))
    lim = int(next(x for x in p.stdout.splitlines() if x.startswith("LIM ")).split()[1])
    n = 4096 * 4096
    # fp16 params (32 MiB) and grads (32 MiB) fit the 100 MiB; the fp32 master (64 MiB) does not
    assert "cannot allocate master (16,777,216 x float32)" in line, line
    assert f"({4 * n:,} B)" in line and "64.0 MiB" in line, line
    assert f"limit {lim / 2**20:,.1f} MiB" in line and "RLIMIT_DATA" in line, line
    assert "\n" not in line
