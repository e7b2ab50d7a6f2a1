"""Layer 5: the decision of an ``auto`` call, as pure functions of a :class:`Cell` (the call and its index features)
and the measurements known on this machine. Nothing here measures, stores or runs anything.

What decides the fastest strategy (measured on H200 hosts):

- the table's size and memory kind: in pinned memory (cudaHostAlloc or registered: 4 KiB GPU mappings), past the
  GPU's address-translation reach (a few GiB) random zero-copy reads of small rows collapse (16-48 GiB tables:
  7-30 GB/s) while a 1 GiB table still runs them at 14-50 GB/s, so nothing measured on a small scratch table
  carries over to a large one; managed memory (large GPU mappings, ``_memory``) keeps its speed at 48 GiB;
- the row width, the density (rows asked / table rows), the index order (sorted and clustered indices make
  zero-copy reads sequential; random ones need sorting or the CPU) and the duplicates (each repeated row crosses
  PCIe once with ``dedupe``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ._cell import Cell, CellKey, Measurement
from ._strategies import REGISTRY, Plan, Split

# Below this many bytes a call is latency-bound: one kernel launch beats sorting, copying indices or measuring.
SMALL_CALL_BYTES = 256 << 10
# A host strategy (staged, dedupe_staged, split) must measure this much faster than the best device-only one: host
# speeds vary more from call to call. With 1.25, 8 of 18 cells that ran below 0.9x the best forced strategy in one
# H200 benchmark had turned down a host plan 1.04-1.23x ahead; a caller whose thread a host plan would hold is
# caught by the in-use check instead (``_auto``).
HOST_MARGIN = 1.1
# Pinned tables larger than this are assumed past the GPU's address-translation reach by the built-in rules
# (managed ones are mapped with large pages: random 256 B rows of a 48 GiB managed table read at 51 GB/s).
TRANSLATION_REACH_BYTES = 4 << 30

Measurements = Mapping[CellKey, Measurement]


@dataclasses.dataclass(frozen=True)
class Decision:
    """``plan``: run it. None: measure ``candidates`` on this call first. ``source`` says where the plan came from
    ("small", "measured", "nearest", "rules", "forced", "measured now"); ``features``: the index features it was
    decided on."""

    plan: Plan | None
    candidates: tuple[str, ...] = ()
    source: str = ""
    features: object = None


def pick(gbps: Mapping[str, float]) -> str | None:
    """The fastest measured strategy; a host strategy only at >= HOST_MARGIN x the fastest device-only one."""
    device = {s: v for s, v in gbps.items() if s in REGISTRY and not Plan(s).needs_host}
    host = {s: v for s, v in gbps.items() if s in REGISTRY and Plan(s).needs_host}
    best_device = max(device, key=device.get) if device else None
    best_host = max(host, key=host.get) if host else None
    if best_host is None or (best_device is not None and host[best_host] < HOST_MARGIN * device[best_device]):
        return best_device
    return best_host


def plan_from(m: Measurement, capturing: bool) -> Plan | None:
    """The plan a measurement keeps. Host strategies cannot run inside graph capture, and would hold a busy
    caller's thread: then the best device-only one measured (None if there is none)."""
    gbps = m.gbps
    if capturing or m.caller_busy:
        gbps = {s: v for s, v in gbps.items() if s in REGISTRY and not Plan(s).needs_host}
    best = pick(gbps)
    if best is None:
        return None
    if best == Split.name:
        return Plan(best, m.split_fraction if m.split_fraction is not None else 0.5, m.split_kernel or "vector")
    return Plan(best)


def find(measurements: Measurements, key: CellKey) -> Measurement | None:
    """The measurement that covers this cell: its own, or one whose count class lies within the other's span
    (``calibrate`` measures every other count class, so its cells span one class on each side)."""
    found = measurements.get(key)
    if found is not None:
        return found
    covering = [m for m in measurements.values() if m.covers(key)]
    return min(covering, key=lambda m: abs(m.key.count_class - key.count_class)) if covering else None


