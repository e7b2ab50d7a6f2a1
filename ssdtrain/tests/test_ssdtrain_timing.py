"""The timing side of calibration and the prefetch order, on CPU with made-up clocks and counters: the unit times are
checked (and rescaled) before any link feedback; that feedback judges the device's own wait for copies back, not
the host running ahead; a slow step without such waits charges its excess to the moved units, and the planner then
prefers recompute where moving inputs does not pay; kept units and tensors shared by several blocks drive the
prefetch so nothing is restored on demand; the leanest plan is found where the one-change search stalls."""

import logging
from dataclasses import replace

import pytest
import torch
from test_ssdtrain_budget import _Clock, _Memory
from test_ssdtrain_offload import batch, make_net
from torch import nn

import ssdtrain
from ssdtrain import prediction as prediction_module
from ssdtrain.planner import (
    AHEAD_UNITS,
    BUDGET_MARGIN,
    Bandwidth,
    Choice,
    UnitProfile,
    _lean_seed,
    _Model,
    _search,
    make_plan,
    make_tiers,
    simulate,
)
from ssdtrain.planning import Calibrator
from ssdtrain.prediction import MOVE_HOST_S, moved_tensors, split_choice

MIB = 1 << 20
GIB = 1 << 30


def _llama_like(n=16, forward_s=0.003, saved=800 * MIB, inputs=64 * MIB, casts=86 * MIB):
    """Units shaped like a Llama-style model's under autocast (per block: 800 MiB saved, a 64 MiB input, 86 MiB of
    weight casts; a 1.5 GiB head)."""
    units = [UnitProfile("<stem>", "stem", forward_s=1e-4, saved_bytes=MIB)]
    units += [
        UnitProfile(f"b.{i}", "block", forward_s=forward_s, saved_bytes=saved, input_bytes=inputs, pinned_bytes=casts)
        for i in range(n)
    ]
    units.append(UnitProfile("<head>", "head", forward_s=0.01, saved_bytes=1500 * MIB))
    return units


LINK = Bandwidth(d2h=51e9, h2d=51e9)
WORK = dict(forward_working=GIB, block_working=300 * MIB, working_bytes=2 * GIB)


def _plan(budget, units=None, **kw):
    return make_plan("m", units or _llama_like(), LINK, int(budget), host_limit=64 * GIB, nvme_limit=0,
                     block_container="b", **WORK, **kw)  # fmt: skip


def _count(plan, name):
    return sum(str(c) == name for c in plan.choices)


class _Counters:
    """What the session's callables report, cumulative: (late bytes, unpacked bytes, device wait s) and host waits."""

    def __init__(self):
        self.late = (0, 0, 0.0)
        self.waited = 0.0

    def add(self, late=0, unpacked=0, wait=0.0, host_wait=0.0):
        a, b, c = self.late
        self.late = (a + late, b + unpacked, c + wait)
        self.waited += host_wait


def _step(cal, counters, plan, forward, total, *, host_wait=0.0, late=0, unpacked=0, wait=0.0, step=4):
    """One checked step of `plan`: its peak as predicted; the forward takes `forward` s (of which it waited
    `host_wait` s for copies out), forward+backward `total` s; `late` of `unpacked` bytes came back late and the
    device waited `wait` s for them."""
    cal.memory.peaks = [plan.predict(False).peak]
    cal.clock = _Clock([0.0, forward, total])
    cal.start(plan, False, given=False)
    assert cal.checking
    counters.add(host_wait=host_wait)
    cal.forward_done()
    counters.add(late=late, unpacked=unpacked, wait=wait)
    cal.backward_done()
    return cal.finish(step=step)


def _calibrator(counters):
    return Calibrator(_Memory(), late=lambda: counters.late, waits=lambda: counters.waited)


def _timed(cal, counters, plan, forward, total, *, step=4, **kw):
    """`_step` run Calibrator.TIMED_STEPS times: the ones before the last only measure the forward (the plan's
    times stay unchecked); the last one's result is returned."""
    for i in range(Calibrator.TIMED_STEPS - 1):
        assert _step(cal, counters, plan, forward, total, step=step - Calibrator.TIMED_STEPS + 1 + i, **kw) is None
        assert not plan.times_checked
    return _step(cal, counters, plan, forward, total, step=step, **kw)


def test_the_drain_before_the_head_counts_as_a_wait_for_copies_out_not_as_compute():
    """The session's forward waits given to calibration include the drain of every copy out before the head (as
    well as the window's waits and pinning): a forward that waited there did not compute, and counting that wait as
    compute made a plan move more than the link carries."""
    model = make_net()
    with ssdtrain.offload(model, min_bytes="4K", verbose=False) as s:
        base = s._link_waits()
        s.cache.counters["head_drain_ns"] += 5_000_000
        assert s._link_waits() == pytest.approx(base + 0.005)
        s.cache.counters["throttle_ns"] += 2_000_000
        assert s._link_waits() == pytest.approx(base + 0.007)


