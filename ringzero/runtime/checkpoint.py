"""Sharded checkpoints: atomic save, bit-exact resume, resharding, export.

What it is
    ``save(engine, save_dir, step, ...)`` (collective) writes every rank's
    partition of the fp32 master, Adam m and v, and the storage-dtype params
    into a temporary directory, fsyncs it, lets rank 0 write the manifest
    last, and renames the directory into place::

        SAVE_DIR/
          step-000010/                 one complete checkpoint per saved step
            manifest.json              config, layout table, Ψ, Nd, stage, step,
                                       Adam t, loss scaler, data position, and
                                       bytes + sha256 of every file below
            master-r00000.bin          rank 0's shard: its piece of every unit,
            adam_m-r00000.bin            padding included, in layout order
            adam_v-r00000.bin            (fp32; params in the storage dtype)
            params-r00000.bin
            ...-r00001.bin ...         one set per rank of the sharding group
          .tmp-step-000020-1a2b3c4d/   a save in progress, or one that crashed:
                                       ignored by latest(), removed by the next save

    ``load(engine, path | "latest", save_dir)`` (collective) checks the whole
    checkpoint first (manifest, model, layout, every file's size and sha256,
    the verdict agreed by all ranks), and only then reads each rank's pieces
    straight into the engine's buffers and re-publishes the params.

    Resharding is slicing. Unit u is padded to a multiple of nd*align, so a
    parameter sits at the same *unit-local* offset at every nd; only the
    piece size ``po = unit_padded/nd`` changes. File k of a checkpoint holds
    unit-local [k*po, (k+1)*po) of unit u at element ``shard_offset[u]`` of
    that file. A new rank r needs [r*pn, (r+1)*pn) of each unit and reads it
    from the old files that cover it, with seek + readinto into its own
    buffer: no rank holds more than its partition (plus one staging piece on
    a GPU). Padding loads as zeros.

    ``export`` streams one parameter at a time into a safetensors file;
    ``python -m ringzero.checkpoint export|inspect`` is the command line.

What it is not
    It decides nothing about when to save or what the data position means:
    the trainer passes ``step``, ``config`` and ``data_state`` and gets them
    back from ``load``. Ranks agree on small metadata (digests, errors) with
    pickled collectives; the state itself is plain file I/O, never MPI.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import secrets
import shutil
import struct
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import numpy as np

from ringzero.runtime.flat import Layout, units_from_description

FORMAT, VERSION = "ringzero-checkpoint", 1
CLASSES = ("master", "adam_m", "adam_v", "params")    # every class a rank writes
LOADED = ("master", "adam_m", "adam_v")               # params are re-published from master
MANIFEST = "manifest.json"
FAULT_ENV = "RINGZERO_FAULT_SAVE"                      # "rank:N": world rank N dies mid-write
_STEP_RE = re.compile(r"^step-(\d+)$")
_CHUNK = 4 << 20                                       # bytes per read when hashing


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or loaded; the message names the file."""


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def shard_file(cls: str, rank: int) -> str:
    return f"{cls}-r{rank:05d}.bin"


# ----------------------------------------------------------------- listing
def complete_checkpoints(save_dir: str) -> list:
    """[(step, path)] of complete checkpoints (a manifest present), oldest first."""
    if not os.path.isdir(save_dir):
        return []
    out = []
    for d in os.listdir(save_dir):
        m = _STEP_RE.match(d)
        if m and os.path.isfile(os.path.join(save_dir, d, MANIFEST)):
            out.append((int(m.group(1)), os.path.join(save_dir, d)))
    return sorted(out)


def latest(save_dir: str) -> str | None:
    """Path of the newest complete checkpoint in ``save_dir``, or None."""
    c = complete_checkpoints(save_dir)
    return c[-1][1] if c else None


def resolve(path: str, save_dir: str | None = None) -> str:
    """A checkpoint directory from "latest" (within save_dir), a step directory,
    or a save directory (its latest)."""
    if path == "latest":
        if not save_dir:
            raise CheckpointError("resume from 'latest' needs a save directory (--save-dir)")
        p = latest(save_dir)
        if p is None:
            raise CheckpointError(f"no complete checkpoint in {save_dir!r} (looked for step-*/{MANIFEST})")
        return p
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    p = latest(path) if os.path.isdir(path) else None
    if p is None:
        raise CheckpointError(f"{path!r} is not a checkpoint: no {os.path.join(path, MANIFEST)} "
                              f"and no complete step-* directory inside")
    return p


