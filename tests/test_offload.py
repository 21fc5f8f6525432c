"""Offload changes where state lives, never the arithmetic: the engine with and without it, bit for bit.

- bitwise: losses, gradient norms and every state class (gathered by MPI's own
  all-gather of the engine, full_state) equal with and without offload, at every
  stage, fp16 and bf16, K = 1 and 2, overlap on and off; tiles of 1024 elements,
  so pieces cross several tiles and the three slots of the stream wrap;
- ahead: the update on its own thread, unit by unit, beside the next forward, is
  bitwise the blocking update (stage 3, hybrid; an eval and a save wait for it);
- checkpoints: saved from offloaded state, resumed into RAM state and back
  (a resume may switch offload on or off), bitwise the run that never stopped;
- a failure in the middle of an update (an injected ENOSPC in the writer) is one
  OffloadError on every rank, and the newest checkpoint still verifies and resumes;
- the page cache: after a save and after a resume, no page of an offload file nor of this
  rank's checkpoint files is resident (mincore), the update's and the load's writes flushed first;
- accounting: each class's tier and bytes (the file's blocks from fstat), and
  the bytes the files read and wrote in a step beside accounting.offload_io_bytes;
- refusals, before any file exists: a missing DIR, a DIR that is not writable, a
  disk smaller than the state, params offload at a stage that holds params in full.
"""
import os

import numpy as np
import pytest
from conftest import assert_all
from test_zero import batches, tiny_model

pytestmark = pytest.mark.mpi
CLASSES = ("params", "master", "adam_m", "adam_v")


def policy(tmp_path, params=False, **kw):
    from ringzero.runtime.offload import OffloadPolicy
    return OffloadPolicy(optimizer=True, params=params, dir=str(tmp_path), tile=1024, **kw)


def engine(comm, stage, **kw):
    from ringzero.runtime.zero import Zero
    kw.setdefault("seed", 3)
    if stage == "hybrid":
        kw.setdefault("ranks_per_node", 2)
    return Zero(tiny_model(), comm, stage, timeout=60, **kw)


def run(comm, stage, steps=3, start=0, eng=None, **kw):
    """(losses, norms, every class's bytes, engine, updated): updated says that updates ran, as
    updates_ran checks them."""
    eng = eng or engine(comm, stage, **kw)
    data = batches(comm, comm.size, comm.rank)
    losses, norms, skipped = [], [], []
    master0, t0 = eng.full_state("master").tobytes(), eng.adam.t
    for s in range(start, start + steps):
        x, y = data.get(s)
        if eng.grad_accum > 1:
            x, y = np.concatenate([x, x]), np.concatenate([y, y])
        r = eng.step(x, y, 3e-3)
        losses.append(r.loss)
        norms.append(r.grad_norm)
        skipped.append(r.skipped)
    state = {c: eng.full_state(c, eng.state.dtypes[c]).tobytes() for c in CLASSES}
    return losses, norms, state, eng, updates_ran(eng, skipped, t0, master0)


def updates_ran(eng, skipped, t0, master0) -> str:
    """"" when the steps updated the state: some step not skipped by the loss scaler (fp16 skips the
    first steps of a small model while its scale backs off), Adam's step count up by exactly the steps
    that were not skipped, and the master changed; else what is wrong. Compare runs only once it is ""."""
    ran = skipped.count(False)
    if not ran:
        return f"every step skipped (loss scale now {eng.scaler.scale:g}): nothing was compared"
    if eng.adam.t - t0 != ran:
        return f"Adam's step count rose by {eng.adam.t - t0}, but {ran} steps were not skipped"
    if eng.full_state("master").tobytes() == master0:
        return "the master did not change"
    return ""


def skip_hybrid(comm, stage):
    if stage == "hybrid" and (comm.size % 2 or comm.size < 4):
        pytest.skip("hybrid needs an even world size >= 4")


def need_bf16(precision):
    if precision == "bf16":
        pytest.importorskip("ml_dtypes")