def test_a_link_bound_forward_rescales_the_times_before_any_link_feedback(caplog):
    """The plan was made on profiled times 2.5x too slow, so it hid many copies behind compute. Its first step is
    as slow as profiled, because it waited for copies out most of the forward, and most moved bytes come
    back late. The compute time (forward less those waits) rescales the times first; that step's late copies are
    not judged (the plan they came from is gone); the rescaled plan is judged from its own second step, and each
    halving of the link's rates says which one it is and what rates are left, two at most."""
    caplog.set_level(logging.INFO, logger="ssdtrain")
    units = _llama_like(forward_s=0.0075)  # profiled 2.5x slower than the steps run
    plan = _plan(6 * GIB, units)
    moved = plan.prediction.host_bytes
    assert moved > 0 and not plan.times_checked
    profiled = sum(u.forward_s for u in units)
    counters = _Counters()
    cal = _calibrator(counters)
    # Measured forward = profiled, but it waited 60% of it for copies out: compute is 0.4x the profile.
    new = _timed(cal, counters, plan, profiled, 3 * profiled, host_wait=0.6 * profiled, late=moved * 106 // 126,
                 unpacked=moved, wait=0.2)  # fmt: skip
    assert new is not None and new.time_scale == pytest.approx(0.4) and new.times_checked
    assert new.link_scale == 1.0  # the late copies of the step under the old times halved nothing
    assert "less" in new.calibrations[-1] and "waited for copies out" in new.calibrations[-1]
    assert "unit times scaled by 0.40" in new.calibrations[-1]
    # Without the host's waits the same step looks like compute as slow as profiled: no rescale, the old plan's
    # times taken as right (the order that halved the link on a plan built from times 2.5x too slow).
    old = _calibrator(_Counters())
    old.waits = None
    same = _plan(6 * GIB, units)
    assert _timed(old, _Counters(), same, profiled, 3 * profiled) is None and same.times_checked
    # The rescaled plan: its first step is not steady (a pass), whatever came back late.
    seconds = new.prediction.seconds
    moved = new.prediction.host_bytes
    assert _step(cal, counters, new, profiled * 0.4, seconds, late=moved, unpacked=moved, wait=1.0, step=5) is None
    # Its second: the device waited for copies back far beyond the predicted stalls: halving 1 of 2.
    halved = _step(cal, counters, new, profiled * 0.4, seconds, late=moved, unpacked=moved, wait=0.1 * seconds,
                   step=6)  # fmt: skip
    assert halved is not None and halved.link_scale == 0.5 and halved.time_scale == pytest.approx(0.4)
    assert "the device waited" in halved.calibrations[-1] and "halving 1 of 2" in halved.calibrations[-1]
    assert "to 0.5x the measured rates" in halved.calibrations[-1]
    if halved.prediction.moved:
        s = halved.prediction.seconds
        m = sum(halved.prediction.moved.values())
        assert _step(cal, counters, halved, profiled * 0.4, s, step=7) is None
        twice = _step(cal, counters, halved, profiled * 0.4, s, late=m, unpacked=m, wait=0.2 * s, step=8)
        assert twice is not None and twice.link_scale == 0.25 and "halving 2 of 2" in twice.calibrations[-1]
        if twice.prediction.moved:
            s = twice.prediction.seconds
            m = sum(twice.prediction.moved.values())
            assert _step(cal, counters, twice, profiled * 0.4, s, step=9) is None
            assert _step(cal, counters, twice, profiled * 0.4, s, late=m, unpacked=m, wait=0.2 * s, step=10) is None
            assert "not halved again" in caplog.text and "2 halvings at most" in caplog.text


def test_a_step_well_below_its_prediction_rescales_the_times_when_the_forward_cannot():
    """The plan's copies slowed its forward on the device (not on the host): the forward looks as slow as profiled,
    but forward and backward together took half the predicted time, which only times too slow explain. The step's
    time rescales the unit times, and the rescaled plan moves no more than the one built on the slow times."""
    units = _llama_like(forward_s=0.006)  # profiled 2x slower than the steps run
    plan = _plan(10 * GIB, units)
    profiled = sum(u.forward_s for u in units)
    predicted = plan.prediction.seconds
    new = _timed(_calibrator(_Counters()), _Counters(), plan, profiled, 0.5 * predicted)
    assert new is not None and new.time_scale == pytest.approx(0.5) and new.times_checked
    assert "forward+backward" in new.calibrations[-1] and "unit times scaled by 0.50" in new.calibrations[-1]
    assert new.prediction.host_bytes <= plan.prediction.host_bytes
    # a step as long as predicted: the times stand
    again = _plan(10 * GIB, units)
    assert _timed(_calibrator(_Counters()), _Counters(), again, profiled, predicted) is None and again.times_checked


