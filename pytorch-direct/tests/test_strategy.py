"""The ``auto`` decision on the CPU: index features, the duplicate estimate, the pure decision function, measuring
(with timed stand-ins for the strategies), and the per-machine cache of measured cells."""

import dataclasses
import json
import math

import pytest
import torch

import pytorch_direct as pd
from pytorch_direct import _strategy
from pytorch_direct._kernels import Plan
from pytorch_direct._strategy import Call, Features, decide

GIB = 1 << 30
RANDOM = Features(ascending=0.5, near=0.0, duplicates=0.0)
SORTED = Features(ascending=1.0, near=0.9, duplicates=0.0)
CLUSTERED = Features(ascending=0.52, near=0.95, duplicates=0.0)
ZIPF = Features(ascending=0.5, near=0.01, duplicates=0.6)


@pytest.fixture(autouse=True)
def fresh_state(tmp_cache):
    _strategy.reset()
    yield
    _strategy.reset()


def gather_call(table_gib=16, row_bytes=256, count=1 << 20):
    table_bytes = int(table_gib * GIB)
    return Call("gather", table_bytes, table_bytes // row_bytes, row_bytes, count)


def features_of(idx, rows, row_bytes=64):
    features, lo, hi = _strategy.index_features(idx, rows, row_bytes)
    assert (lo, hi) == (int(idx.min()), int(idx.max()))
    return features


# ---------------------------------------------------------------------------------------------------- features


def test_duplicate_estimate_is_exact_on_the_whole_index():
    assert _strategy.estimate_duplicates(100, 10**6, 100, 100, 25) == 0.0
    assert _strategy.estimate_duplicates(100, 10**6, 100, 1, 1) == pytest.approx(0.99)
    assert _strategy.estimate_duplicates(0, 10, 0, 0, 0) == 0.0
    # More indices than rows: at least count - rows repeat.
    assert _strategy.estimate_duplicates(10**6, 1000, 4096, 4096, 1024) >= 1 - 1000 / 10**6


@pytest.mark.parametrize("pattern,order", [("uniform", "random"), ("sorted", "sorted"), ("clustered", "clustered")])
def test_index_order_classes(pattern, order):
    g = torch.Generator().manual_seed(3)
    rows = 50_000_000
    idx = _strategy.synthetic_indices(pattern, 300_000, rows, g, cluster=64)
    f = features_of(idx, rows)
    assert f.order == order
    assert f.duplicate_class == "none"


@pytest.mark.parametrize("s,low,high", [(0.8, 0.0, 0.5), (1.0, 0.2, 0.8), (1.2, 0.5, 0.95)])
def test_zipf_duplicates_are_estimated_from_a_sample(s, low, high):
    # The estimate (a power law fitted on the sample) against the exact fraction of repeated indices: never
    # above it by more than noise (dedupe must not be chosen on imagined duplicates), and the right class.
    g = torch.Generator().manual_seed(int(s * 10))
    rows, n = 20_000_000, 1_000_000
    idx = _strategy.synthetic_indices("zipf", n, rows, g, zipf_s=s)
    exact = 1 - torch.unique(idx).numel() / n
    f = features_of(idx, rows)
    assert low <= exact <= high
    assert f.duplicates <= exact + 0.05
    assert f.duplicates >= exact / 4
    if s >= 1.0:
        assert f.duplicate_class in ("some", "heavy") and f.order == "random"


def test_features_of_odd_index_tensors():
    f = features_of(torch.tensor([5]), 10)
    assert f.duplicates == 0.0 and f.order == "sorted"
    f = features_of(torch.full((100_000,), 7, dtype=torch.int32), 10)
    assert f.duplicates > 0.99 and f.duplicate_class == "heavy"
    perm = torch.randperm(200_000, generator=torch.Generator().manual_seed(1))
    assert features_of(perm, 200_000).duplicates < 0.01  # a permutation has no duplicates at full density


def test_synthetic_zipf_is_a_permutation_of_ranks():
    step = _strategy._coprime_step(1000)
    assert math.gcd(step, 1000) == 1
    ranks = torch.arange(1000)
    assert torch.equal(torch.sort((ranks * step) % 1000).values, ranks)
    with pytest.raises(ValueError, match="unknown index pattern"):
        _strategy.synthetic_indices("gauss", 10, 10, torch.Generator())


# ---------------------------------------------------------------------------------------------------- decision


def cell(call, features, gbps, span=0, **extra):
    op, table, row, count = call.kind
    return {_strategy.cell_key(call, features): dict(
        op=op, table_class=table, row_class=row, count_class=count, order=features.order,
        dup=features.duplicate_class, span=span, best=_strategy.pick(gbps), gbps=gbps, **extra)}


def test_small_calls_use_the_vector_kernel():
    call = gather_call(row_bytes=64, count=1000)
    assert decide({}, call, RANDOM, capturing=False, may_measure=True) == _strategy.Decision(Plan("vector"),
                                                                                              source="small")


def test_unmeasured_calls_are_measured_with_the_rules_choice_first():
    call = gather_call(table_gib=48, row_bytes=128, count=1 << 18)  # 0.2 % of a 48 GiB table
    d = decide({}, call, RANDOM, capturing=False, may_measure=True)
    assert d.plan is None and d.source == "measure"
    assert d.candidates[0] == "staged" and d.candidates[-1] == "split"
    # No duplicates: no dedupe; dedupe_staged all the same (its host gather reads the rows in address order).
    assert set(d.candidates) == {"staged", "vector", "sorted", "dedupe_staged", "split"}
    d = decide({}, call, ZIPF, capturing=False, may_measure=True)
    assert d.candidates[0] == "dedupe" and {"dedupe", "dedupe_staged"} <= set(d.candidates)
    d = decide({}, call, SORTED, capturing=False, may_measure=True)
    assert "sorted" not in d.candidates and d.candidates[0] == "vector"  # sorting sorted indices is wasted
    scatter = Call("scatter", call.table_bytes, call.rows, call.row_bytes, call.count)
    assert set(decide({}, scatter, ZIPF, capturing=False, may_measure=True).candidates) == {"vector", "sorted",
                                                                                            "staged"}


def test_rules_account_for_table_size_rows_density_order_and_duplicates():
    rules = _strategy.rules
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


def test_memory_kinds_get_their_own_cells():
    # The same call on a pinned and on a managed table ran 7x apart (probe P7): never one cell for both.
    pinned = gather_call(table_gib=48, row_bytes=256, count=1 << 18)
    managed = dataclasses.replace(pinned, memory="managed")
    assert _strategy.cell_key(pinned, RANDOM) != _strategy.cell_key(managed, RANDOM)
    assert pinned.kind != managed.kind
    cells = cell(pinned, RANDOM, {"staged": 30.0, "vector": 7.0})
    assert _strategy.find_cell(cells, pinned, RANDOM) is not None
    assert _strategy.find_cell(cells, managed, RANDOM) is None
    assert _strategy.nearest_cell(cells, managed, RANDOM) is None


def test_measured_cells_decide_and_graph_capture_gets_the_best_device_strategy():
    call = gather_call(table_gib=16, row_bytes=400, count=2_000_000)
    cells = cell(call, RANDOM, {"vector": 12.0, "sorted": 30.0, "staged": 28.0, "split": 44.6},
                 split_fraction=0.6, split_kernel="sorted")
    d = decide(cells, call, RANDOM, capturing=False, may_measure=True)
    assert d == _strategy.Decision(Plan("split", 0.6, "sorted"), source="measured")
    assert decide(cells, call, RANDOM, capturing=True, may_measure=False).plan == Plan("sorted")
    # Another index order is another cell: measured, not guessed from this one.
    assert decide(cells, call, SORTED, capturing=False, may_measure=True).plan is None
    # Without measuring (budget spent, auto-calibration off): the nearest cell of the same table and row width.
    assert decide(cells, call, SORTED, capturing=False, may_measure=False).source == "nearest"
    other_rows = gather_call(table_gib=16, row_bytes=4096, count=200_000)
    assert decide(cells, other_rows, RANDOM, capturing=False, may_measure=False).source == "rules"
    other_table = gather_call(table_gib=1, row_bytes=400, count=2_000_000)
    assert decide(cells, other_table, RANDOM, capturing=False, may_measure=True).plan is None


def test_host_strategies_need_a_margin():
    assert _strategy.pick({"vector": 2.0, "sorted": 10.0, "staged": 11.5}) == "staged"  # 1.15x
    assert _strategy.pick({"vector": 2.0, "sorted": 10.0, "staged": 10.5}) == "sorted"  # 1.05x
    assert _strategy.pick({"staged": 1.0}) == "staged"
    assert _strategy.pick({"dedupe": 5.0, "dedupe_staged": 5.1, "vector": 1.0}) == "dedupe"


def test_calibrated_cells_span_neighbouring_counts():
    call = gather_call(count=1 << 18)
    cells = cell(call, RANDOM, {"vector": 9.0, "sorted": 30.0}, span=1)
    assert decide(cells, gather_call(count=1 << 19), RANDOM, capturing=False, may_measure=True).plan == Plan("sorted")
    assert decide(cells, gather_call(count=1 << 20), RANDOM, capturing=False, may_measure=True).plan is None


def test_forced_split_takes_its_share_from_a_measured_cell():
    call = gather_call()
    assert _strategy.forced_plan("gather", "split", call) == Plan("split", 0.5, "sorted")
    _strategy._state.record(cell(call, RANDOM, {"split": 30.0, "sorted": 20.0}, split_fraction=0.7,
                                 split_kernel="vector"), save=False)
    assert _strategy.forced_plan("gather", "split", call) == Plan("split", 0.7, "vector")
    assert _strategy.forced_plan("scatter", "dedupe", call) == Plan("sorted")
    assert _strategy.forced_plan("scatter", "split", call) == Plan("staged")
    with pytest.raises(ValueError, match="unknown plan"):
        Plan("fastest")


# ---------------------------------------------------------------------------------------------------- measuring


@pytest.fixture
def fake_run(monkeypatch):
    """make(seconds, log): a call whose strategies take the given seconds on a simulated clock (what measure()
    times), logging each run."""
    now = [0.0]
    monkeypatch.setattr(_strategy, "_clock", lambda: now[0])

    def make(seconds, log):
        def run(plan):
            log.append(plan.strategy)
            now[0] += seconds[plan.strategy]

        return run

    return make


def test_measure_keeps_the_fastest_records_it_and_splits_by_rate(fake_run):
    call = gather_call(count=1 << 20)
    log = []
    seconds = {"vector": 0.03, "sorted": 0.01, "staged": 0.015, "split": 0.0078}
    plan, c = _strategy.measure(call, RANDOM, ("vector", "sorted", "staged", "split"), fake_run(seconds, log))
    assert plan.strategy == "split"
    # The split's share follows the kernel (sorted) and staged rates: 1/0.01 / (1/0.01 + 1/0.015) = 0.6.
    assert c["split_kernel"] == "sorted" and c["split_fraction"] == pytest.approx(0.6, abs=0.05)
    assert log[:6] == ["vector", "vector", "sorted", "sorted", "staged", "staged"]  # a warm-up run, a timed one
    # The finalists (within RETIME_WITHIN of the fastest: split and sorted at 1.28x) are timed in two more rounds.
    assert log.count("split") == 4 and log.count("sorted") == 4 and log.count("vector") == 2
    assert log[-4:] == ["sorted", "split", "split", "sorted"]  # interleaved, the second round reversed
    key = _strategy.cell_key(call, RANDOM)
    on_disk = json.loads(_strategy.cache_path().read_text())
    assert on_disk["cells"][key]["best"] == "split"
    _strategy.reset()  # a new process reads the cell from disk
    assert decide(_strategy.measured_cells(), call, RANDOM, capturing=False, may_measure=True).plan == plan


def test_auto_status_reports_the_last_decision_and_the_measuring_time(fake_run):
    assert pd.auto_status() == {"strategy": None, "source": None, "order": None, "duplicates": None,
                                "measuring_s": 0.0, "measured_cells": 0}
    call = gather_call(count=1 << 20)
    _strategy.measure(call, RANDOM, ("vector", "sorted"), fake_run({"vector": 0.03, "sorted": 0.01}, []))
    status = pd.auto_status()
    assert status["strategy"] == "sorted" and status["source"] == "measured now" and status["order"] == "random"
    assert status["measuring_s"] == pytest.approx(0.03 * 2 + 0.01 * 2)  # a warm-up and a timed run each
    assert status["measured_cells"] == 1


def test_short_calls_are_timed_three_times(fake_run):
    log = []
    _strategy.measure(gather_call(), RANDOM, ("vector", "sorted"), fake_run({"vector": 0.001, "sorted": 0.01}, log))
    assert log.count("vector") == 1 + 3 and log.count("sorted") == 2  # warm-up, 3 timed; no finalist to retime


def test_finalists_are_compared_interleaved_not_one_after_the_other(monkeypatch):
    """A drift during measuring (here: every run 0.8 ms faster than the one before, as with caches warming up) must
    not hand the cell to whichever candidate ran last: the finalists are timed again in alternating order."""
    now = [0.0]
    runs = []
    true_seconds = {"staged": 0.020, "dedupe_staged": 0.021}  # staged is the faster one
    monkeypatch.setattr(_strategy, "_clock", lambda: now[0])

    def run(plan):
        runs.append(plan.strategy)
        now[0] += true_seconds[plan.strategy] - 0.0008 * len(runs)

    call = gather_call()
    _strategy.measure(call, RANDOM, ("staged", "dedupe_staged"), run, budget_s=math.inf)
    # One after the other (staged: runs 1-2, dedupe_staged: runs 3-4), dedupe_staged measured 17.8 ms against
    # staged's 18.4, and would have been kept.
    assert runs == ["staged"] * 2 + ["dedupe_staged"] * 2 + ["staged", "dedupe_staged", "dedupe_staged", "staged"]
    assert _strategy.measured_cells()[_strategy.cell_key(call, RANDOM)]["best"] == "staged"


def test_measuring_stops_at_the_budget(fake_run):
    call = gather_call()
    log = []
    _strategy._state.budget_s = 0.05
    seconds = {"staged": 0.06, "vector": 0.01, "sorted": 0.01, "split": 0.01}
    plan, c = _strategy.measure(call, RANDOM, ("staged", "vector", "sorted", "split"), fake_run(seconds, log))
    assert plan == Plan("staged") and set(c["gbps"]) == {"staged"}  # the first candidate always runs
    assert _strategy._state.budget_s < 0
    decision, _, _ = _strategy.choose(call, torch.arange(call.count), capturing=False)  # sorted: another cell
    assert decision.source == "nearest"  # no budget left: no more measuring in this process


def test_a_candidate_out_of_gpu_memory_is_left_out(fake_run):
    log = []
    seconds = {"vector": 0.02, "sorted": 0.01, "dedupe": 0.005}
    inner = fake_run(seconds, log)

    def run(plan):
        inner(plan)
        if plan.strategy == "dedupe":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (a stand-in)")

    plan, c = _strategy.measure(gather_call(), ZIPF, ("vector", "sorted", "dedupe"), run)
    assert plan == Plan("sorted") and set(c["gbps"]) == {"vector", "sorted"}
    assert log[-1] == "sorted"  # the failed candidate may have written part of the output: the kept plan ran last
    with pytest.raises(torch.cuda.OutOfMemoryError):
        _strategy.measure(gather_call(), ZIPF, ("dedupe",), run)


def test_an_incomplete_cell_is_measured_again_where_budget_is_left(fake_run):
    call = gather_call()
    _strategy._state.budget_s = 0.01
    _, c = _strategy.measure(call, RANDOM, ("staged", "vector"), fake_run({"staged": 0.02, "vector": 0.01}, []))
    assert c["complete"] is False
    cells = _strategy.measured_cells()
    assert decide(cells, call, RANDOM, capturing=False, may_measure=True).plan is None
    assert decide(cells, call, RANDOM, capturing=False, may_measure=False).plan == Plan("staged")
    assert decide(cells, call, RANDOM, capturing=True, may_measure=True).plan == Plan("sorted")  # rules: no host


def test_choose_computes_features_on_the_first_call_and_every_few_calls(monkeypatch):
    call = gather_call(count=1 << 16, row_bytes=64)
    computed = []
    real = _strategy.index_features
    monkeypatch.setattr(_strategy, "index_features", lambda *a: computed.append(1) or real(*a))
    idx = torch.randint(0, call.rows, (call.count,))
    pd.set_auto_calibrate(False)
    try:
        every = _strategy.RECHECK_EVERY
        checked_at = [0, every, 3 * every, 7 * every]  # the interval doubles while the index classes stay the same
        for k in range(7 * every + 1):
            decision, features, bounds = _strategy.choose(call, idx, capturing=False)
            assert (bounds is not None) == (k in checked_at), k
            assert decision.source == "rules" and features.order == "random"
        assert len(computed) == 4
        # New classes: checked again RECHECK_EVERY calls later (not at the doubled interval).
        sorted_idx = torch.sort(idx).values
        calls = 0
        while bounds is None or calls == 0:
            decision, features, bounds = _strategy.choose(call, sorted_idx, capturing=False)
            calls += 1
        assert features.order == "sorted" and calls == 8 * every  # the next check after 7 * every, at 15 * every
        for _ in range(every):
            bounds = _strategy.choose(call, sorted_idx, capturing=False)[2]
        assert bounds is not None and len(computed) == 6
        # Inside graph capture nothing is computed: the last features of this kind are used.
        decision, features, bounds = _strategy.choose(call, idx, capturing=True)
        assert bounds is None and len(computed) == 6 and features.order == "sorted"
        assert not decision.plan.needs_host
        _strategy.reset()
        decision, features, bounds = _strategy.choose(call, idx, capturing=True)
        assert features is None and decision.plan == Plan("sorted")  # rules, device-only
    finally:
        pd.set_auto_calibrate(True)


def test_decisions_are_kept_per_kind_until_features_or_cells_change(monkeypatch):
    call = gather_call(count=1 << 16, row_bytes=64)
    idx = torch.randint(0, call.rows, (call.count,))
    decided = []
    real = _strategy.decide
    monkeypatch.setattr(_strategy, "decide", lambda *a, **k: decided.append(1) or real(*a, **k))
    pd.set_auto_calibrate(False)
    try:
        first, features, _ = _strategy.choose(call, idx, capturing=False)
        for _ in range(5):
            assert _strategy.choose(call, idx, capturing=False)[0] is first
        assert len(decided) == 1  # a dictionary lookup per call after the first
        assert first.plan == Plan("staged")
        assert _strategy.choose(call, idx, capturing=True)[0].plan == Plan("sorted") and len(decided) == 2
        _strategy._state.record(cell(call, features, {"vector": 40.0, "sorted": 3.0}), save=False)
        assert _strategy.choose(call, idx, capturing=False)[0].plan == Plan("vector")  # new cells: decided again
        # Another index pattern of the same kind is seen at the next re-check of the features.
        sorted_idx = torch.sort(idx).values
        for _ in range(_strategy.RECHECK_EVERY):
            decision, features, _ = _strategy.choose(call, sorted_idx, capturing=False)
        assert features.order == "sorted" and decision.source == "nearest"
    finally:
        pd.set_auto_calibrate(True)


def _host_plan_cell(call):
    """A cell where staged (30 GB/s) is kept over vector (20 GB/s, times the host margin 25), and random indices of
    its kind."""
    idx = torch.randint(0, call.rows, (call.count,), generator=torch.Generator().manual_seed(0))
    features, _, _ = _strategy.index_features(idx, call.rows, call.row_bytes)
    _strategy._state.record(cell(call, features, {"staged": 30.0, "vector": 20.0}))
    return idx, _strategy.cell_key(call, features)


def _calls(call, seconds, between, now=None):
    """Reports calls of `seconds` each, `between` seconds apart, to observe() (a simulated clock)."""
    now = now if now is not None else [100.0]
    for s in seconds:
        start = now[0]
        now[0] += s
        _strategy.observe(call, start, now[0])
        now[0] += between
    return now


def test_a_host_plan_slower_in_use_than_measured_gives_way():
    """A host strategy that runs far slower in the caller's loop than when it was measured (it waits there for the
    GPU work making its indices, or for the CPU) is replaced after CHECK_CALLS calls, in this process and the next."""
    call = gather_call(table_gib=16, row_bytes=256, count=1 << 17)
    idx, key = _host_plan_cell(call)
    decision, _, _ = _strategy.choose(call, idx, capturing=False)
    assert decision.plan == Plan("staged") and decision.source == "measured"
    slow = [call.bytes / gbps / 1e9 for gbps in (30.0, 9.0, 12.0, 11.0, 10.0)]  # the first call is not counted
    now = _calls(call, slow[:-1], between=1e-6)
    assert _strategy.checking(call) and _strategy.choose(call, idx, capturing=False)[0].plan == Plan("staged")
    _calls(call, slow[-1:], between=1e-6, now=now)
    assert not _strategy.checking(call)
    assert _strategy.choose(call, idx, capturing=False)[0].plan == Plan("vector")
    stored = json.loads(_strategy.cache_path().read_text())["cells"][key]
    assert stored["gbps"] == {"staged": pytest.approx(12.0), "vector": 20.0}  # the best of the four
    assert stored["observed"] == {"staged": pytest.approx(12.0)} and stored["best"] == "vector"
    assert "caller_busy" not in stored
    _strategy.reset()  # the next process starts from the observed rate and checks nothing
    assert _strategy.choose(call, idx, capturing=False)[0].plan == Plan("vector")
    assert not _strategy.checking(call)


def test_a_host_plan_gives_way_to_a_caller_busy_between_calls():
    """Calls as fast as measured, but the caller works longer between them than they last (a training step between
    two feature gathers): a host plan holds that caller's thread, so the cell serves GPU plans from then on."""
    call = gather_call(table_gib=16, row_bytes=256, count=1 << 17)
    idx, key = _host_plan_cell(call)
    _strategy.choose(call, idx, capturing=False)
    seconds = call.bytes / 30.0 / 1e9
    _calls(call, [seconds] * (_strategy.CHECK_CALLS + 1), between=3 * seconds)
    stored = _strategy.measured_cells()[key]
    assert stored["caller_busy"] is True and stored["gbps"]["staged"] == 30.0 and stored["best"] == "vector"
    assert _strategy.choose(call, idx, capturing=False)[0].plan == Plan("vector")
    _strategy.reset()
    assert _strategy.choose(call, idx, capturing=False)[0].plan == Plan("vector")  # the next process too


def test_only_auto_calls_of_a_kind_being_checked_are_timed(monkeypatch):
    call = gather_call(table_gib=16, row_bytes=256, count=1 << 17)
    idx, key = _host_plan_cell(call)
    _strategy.choose(call, idx, capturing=False)
    seen = []
    monkeypatch.setattr(_strategy, "observe", lambda c, start, end: seen.append(c))
    ran = []
    _strategy.run_decided(call, lambda: ran.append("forced"), auto=False)  # a forced call of the same kind
    _strategy.run_decided(call, lambda: ran.append("auto"), auto=True)
    assert ran == ["forced", "auto"] and seen == [call]
    other = gather_call(table_gib=16, row_bytes=4096, count=1 << 17)  # a kind not being checked
    _strategy.run_decided(other, lambda: ran.append("other"), auto=True)
    assert ran[-1] == "other" and seen == [call]


def test_a_wait_shorter_than_the_measured_call_is_not_a_busy_caller():
    """split's GPU half can outlast the call's return: a loop that synchronises after each call waits for it between
    calls. That wait is shorter than the call as measured (to the end of its GPU work), so the host plan stays."""
    call = gather_call(table_gib=16, row_bytes=256, count=1 << 17)
    idx, key = _host_plan_cell(call)
    _strategy.choose(call, idx, capturing=False)
    returns = call.bytes / 60.0 / 1e9  # the call returns at twice its measured rate (30 GB/s) ...
    _calls(call, [returns] * (_strategy.CHECK_CALLS + 1), between=1.5 * returns)  # ... then its GPU half ends
    stored = _strategy.measured_cells()[key]
    assert "caller_busy" not in stored and stored["best"] == "staged"


def test_a_host_plan_as_fast_as_measured_in_a_gather_loop_is_kept_and_checked_once():
    call = gather_call(table_gib=16, row_bytes=256, count=1 << 17)
    idx, key = _host_plan_cell(call)
    _strategy.choose(call, idx, capturing=False)
    seconds = call.bytes / 25.0 / 1e9  # 0.83x the measured rate: within CHECK_SLOWER
    _calls(call, [seconds] * (_strategy.CHECK_CALLS + 1), between=0.1 * seconds)  # a loop that only gathers
    stored = _strategy.measured_cells()[key]
    assert stored["gbps"]["staged"] == 30.0 and stored["observed"] == {"staged": pytest.approx(25.0)}
    assert "caller_busy" not in stored and stored["best"] == "staged"
    for _ in range(2 * _strategy.RECHECK_EVERY):  # new features and decisions: the cell's plan is checked already
        assert _strategy.choose(call, idx, capturing=False)[0].plan == Plan("staged")
        assert not _strategy.checking(call)


def test_device_plans_and_unmeasured_decisions_are_not_checked():
    call = gather_call(table_gib=16, row_bytes=256, count=1 << 17)
    idx = torch.randint(0, call.rows, (call.count,))
    features, _, _ = _strategy.index_features(idx, call.rows, call.row_bytes)
    _strategy._state.record(cell(call, features, {"staged": 21.0, "vector": 20.0}))  # below the host margin
    assert _strategy.choose(call, idx, capturing=False)[0].plan == Plan("vector")
    assert not _strategy.checking(call)
    _strategy.reset(delete_file=True)
    pd.set_auto_calibrate(False)
    try:
        decision = _strategy.choose(call, idx, capturing=False)[0]
        assert decision.source == "rules" and decision.plan == Plan("staged") and not _strategy.checking(call)
    finally:
        pd.set_auto_calibrate(True)


def test_cache_file_problems_only_cost_measuring_again():
    path = _strategy.cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{not json")
    assert _strategy.measured_cells() == {}
    path.write_text(json.dumps({"format": 1, "gather": {}}))  # the old calibration format
    _strategy.reset()
    assert _strategy.measured_cells() == {}
    call = gather_call()
    _strategy._state.record(cell(call, RANDOM, {"sorted": 3.0}))
    assert json.loads(path.read_text())["format"] == _strategy.CACHE_FORMAT
    _strategy.reset(delete_file=True)
    assert not path.exists() and _strategy.measured_cells() == {}


def test_calibrate_needs_a_gpu():
    if pd.cuda_usable():
        pytest.skip("a GPU is usable here")
    with pytest.raises(pd.UnavailableError, match="CUDA"):
        pd.calibrate()


def test_measured_runs_pay_the_bounds_check_their_plan_pays_later():
    """Candidates are compared at what a later call of theirs costs: the device-checked plans with the sync bounds
    check (one reduction and a host round trip), the host-gathered ones without (they check as they read)."""
    from pytorch_direct import _kernels, _ops

    bad = torch.tensor([0, 5, 10])  # 10 is out of range for 10 rows
    for strategy in ("vector", "sorted", "dedupe", "split"):
        with pytest.raises(IndexError, match="index 10 is out of range"):
            _ops._steady_check(Plan(strategy), bad, 10, checked=True)
        _ops._steady_check(Plan(strategy), bad, 10, checked=False)  # async mode: no check at the call
    for strategy in _kernels.HOST_CHECKED_PLANS:
        _ops._steady_check(Plan(strategy), bad, 10, checked=True)