@pytest.mark.parametrize("stage", ["0", "1", "2", "3", "hybrid"])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("accum_overlap", [(1, False), (2, True)], ids=["k1-blocking", "k2-overlap"])
def test_offload_optimizer_is_bitwise_ram(comm, stage, precision, accum_overlap, tmp_path):
    skip_hybrid(comm, stage)
    need_bf16(precision)
    k, ov = accum_overlap
    kw = dict(precision=precision, grad_accum=k, overlap=ov)
    ram = run(comm, stage, **kw)
    off = run(comm, stage, offload=policy(tmp_path), **kw)
    tiers = {c: off[3].state.tier(c) for c in CLASSES}
    same = ram[0] == off[0] and ram[1] == off[1] and ram[2] == off[2] and not ram[4] and not off[4]
    assert_all(comm, same and tiers == {"params": "ram", "master": "disk", "adam_m": "disk", "adam_v": "disk"},
               f"stage {stage} {precision} K={k} overlap={ov}: losses {ram[0]} vs {off[0]}, norms {ram[1]} vs "
               f"{off[1]}, classes equal {[ram[2][c] == off[2][c] for c in CLASSES]}, tiers {tiers}; "
               f"updates: RAM {ram[4] or 'ran'}, offloaded {off[4] or 'ran'}")
    off[3].close()


@pytest.mark.parametrize("stage", ["3", "hybrid"])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("accum_overlap", [(1, False), (2, True)], ids=["k1-blocking", "k2-overlap"])
def test_offload_params_is_bitwise_ram(comm, stage, precision, accum_overlap, tmp_path):
    skip_hybrid(comm, stage)
    need_bf16(precision)
    k, ov = accum_overlap
    kw = dict(precision=precision, grad_accum=k, overlap=ov)
    ram = run(comm, stage, **kw)
    off = run(comm, stage, offload=policy(tmp_path, params=True), **kw)
    same = ram[0] == off[0] and ram[1] == off[1] and ram[2] == off[2] and not ram[4] and not off[4]
    ok = same and off[3].state.tier("params") == "disk" and off[3].state.tier("grads") == "ram"
    assert_all(comm, ok, f"stage {stage} {precision} K={k}: losses {ram[0]} vs {off[0]}, classes equal "
                         f"{[ram[2][c] == off[2][c] for c in CLASSES]}; updates: RAM {ram[4] or 'ran'}, "
                         f"offloaded {off[4] or 'ran'}")
    off[3].close()


@pytest.mark.parametrize("stage", ["3", "hybrid"])
@pytest.mark.parametrize("params", [False, True])
@pytest.mark.parametrize("accum_overlap", [(1, False), (2, True)], ids=["k1-blocking", "k2-overlap"])
def test_update_ahead_is_bitwise_blocking(comm, stage, params, accum_overlap, tmp_path):
    """The update on its own thread, unit by unit, beside the next forward (ahead=True): the bits
    of the blocking update; an eval and a checkpoint in between wait for it."""
    from ringzero.runtime import checkpoint as ck
    skip_hybrid(comm, stage)
    k, ov = accum_overlap
    kw = dict(precision="fp32", grad_accum=k, overlap=ov)      # fp32: no step skipped, every update runs ahead
    ram = run(comm, stage, **kw)
    eng = engine(comm, stage, offload=policy(tmp_path, params=params, ahead=True), **kw)
    data = batches(comm, comm.size, comm.rank)
    x, y = data.get(0)
    ahead = run(comm, stage, eng=eng, **kw)
    started = eng.update_ahead is not None
    io = eng.io_report()           # the last finished update's bytes, the last step's params reads
    io_ok = (io["read_bytes_per_step"], io["write_bytes_per_step"]) == (io["read_plan_bytes"], io["write_plan_bytes"])
    ev = eng.eval_loss(x, y) if k == 1 else None                 # waits for the last update (collective)
    d = comm.bcast(str(tmp_path) if comm.rank == 0 else None)
    ck.save(eng, os.path.join(d, f"ck{comm.size}"), 3)
    ok = started and io_ok and ram[:3] == ahead[:3] and not eng.update_ahead
    ok &= ev is None or ev == ram[3].eval_loss(x, y)
    assert_all(comm, ok, f"stage {stage} params={params} K={k}: losses {ram[0]} vs {ahead[0]}, classes equal "
                         f"{[ram[2][c] == ahead[2][c] for c in CLASSES]}; io {io}")
    eng.close()


