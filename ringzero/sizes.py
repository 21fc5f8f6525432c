"""Quantities people type: sizes in bytes, counts, rates and times, one parser for all of them.

What it is
    ``parse_size(text) -> int`` reads a size in bytes the same way everywhere
    (``python -m ringzero.bench -b 4K``, ``--mem-budget 80GiB``,
    ``estimate --gpu-mem 32GB``, the benchmarks' size arguments):

        4096, 1e9          plain bytes (a float form must come out whole)
        4K  16M  1.5G  1T  binary: 2^10, 2^20, 2^30, 2^40 (as nccl-tests' -b/-e)
        4KiB 16MiB 1.5GiB  binary, the same as the bare letter
        4KB 16MB 32GB 1TB  decimal: 10^3, 10^6, 10^9, 10^12 (the ZeRO paper's GB)
        B                  optional on plain bytes: 512B

    So ``32GB`` is 32·10^9 bytes and ``32G`` or ``32GiB`` is 32·2^30: when it
    matters, write the i. Case does not matter (``4k``, ``4kib``). The value
    is computed exactly (Decimal), so ``0.5K`` is 512 and ``1.5G`` is
    1610612736; a size that is not a whole number of bytes, or is below 1, is
    an error.

    ``parse_count(text)`` reads a count (parameters): K, M, B or G, T are
    powers of 1000 (``7.5B`` = 7.5·10^9). ``parse_rate(text)`` reads bytes per
    second: a size with an optional ``/s`` (``100GB/s`` = ``100GBps`` = 10^11).
    ``parse_quantity(text, units, what)`` is the reader under all of them,
    for other units (times: ``10us``). ``human(nbytes)`` writes a size back
    the way the bench prints it: ``4K``, ``64M``, ``1G`` when exact, else bytes.

    Every error is a ``QuantityError``: a ValueError with one line that names
    the text and the accepted forms, which argparse also prints as is when a
    parser is used as an argument ``type``.

What it is not
    No MPI, no numpy: any layer (comm, runtime, tools, app) may import it.
"""
from __future__ import annotations

import argparse
import re
from decimal import Decimal

# size suffixes (upper case): bare letters and the i-forms are binary, the B-forms decimal
SIZE_UNITS = {"": 1, "B": 1,
              "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
              "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
COUNT_UNITS = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}

_NUMBER = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z/]*)\s*")


class QuantityError(ValueError, argparse.ArgumentTypeError):
    """A quantity that cannot be read: one line, the text and the accepted forms."""


def parse_quantity(text, units: dict, what: str, example: str) -> Decimal:
    """Decimal(number) * units[SUFFIX.upper()] for text like '1.5G' (units keyed by upper-case suffix)."""
    m = _NUMBER.fullmatch(str(text))
    unit = m.group(2).upper() if m else None
    if not m or unit not in units:
        raise QuantityError(f"cannot read {what} {text!r}: expected a number with an optional "
                            f"suffix {'/'.join(k for k in units if k)}, e.g. {example}")
    return Decimal(m.group(1)) * Decimal(units[unit])   # exact: '0.1B' is 10**8, not 100000000.00000001


def parse_size(text) -> int:
    """Bytes from '4096', '1e9', '4K' (4096), '4KiB' (4096), '4KB' (4000), '1.5G', '32GB' (32e9).

    K, M, G, T and KiB, MiB, GiB, TiB are powers of 1024; KB, MB, GB, TB
    powers of 1000. The result must be a whole number of bytes >= 1.
    """
    v = parse_quantity(text, SIZE_UNITS, "size", "4096, 4K, 64MiB, 1.5G or 32GB")
    if v != int(v) or v < 1:
        raise QuantityError(f"size {text!r} must be a whole number of bytes >= 1, got {v}")
    return int(v)


def parse_count(text) -> int:
    """'7.5B' -> 7500000000: K, M, B or G, T are powers of 1000; a whole number >= 1."""
    v = parse_quantity(text, COUNT_UNITS, "count", "7.5B")
    if v != int(v) or v < 1:
        raise QuantityError(f"count {text!r} must be a whole number >= 1, got {v}")
    return int(v)


def parse_rate(text, what: str = "rate") -> float:
    """Bytes per second: a size (parse_size's units) with an optional '/s': '100GB/s' -> 1e11."""
    s = str(text).strip()
    body = s[:-2] if s.lower().endswith(("/s", "ps")) else s
    try:
        return float(parse_size(body))
    except QuantityError:
        raise QuantityError(f"cannot read {what} {text!r}: expected a size per second, e.g. 100GB/s, "
                            "25GiB/s or 1e9 (bytes/s)") from None


def human(nbytes: int) -> str:
    """'4K', '64M', '1G' when nbytes is an exact multiple of 2^10, 2^20, 2^30 (parse_size reads it back); else bytes."""
    for unit, f in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= f and nbytes % f == 0:
            return f"{nbytes // f}{unit}"
    return str(nbytes)


_TC_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_link(text) -> float:
    """Bytes per second of a link rate written as tc writes it: '1gbit' -> 1.25e8, '500mbit', '10gbit';
    'mbps' and the other '...bps' are BYTES per second, as in tc; a size per second ('125MB/s') too."""
    s = str(text).strip().lower()
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)([kmgt]?)(bit|bps)", s)
    if m:
        v = float(m.group(1)) * _TC_UNITS[m.group(2)]
        return v / 8 if m.group(3) == "bit" else v
    try:
        return parse_rate(text, "link rate")
    except QuantityError:
        raise QuantityError(f"cannot read link rate {text!r}: expected a tc rate (1gbit, 500mbit, 125mbps) or "
                            "a size per second (125MB/s)") from None