@pytest.mark.parametrize("slow_first", [True, False])
def test_the_forwards_compute_is_the_least_of_two_checked_steps(slow_first, caplog):
    """Each checked step's forward, less the host's waits, is compute plus however long the host kept the device
    idle besides (a checked step begins with the device idle): the first planned step of an H100 run read up to
    72 ms for a 46.5 ms forward. The least of two steps counts, whichever comes first; the first one only says it
    was measured. Steps of a plan made from another profile start again."""
    caplog.set_level(logging.INFO, logger="ssdtrain")
    units = _llama_like(forward_s=0.006)
    plan = _plan(10 * GIB, units)
    profiled = sum(u.forward_s for u in units)
    counters = _Counters()
    cal = _calibrator(counters)
    slow, fast = (0.9, 0.5) if slow_first else (0.5, 0.9)
    assert _step(cal, counters, plan, (slow + 0.3) * profiled, 3 * profiled, host_wait=0.3 * profiled, step=3) is None
    assert not plan.times_checked and "the next checked step is timed too" in caplog.text
    new = _step(cal, counters, plan, (fast + 0.3) * profiled, 3 * profiled, host_wait=0.3 * profiled, step=4)
    assert new is not None and new.time_scale == pytest.approx(0.5)
    line = new.calibrations[-1]
    assert f"at step {3 if slow_first else 2}" in line and "the least of 2 checked steps" in line
    assert "unit times scaled by 0.50" in line
    # How long the host took to issue it (here: no time, against the clock's made-up forward): the device's pace.
    assert "the host issued it in" in line and "so it set the pace" not in line
    # A new profile (other unit times): its first step only measures again.
    other = _plan(10 * GIB, _llama_like(forward_s=0.007))
    assert _step(cal, counters, other, 0.2, 3.0, step=9) is None and not other.times_checked
    # A session per step has a calibrator per step: the model's record of timed steps carries over (the session
    # passes its ModelState's), so the next session's checked step completes the count.
    nxt = Calibrator(_Memory(), late=lambda: counters.late, waits=lambda: counters.waited, timed=cal.timed)
    assert _step(nxt, counters, other, 0.2, 3.0, step=10) is not None or other.times_checked


def test_a_forward_that_waited_most_of_its_time_does_not_count_where_another_did_not(caplog):
    """Seen on an H100 (Llama-style 16 x 2048, a 46.5 ms forward): the first planned step's forward took 141.6 ms and
    waited 114.0 of them for copies out, while the host itself issued it late; the difference, 27.7 ms, was taken as
    the compute and every unit time scaled to 0.6x the real one. A forward that waited for more than half its time
    is left out where another timed step did not; where every one did, the least still counts."""
    caplog.set_level(logging.INFO, logger="ssdtrain")
    units = _llama_like(forward_s=0.006)
    profiled = sum(u.forward_s for u in units)
    plan = _plan(10 * GIB, units)
    counters = _Counters()
    cal = _calibrator(counters)
    # step 3: 0.8x the profile, of which 0.6x waited (0.2x "compute"); step 4: 0.5x, of which 0.05x waited
    assert _step(cal, counters, plan, 0.8 * profiled, 3 * profiled, host_wait=0.6 * profiled, step=3) is None
    new = _step(cal, counters, plan, 0.5 * profiled, 3 * profiled, host_wait=0.05 * profiled, step=4)
    assert new is not None and new.time_scale == pytest.approx(0.45)
    line = new.calibrations[-1]
    assert "at step 3" in line and "waited" in line.split("others")[1]  # the step left out, with its waits
    # Both waited most of their forward: the least of them (0.2x) counts, as before.
    again = _plan(10 * GIB, _llama_like(forward_s=0.0061))
    counters = _Counters()
    both = _calibrator(counters)
    assert _step(both, counters, again, 0.8 * profiled, 3 * profiled, host_wait=0.6 * profiled, step=3) is None
    last = _step(both, counters, again, 0.9 * profiled, 3 * profiled, host_wait=0.6 * profiled, step=4)
    scaled = 0.2 * profiled / sum(u.forward_s for u in again.units)
    assert last is not None and last.time_scale == pytest.approx(scaled)


def test_sessions_around_one_model_share_its_timed_forwards():
    model = make_net()
    with ssdtrain.offload(model, min_bytes="4K", verbose=False) as a:
        pass
    with ssdtrain.offload(model, min_bytes="4K", verbose=False) as b:
        pass
    assert a.calibrator.timed is b.calibrator.timed


def test_a_plan_whose_times_were_never_checked_is_not_judged_by_its_copies(caplog):
    """No usable forward timing (an event not recorded): the plan's times stay unchecked, and its late copies or
    slow steps do not halve the link's rates; the log says why."""
    caplog.set_level(logging.INFO, logger="ssdtrain")
    plan = _plan(6 * GIB)
    assert plan.prediction.moved
    counters = _Counters()
    cal = _calibrator(counters)

    class _Broken(_Clock):
        def seconds(self, a, b):
            if b == self.forward_end:
                raise RuntimeError("event not recorded")
            return b - a

    moved = plan.prediction.host_bytes
    for step in (4, 5):
        cal.memory.peaks = [plan.predict(False).peak]
        clock = _Broken([0.0, 1.0, 100.0])
        clock.forward_end = 1.0
        cal.clock = clock
        cal.start(plan, False, given=False)
        cal.forward_done()
        counters.add(late=moved, unpacked=moved, wait=5.0)
        cal.backward_done()
        assert cal.finish(step=step) is None
    assert not plan.times_checked and plan.link_scale == 1.0
    assert "not yet checked against a measured forward" in caplog.text