def nearest(measurements: Measurements, cell: Cell) -> Measurement | None:
    """The closest measurement of the same op, table size class, row width class and cache: same index classes
    first, then the nearest count class."""
    partial = cell.partial_key
    same = [m for m in measurements.values() if m.key.same_kind(partial, with_features=False)]
    if not same:
        return None
    key = cell.key if cell.features is not None else None
    return min(same, key=lambda m: (key is None or not m.key.same_kind(key),
                                    abs(m.key.count_class - partial.count_class)))


def rules(cell: Cell, capturing: bool) -> Plan:
    """The built-in choice where nothing was measured, from H200 measurements: cached tables -> ``cached``, or
    ``cached_sorted`` for random rows of pinned tables past the translation reach; heavy duplicates -> dedupe;
    sorted or clustered indices, or rows >= 2 KiB -> vector (reads are sequential, or long enough); small rows at
    low density of a pinned table past the translation reach -> staged (the CPU gathers them at 20-30 GB/s,
    zero-copy reads at 2-10); otherwise sorted."""
    call, features = cell.call, cell.features
    order = features.order if features is not None else "random"
    duplicates = features.duplicates if features is not None else 0.0
    far = call.memory != "managed" and call.table_bytes > TRANSLATION_REACH_BYTES
    if cell.cached and call.op == "gather":
        return Plan("cached_sorted" if order == "random" and far and call.row_bytes < 2048 else "cached")
    if call.op == "gather" and duplicates >= 0.3:
        return Plan("dedupe")
    if order != "random" or call.row_bytes >= 2048:
        return Plan("vector")
    if call.op == "gather" and not capturing and far and call.row_bytes <= 512 and call.density < 0.005:
        return Plan("staged")
    return Plan("sorted")


def candidates(cell: Cell) -> tuple[str, ...]:
    """The strategies worth measuring on this call (each strategy's ``candidate``), the rules' choice first (it is
    the one kept if the measuring budget runs out after it), in registry order after it (split after the kernels and
    staged it is made of)."""
    found = [name for name, s in REGISTRY.items() if s.candidate(cell)]
    first = rules(cell, capturing=False).strategy
    return tuple([first] + [s for s in found if s != first])


def decide(cell: Cell, measurements: Measurements, *, capturing: bool, may_measure: bool) -> Decision:
    """The decision for one call: a pure function of the cell (the call and its index features, None when they
    could not be computed, e.g. inside graph capture before any call of this kind) and the measurements."""
    if cell.call.bytes < SMALL_CALL_BYTES:
        return Decision(Plan("cached" if cell.cached and cell.call.op == "gather" else "vector"), source="small")
    if cell.features is not None:
        m = find(measurements, cell.key)
        # (a cell that a spent budget left incomplete is measured again where there is budget)
        if m is not None and (m.complete or capturing or not may_measure):
            plan = plan_from(m, capturing)
            if plan is not None:
                return Decision(plan, source="measured")
        if may_measure and not capturing:
            return Decision(None, candidates(cell), source="measure")
    m = nearest(measurements, cell)
    if m is not None:
        plan = plan_from(m, capturing)
        if plan is not None:
            return Decision(plan, source="nearest")
    return Decision(rules(cell, capturing), source="rules")


def forced_plan(cell: Cell, name: str, measurements: Measurements) -> Plan:
    """The plan of a strategy named by the caller. ``split`` takes its share from the nearest measured cell of the
    same table and row width (or an even split)."""
    if name != Split.name or cell.call.op != "gather":
        return Plan(name)
    m = nearest(measurements, Cell(cell.call, None, cell.cached))
    if m is not None and m.split_fraction is not None:
        return Plan(Split.name, m.split_fraction, m.split_kernel or "vector")
    return Plan(Split.name, 0.5, "sorted" if cell.call.row_bytes < 2048 else "vector")
