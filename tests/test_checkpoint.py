"""Sharded checkpoints against independent references.

- resume: the run that never stopped is the reference (losses and master, bitwise);
- reshard: the global state gathered by the engine's own all-gather
  (``full_state``) before the save equals the one gathered after the load,
  parameter by parameter (the two layouts pad differently);
- kill mid-save: a real mpirun whose rank 1 dies with os._exit mid-write;
- damage: flipped byte, truncated file, missing file, another model, a bad
  layout -> one clear error on every rank, engine buffers untouched;
- export: safetensors' own loader against ``full_state("master")`` and the
  engine's fp16 params.
"""
import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from conftest import assert_all

TINY = dict(n_layer=2, n_head=2, n_embd=24, block_size=16, vocab=37)   # Ψ not divisible by 2, 3, 4, 8
B, T = 2, 16


def tiny_model(**over):
    from ringzero.nn.gpt import GPT, GPTConfig
    return GPT(GPTConfig(**dict(TINY, **over)))


DATA = np.random.default_rng(0).integers(0, TINY["vocab"], 4096).astype(np.uint8)


def batches(rank, world, b=B, seed=5):
    from ringzero.app.data import Batches
    return Batches(DATA, b, T, rank, world, seed)


def engine(comm, stage, seed=3, scaler=None, **kw):
    from ringzero.runtime.optim import LossScaler
    from ringzero.runtime.zero import Zero
    # a scaler that grows every 3 clean steps: its state must survive a resume
    scaler = scaler or LossScaler(init=2.0 ** 10, growth_interval=3)
    return Zero(tiny_model(**kw.pop("model", {})), comm, stage, seed=seed, timeout=60, scaler=scaler, **kw)


def train(eng, data, start, stop, lr=3e-3):
    return [eng.step(*data.get(s), lr) for s in range(start, stop)]


def shared_dir(comm, factory, name="ckpt"):
    """One directory for all ranks: rank 0's, broadcast."""
    return comm.bcast(str(factory.mktemp(name)) if comm.rank == 0 else None, root=0)


def by_name(layout, full):
    """{param: real elements} of a full flat buffer (padding dropped)."""
    return {n: full[s.offset:s.offset + s.spec.numel].copy() for n, s in layout.slots.items()}


# ------------------------------------------------------------------ resume
@pytest.mark.mpi
@pytest.mark.parametrize("stage", ["0", "3"])      # HYBRID save/load: test_reshard
def test_resume_bitwise(comm, stage, tmp_path_factory):
    from ringzero.runtime import checkpoint as ck
    d = shared_dir(comm, tmp_path_factory)
    data = batches(comm.rank, comm.size)
    a = engine(comm, stage)
    first = train(a, data, 0, 10)
    path = ck.save(a, d, 10, config={"stage": stage}, data_state={"step": 10, "seed": 5}, keep=2)
    ref = train(a, data, 10, 20)                         # the run that never stopped
    ref_master = a.full_state("master")
    b = engine(comm, stage, seed=77)                     # other initial weights: the load must matter
    m = ck.load(b, "latest", d)
    got = train(b, data, 10, 20)
    ok = [r.loss for r in got] == [r.loss for r in ref] and np.array_equal(b.full_state("master"), ref_master)
    ok &= [r.loss_scale for r in got] == [r.loss_scale for r in ref]
    taken = sum(not r.skipped for r in first)           # Adam t counted independently
    meta = (m["step"], m["adam"]["t"], m["data"], m["config"], m["path"])
    ok_meta = meta == (10, taken, {"step": 10, "seed": 5}, {"stage": stage}, path)
    ok_meta &= path == os.path.join(d, "step-000010")
    assert_all(comm, ok, f"stage {stage}: resumed losses {[r.loss for r in got][-2:]} vs {[r.loss for r in ref][-2:]}")
    assert_all(comm, ok_meta, f"manifest {meta}, expected step 10, t {taken}")


# ----------------------------------------------------------------- reshard
RESHARD = [  # (Nd a, stage a) -> (Nd b, stage b); 0 = the world size
    (4, "3", 2, "1"), (2, "2", 3, "3"), (3, "1", 1, "0"),
    (0, "3", 0, "1"), (0, "0", 0, "3"), (0, "hybrid", 0, "2"),
]