def test_late_on_the_host_is_no_stall_the_device_wait_decides():
    """The host runs ahead of the device, so copies back are often unfinished when the host unpacks them; the
    device's own wait (CUDA events) decides: none, nothing halved; beyond the predicted stalls, halved."""
    units = _llama_like()
    plan = _plan(6 * GIB, units)
    plan.times_checked = True
    counters = _Counters()
    cal = _calibrator(counters)
    s = plan.prediction.seconds
    moved = plan.prediction.host_bytes
    forward = sum(u.forward_s for u in units)
    assert _step(cal, counters, plan, forward, s, late=moved, unpacked=moved) is None  # first step: a pass
    assert _step(cal, counters, plan, forward, s, late=moved * 9 // 10, unpacked=moved, wait=0.0, step=5) is None
    assert plan._verified and plan.link_scale == 1.0
    plan._verified, plan._passes = False, 1
    wait = plan.prediction.stall_s + 0.05 * s
    behind = _step(cal, counters, plan, forward, s, late=moved // 20, unpacked=moved, wait=wait, step=6)
    assert behind is not None and behind.link_scale == 0.5


def test_moves_that_cost_more_than_their_copies_give_way_to_recompute():
    """The link hides a block input's copy, so recompute+host costs only the host's work for the move, and the
    planner moves inputs to keep more blocks whole. Charged what it was measured to cost per moved unit (3 ms, as
    much as the block's forward), the planner recomputes those blocks instead and moves no input where the budget
    allows; where only moves fit (below full recompute's peak), it moves as few as it can. The charge is in the
    prediction."""
    for budget in (6 * GIB, 7 * GIB, 9 * GIB):
        free, costly = _plan(budget), _plan(budget, move_overhead_s=0.003)
        assert _count(free, "recompute+host") >= 2
        assert _count(costly, "recompute+host") == 0 and _count(costly, "host") == 0
        assert costly.prediction.peak <= budget and free.prediction.peak <= budget
        moved = sum(1 for c in free.choices if c.tier == "host")
        again = costly._model()(free.choices)
        assert again.seconds == pytest.approx(free.prediction.seconds + moved * 0.003, rel=1e-6)
        assert costly.prediction.seconds < again.seconds
    assert "ms per moved unit (measured)" in str(_plan(6 * GIB, move_overhead_s=0.003))
    tight = _plan(4.5 * GIB, move_overhead_s=0.003)
    assert 0 < _count(tight, "recompute+host") < _count(_plan(4.5 * GIB), "recompute+host")


def test_a_block_input_moves_only_where_recompute_alone_does_not_fit(monkeypatch):
    """Each moved tensor costs the host's work (MOVE_HOST_S), so a plan never moves a block's input where keeping
    it (plain recompute) still fits the budget: recompute+host is the plan's last resort, not a tie. Without that
    charge the planner moved inputs it had room to keep (13 of 16 blocks at 6 GiB, where 5 need it)."""
    for budget in (4.5 * GIB, 6 * GIB, 7 * GIB, 9 * GIB):
        plan = _plan(budget)
        target = budget * (1 - BUDGET_MARGIN)
        model = plan._model()
        for i, c in enumerate(plan.choices):
            if str(c) == "recompute+host":
                kept = plan.choices[:i] + [Choice("full", "keep")] + plan.choices[i + 1 :]
                assert model(kept).peak > target, f"{plan.units[i].name} could keep its input at {budget / GIB} GiB"
        moves = sum(moved_tensors(u, c) for u, c in zip(plan.units, plan.choices, strict=True))
        assert moves >= _count(plan, "recompute+host") > 0
        charged = plan.prediction.seconds
        with monkeypatch.context() as m:
            m.setattr(prediction_module, "MOVE_HOST_S", 0.0)
            assert charged == pytest.approx(plan.prediction.seconds + moves * MOVE_HOST_S, rel=1e-9)
    assert _count(_plan(6 * GIB), "recompute+host") < 13


def test_copies_out_run_further_ahead_where_the_peak_has_room():
    """The cache bounds the copies out in flight in forward (the host waits beyond): the window by default, more
    (up to AHEAD_UNITS x the largest moved unit) where the step peaks elsewhere, so a pause of the host's does not
    leave the device idle. The peak stays where it was; where the forward holds the peak, only the window."""
    for budget in (6 * GIB, 7 * GIB, 9 * GIB):
        plan = _plan(budget)
        moved = max(split_choice(u, c)[1] for u, c in zip(plan.units, plan.choices, strict=True))
        assert plan.prediction.peak_at.startswith("backward of ")
        assert plan.window_bytes < plan.inflight_bytes <= AHEAD_UNITS * moved
        assert plan.inflight_bytes % moved == 0
        assert plan.prediction.peak == replace(plan, inflight_bytes=0).prediction.peak
        more = replace(plan, inflight_bytes=plan.inflight_bytes + moved).prediction
        assert more.peak > plan.prediction.peak or plan.inflight_bytes == AHEAD_UNITS * moved
    # A forward whose working memory is the step's largest: no room, the window alone.
    work = {**WORK, "forward_working": 3 * GIB, "working_bytes": GIB}
    tight = make_plan("m", _llama_like(), LINK, 9 * GIB, host_limit=64 * GIB, nvme_limit=0, block_container="b", **work)
    assert tight.prediction.peak_at.startswith("forward of ") and tight.inflight_bytes == 0
    assert _plan(40 * GIB).inflight_bytes == 0  # nothing moved


def test_a_slow_step_without_device_waits_charges_its_excess_to_the_moved_units_once():
    """From the second checked step of a plan with checked times: above 1.05x its prediction while the device did
    not wait for copies back, the excess is charged per moved unit (not the link's rates), once per lineage."""
    plan = _plan(6 * GIB)
    plan.times_checked = True
    counters = _Counters()
    cal = _calibrator(counters)
    s = plan.prediction.seconds
    forward = sum(u.forward_s for u in plan.units)
    moved_units = sum(c.tier == "host" for c in plan.choices)
    assert _step(cal, counters, plan, forward, 1.1 * s) is None  # first step: a pass
    new = _step(cal, counters, plan, forward, 1.1 * s, step=5)
    assert new is not None and new.move_overhead_s == pytest.approx(0.1 * s / moved_units)
    assert new.link_scale == 1.0 and f"charged to the {moved_units} moved units" in new.calibrations[-1]
    if new.prediction.moved:
        s2 = new.prediction.seconds
        assert _step(cal, counters, new, forward, 1.1 * s2, step=6) is None
        assert _step(cal, counters, new, forward, 1.1 * s2, step=7) is None  # once per lineage
        assert new.move_overhead_s == pytest.approx(0.1 * s / moved_units)


def test_the_leanest_plan_is_found_where_the_one_change_search_stalls():
    """While one block moves all it saves, the window the cache holds is that block's size, so no single change
    of another block lowers the peak: the leanest-first search stalls. The leanest choice of every unit is
    tried too, for plans and for the minimum a BudgetError names."""
    units = _llama_like(casts=0)
    units[-1].saved_bytes = 200 * MIB
    bw = Bandwidth(d2h=50e9, h2d=50e9)
    model = _Model(units, bw, 2, 0, make_tiers(64 * GIB, 0), False, GIB, 300 * MIB)
    start = [Choice()] * len(units)
    _, stalled, _ = _search(model, start, 0, set(), by_peak=True)
    seed, lean = _lean_seed(model, start, set())
    assert lean.peak < stalled.peak - 512 * MIB
    assert all(str(c) == "recompute+host" for c in seed[1:-1])
    budget = int((lean.peak + stalled.peak) / 2)
    plan = make_plan("m", units, bw, budget, host_limit=64 * GIB, nvme_limit=0, block_container="b",
                     working_bytes=0, forward_working=GIB, block_working=300 * MIB)  # fmt: skip
    assert plan.prediction.peak <= budget
    with pytest.raises(ssdtrain.BudgetError) as err:
        make_plan("m", units, bw, int(lean.peak * 0.9), host_limit=64 * GIB, nvme_limit=0, block_container="b",
                  working_bytes=0, forward_working=GIB, block_working=300 * MIB)  # fmt: skip
    assert err.value.minimum == pytest.approx(lean.peak / (1 - BUDGET_MARGIN), rel=1e-6)


# ------------------------------------------------------------------ the prefetch order (hooks, CPU)
def _record_order(cache):
    """Log ("restore", unit) when a unit's prefetch is issued and ("use", unit) at each first unpack of a moved
    entry, in the order they happen."""
    order = []
    prefetch, device_bytes = cache._prefetch_unit, cache._device_bytes

    def _prefetch_unit(unit):
        order.append(("restore", unit))
        return prefetch(unit)

    def _device_bytes(entry):
        if not entry.unpacked:
            order.append(("use", entry.unit))
        return device_bytes(entry)

    cache._prefetch_unit, cache._device_bytes = _prefetch_unit, _device_bytes
    return order


def test_kept_blocks_move_the_prefetch_window_to_a_moved_block_under_them():
    """The last block and the first are moved, the six between are kept whole (the plan's fast path for kept units,
    which decides nothing per tensor). Backward through the kept blocks still moves the window: the first block is
    restored when backward is one unit above it, not when it reaches it (on a GPU the device would wait for the
    whole copy there)."""
    model, ids = make_net(layers=8), batch()
    overrides = {f"blocks.{i}": "host" if i in (0, 7) else "keep" for i in range(8)}
    with ssdtrain.offload(model, min_bytes="4K", verbose=False, profile_steps=1, prefetch_units=1,
                          overrides=overrides) as s:  # fmt: skip
        model(ids).backward()  # profiled
        model.zero_grad()
        model(ids).backward()
        assert s.cache.keeps_unit is not None and s.cache.keeps_unit(4)
        order = _record_order(s.cache)
        model.zero_grad()
        model(ids).backward()
    assert s.stats()["misses"] == 0
    restores = [u for kind, u in order if kind == "restore"]
    assert 1 in restores and order.index(("restore", 1)) < order.index(("use", 1))
    assert order.index(("restore", 1)) > order.index(("use", 8))  # the window moved down with backward


def test_a_moved_block_under_kept_ones_is_restored_when_backward_comes_near_it():
    """Only the first block moves. Backward begins in the head, where the step peaks (the logits' gradients), and
    the plan counts no prefetched bytes there: the window starts at the head and moves down with backward, so the
    first block is restored one unit above it, not as backward begins (which held its bytes through the head's
    backward: 384 MiB over the predicted peak on an H100)."""
    model, ids = make_net(layers=8), batch()
    overrides = {f"blocks.{i}": "host" if i == 0 else "keep" for i in range(8)}
    with ssdtrain.offload(model, min_bytes="4K", verbose=False, profile_steps=1, prefetch_units=1,
                          overrides=overrides) as s:  # fmt: skip
        model(ids).backward()  # profiled
        model.zero_grad()
        model(ids).backward()
        order = _record_order(s.cache)
        model.zero_grad()
        model(ids).backward()
    assert s.stats()["misses"] == 0
    restores = [u for kind, u in order if kind == "restore"]
    head = len(s.unit_names) - 1
    assert restores[0] == head and restores == sorted(restores, reverse=True), restores
    assert 1 in restores and order.index(("restore", 1)) < order.index(("use", 1))


class _Table(nn.Module):
    """Blocks that all take one tensor computed once per forward (as rotary cos/sin tables are) and save it."""

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.fc = nn.Linear(d, d)

        def forward(self, x, table):
            return torch.tanh(self.fc(x * table)) + x

    def __init__(self, layers=6, d=64):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList([self.Block(d) for _ in range(layers)])
        self.out = nn.Linear(d, 1)
        self.d = d

    def forward(self, x):
        table = torch.cos(torch.arange(x.shape[-2] * self.d, dtype=x.dtype).view(x.shape[-2], self.d) / 7.0)
        h = self.inp(x)
        for b in self.blocks:
            h = b(h, table)
        return self.out(h).sum()


def test_a_tensor_saved_by_every_block_is_prefetched_with_the_last_one():
    """One stored tensor saved by every block: its entry is the first block's, but backward needs it first at the
    last block. That block's prefetch brings it back (no miss), and its unpacks there do not pull the first
    block's bytes onto the device early (they would stay through the rest of backward)."""
    torch.manual_seed(0)
    model = _Table()
    x = torch.randn(4, 32, 64)
    overrides = {f"blocks.{i}": "host" for i in range(6)}
    with ssdtrain.offload(model, min_bytes="1K", verbose=False, profile_steps=1, overrides=overrides) as s:
        model(x).backward()  # profiled
        model.zero_grad()
        model(x).backward()
        order = _record_order(s.cache)
        model.zero_grad()
        loss = model(x)
        loss.backward()
    stats = s.stats()
    assert stats["misses"] == 0 and stats["views_deduplicated"] >= 5
    restores = [u for kind, u in order if kind == "restore"]
    first_block = 1
    assert restores.index(first_block) > restores.index(5)  # not pulled early by the shared tensor
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model(x).backward()  # without ssdtrain: the same gradients
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n])


