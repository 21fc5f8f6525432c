"""The Ring's argument checks: everything that must fail before any message is sent.

What it is
    ``check_args(name, send, recv, op, n, rank)`` raises a one-line TypeError
    or ValueError (both sides of the failed check, a hint where one helps) or
    returns the array module. The Ring calls it once per buffer key (plan.py
    keeps the plan of a key that passed), so its cost is not per call.

What it is not
    Any test of what other ranks pass: a length that differs between ranks is
    caught by the received counts (ring.py), not here.
"""
from __future__ import annotations

import numpy as np

from ringzero.comm.backend import get_array_module

DTYPES = [np.dtype(t) for t in ("float16", "float32", "float64", "int32", "int64")]
# and bfloat16, ml_dtypes' (by name: an array of it means ml_dtypes is imported already; importing
# it here would cost every rank about 0.4 s of CPU at start-up, bf16 run or not)
BF16 = "bfloat16"


def takes_dtype(dt) -> bool:
    return dt in DTYPES or dt.name == BF16


def _addr(x) -> int:
    return x.ctypes.data if isinstance(x, np.ndarray) else x.data.ptr


def check_args(name, send, recv, op, n, rank):
    for what, a in (("send", send), ("recv", recv)):
        if not (hasattr(a, "dtype") and hasattr(a, "flags") and hasattr(a, "ndim")):
            raise TypeError(f"ring {name}: expected {what} to be a NumPy or CuPy array, got {type(a).__name__}")
    xp = get_array_module(send, recv)
    for what, a in (("send", send), ("recv", recv)):
        if a.ndim != 1:
            raise ValueError(f"ring {name}: expected 1-D {what}, got shape {a.shape}")
        if not a.flags.c_contiguous:
            raise ValueError(f"ring {name}: expected contiguous {what}, got strides {a.strides} "
                             f"(itemsize {a.itemsize}); HINT: pass a slice of a flat buffer")
    if send.dtype != recv.dtype:
        raise TypeError(f"ring {name}: expected send and recv of one dtype, got {send.dtype} and {recv.dtype}")
    if not takes_dtype(send.dtype):
        raise TypeError(f"ring {name}: expected dtype in {[str(d) for d in DTYPES] + [BF16]}, got {send.dtype}")
    if not getattr(recv.flags, "writeable", True):  # CuPy's flags have no `writeable`
        raise ValueError(f"ring {name}: expected a writeable {'buf' if send is recv else 'recv'}")
    if op not in ("sum", "avg"):
        raise ValueError(f"ring {name}: expected op 'sum' or 'avg', got {op!r}")
    if op == "avg" and send.dtype.kind in "iu":
        raise TypeError(f"ring {name}: op 'avg' needs a floating dtype, got {send.dtype}")
    if name == "reduce_scatter":
        big, small, bigname = send, recv, "send"
    elif name == "all_gather":
        big, small, bigname = recv, send, "recv"
    else:
        return xp
    if len(big) != n * len(small):
        other = "recv" if bigname == "send" else "send"
        raise ValueError(f"ring {name}: expected len({bigname}) == {n}*len({other}) = {n * len(small)}, "
                         f"got {len(big)}")
    # recv may alias send only as block `rank` of the big one (in place).
    b0, s0 = _addr(big), _addr(small)
    if len(small) and s0 < b0 + big.nbytes and b0 < s0 + small.nbytes \
            and s0 != b0 + rank * small.nbytes:
        raise ValueError(f"ring {name}: send and recv overlap other than in place; expected the small one at "
                         f"byte {rank * small.nbytes} of the big one, got byte {s0 - b0}")
    return xp
