"""Layer 7: ``auto`` in this process: the state around the pure decision (``_decide``), the cell store
(``_cells``) and the measurer (``_measure``).

The first call of each kind (a *cell*: table size class, row width class, count class, index order class,
duplicate class, cached or not) runs the candidate strategies on that very call (reads only; a scatter writes the
same values each time), keeps the fastest and stores it on disk per machine, so later calls and later processes of
that kind run it directly. The measurements of a process are capped (:data:`RACE_BUDGET_S`); past the cap, inside
CUDA graph capture, or with auto-calibration off, a call uses the nearest measured cell or, with none, the built-in
rules. The index features (order, estimated duplicates) come from a small sample of the indices, with one host
round trip on the first call of each (table, row width, count) kind and again after :data:`RECHECK_EVERY` calls,
then less and less often while the indices keep their order and duplicate classes (none inside graph capture).

``_ops`` asks :func:`choose` for a decision, then runs it with :func:`run` (or :func:`measure` when the decision is
to measure): it passes typed values (a ``Call``, a ``RowJob``), never code.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from torch import Tensor

from . import _cells, _features, _measure
from ._cell import Call, Cell, Features
from ._config import settings
from ._decide import SMALL_CALL_BYTES, Decision, decide, find, forced_plan
from ._strategies import Plan, RowJob

# The index features of a (table, row width, count) kind are computed again RECHECK_EVERY calls after its first
# call, then at intervals that double (up to RECHECK_MAX calls) while the order and duplicate classes stay the same,
# and start again from RECHECK_EVERY when they change. A check costs ~15 small kernels and a host round trip: with
# one every 16 calls, choosing took 39 us per call on an H200 host (2.6 us without checks on a development CPU),
# ~8% of a 131072-row gather of 47 B rows.
RECHECK_EVERY = 16
RECHECK_MAX = 256
# Seconds a process may spend measuring strategies on its calls ("the first call must not stall for long").
RACE_BUDGET_S = 2.0
# A host strategy kept from a measured cell is then watched on its first CHECK_CALLS calls after the first, once
# per cell (``_measure.judge`` says what is learned from them).
CHECK_CALLS = 4

log = logging.getLogger("pytorch_direct")


class _Seen:
    """Per call kind: calls seen, the features last computed, and the decision they gave (kept until the features
    are computed again or the cells change, so that most calls decide with a dictionary lookup); while a host plan
    is being watched (see CHECK_CALLS), the key of its cell, the seconds of its calls and of the caller's work
    between them so far, and when the last call returned."""

    __slots__ = ("calls", "next_check", "interval", "features", "decision", "made_for", "checking", "observed",
                 "between", "last_end")

    def __init__(self) -> None:
        self.calls = 0
        self.next_check = 0  # the features are computed when calls reaches this
        self.interval = RECHECK_EVERY
        self.features: Features | None = None
        self.decision: Decision | None = None
        self.made_for: tuple | None = None
        self.checking = None  # the CellKey of the measurement whose host plan is watched
        self.observed: list = []
        self.between: list = []
        self.last_end: float | None = None


class _State:
    """This process's ``auto``: the cell store, the measuring budget left, per call kind what was seen, and the last
    decision (for diagnostics)."""

    def __init__(self) -> None:
        self.store = _cells.CellStore()
        self.budget_s = RACE_BUDGET_S
        self.kinds: dict = {}
        self.last: Decision | None = None


_state = _State()


def _kind(call: Call, cached: bool) -> tuple:
    return call.kind + (cached,)


def choose(call: Call, idx: Tensor, *, capturing: bool,
           cached: bool = False) -> tuple[Decision, Features | None, tuple[int, int] | None]:
    """The decision for an ``auto`` call with CUDA indices, its features, and the indices' (min, max) when the
    features were computed on this call (then no separate bounds check is needed)."""
    if call.bytes < SMALL_CALL_BYTES:
        _state.last = decide(Cell(call, None, cached), {}, capturing=capturing, may_measure=False)
        return _state.last, None, None
    seen = _state.kinds.get(_kind(call, cached))
    if seen is None:
        seen = _state.kinds[_kind(call, cached)] = _Seen()
    bounds = None
    if not capturing and (seen.features is None or seen.calls >= seen.next_check):
        features, lo, hi = _features.index_features(idx, call.rows, call.row_bytes)
        same = seen.features is not None and features.classes == seen.features.classes
        seen.interval = min(2 * seen.interval, RECHECK_MAX) if same else RECHECK_EVERY
        seen.next_check = seen.calls + seen.interval
        seen.features, seen.decision = features, None
        bounds = (lo, hi)
    seen.calls += 1
    cells = _state.store.cells()  # (reloads, and changes the version, when the cache file setting changed)
    made_for = (_state.store.version, capturing, settings.auto_calibrate)
    if seen.decision is not None and seen.made_for == made_for:
        _state.last = seen.decision
        return seen.decision, seen.features, bounds
    may_measure = settings.auto_calibrate and _state.budget_s > 0
    decision = decide(Cell(call, seen.features, cached), cells, capturing=capturing, may_measure=may_measure)
    _state.last = decision = dataclasses.replace(decision, features=seen.features)
    if decision.plan is not None:
        seen.decision, seen.made_for = decision, made_for
        seen.checking, seen.observed, seen.between, seen.last_end = (
            _cell_to_watch(cells, Cell(call, seen.features, cached), decision), [], [], None)
    return decision, seen.features, bounds


def forced(call: Call, name: str) -> Decision:
    """The decision for a strategy the caller named."""
    return Decision(forced_plan(Cell(call), name, _state.store.cells()), source="forced")


def _cell_to_watch(cells: dict, cell: Cell, decision: Decision):
    """The key of the measured cell whose host plan this decision runs, if its calls are still to be watched."""
    if decision.source != "measured" or not decision.plan.needs_host or cell.features is None:
        return None
    m = find(cells, cell.key)
    if m is None or decision.plan.strategy in m.observed:
        return None
    return m.key


def measure(call: Call, decision: Decision, job: RowJob, *, check_bounds: bool, cached: bool = False) -> Plan:
    """Races ``decision.candidates`` on `job` (the call itself) within the budget left, records the measurement
    (this process and the cache file) and returns the plan kept; the call's output is then written."""
    cell = Cell(call, decision.features, cached)
    result = _measure.race(cell, job, decision.candidates, budget_s=_state.budget_s, check_bounds=check_bounds)
    _state.budget_s -= result.seconds
    _state.store.record({result.measurement.key: result.measurement})
    _state.last = Decision(result.plan, decision.candidates, source="measured now", features=decision.features)
    rates = ", ".join(f"{name} {gbps:.1f}" for name, gbps in result.measurement.gbps.items())
    log.info("auto measured %s in %.0f ms and kept %s (GB/s: %s)", result.measurement.key, result.seconds * 1e3,
             result.measurement.best, rates)
    return result.plan