def test_the_plan_says_where_its_peak_is_and_what_it_is_made_of():
    """The leanest plans are compared with peers by their peak: the plan names the point of its predicted peak and
    its parts (kept, weight casts, in flight, working, ...), which add up to the peak before any correction."""
    for budget in (4.5 * GIB, 9 * GIB, 16 * GIB):
        p = _plan(budget).prediction
        assert p.peak_at.startswith(("forward of ", "backward of "))
        assert sum(p.peak_parts.values()) == p.peak and all(v > 0 for v in p.peak_parts.values())
    lean = _plan(4.4 * GIB)
    # Recomputed blocks' weight casts are cleared from autocast's cache when each returns: none at the head.
    assert lean.prediction.peak_at == "forward of <head>" and "weight casts" not in lean.prediction.peak_parts
    held = replace(lean, clear_casts=False).prediction  # cached until autocast's region ends
    assert held.peak_parts["weight casts"] == sum(
        u.pinned_bytes for u, c in zip(lean.units, lean.choices, strict=True) if c.recompute == "full"
    ) > 0
    assert held.peak > lean.prediction.peak
    assert f"the peak is at the {lean.prediction.peak_at}: " in str(lean)
    corrected = _plan(4.5 * GIB, correction=100 * MIB)
    assert corrected.prediction.peak == sum(corrected.prediction.peak_parts.values()) + 100 * MIB


