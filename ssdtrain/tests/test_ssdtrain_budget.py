"""The budget as a promise, on CPU with device memory numbers made up: what the planner's peak is made of (copies
out in flight, the prefetch window, working memory of the forward, the head's backward and a block's backward,
gradients, the calibration correction), what the profiled step's peaks turn into, when ``BudgetError`` is raised
(at the first plan or the first calibration only) and what calibration does later or with ``budget=None``, and
the profiling that keeps ``budget=None`` safe at large batches (a warm-up that keeps nothing it can move)."""

import copy
import gc
import warnings
import weakref

import pytest
import torch
from ssdtrain_testutil import measured_cpu_memory
from test_ssdtrain_derive import _BranchModel
from test_ssdtrain_offload import batch, make_net

import ssdtrain
from ssdtrain.planner import (
    BUDGET_MARGIN,
    Bandwidth,
    Choice,
    UnitProfile,
    format_bytes,
    make_plan,
    replan,
    simulate,
    window_bytes,
)
from ssdtrain.planning import Calibrator, state_of
from ssdtrain.profiler import DeviceMemory, PeakProbe, working_memory

MIB = 1 << 20
GIB = 1 << 30
FAST = Bandwidth(d2h=50e9, h2d=50e9)


def _units(n=8, saved=400 * MIB, head_saved=1600 * MIB, inputs=32 * MIB, grad=40 * MIB, head_grad=200 * MIB):
    units = [UnitProfile("<stem>", "stem", forward_s=1e-4, saved_bytes=MIB)]
    units += [
        UnitProfile(f"b.{i}", "block", forward_s=0.01, saved_bytes=saved, input_bytes=inputs, grad_bytes=grad)
        for i in range(n)
    ]
    units.append(UnitProfile("<head>", "head", forward_s=0.005, saved_bytes=head_saved, grad_bytes=head_grad))
    return units


def test_copies_out_in_flight_count_up_to_the_window_in_forward():
    """The host runs ahead of the device: the allocator frees a moved tensor only when the cache has seen its copy
    out done, so forward holds up to the window of moved bytes (the cache makes compute wait beyond it)."""
    units = _units()
    host = [Choice()] + [Choice("none", "host")] * 8 + [Choice()]
    window = window_bytes(units, host, 2)
    assert window == 2 * 400 * MIB
    fwd_work = 3 * GIB
    sync = simulate(units, host, FAST, forward_working=fwd_work, working_bytes=0, block_working=0, async_copies=False)
    asyn = simulate(units, host, FAST, forward_working=fwd_work, working_bytes=0, block_working=0)
    resident = MIB + 1600 * MIB  # the stem and the head keep theirs
    assert asyn.peak == resident + window + fwd_work  # at the head's forward: a full window still in flight
    assert sync.peak < asyn.peak
    # A slow link: compute waits for the window.
    slow = simulate(units, host, Bandwidth(d2h=5e9, h2d=5e9))
    assert slow.seconds > simulate(units, host, FAST).seconds + 0.3


