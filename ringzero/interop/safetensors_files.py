"""safetensors files read by hand: the header, then zero-copy views of each tensor, bf16 included.

What it is
    ``TensorFile(path)`` parses a ``.safetensors`` file's header (8 bytes of
    little-endian header length, then JSON: ``{key: {dtype, shape,
    data_offsets: [begin, end]}}``, ``__metadata__`` aside), checks every
    tensor's byte range against its shape and dtype and against the file's
    size, and maps the file read-only (``mmap``). ``get_slice(key)`` gives a
    ``TensorSlice`` with safetensors' own interface (``get_shape``,
    ``get_dtype``, ``[rows]``, ``[rows, cols]``), so that a caller reads only
    the bytes it indexes: the pages of a ranged read, never a whole tensor.

        F32, F16, F64   read as they are, then cast to float32
        BF16            read as uint16, shifted left 16 bits into a uint32 and
                        viewed as float32: exact (bf16 is float32's top half),
                        without torch or ml_dtypes

    ``locate(path)``: (config.json, [files]) of a folder (``model.safetensors``
    or ``model.safetensors.index.json``), a single file or an index.

What it is not
    No writer (runtime/export.py writes), no pickle (``pytorch_model.bin`` is
    refused with a hint), no other dtypes (integer tensors are no weights).
"""
from __future__ import annotations

import json
import mmap
import os
import struct
from typing import NamedTuple

import numpy as np

CONFIG, SINGLE, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
# file dtype -> (NumPy dtype the bytes are read as, bytes per element)
DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "F64": np.dtype("<f8"), "BF16": np.dtype("<u2")}


class Part(NamedTuple):
    """One file tensor's share of a ringzero parameter: ``width`` columns of a 2-D parameter (or
    elements of a 1-D one), left to right in the order of the parameter's Parts."""
    key: str              # the tensor's key in the file (a family may strip a prefix: interop/hf_families.py)
    width: int
    transposed: bool      # the file holds (width, rows): the parameter's block is its transpose


class HFConfigError(ValueError):
    """A Hugging Face folder, config.json, weight file or index (or a checkpoint's manifest) that describes
    no model ringzero reads and computes exactly: one line. Every interop module raises this one class."""


def widen(a: np.ndarray, dtype: str) -> np.ndarray:
    """float32 of an array read as ``DTYPES[dtype]``: bf16's uint16 bits become float32's top half."""
    if dtype == "BF16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


class TensorSlice:
    """One tensor of a TensorFile: its shape and dtype, and float32 copies of what is indexed."""

    def __init__(self, raw: np.ndarray, dtype: str):
        self.raw, self.dtype = raw, dtype          # raw: a read-only view of the mapped file

    def get_shape(self):
        return list(self.raw.shape)

    def get_dtype(self) -> str:
        return self.dtype

    def __getitem__(self, index) -> np.ndarray:
        return widen(self.raw[index], self.dtype)


class TensorFile:
    """A .safetensors file, mapped read-only; ``keys()`` and ``get_slice(key)`` as safetensors' safe_open."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(8)
            if len(head) < 8:
                raise HFConfigError(f"{path}: not a readable safetensors file: {size} bytes, too short for a header "
                                    f"(8-byte length + JSON)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise HFConfigError(f"{path}: not a readable safetensors file: header length {n:,} is more than the "
                                    f"file's {size - 8:,} bytes after it (a truncated file?)")
            try:
                meta = json.loads(fh.read(n))
            except ValueError as e:
                raise HFConfigError(f"{path}: not a readable safetensors file: the header is not JSON ({e})") from None
            self._mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size > 0 else None
        if not isinstance(meta, dict):
            raise HFConfigError(f"{path}: not a readable safetensors file: the header is not a JSON object")
        self.metadata = meta.pop("__metadata__", None) or {}
        self.base, self.tensors = 8 + n, {}
        for k, v in meta.items():
            try:
                dt, shape, (b, e) = v["dtype"], tuple(int(d) for d in v["shape"]), v["data_offsets"]
            except (TypeError, KeyError, ValueError) as err:
                raise HFConfigError(f"{path}: tensor {k!r} has a malformed header entry {v!r} ({err})") from None
            if dt not in DTYPES:
                raise HFConfigError(f"{path}: {k!r} is {dt}: expected F32, F16, BF16 or F64 weights")
            numel = int(np.prod(shape)) if shape else 1
            if e - b != numel * DTYPES[dt].itemsize or b < 0 or self.base + e > size:
                raise HFConfigError(f"{path}: {k!r} ({dt} {shape}) needs {numel * DTYPES[dt].itemsize:,} bytes, its "
                                   f"data_offsets give [{b}, {e}) in a file of {size - self.base:,} data bytes")
            self.tensors[k] = (dt, shape, b)

    def keys(self):
        return list(self.tensors)

    def get_slice(self, key: str) -> TensorSlice:
        dt, shape, b = self.tensors[key]
        numel = int(np.prod(shape)) if shape else 1
        raw = np.frombuffer(self._mm, DTYPES[dt], count=numel, offset=self.base + b) if numel else \
            np.zeros(0, DTYPES[dt])
        return TensorSlice(raw.reshape(shape), dt)

    def close(self):
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:        # a caller still holds a view: the map goes with the last one
                pass
            self._mm = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def locate(path: str, what: str = "--init-from"):
    """(config.json, [safetensors files]) for a folder, a file or an index. Raises HFConfigError."""
    if os.path.isdir(path):
        folder, single, index = path, os.path.join(path, SINGLE), os.path.join(path, INDEX)
        if os.path.isfile(single):
            weights = [single]
        elif os.path.isfile(index):
            weights = index_files(index)
        else:
            bins = [f for f in os.listdir(path) if f.endswith(".bin")]
            hint = (f" (found {bins[0]}: a pickle, which ringzero does not read; save the model with "
                    f"save_pretrained, which writes safetensors)" if bins else "")
            raise HFConfigError(f"{what} {path!r}: no {SINGLE} and no {INDEX} in the folder{hint}")
    elif os.path.isfile(path):
        folder = os.path.dirname(os.path.abspath(path))
        weights = index_files(path) if path.endswith(".json") else [path]
    else:
        raise HFConfigError(f"{what} {path!r} does not exist: expected a Hugging Face folder "
                           f"({CONFIG} + {SINGLE}), a .safetensors file or a {INDEX}")
    cfg = os.path.join(folder, CONFIG)
    if not os.path.isfile(cfg):
        raise HFConfigError(f"{what} {path!r}: no {CONFIG} in {folder!r}: the weights do not give "
                           f"the head count; put the model's {CONFIG} beside them")
    return cfg, weights


def index_files(index: str) -> list:
    """The shard files a model.safetensors.index.json names, each checked to exist."""
    try:
        with open(index, encoding="utf-8") as fh:
            wm = json.load(fh)["weight_map"]
        files = sorted(set(wm.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise HFConfigError(f"{index}: not a safetensors index (expected {{'weight_map': {{key: file}}}}: "
                           f"{type(e).__name__}: {e})") from None
    out = [os.path.join(os.path.dirname(os.path.abspath(index)), f) for f in files]
    for f in out:
        if not os.path.isfile(f):
            raise HFConfigError(f"{index}: names shard {os.path.basename(f)!r}, which is not in its folder")
    return out
