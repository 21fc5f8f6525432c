"""The offload tier of a device run (runtime/host_tier.py), on the strict CuPy stand-in.

- bitwise: a "cuda" engine with the fp32 master, Adam m and v in host memory (pageable: only
  the update's transfer slots are pinned) or in files, against the same engine with everything on the device:
  losses, gradient norms and every state class equal bytes, stages 0-3, fp32 and fp16 (CuPy has
  no bfloat16), K = 1 and 2; tiles of 1024 elements, so pieces cross several tiles and the
  pinned slots wrap (the stand-in refuses a pinned slot reused before its async copy ran);
- where the state lives: params and grads on the device, master/m/v on the host or disk, as the
  memory report counts them; the transfer slots pinned, master, m, v pageable with room to spare;
- checkpoints: saved from the host tier, resumed into a device engine without offload and back,
  bit for bit the run that never stopped;
- the accounting: budget.state_by_tier and memcheck on "cuda" count the offloaded classes off the
  device (the formula written here), and refuse or pass a GPU's free memory accordingly;
- bad input: params offload or --offload-ahead on cuda, a pin limit that does not parse: one line.

What these prove and what not: CuPy's rules (types, streams, events, async copies from pinned
memory) and the host arithmetic; nothing about a real GPU's speed (none was lent).
"""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import cupy_standin  # noqa: E402
from conftest import assert_all  # noqa: E402

pytestmark = pytest.mark.standin
CLASSES = ("params", "grads", "master", "adam_m", "adam_v")
TINY = dict(n_layer=2, n_head=2, n_embd=24, block_size=16, vocab=37)


@pytest.fixture
def cp(monkeypatch):
    return cupy_standin.install(monkeypatch)


def _data(comm):
    from ringzero.app.data import Batches
    data = (np.arange(4096) * 7 % TINY["vocab"]).astype(np.uint8)
    return Batches(data, 2, 16, comm.rank, comm.size, 5)


def _off(where, **kw):
    from ringzero.runtime.offload import OffloadPolicy
    return OffloadPolicy(optimizer=True, device="cuda", tile=1024, dir=where or "", **kw)


def _engine(comm, stage, offload=None, seed=3, **kw):
    from ringzero.nn.gpt import GPT, GPTConfig
    from ringzero.runtime.zero import Zero
    return Zero(GPT(GPTConfig(**TINY)), comm, stage, device="cuda", seed=seed, timeout=60, offload=offload, **kw)


def _steps(comm, cp, eng, a, b):
    data, out = _data(comm), []
    for s in range(a, b):
        x, y = data.get(s)
        if eng.grad_accum > 1:
            x, y = np.concatenate([x, x]), np.concatenate([y, y])
        r = eng.step(cp.asarray(x), cp.asarray(y), 3e-3)
        out.append((r.loss, r.grad_norm, r.skipped))
    return out


def _updated(eng, got, t0, master0) -> str:
    """"" when the steps updated the state (some step not skipped by the fp16 loss scaler, Adam's step
    count up by exactly the steps that were not, the master changed), else what is wrong."""
    ran = [s for _, _, s in got].count(False)
    if not ran:
        return f"every step skipped (loss scale now {eng.scaler.scale:g}): nothing was compared"
    if eng.adam.t - t0 != ran:
        return f"Adam's step count rose by {eng.adam.t - t0}, but {ran} steps were not skipped"
    return "" if eng.full_state("master").tobytes() != master0 else "the master did not change"


def _state(eng):
    return {c: eng.full_state(c, eng.state.dtypes[c]).tobytes() for c in CLASSES if c != "grads"}


