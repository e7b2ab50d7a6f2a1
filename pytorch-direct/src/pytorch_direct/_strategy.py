"""Layer 3: deciding how an ``auto`` call moves its rows. Execution is ``_kernels``'s; the decision is made here.

What decides the fastest strategy (benchmarks/RESULTS.md has the measurements):

- the table's size and memory kind: in pinned memory (cudaHostAlloc or registered: 4 KiB GPU mappings), past the
  GPU's address-translation reach (a few GiB) random zero-copy reads of small rows collapse (16-48 GiB tables:
  7-30 GB/s) while a 1 GiB table still runs them at 14-50 GB/s, so nothing measured on a small scratch table
  carries over to a large one; managed memory (large GPU mappings, ``_memory``) keeps its speed at 48 GiB;
- the row width, the density (rows asked / table rows), the index order (sorted and clustered indices make
  zero-copy reads sequential; random ones need sorting or the CPU) and the duplicates (each repeated row crosses
  PCIe once with ``dedupe``).

So ``auto`` measures where the user's calls happen: the first call of each kind (a *cell*: table size class, row
width class, count class, index order class, duplicate class) runs the candidate strategies on that very call
(reads only; a scatter writes the same values each time), keeps the fastest and stores it on disk per machine, so
later calls and later processes of that kind run it directly. The measurements of a process are capped
(:data:`RACE_BUDGET_S`); past the cap, inside CUDA graph capture, or with auto-calibration off, a call uses the
nearest measured cell or, with none, :func:`rules` from the H200 measurements. The index features (order,
estimated duplicates) come from a small sample of the indices, with one host round trip on the first call of each
(table, row width, count) kind and again after :data:`RECHECK_EVERY` calls, then less and less often while the
indices keep their order and duplicate classes (none inside graph capture).

:func:`decide` is the whole decision as a pure function of the measured cells, the call and its features.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import tempfile
import time
from pathlib import Path

import torch
from torch import Tensor

from . import _core, _kernels, _memory
from ._config import settings
from ._kernels import HOST_PLANS, Plan

# Below this many bytes a call is latency-bound: one kernel launch beats sorting, copying indices or measuring.
SMALL_CALL_BYTES = 256 << 10
# The index features of a (table, row width, count) kind are computed again RECHECK_EVERY calls after its first
# call, then at intervals that double (up to RECHECK_MAX calls) while the order and duplicate classes stay the same,
# and start again from RECHECK_EVERY when they change. A check costs ~15 small kernels and a host round trip: with
# one every 16 calls, choose() took 39 us per call on an H200 host (probe P5b; 2.6 us without checks on the dev CPU),
# ~8% of a 131072-row gather of 47 B rows.
RECHECK_EVERY = 16
RECHECK_MAX = 256
# Seconds a process may spend measuring strategies on its calls ("the first call must not stall for long").
RACE_BUDGET_S = 2.0
# A host strategy (staged, dedupe_staged, split) must measure this much faster than the best device-only one: host
# speeds vary more from call to call. (Runs K-O used 1.25, set after a GNN training loop kept a host plan that held
# its thread, integration-tests E9; the in-use check below now takes care of such callers. In run O, 8 of the 18
# cells below 0.9x the best forced strategy had a host plan 1.04-1.23x ahead that 1.25 turned down.)
HOST_MARGIN = 1.1
# A host strategy kept from a measured cell is then watched on its first CHECK_CALLS calls after the first, once
# per cell: how long each call held the caller's thread, and how long the caller worked between calls. A host plan
# holds the thread until its rows are gathered, where a GPU plan returns after queueing them, so:
# - when the caller's own work between calls takes longer than the call as measured (the median of the gaps: a
#   training step between two gathers, not a loop that only gathers), the cell serves GPU plans only from then on
#   ("caller_busy").
#   In integration-tests run E36 one GNN process in four kept split (measured 36.9 GB/s against vector's 28.3) and
#   spent 0.44-0.79 s per epoch in its gather phase, against 0.28-0.29 s in the three that kept a GPU plan; E23 and
#   E35 show the same split of processes;
# - when the fastest call ran below CHECK_SLOWER x the plan's measured rate (it waits for the GPU work making its
#   indices, or for the CPU), the cell's rate for it becomes the observed one.
# Either way the call kind is decided again, and the cell (on disk) counts as checked for that plan.
CHECK_CALLS = 4
CHECK_SLOWER = 0.7
# Candidates within this factor of the fastest are measured again before one is kept (one noisy run must not
# decide a cell: in H200 run I auto kept plans whose steady speed was down to 0.73x another candidate's); calls
# shorter than SHORT_CALL_S are timed three times from the start.
RETIME_WITHIN = 1.3
SHORT_CALL_S = 3e-3
# Index sample sizes: a contiguous window for the order, strided positions for the duplicates.
ORDER_WINDOW = 2048
DUPLICATE_SAMPLE = 4096
# Consecutive indices whose rows lie within this many bytes count as "near" (clustered reads).
NEAR_BYTES = 64 << 10
# Pinned tables larger than this are assumed past the GPU's address-translation reach by the built-in rules
# (managed ones are mapped with large pages: probe P7 read random 256 B rows of 48 GiB at 51 GB/s).
TRANSLATION_REACH_BYTES = 4 << 30
# calibrate(): row widths of a scratch table, counts, and the index patterns measured.
ROW_BYTES = (64, 128, 256, 512, 1024, 2048, 4096)
CALIBRATION_COUNTS = (1 << 13, 1 << 15, 1 << 17, 1 << 19, 1 << 21)
# (pattern, Zipf exponent): no duplicates in three orders, some and many duplicates.
CALIBRATION_PATTERNS = (("uniform", 0), ("sorted", 0), ("clustered", 0), ("zipf", 0.9), ("zipf", 1.1))
CALIBRATION_TABLE_BYTES = 1 << 30
CACHE_FORMAT = 3  # 3: table classes name the memory kind


# ---------------------------------------------------------------------------------------------------- features


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
        return (self.op, _table_class(self.table_bytes, self.memory), _row_class(self.row_bytes),
                _count_class(self.count))


@dataclasses.dataclass(frozen=True)
class Features:
    """Index features from a sample: ``ascending`` and ``near`` are fractions of consecutive index pairs that do not
    decrease / whose rows lie within :data:`NEAR_BYTES`; ``duplicates`` is the estimated fraction of the indices
    that repeat an earlier one (0: all distinct)."""

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


def estimate_duplicates(count: int, rows: int, sample: int, distinct: int, distinct_quarter: int) -> float:
    """Estimated fraction of `count` indices that repeat an earlier one, from a sample of `sample` of them holding
    `distinct` distinct values (and `distinct_quarter` in its first quarter). Distinct values grow like a power of
    the number drawn (``n ** a``: a = 1 for distinct indices, a < 1 for skewed ones such as Zipf); a is fitted on
    the two sample sizes and extrapolated to `count`. Exact when the sample is the whole index."""
    if count <= 0 or sample <= 0:
        return 0.0
    if sample >= count:
        return 1.0 - distinct / count
    quarter = max(1, sample // 4)
    a = 1.0
    if distinct_quarter > 0 and distinct > 0:
        a = min(1.0, max(0.0, math.log(distinct / distinct_quarter) / math.log(sample / quarter)))
    expected = distinct * (count / sample) ** a
    expected = min(expected, count, max(rows, 1))
    return max(0.0, 1.0 - expected / count)


def index_features(idx: Tensor, rows: int, row_bytes: int) -> tuple[Features, int, int]:
    """Features of 1-D indices on the GPU, and their min and max (for the bounds check), with one host round trip.
    About 15 small kernels on samples of a few thousand indices, whatever the count."""
    n = idx.numel()
    window = idx[: min(n, ORDER_WINDOW)]
    step = window[1:] - window[:-1]
    near_rows = max(1, NEAR_BYTES // max(row_bytes, 1))
    sample = idx[:: max(1, n // DUPLICATE_SAMPLE)][:DUPLICATE_SAMPLE]
    s = sample.numel()
    values, position = torch.sort(sample, stable=True)
    first = torch.ones(s, dtype=torch.bool, device=idx.device)
    if s > 1:
        torch.ne(values[1:], values[:-1], out=first[1:])
    lo, hi = torch.aminmax(idx)
    stats = torch.stack([
        lo.long(), hi.long(), (step >= 0).sum(), (step.abs() <= near_rows).sum(), first.sum(),
        (first & (position < max(1, s // 4))).sum(),
    ]).tolist()
    lo, hi, ascending, near, distinct, distinct_quarter = stats
    pairs = max(window.numel() - 1, 1)
    features = Features(ascending / pairs if n > 1 else 1.0, near / pairs if n > 1 else 1.0,
                        estimate_duplicates(n, rows, s, distinct, distinct_quarter))
    return features, lo, hi


# ---------------------------------------------------------------------------------------------------- cells


def _table_class(table_bytes: int, memory: str) -> str:
    """The size class (log2 of the bytes) and the memory kind: "t" pinned, "m" managed."""
    return f"{'m' if memory == 'managed' else 't'}{round(math.log2(max(table_bytes, 1)))}"


def _row_class(row_bytes: int) -> int:
    return round(2 * math.log2(max(row_bytes, 1)))  # half octaves: 47 B and 64 B rows differ


def _count_class(count: int) -> int:
    return round(math.log2(max(count, 1)))


def cell_key(call: Call, features: Features) -> str:
    op, table, row, count = call.kind
    return f"{op}|{table}|r{row}|n{count}|{features.order}|{features.duplicate_class}"


def _same_kind(cell: dict, call: Call, features: Features | None) -> bool:
    op, table, row, _ = call.kind
    if (cell["op"], cell["table_class"], cell["row_class"]) != (op, table, row):
        return False
    return features is None or (cell["order"], cell["dup"]) == (features.order, features.duplicate_class)


def find_cell(cells: dict, call: Call, features: Features) -> dict | None:
    """The measured cell that covers this call: its own, or one whose count class lies within the other's span
    (calibrate() measures every third count class, so its cells span one class on each side)."""
    cell = cells.get(cell_key(call, features))
    if cell is not None:
        return cell
    count = _count_class(call.count)
    covering = [c for c in cells.values()
                if _same_kind(c, call, features) and abs(c["count_class"] - count) <= c["span"]]
    return min(covering, key=lambda c: abs(c["count_class"] - count)) if covering else None


def nearest_cell(cells: dict, call: Call, features: Features | None) -> dict | None:
    """The closest measured cell of the same op, table size class and row width class: same features first, then
    the nearest count class."""
    count = _count_class(call.count)
    same = [c for c in cells.values() if _same_kind(c, call, None)]
    if not same:
        return None
    return min(same, key=lambda c: (not _same_kind(c, call, features), abs(c["count_class"] - count)))


def pick(gbps: dict) -> str:
    """The fastest measured strategy; a host strategy only at >= HOST_MARGIN x the fastest device-only one."""
    device = {s: v for s, v in gbps.items() if s not in HOST_PLANS}
    host = {s: v for s, v in gbps.items() if s in HOST_PLANS}
    best_device = max(device, key=device.get) if device else None
    best_host = max(host, key=host.get) if host else None
    if best_host is None or (best_device is not None and host[best_host] < HOST_MARGIN * device[best_device]):
        return best_device
    return best_host


def plan_from_cell(cell: dict, capturing: bool) -> Plan | None:
    gbps = cell["gbps"]
    # Host strategies cannot run inside graph capture, and would hold a busy caller's thread (CHECK_CALLS): then the
    # best device-only one measured.
    if capturing or cell.get("caller_busy", False):
        gbps = {s: v for s, v in gbps.items() if s not in HOST_PLANS}
    if not gbps:
        return None
    best = pick(gbps)
    if best == "split":
        return Plan("split", cell.get("split_fraction", 0.5), cell.get("split_kernel", "vector"))
    return Plan(best)


# ---------------------------------------------------------------------------------------------------- decision


def rules(call: Call, features: Features | None, capturing: bool) -> Plan:
    """The built-in choice where nothing was measured, from the H200 measurements (benchmarks/RESULTS.md):
    heavy duplicates -> dedupe; sorted or clustered indices, or rows >= 2 KiB -> vector (reads are sequential, or
    long enough); small rows at low density of a table past the translation reach -> staged (the CPU gathers them
    at 20-30 GB/s, zero-copy reads at 2-10); otherwise sorted."""
    order = features.order if features is not None else "random"
    duplicates = features.duplicates if features is not None else 0.0
    if call.op == "gather" and duplicates >= 0.3:
        return Plan("dedupe")
    if order != "random" or call.row_bytes >= 2048:
        return Plan("vector")
    if (call.op == "gather" and not capturing and call.memory != "managed"
            and call.table_bytes > TRANSLATION_REACH_BYTES and call.row_bytes <= 512 and call.density < 0.005):
        return Plan("staged")
    return Plan("sorted")


def candidates(call: Call, features: Features) -> tuple[str, ...]:
    """The strategies worth measuring for this call, the rules' choice first (it is the one kept if the measuring
    budget runs out after it); split last (its share comes from the kernel and staged measurements). ``dedupe``
    only where the indices repeat rows (its extra passes cost more than they save otherwise); ``dedupe_staged``
    for every gather (see below)."""
    found = ["vector"]
    if features.order != "sorted":
        found.append("sorted")
    if call.op == "gather" and features.duplicates >= 0.01:
        found.append("dedupe")
    found.append("staged")
    if call.op == "gather":
        # Also without duplicates: its host gather reads the distinct rows in address order, which beat staged's
        # call order by 1.08-1.33x for 1M uniform rows of 47-400 B on 16/48 GiB tables (H200 run I).
        found.append("dedupe_staged")
        found.append("split")
    first = rules(call, features, capturing=False).strategy
    return tuple([first] + [s for s in found if s != first])


@dataclasses.dataclass(frozen=True)
class Decision:
    """``plan``: run it. None: measure ``candidates`` on this call first. ``source`` says where the plan came from
    ("small", "measured", "nearest", "rules", "forced"); ``features``: the index features it was decided on."""

    plan: Plan | None
    candidates: tuple[str, ...] = ()
    source: str = ""
    features: Features | None = None


def decide(cells: dict, call: Call, features: Features | None, *, capturing: bool, may_measure: bool) -> Decision:
    """The decision for one call: a pure function of the measured cells, the call and its index features (None
    when they could not be computed, e.g. inside graph capture before any call of this kind)."""
    if call.bytes < SMALL_CALL_BYTES:
        return Decision(Plan("vector"), source="small")
    if features is not None:
        cell = find_cell(cells, call, features)
        # (a cell that a spent budget left incomplete is measured again where there is budget)
        if cell is not None and (cell.get("complete", True) or capturing or not may_measure):
            plan = plan_from_cell(cell, capturing)
            if plan is not None:
                return Decision(plan, source="measured")
        if may_measure and not capturing:
            return Decision(None, candidates(call, features), source="measure")
    cell = nearest_cell(cells, call, features)
    if cell is not None:
        plan = plan_from_cell(cell, capturing)
        if plan is not None:
            return Decision(plan, source="nearest")
    return Decision(rules(call, features, capturing), source="rules")


def forced_plan(op: str, strategy: str, call: Call) -> Plan:
    """The plan of a strategy named by the caller. Scatters have no deduplicating or split plans (both halves of a
    split would compete for the same rows): those run their closest scatter plan."""
    if op == "scatter":
        strategy = {"split": "staged", "dedupe": "sorted", "dedupe_staged": "staged"}.get(strategy, strategy)
        return Plan(strategy)
    if strategy != "split":
        return Plan(strategy)
    cell = nearest_cell(_state.cells(), call, None)
    if cell is not None and "split_fraction" in cell:
        return Plan("split", cell["split_fraction"], cell["split_kernel"])
    return Plan("split", 0.5, "sorted" if call.row_bytes < 2048 else "vector")


# ---------------------------------------------------------------------------------------------------- state


def _machine_key(device: int) -> str:
    from importlib.metadata import version  # (not from the package root: it sits above this layer)

    props = _core.device_properties(device) or {}
    name = str(props.get("name", "unknown")).replace(" ", "_").replace("/", "_")
    bus = str(props.get("pci_bus_id", "")).replace(":", "-")
    return f"{name}-{bus}-{os.cpu_count()}cpu-{version('pytorch-direct')}"


@functools.cache
def _cached_machine_key(device: int) -> str:
    return _machine_key(device)  # device properties never change; this runs on every cache access


def cache_path() -> Path:
    """The file holding this machine's measured cells (``PYTORCH_DIRECT_CALIBRATION`` overrides it)."""
    if settings.calibration_file is not None:
        return settings.calibration_file
    return settings.cache_dir / f"decisions-{_cached_machine_key(max(_core.current_device(), 0))}.json"