def run(call: Call, job: RowJob, plan: Plan, *, auto: bool, cached: bool = False, check_bounds: bool,
        in_range: bool) -> None:
    """Runs a decided plan on `job`; an ``auto`` call whose kind's host plan is being watched (CHECK_CALLS) is
    timed from its start until it returns to the caller."""
    seen = _state.kinds.get(_kind(call, cached)) if auto else None
    if seen is None or seen.checking is None:
        _measure.execute(job, plan, check_bounds=check_bounds, in_range=in_range)
        return
    start = _measure._clock()
    _measure.execute(job, plan, check_bounds=check_bounds, in_range=in_range)
    observe(call, start, _measure._clock(), cached=cached)


def checking(call: Call, cached: bool = False) -> bool:
    """Whether calls of this kind are being watched (see CHECK_CALLS)."""
    seen = _state.kinds.get(_kind(call, cached))
    return seen is not None and seen.checking is not None


def observe(call: Call, start: float, end: float, *, cached: bool = False) -> None:
    """One watched call, from its start until it returned to the caller (``_measure._clock`` times). After
    CHECK_CALLS calls following the first (each with the caller's work before it), the cell is judged."""
    seen = _state.kinds.get(_kind(call, cached))
    if seen is None or seen.checking is None:
        return
    if seen.last_end is not None:
        seen.observed.append(end - start)
        seen.between.append(start - seen.last_end)
    seen.last_end = end
    if len(seen.observed) < CHECK_CALLS:
        return
    key, plan = seen.checking, seen.decision.plan
    observed, between = seen.observed, seen.between
    seen.checking, seen.observed, seen.between, seen.last_end = None, [], [], None
    m = _state.store.cells().get(key)
    if m is not None:
        _state.store.record({key: _measure.judge(m, plan, call, observed, between)})