def test_a_budget_below_every_prefetching_plan_gets_a_head_backward_without_prefetch():
    """Where the step peaks in the head's backward (the logits' gradients), the blocks prefetched during it are
    part of the peak. Below every plan that prefetches there, the planner lets the head's backward run with no
    block prefetched (the first block's copy back then waits for it: a stall, predicted), and names the lower
    minimum in BudgetError; above, it prefetches as usual."""
    units = _llama_like(casts=0)
    work = dict(working_bytes=4 * GIB, forward_working=GIB, block_working=300 * MIB)
    lean = [Choice()] + [Choice("full", "host")] * 16 + [Choice()]
    tiers = make_tiers(64 * GIB, 0)
    usual = simulate(units, lean, LINK, 2, tiers=tiers, **work)
    held = simulate(units, lean, LINK, 2, tiers=tiers, hold_head=True, **work)
    assert usual.peak_at == held.peak_at == "backward of <head>"
    assert usual.peak - held.peak == usual.peak_parts["prefetched ahead"] == 2 * 64 * MIB
    assert held.stall_s == pytest.approx(64 * MIB / LINK.h2d)  # the last block's input, on demand
    with pytest.raises(ssdtrain.BudgetError) as err:
        make_plan("m", units, LINK, GIB, host_limit=64 * GIB, nvme_limit=0, block_container="b", **work)
    assert err.value.minimum * (1 - BUDGET_MARGIN) < usual.peak
    tight = make_plan("m", units, LINK, int((usual.peak - 16 * MIB) / (1 - BUDGET_MARGIN)), host_limit=64 * GIB,
                      nvme_limit=0, block_container="b", **work)  # fmt: skip
    assert tight.hold_head and tight.prediction.peak <= tight.budget * (1 - BUDGET_MARGIN)
    assert "no block prefetched (the budget needs it)" in str(tight)
    roomy = make_plan("m", units, LINK, int((usual.peak + 64 * MIB) / (1 - BUDGET_MARGIN)), host_limit=64 * GIB,
                      nvme_limit=0, block_container="b", **work)  # fmt: skip
    assert not roomy.hold_head