class _State:
    """The measured cells (in memory and on disk), the measuring budget left, and per call kind the features last
    computed and the calls seen."""

    def __init__(self) -> None:
        self._cells: dict | None = None
        self._path: Path | None = None
        self._where: tuple | None = None
        self.budget_s = RACE_BUDGET_S
        self.kinds: dict = {}
        self.last: Decision | None = None  # of the last auto call, for diagnostics (last_decision())
        self.version = 0  # changes whenever the cells do: decisions kept per kind are then made again

    def cells(self) -> dict:
        where = (settings.calibration_file, settings.cache_dir, _core.current_device())  # what cache_path() reads
        if self._cells is None or where != self._where:
            self._where, self._path = where, cache_path()
            self._cells = _read_cells(self._path)
            self.version += 1
        return self._cells

    def record(self, cells: dict, save: bool = True) -> None:
        self.cells().update(cells)
        self.version += 1
        if save:
            _write_cells(self._path, cells)


def _read_cells(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # none yet, or a broken file: measured again
    if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT or not isinstance(data.get("cells"), dict):
        return {}
    return dict(data["cells"])


def _write_cells(path: Path, cells: dict) -> None:
    """Merges `cells` into the file (other processes may have added theirs) with an atomic replace."""
    try:
        merged = _read_cells(path)
        merged.update(cells)
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump({"format": CACHE_FORMAT, "cells": merged}, f, indent=1)
        os.replace(f.name, path)
    except OSError:
        pass  # an unwritable cache only costs measuring again in the next process


_state = _State()


def reset(*, delete_file: bool = False) -> None:
    """Forgets this process's measured cells, features and measuring budget (as in a new process); with
    ``delete_file`` also this machine's cache file (as on a new machine)."""
    global _state
    if delete_file:
        try:
            cache_path().unlink()
        except OSError:
            pass
    _state = _State()


def measured_cells() -> dict:
    """The measured cells in use (this machine's cache file plus this process's measurements)."""
    return dict(_state.cells())


class _Seen:
    """Per call kind: calls seen, the features last computed, and the decision they gave (kept until the features
    are computed again or the cells change, so that most calls decide with a dictionary lookup); while a host plan
    is being checked (see CHECK_CALLS), the key of its cell, the seconds of its calls and of the caller's work between
    them so far, and when the last call returned."""

    __slots__ = ("calls", "next_check", "interval", "features", "decision", "made_for", "checking", "observed",
                 "between", "last_end")

    def __init__(self) -> None:
        self.calls = 0
        self.next_check = 0  # the features are computed when calls reaches this
        self.interval = RECHECK_EVERY
        self.features: Features | None = None
        self.decision: Decision | None = None
        self.made_for: tuple | None = None
        self.checking: str | None = None
        self.observed: list = []
        self.between: list = []
        self.last_end: float | None = None


def choose(call: Call, idx: Tensor, *, capturing: bool) -> tuple[Decision, Features | None, tuple[int, int] | None]:
    """The decision for an ``auto`` call with CUDA indices, its features, and the indices' (min, max) when the
    features were computed on this call (then no separate bounds check is needed)."""
    if call.bytes < SMALL_CALL_BYTES:
        _state.last = Decision(Plan("vector"), source="small")
        return _state.last, None, None
    seen = _state.kinds.get(call.kind)
    if seen is None:
        seen = _state.kinds[call.kind] = _Seen()
    bounds = None
    if not capturing and (seen.features is None or seen.calls >= seen.next_check):
        features, lo, hi = index_features(idx, call.rows, call.row_bytes)
        same = seen.features is not None and _classes(features) == _classes(seen.features)
        seen.interval = min(2 * seen.interval, RECHECK_MAX) if same else RECHECK_EVERY
        seen.next_check = seen.calls + seen.interval
        seen.features, seen.decision = features, None
        bounds = (lo, hi)
    seen.calls += 1
    cells = _state.cells()  # (reloads, and changes the version, when the cache file setting changed)
    made_for = (_state.version, capturing, settings.auto_calibrate)
    if seen.decision is not None and seen.made_for == made_for:
        _state.last = seen.decision
        return seen.decision, seen.features, bounds
    may_measure = settings.auto_calibrate and _state.budget_s > 0
    decision = decide(cells, call, seen.features, capturing=capturing, may_measure=may_measure)
    _state.last = decision = dataclasses.replace(decision, features=seen.features)
    if decision.plan is not None:
        seen.decision, seen.made_for = decision, made_for
        seen.checking, seen.observed, seen.between, seen.last_end = _cell_to_check(cells, call, decision), [], [], None
    return decision, seen.features, bounds


def _classes(features: Features) -> tuple[str, str]:
    return features.order, features.duplicate_class


def _cell_to_check(cells: dict, call: Call, decision: Decision) -> str | None:
    """The key of the measured cell whose host plan this decision runs, if its calls are still to be checked."""
    if decision.source != "measured" or not decision.plan.needs_host or decision.features is None:
        return None
    cell = find_cell(cells, call, decision.features)
    if cell is None or decision.plan.strategy in cell.get("observed", {}):
        return None
    return next((key for key, c in cells.items() if c is cell), None)


def checking(call: Call) -> bool:
    """Whether the caller should time this call and report it with :func:`observe` (see CHECK_CALLS)."""
    seen = _state.kinds.get(call.kind)
    return seen is not None and seen.checking is not None


def run_decided(call: Call, execute, *, auto: bool) -> None:
    """Runs `execute()`, a call's decided plan; an ``auto`` call whose kind's host plan is being checked (see
    CHECK_CALLS) is timed for :func:`observe`."""
    if not (auto and checking(call)):
        execute()
        return
    start = _clock()
    execute()
    observe(call, start, _clock())


def observe(call: Call, start: float, end: float) -> None:
    """One checked call, from its start until it returned to the caller (``_clock`` times). After CHECK_CALLS calls
    following the first (each with the caller's work before it), the cell is updated as CHECK_CALLS describes."""
    seen = _state.kinds.get(call.kind)
    if seen is None or seen.checking is None:
        return
    if seen.last_end is not None:
        seen.observed.append(end - start)
        seen.between.append(start - seen.last_end)
    seen.last_end = end
    if len(seen.observed) < CHECK_CALLS:
        return
    key, strategy = seen.checking, seen.decision.plan.strategy
    observed, between = sorted(seen.observed), sorted(seen.between)
    seen.checking, seen.observed, seen.between, seen.last_end = None, [], [], None
    cell = _state.cells().get(key)
    if cell is None:
        return
    rate = call.bytes / max(observed[0], 1e-9) / 1e9
    measured = cell["gbps"].get(strategy, rate)
    cell = dict(cell, observed={**cell.get("observed", {}), strategy: rate})
    # (Against the measured call, which lasts until its GPU work is done: split's GPU half may outlast the call's
    # return, and a loop that synchronises after each call then waits for it between calls.)
    if between[len(between) // 2] > call.bytes / max(measured, 1e-9) / 1e9:
        cell["caller_busy"] = True
    elif rate < CHECK_SLOWER * measured:
        cell["gbps"] = {**cell["gbps"], strategy: rate}
    kept = plan_from_cell(cell, capturing=False)
    if kept is None:  # no GPU plan was measured in this cell (the budget ran out): the host plan stays
        del cell["caller_busy"]
        kept = plan_from_cell(cell, capturing=False)
    cell["best"] = kept.strategy
    _state.record({key: cell})


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
        "measured_cells": len(_state.cells()),
    }


# ---------------------------------------------------------------------------------------------------- measuring


_clock = time.perf_counter  # (tests replace it with a simulated clock)


def _sync() -> None:
    if torch.cuda.is_initialized():  # (never on a CPU-only machine, where the tests time stand-ins)
        torch.cuda.synchronize()


def _timed(run, plan: Plan) -> float:
    start = _clock()
    run(plan)
    _sync()
    return _clock() - start


def measure(call: Call, features: Features, names: tuple[str, ...], run, *, budget_s: float | None = None,
            span: int = 0, save: bool = True) -> tuple[Plan, dict]:
    """Runs `run(plan)` (the call itself, all of it, with the bounds check a later call of that plan makes) for each
    candidate: once untimed (a first run allocates its buffers and fills caches; in H200 run 1, with only a warm-up
    on a few rows, the first cells kept strategies up to 2.3x slower than the best one), then timed (three times
    for calls under SHORT_CALL_S, which vary more); those within RETIME_WITHIN of the fastest are timed in two more
    interleaved rounds; keeps the fastest (``pick``) and records the cell. Stops early, keeping what was measured,
    when `budget_s` (default: the process's measuring budget left) runs out. Returns the plan kept and the cell.

    A candidate that runs out of GPU memory (``dedupe`` needs a second buffer as large as the output) is left out:
    measuring must not fail a call that the rules' choice can serve. The cell is marked incomplete when the budget
    stopped the measuring, and measured again in a process with budget left."""
    budget = _state.budget_s if budget_s is None else budget_s
    start = _clock()
    seconds: dict = {}
    out_of_memory: list = []
    split_plan = None
    complete = True
    output_from_failed_run = False
    for name in names:
        if seconds and _clock() - start > budget:
            complete = False
            break
        if name == "split":
            kernel = min((s for s in ("vector", "sorted") if s in seconds), key=seconds.get, default=None)
            if kernel is None or "staged" not in seconds:
                continue
            gpu, cpu = 1 / seconds[kernel], 1 / seconds["staged"]
            plan = split_plan = Plan("split", gpu / (gpu + cpu), kernel)
        else:
            plan = Plan(name)
        try:
            _timed(run, plan)  # warm-up
            seconds[name] = _timed(run, plan)
            if seconds[name] < SHORT_CALL_S:
                seconds[name] = min(seconds[name], _timed(run, plan), _timed(run, plan))
            output_from_failed_run = False
        except torch.cuda.OutOfMemoryError as e:
            out_of_memory.append(e)
            output_from_failed_run = True  # it may have written part of the output
    if not seconds:
        raise out_of_memory[0]
    fastest = min(seconds.values())
    finalists = [s for s, t in seconds.items() if t <= RETIME_WITHIN * fastest]
    if len(finalists) > 1:
        # Timed again in two rounds, each running every finalist once, the second in reverse order: measured one
        # after the other, whichever ran last was favoured (H200 run I: 10 cells kept split, measured last, whose
        # steady speed was 0.73-0.97x staged's).
        for order in (finalists, finalists[::-1]):
            for name in order:
                plan = split_plan if name == "split" else Plan(name)
                seconds[name] = min(seconds[name], _timed(run, plan))
    gbps = {s: call.bytes / max(t, 1e-9) / 1e9 for s, t in seconds.items()}
    best = pick(gbps)
    features_key = cell_key(call, features)
    op, table, row, count = call.kind
    cell = {"op": op, "table_class": table, "row_class": row, "count_class": count, "order": features.order,
            "dup": features.duplicate_class, "span": span, "best": best, "gbps": gbps, "complete": complete,
            "measured_on": {"table_bytes": call.table_bytes, "row_bytes": call.row_bytes, "count": call.count}}
    if split_plan is not None:
        cell["split_fraction"], cell["split_kernel"] = split_plan.split_fraction, split_plan.split_kernel
    kept = plan_from_cell(cell, capturing=False)
    if output_from_failed_run:
        run(kept)
    if budget_s is None:
        _state.budget_s -= _clock() - start
    _state.record({features_key: cell}, save=save)
    _state.last = Decision(kept, names, source="measured now", features=features)
    return kept, cell


# ---------------------------------------------------------------------------------------------------- calibrate


def synthetic_indices(pattern: str, count: int, rows: int, generator: torch.Generator, *, zipf_s: float = 1.0,
                      cluster: int = 32) -> Tensor:
    """int64 row indices on the generator's device: ``uniform`` (random rows), ``sorted`` (the same, ascending),
    ``clustered`` (runs of `cluster` consecutive rows at random places), ``zipf`` (rank r drawn with probability
    ~ 1 / r**zipf_s, ranks spread over the table by a fixed permutation)."""
    device = generator.device
    if pattern in ("uniform", "sorted"):
        idx = torch.randint(0, rows, (count,), device=device, generator=generator)
        return torch.sort(idx).values if pattern == "sorted" else idx
    if pattern == "clustered":
        run = max(1, min(cluster, rows))
        starts = torch.randint(0, rows - run + 1, (-(-count // run),), device=device, generator=generator)
        return (starts[:, None] + torch.arange(run, device=device)).reshape(-1)[:count]
    if pattern == "zipf":
        u = torch.rand(count, device=device, generator=generator, dtype=torch.float64)
        if abs(zipf_s - 1.0) < 1e-9:
            x = torch.exp(u * math.log(rows))
        else:
            a = 1.0 - zipf_s
            x = ((float(rows) ** a - 1.0) * u + 1.0) ** (1.0 / a)
        rank = (x.floor().long() - 1).clamp_(0, rows - 1)
        step = _coprime_step(rows)
        return (rank * step) % rows  # a bijection: the hot ranks land all over the table
    raise ValueError(f"unknown index pattern {pattern!r}: uniform, sorted, clustered or zipf")


def _coprime_step(rows: int) -> int:
    step = max(1, min(int(rows * 0.6180339887), (1 << 32) - 1)) | 1
    while math.gcd(step, rows) != 1:
        step += 2
    return step


def calibrate(*, table=None, table_bytes: int = CALIBRATION_TABLE_BYTES, row_bytes=None, counts=None,
              save: bool = True, verbose: bool = False) -> dict:
    """Measures the gather strategies on `table` (reads only: its contents are not changed) or on a scratch pinned
    table of `table_bytes`, for index patterns uniform / sorted / clustered / Zipf (exponents 0.9 and 1.1) at
    several counts, and stores the cells for this machine (on disk when `save`). ``auto`` then runs the measured
    choice for calls of those kinds without measuring on them first. Returns the measured cells.

    `row_bytes`: row widths to view the table's bytes at (default: the table's own rows; the scratch table: 64 B
    to 4 KiB). `counts`: rows per call (default 8K to 2M in steps of 4x, at most the table's rows and 1 GiB; each
    cell then also covers the counts 2x either side). `verbose`: print each measured cell as it is done. Took
    0.6-3.2 s per row width on an H200 host (1-48 GiB tables)."""
    if not _memory.cuda_usable():
        raise _core.UnavailableError("calibration needs a CUDA device")
    device = torch.device("cuda", torch.cuda.current_device())
    if table is None:
        plain = _memory.host_empty((table_bytes,), torch.uint8)
        plain.fill_(1)
        widths = tuple(row_bytes or ROW_BYTES)
        memory = _memory.host_kind(plain)
    else:
        with torch._C.DisableTorchFunctionSubclass():
            plain = table.detach()
            if not plain.is_contiguous():
                raise ValueError("calibrate(table=...) needs a contiguous table")
            if row_bytes is None:
                widths = (_kernels.row_layout(plain)[1],)
            else:
                widths = tuple(row_bytes)
            plain = plain.reshape(-1).view(torch.uint8)
        memory = _kernels.table_for_device(plain, device.index)
    total = plain.numel()
    checked = settings.bounds_check == "sync"
    generator = torch.Generator(device=device).manual_seed(0)
    measured: dict = {}
    for rb in widths:
        rows = total // rb
        if rows == 0:
            continue
        with torch._C.DisableTorchFunctionSubclass():
            view = plain[: rows * rb].view(rows, rb)
        for pattern, zipf_s in CALIBRATION_PATTERNS:
            for n in counts or CALIBRATION_COUNTS:
                n = min(n, rows, max(1, (1 << 30) // rb))
                idx = synthetic_indices(pattern, n, rows, generator, zipf_s=zipf_s)
                features, _, _ = index_features(idx, rows, rb)
                call = Call("gather", total, rows, rb, n, memory)
                if call.bytes < SMALL_CALL_BYTES:
                    continue
                out = torch.empty((n, rb), dtype=torch.uint8, device=device)
                span = 1 if counts is None else 0

                def run(plan, view=view, rows=rows, rb=rb, idx=idx, out=out):
                    if checked:  # what a later call of this plan pays (see measure)
                        _kernels.gather_cuda_checked(view, rows, rb, idx, out, plan, 0)
                    else:
                        _kernels.gather_cuda(view, rows, rb, idx, out, plan, 0, False)

                _, cell = measure(call, features, candidates(call, features), run, budget_s=math.inf, span=span,
                                  save=False)
                measured[cell_key(call, features)] = cell
                if verbose:
                    rates = " ".join(f"{s}={v:.1f}" for s, v in cell["gbps"].items())
                    print(f"calibrate {rb:6d} B x {n:8d} {pattern:9} -> {cell['best']:13} ({rates} GB/s)",
                          flush=True)
    _state.record(measured, save=save)  # in this process either way
    return measured