def last_decision() -> Decision | None:
    """The decision of this process's last ``auto`` call with CUDA indices (after measuring: what was kept)."""
    return _state.last


def auto_status() -> dict:
    """What ``auto`` did in this process, for logs (see :func:`pytorch_direct.auto_status`)."""
    last = _state.last
    features = last.features if last is not None else None
    return {
        "strategy": last.plan.strategy if last is not None and last.plan is not None else None,
        "source": last.source if last is not None else None,
        "order": features.order if features is not None else None,
        "duplicates": features.duplicates if features is not None else None,
        "measuring_s": RACE_BUDGET_S - _state.budget_s,
        "measured_cells": len(_state.store.cells()),
    }


def measured_cells() -> dict:
    """The measurements in use (this machine's cache file plus this process's), by key."""
    return dict(_state.store.cells())


def cache_path():
    """The file holding this machine's measurements."""
    return _cells.path()


def reset(*, delete_file: bool = False) -> None:
    """Forgets this process's measurements, features and measuring budget (as in a new process); with
    ``delete_file`` also this machine's cache file (as on a new machine)."""
    global _state
    if delete_file:
        _state.store.delete_file()
    _state = _State()


def calibrate(*, table: Tensor | None = None, table_bytes: int = _measure.CALIBRATION_TABLE_BYTES,
              row_bytes: int | Sequence[int] | None = None, counts: int | Sequence[int] | None = None,
              save: bool = True, verbose: bool = False) -> dict:
    """Measures the gather strategies on `table` (reads only: its contents are not changed) or on a scratch pinned
    table of `table_bytes`, for index patterns uniform / sorted / clustered / Zipf (exponents 0.9 and 1.1) at
    several counts, and stores the cells for this machine (on disk when `save`). ``auto`` then runs the measured
    choice for calls of those kinds without measuring on them first. Returns the measurements, by key (str).

    `row_bytes`: row widths to view the table's bytes at (default: the table's own rows; the scratch table: 64 B
    to 4 KiB). `counts`: rows per call (default 8K to 2M in steps of 4x, at most the table's rows and 1 GiB; each
    cell then also covers the counts 2x either side). `verbose`: print each measured cell as it is done. Took
    0.6-3.2 s per row width on an H200 host (1-48 GiB tables)."""

    def log_cell(m):
        rates = " ".join(f"{s}={v:.1f}" for s, v in m.gbps.items())
        line = (f"calibrate {m.measured_on['row_bytes']:6d} B x {m.measured_on['count']:8d} {m.key.order:9} "
                f"{m.key.dup:5} -> {m.best:13} ({rates} GB/s)")
        log.info(line)
        if verbose:
            print(line, flush=True)

    measured = _measure.calibrate(table=table, table_bytes=table_bytes, row_bytes=row_bytes, counts=counts,
                                  log=log_cell)
    _state.store.record(measured, save=save)  # in this process either way
    return {str(k): m for k, m in measured.items()}