def test_ahead_needs_the_params_sharded(comm, tmp_path):
    from ringzero.runtime.offload import OffloadError
    try:
        engine(comm, "2", offload=policy(tmp_path, ahead=True))
        err = "no error"
    except OffloadError as e:
        err = str(e)
    assert_all(comm, "needs the params sharded" in err, err)


def test_numpy_update_path_is_bitwise_the_fused_one(comm, tmp_path, monkeypatch):
    """Without the C extension the offloaded update takes the NumPy steps: the same bits."""
    from ringzero.runtime import optim
    fused = run(comm, "3", offload=policy(tmp_path, params=True))
    monkeypatch.setattr(optim, "_c", None)
    plain = run(comm, "3", offload=policy(tmp_path, params=True))
    ok = fused[:3] == plain[:3]
    assert_all(comm, ok, f"numpy path: losses {plain[0]} vs fused {fused[0]}")


def shared_dir(comm, factory, name):
    return comm.bcast(str(factory.mktemp(name)) if comm.rank == 0 else None, root=0)


@pytest.mark.parametrize("stage,params", [("1", False), ("3", True)])
def test_checkpoint_switches_offload_on_and_off(comm, stage, params, tmp_path, tmp_path_factory):
    """Save from offloaded state, resume into RAM; save from RAM, resume into offload: each the run
    that never stopped, bit for bit."""
    from ringzero.runtime import checkpoint as ck
    d1, d2 = shared_dir(comm, tmp_path_factory, "from-disk"), shared_dir(comm, tmp_path_factory, "from-ram")
    ref = run(comm, stage, steps=6)
    a = run(comm, stage, steps=3, offload=policy(tmp_path, params=params))[3]
    ck.save(a, d1, 3)
    b = engine(comm, stage, seed=77)                       # RAM, other weights: the load must matter
    ck.load(b, "latest", d1)
    got_ram = run(comm, stage, steps=3, start=3, eng=b)
    c = run(comm, stage, steps=3)[3]
    ck.save(c, d2, 3)
    e = engine(comm, stage, seed=77, offload=policy(tmp_path, params=params))
    ck.load(e, "latest", d2)
    got_disk = run(comm, stage, steps=3, start=3, eng=e)
    # the reference's last three steps, from a run of six
    ok = got_ram[2] == ref[2] and got_disk[2] == ref[2]
    ok &= got_ram[0] == ref[0][3:] and got_disk[0] == ref[0][3:]
    assert_all(comm, ok, f"stage {stage}: resumed losses {got_ram[0]} / {got_disk[0]} vs {ref[0][3:]}")
    for x in (a, e):
        x.close()


def test_failure_mid_update_leaves_the_checkpoint(comm, tmp_path, tmp_path_factory):
    """An ENOSPC in the writer, in the middle of an update, on one rank: one OffloadError on every rank;
    the checkpoint saved before still verifies and resumes bitwise."""
    from ringzero.runtime import checkpoint as ck
    from ringzero.runtime import offload
    d = shared_dir(comm, tmp_path_factory, "crash")
    a = run(comm, "2", steps=2, offload=policy(tmp_path), precision="fp32")[3]   # no skipped step: an update runs
    path = ck.save(a, d, 2)
    saved = {c: a.full_state(c).tobytes() for c in ("master", "adam_m", "adam_v")}
    a.offload_stream.fault = "enospc" if comm.rank == comm.size - 1 else None   # as RINGZERO_FAULT_OFFLOAD does
    err = None
    try:
        run(comm, "2", steps=1, start=2, eng=a)
    except offload.OffloadError as e:
        err = str(e)
    ok = err is not None and f"rank {comm.size - 1}:" in err and "No space left" in err
    ok &= ck.verify(path, ck.read_manifest(path)) is None
    b = engine(comm, "2", seed=77, offload=policy(tmp_path), precision="fp32")
    ck.load(b, "latest", d)
    ok &= all(b.full_state(c).tobytes() == saved[c] for c in saved)
    assert_all(comm, ok, f"error {err!r}")
    a.close()
    b.close()


