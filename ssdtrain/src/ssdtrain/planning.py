"""What outlives one session around a model (its plans, warm-ups, what was seen of its gradients), and the
calibration of a plan by the peaks its first steps measure.

Plans are kept per model, input signature and the options that decide a plan (the budget as given, the tiers'
limits as given, overrides, ``min_bytes``, ``prefetch_units``), never a reading that changes between calls (the
default host limit follows the available RAM, which moves all the time), so a new ``offload()`` around the same
model, even one per step, reuses them.
"""

from __future__ import annotations

import logging
import sys
import warnings
import weakref

from .entries import OffloadWarning
from .planner import Bandwidth, BudgetError, Plan, format_bytes, replan, scaled_units

_GIB = float(1 << 30)

log = logging.getLogger("ssdtrain")


class ModelState:
    """Per model: plans by (signature, options), warm-up steps done per signature, the latest plan."""

    def __init__(self):
        self.plans: dict = {}
        self.warmups: dict = {}
        self.latest: Plan | None = None
        self.grads_missing = False  # some step started without gradients: backward allocates them
        self.grads_held = False  # some step started with gradients held (accumulation): they count throughout
        self.warned: set[str] = set()

    def replace(self, old: Plan, new: Plan) -> None:
        for key, value in list(self.plans.items()):
            if value is old:
                self.plans[key] = new
        if self.latest is old:
            self.latest = new


_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def state_of(model) -> ModelState:
    state = _STATES.get(model)
    if state is None:
        state = _STATES[model] = ModelState()
    return state


def _peak_checks(plan: Plan) -> int:
    """Calibrations of `plan` by a measured peak (not those that rescaled its times or link rates)."""
    return len(plan.calibrations) - plan.timing_calibrations