def read_manifest(path: str) -> dict:
    f = os.path.join(path, MANIFEST)
    try:
        with open(f) as fh:
            m = json.load(fh)
    except FileNotFoundError:
        raise CheckpointError(f"{f}: missing; the directory is not a complete checkpoint") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{f}: unreadable manifest ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointError(f"{f}: not a ringzero checkpoint manifest (format "
                              f"{m.get('format') if isinstance(m, dict) else None!r}, expected {FORMAT!r})")
    if m.get("version") != VERSION:
        raise CheckpointError(f"{f}: format version {m.get('version')}, this reader reads version {VERSION}")
    return m


# ------------------------------------------------------------------ checks
def _model_signature(units) -> list:
    """[(unit name, [(param name, shape)])]: what must match to load."""
    return [(u["name"], [(p["name"], list(p["shape"])) for p in u["params"]]) for u in units]


def check_layout(m: dict, path: str, layout: Layout | None = None) -> Layout:
    """The checkpoint's own Layout, after checking it against its manifest,
    its file list, and (if given) the loading engine's layout. Raises."""
    try:
        return _check_layout(m, path, layout)
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{os.path.join(path, MANIFEST)}: malformed manifest "
                              f"({type(e).__name__}: {e})") from None


def _check_layout(m, path, layout):
    f = os.path.join(path, MANIFEST)
    d = m["layout"]
    old = Layout(units_from_description(d), nd=int(m["nd"]), align=int(d["align"]))
    classes, files = m["classes"], m["files"]
    # everything load() applies after the read must be present now, not fail half-way
    int(m["step"]), int(m["adam"]["t"]), int(m.get("engine_step_count", 0)), str(m["precision"])
    float(m["scaler"]["scale"]), int(m["scaler"]["good"]), int(m["scaler"]["hyst"])
    for info in files.values():
        int(info["bytes"]), str(info["sha256"])
    if layout is not None:
        mine, theirs = _model_signature(layout.describe()["units"]), _model_signature(d["units"])
        if mine != theirs:
            raise CheckpointError(f"{f}: checkpoint is from another model: {_first_diff(theirs, mine)}")
    again = old.describe()
    for key in ("numel", "padded"):
        if again[key] != d.get(key):
            raise CheckpointError(f"{f}: layout mismatch: manifest says {key} = {d.get(key)} at nd = "
                                  f"{old.nd}, the layout table gives {again[key]}")
    for ua, ub in zip(again["units"], d["units"]):
        if ua["padded"] != ub.get("padded"):
            raise CheckpointError(f"{f}: layout mismatch: unit {ua['name']!r} padded to {ub.get('padded')} "
                                  f"in the manifest, {ua['padded']} by the layout table at nd = {old.nd}")
    if m.get("psi") != old.numel:
        raise CheckpointError(f"{f}: layout mismatch: manifest Ψ = {m.get('psi')}, layout Ψ = {old.numel}")
    for cls in CLASSES:
        if cls not in classes:
            raise CheckpointError(f"{f}: manifest lists no {cls!r} class")
        want = old.shard_numel * np.dtype(classes[cls]).itemsize
        for k in range(old.nd):
            name = shard_file(cls, k)
            if name not in files:
                raise CheckpointError(f"{os.path.join(path, name)}: not listed in the manifest "
                                      f"(nd = {old.nd} needs {cls} files r0..r{old.nd - 1})")
            if files[name]["bytes"] != want:
                raise CheckpointError(f"{os.path.join(path, name)}: layout mismatch: listed with "
                                      f"{files[name]['bytes']} bytes, the layout needs {want}")
    for cls in LOADED:
        if np.dtype(classes[cls]) != np.float32:
            raise CheckpointError(f"{f}: class {cls} stored as {classes[cls]}, expected float32")
    return old


def _first_diff(theirs, mine) -> str:
    if len(theirs) != len(mine):
        return (f"{len(theirs)} units ({', '.join(u for u, _ in theirs)}) in the checkpoint, "
                f"{len(mine)} ({', '.join(u for u, _ in mine)}) in this model")
    for (ua, pa), (ub, pb) in zip(theirs, mine):
        if ua != ub or len(pa) != len(pb):
            return f"unit {ua!r} has {len(pa)} params in the checkpoint, unit {ub!r} has {len(pb)} here"
        for (na, sa), (nb, sb) in zip(pa, pb):
            if na != nb or sa != sb:
                return f"param {na!r} {tuple(sa)} in the checkpoint, {nb!r} {tuple(sb)} in this model"
    return "unknown difference"