@pytest.mark.mpi
@pytest.mark.parametrize("stage", ["0", "1", "2", "3"])
@pytest.mark.parametrize("precision,k", [("fp16", 1), ("fp16", 2), ("fp32", 1)])
@pytest.mark.parametrize("where", ["host", "disk"])
def test_device_offload_is_bitwise_on_device(comm, cp, stage, precision, k, where, tmp_path):
    kw = dict(precision=precision, grad_accum=k)
    ref = _engine(comm, stage, **kw)
    want = _steps(comm, cp, ref, 0, 3)
    # only the transfer slots pinned (the update's grads and params tiles, `buffers` each, of min(tile,
    # the largest piece) elements of the storage dtype: host_tier.DeviceLink); master, m, v pageable even
    # where the limit has room for them (host: a limit of the slots and master; disk: the files)
    from ringzero.runtime.offload import OffloadPolicy
    dev = _engine(comm, stage, None, **kw)
    nslots = 2 * OffloadPolicy().buffers
    slots = nslots * min(1024, max(dev.layout.piece_numel)) * np.dtype(dev.storage_dtype).itemsize
    limit = dev.state.master.nbytes + slots
    eng = _engine(comm, stage, _off(str(tmp_path) if where == "disk" else None, pin_limit=limit), **kw)
    master0, t0 = eng.full_state("master").tobytes(), eng.adam.t
    got = _steps(comm, cp, eng, 0, 3)
    tiers = {c: eng.state.tier(c) for c in CLASSES}
    on = "disk" if where == "disk" else "ram"
    updated = _updated(eng, got, t0, master0)
    ok = got == want and _state(eng) == _state(ref) and not updated
    ok &= tiers == {"params": "device", "grads": "device", "master": on, "adam_m": on, "adam_v": on}
    ok &= all(isinstance(eng.state.bufs[c], np.ndarray) for c in ("master", "adam_m", "adam_v")) or where == "disk"
    rep = eng.memory_report()
    on_device = ("params", "grads") + (("grad_accum",) if k > 1 else ())       # K > 1: its fp32 accumulator
    ok &= rep["tiers"]["device"] == sum(eng.state.bufs[c].nbytes for c in on_device)
    pin = eng.pinned
    if where == "host":
        ok &= all(pin.kinds.get(c) == "pageable" for c in ("master", "adam_m", "adam_v"))
        ok &= pin.pinned == slots and rep["tiers"]["ram"] == 3 * eng.state.master.nbytes
    ok &= sum(v == "pinned" for k, v in pin.kinds.items() if " tile " in k) == nslots
    assert_all(comm, ok, f"stage {stage} {precision} K={k} {where}: {got} vs {want}; tiers {tiers}, "
                         f"pinned {pin.kinds}; updates: {updated or 'ran'}")
    eng.close()


@pytest.mark.mpi
@pytest.mark.parametrize("stage", ["1", "3"])
def test_device_offload_checkpoint_switches_on_and_off(comm, cp, stage, tmp_path_factory):
    """Save from the host tier, resume on the device without offload; save from the device, resume
    into the host tier: each the 6-step run that never stopped, bit for bit."""
    from ringzero.runtime import checkpoint as ck
    d1 = comm.bcast(str(tmp_path_factory.mktemp("from-host")) if comm.rank == 0 else None)
    d2 = comm.bcast(str(tmp_path_factory.mktemp("from-dev")) if comm.rank == 0 else None)
    ref = _engine(comm, stage)
    want = _steps(comm, cp, ref, 0, 6)
    a = _engine(comm, stage, _off(None))
    _steps(comm, cp, a, 0, 3)
    ck.save(a, d1, 3)
    b = _engine(comm, stage, seed=77)
    ck.load(b, "latest", d1)
    got_dev = _steps(comm, cp, b, 3, 6)
    c = _engine(comm, stage)
    _steps(comm, cp, c, 0, 3)
    ck.save(c, d2, 3)
    e = _engine(comm, stage, _off(None), seed=77)
    ck.load(e, "latest", d2)
    master0, t0 = e.full_state("master").tobytes(), e.adam.t
    got_host = _steps(comm, cp, e, 3, 6)
    updated = _updated(e, got_host, t0, master0)     # fp16: the resumed steps of the host tier updated it
    ok = got_dev == want[3:] and got_host == want[3:] and _state(b) == _state(ref) == _state(e) and not updated
    assert_all(comm, ok, f"stage {stage}: resumed {got_dev} / {got_host} vs {want[3:]}; updates: {updated or 'ran'}")


