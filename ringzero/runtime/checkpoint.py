"""Sharded checkpoints: atomic save, bit-exact resume, resharding, export.

What it is
    ``save(engine, save_dir, step, ...)`` (collective) writes every rank's
    partition of the fp32 master, Adam m and v, and the storage-dtype params
    into a temporary directory, fsyncs it, lets rank 0 write the manifest
    last, and renames the directory into place::

        SAVE_DIR/
          step-000010/                 one complete checkpoint per saved step
            manifest.json              config, layout table, Ψ, shards, stage, step,
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

    With qgZ's error feedback each rank also writes its own residual (zeropp_state.py): restored
    on the same world and node map, else dropped with a note (``load``'s "notes").

    Resharding is slicing. Unit u is padded to a multiple of shards*align, so
    a parameter sits at the same *unit-local* offset at every shard count;
    only the piece size ``po = unit_padded/shards`` changes. File k of a checkpoint holds
    unit-local [k*po, (k+1)*po) of unit u at element ``shard_offset[u]`` of
    that file. A new rank r needs [r*pn, (r+1)*pn) of each unit and reads it
    from the old files that cover it, with seek + readinto into its own
    buffer: no rank holds more than its partition (plus one staging piece on
    a GPU). Padding loads as zeros.

    ``export`` streams one parameter at a time into a safetensors file;
    ``python -m ringzero.checkpoint export|inspect`` is the command line
    (both in export.py). The on-disk format, its checks and the ranged reads
    are manifest.py's; this module is the collective part, save and load.

    What it reads of the engine is a small API: ``engine.wait_params()``, ``engine.comm``,
    ``engine.layout``, ``engine.state`` (``piece``, ``held_ranks``, ``dtypes``, ``files``,
    ``shard_rank``, ``on_host``), ``engine.topology.writes_checkpoint``, and
    ``engine.checkpoint_meta()`` / ``engine.restore_meta(manifest)``.

    Offloaded state (offload.py): a piece of a class that lives in a file is a
    FileView; it is read into the staging piece to be hashed and written, and a
    loaded piece is assembled in a host piece and written to its file. The
    checkpoint is its own folder, never the offload files: a crash in the middle
    of an update leaves the newest checkpoint as it was, and a run may resume
    with offload switched on or off (the files hold the same pieces).

What it is not
    It decides nothing about when to save or what the data position means:
    the trainer passes ``step``, ``config`` and ``data_state`` and gets them
    back from ``load``. Ranks agree on small metadata (digests, errors) with
    pickled collectives; the state itself is plain file I/O, never MPI.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ringzero.comm.objects import allgather_obj, bcast_obj
from ringzero.runtime import zeropp_state
from ringzero.runtime.export import describe, export, main  # noqa: F401  (the public names)
from ringzero.runtime.flat import Layout
from ringzero.runtime.manifest import (  # noqa: F401
    CLASSES,
    FAULT_ENV,
    FORMAT,
    LOADED,
    MANIFEST,
    READABLE,
    VERSION,
    CheckpointError,
    check_layout,
    complete_checkpoints,
    error_line,
    fsync_dir,
    latest,
    read_manifest,
    read_range,
    resolve,
    save_fault,
    shard_file,
    step_dir_name,
    verify,
    verify_file,
)
from ringzero.runtime.offload import drop_pages, on_disk, write_from


def _agree(ctl, err: str | None):
    """Raise the first rank's error on every rank (a scalar-sized verdict, over the watched control ring)."""
    errs = allgather_obj(ctl, err)
    first = next((e for e in errs if e), None)
    if first:
        raise CheckpointError(first)