def test_with_the_head_held_no_block_is_restored_before_backward_leaves_the_head():
    """The cache under such a plan: the head's backward restores nothing below it; the last block's bytes come back
    on demand when backward reaches it (one miss), and the blocks below it are prefetched from there."""
    model, ids = make_net(layers=6), batch()
    overrides = {f"blocks.{i}": "host" for i in range(6)}
    with ssdtrain.offload(model, min_bytes="4K", verbose=False, profile_steps=1, overrides=overrides) as s:
        model(ids).backward()  # profiled
        model.zero_grad()
        model(ids).backward()
        head = len(s.unit_names) - 1
        s.plan.hold_head = True
        s._apply(s.plan)
        assert s.cache.hold_head == head
        before = s.stats()["misses"]
        order = _record_order(s.cache)
        model.zero_grad()
        model(ids).backward()
    assert s.stats()["misses"] - before == 1
    last_block = head - 1
    first_use = order.index(("use", last_block))
    assert all(u >= head for kind, u in order[:first_use])  # nothing below the head restored while it ran
    assert ("restore", last_block - 1) in order
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model(ids).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n])


def test_copies_out_drained_before_the_head_leave_no_bytes_in_flight_at_its_forward():
    """The host runs ahead of the device, so at the head's forward (the logits: the forward's largest temporaries)
    the allocator still counts the last moved blocks' bytes, copied out long before on the device. With
    ``drain_at_head`` (the session's wait for every copy out as the last block returns) none is in flight there:
    the forward's peak drops by what was in flight, and the head starts no earlier than the last copy's end (no
    later where the copies finished behind the blocks' compute)."""
    units = _llama_like(casts=0)
    units[-1].saved_bytes = 3 * GIB  # the head's own bytes: its forward is the peak with or without copies in flight
    work = dict(forward_working=3 * GIB, block_working=300 * MIB, working_bytes=GIB)
    tiers = make_tiers(64 * GIB, 0)
    spread = [Choice()] + [Choice("none", "host") if i % 4 == 0 else Choice() for i in range(16)] + [Choice()]
    usual = simulate(units, spread, LINK, 2, tiers=tiers, **work)
    drained = simulate(units, spread, LINK, 2, tiers=tiers, drain_at_head=True, **work)
    assert usual.peak_at == drained.peak_at == "forward of <head>"
    assert usual.peak_parts["in flight"] == 2 * 800 * MIB  # the window: the last two moved blocks
    assert "in flight" not in drained.peak_parts
    assert usual.peak - drained.peak == 2 * 800 * MIB
    # Block 12's 800 MiB (16 ms on the link) end 4 ms after the last block (3 blocks of 3 ms + the host's moves
    # after it): the head starts that much later, and so does the whole step.
    last_copy_end = drained.seconds - usual.seconds
    assert 0 < last_copy_end < 800 * MIB / LINK.d2h
    # Copies that end behind the compute cost the drain nothing, and the allocator (which the host, running
    # ahead, would otherwise leave holding them) no longer counts them at the head.
    early = [Choice()] + [Choice("none", "host") if i in (0, 4) else Choice() for i in range(16)] + [Choice()]
    early_usual = simulate(units, early, LINK, 2, tiers=tiers, **work)
    early_drained = simulate(units, early, LINK, 2, tiers=tiers, drain_at_head=True, **work)
    assert early_drained.seconds == pytest.approx(early_usual.seconds)
    assert early_usual.peak_parts["in flight"] == 2 * 800 * MIB and "in flight" not in early_drained.peak_parts
    assert early_usual.peak - early_drained.peak == 2 * 800 * MIB
    # On the CPU copies are synchronous (nothing in flight): no change.
    cpu = dict(tiers=tiers, async_copies=False, **work)
    assert simulate(units, spread, LINK, 2, drain_at_head=True, **cpu) == simulate(units, spread, LINK, 2, **cpu)


