"""qgZ's error-feedback residual in a checkpoint: each rank's own piece, saved and restored.

What it is
    With ``--zeropp qgz --zeropp-error-feedback`` every rank carries one float32 residual per
    padded element (runtime/zeropp.py ``ZeroPP.residual``): what its last quantized gradients
    lost, added to the next step's. It is rank state, like Adam's m and v, so a resume that lost
    it would not be the uninterrupted run. checkpoint.save writes it beside the shards::

        step-000010/
          qgz_residual-w00000.bin      world rank 0's residual: layout.padded float32 (host order)
          qgz_residual-w00001.bin      one per world rank (hybrid's replicas included: each has its own)
          manifest.json                "qgz_residual": {world, nodes, padded, block, grad_bits};
                                       every file above is in "files" (bytes, sha256), verified on load

    written in the same temporary directory, fsynced, listed in the same manifest, renamed into
    place with the rest. ``load`` restores rank r's file into rank r's residual when the run is
    the one that saved it: the same world size, the same node map (node index of every rank) and
    the same padded layout. Otherwise the residual is dropped and error feedback starts again from
    zeros, with one printed note (``note``): the weights, Adam and the data position resume as
    usual. This is what DeepSpeed's 1-bit Adam does on every load (its ``load_state_dict`` resets
    the worker and server error buffers); here a resume on the same ranks keeps it, and is bitwise
    the uninterrupted run (tests/test_zeropp_checkpoint.py).

What it is not
    The weights: the checkpoint stays full precision (fp32 master, Adam), whatever --zeropp says.
    hpZ's secondary shard is not saved: it is a copy of the params, cut again from the first
    gather after the resume's publish (ZeroPP.invalidate).
"""
from __future__ import annotations

import hashlib
import os

import numpy as np

KEY = "qgz_residual"                 # the manifest's record and the files' class


def residual_file(rank: int) -> str:
    return f"{KEY}-w{rank:05d}.bin"


def _zpp(engine):
    z = getattr(engine.topology, "zeropp", None)
    return z if z is not None and z.residual is not None else None


def record(engine) -> dict | None:
    """The manifest's "qgz_residual": what must match for the residual to be restored (None: no residual)."""
    z = _zpp(engine)
    if z is None:
        return None
    return {"world": int(engine.comm.size), "nodes": list(map(int, engine.topology.nodes.node_of)),
            "padded": int(engine.layout.padded), "block": int(z.policy.block), "grad_bits": int(z.policy.grad_bits),
            "grad_block": int(z.policy.grad_block)}


def write(engine, tmp: str) -> dict:
    """This rank's residual file in ``tmp`` (fsynced); {name: {class, rank, dtype, bytes, sha256}} or {}."""
    z = _zpp(engine)
    if z is None:
        return {}
    res = z.residual
    host = res if isinstance(res, np.ndarray) else res.get()     # a device residual: one host copy at a save
    mv = memoryview(np.ascontiguousarray(host[:engine.layout.padded]).view(np.uint8))
    name, r = residual_file(engine.comm.rank), int(engine.comm.rank)
    with open(os.path.join(tmp, name), "wb") as fh:
        fh.write(mv)
        fh.flush()
        os.fsync(fh.fileno())
    return {name: {"class": KEY, "rank": r, "dtype": "float32", "bytes": mv.nbytes,
                   "sha256": hashlib.sha256(mv).hexdigest()}}


def plan(engine, m: dict) -> tuple[bool, str | None]:
    """(restore?, note): whether this engine takes the checkpoint's residuals, and the line to print if not."""
    saved, mine = m.get(KEY), record(engine)
    if mine is None:
        if saved:
            return False, ("the checkpoint holds qgZ error-feedback residuals; this run has no "
                           "--zeropp-error-feedback: they are not loaded")
        return False, None
    if not saved:
        return False, "the checkpoint holds no qgZ residual: error feedback starts from zeros"
    for key, what in (("world", "world size"), ("nodes", "node map"), ("padded", "padded layout")):
        if saved.get(key) != mine[key]:
            return False, (f"the checkpoint's qgZ residuals are from another {what} ({_short(saved.get(key))} "
                           f"saved, {_short(mine[key])} now): dropped, error feedback starts from zeros")
    return True, None


def _short(v) -> str:
    s = str(v)
    return s if len(s) <= 40 else s[:37] + "..."


def check(engine, m: dict, path: str) -> str | None:
    """The problem with this rank's residual file if it will be restored (before any buffer changes)."""
    ok, _ = plan(engine, m)
    if not ok:
        return None
    name = residual_file(engine.comm.rank)
    info = m["files"].get(name)
    want = engine.layout.padded * 4
    if info is None:
        return f"{os.path.join(path, name)}: not listed in the manifest (it records qgZ residuals)"
    if int(info["bytes"]) != want:
        return f"{os.path.join(path, name)}: listed with {info['bytes']} bytes, the layout needs {want}"
    return None


def read(engine, m: dict, path: str) -> None:
    """Restore this rank's residual (when ``plan`` says so) or zero it (a resume starts error feedback anew)."""
    z = _zpp(engine)
    if z is None:
        return
    ok, _ = plan(engine, m)
    if not ok:
        z.residual[...] = 0
        return
    host = np.fromfile(os.path.join(path, residual_file(engine.comm.rank)), np.float32)
    z.residual[:len(host)] = host if isinstance(z.residual, np.ndarray) else z.xp.asarray(host)