def test_state_by_tier_on_a_device():
    """The formula by hand: on "cuda" the offloaded classes leave the device, for the host or the disk."""
    from ringzero.runtime import budget
    psi, nd = 1 << 20, 4
    for to in ("ram", "disk"):
        t = budget.tier_totals(budget.state_by_tier("3", psi, nd, offload=("optimizer",), device="cuda",
                                                    offload_to=to))
        assert t == {"device": 4 * psi // nd, to: 12 * psi // nd, **({"disk": 0} if to == "ram" else {"ram": 0})}
    t = budget.tier_totals(budget.state_by_tier("0", psi, nd, device="cuda"))
    assert t == {"device": 16 * psi, "ram": 0, "disk": 0}


def test_memcheck_on_a_device_leaves_the_offloaded_classes(cp):
    """memcheck on "cuda" compares the device need with the GPU's free memory: a free figure between
    the need with and without --offload optimizer refuses the one (naming --offload optimizer) and
    passes the other."""
    from ringzero.app import memcheck
    from ringzero.app.config import Config
    from ringzero.nn.gpt import GPT, GPTConfig
    g = GPTConfig(n_layer=4, n_head=4, n_embd=256, block_size=64, vocab=256)
    base = dict(device="cuda", stage="3", batch=1, seq_len=64, sample_chars=0, precision="fp16")
    plain, off = Config(**base), Config(**base, offload="optimizer")
    model = GPT(g)
    full = memcheck.need_of(plain, model, memcheck.base_run(plain, 2, 2))
    less = memcheck.need_of(off, model, memcheck.base_run(off, 2, 2))
    from ringzero.runtime.flat import Layout
    L = Layout(model.units, shards=2)
    # the master, m and v shards (12 bytes a parameter / Nd), and AdamW's scratch, leave the device
    assert full.model_state - less.model_state == 12 * L.shard_numel, (full, less)
    assert full.workspace - less.workspace == 4 * max(L.piece_numel)
    room = (full.total + less.total) // 2
    line = memcheck.verdict(plain, model, [room, room], [0, 0], 2)
    assert line and "GPU has" in line and "HINT: --offload optimizer" in line, line
    assert memcheck.verdict(off, model, [room, room], [0, 0], 2) is None


def test_device_offload_bad_input_one_line(cp, tmp_path):
    from ringzero.app.config import ConfigError, parse_config
    from ringzero.runtime.host_tier import parse_pin_limit
    cases = [(["--stage", "3", "--offload", "optimizer,params"], "--offload params runs on --device cpu only"),
             (["--stage", "3", "--offload", "optimizer", "--offload-ahead"], "--offload-ahead runs on --device cpu"),
             (["--offload", "optimizer", "--offload-pin-limit", "lots"], "--offload-pin-limit"),
             (["--offload", "optimizer", "--offload-pin-limit", "-1G"], "--offload-pin-limit")]
    for args, want in cases:
        with pytest.raises(ConfigError) as e:
            parse_config(["--device", "cuda", *args])
        msg = str(e.value)
        assert want in msg and "\n" not in msg, (args, msg)
    assert parse_pin_limit("0") == 0 and parse_pin_limit("512MiB") == 512 << 20
    cfg, _ = parse_config(["--device", "cuda", "--offload", "optimizer", "--offload-pin-limit", "1G"])
    from ringzero.app.policies import offload_policy
    pol = offload_policy(cfg)
    assert pol.pin_limit == 1 << 30 and pol.where == "ram" and pol.in_host_memory("master")


@pytest.mark.mpi
def test_trainer_offloads_to_the_host_on_device(comm, cp, capsys, tmp_path_factory):
    """python -m ringzero.train --device cuda --offload optimizer: trains, and its start report puts
    master, m and v in RAM (pinned up to the limit), params and grads on the device."""
    from ringzero.app import train
    d = comm.bcast(str(tmp_path_factory.mktemp("tr")) if comm.rank == 0 else None)
    cfg, _ = train.parse_config(["--device", "cuda", "--steps", "3", "--n-layer", "1", "--n-embd", "32",
                                 "--n-head", "2", "--seq-len", "16", "--batch", "2", "--eval-interval", "0",
                                 "--eval-batches", "1", "--sample-chars", "0", "--stage", "3",
                                 "--offload", "optimizer", "--offload-pin-limit", "64KiB",
                                 "--save-every", "2", "--save-dir", d])
    summ = train.run(cfg, comm)
    out = capsys.readouterr().out
    ok = np.isfinite(summ["train_loss"])
    if comm.rank == 0:
        rows = {ln.split()[0]: ln.split() for ln in out.splitlines() if ln.startswith("  ") and "MiB" in ln}
        ok &= "offload optimizer in host memory" in out and "(limit 0.06 MiB), pageable" in out
        ok &= rows["master_fp32"][5] == "ram" and rows["params_fp16"][5] == "device"
    assert_all(comm, ok, out[-3000:])


def test_pinning_refused_by_the_driver_falls_back_to_pageable(cp, monkeypatch):
    """cudaHostAlloc failing (the host's locked-memory limit): the array is pageable, counted so."""
    from ringzero.runtime.host_tier import PinnedArena

    def refuse(nbytes):
        raise MemoryError("out of memory to allocate pinned memory")
    arena = PinnedArena(1 << 20)
    a = arena.zeros(1000, np.float32, "master")
    monkeypatch.setattr(cp.cuda, "alloc_pinned_memory", refuse)
    b = arena.zeros(1000, np.float32, "adam_m")
    assert arena.kinds == {"master": "pinned", "adam_m": "pageable"} and (arena.pinned, arena.pageable) == (4000, 4000)
    assert not a.any() and not b.any() and a.size == b.size == 1000


def test_bad_device_offload_flags_one_line_exit_2():
    """On the command line, before any mpirun or CuPy: one line, exit 2."""
    import subprocess
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
    for args, want in ((["--offload", "optimizer,params", "--stage", "3"], "--offload params runs on --device cpu"),
                       (["--offload", "optimizer", "--offload-pin-limit", "2X"], "--offload-pin-limit: ")):
        p = subprocess.run([sys.executable, "-m", "ringzero.train", "--device", "cuda", "--steps", "1", *args],
                           capture_output=True, text=True, timeout=120, env=env)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1 and want in lines[0], p.stderr


def test_mem_budget_on_a_device_counts_device_memory():
    """--mem-budget on "cuda": 16Ψ/Nd at stage 3 is over a budget between 4Ψ/Nd and 16Ψ/Nd; with
    the optimizer in host memory 4Ψ/Nd stays on the device and fits (the formula written here)."""
    from ringzero.runtime.flat import Layout, ParamSpec, Unit
    from ringzero.runtime.state import MemoryBudgetError, check_budget
    nd = 4
    L = Layout((Unit("u", (ParamSpec("w", (1000, 1000)),)),), shards=nd)
    budget_ = 8 * L.padded // nd
    with pytest.raises(MemoryBudgetError) as e:
        check_budget(L, "3", nd, budget_, device="cuda")
    assert f"needs {16 * L.padded // nd / 2**20:.1f} MiB of model state per rank in device memory" in str(e.value)
    check_budget(L, "3", nd, budget_, offload=("optimizer",), device="cuda", offload_to="ram")
    with pytest.raises(MemoryBudgetError) as e:
        check_budget(L, "3", nd, 3 * L.padded // nd, offload=("optimizer",), device="cuda", offload_to="ram")
    assert f"{12 * L.padded // nd / 2**20:.1f} MiB more in host memory" in str(e.value), str(e.value)


@pytest.mark.mpi
@pytest.mark.parametrize("where", ["host", "disk"])
def test_device_offload_hybrid_is_bitwise_on_device(comm, cp, where, tmp_path):
    """Hybrid (sharded within a node, replicated across): the host tier gives the device run's bits."""
    kw = dict(precision="fp16", ranks_per_node=1 if comm.size % 2 else 2)
    ref = _engine(comm, "hybrid", **kw)
    want = _steps(comm, cp, ref, 0, 3)
    eng = _engine(comm, "hybrid", _off(str(tmp_path) if where == "disk" else None), **kw)
    got = _steps(comm, cp, eng, 0, 3)
    on = "disk" if where == "disk" else "ram"
    ok = got == want and _state(eng) == _state(ref) and eng.state.tier("master") == on
    assert_all(comm, ok, f"hybrid {where}: {got} vs {want}")
    eng.close()


def test_memcheck_on_a_device_checks_the_host_tier_against_the_host():
    """The host tier's bytes (12Ψ/Nd of master, m, v, plus the larger of the initial fp32 copy, 4Ψ/Nd,
    and the update's buffers, written out here) against a node's MemAvailable: refused one line
    under it, with --offload-dir as the hint; passed above it."""
    from ringzero.app import memcheck
    from ringzero.app.config import Config
    from ringzero.nn.gpt import GPT, GPTConfig
    from ringzero.runtime.flat import Layout
    from ringzero.runtime.limits import Room
    model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=256, block_size=64, vocab=256))
    cfg = Config(device="cuda", stage="3", batch=1, seq_len=64, sample_chars=0, precision="fp16", offload="optimizer")
    L = Layout(model.units, shards=2)
    piece = max(L.piece_numel)
    # the update's buffers: grads and params slots, --offload-depth 2 + 2 = 4 of each (host_tier.DeviceLink)
    want = 12 * L.shard_numel + max(4 * L.shard_numel, 2 * 4 * min(1 << 18, piece) * 2 + 4 * piece)
    assert memcheck.host_tier_need(cfg, model, memcheck.base_run(cfg, 2, 2)) == want

    def room(avail):
        return Room(avail, None, None, 0)
    line = memcheck.host_verdict(cfg, model, [room(2 * want - 1)] * 2, [0, 0], 2)
    assert line and "this node's 2 ranks need" in line and "MemAvailable is" in line and "--offload-dir" in line
    assert "\n" not in line
    assert memcheck.host_verdict(cfg, model, [room(2 * want)] * 2, [0, 0], 2) is None