def _write_shards(engine, tmp: str) -> dict:
    """This rank's files; returns {name: {class, rank, dtype, bytes, sha256}}.

    On the host, a second thread hashes a piece while this one writes it
    (both release the GIL), so a save costs about max(hash, write), not the
    sum. A GPU piece goes through one reused staging buffer, hashed in line.
    """
    L, state, U = engine.layout, engine.state, len(engine.layout.units)
    r = state.shard_rank
    fault = save_fault(engine.comm.rank)        # tests only: RINGZERO_FAULT_SAVE
    staging = None if state.on_host and not state.files else np.empty(max(L.piece_numel), np.float32)
    # offload: the update's last write-back on the disk and out of the page cache before the save reads
    # the files; each piece read is dropped again, and each checkpoint file once fsynced (the page cache
    # would otherwise grow by the whole state, the RAM offload exists to free)
    for f in state.files.values():
        f.flush()
    out = {}
    with ThreadPoolExecutor(1) as pool:
        for cls in CLASSES:
            dtype, name = state.dtypes[cls], shard_file(cls, r)
            h, nbytes, pending = hashlib.sha256(), 0, []
            path = os.path.join(tmp, name)
            if fault == "eacces":
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
            with open(path, "wb") as fh:
                for u in range(U):
                    p = state.piece(cls, u, r)
                    if isinstance(p, np.ndarray):
                        mv = memoryview(p.view(np.uint8))
                        pending.append(pool.submit(h.update, mv))   # one worker: in order
                    elif on_disk(p):                 # an offloaded class: through the staging piece
                        mv = memoryview(p.read(staging.view(p.dtype)[:p.size]).view(np.uint8))
                        p.store.drop(p.start, p.size)
                        h.update(mv)
                    else:
                        mv = memoryview(p.get(out=staging.view(p.dtype)[:p.size]).view(np.uint8))
                        h.update(mv)
                    fh.write(mv)
                    nbytes += mv.nbytes
                    if fault in ("rank", "enospc") and u == U // 2:    # a half-written file
                        fh.flush()
                        if fault == "rank":          # the process dies, no cleanup
                            os._exit(86)
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
                fh.flush()
                os.fsync(fh.fileno())
                if state.files:
                    drop_pages(fh.fileno())
            for f in pending:
                f.result()
            if cls in state.files:               # the pages at the pieces' edges (DONTNEED takes whole pages)
                state.files[cls].drop(0, state.files[cls].size)
            out[name] = {"class": cls, "rank": r, "dtype": str(dtype), "bytes": nbytes,
                         "sha256": h.hexdigest()}
    return out



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
    ctl = engine.topology.control    # every agreement is watched: a partition mid-save is named, not a hang
    engine.wait_params()             # the last update's gathers (overlap) land before params are written

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
            msg = (f"cannot prepare {save_dir!r} for a checkpoint: {error_line(e)}", None)
    err, tmp = bcast_obj(ctl, msg)
    if err:
        raise CheckpointError(err)

    # 2. every writer writes and fsyncs its partition (hybrid: replica 0 only)
    # (and every rank its own qgZ residual, hybrid's replicas too: zeropp_state.py)
    files, err = {}, None
    try:
        if engine.topology.writes_checkpoint:
            files = _write_shards(engine, tmp)
        files.update(zeropp_state.write(engine, tmp))
    except Exception as e:
        err = f"rank {comm.rank}: writing into {tmp}: {error_line(e)}"
    got = allgather_obj(ctl, (files, err))

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
            result = (f"checkpoint {name} not saved: {error_line(e)}", None)
    err, path = bcast_obj(ctl, result)
    if err:
        raise CheckpointError(err)
    return path