@pytest.mark.mpi
@pytest.mark.parametrize("case", RESHARD, ids=lambda c: f"{c[0] or 'n'}s{c[1]}-{c[2] or 'n'}s{c[3]}")
def test_reshard(comm, case, tmp_path_factory):
    from mpi4py import MPI

    from ringzero.runtime import checkpoint as ck
    a, sa, b, sb = case
    a, b = a or comm.size, b or comm.size
    if comm.size < max(a, b):
        pytest.skip(f"needs world size >= {max(a, b)}")
    kwa = {}
    if sa == "hybrid":
        if comm.size % 2 or comm.size < 4:
            pytest.skip("hybrid needs an even world size >= 4")
        kwa["ranks_per_node"] = 2
    d = shared_dir(comm, tmp_path_factory)
    G = 2 * math.lcm(a, b)                                 # one global batch, divisible by a and b

    def group(k):
        return comm.Split(0 if comm.rank < k else MPI.UNDEFINED, comm.rank)

    # Each side catches its own failure, so ranks outside a group never wait
    # in a collective that a failed rank skipped: every rank reaches assert_all.
    saved, ref, err = None, None, None
    ca = group(a)
    if ca != MPI.COMM_NULL:
        try:
            ea = engine(ca, sa, **kwa)
            da = batches(ca.rank, a, G // a)
            train(ea, da, 0, 4)
            ck.save(ea, d, 4)
            saved = {c: by_name(ea.layout, ea.full_state(c)) for c in ("master", "adam_m", "adam_v")}
            ref = [r.loss for r in train(ea, da, 4, 7)]
        except Exception as x:
            err = f"saving at Nd {a}: {type(x).__name__}: {x}"
    saved, ref = comm.bcast((saved, ref), root=0)
    comm.Barrier()
    ok, msg = err is None, err or ""
    cb = group(b)
    if cb != MPI.COMM_NULL and saved is not None:
        try:
            eb = engine(cb, sb, seed=77)
            for c in saved:                                    # an engine holding anything at all
                eb.bufs[c][...] = np.nan
            m = ck.load(eb, os.path.join(d, "step-000004"))
            bad = [(c, n) for c in saved for n, v in by_name(eb.layout, eb.full_state(c)).items()
                   if not np.array_equal(v, saved[c][n])]
            got = [r.loss for r in train(eb, batches(cb.rank, b, G // b), 4, 7)]
            same_sum = a == b and "hybrid" not in (sa, sb)   # same Nd: the stages are bitwise equal
            close = got == ref if same_sum else np.allclose(got, ref, rtol=2e-3, atol=2e-3)
            # padding loads as zeros; the fp16 params are cast(master) again
            full = {c: eb.full_state(c) for c in saved}
            pad = np.ones(eb.layout.padded, bool)
            for s in eb.layout.slots.values():
                pad[s.offset:s.offset + s.spec.numel] = False
            zeros = all(np.array_equal(v[pad], np.zeros(pad.sum(), np.float32)) for v in full.values())
            ok = not bad and close and m["shards"] == (2 if sa == "hybrid" else a) and zeros
            ok &= np.array_equal(eb.full_params(np.float16), full["master"].astype(eb.storage_dtype))
            msg = f"Nd {a} s{sa} -> Nd {b} s{sb}: differ in {bad[:3]}; padding zero {zeros}; losses {got} vs {ref}"
        except Exception as x:
            ok, msg = False, f"loading at Nd {b}: {type(x).__name__}: {x}"
    elif cb != MPI.COMM_NULL:
        ok, msg = False, msg or "nothing was saved"
    comm.Barrier()
    assert_all(comm, ok, msg)


# --------------------------------------------------------------- damage
def _damage(src, dst, how, nd):
    shutil.copytree(src, dst)
    victim = os.path.join(dst, f"adam_v-r{nd - 1:05d}.bin")
    if how == "flip":
        with open(victim, "r+b") as f:
            f.seek(os.path.getsize(victim) // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x10]))
    elif how == "truncate":
        with open(victim, "r+b") as f:
            f.truncate(os.path.getsize(victim) - 4)
    elif how == "missing":
        os.remove(victim)
    elif how == "layout":
        mf = os.path.join(dst, "manifest.json")
        m = json.load(open(mf))
        m["layout"]["units"][1]["padded"] += 32 * m["shards"]
        json.dump(m, open(mf, "w"))
    elif how == "malformed":
        mf = os.path.join(dst, "manifest.json")
        m = json.load(open(mf))
        del m["scaler"]["hyst"]
        json.dump(m, open(mf, "w"))
    elif how == "manifest":
        os.remove(os.path.join(dst, "manifest.json"))
    return victim


@pytest.mark.mpi
def test_damage_is_caught_before_anything_changes(comm, tmp_path_factory):
    from ringzero.runtime import checkpoint as ck
    d = shared_dir(comm, tmp_path_factory)
    e = engine(comm, "2")
    train(e, batches(comm.rank, comm.size), 0, 2)
    src = ck.save(e, d, 2)
    fresh = engine(comm, "3", seed=77)
    before = {k: v.copy() for k, v in fresh.bufs.items()}
    want = {"flip": "corrupt: sha256", "truncate": "truncated: expected", "missing": "missing",
            "layout": "layout mismatch", "malformed": "malformed manifest (KeyError: 'hyst')",
            "manifest": "not a checkpoint"}
    for how, word in want.items():
        dst = os.path.join(d, f"damaged-{how}")
        victim = _damage(src, dst, how, e.layout.shards) if comm.rank == 0 else None   # plain file ops
        victim = comm.bcast(victim, root=0)
        try:
            ck.load(fresh, dst)
            err = None
        except ck.CheckpointError as x:
            err = str(x)
        errs = comm.allgather(err)
        names = victim if how in ("flip", "truncate", "missing") else "manifest.json"
        ok = err is not None and word in err and names in err and "\n" not in err
        ok &= len(set(errs)) == 1                                   # the same line on every rank
        ok &= all(np.array_equal(before[k], v) for k, v in fresh.bufs.items())
        assert_all(comm, ok, f"{how}: got {err!r}, expected '{word}' naming {names}")
    # a checkpoint of another model
    other = engine(comm, "2", model={"n_embd": 32})
    try:
        ck.load(other, src)
        err = None
    except ck.CheckpointError as x:
        err = str(x)
    assert_all(comm, err is not None and "another model" in err and "(37, 24)" in err, f"other model: {err!r}")


@pytest.mark.mpi
def test_save_failure_on_one_rank_raises_everywhere(comm, tmp_path_factory, monkeypatch):
    """A rank that cannot write: every rank raises, the temp dir is gone, the last checkpoint stays."""
    from ringzero.runtime import checkpoint as ck
    d = shared_dir(comm, tmp_path_factory)
    e = engine(comm, "3")
    ck.save(e, d, 1)
    victim = comm.size - 1

    def disk_full(engine, tmp):
        raise OSError(28, "No space left on device")
    if comm.rank == victim:
        monkeypatch.setattr(ck, "_write_shards", disk_full)
    try:
        ck.save(e, d, 2)
        err = None
    except ck.CheckpointError as x:
        err = str(x)
    comm.Barrier()
    left = sorted(os.listdir(d))
    ok = err is not None and f"rank {victim}: writing into" in err and "No space left" in err
    ok &= left == ["step-000001"] and ck.latest(d) == os.path.join(d, "step-000001")
    assert_all(comm, ok, f"error {err!r}, directory {left}")


# ----------------------------------------------------------------- export
@pytest.mark.mpi
def test_export_equals_gathered_master(comm, tmp_path_factory):
    from ringzero.runtime import checkpoint as ck
    st = pytest.importorskip("safetensors.numpy")
    d = shared_dir(comm, tmp_path_factory)
    e = engine(comm, "3")
    train(e, batches(comm.rank, comm.size), 0, 3)
    src = ck.save(e, d, 3)
    master = by_name(e.layout, e.full_state("master"))
    params = by_name(e.layout, e.full_params(np.float16))       # the engine's own fp16 copy
    ok, msg = True, ""
    if comm.rank == 0:          # serial; a failure here must not leave the others waiting
        try:
            for dtype, ref in (("fp32", master), ("fp16", params)):
                out = os.path.join(d, f"w-{dtype}.safetensors")
                ck.export(src, out, dtype)
                w = st.load_file(out)
                bad = [n for n in ref if n not in w or w[n].dtype != ref[n].dtype
                       or not np.array_equal(w[n].ravel(), ref[n])]
                shapes = all(w[n].shape == e.layout.slots[n].spec.shape for n in w)
                ok &= not bad and shapes and sorted(w) == sorted(ref)
                ok &= not [f for f in os.listdir(d) if ".tmp-" in f]    # atomic: no temp file left
                msg += f"{dtype}: differ {bad[:3]}, shapes {shapes}; "
        except Exception as x:
            ok, msg = False, f"export: {type(x).__name__}: {x}"
    assert_all(comm, ok, msg)


# ------------------------------------------------- serial: kill, CLI, keep
KILL_SCRIPT = r"""
import os, sys, numpy as np
sys.path.insert(0, {tests!r})
from mpi4py import MPI
import test_checkpoint as t
from ringzero.runtime import checkpoint as ck
comm, d = MPI.COMM_WORLD, {d!r}
e = t.engine(comm, "3")
data = t.batches(comm.rank, comm.size)
t.train(e, data, 0, 2)
ck.save(e, d, 2)
full = e.full_state("master")
if comm.rank == 0:
    np.save(os.path.join({d!r}, "..", "master2.npy"), full)
t.train(e, data, 2, 3)
os.environ[ck.FAULT_ENV] = "rank:1"
ck.save(e, d, 3)
print("SURVIVED", flush=True)
"""


def _mpirun():
    exe = os.path.join(os.path.dirname(sys.executable), "mpirun")
    exe = exe if os.path.exists(exe) else shutil.which("mpirun")
    if not exe:
        pytest.skip("no mpirun")
    ver = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    flags = ["--oversubscribe", "--bind-to", "none"] if "Open MPI" in ver or "OpenRTE" in ver else []
    if flags and os.geteuid() == 0:
        flags.append("--allow-run-as-root")
    return [exe] + flags


def _clean_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "PMI_"))}
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    return env


def test_kill_mid_save_keeps_previous(tmp_path):
    from mpi4py import MPI

    from ringzero.runtime import checkpoint as ck
    from ringzero.runtime.flat import Layout
    d = str(tmp_path / "ckpt")
    script = tmp_path / "kill.py"
    script.write_text(KILL_SCRIPT.format(tests=os.path.dirname(__file__), d=d))
    p = subprocess.run(_mpirun() + ["-n", "2", sys.executable, "-m", "mpi4py", str(script)],
                       capture_output=True, text=True, timeout=240, env=_clean_env())
    assert p.returncode != 0 and "SURVIVED" not in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]
    assert ck.latest(d) == os.path.join(d, "step-000002"), p.stdout[-2000:] + p.stderr[-2000:]
    tmps = [x for x in os.listdir(d) if x.startswith(".tmp-step-000003")]
    assert len(tmps) == 1 and "manifest.json" not in os.listdir(os.path.join(d, tmps[0])), os.listdir(d)
    # the previous checkpoint loads (here at Nd = 1: a reshard 2 -> 1)
    e = engine(MPI.COMM_SELF, "1", seed=77)
    m = ck.load(e, "latest", d)
    ref = np.load(tmp_path / "master2.npy")
    old_layout = Layout(e.layout.units, 2)                 # the saving run's padding
    assert m["step"] == 2
    now = by_name(e.layout, e.full_state("master"))
    assert all(np.array_equal(v, by_name(old_layout, ref)[n]) for n, v in now.items())
    ck.save(e, d, 3)                                       # the next save clears the half-written one
    assert sorted(os.listdir(d)) == ["step-000002", "step-000003"]


def test_keep_latest_and_replace(tmp_path):
    from mpi4py import MPI

    from ringzero.runtime import checkpoint as ck
    d = str(tmp_path)
    e = engine(MPI.COMM_SELF, "0")
    os.makedirs(os.path.join(d, "step-000099"))           # no manifest: not a checkpoint
    for s in (1, 2, 3, 4):
        ck.save(e, d, s, keep=2)
    assert [s for s, _ in ck.complete_checkpoints(d)] == [3, 4]
    os.makedirs(os.path.join(d, ".tmp-step-000050-dead"))
    assert ck.latest(d) == os.path.join(d, "step-000004")
    train(e, batches(0, 1), 0, 1)
    ck.save(e, d, 4, keep=2)                               # the same step again: replaced
    assert not [x for x in os.listdir(d) if x.startswith(".tmp")]
    assert ck.read_manifest(os.path.join(d, "step-000004"))["adam"]["t"] == 1
    with pytest.raises(TypeError, match="JSON"):
        ck.save(e, d, 5, config={"f": object()})
    with pytest.raises(ValueError, match="step must be"):
        ck.save(e, d, -1)
    with pytest.raises(ck.CheckpointError, match="no complete checkpoint"):
        ck.load(e, "latest", str(tmp_path / "empty"))
    with pytest.raises(ck.CheckpointError, match="needs a save directory"):
        ck.load(e, "latest")


def test_cli_inspect_export(tmp_path):
    from mpi4py import MPI

    from ringzero.runtime import checkpoint as ck
    e = engine(MPI.COMM_SELF, "3")
    train(e, batches(0, 1), 0, 2)
    src = ck.save(e, str(tmp_path / "c"), 2, config={"n_layer": 2})
    def run(*a, **kw):
        return subprocess.run([sys.executable, "-m", "ringzero.checkpoint", *a], capture_output=True,
                              text=True, timeout=120, **kw)
    r = run("inspect", str(tmp_path / "c"), "--verify")
    assert r.returncode == 0 and "step        2" in r.stdout and f"{e.layout.numel:,}" in r.stdout, r.stdout + r.stderr
    assert r.stdout.count("  ok") == 4, r.stdout
    out = str(tmp_path / "w.safetensors")
    r = run("export", src, out, "--dtype", "fp16")
    assert r.returncode == 0 and "exported" in r.stdout, r.stderr
    os.remove(os.path.join(src, "master-r00000.bin"))
    r = run("export", src, out)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "master-r00000.bin: missing" in r.stderr, r.stderr
    # without safetensors: one line that says how to get it
    code = ("import sys; sys.modules['safetensors'] = None; from ringzero.runtime.checkpoint import main; "
            "sys.exit(main())")
    r = subprocess.run([sys.executable, "-c", code, "export", src, out], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "pip install 'ringzero[checkpoint]'" in r.stderr, r.stderr


def test_precision_change_keeps_master(tmp_path):
    """An fp16 run's checkpoint loads into an fp32 engine: master bitwise, its own scaler kept."""
    from mpi4py import MPI

    from ringzero.runtime import checkpoint as ck
    from ringzero.runtime.optim import LossScaler
    a = engine(MPI.COMM_SELF, "2")
    train(a, batches(0, 1), 0, 2)
    ck.save(a, str(tmp_path), 2)
    b = engine(MPI.COMM_SELF, "3", seed=77, precision="fp32", scaler=LossScaler(init=1.0, dynamic=False))
    ck.load(b, "latest", str(tmp_path))
    assert np.array_equal(a.full_state("master"), b.full_state("master"))
    assert np.array_equal(b.full_params(), b.full_state("master"))          # fp32 params = master
    assert b.scaler.scale == 1.0 and b.adam.t == 2


def test_reads_format_version_1(tmp_path):
    """A version-1 manifest named the shard count "nd"; it still loads, bitwise."""
    from mpi4py import MPI

    from ringzero.runtime import checkpoint as ck
    a = engine(MPI.COMM_SELF, "2")
    train(a, batches(0, 1), 0, 2)
    path = ck.save(a, str(tmp_path), 2)
    mf = os.path.join(path, "manifest.json")
    m = json.load(open(mf))
    assert m["version"] == 2 and m["shards"] == 1 and "nd" not in m
    m["version"], m["nd"] = 1, m.pop("shards")                 # what a version-1 save wrote
    json.dump(m, open(mf, "w"))
    b = engine(MPI.COMM_SELF, "3", seed=77)
    got = ck.load(b, path)
    assert got["shards"] == 1 and np.array_equal(a.full_state("master"), b.full_state("master"))
    m["version"] = 3
    json.dump(m, open(mf, "w"))
    with pytest.raises(ck.CheckpointError, match="format version 3, this reader reads versions 1, 2"):
        ck.load(b, path)


def test_start_up_leaves_ml_dtypes_unimported_until_a_manifest_names_bfloat16():
    """The trainer's and the checkpoint tools' modules import without ml_dtypes (its import
    costs every rank about 0.4 s of CPU); a manifest's "bfloat16" class still reads, by
    importing it then, and a name NumPy does not know is one CheckpointError. Run in a fresh
    interpreter: this one may hold ml_dtypes already."""
    code = (
        "import sys, numpy as np\n"
        "import ringzero.app.train, ringzero.runtime.zero, ringzero.runtime.checkpoint, ringzero.runtime.export\n"
        "from ringzero.runtime.manifest import class_dtype\n"
        "print('ml_dtypes' in sys.modules)\n"
        "print(class_dtype('float16') == np.float16, class_dtype('float32') == np.float32)\n"
        "from ringzero.runtime.manifest import CheckpointError\n"
        "try:\n"
        "    class_dtype('float99')\n"
        "except CheckpointError as e:\n"
        "    print('float99' in str(e) and '\\n' not in str(e))\n"
        "try:\n"
        "    d = class_dtype('bfloat16')\n"
        "except CheckpointError as e:\n"
        "    print('no-ml_dtypes' if 'needs ml_dtypes' in str(e) else e)\n"
        "else:\n"
        "    import ml_dtypes\n"
        "    print(d == np.dtype(ml_dtypes.bfloat16))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=60, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.split("\n")
    assert lines[0] == "False", "ml_dtypes was imported at start-up"
    assert lines[1] == "True True"
    assert lines[2] == "True", "an unknown dtype name is not one CheckpointError line"
    assert lines[3] in ("True", "no-ml_dtypes")