def verify_file(path: str, name: str, info: dict) -> str | None:
    """None if the file exists with the listed size and sha256, else the problem."""
    f = os.path.join(path, name)
    try:
        size = os.path.getsize(f)
    except FileNotFoundError:
        return f"{f}: missing (the manifest lists it with {info['bytes']} bytes)"
    except OSError as e:
        return f"{f}: unreadable ({e})"
    if size != info["bytes"]:
        what = "truncated" if size < info["bytes"] else "too long"
        return f"{f}: {what}: expected {info['bytes']} bytes, got {size}"
    h, chunk = hashlib.sha256(), bytearray(min(_CHUNK, max(size, 1)))
    mv = memoryview(chunk)
    try:
        with open(f, "rb", buffering=0) as fh:
            while True:
                n = fh.readinto(mv)
                if not n:
                    break
                h.update(mv[:n])
    except OSError as e:
        return f"{f}: unreadable ({e})"
    got = h.hexdigest()
    if got != info["sha256"]:
        return f"{f}: corrupt: sha256 {got[:16]}.. does not match the manifest's {info['sha256'][:16]}.."
    return None


def verify(path: str, m: dict, names=None, rank: int = 0, size: int = 1) -> str | None:
    """Verify files ``names`` (default: all), this rank's round-robin share."""
    names = sorted(m["files"]) if names is None else list(names)
    for i, name in enumerate(names):
        if i % size == rank:
            err = verify_file(path, name, m["files"][name])
            if err:
                return err
    return None


def _msg(e: BaseException) -> str:
    """One line for an error: ours as is, anything else with its type."""
    s = str(e) if isinstance(e, (CheckpointError, OSError)) else f"{type(e).__name__}: {e}"
    return s.replace("\n", " ")


def _agree(comm, err: str | None):
    """Raise the first rank's error on every rank (a scalar-sized verdict)."""
    errs = comm.allgather(err) if comm.size > 1 else [err]
    first = next((e for e in errs if e), None)
    if first:
        raise CheckpointError(first)


# -------------------------------------------------------------- piece I/O
def _piece(L: Layout, buf, u: int, r: int):
    """Piece (u, r) of a buffer held full (length padded) or as rank r's shard."""
    if buf.size == L.padded:      # full; at nd = 1 full and shard coincide
        a = L.unit_offset[u] + r * L.piece[u]
        return buf[a:a + L.piece[u]]
    return L.unit_shard(buf, u)