def _finish(engine, save_dir, tmp, name, step, extra, files, keep) -> str:
    L = engine.layout
    # the engine's own record: stage, world, shards, precision, step count, Adam, scaler
    man = {"format": FORMAT, "version": VERSION, "step": step,
           "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **engine.checkpoint_meta(),
           "psi": L.numel, "padded": L.padded, "padding": L.padded - L.numel, **extra,
           "layout": L.describe(),
           "classes": {c: str(engine.state.dtypes[c]) for c in CLASSES},
           zeropp_state.KEY: zeropp_state.record(engine),
           "files": dict(sorted(files.items()))}
    mf = os.path.join(tmp, MANIFEST)
    with open(mf, "w") as fh:
        json.dump(man, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    fsync_dir(tmp)
    final = os.path.join(save_dir, name)
    aside = None
    if os.path.exists(final):            # the same step saved again: replace it
        aside = f"{tmp}-replaced"
        os.rename(final, aside)
    os.rename(tmp, final)
    fsync_dir(save_dir)
    if aside:
        shutil.rmtree(aside, ignore_errors=True)
    if keep:
        others = [p for s, p in complete_checkpoints(save_dir) if p != final]
        for p in others[:max(0, len(others) - (keep - 1))]:
            shutil.rmtree(p, ignore_errors=True)
        fsync_dir(save_dir)
    return final


# ------------------------------------------------------------------- load
def load(engine, path: str = "latest", save_dir: str | None = None) -> dict:
    """Load a checkpoint into ``engine`` at any shard count and stage. Collective.

    Everything is checked before any engine buffer changes; a bad checkpoint
    raises the same one-line CheckpointError on every rank. Returns the
    manifest (step, data, config, ...) with "path" added.
    """
    comm, ctl = engine.comm, engine.topology.control
    res = None
    if comm.rank == 0:
        try:
            p = resolve(path, save_dir)
            res = (None, p, read_manifest(p))
        except Exception as e:
            res = (error_line(e), None, None)
    err, p, m = bcast_obj(ctl, res)
    if err:
        raise CheckpointError(err)

    err = None
    try:
        old = check_layout(m, p, engine.layout)
        err = verify(p, m, rank=comm.rank, size=comm.size, drop=bool(engine.state.files))
        err = err or zeropp_state.check(engine, m, p)
    except Exception as e:
        err = error_line(e)
    _agree(ctl, err)           # nothing has been modified yet

    err = None
    try:
        _read_state(engine, p, old)
        zeropp_state.read(engine, m, p)           # qgZ's residual: restored, or zeros (zeropp_state.plan)
    except Exception as e:
        err = f"{error_line(e)} (the engine is half-loaded: discard it)"
    _agree(ctl, err)
    # Adam t, loss scaler, step count; then params = cast(master), all-gathered
    # where they are held in full (collective)
    engine.restore_meta(m)
    err = None
    try:         # offload: the loaded state (and the params cast from it) on the disk, out of the page cache
        for f in engine.state.files.values():
            f.flush()
    except OSError as e:
        err = f"rank {comm.rank}: flushing the offload files after the load: {error_line(e)}"
    _agree(ctl, err)
    return dict(m, path=p, notes=[n for n in [zeropp_state.plan(engine, m)[1]] if n])


def _read_state(engine, path, old: Layout):
    """Each piece this rank holds = the unit-local range it covers, from the old files."""
    L, state = engine.layout, engine.state
    staging = None if state.on_host else np.empty(max(L.piece_numel), np.float32)
    for cls in LOADED:
        fhs = {}
        # an offloaded class: each piece assembled in a host piece, then written to its file
        host = np.empty(max(L.piece_numel), state.dtypes[cls]) if cls in state.files else None
        try:
            for u in range(len(L.units)):
                pn, real = L.piece_numel[u], L.unit_numel[u]
                for r in state.held_ranks(cls):
                    piece = state.piece(cls, u, r)
                    dst = host[:pn] if host is not None else piece
                    lo, hi = r * pn, min((r + 1) * pn, real)
                    if lo < hi:
                        read_range(fhs, path, cls, old, u, lo, hi, dst, staging)
                    dst[max(0, hi - lo):] = 0            # padding
                    if host is not None:
                        write_from(piece, dst)
        finally:
            for fh in fhs.values():
                if state.files:                   # offload: the checkpoint's pages read, dropped
                    drop_pages(fh.fileno())
                fh.close()


if __name__ == "__main__":
    import sys
    sys.exit(main())
