"""A checkpoint on disk: its names, its manifest, the checks, and ranged reads.

What it is
    The format shared by save/load (checkpoint.py) and export/inspect
    (export.py)::

        step-000010/manifest.json      format, version, config, layout table, Ψ,
                                       shards, stage, step, Adam t, loss scaler,
                                       data position, bytes + sha256 of each file
        step-000010/{master,adam_m,adam_v,params}-rNNNNN.bin
                                       file k: piece k of every unit, in layout order

    Format version 2 calls the number of pieces per unit ``shards`` (the
    sharding group's size: Nd at stages 0-3, Ng for hybrid); version 1 called
    it ``nd``, and this reader still reads it, under the new name.

    ``read_range`` reads unit-local elements [lo, hi) of a unit from the files
    of any number of shards: the whole of resharding.

What it is not
    No engine and no MPI: plain files and arithmetic on the layout table.
"""
from __future__ import annotations

import hashlib
import json
import os
import re

import numpy as np

from ringzero.runtime.flat import Layout, units_from_description


def class_dtype(name: str) -> np.dtype:
    """The NumPy dtype a manifest names for a class ("float16", "float32", "bfloat16").

    "bfloat16" (a bf16 run's params) is ml_dtypes', imported only then: its
    import costs about 0.4 s of CPU per process, which every rank of every run
    would otherwise pay at start-up. A name NumPy does not know is a
    CheckpointError (one line), as a damaged manifest's other fields are.
    """
    if name == "bfloat16":
        try:
            import ml_dtypes  # noqa: F401  (registers "bfloat16" with NumPy)
        except ImportError:
            raise CheckpointError(f"the checkpoint stores dtype {name!r}; reading it needs ml_dtypes: "
                                  "pip install 'ringzero[bf16]'") from None
    try:
        return np.dtype(name)
    except TypeError:
        raise CheckpointError(f"the manifest names dtype {name!r}, which NumPy does not know") from None


FORMAT, VERSION = "ringzero-checkpoint", 2
READABLE = (1, 2)                                     # v1 named shards "nd"
CLASSES = ("master", "adam_m", "adam_v", "params")    # every class a rank writes
LOADED = ("master", "adam_m", "adam_v")               # params are re-published from master
MANIFEST = "manifest.json"
FAULT_ENV = "RINGZERO_FAULT_SAVE"                      # fault injection for tests: see save_fault
_STEP_RE = re.compile(r"^step-(\d+)$")
_CHUNK = 4 << 20                                       # bytes per read when hashing


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or loaded; the message names the file."""


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def shard_file(cls: str, rank: int) -> str:
    return f"{cls}-r{rank:05d}.bin"


def save_fault(rank: int) -> str | None:
    """The save fault ``RINGZERO_FAULT_SAVE`` injects on world rank ``rank``, or None.

    ``MODE:N`` hits world rank N, a bare ``MODE`` every rank:
      rank    the process dies half-way through its first file (``rank:N`` only)
      enospc  a write fails half-way with ENOSPC, as on a full disk
      eacces  opening the first file fails with EACCES, as in a read-only directory
    """
    spec = os.environ.get(FAULT_ENV, "")
    mode, _, who = spec.partition(":")
    if mode not in ("rank", "enospc", "eacces") or (who == "" and mode == "rank"):
        return None
    return mode if who == "" or who == str(rank) else None


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
    if m.get("version") not in READABLE:
        raise CheckpointError(f"{f}: format version {m.get('version')}, this reader reads versions "
                              f"{', '.join(map(str, READABLE))}")
    if m["version"] == 1 and "nd" in m:       # v1's "nd" was the shard count, not the world size
        m["shards"] = m.pop("nd")
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
    old = Layout(units_from_description(d), shards=int(m["shards"]), align=int(d["align"]))
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
            raise CheckpointError(f"{f}: layout mismatch: manifest says {key} = {d.get(key)} at shards = "
                                  f"{old.shards}, the layout table gives {again[key]}")
    for ua, ub in zip(again["units"], d["units"]):
        if ua["padded"] != ub.get("padded"):
            raise CheckpointError(f"{f}: layout mismatch: unit {ua['name']!r} padded to {ub.get('padded')} "
                                  f"in the manifest, {ua['padded']} by the layout table at shards = {old.shards}")
    if m.get("psi") != old.numel:
        raise CheckpointError(f"{f}: layout mismatch: manifest Ψ = {m.get('psi')}, layout Ψ = {old.numel}")
    for cls in CLASSES:
        if cls not in classes:
            raise CheckpointError(f"{f}: manifest lists no {cls!r} class")
        want = old.shard_numel * class_dtype(classes[cls]).itemsize
        for k in range(old.shards):
            name = shard_file(cls, k)
            if name not in files:
                raise CheckpointError(f"{os.path.join(path, name)}: not listed in the manifest "
                                      f"(shards = {old.shards} needs {cls} files r0..r{old.shards - 1})")
            if files[name]["bytes"] != want:
                raise CheckpointError(f"{os.path.join(path, name)}: layout mismatch: listed with "
                                      f"{files[name]['bytes']} bytes, the layout needs {want}")
    for cls in LOADED:
        if class_dtype(classes[cls]) != np.float32:
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


def verify_file(path: str, name: str, info: dict, drop: bool = False) -> str | None:
    """None if the file exists with the listed size and sha256, else the problem.
    drop: its pages dropped from the page cache once hashed (an offloaded run's resume)."""
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
            if drop:
                os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError as e:
        return f"{f}: unreadable ({e})"
    got = h.hexdigest()
    if got != info["sha256"]:
        return f"{f}: corrupt: sha256 {got[:16]}.. does not match the manifest's {info['sha256'][:16]}.."
    return None


def verify(path: str, m: dict, names=None, rank: int = 0, size: int = 1, drop: bool = False) -> str | None:
    """Verify files ``names`` (default: all), this rank's round-robin share (drop: see verify_file)."""
    names = sorted(m["files"]) if names is None else list(names)
    for i, name in enumerate(names):
        if i % size == rank:
            err = verify_file(path, name, m["files"][name], drop)
            if err:
                return err
    return None


def error_line(e: BaseException) -> str:
    """One line for an error: ours as is, anything else with its type."""
    s = str(e) if isinstance(e, (CheckpointError, OSError)) else f"{type(e).__name__}: {e}"
    return s.replace("\n", " ")



def read_range(fhs, path, cls, old: Layout, u: int, lo: int, hi: int, dst, staging=None):
    """dst[:hi-lo] = unit-local elements [lo, hi) of unit u, from the old files."""
    po, item = old.piece_numel[u], dst.dtype.itemsize
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


def fsync_dir(path: str):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
