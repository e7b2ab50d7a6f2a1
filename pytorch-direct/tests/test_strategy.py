"""The ``auto`` decision on the CPU: index features, the duplicate estimate, the pure decision function, measuring
(with timed stand-ins for the strategies), the per-machine cell store, and the strategy registry."""

import dataclasses
import json
import math

import pytest
import torch

import pytorch_direct as pd
from pytorch_direct import _auto, _cells, _decide, _features, _kernels, _measure, _strategies
from pytorch_direct._cell import Call, Cell, CellKey, Features, Measurement
from pytorch_direct._decide import Decision, decide
from pytorch_direct._strategies import REGISTRY, Plan, RowJob

GIB = 1 << 30
RANDOM = Features(ascending=0.5, near=0.0, duplicates=0.0)
SORTED = Features(ascending=1.0, near=0.9, duplicates=0.0)
CLUSTERED = Features(ascending=0.52, near=0.95, duplicates=0.0)
ZIPF = Features(ascending=0.5, near=0.01, duplicates=0.6)


@pytest.fixture(autouse=True)
def fresh_state(tmp_cache):
    _auto.reset()
    yield
    _auto.reset()


def gather_call(table_gib=16, row_bytes=256, count=1 << 20):
    table_bytes = int(table_gib * GIB)
    return Call("gather", table_bytes, table_bytes // row_bytes, row_bytes, count)


def features_of(idx, rows, row_bytes=64):
    features, lo, hi = _features.index_features(idx, rows, row_bytes)
    assert (lo, hi) == (int(idx.min()), int(idx.max()))
    return features


# ---------------------------------------------------------------------------------------------------- features


def test_duplicate_estimate_is_exact_on_the_whole_index():
    assert _features.estimate_duplicates(100, 10**6, 100, 100, 25) == 0.0
    assert _features.estimate_duplicates(100, 10**6, 100, 1, 1) == pytest.approx(0.99)
    assert _features.estimate_duplicates(0, 10, 0, 0, 0) == 0.0
    # More indices than rows: at least count - rows repeat.
    assert _features.estimate_duplicates(10**6, 1000, 4096, 4096, 1024) >= 1 - 1000 / 10**6


@pytest.mark.parametrize("pattern,order", [("uniform", "random"), ("sorted", "sorted"), ("clustered", "clustered")])
def test_index_order_classes(pattern, order):
    g = torch.Generator().manual_seed(3)
    rows = 50_000_000
    idx = _features.synthetic_indices(pattern, 300_000, rows, g, cluster=64)
    f = features_of(idx, rows)
    assert f.order == order
    assert f.duplicate_class == "none"


@pytest.mark.parametrize("s,low,high", [(0.8, 0.0, 0.5), (1.0, 0.2, 0.8), (1.2, 0.5, 0.95)])
def test_zipf_duplicates_are_estimated_from_a_sample(s, low, high):
    # The estimate (a power law fitted on the sample) against the exact fraction of repeated indices: never
    # above it by more than noise (dedupe must not be chosen on imagined duplicates), and the right class.
    g = torch.Generator().manual_seed(int(s * 10))
    rows, n = 20_000_000, 1_000_000
    idx = _features.synthetic_indices("zipf", n, rows, g, zipf_s=s)
    exact = 1 - torch.unique(idx).numel() / n
    f = features_of(idx, rows)
    assert low <= exact <= high
    assert f.duplicates <= exact + 0.05
    assert f.duplicates >= exact / 4
    if s >= 1.0:
        assert f.duplicate_class in ("some", "heavy") and f.order == "random"


def test_duplicates_of_sorted_indices_are_counted_in_the_window():
    # Sorted uniform indices at full density repeat ~37% of rows; a strided sample of a sorted index holds only
    # distinct values, so without counting equal neighbours dedupe would never be a candidate for them.
    g = torch.Generator().manual_seed(5)
    rows = n = 1 << 20
    idx = _features.synthetic_indices("sorted", n, rows, g)
    exact = 1 - torch.unique(idx).numel() / n
    f = features_of(idx, rows, 1024)
    assert f.order == "sorted"
    assert f.duplicates == pytest.approx(exact, abs=0.05)
    assert "dedupe" in _decide.candidates(Cell(Call("gather", rows * 1024, rows, 1024, n, "managed"), f))
    # Sorted indices into a large table stay duplicate-free.
    idx = _features.synthetic_indices("sorted", n, 1 << 30, g)
    assert features_of(idx, 1 << 30).duplicate_class == "none"


def test_features_of_odd_index_tensors():
    f = features_of(torch.tensor([5]), 10)
    assert f.duplicates == 0.0 and f.order == "sorted"
    f = features_of(torch.full((100_000,), 7, dtype=torch.int32), 10)
    assert f.duplicates > 0.99 and f.duplicate_class == "heavy"
    perm = torch.randperm(200_000, generator=torch.Generator().manual_seed(1))
    assert features_of(perm, 200_000).duplicates < 0.01  # a permutation has no duplicates at full density


def test_synthetic_zipf_is_a_permutation_of_ranks():
    step = _features.coprime_step(1000)
    assert math.gcd(step, 1000) == 1
    ranks = torch.arange(1000)
    assert torch.equal(torch.sort((ranks * step) % 1000).values, ranks)
    with pytest.raises(ValueError, match="unknown index pattern"):
        _features.synthetic_indices("gauss", 10, 10, torch.Generator())


# ---------------------------------------------------------------------------------------------------- decision


def measurement(call, features, gbps, span=0, cached=False, **extra):
    """{key: Measurement} for `call` with `features`, keeping what pick() keeps."""
    key = Cell(call, features, cached).key
    return {key: Measurement(key, gbps, _decide.pick(gbps), span, **extra)}


def decide_for(ms, call, features, *, capturing=False, may_measure=True, cached=False):
    return decide(Cell(call, features, cached), ms, capturing=capturing, may_measure=may_measure)


def test_small_calls_use_the_vector_kernel():
    call = gather_call(row_bytes=64, count=1000)
    assert decide_for({}, call, RANDOM) == Decision(Plan("vector"), source="small")
    assert decide_for({}, call, RANDOM, cached=True) == Decision(Plan("cached"), source="small")


def test_unmeasured_calls_are_measured_with_the_rules_choice_first():
    call = gather_call(table_gib=48, row_bytes=128, count=1 << 18)  # 0.2 % of a 48 GiB table
    d = decide_for({}, call, RANDOM)
    assert d.plan is None and d.source == "measure"
    assert d.candidates[0] == "staged" and d.candidates[-1] == "split"
    # No duplicates: no dedupe; dedupe_staged all the same (its host gather reads the rows in address order).
    assert set(d.candidates) == {"staged", "vector", "sorted", "dedupe_staged", "split"}
    d = decide_for({}, call, ZIPF)
    assert d.candidates[0] == "dedupe" and {"dedupe", "dedupe_staged"} <= set(d.candidates)
    d = decide_for({}, call, SORTED)
    assert "sorted" not in d.candidates and d.candidates[0] == "vector"  # sorting sorted indices is wasted
    scatter = Call("scatter", call.table_bytes, call.rows, call.row_bytes, call.count)
    assert set(decide_for({}, scatter, ZIPF).candidates) == {"vector", "sorted", "staged"}
    # A table with a GPU cache measures its cached strategies first (the rules' choice), and the others too.
    cached = decide_for({}, call, RANDOM, cached=True).candidates
    uncached = set(decide_for({}, call, RANDOM).candidates)
    assert cached[0] == "cached_sorted" and set(cached) == uncached | {"cached", "cached_sorted"}
    assert decide_for({}, call, SORTED, cached=True).candidates[0] == "cached"
    assert "cached_sorted" not in decide_for({}, call, SORTED, cached=True).candidates
    assert not {"cached", "cached_sorted"} & set(decide_for({}, call, RANDOM).candidates)


def test_rules_account_for_table_size_rows_density_order_and_duplicates():
    def rules(call, features, capturing, cached=False):
        return _decide.rules(Cell(call, features, cached), capturing)

    big_sparse = gather_call(table_gib=48, row_bytes=256, count=1 << 18)
    small_table = gather_call(table_gib=1, row_bytes=256, count=1 << 12 + 4)
    assert rules(big_sparse, RANDOM, capturing=False) == Plan("staged")
    assert rules(big_sparse, RANDOM, capturing=True) == Plan("sorted")  # no host strategy in graph capture
    assert rules(small_table, RANDOM, capturing=False) == Plan("sorted")  # within translation reach: no staging
    assert rules(big_sparse, SORTED, capturing=False) == Plan("vector")
    assert rules(big_sparse, CLUSTERED, capturing=False) == Plan("vector")
    assert rules(gather_call(row_bytes=4096), RANDOM, capturing=False) == Plan("vector")
    assert rules(big_sparse, ZIPF, capturing=True) == Plan("dedupe")
    assert rules(big_sparse, None, capturing=False) == Plan("staged")  # no features: assumed random
    # A managed table is mapped with large pages: no translation collapse, so no staging for its size.
    big_managed = dataclasses.replace(big_sparse, memory="managed")
    assert rules(big_managed, RANDOM, capturing=False) == Plan("sorted")
    # Cached tables: misses in address order only where random reads of a pinned table collapse.
    assert rules(big_sparse, RANDOM, capturing=False, cached=True) == Plan("cached_sorted")
    assert rules(big_managed, RANDOM, capturing=False, cached=True) == Plan("cached")
    assert rules(small_table, ZIPF, capturing=True, cached=True) == Plan("cached")


def test_memory_kinds_and_caches_get_their_own_cells():
    # The same call on a pinned and on a managed table ran 7x apart on an H200 host: never one cell for both.
    pinned = gather_call(table_gib=48, row_bytes=256, count=1 << 18)
    managed = dataclasses.replace(pinned, memory="managed")
    assert Cell(pinned, RANDOM).key != Cell(managed, RANDOM).key
    assert Cell(pinned, RANDOM).key != Cell(pinned, RANDOM, cached=True).key
    assert pinned.kind != managed.kind
    ms = measurement(pinned, RANDOM, {"staged": 30.0, "vector": 7.0})
    assert _decide.find(ms, Cell(pinned, RANDOM).key) is not None
    assert _decide.find(ms, Cell(managed, RANDOM).key) is None
    assert _decide.find(ms, Cell(pinned, RANDOM, cached=True).key) is None
    assert _decide.nearest(ms, Cell(managed, RANDOM)) is None
    assert _decide.nearest(ms, Cell(pinned, RANDOM, cached=True)) is None


def test_cell_keys_round_trip_and_reject_garbage():
    key = Cell(gather_call(), ZIPF, cached=True).key
    assert CellKey.parse(str(key)) == key and str(key).endswith("|cached")
    plain = Cell(gather_call(), RANDOM).key
    assert CellKey.parse(str(plain)) == plain and str(plain) == "gather|t34|r16|n20|random|none"
    for bad in ("", "gather|t34", "gather|t34|16|n20|random|none", "copy|t34|r16|n20|random|none",
                "gather|t34|r16|n20|random|none|extra"):
        with pytest.raises(ValueError, match="not a cell key"):
            CellKey.parse(bad)


def test_measured_cells_decide_and_graph_capture_gets_the_best_device_strategy():
    call = gather_call(table_gib=16, row_bytes=400, count=2_000_000)
    ms = measurement(call, RANDOM, {"vector": 12.0, "sorted": 30.0, "staged": 28.0, "split": 44.6},
                     split_fraction=0.6, split_kernel="sorted")
    assert decide_for(ms, call, RANDOM) == Decision(Plan("split", 0.6, "sorted"), source="measured")
    assert decide_for(ms, call, RANDOM, capturing=True, may_measure=False).plan == Plan("sorted")
    # Another index order is another cell: measured, not guessed from this one.
    assert decide_for(ms, call, SORTED).plan is None
    # Without measuring (budget spent, auto-calibration off): the nearest cell of the same table and row width.
    assert decide_for(ms, call, SORTED, may_measure=False).source == "nearest"
    other_rows = gather_call(table_gib=16, row_bytes=4096, count=200_000)
    assert decide_for(ms, other_rows, RANDOM, may_measure=False).source == "rules"
    other_table = gather_call(table_gib=1, row_bytes=400, count=2_000_000)
    assert decide_for(ms, other_table, RANDOM).plan is None


def test_host_strategies_need_a_margin():
    assert _decide.pick({"vector": 2.0, "sorted": 10.0, "staged": 11.5}) == "staged"  # 1.15x
    assert _decide.pick({"vector": 2.0, "sorted": 10.0, "staged": 10.5}) == "sorted"  # 1.05x
    assert _decide.pick({"staged": 1.0}) == "staged"
    assert _decide.pick({"dedupe": 5.0, "dedupe_staged": 5.1, "vector": 1.0}) == "dedupe"
    assert _decide.pick({"retired_strategy": 99.0, "vector": 1.0}) == "vector"  # names no longer registered


def test_calibrated_cells_span_neighbouring_counts():
    call = gather_call(count=1 << 20)
    ms = measurement(call, RANDOM, {"sorted": 3.0}, span=1)
    assert decide_for(ms, gather_call(count=1 << 21), RANDOM).source == "measured"
    assert decide_for(ms, gather_call(count=1 << 22), RANDOM).plan is None


def test_forced_split_takes_its_share_from_a_measured_cell():
    call = gather_call(row_bytes=256)
    assert _decide.forced_plan(Cell(call), "split", {}) == Plan("split", 0.5, "sorted")
    ms = measurement(call, RANDOM, {"split": 30.0, "sorted": 20.0}, split_fraction=0.7, split_kernel="vector")
    assert _decide.forced_plan(Cell(call), "split", ms) == Plan("split", 0.7, "vector")
    assert _strategies.scatter_plan(Plan("dedupe")) == Plan("sorted")
    assert _strategies.scatter_plan(Plan("split")) == Plan("staged")
    assert _strategies.scatter_plan(Plan("dedupe_staged")) == Plan("staged")
    assert _strategies.scatter_plan(Plan("cached_sorted")) == Plan("vector")


def test_unknown_plans_and_strategy_names_are_refused():
    with pytest.raises(ValueError, match="unknown plan"):
        Plan("fastest")
    with pytest.raises(ValueError, match="bad split parameters"):
        Plan("split", 1.5)
    with pytest.raises(ValueError, match="is not one of"):
        pd.set_strategy("fastest")


# ---------------------------------------------------------------------------------------------------- registry


def test_the_registry_is_the_one_list_of_strategies():
    assert pd.STRATEGIES == ("auto", *REGISTRY)
    assert set(_strategies.scatter_names()) == {"vector", "sorted", "staged", "naive"}
    for name, s in REGISTRY.items():
        assert s.name == name and s.runs_on in ("device", "host")
        assert s.scatter_as is None or s.scatter_as in _strategies.scatter_names()
        assert Plan(name).needs_host == (s.runs_on == "host")
    # Every strategy some cell measures is measurable; the baseline is never measured by auto.
    cells = [Cell(gather_call(), f, cached) for f in (RANDOM, SORTED, ZIPF) for cached in (False, True)]
    measured = {n for c in cells for n in _decide.candidates(c)}
    assert measured == set(REGISTRY) - {"naive"}


def test_a_new_strategy_is_one_registered_class(monkeypatch):
    # Registering a class is all it takes for it to be forced by name, measured by auto and stored.
    monkeypatch.setattr(_strategies, "REGISTRY", dict(REGISTRY))
    monkeypatch.setattr(_decide, "REGISTRY", _strategies.REGISTRY)

    @_strategies.register
    class Twice(_strategies.Strategy):
        name = "twice_for_test"

        def candidate(self, cell):
            return super().candidate(cell) and cell.call.op == "gather"

    assert "twice_for_test" in _decide.candidates(Cell(gather_call(), RANDOM))
    assert Plan("twice_for_test").kind.runs_on == "device"
    with pytest.raises(ValueError, match="taken"):
        _strategies.register(Twice)


# ---------------------------------------------------------------------------------------------------- measuring


DUMMY_JOB = RowJob("gather", torch.empty(0), 0, 0, torch.empty(0), torch.empty(0))


@pytest.fixture
def fake_run(monkeypatch):
    """make(seconds, log, fail=()): strategies that take the given seconds on a simulated clock (what the measurer
    times), logging each run; those in `fail` run out of GPU memory."""
    now = [0.0]
    monkeypatch.setattr(_measure, "_clock", lambda: now[0])

    def make(seconds, log, fail=()):
        def execute(job, plan, *, check_bounds, in_range):
            log.append(plan.strategy)
            now[0] += seconds[plan.strategy]
            if plan.strategy in fail:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (a stand-in)")

        monkeypatch.setattr(_measure, "execute", execute)

    make.now = now
    return make


def measure(call, features, names):
    """What gather_impl does for a call of a kind never measured: race the candidates, record, keep."""
    plan = _auto.measure(call, Decision(None, names, source="measure", features=features), DUMMY_JOB,
                         check_bounds=False)
    return plan, _auto.measured_cells()[Cell(call, features).key]


def test_measure_keeps_the_fastest_records_it_and_splits_by_rate(fake_run):
    call = gather_call(count=1 << 20)
    log = []
    fake_run({"vector": 0.03, "sorted": 0.01, "staged": 0.015, "split": 0.0078}, log)
    plan, m = measure(call, RANDOM, ("vector", "sorted", "staged", "split"))
    assert plan.strategy == "split"
    # The split's share follows the kernel (sorted) and staged rates: 1/0.01 / (1/0.01 + 1/0.015) = 0.6.
    assert m.split_kernel == "sorted" and m.split_fraction == pytest.approx(0.6, abs=0.05)
    assert log[:6] == ["vector", "vector", "sorted", "sorted", "staged", "staged"]  # a warm-up run, a timed one
    # The finalists (within RETIME_WITHIN of the fastest: split and sorted at 1.28x) are timed in two more rounds.
    assert log.count("split") == 4 and log.count("sorted") == 4 and log.count("vector") == 2
    assert log[-4:] == ["sorted", "split", "split", "sorted"]  # interleaved, the second round reversed
    key = str(Cell(call, RANDOM).key)
    on_disk = json.loads(_auto.cache_path().read_text())
    assert on_disk["cells"][key]["best"] == "split" and on_disk["format"] == _cells.FORMAT
    _auto.reset()  # a new process reads the cell from disk
    assert decide_for(_auto.measured_cells(), call, RANDOM).plan == plan


def test_auto_status_reports_the_last_decision_and_the_measuring_time(fake_run):
    assert pd.auto_status() == {"strategy": None, "source": None, "order": None, "duplicates": None,
                                "measuring_s": 0.0, "measured_cells": 0}
    call = gather_call(count=1 << 20)
    fake_run({"vector": 0.03, "sorted": 0.01}, [])
    measure(call, RANDOM, ("vector", "sorted"))
    status = pd.auto_status()
    assert status["strategy"] == "sorted" and status["source"] == "measured now" and status["order"] == "random"
    assert status["measuring_s"] == pytest.approx(0.03 * 2 + 0.01 * 2)  # a warm-up and a timed run each
    assert status["measured_cells"] == 1


def test_short_calls_are_timed_three_times(fake_run):
    log = []
    fake_run({"vector": 0.001, "sorted": 0.01}, log)
    measure(gather_call(), RANDOM, ("vector", "sorted"))
    assert log.count("vector") == 1 + 3 and log.count("sorted") == 2  # warm-up, 3 timed; no finalist to retime


def test_finalists_are_compared_interleaved_not_one_after_the_other(monkeypatch):
    """A drift during measuring (here: every run 0.8 ms faster than the one before, as with caches warming up) must
    not hand the cell to whichever candidate ran last: the finalists are timed again in alternating order."""
    now = [0.0]
    runs = []
    true_seconds = {"staged": 0.020, "dedupe_staged": 0.021}  # staged is the faster one
    monkeypatch.setattr(_measure, "_clock", lambda: now[0])

    def execute(job, plan, *, check_bounds, in_range):
        runs.append(plan.strategy)
        now[0] += true_seconds[plan.strategy] - 0.0008 * len(runs)

    monkeypatch.setattr(_measure, "execute", execute)
    call = gather_call()
    result = _measure.race(Cell(call, RANDOM), DUMMY_JOB, ("staged", "dedupe_staged"), budget_s=math.inf,
                           check_bounds=False)
    # One after the other (staged: runs 1-2, dedupe_staged: runs 3-4), dedupe_staged measured 17.8 ms against
    # staged's 18.4, and would have been kept.
    assert runs == ["staged"] * 2 + ["dedupe_staged"] * 2 + ["staged", "dedupe_staged", "dedupe_staged", "staged"]
    assert result.measurement.best == "staged" and result.plan == Plan("staged")


# Steady rates (GB/s) of each strategy forced, in cells of an H100 benchmark where auto had kept a plan below 0.95x
# the best one: (table GiB, row bytes, pattern, count) -> rates. The 1 KiB sorted cell repeats 37% of its rows.
H100_CELLS = {
    (1, 1024, "sorted", 1 << 20): {"vector": 67.92, "dedupe": 72.34, "staged": 51.24, "dedupe_staged": 61.69,
                                   "split": 55.65},
    (1, 64, "zipf", 1 << 20): {"dedupe": 47.77, "vector": 70.60, "sorted": 133.57, "staged": 26.99,
                               "dedupe_staged": 42.59, "split": 40.81},
    (16, 256, "uniform", 1 << 20): {"vector": 44.97, "sorted": 45.72, "staged": 28.30, "dedupe_staged": 25.82,
                                    "split": 34.32},
    (16, 64, "sorted", 1 << 17): {"vector": 18.01, "staged": 10.84, "dedupe_staged": 7.66, "split": 9.30},
}


@pytest.mark.parametrize("cell", list(H100_CELLS), ids=lambda c: "-".join(map(str, c)))
def test_measuring_real_indices_keeps_the_best_forced_plan(fake_run, cell):
    # Features from the cell's own indices (synthetic, on the CPU), its candidates raced at the rates measured when
    # each was forced: the plan kept is the best forced one, and later calls of the kind run it without measuring.
    gib, rb, pattern, count = cell
    rows = gib * GIB // rb
    g = torch.Generator().manual_seed(7)
    idx = _features.synthetic_indices(pattern, count, rows, g, zipf_s=1.2)
    call = Call("gather", gib * GIB, rows, rb, count, "managed")
    features = features_of(idx, rows, rb)
    d = decide_for({}, call, features)
    rates = H100_CELLS[cell]
    assert d.plan is None and set(d.candidates) <= set(rates)
    best = max(d.candidates, key=rates.get)
    assert best == max(rates, key=rates.get)  # the best forced strategy is among the candidates
    fake_run({s: call.bytes / (v * 1e9) for s, v in rates.items()}, [])
    plan, m = measure(call, features, d.candidates)
    assert plan.strategy == best and m.best == best
    assert decide_for(_auto.measured_cells(), call, features) == Decision(Plan(best), source="measured")


# Cells of another H100 benchmark where auto ran below 0.95x the best forced column: (table GiB, row bytes, pattern,
# count) -> (the rates auto measured on its first call, the steady rates of each strategy forced, GB/s). In each
# of them auto had kept the best forced column's plan and ran it slower than that column, timed after other
# columns (benchmarks/gather.py, interleaved_best): the decision was right, the conditions of the timing differed.
H100_KEPT_RIGHT = {
    (1, 64, "uniform", 1 << 17): ({"sorted": 20.33, "vector": 27.29, "staged": 9.15, "dedupe_staged": 4.85,
                                   "split": 6.54},
                                  {"vector": 23.17, "sorted": 15.77, "staged": 9.62, "dedupe_staged": 5.87,
                                   "split": 8.68}),
    (16, 64, "uniform", 1 << 17): ({"sorted": 14.50, "vector": 18.55, "staged": 9.12, "dedupe_staged": 6.93,
                                    "split": 13.01},
                                   {"vector": 14.83, "sorted": 11.78, "staged": 7.95, "dedupe_staged": 5.03,
                                    "split": 8.03}),
    (16, 64, "sorted", 1 << 17): ({"vector": 20.22, "staged": 8.77, "dedupe_staged": 6.12, "split": 12.68},
                                  {"vector": 17.49, "staged": 8.64, "dedupe_staged": 5.42, "split": 9.41}),
    (16, 64, "zipf", 1 << 17): ({"dedupe": 15.91, "vector": 49.40, "sorted": 36.12, "staged": 14.06,
                                 "dedupe_staged": 13.35, "split": 22.27},
                                {"vector": 34.95, "sorted": 26.54, "dedupe": 11.93, "staged": 12.50,
                                 "dedupe_staged": 9.16, "split": 14.86}),
    (1, 256, "uniform", 1 << 17): ({"sorted": 40.82, "vector": 45.70, "staged": 21.64, "dedupe_staged": 8.44,
                                    "split": 28.74},
                                   {"vector": 42.36, "sorted": 36.72, "staged": 20.01, "dedupe_staged": 15.19,
                                    "split": 25.13}),
    (1, 256, "uniform", 1 << 20): ({"sorted": 50.37, "vector": 45.95, "staged": 23.36, "dedupe_staged": 22.48,
                                    "split": 41.67},
                                   {"vector": 46.37, "sorted": 48.27, "staged": 24.42, "dedupe_staged": 22.43,
                                    "split": 38.57}),
    (16, 256, "sorted", 1 << 17): ({"vector": 44.22, "staged": 17.85, "dedupe_staged": 6.32, "split": 29.75},
                                   {"vector": 42.54, "staged": 20.29, "dedupe_staged": 15.43, "split": 27.45}),
    (16, 256, "zipf", 1 << 20): ({"dedupe": 154.46, "vector": 113.75, "sorted": 279.76, "staged": 20.25,
                                  "dedupe_staged": 80.91, "split": 146.73},
                                 {"vector": 114.08, "sorted": 258.03, "dedupe": 131.61, "staged": 26.17,
                                  "dedupe_staged": 79.47, "split": 121.88}),
}


@pytest.mark.parametrize("cell", list(H100_KEPT_RIGHT), ids=lambda c: "-".join(map(str, c)))
def test_decisions_from_first_call_rates_are_the_best_forced_plans(cell):
    gib, rb, pattern, count = cell
    rows = gib * GIB // rb
    idx = _features.synthetic_indices(pattern, count, rows, torch.Generator().manual_seed(5), zipf_s=1.2)
    call = Call("gather", gib * GIB, rows, rb, count, "managed")
    features = features_of(idx, rows, rb)
    measured, steady = H100_KEPT_RIGHT[cell]
    assert set(measured) == set(decide_for({}, call, features).candidates)  # the candidates it measured
    d = decide_for(measurement(call, features, measured), call, features)
    assert d.source == "measured" and steady[d.plan.strategy] >= 0.95 * max(steady.values())
    assert decide_for(measurement(call, features, measured), call, features, capturing=True).plan == d.plan


def test_measuring_stops_at_the_budget(fake_run):
    call = gather_call()
    log = []
    _auto._state.budget_s = 0.05
    fake_run({"staged": 0.06, "vector": 0.01, "sorted": 0.01, "split": 0.01}, log)
    plan, m = measure(call, RANDOM, ("staged", "vector", "sorted", "split"))
    assert plan == Plan("staged") and set(m.gbps) == {"staged"}  # the first candidate always runs
    assert _auto._state.budget_s < 0
    decision, _, _ = _auto.choose(call, torch.arange(call.count), capturing=False)  # sorted: another cell
    assert decision.source == "nearest"  # no budget left: no more measuring in this process


def test_a_candidate_out_of_gpu_memory_is_left_out(fake_run):
    log = []
    fake_run({"vector": 0.02, "sorted": 0.01, "dedupe": 0.005}, log, fail=("dedupe",))
    plan, m = measure(gather_call(), ZIPF, ("vector", "sorted", "dedupe"))
    assert plan == Plan("sorted") and set(m.gbps) == {"vector", "sorted"}
    assert log[-1] == "sorted"  # the failed candidate may have written part of the output: the kept plan ran last
    with pytest.raises(torch.cuda.OutOfMemoryError):
        measure(gather_call(), ZIPF, ("dedupe",))


def test_an_incomplete_cell_is_measured_again_where_budget_is_left(fake_run):
    call = gather_call()
    _auto._state.budget_s = 0.01
    fake_run({"staged": 0.02, "vector": 0.01}, [])
    _, m = measure(call, RANDOM, ("staged", "vector"))
    assert m.complete is False
    ms = _auto.measured_cells()
    assert decide_for(ms, call, RANDOM).plan is None
    assert decide_for(ms, call, RANDOM, may_measure=False).plan == Plan("staged")
    assert decide_for(ms, call, RANDOM, capturing=True).plan == Plan("sorted")  # rules: no host


def test_choose_computes_features_on_the_first_call_and_every_few_calls(monkeypatch):
    call = gather_call(count=1 << 16, row_bytes=64)
    computed = []
    real = _features.index_features
    monkeypatch.setattr(_features, "index_features", lambda *a: computed.append(1) or real(*a))
    idx = torch.randint(0, call.rows, (call.count,))
    pd.set_auto_calibrate(False)
    try:
        every = _auto.RECHECK_EVERY
        checked_at = [0, every, 3 * every, 7 * every]  # the interval doubles while the index classes stay the same
        for k in range(7 * every + 1):
            decision, features, bounds = _auto.choose(call, idx, capturing=False)
            assert (bounds is not None) == (k in checked_at), k
            assert decision.source == "rules" and features.order == "random"
        assert len(computed) == 4
        # New classes: checked again RECHECK_EVERY calls later (not at the doubled interval).
        sorted_idx = torch.sort(idx).values
        calls = 0
        while bounds is None or calls == 0:
            decision, features, bounds = _auto.choose(call, sorted_idx, capturing=False)
            calls += 1
        assert features.order == "sorted" and calls == 8 * every  # the next check after 7 * every, at 15 * every
        for _ in range(every):
            bounds = _auto.choose(call, sorted_idx, capturing=False)[2]
        assert bounds is not None and len(computed) == 6
        # Inside graph capture nothing is computed: the last features of this kind are used.
        decision, features, bounds = _auto.choose(call, idx, capturing=True)
        assert bounds is None and len(computed) == 6 and features.order == "sorted"
        assert not decision.plan.needs_host
        _auto.reset()
        decision, features, bounds = _auto.choose(call, idx, capturing=True)
        assert features is None and decision.plan == Plan("sorted")  # rules, device-only
    finally:
        pd.set_auto_calibrate(True)


def test_decisions_are_kept_per_kind_until_features_or_cells_change(monkeypatch):
    call = gather_call(count=1 << 16, row_bytes=64)
    idx = torch.randint(0, call.rows, (call.count,))
    decided = []
    real = _auto.decide
    monkeypatch.setattr(_auto, "decide", lambda *a, **k: decided.append(1) or real(*a, **k))
    pd.set_auto_calibrate(False)
    try:
        first, features, _ = _auto.choose(call, idx, capturing=False)
        for _ in range(5):
            assert _auto.choose(call, idx, capturing=False)[0] is first
        assert len(decided) == 1  # a dictionary lookup per call after the first
        assert first.plan == Plan("staged")
        assert _auto.choose(call, idx, capturing=True)[0].plan == Plan("sorted") and len(decided) == 2
        _auto._state.store.record(measurement(call, features, {"vector": 40.0, "sorted": 3.0}), save=False)
        assert _auto.choose(call, idx, capturing=False)[0].plan == Plan("vector")  # new cells: decided again
        # The same call on a cached table is another kind, decided on its own.
        assert _auto.choose(call, idx, capturing=False, cached=True)[0].plan.strategy.startswith("cached")
        # Another index pattern of the same kind is seen at the next re-check of the features.
        sorted_idx = torch.sort(idx).values
        for _ in range(_auto.RECHECK_EVERY):
            decision, features, _ = _auto.choose(call, sorted_idx, capturing=False)
        assert features.order == "sorted" and decision.source == "nearest"
    finally:
        pd.set_auto_calibrate(True)


def _host_plan_cell(call):
    """A cell where staged (30 GB/s) is kept over vector (20 GB/s, times the host margin 22), and random indices
    of its kind."""
    idx = torch.randint(0, call.rows, (call.count,), generator=torch.Generator().manual_seed(0))
    features, _, _ = _features.index_features(idx, call.rows, call.row_bytes)
    _auto._state.store.record(measurement(call, features, {"staged": 30.0, "vector": 20.0}))
    return idx, Cell(call, features).key


def _calls(call, seconds, between, now=None):
    """Reports calls of `seconds` each, `between` seconds apart, to observe() (a simulated clock)."""
    now = now if now is not None else [100.0]
    for s in seconds:
        start = now[0]
        now[0] += s
        _auto.observe(call, start, now[0])
        now[0] += between
    return now


def test_a_host_plan_slower_in_use_than_measured_gives_way():
    """A host strategy that runs far slower in the caller's loop than when it was measured (it waits there for the
    GPU work making its indices, or for the CPU) is replaced after CHECK_CALLS calls, in this process and the next."""
    call = gather_call(table_gib=16, row_bytes=256, count=1 << 17)
    idx, key = _host_plan_cell(call)
    decision, _, _ = _auto.choose(call, idx, capturing=False)
    assert decision.plan == Plan("staged") and decision.source == "measured"
    slow = [call.bytes / gbps / 1e9 for gbps in (30.0, 9.0, 12.0, 11.0, 10.0)]  # the first call is not counted
    now = _calls(call, slow[:-1], between=1e-6)
    assert _auto.checking(call) and _auto.choose(call, idx, capturing=False)[0].plan == Plan("staged")
    _calls(call, slow[-1:], between=1e-6, now=now)
    assert not _auto.checking(call)
    assert _auto.choose(call, idx, capturing=False)[0].plan == Plan("vector")
    stored = json.loads(_auto.cache_path().read_text())["cells"][str(key)]
    assert stored["gbps"] == {"staged": pytest.approx(12.0), "vector": 20.0}  # the best of the four
    assert stored["observed"] == {"staged": pytest.approx(12.0)} and stored["best"] == "vector"
    assert "caller_busy" not in stored
    _auto.reset()  # the next process starts from the observed rate and checks nothing
    assert _auto.choose(call, idx, capturing=False)[0].plan == Plan("vector")
    assert not _auto.checking(call)


def test_a_host_plan_gives_way_to_a_caller_busy_between_calls():
    """Calls as fast as measured, but the caller works longer between them than they last (a training step between
    two feature gathers): a host plan holds that caller's thread, so the cell serves GPU plans from then on."""
    call = gather_call(table_gib=16, row_bytes=256, count=1 << 17)
    idx, key = _host_plan_cell(call)
    _auto.choose(call, idx, capturing=False)
    seconds = call.bytes / 30.0 / 1e9
    _calls(call, [seconds] * (_auto.CHECK_CALLS + 1), between=3 * seconds)
    stored = _auto.measured_cells()[key]
    assert stored.caller_busy is True and stored.gbps["staged"] == 30.0 and stored.best == "vector"
    assert _auto.choose(call, idx, capturing=False)[0].plan == Plan("vector")
    _auto.reset()
    assert _auto.choose(call, idx, capturing=False)[0].plan == Plan("vector")  # the next process too


def test_only_auto_calls_of_a_kind_being_checked_are_timed(monkeypatch):
    call = gather_call(table_gib=16, row_bytes=256, count=1 << 17)
    idx, key = _host_plan_cell(call)
    _auto.choose(call, idx, capturing=False)
    seen = []
    monkeypatch.setattr(_auto, "observe", lambda c, start, end, cached=False: seen.append(c))
    ran = []
    monkeypatch.setattr(_measure, "execute", lambda job, plan, **k: ran.append(job.op))
    plan = Plan("staged")
    _auto.run(call, dataclasses.replace(DUMMY_JOB, op="forced"), plan, auto=False, check_bounds=False,
              in_range=False)  # a forced call of the same kind
    _auto.run(call, dataclasses.replace(DUMMY_JOB, op="auto"), plan, auto=True, check_bounds=False, in_range=False)
    assert ran == ["forced", "auto"] and seen == [call]
    other = gather_call(table_gib=16, row_bytes=4096, count=1 << 17)  # a kind not being checked
    _auto.run(other, dataclasses.replace(DUMMY_JOB, op="other"), plan, auto=True, check_bounds=False,
              in_range=False)
    assert ran[-1] == "other" and seen == [call]


def test_a_wait_shorter_than_the_measured_call_is_not_a_busy_caller():
    """split's GPU half can outlast the call's return: a loop that synchronises after each call waits for it between
    calls. That wait is shorter than the call as measured (to the end of its GPU work), so the host plan stays."""
    call = gather_call(table_gib=16, row_bytes=256, count=1 << 17)
    idx, key = _host_plan_cell(call)
    _auto.choose(call, idx, capturing=False)
    returns = call.bytes / 60.0 / 1e9  # the call returns at twice its measured rate (30 GB/s) ...
    _calls(call, [returns] * (_auto.CHECK_CALLS + 1), between=1.5 * returns)  # ... then its GPU half ends
    stored = _auto.measured_cells()[key]
    assert not stored.caller_busy and stored.best == "staged"


def test_a_host_plan_as_fast_as_measured_in_a_gather_loop_is_kept_and_checked_once():
    call = gather_call(table_gib=16, row_bytes=256, count=1 << 17)
    idx, key = _host_plan_cell(call)
    _auto.choose(call, idx, capturing=False)
    seconds = call.bytes / 25.0 / 1e9  # 0.83x the measured rate: within CHECK_SLOWER
    _calls(call, [seconds] * (_auto.CHECK_CALLS + 1), between=0.1 * seconds)  # a loop that only gathers
    stored = _auto.measured_cells()[key]
    assert stored.gbps["staged"] == 30.0 and stored.observed == {"staged": pytest.approx(25.0)}
    assert not stored.caller_busy and stored.best == "staged"
    for _ in range(2 * _auto.RECHECK_EVERY):  # new features and decisions: the cell's plan is checked already
        assert _auto.choose(call, idx, capturing=False)[0].plan == Plan("staged")
        assert not _auto.checking(call)


def test_device_plans_and_unmeasured_decisions_are_not_checked():
    call = gather_call(table_gib=16, row_bytes=256, count=1 << 17)
    idx = torch.randint(0, call.rows, (call.count,))
    features, _, _ = _features.index_features(idx, call.rows, call.row_bytes)
    _auto._state.store.record(measurement(call, features, {"staged": 21.0, "vector": 20.0}))  # below the margin
    assert _auto.choose(call, idx, capturing=False)[0].plan == Plan("vector")
    assert not _auto.checking(call)
    _auto.reset(delete_file=True)
    pd.set_auto_calibrate(False)
    try:
        decision = _auto.choose(call, idx, capturing=False)[0]
        assert decision.source == "rules" and decision.plan == Plan("staged") and not _auto.checking(call)
    finally:
        pd.set_auto_calibrate(True)


def test_cache_file_problems_only_cost_measuring_again():
    path = _auto.cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{not json")
    assert _auto.measured_cells() == {}
    path.write_text(json.dumps({"format": 3, "cells": {"gather|t34|r16|n20|random|none": {"gbps": {"x": 1}}}}))
    _auto.reset()
    assert _auto.measured_cells() == {}  # an older format
    good = {"gbps": {"sorted": 3.0}, "best": "sorted"}
    path.write_text(json.dumps({"format": _cells.FORMAT, "cells": {
        "gather|t34|r16|n20|random|none": good, "no key": good, "gather|t34|r16|n21|random|none": {"best": 1}}}))
    _auto.reset()
    assert [str(k) for k in _auto.measured_cells()] == ["gather|t34|r16|n20|random|none"]  # the others left out
    call = gather_call()
    _auto._state.store.record(measurement(call, ZIPF, {"sorted": 3.0}))
    on_disk = json.loads(path.read_text())
    assert on_disk["format"] == _cells.FORMAT and len(on_disk["cells"]) == 2
    _auto.reset(delete_file=True)
    assert not path.exists() and _auto.measured_cells() == {}


def test_the_cache_directory_follows_xdg_cache_home(tmp_path, monkeypatch):
    from pytorch_direct import _config

    def read():  # the value from the environment (the test's fixture overrides the setting itself)
        return dict(_config.settings)["cache_dir"].from_environment()

    try:
        monkeypatch.delenv("PYTORCH_DIRECT_CACHE_DIR", raising=False)
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
        assert read() == tmp_path / "xdg" / "pytorch_direct"
        monkeypatch.delenv("XDG_CACHE_HOME")
        assert read().parts[-2:] == (".cache", "pytorch_direct")
        monkeypatch.setenv("PYTORCH_DIRECT_CACHE_DIR", str(tmp_path / "mine"))
        assert read() == tmp_path / "mine"
    finally:
        monkeypatch.undo()


def test_calibrate_needs_a_gpu():
    if pd.cuda_usable():
        pytest.skip("a GPU is usable here")
    with pytest.raises(pd.UnavailableError, match="CUDA"):
        pd.calibrate()


def test_measured_runs_pay_the_bounds_check_their_plan_pays_later(monkeypatch):
    """Candidates are compared at what a later call of theirs costs: the device-checked plans with the sync bounds
    check, the host-gathered ones without (they check as they read). A scatter writes nothing for a bad index."""
    import contextlib

    checks, moved = [], []

    @contextlib.contextmanager
    def overlapped(idx, rows):  # the GPU's overlapped check, as a CPU check after the block
        yield
        checks.append("overlapped")
        _kernels.precheck(idx, rows)

    monkeypatch.setattr(_kernels, "bounds_checked", overlapped)
    for fn in ("launch_gather", "launch_scatter", "gather_staged", "scatter_staged", "launch_cached"):
        monkeypatch.setattr(_kernels, fn, lambda *a, fn=fn: moved.append(fn))
    monkeypatch.setattr(_kernels, "raw_stream", lambda device: 0)
    monkeypatch.setattr(_kernels, "staged_index", lambda idx, rb, rows: idx)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: None)
    bad = torch.tensor([0, 5, 10])  # 10 is out of range for 10 rows
    for op in ("gather", "scatter"):
        job = RowJob(op, torch.zeros(10, 4), 10, 16, bad, torch.zeros(3, 4))
        for strategy in ("vector", "sorted"):
            moved.clear()
            with pytest.raises(IndexError, match="index 10 is out of range"):
                _strategies.run(job, Plan(strategy), check_bounds=True, in_range=True)
            assert moved == ([] if op == "scatter" else ["launch_gather"])  # a scatter: nothing written
            _strategies.run(job, Plan(strategy), check_bounds=False, in_range=False)  # async mode: no check
        for strategy in ("staged",) + (("dedupe_staged",) if op == "gather" else ()):
            if strategy == "dedupe_staged":
                continue  # (torch.unique on the device first: covered by the GPU tests)
            moved.clear()
            _strategies.run(job, Plan(strategy), check_bounds=True, in_range=True)  # it checks as it reads
            assert moved == [f"{op}_staged"]
    assert checks.count("overlapped") == 2  # the gathers' device plans overlap the check