def _read_range(fhs, path, cls, old: Layout, u: int, lo: int, hi: int, dst, staging=None):
    """dst[:hi-lo] = unit-local elements [lo, hi) of unit u, from the old files."""
    po, item = old.piece[u], dst.dtype.itemsize
    for k in range(lo // po, (hi - 1) // po + 1):
        a, b = max(lo, k * po), min(hi, (k + 1) * po)
        if k not in fhs:
            fhs[k] = open(os.path.join(path, shard_file(cls, k)), "rb", buffering=0)
        fh = fhs[k]
        fh.seek((old.shard_offset[u] + a - k * po) * item)
        out = dst[a - lo:b - lo]
        host = out if isinstance(out, np.ndarray) else staging[:b - a]
        mv, n = memoryview(host.view(np.uint8)), 0
        while n < mv.nbytes:                 # a raw read may return less (>2 GiB on Linux)
            got = fh.readinto(mv[n:])
            if not got:
                raise CheckpointError(f"{fh.name}: short read: expected {mv.nbytes} bytes at offset "
                                      f"{fh.tell() - n}, got {n}")
            n += got
        if host is not out:
            out.set(host)


def _write_shards(engine, tmp: str) -> dict:
    """This rank's files; returns {name: {class, rank, dtype, bytes, sha256}}.

    On the host, a second thread hashes a piece while this one writes it
    (both release the GIL), so a save costs about max(hash, write), not the
    sum. A GPU piece goes through one reused staging buffer, hashed in line.
    """
    L, r, U = engine.layout, engine.srank, len(engine.layout.units)
    die = os.environ.get(FAULT_ENV, "") == f"rank:{engine.comm.rank}"
    staging = None if engine.xp is np else np.empty(max(L.piece), np.float32)
    out = {}
    with ThreadPoolExecutor(1) as pool:
        for cls in CLASSES:
            buf, name = engine.bufs[cls], shard_file(cls, r)
            h, nbytes, pending = hashlib.sha256(), 0, []
            with open(os.path.join(tmp, name), "wb") as fh:
                for u in range(U):
                    p = _piece(L, buf, u, r)
                    if isinstance(p, np.ndarray):
                        mv = memoryview(p.view(np.uint8))
                        pending.append(pool.submit(h.update, mv))   # one worker: in order
                    else:
                        mv = memoryview(p.get(out=staging.view(p.dtype)[:p.size]).view(np.uint8))
                        h.update(mv)
                    fh.write(mv)
                    nbytes += mv.nbytes
                    if die and u == U // 2:          # fault injection: a half-written file, no cleanup
                        fh.flush()
                        os._exit(86)
                fh.flush()
                os.fsync(fh.fileno())
            for f in pending:
                f.result()
            out[name] = {"class": cls, "rank": r, "dtype": str(buf.dtype), "bytes": nbytes,
                         "sha256": h.hexdigest()}
    return out


def _fsync_dir(path: str):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------- save
def save(engine, save_dir: str, step: int, config: dict | None = None, data_state: dict | None = None,
         keep: int | None = None, rng_state=None) -> str:
    """Write a complete checkpoint of ``engine`` at ``step`` into
    ``save_dir/step-NNNNNN`` atomically; prune to the newest ``keep``.
    Collective: call on every rank. Returns the checkpoint path."""
    if not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if keep is not None and (not isinstance(keep, (int, np.integer)) or keep < 1):
        raise ValueError(f"keep must be an int >= 1 or None, got {keep!r}")
    extra = {"config": config or {}, "data": data_state if data_state is not None else {"step": int(step)},
             "rng": rng_state}
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as e:
        raise TypeError(f"config, data_state and rng_state must be JSON-serializable: {e}") from None
    comm, name = engine.comm, step_dir_name(int(step))

    # 1. rank 0 clears stale temporaries and makes this save's own
    msg = None
    if comm.rank == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            for d in os.listdir(save_dir):
                if d.startswith(".tmp-"):
                    shutil.rmtree(os.path.join(save_dir, d), ignore_errors=True)
            tmp = os.path.join(save_dir, f".tmp-{name}-{secrets.token_hex(4)}")
            os.mkdir(tmp)
            msg = (None, tmp)
        except Exception as e:      # any failure is reported on every rank, never a hang
            msg = (f"cannot prepare {save_dir!r} for a checkpoint: {_msg(e)}", None)
    err, tmp = comm.bcast(msg, root=0) if comm.size > 1 else msg
    if err:
        raise CheckpointError(err)

    # 2. every writer writes and fsyncs its partition (hybrid: replica 0 only)
    writer = engine.replica_comm is None or engine.replica_comm.rank == 0
    files, err = {}, None
    if writer:
        try:
            files = _write_shards(engine, tmp)
        except Exception as e:
            err = f"rank {comm.rank}: writing into {tmp}: {_msg(e)}"
    got = comm.gather((files, err), root=0) if comm.size > 1 else [(files, err)]

    # 3. rank 0: manifest last, fsync, rename into place, prune
    result = None
    if comm.rank == 0:
        errs = [e for _, e in got if e]
        try:
            if errs:
                raise CheckpointError(errs[0])
            allf = {}
            for f, _ in got:
                allf.update(f)
            result = (None, _finish(engine, save_dir, tmp, name, int(step), extra, allf, keep))
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            result = (f"checkpoint {name} not saved: {_msg(e)}", None)
    err, path = comm.bcast(result, root=0) if comm.size > 1 else result
    if err:
        raise CheckpointError(err)
    return path


def _finish(engine, save_dir, tmp, name, step, extra, files, keep) -> str:
    L = engine.layout
    man = {"format": FORMAT, "version": VERSION, "step": step,
           "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "stage": engine.stage, "world": engine.comm.size, "nd": engine.nd,
           "psi": L.numel, "padded": L.padded, "padding": L.padded - L.numel,
           "precision": engine.precision, "engine_step_count": int(engine.step_count),
           "adam": {"t": int(engine.adam.t), **asdict(engine.adam.cfg)},
           "scaler": engine.scaler.state_dict(), **extra,
           "layout": L.describe(),
           "classes": {c: str(engine.bufs[c].dtype) for c in CLASSES},
           "files": dict(sorted(files.items()))}
    mf = os.path.join(tmp, MANIFEST)
    with open(mf, "w") as fh:
        json.dump(man, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    _fsync_dir(tmp)
    final = os.path.join(save_dir, name)
    aside = None
    if os.path.exists(final):            # the same step saved again: replace it
        aside = f"{tmp}-replaced"
        os.rename(final, aside)
    os.rename(tmp, final)
    _fsync_dir(save_dir)
    if aside:
        shutil.rmtree(aside, ignore_errors=True)
    if keep:
        others = [p for s, p in complete_checkpoints(save_dir) if p != final]
        for p in others[:max(0, len(others) - (keep - 1))]:
            shutil.rmtree(p, ignore_errors=True)
        _fsync_dir(save_dir)
    return final


# ------------------------------------------------------------------- load
def load(engine, path: str = "latest", save_dir: str | None = None) -> dict:
    """Load a checkpoint into ``engine`` at any Nd and stage. Collective.

    Everything is checked before any engine buffer changes; a bad checkpoint
    raises the same one-line CheckpointError on every rank. Returns the
    manifest (step, data, config, ...) with "path" added.
    """
    comm = engine.comm
    res = None
    if comm.rank == 0:
        try:
            p = resolve(path, save_dir)
            res = (None, p, read_manifest(p))
        except Exception as e:
            res = (_msg(e), None, None)
    err, p, m = comm.bcast(res, root=0) if comm.size > 1 else res
    if err:
        raise CheckpointError(err)

    err = None
    try:
        old = check_layout(m, p, engine.layout)
        err = verify(p, m, rank=comm.rank, size=comm.size)
    except Exception as e:
        err = _msg(e)
    _agree(comm, err)          # nothing has been modified yet

    err = None
    try:
        _read_state(engine, p, old)
    except Exception as e:
        err = f"{_msg(e)} (the engine is half-loaded: discard it)"
    _agree(comm, err)
    engine.adam.t = int(m["adam"]["t"])
    if m.get("precision") == engine.precision:   # an fp32 engine keeps its static scale of 1
        engine.scaler.load_state_dict(m["scaler"])
    engine.step_count = int(m.get("engine_step_count", m["step"]))
    # params = cast(master), all-gathered where they are held in full (collective)
    publish = engine.publish_params
    publish()
    return dict(m, path=p)


def _read_state(engine, path, old: Layout):
    """Each piece this rank holds = the unit-local range it covers, from the old files."""
    L = engine.layout
    staging = None if engine.xp is np else np.empty(max(L.piece), np.float32)
    for cls in LOADED:
        buf = engine.bufs[cls]
        mine = range(L.nd) if buf.size == L.padded else (engine.srank,)
        fhs = {}
        try:
            for u in range(len(L.units)):
                pn, real = L.piece[u], L.unit_numel[u]
                for r in mine:
                    dst = _piece(L, buf, u, r)
                    lo, hi = r * pn, min((r + 1) * pn, real)
                    if lo < hi:
                        _read_range(fhs, path, cls, old, u, lo, hi, dst, staging)
                    dst[max(0, hi - lo):] = 0            # padding
        finally:
            for fh in fhs.values():
                fh.close()


# ----------------------------------------------------------------- export
def export(path: str, out: str, dtype: str = "fp32") -> dict:
    """Consolidate a checkpoint's weights into a safetensors file, one
    parameter at a time (memory: the largest parameter). Serial."""
    if dtype not in ("fp32", "fp16"):
        raise ValueError(f"dtype must be fp32 or fp16, got {dtype!r}")
    try:
        from safetensors import safe_open
    except ImportError:
        raise CheckpointError("export needs safetensors: pip install 'ringzero[checkpoint]'") from None
    p = resolve(path)
    m = read_manifest(p)
    old = check_layout(m, p)
    # fp16 straight from the fp16 params files when the run stored fp16, else from master
    cls = "params" if dtype == "fp16" and np.dtype(m["classes"]["params"]) == np.float16 else "master"
    err = verify(p, m, [shard_file(cls, k) for k in range(old.nd)])
    if err:
        raise CheckpointError(err)
    src_dt, out_dt = np.dtype(m["classes"][cls]), np.dtype(np.float32 if dtype == "fp32" else np.float16)
    tag = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16"}[out_dt]
    header, off = {}, 0
    for name, s in old.slots.items():
        n = s.spec.numel * out_dt.itemsize
        header[name] = {"dtype": tag, "shape": list(s.spec.shape), "data_offsets": [off, off + n]}
        off += n
    header["__metadata__"] = {"format": "np", "source": FORMAT, "step": str(m["step"]),
                              "config": json.dumps(m.get("config", {}))}
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    biggest = max((s.spec.numel for s in old.slots.values()), default=0)
    buf = np.empty(biggest, src_dt)
    cast = np.empty(biggest, out_dt) if out_dt != src_dt else None
    tmp = f"{out}.tmp-{secrets.token_hex(4)}"
    fhs = {}
    try:
        with open(tmp, "wb") as fo:
            fo.write(struct.pack("<Q", len(hb)))
            fo.write(hb)
            for name, s in old.slots.items():
                n = s.spec.numel
                if n:
                    _read_range(fhs, p, cls, old, s.unit, s.in_unit, s.in_unit + n, buf)
                v = buf[:n]
                if cast is not None:
                    np.copyto(cast[:n], v, casting="same_kind")   # round to nearest even
                    v = cast[:n]
                fo.write(memoryview(v.view(np.uint8)))
            fo.flush()
            os.fsync(fo.fileno())
        with safe_open(tmp, framework="numpy") as st:      # the reference parser accepts it
            if sorted(st.keys()) != sorted(old.slots):
                raise CheckpointError(f"{tmp}: safetensors keys do not match the layout")
        os.replace(tmp, out)
        _fsync_dir(os.path.dirname(os.path.abspath(out)))
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    finally:
        for fh in fhs.values():
            fh.close()
    return {"path": out, "source": p, "tensors": len(old.slots), "dtype": dtype, "class": cls,
            "bytes": os.path.getsize(out), "psi": old.numel}


# ---------------------------------------------------------------- inspect
def describe(path: str, check: bool = False) -> str:
    """The manifest of a checkpoint, readably (and the files verified if ``check``)."""
    p = resolve(path)
    m = read_manifest(p)
    old = check_layout(m, p)
    lines = [f"checkpoint {p}",
             f"  format      {m['format']} v{m['version']}, saved {m.get('saved_at', '?')}",
             f"  step        {m['step']} (engine steps {m.get('engine_step_count')}, Adam t {m['adam']['t']})",
             f"  data        {json.dumps(m.get('data'))}",
             f"  rng         {json.dumps(m.get('rng'))}",
             f"  stage       {m['stage']}, Nd = {m['nd']} (world {m['world']}), {m['precision']}",
             f"  Ψ           {m['psi']:,} params, padded {m['padded']:,} (+{m['padding']:,} padding, "
             f"align {old.align})",
             f"  loss scale  {json.dumps(m['scaler'])}",
             "  adam        " + ", ".join(f"{k}={v}" for k, v in m["adam"].items()),
             "  config      " + (", ".join(f"{k}={v}" for k, v in m.get("config", {}).items()) or "{}"),
             f"  units       {'name':<12} {'numel':>12} {'padded':>12} {'piece':>10}  params"]
    for i, u in enumerate(old.units):
        lines.append(f"              {u.name:<12} {old.unit_numel[i]:>12,} {old.unit_padded[i]:>12,} "
                     f"{old.piece[i]:>10,}  {len(u.params)}")
    total = sum(f["bytes"] for f in m["files"].values())
    lines.append(f"  files       {len(m['files'])} files, {total:,} bytes")
    for name, f in m["files"].items():
        status = ""
        if check:
            e = verify_file(p, name, f)
            status = "  ok" if e is None else f"  BAD: {e}"
        lines.append(f"              {name:<22} {f['dtype']:<8} {f['bytes']:>12,}  sha256 {f['sha256'][:16]}{status}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ringzero.checkpoint",
                                 description="Export or inspect a ringzero checkpoint (serial, no MPI).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="consolidate the weights into one safetensors file")
    e.add_argument("dir", help="a step-NNNNNN directory, or a save directory (its latest)")
    e.add_argument("out", help="output .safetensors path (written atomically)")
    e.add_argument("--dtype", choices=("fp32", "fp16"), default="fp32")
    i = sub.add_parser("inspect", help="print the manifest")
    i.add_argument("dir")
    i.add_argument("--verify", action="store_true", help="also check every file's size and sha256")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "export":
            t0 = time.perf_counter()
            r = export(a.dir, a.out, a.dtype)
            print(f"exported {r['tensors']} tensors ({r['psi']:,} params, {a.dtype}, from {r['class']}) "
                  f"of {r['source']} to {r['path']}: {r['bytes']:,} bytes in {time.perf_counter() - t0:.2f} s")
        else:
            text = describe(a.dir, a.verify)
            print(text)
            if "  BAD: " in text:
                return 1
    except (CheckpointError, OSError) as err:
        print(f"ringzero.checkpoint: error: {_msg(err)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
