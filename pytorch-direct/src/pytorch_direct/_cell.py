"""Layer 3: the typed values ``auto`` decides over, with no behaviour beyond their own arithmetic.

- :class:`Call`: the shape of one row operation (op, table size and memory kind, rows, row width, rows moved).
- :class:`Features`: what a sample of its indices says (order, estimated duplicates).
- :class:`Cell`: a call with its features (and whether the table has a GPU cache): what ``decide`` is asked about.
- :class:`CellKey`: the class of a cell (sizes rounded to classes): what a measurement is stored under.
- :class:`Measurement`: the measured speeds of the strategies in one cell, as stored on disk.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping

OPS = ("gather", "scatter")
ORDERS = ("sorted", "clustered", "random")
DUPLICATE_CLASSES = ("none", "some", "heavy")


@dataclasses.dataclass(frozen=True)
class Call:
    """The shape of one call: op ("gather" or "scatter"), table size, rows, row width, rows moved, and the kind of
    host memory the table is in ("pinned" or "managed", see ``_memory``: they differ past the translation reach)."""

    op: str
    table_bytes: int
    rows: int
    row_bytes: int
    count: int
    memory: str = "pinned"

    @property
    def bytes(self) -> int:
        return self.count * self.row_bytes

    @property
    def density(self) -> float:
        return self.count / max(self.rows, 1)

    @functools.cached_property  # (read more than once per call)
    def kind(self) -> tuple:
        """What the per-kind feature state is keyed by (the features themselves are not)."""
        return (self.op, table_class(self.table_bytes, self.memory), row_class(self.row_bytes),
                count_class(self.count))


@dataclasses.dataclass(frozen=True)
class Features:
    """Index features from a sample: ``ascending`` and ``near`` are fractions of consecutive index pairs that do not
    decrease / whose rows lie close together (``_features.NEAR_BYTES``); ``duplicates`` is the estimated fraction of
    the indices that repeat an earlier one (0: all distinct)."""

    ascending: float
    near: float
    duplicates: float

    @property
    def order(self) -> str:
        if self.ascending >= 0.999:  # (runs of consecutive rows in random order are "clustered")
            return "sorted"
        if self.near >= 0.5:
            return "clustered"
        return "random"

    @property
    def duplicate_class(self) -> str:
        if self.duplicates < 0.01:
            return "none"
        return "some" if self.duplicates < 0.3 else "heavy"

    @property
    def classes(self) -> tuple[str, str]:
        return self.order, self.duplicate_class


def table_class(table_bytes: int, memory: str) -> str:
    """The size class (log2 of the bytes) and the memory kind: "t" pinned, "m" managed."""
    return f"{'m' if memory == 'managed' else 't'}{round(math.log2(max(table_bytes, 1)))}"


def row_class(row_bytes: int) -> int:
    return round(2 * math.log2(max(row_bytes, 1)))  # half octaves: 47 B and 64 B rows differ


def count_class(count: int) -> int:
    return round(math.log2(max(count, 1)))


@dataclasses.dataclass(frozen=True)
class CellKey:
    """The class of a cell. ``cached``: the table has a GPU cache of hot rows (its gathers have their own
    strategies). Written as ``gather|m34|r16|n20|random|none`` (``|cached`` appended for cached tables)."""

    op: str
    table_class: str
    row_class: int
    count_class: int
    order: str
    dup: str
    cached: bool = False

    def __str__(self) -> str:
        text = f"{self.op}|{self.table_class}|r{self.row_class}|n{self.count_class}|{self.order}|{self.dup}"
        return text + "|cached" if self.cached else text

    @classmethod
    def parse(cls, text: str) -> CellKey:
        parts = text.split("|")
        if len(parts) not in (6, 7) or (len(parts) == 7 and parts[6] != "cached"):
            raise ValueError(f"not a cell key: {text!r}")
        op, table, row, count, order, dup = parts[:6]
        if op not in OPS or order not in ORDERS or dup not in DUPLICATE_CLASSES or row[:1] != "r" or count[:1] != "n":
            raise ValueError(f"not a cell key: {text!r}")
        return cls(op, table, int(row[1:]), int(count[1:]), order, dup, len(parts) == 7)

    def same_kind(self, other: CellKey, *, with_features: bool = True) -> bool:
        """Same op, table class, row class and cache (and, `with_features`, the same index classes)."""
        if (self.op, self.table_class, self.row_class, self.cached) != (
                other.op, other.table_class, other.row_class, other.cached):
            return False
        return not with_features or (self.order, self.dup) == (other.order, other.dup)


@dataclasses.dataclass(frozen=True)
class Cell:
    """One call and its index features (None when they could not be computed, e.g. inside CUDA graph capture before
    any call of this kind), and whether the table has a GPU cache of hot rows."""

    call: Call
    features: Features | None = None
    cached: bool = False

    @property
    def key(self) -> CellKey:
        """The class this cell is measured and stored under (needs the features)."""
        if self.features is None:
            raise ValueError("a cell without index features has no key")
        op, table, row, count = self.call.kind
        return CellKey(op, table, row, count, self.features.order, self.features.duplicate_class, self.cached)

    @property
    def partial_key(self) -> CellKey:
        """The key with placeholder index classes: for matching op, table, row width and cache only."""
        op, table, row, count = self.call.kind
        return CellKey(op, table, row, count, "random", "none", self.cached)


@dataclasses.dataclass(frozen=True)
class Measurement:
    """The measured rates (GB/s) of the strategies in one cell, and what was learned about them in use.

    ``span``: count classes on either side this measurement also covers (``calibrate`` measures every other
    class). ``complete``: every candidate was measured (the measuring budget may stop early). ``best``: the plan
    kept. ``split_fraction``/``split_kernel``: the split plan's parameters when it was measured. ``observed``: rates
    seen in use, per strategy; ``caller_busy``: the caller works longer between calls than a host plan holds it.
    ``measured_on``: the exact call it was measured on (for reports)."""

    key: CellKey
    gbps: Mapping[str, float]
    best: str
    span: int = 0
    complete: bool = True
    split_fraction: float | None = None
    split_kernel: str | None = None
    observed: Mapping[str, float] = dataclasses.field(default_factory=dict)
    caller_busy: bool = False
    measured_on: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def covers(self, key: CellKey) -> bool:
        return self.key.same_kind(key) and abs(self.key.count_class - key.count_class) <= self.span

    def to_json(self) -> dict:
        d = {"gbps": dict(self.gbps), "best": self.best, "span": self.span, "complete": self.complete}
        if self.split_fraction is not None:
            d["split_fraction"], d["split_kernel"] = self.split_fraction, self.split_kernel
        if self.observed:
            d["observed"] = dict(self.observed)
        if self.caller_busy:
            d["caller_busy"] = True
        if self.measured_on:
            d["measured_on"] = dict(self.measured_on)
        return d

    @classmethod
    def from_json(cls, key: str, d: dict) -> Measurement:
        """Raises ValueError (or KeyError, TypeError) for an entry that is not a measurement."""
        gbps = {str(s): float(v) for s, v in dict(d["gbps"]).items()}
        if not gbps:
            raise ValueError("a measurement without rates")
        return cls(CellKey.parse(key), gbps, str(d["best"]), int(d.get("span", 0)), bool(d.get("complete", True)),
                   d.get("split_fraction"), d.get("split_kernel"),
                   {str(s): float(v) for s, v in dict(d.get("observed", {})).items()},
                   bool(d.get("caller_busy", False)), dict(d.get("measured_on", {})))
