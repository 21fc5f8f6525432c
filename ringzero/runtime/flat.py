"""The layout table: one declaration of a model's parameters, from which every
flat buffer, named view, padding and shard slice is derived.

What it is
    A model declares its parameters once, as ``ParamSpec(name, shape, init)``
    grouped into ``Unit``s (embeddings, one per transformer block, the head).
    ``Layout(units, shards)`` turns that declaration into arithmetic:

        full flat buffer (one per state class, length ``layout.padded``)
        +-------------- unit 0 --------------+------- unit 1 -------+ ...
        | p0 | p1 | ... | pad                | p0 | p1 | ... | pad  |
        +------+------+------+------+--------+-----+-----+-----+----+
        | piece 0 | piece 1 | ... | piece S-1 |  (each unit split in S = shards equal pieces)

        shard of rank r (length ``layout.shard_numel``)
        [ unit0.piece r | unit1.piece r | unit2.piece r | ... ]

    Each unit is padded to a multiple of ``shards * align`` elements and cut into
    ``shards`` equal contiguous pieces, as FSDP's FlatParameter does. A rank's
    shard of a state class is its piece of every unit, concatenated. So every
    collective is a uniform block reduce-scatter / all-gather on one unit, every
    element has the same reduction order at every stage, and resharding to
    another ``shards`` is slicing by this table.

What it is not
    It allocates nothing but what a caller asks for, and knows nothing of
    stages, dtypes of particular state classes, or communication.

Ψ (``layout.numel``) is computed here and only here; the estimator reuses it.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import numpy as np

ALIGN = 32  # elements; a piece boundary is a multiple of 32 (64 B fp16, 128 B fp32)


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: name (globally unique), shape, init rule, weight decay."""
    name: str
    shape: tuple
    init: str = "normal:0.02"   # "normal:STD" | "zeros" | "ones"
    decay: bool = True          # AdamW weight decay; False for biases and norms

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Unit:
    """A group of parameters gathered, computed and freed together (stage 3).

    ``needs`` names other units whose parameters this unit's forward reads,
    e.g. a head tied to the token embedding needs the embedding unit.
    """
    name: str
    params: tuple
    needs: tuple = ()

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)


@dataclass(frozen=True)
class Slot:
    """Where one parameter sits: its unit, and offsets into the buffers."""
    spec: ParamSpec
    unit: int
    in_unit: int      # offset inside the unit's (padded) segment
    offset: int       # offset inside the full flat buffer


def _parse_init(rule: str):
    kind, _, arg = rule.partition(":")
    if kind not in ("normal", "zeros", "ones"):
        raise ValueError(f"unknown init rule {rule!r}: expected normal:STD, zeros or ones")
    return kind, float(arg) if arg else 0.02


