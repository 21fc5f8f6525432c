"""Export and inspect a checkpoint, serially: the ``python -m ringzero.checkpoint`` command line.

What it is
    ``export(path, out, dtype)`` streams one parameter at a time from a
    checkpoint's shard files (any number of shards) into a safetensors file,
    checked afterwards by safetensors' own parser; ``write_tensors`` is that
    streaming writer, which ``export --format hf`` (interop/hf_export.py) drives
    with GPT-2's names. ``describe(path)`` prints the manifest; ``main`` is
    the ``export`` / ``inspect`` command line.

What it is not
    No MPI and no engine: a checkpoint is read as plain files (manifest.py).
    No model names: those of ``--format hf`` are the GPT's (interop/gpt2.py).
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import struct
import sys
import time
from typing import NamedTuple

import numpy as np

from ringzero.runtime.flat import Layout
from ringzero.runtime.manifest import (
    FORMAT,
    CheckpointError,
    check_layout,
    class_dtype,
    error_line,
    fsync_dir,
    read_manifest,
    read_range,
    resolve,
    shard_file,
    verify,
    verify_file,
)

_OUT = {"fp32": "F32", "fp16": "F16", "bf16": "BF16"}    # safetensors' dtype tags


def _out_dtype(dtype: str):
    """(NumPy dtype, safetensors tag) of an export dtype; bf16 needs ml_dtypes."""
    if dtype == "bf16":
        try:
            import ml_dtypes
        except ImportError:
            raise CheckpointError("export --dtype bf16 needs ml_dtypes: pip install 'ringzero[bf16]'") from None
        return np.dtype(ml_dtypes.bfloat16), _OUT[dtype]
    return np.dtype(np.float32 if dtype == "fp32" else np.float16), _OUT[dtype]


def _safe_open():
    try:
        from safetensors import safe_open
    except ImportError:
        raise CheckpointError("export needs safetensors: pip install 'ringzero[checkpoint]'") from None
    return safe_open


def export(path: str, out: str, dtype: str = "fp32") -> dict:
    """Consolidate a checkpoint's weights into a safetensors file, one
    parameter at a time (memory: the largest parameter). Serial."""
    ex = open_export(path, dtype)
    p, m, old = ex.path, ex.manifest, ex.layout
    tensors = [(name, name, tuple(s.spec.shape)) for name, s in old.slots.items()]
    meta = {"format": "np", "source": FORMAT, "step": str(m["step"]), "config": json.dumps(m.get("config", {}))}
    write_tensors(ex, tensors, meta, out)
    return {"path": out, "source": p, "tensors": len(old.slots), "dtype": dtype, "class": ex.cls,
            "bytes": os.path.getsize(out), "psi": old.numel}


class Export(NamedTuple):
    """What an export reads: the checkpoint, its layout, the class and the dtypes."""
    path: str              # the step directory
    manifest: dict
    layout: Layout         # the checkpoint's own (its shard count)
    cls: str               # "master", or "params" when the run stored the export's dtype
    src_dt: np.dtype       # that class's dtype on disk
    out_dt: np.dtype       # the export's dtype
    tag: str               # its safetensors tag: F32, F16, BF16


def open_export(path: str, dtype: str) -> Export:
    """An export's checkpoint, its files verified. fp16 (bf16) come straight from
    the params files when the run stored that dtype, else from master."""
    if dtype not in _OUT:
        raise ValueError(f"dtype must be one of {', '.join(_OUT)}, got {dtype!r}")
    _safe_open()                          # the hint first, before any file is read
    p = resolve(path)
    m = read_manifest(p)
    old = check_layout(m, p)
    out_dt, tag = _out_dtype(dtype)
    cls = "params" if dtype != "fp32" and class_dtype(m["classes"]["params"]) == out_dt else "master"
    err = verify(p, m, [shard_file(cls, k) for k in range(old.shards)])
    if err:
        raise CheckpointError(err)
    return Export(p, m, old, cls, class_dtype(m["classes"][cls]), out_dt, tag)


def write_tensors(ex: Export, tensors, meta: dict, out: str):
    """Write ``out`` (atomically) as safetensors: one tensor per entry of ``tensors``, in that order, read
    from the checkpoint one parameter at a time (consecutive entries of one parameter read it once).

    An entry is (param name, key, shape): the leading prod(shape) elements of the parameter (an export
    may leave a padded vocabulary's rows out); or (param name, key, shape, pick): ``pick(v)`` of the
    parameter ``v`` in its own shape, a view (a column block, a transpose) of exactly ``shape``: how a
    model's export splits one fused parameter into a format's several tensors, the runtime knowing none."""
    p, old, cls, out_dt, tag = ex.path, ex.layout, ex.cls, ex.out_dt, ex.tag
    safe_open = _safe_open()
    header, off = {}, 0
    for name, key, shape, *pick in tensors:
        n = int(np.prod(shape, dtype=np.int64)) * out_dt.itemsize
        if int(np.prod(shape)) > old.slots[name].spec.numel:
            raise CheckpointError(f"export: {key} {tuple(shape)} is larger than parameter {name} "
                                  f"{old.slots[name].spec.shape}")
        header[key] = {"dtype": tag, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    header["__metadata__"] = meta
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    biggest = max((s.spec.numel for s in old.slots.values()), default=0)
    buf = np.empty(biggest, ex.src_dt)                      # one parameter
    cast = np.empty(biggest, out_dt) if out_dt != ex.src_dt else None
    fhs = {}
    tmp = f"{out}.tmp-{secrets.token_hex(4)}"
    try:
        with open(tmp, "wb") as fo:
            fo.write(struct.pack("<Q", len(hb)))
            fo.write(hb)
            last = None
            for name, key, shape, *pick in tensors:
                s, k = old.slots[name], int(np.prod(shape))
                whole = s.spec.numel if pick else k
                if whole and name != last:
                    read_range(fhs, p, cls, old, s.unit, s.in_unit, s.in_unit + whole, buf)
                last = name if pick else None       # a leading-elements read may be partial: read again
                v = buf[:whole]
                if pick:
                    v = np.ascontiguousarray(pick[0](v.reshape(s.spec.shape)))
                    if v.shape != tuple(shape):
                        raise CheckpointError(f"export: {key} picked {v.shape} from {name}, expected {tuple(shape)}")
                    v = v.reshape(-1)
                if cast is not None:
                    np.copyto(cast[:k], v, casting="unsafe")      # fp32 -> fp16/bf16: round to nearest even
                    v = cast[:k]
                fo.write(memoryview(v.view(np.uint8)))
            fo.flush()
            os.fsync(fo.fileno())
        with safe_open(tmp, framework="numpy") as st:      # the reference parser accepts it
            if sorted(st.keys()) != sorted(t[1] for t in tensors):
                raise CheckpointError(f"{tmp}: safetensors keys do not match the layout")
        os.replace(tmp, out)
        fsync_dir(os.path.dirname(os.path.abspath(out)))
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    finally:
        for fh in fhs.values():
            fh.close()


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
             f"  stage       {m['stage']}, {m['shards']} shards (world {m['world']}), {m['precision']}",
             f"  Ψ           {m['psi']:,} params, padded {m['padded']:,} (+{m['padding']:,} padding, "
             f"align {old.align})",
             f"  loss scale  {json.dumps(m['scaler'])}",
             "  adam        " + ", ".join(f"{k}={v}" for k, v in m["adam"].items()),
             "  config      " + (", ".join(f"{k}={v}" for k, v in m.get("config", {}).items()) or "{}"),
             f"  units       {'name':<12} {'numel':>12} {'padded':>12} {'piece':>10}  params"]
    for i, u in enumerate(old.units):
        lines.append(f"              {u.name:<12} {old.unit_numel[i]:>12,} {old.unit_padded[i]:>12,} "
                     f"{old.piece_numel[i]:>10,}  {len(u.params)}")
    total = sum(f["bytes"] for f in m["files"].values())
    lines.append(f"  files       {len(m['files'])} files, {total:,} bytes")
    for name, f in m["files"].items():
        status = ""
        if check:
            e = verify_file(p, name, f)
            status = "  ok" if e is None else f"  BAD: {e}"
        lines.append(f"              {name:<22} {f['dtype']:<8} {f['bytes']:>12,}  sha256 {f['sha256'][:16]}{status}")
    return "\n".join(lines)


def main(argv=None, formats=None) -> int:
    """The command line. ``formats``: {name: export(dir, out, dtype, vocab) -> printed line} of
    the export formats beside ringzero's own; ``python -m ringzero.checkpoint`` hands in "hf"
    (interop/hf_export.py), so that the GPT-2 names stay with the model and the runtime imports none."""
    formats = dict(formats or {})
    ap = argparse.ArgumentParser(prog="python -m ringzero.checkpoint",
                                 description="Export or inspect a ringzero checkpoint (serial, no MPI).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="consolidate the weights into one safetensors file (or a Hugging Face folder)")
    e.add_argument("dir", help="a step-NNNNNN directory, or a save directory (its latest)")
    e.add_argument("out", help="output .safetensors path (written atomically); --format hf: a folder")
    e.add_argument("--dtype", choices=tuple(_OUT), default="fp32",
                   help="fp16/bf16 come from the run's params when it stored that dtype, else from master")
    e.add_argument("--format", choices=("ringzero",) + tuple(formats), default="ringzero",
                   help="ringzero: its own names" + ("; hf: config.json + model.safetensors that transformers' "
                                                     "from_pretrained loads (GPT-2, Llama, Qwen2)"
                                                     if "hf" in formats else ""))
    e.add_argument("--vocab", type=int, default=None,
                   help="--format hf: the token rows to keep (default: the imported model's vocab_size, else all)")
    i = sub.add_parser("inspect", help="print the manifest")
    i.add_argument("dir")
    i.add_argument("--verify", action="store_true", help="also check every file's size and sha256")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "export" and a.format in formats:
            print(formats[a.format](a.dir, a.out, a.dtype, a.vocab))
        elif a.cmd == "export":
            if a.vocab is not None:
                raise CheckpointError(f"--vocab applies to --format {' or '.join(formats) or 'hf'} only")
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
        print(f"ringzero.checkpoint: error: {error_line(err)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