class Calibrator:
    """The first steps of a plan are measured (the device's peak statistic, reset for it). A peak above the
    prediction (temporaries the profile could not see) becomes the plan's ``correction`` and the same
    measurements are planned again, at most `limit` times per plan; a peak far below it lowers it once.

    When the corrected prediction leaves no plan within the budget: at the first calibration (the first step
    under the first plan, right after profiling) ``BudgetError`` names the smallest budget that fits, so the
    refusal comes before training goes on; at a later one the leanest plan is used with a warning (training that
    has started is not stopped). With no budget (``budget=None``) the leanest plan is used, with a warning.

    A plan is trusted after `passes` steps in a row measured within its prediction: the first step under a new
    plan is not a steady one (the pinned host pool grows to the plan's size during it, which holds the host back
    and leaves fewer copies in flight than later steps have).

    Where steps start with gradients held (accumulation after a step that set them to None) and the plan counts
    them (``plan.held_grads``), the measurement starts below them, as the budget counts them.

    The checked step's forward is timed too (`clock`). The profiled step runs slower than the steps after it
    (first calls, the profiler's own hooks), which makes copies to the host look hidden behind compute when they
    are not. A forward measured below ``TIME_SLACK`` x the profiled one scales every unit's measured time by the
    ratio, once per plan, and plans again: the moved bytes then compete with the real compute time. Only
    downwards: a forward slowed by the plan's own copies (the host waiting on the link) is no measure of compute.

    Forward and backward together are timed as well, and the cache's late copies counted (`late`: a callable
    giving the cumulative (late or missed, all) unpacks of moved tensors). A plan that moves bytes and, from its
    second checked step on (the first is not steady), runs above ``SPEED_SLACK`` x its predicted time, or finds
    more than ``LATE_SLACK`` of its moved tensors late or not prefetched in backward, is planned again with the
    link's rates halved, at most twice: copies that arrive late cost more than the link's measured rate says (on
    an H100 a plan predicted at 1.22x keep's time with no stall ran at 1.47x, half its prefetches late), and the
    planner then prefers recompute where it fits the budget."""

    TIME_SLACK = 0.8
    SPEED_SLACK = 1.15
    LATE_SLACK = 0.1
    LINK_HALVINGS = 2

    def __init__(self, memory, *, clock=None, late=None, limit: int = 2, verbose: bool = False, passes: int = 2):
        self.memory = memory
        self.clock = clock
        self.late = late
        self._late_base: tuple[int, int] | None = None
        self._forward: list | None = None  # [start, forward's end, backward's end] marks of the checked step
        self.limit = limit
        self.passes = passes
        self.verbose = verbose
        self._check = None
        self._peak: int | None = None  # the device's peak statistic read when the checked step's backward ended

    def start(self, plan: Plan, grads: bool, given: bool, held: int = 0) -> None:
        """A step under `plan` begins (`grads`: it starts without gradients; `held`: bytes of the gradients it
        starts with)."""
        self._check = None
        self._peak = None
        self._forward = None
        if given or not self.memory.can_measure() or (plan.budget is None and plan.speed_target is None):
            return
        if _peak_checks(plan) >= self.limit or getattr(plan, "_verified", False):
            return
        counted = held if plan.held_grads and not grads else 0
        self._check = (plan, grads, counted > 0, self.memory.allocated() - counted)
        self.memory.reset_peak()
        if self.clock is not None:
            self._forward = [self.clock.mark(), None, None]
        self._late_base = self.late() if self.late is not None else None

    def forward_done(self) -> None:
        """The checked step's forward ended."""
        if self._check is not None and self._forward is not None and self._forward[1] is None:
            self._forward[1] = self.clock.mark()

    def cancel(self) -> None:
        self._check = None
        self._forward = None

    @property
    def checking(self) -> bool:
        return self._check is not None

    def backward_done(self) -> None:
        """The checked step's backward ended: its peak is read now, not when the next step begins, so the
        optimizer's step (whose first call allocates its state: Adam's two fp32 copies of the parameters) and
        whatever else runs between steps is not taken for activation memory. Only the step's first backward is
        read this way: a second backward through the same graph (``retain_graph=True``) is not measured, as the
        planner does not predict it either."""
        if self._check is not None:
            if self._forward is not None and self._forward[1] is not None and self._forward[2] is None:
                self._forward[2] = self.clock.mark()
            self._peak = self.memory.max_allocated()

    def finish(self, step: int) -> Plan | None:
        """The step under check ended (the next one begins): a corrected plan, or None to keep the plan."""
        check, self._check = self._check, None
        if check is None:
            return None
        plan, grads, held, base = check
        peak = (self._peak if self._peak is not None else self.memory.max_allocated()) - base
        self._peak = None
        marks, self._forward = self._forward, None
        rescale = self._time_scale(plan, marks)
        if rescale is not None:
            plan = self._rescaled(plan, rescale, step)
        predicted = plan.predict(grads, held).peak
        limit = plan.budget if plan.budget is not None else plan.speed_target
        # Upward always (the budget is at stake); downward (a faster plan) only on the first check and only when
        # the prediction was far too high.
        if peak <= predicted and (peak > 0.8 * predicted or plan.calibrations or getattr(plan, "_passes", 0)):
            return plan if rescale is not None else self._steady(plan, grads, held, marks, step)
        correction = max(-plan.working_bytes, plan.correction + peak - predicted)
        if correction == plan.correction:
            return plan if rescale is not None else self._steady(plan, grads, held, marks, step)
        line = (
            f"step {step - 1}: measured peak {peak / _GIB:.2f} GiB, predicted {predicted / _GIB:.2f} GiB "
            f"(limit {limit / _GIB:.2f} GiB): correction {plan.correction / _GIB:+.2f} -> {correction / _GIB:+.2f} GiB"
        )
        try:
            new = replan(plan, correction=correction)
        except BudgetError as e:
            if not _peak_checks(plan):
                raise BudgetError(
                    f"ssdtrain: the measured activation peak ({format_bytes(peak)}) of the first step under the plan "
                    f"is above its prediction ({format_bytes(predicted)}); with that correction no plan fits the "
                    f"budget {format_bytes(plan.budget)}: the smallest budget is {format_bytes(e.minimum)} "
                    f"({e.minimum} bytes). Pass budget >= that, give more host RAM or an NVMe directory, or reduce "
                    "the batch",
                    e.minimum,
                ) from None
            new = self._leanest(plan, correction)
            warnings.warn(
                f"ssdtrain: {line}: no plan fits the budget {format_bytes(plan.budget)} any more; training goes on "
                f"with the leanest plan (predicted peak {format_bytes(new.prediction.peak)}, over the budget)",
                OffloadWarning,
                stacklevel=5,
            )
        if plan.budget is None and not new.fits:
            warnings.warn(
                f"ssdtrain: {line}: even the leanest plan ({format_bytes(new.prediction.peak)}) is predicted above "
                f"the free device memory ({format_bytes(plan.speed_target)}); training goes on with it, but may "
                "run out of memory: reduce the batch",
                OffloadWarning,
                stacklevel=5,
            )
        return self._replanned(plan, new, line)

    def _time_scale(self, plan: Plan, marks) -> float | None:
        """The factor to scale the plan's unit times by, from the checked step's forward; None to keep them."""
        if marks is None or marks[1] is None or plan.time_scale != 1.0:
            return None
        profiled = sum(u.forward_s for u in plan.units)
        try:
            measured = self.clock.seconds(marks[0], marks[1])
        except RuntimeError:  # an event not recorded (a step interrupted between the marks)
            return None
        if profiled <= 0 or measured <= 0 or measured >= self.TIME_SLACK * profiled:
            return None
        return measured / profiled

    def _rescaled(self, plan: Plan, scale: float, step: int) -> Plan:
        """`plan` planned again with every unit's time scaled by `scale` (same budget, same correction)."""
        profiled = sum(u.forward_s for u in plan.units)
        line = (
            f"step {step - 1}: measured forward {profiled * scale * 1e3:.1f} ms, profiled {profiled * 1e3:.1f} ms: "
            f"unit times scaled by {scale:.2f}"
        )
        try:
            new = replan(plan, units=scaled_units(plan.units, scale), time_scale=scale)
        except BudgetError:
            # The same bytes with less time to move them: no plan fits any more. Keep the plan; the peak check that
            # follows guards the budget.
            plan.time_scale = scale
            plan.calibrations.append(f"{line}; no plan fits the budget with those times: the plan is kept")
            plan.timing_calibrations += 1
            return plan
        return self._replanned(plan, new, line, timing=True)

    def _steady(self, plan: Plan, grads: bool, held: bool, marks, step: int) -> Plan | None:
        """The checked step's peak is within the prediction: a slower plan than predicted that moves bytes is
        planned again with the link's rates halved; else the step counts as a pass."""
        prediction = plan.predict(grads, held)
        steady = bool(prediction.moved) and getattr(plan, "_passes", 0) >= 1
        measured = None
        if steady and marks is not None and marks[2] is not None:
            try:
                measured = self.clock.seconds(marks[0], marks[2])
            except RuntimeError:
                measured = None
        late = None
        if steady and self._late_base is not None:
            now = self.late()
            late = (now[0] - self._late_base[0], now[1] - self._late_base[1])
        slow = measured is not None and measured > self.SPEED_SLACK * prediction.seconds
        behind = late is not None and late[1] > 0 and late[0] > self.LATE_SLACK * late[1]
        if not (slow or behind) or plan.link_scale <= 0.5**self.LINK_HALVINGS:
            return self._passed(plan)
        bw = plan.bandwidth
        why = []
        if slow:
            why.append(f"forward+backward {measured * 1e3:.1f} ms against {prediction.seconds * 1e3:.1f} predicted")
        if behind:
            why.append(f"{late[0]} of {late[1]} moved tensors late or not prefetched")
        line = f"step {step - 1}: {'; '.join(why)}: link rates halved for planning"
        try:
            new = replan(plan, bandwidth=Bandwidth(bw.d2h / 2, bw.h2d / 2), link_scale=plan.link_scale / 2)
        except BudgetError:
            return self._passed(plan)  # the budget needs the moves: keep them
        return self._replanned(plan, new, line, timing=True)

    def _replanned(self, plan: Plan, new: Plan, line: str, timing: bool = False) -> Plan:
        """`new`, planned again from `plan` by a check (`line` says why; `timing`: a check of times, not of the
        peak), with that line recorded and said."""
        new.calibrations = plan.calibrations + [line]
        new.timing_calibrations = plan.timing_calibrations + timing
        message = (
            f"ssdtrain: {line}; replanned: predicted peak {new.prediction.peak / _GIB:.2f} GiB, forward+backward "
            f"{new.prediction.seconds / new.keep_prediction.seconds:.2f}x keep's"
        )
        log.info(message)
        if self.verbose:
            print(message, file=sys.stderr)
        return new

    def _passed(self, plan: Plan) -> None:
        plan._passes = getattr(plan, "_passes", 0) + 1
        plan._verified = plan._passes >= self.passes

    @staticmethod
    def _leanest(plan: Plan, correction: int) -> Plan:
        """The fastest plan within the budget, else the leanest, keeping the budget it was asked for."""
        new = replan(plan, correction=correction, budget=None, budget_fraction=None, speed_target=plan.budget)
        new.budget, new.budget_fraction, new.speed_target = plan.budget, plan.budget_fraction, plan.speed_target
        new.fits = False
        return new