def test_write_slot_waits_are_counted(comm, tmp_path, monkeypatch):
    """A slow disk for writes (each tile's write made 20 ms longer): the update waits for slots whose
    write has not returned, and those waits are counted (slot_wait_s), apart from the read waits and
    the last writes, in the exposed I/O they sum to."""
    import time

    from ringzero.runtime import stream
    slow = stream.TileStream._write

    def write(self, *a, **k):
        time.sleep(0.02)
        return slow(self, *a, **k)
    monkeypatch.setattr(stream.TileStream, "_write", write)
    # three slots (depth 1, the default before --offload-depth): with 8 ranks the tiny model has 4 tiles a rank
    eng = run(comm, "3", steps=1, offload=policy(tmp_path, buffers=3), precision="fp32")[3]
    tl, n = eng.timeline, len(eng.offload_tiles)
    parts = tl["offload_read_wait_s"] + tl["offload_slot_wait_s"] + tl["offload_drain_s"]
    # n tiles, 3 slots: n - 3 reads wait for a write; each write holds its slot >= 20 ms
    ok = n > 3 and tl["offload_slot_wait_s"] >= 0.01 * (n - 3) and abs(parts - tl["offload_exposed_s"]) < 1e-9
    assert_all(comm, ok, f"{n} tiles: {({k: v for k, v in tl.items() if k.startswith('offload_')})}")
    eng.close()