def test_plans_carry_drain_at_head_through_replanning():
    """A plan made with ``drain_at_head`` predicts with it, and so does every plan calibration makes from it."""
    plan = _plan(6 * GIB, drain_at_head=True)
    assert plan.drain_at_head and plan._model().drain_at_head
    again = ssdtrain.planner.replan(plan, correction=10 * MIB)
    assert again.drain_at_head
    assert not _plan(6 * GIB).drain_at_head


def test_a_moves_host_work_costs_the_device_time_only_where_the_host_sets_the_pace():
    """Two clocks in the forward once the host's own time is known (`host_forward_s`): a moved block's host work
    (``MOVE_HOST_S`` per moved tensor) delays the device only where the host, with that work, falls behind it.
    Without the host's time that work is counted as the device's, as before."""
    units = _llama_like(n=4)
    for u in units[1:-1]:
        u.tensors = 30
    units[3].saved_bytes = 100 * MIB  # (its copy out ends long before backward: no wait for the link here)
    choices = [Choice(), Choice(), Choice(), Choice(tier="host"), Choice(), Choice()]
    device = sum(u.forward_s for u in units)
    host_work = MOVE_HOST_S * moved_tensors(units[3], choices[3])
    assert host_work == pytest.approx(0.003)

    def seconds(**kw):
        return simulate(units, choices, LINK, **WORK, **kw).seconds

    counted = seconds()
    # The host far ahead (a fifth of the device's time): the move's host work hides behind compute.
    assert seconds(host_forward_s=0.2 * device) == pytest.approx(counted - host_work)
    # The host as slow as the device: all of it is on the device's path, as without the host's time.
    assert seconds(host_forward_s=device) == pytest.approx(counted)
    # The host twice as slow: the forward takes the host's time and the move's work on top.
    kept = simulate(units, [Choice()] * len(units), LINK, **WORK)
    slower = seconds(host_forward_s=2 * device)
    assert slower - (counted - host_work) == pytest.approx(device + host_work, rel=1e-6)
    assert kept.seconds < counted


def test_the_timed_forwards_host_time_less_its_moves_goes_into_the_plan(monkeypatch, caplog):
    """Calibration reads the host's own time to issue the timed forward. Less the moves' host work the plan
    predicts, it is the host's time for a forward without moves (``plan.host_forward_s``): the rescaled plan is made
    with it, says so, and its prediction runs the forward on two clocks. A plan whose copies are synchronous (CPU)
    gets none."""
    caplog.set_level(logging.INFO, logger="ssdtrain")
    units = _llama_like(forward_s=0.0075)
    for u in units[1:-1]:
        u.tensors = 30
    plan = _plan(6 * GIB, units)
    moves = sum(moved_tensors(u, c) for u, c in zip(plan.units, plan.choices, strict=True) if split_choice(u, c)[1])
    assert moves > 0
    profiled = sum(u.forward_s for u in units)
    host = 0.3 * profiled + MOVE_HOST_S * moves  # the host's clock from the step's start to its forward's end
    ticks = iter([0.0, host] * Calibrator.TIMED_STEPS)
    monkeypatch.setattr("ssdtrain.planning.time.perf_counter", lambda: next(ticks))
    new = _timed(_calibrator(_Counters()), _Counters(), plan, 0.4 * profiled, 1.2 * profiled)
    assert new is not None and new.time_scale == pytest.approx(0.4)
    assert new.host_forward_s == pytest.approx(0.3 * profiled)
    assert "the host issues a forward without moves in" in new.calibrations[-1]
    assert "the host issues a forward without moves in" in str(new)
    two_clocks = new._model()(new.choices).seconds
    assert two_clocks <= replace(new, host_forward_s=0.0).prediction.seconds
    # Synchronous copies: the host is the device.
    cpu = _plan(6 * GIB, units, async_copies=False)
    ticks = iter([0.0, host] * Calibrator.TIMED_STEPS)
    new = _timed(_calibrator(_Counters()), _Counters(), cpu, 0.4 * profiled, 1.2 * profiled)
    assert new is not None and new.host_forward_s == 0.0