@dataclass
class Layout:
    """Offsets, padding and shards for ``units`` partitioned ``shards`` ways.

    ``shards`` is the size of the sharding group: the world size Nd at stages
    0-3, the ranks of a node Ng for HYBRID (so Nd only where they coincide).
    """
    units: tuple
    shards: int = 1
    align: int = ALIGN
    # derived, filled by __post_init__
    unit_numel: list = field(init=False)      # real elements per unit
    unit_padded: list = field(init=False)     # padded elements per unit (multiple of shards*align)
    unit_offset: list = field(init=False)     # start of unit in the full flat buffer
    piece_numel: list = field(init=False)     # elements of one piece of a unit: unit_padded // shards
    shard_offset: list = field(init=False)    # start of unit's piece in a shard buffer
    slots: dict = field(init=False)           # name -> Slot

    def __post_init__(self):
        self.units = tuple(self.units)
        if self.shards < 1:
            raise ValueError(f"shards must be >= 1, got {self.shards}")
        names = [p.name for u in self.units for p in u.params]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"duplicate parameter names in layout: {dup}")
        unit_names = [u.name for u in self.units]
        for u in self.units:
            for need in u.needs:
                if need not in unit_names:
                    raise ValueError(f"unit {u.name!r} needs unknown unit {need!r}")
        quantum = self.shards * self.align
        self.unit_numel, self.unit_padded, self.unit_offset = [], [], []
        self.piece_numel, self.shard_offset, self.slots = [], [], {}
        off = shard_off = 0
        for ui, u in enumerate(self.units):
            n = u.numel
            padded = max(quantum, -(-n // quantum) * quantum)  # never a zero-size unit
            self.unit_numel.append(n)
            self.unit_padded.append(padded)
            self.unit_offset.append(off)
            self.piece_numel.append(padded // self.shards)
            self.shard_offset.append(shard_off)
            in_unit = 0
            for p in u.params:
                self.slots[p.name] = Slot(p, ui, in_unit, off + in_unit)
                in_unit += p.numel
            off += padded
            shard_off += padded // self.shards

    # ---- sizes -------------------------------------------------------------
    @property
    def numel(self) -> int:
        """Ψ: the number of real parameters."""
        return sum(self.unit_numel)

    @property
    def padded(self) -> int:
        """Length of a full flat buffer, padding included (= shards * shard_numel)."""
        return sum(self.unit_padded)

    @property
    def shard_numel(self) -> int:
        """Length of one rank's shard buffer."""
        return self.padded // self.shards

    @property
    def max_unit_padded(self) -> int:
        return max(self.unit_padded)

    def unit_index(self, name: str) -> int:
        for i, u in enumerate(self.units):
            if u.name == name:
                return i
        raise KeyError(f"no unit named {name!r}")

    def needs(self, ui: int) -> tuple:
        """Indices of the units whose parameters unit ``ui`` reads (itself first)."""
        return (ui,) + tuple(self.unit_index(n) for n in self.units[ui].needs)

    # ---- views -------------------------------------------------------------
    def views(self, buf, unit: int | None = None) -> dict:
        """Named, shaped views into ``buf``.

        unit=None: ``buf`` is a full flat buffer (length ``padded``), all params.
        unit=i:    ``buf`` holds unit i's segment only (length >= unit_padded[i]).
        """
        if unit is None:
            if buf.size < self.padded:
                raise ValueError(f"expected a full buffer of >= {self.padded} elements, got {buf.size}")
            return {n: buf[s.offset:s.offset + s.spec.numel].reshape(s.spec.shape)
                    for n, s in self.slots.items()}
        if buf.size < self.unit_numel[unit]:
            raise ValueError(f"expected >= {self.unit_numel[unit]} elements for unit "
                             f"{self.units[unit].name!r}, got {buf.size}")
        return {p.name: buf[self.slots[p.name].in_unit:self.slots[p.name].in_unit + p.numel]
                .reshape(p.shape) for p in self.units[unit].params}

    def unit_full(self, buf, ui: int):
        """Unit ``ui``'s padded segment of a full flat buffer."""
        o = self.unit_offset[ui]
        return buf[o:o + self.unit_padded[ui]]

    def unit_shard(self, shard, ui: int):
        """Unit ``ui``'s piece inside a shard buffer."""
        o = self.shard_offset[ui]
        return shard[o:o + self.piece_numel[ui]]

    def own(self, seg, ui: int, rank: int):
        """Rank's piece inside unit ``ui``'s padded segment ``seg`` (a unit-sized
        buffer: a gather slot, a gradient bucket, or ``unit_full``)."""
        p = self.piece_numel[ui]
        return seg[rank * p:(rank + 1) * p]

    def piece(self, buf, ui: int, rank: int):
        """Piece (ui, rank) of a state buffer held in full (length ``padded``) or
        as rank's shard (length ``shard_numel``; at shards = 1 the two coincide)."""
        if buf.size == self.padded:
            return self.own(self.unit_full(buf, ui), ui, rank)
        return self.unit_shard(buf, ui)

    def shard_ranges(self, rank: int):
        """Yield (unit, full_start, full_stop, shard_start) for rank's pieces."""
        for ui in range(len(self.units)):
            start = self.unit_offset[ui] + rank * self.piece_numel[ui]
            yield ui, start, start + self.piece_numel[ui], self.shard_offset[ui]

    # ---- init ---------------------------------------------------------------
    def init_param(self, name: str, seed: int) -> np.ndarray:
        """Float32 initial value of one parameter, a pure function of (seed, name).

        Independent of shards, rank and stage, so every partitioning starts from
        the same global weights, bit for bit.
        """
        s = self.slots[name].spec
        kind, std = _parse_init(s.init)
        if kind == "zeros":
            return np.zeros(s.numel, np.float32)
        if kind == "ones":
            return np.ones(s.numel, np.float32)
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        return (rng.standard_normal(s.numel, dtype=np.float32) * np.float32(std))

    def init_full(self, out, seed: int):
        """Fill a full flat host buffer with initial values (padding zero)."""
        out[...] = 0
        for name, s in self.slots.items():
            out[s.offset:s.offset + s.spec.numel] = self.init_param(name, seed)
        return out

    def init_shard(self, out, seed: int, rank: int):
        """Fill rank's shard host buffer; transient memory is one parameter."""
        out[...] = 0
        for name, s in self.slots.items():
            a, b = s.offset, s.offset + s.spec.numel
            val = None
            for ui, fa, fb, so in self.shard_ranges(rank):
                lo, hi = max(a, fa), min(b, fb)
                if lo < hi:
                    if val is None:
                        val = self.init_param(name, seed)
                    out[so + lo - fa:so + hi - fa] = val[lo - a:hi - a]
        return out

    # ---- description (checkpoint manifests, reports) -----------------------
    def describe(self) -> dict:
        return {
            "shards": self.shards, "align": self.align, "numel": self.numel,
            "padded": self.padded,
            "units": [{"name": u.name, "needs": list(u.needs),
                       "numel": self.unit_numel[i], "padded": self.unit_padded[i],
                       "params": [{"name": p.name, "shape": list(p.shape),
                                   "init": p.init, "decay": p.decay} for p in u.params]}
                      for i, u in enumerate(self.units)],
        }


def units_from_description(d: dict) -> tuple:
    """Inverse of ``Layout.describe()['units']``: rebuild the declaration."""
    return tuple(Unit(u["name"], tuple(ParamSpec(p["name"], tuple(p["shape"]), p["init"], p["decay"])
                                       for p in u["params"]), tuple(u["needs"]))
                 for u in d["units"])