def test_prefetch_holds_at_most_the_window_of_the_next_units():
    """During a block's backward: its own moved bytes plus the units below it prefetched within the window, whole
    units, at most `window_units` of them."""
    units = _units(head_saved=MIB)
    host = [Choice()] + [Choice("none", "host")] * 8 + [Choice()]
    for window_units in (1, 2, 3):
        p = simulate(units, host, FAST, window_units, async_copies=False)
        # At the last block's backward: itself + min(window_units, window / unit) units ahead, gradients aside.
        ahead = min(window_units, window_bytes(units, host, window_units) // (400 * MIB))
        assert p.peak == MIB + (1 + ahead) * 400 * MIB  # the stem's kept bytes; the head's are gone


def test_working_memory_applies_where_it_is_alive():
    """The head's backward working memory (logits' gradients) is added at the head only; a block's backward has
    its own, smaller one, with the recompute's re-created activations: the leanest plan's peak is the larger of
    the two, not their sum."""
    units = _units(head_saved=MIB)
    full = [Choice()] + [Choice("full", "keep")] * 8 + [Choice()]
    head_work, block_work = 5 * GIB, 300 * MIB
    p = simulate(units, full, FAST, 2, head_work, None, False, forward_working=2 * GIB, block_working=block_work)
    inputs = 8 * 32 * MIB
    head_point = MIB + inputs + MIB + head_work
    block_point = MIB + inputs + 400 * MIB + block_work  # the last block: its inputs still counted
    forward_point = MIB + inputs + MIB + 2 * GIB
    assert p.peak == max(head_point, block_point, forward_point) == head_point
    # One working number everywhere (what the planner did before) would add the head's to the recompute too.
    lumped = simulate(units, full, FAST, 2, head_work, None, False)
    assert lumped.peak == MIB + inputs + 400 * MIB + head_work > p.peak


def test_gradients_are_counted_from_the_head_down_and_the_correction_everywhere():
    units = _units()
    keep = [Choice()] * len(units)
    without = simulate(units, keep, FAST, 2, 0, None, False)
    grads = simulate(units, keep, FAST, 2, 0, None, True)
    assert grads.peak - without.peak == 200 * MIB  # at the head's backward: the head's gradients only
    corrected = simulate(units, keep, FAST, 2, 0, None, True, correction=123 * MIB)
    assert corrected.peak == grads.peak + 123 * MIB


class _Memory:
    """Device memory readings made up by the test: `peaks` are returned by max_allocated() in turn."""

    def __init__(self, peaks=(), free=80 * GIB, allocated=0):
        self.peaks = list(peaks)
        self._free = free
        self._allocated = allocated
        self.resets = 0

    def can_measure(self):
        return True

    def allocated(self):
        return self._allocated

    def max_allocated(self):
        return self.peaks.pop(0) if self.peaks else self._allocated

    def reset_peak(self):
        self.resets += 1

    def free(self):
        return self._free


def test_profiled_peaks_become_forward_head_and_block_working_memory():
    """The measured step's three peaks (forward; the head's backward, up to the gradient of the last block's
    output; the rest of backward) minus what was saved then and the gradients allocated by then."""
    probe = PeakProbe(_Memory(peaks=[9 * GIB, 11 * GIB, 7 * GIB], allocated=GIB))
    probe.start()
    probe.forward_done()
    probe.head_done()
    probe.finish()
    assert (probe.forward, probe.head, probe.blocks) == (8 * GIB, 10 * GIB, 6 * GIB)
    saved, head_saved = 5 * GIB, 2 * GIB
    grads = (GIB // 4, GIB // 8, GIB)
    fwd, head, blocks = working_memory(probe, saved, head_saved, grads, recomputed=0)
    assert fwd == 3 * GIB
    assert head == 5 * GIB - GIB // 4
    assert blocks == 6 * GIB - 3 * GIB - GIB // 4 - GIB // 8
    # A block checkpointed while profiling re-creates its activations in backward: not working memory.
    assert working_memory(probe, saved, head_saved, grads, recomputed=GIB)[2] == blocks - GIB
    # No mark between the head's and the blocks' backward (a compiled model): one backward peak for both.
    one = PeakProbe(_Memory(peaks=[9 * GIB, 11 * GIB], allocated=GIB))
    one.start()
    one.forward_done()
    one.finish()
    f, h, b = working_memory(one, saved, head_saved, grads, recomputed=0)
    assert h == b == 5 * GIB - GIB // 4


def _plan(budget, **kw):
    return make_plan("m", _units(), FAST, budget, host_limit=64 * GIB, nvme_limit=0, block_container="b", **kw)


def test_budget_error_at_the_first_plan_names_a_minimum_the_leanest_plan_reaches():
    units = _units()
    with pytest.raises(ssdtrain.BudgetError) as info:
        _plan(GIB, working_bytes=4 * GIB, block_working=200 * MIB, forward_working=2 * GIB)
    minimum = info.value.minimum
    plan = _plan(minimum, working_bytes=4 * GIB, block_working=200 * MIB, forward_working=2 * GIB)
    assert plan.prediction.peak <= minimum
    full = [Choice()] + [Choice("full", "keep")] * 8 + [Choice()]
    recompute = simulate(units, full, FAST, 2, 4 * GIB, None, False, forward_working=2 * GIB, block_working=200 * MIB)
    assert plan.prediction.peak <= recompute.peak  # the leanest plan is at or below full recompute's


def test_calibration_raises_only_at_the_first_check_then_uses_the_leanest_plan_with_a_warning():
    plan = _plan(int(6.5 * GIB), working_bytes=3 * GIB, block_working=200 * MIB, forward_working=2 * GIB)
    predicted = plan.predict(False).peak
    # First check: measured 3 GiB above the prediction, no plan fits: refused now, with the minimum.
    memory = _Memory(peaks=[predicted + 3 * GIB])
    cal = Calibrator(memory)
    cal.start(plan, False, given=False)
    with pytest.raises(ssdtrain.BudgetError, match="first step under the plan") as info:
        cal.finish(step=4)
    assert info.value.minimum > plan.budget
    # A plan calibrated once already: training has started, so the leanest plan and a warning instead.
    plan.calibrations.append("step 3: earlier")
    memory.peaks = [predicted + 3 * GIB]
    cal.start(plan, False, given=False)
    with pytest.warns(ssdtrain.OffloadWarning, match="leanest plan"):
        new = cal.finish(step=5)
    assert new is not None and new.budget == plan.budget and not new.fits
    assert new.correction == 3 * GIB and len(new.calibrations) == 2
    lean = make_plan(
        "m", _units(), FAST, None, host_limit=64 * GIB, nvme_limit=0, block_container="b", speed_target=0,
        working_bytes=3 * GIB, block_working=200 * MIB, forward_working=2 * GIB, correction=3 * GIB,
    )  # fmt: skip
    assert new.prediction.peak == lean.prediction.peak


def test_calibration_with_a_leaner_plan_in_reach_replans_quietly():
    plan = _plan(int(7.5 * GIB), working_bytes=3 * GIB, block_working=200 * MIB, forward_working=2 * GIB)
    predicted = plan.predict(False).peak
    cal = Calibrator(_Memory(peaks=[predicted + 300 * MIB]))
    cal.start(plan, False, given=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = cal.finish(step=4)
    assert new.correction == 300 * MIB and new.prediction.peak <= plan.budget and new.fits


def test_calibration_with_no_budget_falls_back_to_the_leanest_plan_loudly():
    plan = make_plan(
        "m", _units(), FAST, None, host_limit=64 * GIB, nvme_limit=0, block_container="b", speed_target=8 * GIB,
        working_bytes=3 * GIB, block_working=200 * MIB, forward_working=2 * GIB,
    )  # fmt: skip
    assert plan.fits
    cal = Calibrator(_Memory(peaks=[plan.predict(False).peak + 6 * GIB]))
    cal.start(plan, False, given=False)
    with pytest.warns(ssdtrain.OffloadWarning, match="may run out of memory"):
        new = cal.finish(step=4)
    assert not new.fits and new.budget is None


def test_budget_none_profiling_is_safe_with_little_free_memory(monkeypatch):
    """With made-up device memory: the warm-up keeps nothing it can move (allowance 0: blocks after the first
    checkpointed, saved tensors to host memory), so its peak is at most full recompute's; the measured step keeps
    what leaves the warm-up's excess (the head's working memory) free; a budget=None plan that cannot fit the free
    memory says so with a warning."""
    free = {"bytes": 1 << 40}
    peaks = []
    allocated = {"now": 0}
    monkeypatch.setattr(DeviceMemory, "can_measure", lambda self: True)
    monkeypatch.setattr(DeviceMemory, "allocated", lambda self: allocated["now"])
    monkeypatch.setattr(DeviceMemory, "max_allocated", lambda self: peaks.pop(0) if peaks else 0)
    monkeypatch.setattr(DeviceMemory, "reset_peak", lambda self: None)
    monkeypatch.setattr(DeviceMemory, "free", lambda self: free["bytes"])
    model, ids = make_net(layers=4), batch()
    session = ssdtrain.offload(model, min_bytes="4K", verbose=False, profile_steps=2)
    allowances = []
    real_begin = session.profiler.begin

    def begin(signature, allowance):
        allowances.append(allowance)
        real_begin(signature, allowance)

    session.profiler.begin = begin
    with session:
        free["bytes"] = 10 * MIB
        model(ids).backward()  # warm-up: allowance 0, moves or checkpoints everything it can
        warm_moved = session.cache.counters["bytes_to_host"]
        warm_checkpointed = set(session.profiler.checkpointed)
        peaks[:] = [4 * MIB]  # the warm-up's peak above its start: its excess
        free["bytes"] = 6 * MIB
        model(ids).backward()  # measured step: free - 1.25 x excess = 1 MiB kept at most
        peaks[:] = [0, 0, 0]
        free["bytes"] = 1 * MIB  # the leanest plan does not fit 85% of this
        with pytest.warns(ssdtrain.OffloadWarning, match="leanest plan"):
            model(ids).backward()
    assert allowances[0] == 0 and warm_moved > 0 and warm_checkpointed == {2, 3, 4}
    assert allowances[1] == 6 * MIB - int(1.25 * 4 * MIB)
    assert not session.plan.fits and session.plan.speed_target == int(MIB * 0.85)


def test_cache_prefetch_stays_within_the_window():
    """On CPU, with every block in host memory: the bytes restored and not yet released at any time stay within a
    block plus the plan's window (what the planner counts)."""
    model, ids = make_net(layers=6), batch()
    overrides = {f"blocks.{i}": "host" for i in range(6)}
    with ssdtrain.offload(model, min_bytes="4K", verbose=False, profile_steps=1, overrides=overrides) as s:
        model(ids).backward()
        cache = s.cache
        seen = []
        real = cache._account

        def account(delta):
            real(delta)
            seen.append(cache.gpu_saved_bytes)

        cache._account = account
        model.zero_grad()
        model(ids).backward()
    block = max(u.saved_bytes for u in s.plan.units[1:-1])
    assert s.stats()["misses"] == 0
    assert max(seen) <= block + s.plan.window_bytes
    assert torch.is_tensor(ids)


def test_kept_units_move_the_prefetch_window_so_nothing_misses():
    """The first blocks moved, the last ones kept: backward through the kept blocks prefetches the moved ones as it
    nears them (at most `prefetch_units` units ahead), so none is restored on demand."""
    model, ids = make_net(layers=8), batch()
    overrides = {f"blocks.{i}": "host" if i < 4 else "keep" for i in range(8)}
    with ssdtrain.offload(model, min_bytes="4K", verbose=False, profile_steps=1, overrides=overrides) as s:
        for _ in range(3):
            model.zero_grad()
            model(ids).backward()
    stats = s.stats()
    assert stats["bytes_offloaded"]["host"] > 0 and stats["misses"] == 0 and stats["prefetch_hits"] > 0


# ------------------------------------------------------------------ gradient accumulation, steady-state checks
def test_accumulation_steps_hold_every_gradient_through_forward_and_backward():
    """A step of gradient accumulation after one that set the gradients to None starts with all of them: they
    count at every point of the step (the forward's peak included), not only as backward allocates them."""
    units = _units()
    host = [Choice()] + [Choice("none", "host")] * 8 + [Choice()]
    grads = sum(u.grad_bytes for u in units)
    kw = dict(working_bytes=GIB, block_working=100 * MIB, forward_working=2 * GIB)
    none = simulate(units, host, FAST, **kw)
    held = simulate(units, host, FAST, held_grads=True, **kw)
    progressive = simulate(units, host, FAST, grads=True, **kw)
    assert held.peak == none.peak + grads  # the forward's peak holds them all
    assert held.peak > progressive.peak
    assert held.seconds == none.seconds
    # A plan for steps of both kinds counts the larger; it fits its budget with the gradients held.
    budget = int(5 * GIB)
    plain = _plan(budget, grads=True, **kw)
    both = _plan(budget, grads=True, held_grads=True, **kw)
    assert both.predict(False, held=True).peak <= budget * (1 - BUDGET_MARGIN)
    assert both.prediction.peak == max(both.predict(True).peak, both.predict(False, held=True).peak)
    assert plain.predict(False, held=True).peak > both.predict(False, held=True).peak  # the old plan overshoots
    assert "held through accumulation steps" in str(both)


def test_calibration_of_an_accumulation_step_measures_below_the_held_gradients():
    kw = dict(working_bytes=GIB, block_working=100 * MIB, forward_working=2 * GIB)
    plan = _plan(int(8 * GIB), grads=True, held_grads=True, **kw)
    grads = sum(u.grad_bytes for u in plan.units)
    allocated = 5 * GIB  # parameters, optimizer state and the held gradients
    predicted = plan.predict(False, held=True).peak
    # The allocator's peak over the step, above the memory without gradients: exactly the prediction.
    memory = _Memory(peaks=[allocated - grads + predicted], allocated=allocated)
    cal = Calibrator(memory)
    cal.start(plan, False, given=False, held=grads)
    assert cal.finish(step=4) is None
    # 1 GiB above it: a correction of 1 GiB (not 1 GiB + the gradients, nor 1 GiB - them).
    memory.peaks = [allocated - grads + predicted + GIB]
    cal.start(plan, False, given=False, held=grads)
    new = cal.finish(step=5)
    assert new is not None and new.correction == GIB


def test_a_plan_is_trusted_only_after_two_steps_within_its_prediction():
    """The first step under a plan grows the pinned pool (the host is held back, fewer copies are in flight): a
    peak within the prediction there does not end the checks; the next step above it still corrects the plan."""
    plan = _plan(int(7.5 * GIB), working_bytes=3 * GIB, block_working=200 * MIB, forward_working=2 * GIB)
    predicted = plan.predict(False).peak
    memory = _Memory(peaks=[predicted - 100 * MIB, predicted + 300 * MIB])
    cal = Calibrator(memory)
    cal.start(plan, False, given=False)
    assert cal.finish(step=4) is None and not plan._verified
    cal.start(plan, False, given=False)
    new = cal.finish(step=5)
    assert new is not None and new.correction == 300 * MIB
    # Two passes in a row: trusted, no more checks (the peak statistics are left alone).
    memory.peaks = [new.predict(False).peak] * 2
    for step in (6, 7):
        cal.start(new, False, given=False)
        assert cal.finish(step=step) is None
    assert new._verified
    resets = memory.resets
    cal.start(new, False, given=False)
    assert memory.resets == resets


def test_backward_starts_after_the_copies_out_so_a_moved_head_comes_back_over_the_link():
    """The cache waits for every copy out at backward's first unpack and frees their device bytes: a plan that
    moves more than the forward can send waits for the backlog, then brings the head back before its backward."""
    units = _units(head_saved=3 * GIB)
    slow = Bandwidth(d2h=10e9, h2d=10e9)
    keep_head = [Choice()] + [Choice("none", "host")] * 8 + [Choice()]
    move_head = keep_head[:-1] + [Choice("none", "host")]
    forward = sum(u.forward_s for u in units)
    moved = 8 * 400 * MIB
    a = simulate(units, keep_head, slow)
    b = simulate(units, move_head, slow)
    # Backward cannot start before the link has sent everything (forward ~85 ms, the link ~336 ms).
    backward = sum(u.backward_s for u in units)
    assert forward < moved / slow.d2h
    assert a.seconds >= moved / slow.d2h + backward - 1e-6
    assert a.per_unit_stall[-1] > 0
    # Moving the head adds its copy out before backward and its copy back before the head's backward.
    assert b.seconds >= a.seconds + 2 * 3 * GIB / slow.d2h - 1e-3
    assert b.stall_s > a.stall_s


def test_a_session_with_gradient_accumulation_plans_for_held_gradients():
    """Accumulation over 2 micro-batches with zero_grad(set_to_none=True): the session sees steps without and with
    gradients and plans for both; a plan made before accumulation began is replanned when it does."""
    model, ids = make_net(layers=4), batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with ssdtrain.offload(model, budget=0.5, min_bytes="4K", verbose=False) as session:
        for _ in range(3):
            for _ in range(2):
                model(ids).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert session.plan.grads and session.plan.held_grads
    assert "held through accumulation steps" in str(session.plan)
    # Plain steps first (a plan without held gradients), then accumulation: the plan is made again for it.
    model2 = make_net(layers=4)
    with ssdtrain.offload(model2, budget=0.5, min_bytes="4K", verbose=False) as session:
        for _ in range(4):
            model2(ids).sum().backward()
            model2.zero_grad(set_to_none=True)
        first = session.plan
        assert first.grads and not first.held_grads
        for _ in range(2):
            model2(ids).sum().backward()
        model2(ids).sum().backward()
    assert session.plan is not first and session.plan.held_grads


def _tight_budget():
    """A model, its batch, a plan made without accumulation, and the smallest budget that plan's measurements fit
    without held gradients (none fits with them)."""
    torch.manual_seed(0)
    model = _BranchModel(dim=32)
    ids = torch.randint(0, 37, (4, 64), generator=torch.Generator().manual_seed(11))

    def step():
        model.zero_grad(set_to_none=True)
        model(ids).backward()

    plan = ssdtrain.plan(model, step, min_bytes=0)
    with pytest.raises(ssdtrain.BudgetError) as plain:
        plan.replan(budget=1)
    with pytest.raises(ssdtrain.BudgetError) as held:
        replan(plan, budget=1, held_grads=True)
    assert held.value.minimum > plain.value.minimum
    return model, ids, plan, plain.value.minimum


def test_a_given_plan_that_accumulation_puts_over_its_budget_warns_once_and_runs_its_leanest():
    """plan= made for the smallest budget its steps fit, then trained with accumulation: no plan fits that budget with
    the gradients held, so the leanest is used with one OffloadWarning (as plan.override does: a given plan runs
    as the user has it) that names the cause and the fix, and training goes on under that one plan."""
    model, ids, plan, budget = _tight_budget()
    given = plan.replan(budget=budget)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ssdtrain.offload(model, plan=given, min_bytes=0) as session:
            for _ in range(3):
                model.zero_grad(set_to_none=True)
                for _ in range(2):
                    model(ids).backward()
                adjusted = session.plan
    said = [str(w.message) for w in caught if issubclass(w.category, ssdtrain.OffloadWarning)]
    assert len(said) == 1, said
    assert "gradient accumulation began" in said[0] and "plan=plan.replan(budget=...)" in said[0]
    assert session.plan is adjusted and adjusted.held_grads and not adjusted.fits
    assert adjusted.budget == budget < adjusted.prediction.peak
    assert format_bytes(adjusted.prediction.peak) in said[0]


def test_a_profiled_plan_that_accumulation_puts_over_its_budget_raises_naming_accumulation():
    """The same budget as budget= (a plan the session profiles): the first accumulation step refuses with
    BudgetError, as the first plan would, and says that accumulation is why."""
    model, ids, _, budget = _tight_budget()
    with ssdtrain.offload(model, budget=budget, min_bytes=0, verbose=False) as session:
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            model(ids).backward()
        assert session.plan is not None and not session.plan.held_grads
        model.zero_grad(set_to_none=True)
        model(ids).backward()
        with pytest.raises(ssdtrain.BudgetError, match="gradient accumulation began after the plan was made") as e:
            model(ids).backward()
    assert e.value.minimum > budget


def _accumulated_grads(model, ids) -> list:
    """The gradients of 2 micro-batches of a copy of `model` without ssdtrain (made before any session: a session's
    saved-tensor hooks are the thread's, so a copy run inside one would count in its profile)."""
    ref = copy.deepcopy(model)
    for _ in range(2):
        ref(ids).backward()
    return [p.grad for p in ref.parameters()]


def _accumulation_steps(model, ids, steps, want, live=None):
    """`steps` optimizer steps of 2 micro-batches each (gradients set to None between steps, no update), each step's
    gradients checked against `want`. Returns each micro-batch's measured peak above what it started with (`live`:
    a LiveBytes, its peak reset when the first block starts, after the step's start has made any plan)."""
    peaks = []
    reset = model.layers[0].register_forward_pre_hook(lambda *_: live and live.reset_high())
    try:
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            for _ in range(2):
                base = live.allocated() if live else 0
                model(ids).backward()
                peaks.append(live.high - base if live else None)
            for (name, p), g in zip(model.named_parameters(), want, strict=True):
                assert torch.equal(p.grad, g), name
    finally:
        reset.remove()
    return peaks


def test_accumulation_seen_when_the_plan_is_made_is_planned_for_and_the_measured_peak_stays_in_the_budget(
    monkeypatch, caplog
):
    """Accumulation from the first optimizer step, profiled in one micro-batch (profile_steps=1): the plan is made
    when the second micro-batch starts, which holds every gradient, and is made for them, once (it was made without
    them and at once made again, said as accumulation having begun after the plan). With the CPU's memory measured as
    a GPU's (the profile's working memory, calibration by measured peaks): every planned micro-batch's measured peak
    is within the budget, the gradients are keep's, bit for bit."""
    torch.manual_seed(0)
    model = _BranchModel(dim=32)
    ids = torch.randint(0, 37, (4, 64), generator=torch.Generator().manual_seed(11))
    want = _accumulated_grads(model, ids)
    with measured_cpu_memory(monkeypatch) as live:
        session = ssdtrain.offload(model, budget=0.6, min_bytes=0, profile_steps=1, nvme_memory=0)
        session.calibrator.clock = None  # peaks only: host timing noise would replan for time (tested elsewhere)
        with caplog.at_level("INFO", logger="ssdtrain"), session:
            peaks = _accumulation_steps(model, ids, 4, want, live)
    plan = session.plan
    assert plan.held_grads and plan.budget_fraction == 0.6
    assert caplog.text.count("ssdtrain: plan for _BranchModel") == 1
    assert "accumulation began" not in caplog.text
    assert any(c != Choice() for c in plan.choices)  # the budget made it move or recompute
    assert max(peaks[1:]) <= plan.budget, (peaks, plan.budget)  # (the first micro-batch was profiled)
    assert session.stats()["planned_steps"] == 7
    ssdtrain.release(model)


def test_accumulation_that_begins_after_the_plan_is_planned_for_within_the_measured_budget(monkeypatch, caplog):
    """Plain steps first (the plan is made without held gradients), then accumulation: the plan is made again for
    the held gradients, once, and every micro-batch's measured peak, before and after, stays within the budget."""
    torch.manual_seed(0)
    model = _BranchModel(dim=32)
    ids = torch.randint(0, 37, (4, 64), generator=torch.Generator().manual_seed(11))
    want = _accumulated_grads(model, ids)
    with measured_cpu_memory(monkeypatch) as live:
        session = ssdtrain.offload(model, budget=0.6, min_bytes=0, profile_steps=1, nvme_memory=0)
        session.calibrator.clock = None
        with caplog.at_level("INFO", logger="ssdtrain"), session:
            plain = []
            reset = model.layers[0].register_forward_pre_hook(lambda *_: live.reset_high())
            for _ in range(3):
                model.zero_grad(set_to_none=True)
                base = live.allocated()
                model(ids).backward()
                plain.append(live.high - base)
            reset.remove()
            first = session.plan
            peaks = _accumulation_steps(model, ids, 3, want, live)
    assert first.grads and not first.held_grads
    assert session.plan is not first and session.plan.held_grads and session.plan.budget == first.budget
    assert caplog.text.count("gradient accumulation began after the plan was made") == 1
    assert max(plain[1:] + peaks) <= first.budget, (plain, peaks, first.budget)
    ssdtrain.release(model)


def test_accumulation_seen_when_the_plan_is_made_refuses_a_budget_only_its_gradients_break():
    """The same with a budget that plain steps fit and steps holding the gradients do not: BudgetError when the plan
    is made, naming the gradients held through accumulation and the smallest budget with them."""
    model, ids, plan, budget = _tight_budget()
    with pytest.raises(ssdtrain.BudgetError) as e:
        with ssdtrain.offload(model, budget=budget, min_bytes=0, profile_steps=1, verbose=False):
            for _ in range(2):
                model.zero_grad(set_to_none=True)
                for _ in range(2):
                    model(ids).backward()
    with pytest.raises(ssdtrain.BudgetError) as held:
        replan(plan, budget=budget, held_grads=True)
    assert e.value.minimum == held.value.minimum > budget
    assert "accumulation began after the plan was made" not in str(e.value)
    assert "held through gradient accumulation" in str(e.value)


def test_the_checked_step_peak_is_the_one_read_when_its_backward_ended():
    """What runs between backward and the next step (the optimizer's first step allocates Adam's state) is not
    activation memory: the calibration reads the peak at backward's end, not when the next step begins."""
    plan = _plan(int(7.5 * GIB), working_bytes=3 * GIB, block_working=200 * MIB, forward_working=2 * GIB)
    predicted = plan.predict(False).peak
    memory = _Memory(peaks=[predicted - 100 * MIB, predicted + 5 * GIB])
    cal = Calibrator(memory)
    cal.start(plan, False, given=False)
    assert cal.checking
    cal.backward_done()  # backward ended: within the prediction
    assert cal.finish(step=4) is None  # the optimizer's 5 GiB afterwards changes nothing
    # Without a backward-end reading (no unpack went through the session), the next step's start reads the peak.
    cal.start(plan, False, given=False)
    memory.peaks = [predicted + 300 * MIB]
    new = cal.finish(step=5)
    assert new is not None and new.correction == 300 * MIB


def test_the_session_reads_the_measured_step_peaks_when_backward_ends(monkeypatch):
    """The measured step's last peak is read by the autograd engine's final callback, before `backward()`
    returns, so an optimizer step after it is not taken for the blocks' working memory."""
    monkeypatch.setattr(DeviceMemory, "can_measure", lambda self: True)
    monkeypatch.setattr(DeviceMemory, "allocated", lambda self: 0)
    monkeypatch.setattr(DeviceMemory, "max_allocated", lambda self: 0)
    monkeypatch.setattr(DeviceMemory, "reset_peak", lambda self: None)
    monkeypatch.setattr(DeviceMemory, "free", lambda self: 1 << 40)
    model, ids = make_net(layers=4), batch()
    session = ssdtrain.offload(model, min_bytes="4K", verbose=False, profile_steps=1)
    with session:
        model(ids).backward()
        assert session.probe.forward is not None
        assert session.probe.finished  # read at backward's end, not at the next step
        model(ids).backward()
    assert session.plan is not None


class _Clock:
    """Marks read from a list of made-up times (seconds)."""

    def __init__(self, times):
        self.times = list(times)

    def mark(self):
        return self.times.pop(0)

    def seconds(self, a, b):
        return b - a


def test_a_forward_faster_than_profiled_scales_unit_times_once_and_spreads_the_copies():
    """The profiled step ran 4x slower than the steps after it. With its times a slow link hides the inputs moved
    by recompute+host behind compute; with the measured ones it cannot: the plan predicts the stall and spreads
    its moves out. Slower forwards (the plan's own copies holding the host back) and later checks leave the times
    alone."""
    slow = [UnitProfile("<stem>", "stem", forward_s=1e-4, saved_bytes=MIB)]
    slow += [
        UnitProfile(f"b.{i}", "block", forward_s=0.02, saved_bytes=400 * MIB, input_bytes=64 * MIB)
        for i in range(16)
    ]
    slow.append(UnitProfile("<head>", "head", forward_s=0.02, saved_bytes=200 * MIB))
    link = Bandwidth(d2h=2e9, h2d=2e9)
    plan = make_plan("m", slow, link, int(1.1 * GIB), host_limit=64 * GIB, nvme_limit=0, block_container="b")
    assert plan.prediction.host_bytes > 0
    old_ratio = plan.prediction.seconds / plan.keep_prediction.seconds
    profiled = sum(u.forward_s for u in plan.units)
    predicted = plan.predict(False).peak
    # Two checked steps (Calibrator.TIMED_STEPS): the first only measures, the least forward of the two counts.
    cal = Calibrator(_Memory(peaks=[predicted, predicted]), clock=_Clock([0.0, profiled / 3, profiled]))
    for step, clock in ((3, _Clock([0.0, profiled / 3, profiled])), (4, _Clock([0.0, profiled / 4, profiled]))):
        cal.clock = clock
        cal.start(plan, False, given=False)
        cal.forward_done()
        cal.backward_done()
        new = cal.finish(step=step)
        if step == 3:
            assert new is None and not plan.times_checked
    assert new is not None and new.time_scale == pytest.approx(0.25)
    assert sum(u.forward_s for u in new.units) == pytest.approx(profiled / 4)
    assert sum(u.forward_s for u in plan.units) == pytest.approx(profiled)  # the old plan's units are untouched
    assert new.prediction.seconds / new.keep_prediction.seconds > old_ratio + 0.2  # the copies' stall, predicted
    assert [str(c) for c in new.choices] != [str(c) for c in plan.choices]
    assert new.prediction.peak <= new.budget
    assert "unit times scaled by 0.25" in new.calibrations[0]
    # Once per plan: the rescaled plan's own check leaves its times alone and still counts as a peak check.
    cal.memory.peaks = [new.predict(False).peak]
    cal.clock = _Clock([0.0, profiled / 50, profiled / 20])
    cal.start(new, False, given=False)
    assert cal.checking
    cal.forward_done()
    cal.backward_done()
    assert cal.finish(step=5) is None
    # A forward slower than profiled (copies holding the host back): no rescale.
    cal.memory.peaks = [predicted]
    cal.clock = _Clock([0.0, profiled * 2, profiled * 5])
    cal.start(plan, False, given=False)
    cal.forward_done()
    cal.backward_done()
    assert cal.finish(step=6) is None


def test_a_plan_slower_than_its_moves_predict_is_planned_again_with_slower_link_rates():
    """From the second checked step of a plan that moves bytes, forward+backward above 1.15x its prediction halves
    the link's rates for planning (late copies cost more than the rate says), at most twice; the first step under
    a plan (not steady) and plans that move nothing are not judged by their time."""
    units = [UnitProfile("<stem>", "stem", forward_s=1e-4, saved_bytes=MIB)]
    units += [
        UnitProfile(f"b.{i}", "block", forward_s=0.02, saved_bytes=400 * MIB, input_bytes=64 * MIB)
        for i in range(16)
    ]
    units.append(UnitProfile("<head>", "head", forward_s=0.02, saved_bytes=200 * MIB))
    plan = make_plan("m", units, Bandwidth(d2h=4e9, h2d=4e9), int(1.1 * GIB), host_limit=64 * GIB, nvme_limit=0,
                     block_container="b")  # fmt: skip
    assert plan.prediction.host_bytes > 0
    forward = sum(u.forward_s for u in units)

    cal = Calibrator(_Memory())  # one per session, as there

    def check(p, seconds, step, late=(0, 100)):
        """One checked step of `p`: its peak as predicted, forward+backward taking `seconds`, `late` = (MiB of
        moved tensors late or missed, MiB of moved tensors unpacked) during it."""
        counts = [(7 * MIB, 50 * MIB), (7 * MIB + late[0] * MIB, 50 * MIB + late[1] * MIB)]
        cal.memory = _Memory(peaks=[p.predict(False).peak])
        cal.clock = _Clock([0.0, forward, seconds])
        cal.late = lambda: counts.pop(0)
        cal.start(p, False, given=False)
        assert cal.checking
        cal.forward_done()
        cal.backward_done()
        return cal.finish(step=step)

    slow = 2 * plan.prediction.seconds
    assert check(plan, slow, 4) is None  # the first step under the plan: a pass, whatever its time
    new = check(plan, slow, 5)
    assert new is not None and new.link_scale == 0.5 and new.bandwidth.h2d == plan.bandwidth.h2d / 2
    assert new.prediction.seconds >= plan.prediction.seconds and new.prediction.peak <= new.budget
    assert "link rates halved" in new.calibrations[-1] and new.timing_calibrations == 1
    assert check(new, slow, 6) is None
    newer = check(new, 2 * new.prediction.seconds, 7)
    assert newer is not None and newer.link_scale == 0.25
    assert check(newer, slow * 4, 8) is None and check(newer, slow * 4, 9) is None  # two halvings at most
    # Within 1.15x of the prediction: passes.
    on_time = make_plan("m", units, Bandwidth(d2h=4e9, h2d=4e9), int(1.1 * GIB), host_limit=64 * GIB, nvme_limit=0,
                        block_container="b")  # fmt: skip
    assert check(on_time, on_time.prediction.seconds, 4) is None
    assert check(on_time, 1.1 * on_time.prediction.seconds, 5) is None and on_time._verified
    # On time, but more than a tenth of the moved bytes late or missed in backward (no measure of the device's
    # own wait): halved as well.
    late_plan = make_plan("m", units, Bandwidth(d2h=4e9, h2d=4e9), int(1.1 * GIB), host_limit=64 * GIB, nvme_limit=0,
                          block_container="b")  # fmt: skip
    assert check(late_plan, late_plan.prediction.seconds, 4, late=(50, 100)) is None  # first step: not judged
    assert check(late_plan, late_plan.prediction.seconds, 5, late=(10, 100)) is None  # a tenth: tolerated
    late_plan._passes, late_plan._verified = 1, False
    behind = check(late_plan, late_plan.prediction.seconds, 6, late=(11, 100))
    assert behind is not None and behind.link_scale == 0.5
    assert "11.0 MiB of 100.0 MiB moved late" in behind.calibrations[-1]
    # Nothing moved: a slow step is not the link's doing.
    roomy = make_plan("m", units, Bandwidth(d2h=4e9, h2d=4e9), 64 * GIB, host_limit=64 * GIB, nvme_limit=0,
                      block_container="b")  # fmt: skip
    assert not roomy.prediction.moved
    assert check(roomy, 10.0, 4) is None and check(roomy, 10.0, 5) is None


def test_weight_casts_of_recomputed_blocks_count_while_they_are_cached():
    """Autocast caches its bf16 weight casts until the autocast region ends: a recomputed block saves none of
    them, but the cache holds them through the rest of the forward (measured on an H100: a checkpointed Llama block
    leaves its casts allocated after its forward) unless the session clears it when the block returns
    (`clear_casts`, its default): then only the running block's count. Kept blocks hold theirs as saved bytes."""
    casts = 90 * MIB
    units = _units(n=4, head_saved=MIB)
    for u in units[1:-1]:
        u.pinned_bytes = casts
    fwd_work = 2 * GIB
    recompute = [Choice()] + [Choice("full", "keep")] * 4 + [Choice()]
    inputs = 4 * 32 * MIB
    kw = dict(forward_working=fwd_work, working_bytes=0, block_working=0)
    held = simulate(units, recompute, FAST, clear_casts=False, **kw)
    # At the head's forward: the stem and head keep theirs, the blocks keep their inputs and all four blocks' casts
    assert held.peak == MIB + MIB + inputs + 4 * casts + fwd_work
    assert held.peak_at == "forward of <head>" and held.peak_parts["weight casts"] == 4 * casts
    cleared = simulate(units, recompute, FAST, **kw)
    # The last block's forward: its own casts are still cached, the others' are gone.
    assert cleared.peak == MIB + inputs + casts + fwd_work
    assert cleared.peak_parts["weight casts"] == casts
    kept = [Choice()] * 6
    for clear in (True, False):
        k = simulate(units, kept, FAST, clear_casts=clear, **kw)
        assert k.peak == MIB + MIB + 4 * (400 * MIB + casts) + fwd_work


def _peaks_only(monkeypatch):
    """Calibrators check peaks only: host timing noise on a shared CPU would replan for time (tested elsewhere)."""
    init = Calibrator.__init__

    def without_clock(self, memory, **kw):
        init(self, memory, **{**kw, "clock": None})

    monkeypatch.setattr(Calibrator, "__init__", without_clock)


def _branch_model():
    torch.manual_seed(0)
    model = _BranchModel(dim=32)
    ids = torch.randint(0, 37, (4, 64), generator=torch.Generator().manual_seed(11))
    return model, ids


@pytest.mark.parametrize("sessions", ["one", "per step"])
def test_a_plan_is_checked_by_measured_peaks_with_a_session_per_step_as_with_one(sessions, monkeypatch):
    """No accumulation, a context per step (the Trainer callback's pattern, torchtune's): each step's peak check
    outlives its session and is finished by the next step, in the next session, so the plan is checked and trusted
    within a few steps, as under one session (a check cancelled when its session closed never completed)."""
    _peaks_only(monkeypatch)
    model, ids = _branch_model()
    options = dict(budget=0.6, min_bytes=0, profile_steps=1, nvme_memory=0, verbose=False)
    with measured_cpu_memory(monkeypatch):
        if sessions == "one":
            with ssdtrain.offload(model, **options) as session:
                for _ in range(6):
                    model.zero_grad(set_to_none=True)
                    model(ids).backward()
            plan = session.plan
        else:
            for _ in range(6):
                model.zero_grad(set_to_none=True)
                with ssdtrain.offload(model, **options) as session:
                    model(ids).backward()
            plan = state_of(model).latest
    assert plan is not None and plan.held_grads is False
    assert plan._verified, (plan.calibrations, getattr(plan, "_passes", 0))
    ssdtrain.release(model)
    if sessions == "per step":
        # A session whose step is still to be judged is kept by the model's state, and does not keep it alive.
        model, ids = _branch_model()
        with measured_cpu_memory(monkeypatch):
            for _ in range(2):
                with ssdtrain.offload(model, **options) as session:
                    model(ids).backward()
        assert state_of(model).unfinished is session
        gone = weakref.ref(model)
        del model, session
        gc.collect()
        assert gone() is None


def test_per_forward_sessions_plan_for_the_gradients_accumulation_holds(monkeypatch, caplog):
    """A context per forward (backward after the ``with`` block), profiled in one micro-batch (profile_steps=1),
    accumulation over 2: the profile is finished when the next micro-batch starts, after its held gradients are
    read and after the profiled backward's peaks (which run after the profiled forward's session closed), so one
    plan is made, for the held gradients, as a single session makes it; every planned micro-batch's measured peak
    is within the budget and the gradients are keep's, bit for bit."""
    _peaks_only(monkeypatch)
    model, ids = _branch_model()
    want = _accumulated_grads(model, ids)
    options = dict(budget=0.6, min_bytes=0, profile_steps=1, nvme_memory=0, verbose=False)
    peaks = []
    with measured_cpu_memory(monkeypatch) as live, caplog.at_level("INFO", logger="ssdtrain"):
        reset = model.layers[0].register_forward_pre_hook(lambda *_: live.reset_high())
        for _ in range(4):
            model.zero_grad(set_to_none=True)
            for _ in range(2):
                base = live.allocated()
                with ssdtrain.offload(model, **options):
                    loss = model(ids)
                loss.backward()
                del loss
                peaks.append(live.high - base)
            for (name, p), g in zip(model.named_parameters(), want, strict=True):
                assert torch.equal(p.grad, g), name
        reset.remove()
    plan = state_of(model).latest
    assert plan.held_grads and plan.budget_fraction == 0.6
    assert any(c != Choice() for c in plan.choices)  # the budget made it move or recompute
    assert max(peaks[1:]) <= plan.budget, (peaks, plan.budget)  # (the first micro-batch was profiled)
    assert caplog.text.count("ssdtrain: plan for _BranchModel") == 1
    assert "accumulation began" not in caplog.text
    ssdtrain.release(model)