def resident_pages(path_or_fd) -> int:
    """Pages of a file in the page cache (mmap + mincore through libc): the kernel's own count."""
    import ctypes
    import mmap
    fd = os.open(path_or_fd, os.O_RDONLY) if isinstance(path_or_fd, str) else path_or_fd
    try:
        n = os.fstat(fd).st_size
        if not n:
            return 0
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        addr = libc.mmap(None, n, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        vec = ctypes.create_string_buffer((n + mmap.PAGESIZE - 1) // mmap.PAGESIZE)
        try:
            assert libc.mincore(addr, n, vec) == 0, os.strerror(ctypes.get_errno())
        finally:
            libc.munmap(addr, n)
        return sum(b & 1 for b in vec.raw)
    finally:
        if isinstance(path_or_fd, str):
            os.close(fd)


def test_page_cache_dropped_after_save_and_resume(comm, tmp_path, tmp_path_factory):
    """The offload files and the checkpoint's own leave no page in the page cache after a save, nor
    after a resume (whose writes are flushed first: DONTNEED drops clean pages only)."""
    from ringzero.runtime import checkpoint as ck
    d = shared_dir(comm, tmp_path_factory, "cache")
    a = run(comm, "3", steps=2, offload=policy(tmp_path, params=True), precision="fp32")[3]
    path = ck.save(a, d, 2)
    mine = [os.path.join(path, f) for f in os.listdir(path) if f.endswith(f"-r{a.state.shard_rank:05d}.bin")]
    after_save = {n: resident_pages(f.fd) for n, f in a.state.files.items()}
    after_save.update({os.path.basename(f): resident_pages(f) for f in mine})
    a.close()
    b = engine(comm, "3", seed=77, offload=policy(tmp_path, params=True), precision="fp32")
    ck.load(b, "latest", d)
    after_load = {n: resident_pages(f.fd) for n, f in b.state.files.items()}
    after_load.update({os.path.basename(f): resident_pages(f) for f in mine})
    b.close()
    ok = len(mine) == 4 and len(after_save) == 8 and not any(after_save.values()) and not any(after_load.values())
    assert_all(comm, ok, f"resident pages after the save {after_save}, after the load {after_load}")


@pytest.mark.parametrize("stage,params", [("0", False), ("2", False), ("3", False), ("3", True)])
def test_tiers_and_io_counters(comm, stage, params, tmp_path):
    """Each class's tier and bytes; the files' read and write counters of one step vs the formula,
    recomputed here from the layout: 12 B per updated element each way (+ params: 4 B (fp32) written,
    and 4 B per element of each gathered run read). fp32: no step is skipped by the loss scaler."""
    eng = engine(comm, stage, offload=policy(tmp_path, params=params), precision="fp32")
    rep = eng.memory_report()
    L, n = eng.layout, comm.size
    e = L.padded if stage == "0" else L.padded // n
    on_disk = {"master_fp32", "adam_m_fp32", "adam_v_fp32"} | ({"params_fp16"} if params else set())
    ok = True
    for c, d in rep["classes"].items():
        disk = c in on_disk
        ok &= d["tier"] == ("disk" if disk else "ram")
        ok &= (d["disk_bytes"] >= d["measured_bytes"]) if disk else (d["ram_bytes"] == d["measured_bytes"])
        ok &= d["measured_bytes"] == d["formula_bytes"]
    run(comm, stage, steps=2, eng=eng)
    io = eng.io_report()
    read, write = 12 * e, 12 * e
    if params:
        write += 4 * e
        read += 4 * sum(L.unit_padded[w] // n for w, a, b in eng.plan.param_runs)
    ok &= (io["read_bytes_per_step"], io["write_bytes_per_step"]) == (read, write)
    ok &= (io["read_plan_bytes"], io["write_plan_bytes"]) == (read, write)
    assert_all(comm, ok, f"stage {stage}: {rep['classes']}; io {io}; expected read {read}, write {write}")
    eng.close()


def test_refusals_before_any_file(comm, tmp_path):
    from ringzero.runtime.offload import OffloadError, OffloadPolicy
    cases = {
        "missing": (dict(dir=str(tmp_path / "nope")), "3", "does not exist"),
        "not-writable": (dict(dir="/proc/self"), "3", "not writable"),
        "params-at-2": (dict(dir=str(tmp_path), params=True), "2", "needs the params sharded"),
    }
    got = {}
    for name, (kw, stage, want) in cases.items():
        try:
            engine(comm, stage, offload=OffloadPolicy(optimizer=True, **kw))
            got[name] = "no error"
        except OffloadError as e:
            got[name] = str(e)
    os.environ["RINGZERO_OFFLOAD_FREE"] = "4096"
    try:
        engine(comm, "3", offload=OffloadPolicy(optimizer=True, dir=str(tmp_path)))
        got["small"] = "no error"
    except OffloadError as e:
        got["small"] = str(e)
    finally:
        del os.environ["RINGZERO_OFFLOAD_FREE"]
    ok = all(want in got[name] for name, (_, _, want) in cases.items())
    ok &= "needs" in got["small"] and "0.0 MiB free" in got["small"] and "\n" not in "".join(got.values())
    ok &= not os.listdir(tmp_path)
    assert_all(comm, ok, f"{got}; left {os.listdir(tmp_path)}")


def test_a_reservation_that_fails_on_one_rank_fails_on_every_rank(comm, tmp_path, monkeypatch):
    """The space was there at the check, then another tenant took it: posix_fallocate fails (ENOSPC)
    on the last rank alone; every rank raises the same one line, none waits in a collective."""
    import errno

    from ringzero.runtime.offload import OffloadError
    if comm.rank == comm.size - 1:
        def full(fd, off, n):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        monkeypatch.setattr(os, "posix_fallocate", full)
    try:
        engine(comm, "3", offload=policy(tmp_path))
        err = "no error"
    except OffloadError as e:
        err = str(e)
    ok = err.startswith(f"rank {comm.size - 1}: making the offload files: --offload-dir ") and "cannot reserve" in err
    assert_all(comm, ok and "No space left on device" in err, err)
