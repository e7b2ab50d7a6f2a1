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
import time
import warnings
import weakref
from math import log2 as math_log2

from .entries import OffloadWarning
from .planner import Bandwidth, BudgetError, Plan, format_bytes, replan, scaled_units
from .prediction import move_host_s, split_choice

_GIB = float(1 << 30)

log = logging.getLogger("ssdtrain")


def host_forward_base(plan: Plan, host: float) -> float:
    """The host's time to issue a forward without moves, from a timed forward's host time under `plan`: less the
    moves' host work the plan predicts (``MOVE_HOST_S`` per moved tensor). 0 (unknown) where copies are synchronous
    (CPU: the host is the device there)."""
    if not plan.async_copies:
        return 0.0
    return max(0.0, host - sum(move_host_s(u, c) for u, c in zip(plan.units, plan.choices, strict=True)))


def _host_part(host: float, measured: float) -> str:
    """How long the host took to issue a timed forward, and what that says about the measure: a host that needed
    about as long as the device (or longer) set the pace, and the measure is then more than the device's compute."""
    line = f"the host issued it in {host * 1e3:.1f} ms"
    return line + (", so it set the pace" if host >= 0.9 * measured else "")


class TimedForwards:
    """The checked steps whose forward was timed while the plans' unit times were not yet checked: (step, measured
    forward s, host's waits s, the host's own time to its end s) each, and the profiled unit times those plans were
    made from (`Calibrator`). Kept per model, so that a session per step (the Trainer callback) counts its steps
    together."""

    def __init__(self):
        self.steps: list[tuple[int, float, float, float]] = []
        self.profile: tuple | None = None


class ModelState:
    """Per model: plans by (signature, options), warm-up steps done per signature, the latest plan."""

    def __init__(self):
        self.timed = TimedForwards()
        self.plans: dict = {}
        self.warmups: dict = {}
        self.latest: Plan | None = None
        self.grads_missing = False  # some step started without gradients: backward allocates them
        self.grads_held = False  # some step started with gradients held (accumulation): they count throughout
        self.warned: set[str] = set()
        # Steps begun by every session around the model: what log lines number steps by (a session per micro-batch
        # would otherwise call every step "step 1").
        self.steps = 0
        # A closed session whose last step the model's next step finishes (OffloadSession._finish_previous).
        self.unfinished = None
        # id(a plan= as given) -> (that plan, its choices, budget and window then, that plan adjusted for gradients
        # held through accumulation): the adjustment is made once, not by every session (see OffloadSession).
        self.adjusted: dict = {}

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

    The checked step's forward is timed too (`clock`). The profiled step runs slower than the steps after it (first
    calls, the profiler's own hooks, its own copies to the host), which makes copies to the host look hidden behind
    compute when they are not. The forward's compute time is the measured forward less the waits for the link in it
    (`waits`: a callable giving the cumulative seconds the device's compute waited for copies out and the host for
    pinning new host memory): the device idles at most that long for the plan's own copies, so a forward that the copies
    slowed is still a measure of compute. Each such measure is compute plus however long the host kept the device
    waiting besides, and a checked step begins with the device idle (its memory readings synchronize), so the host sets
    the pace until it gets ahead: the compute time is the least of the first ``TIMED_STEPS`` checked steps' measures (on
    an H100, Llama-style 16 x 2048, the first planned step read 48.5-72.4 ms for a 46.5 ms forward in plans that move
    bytes, having waited 58-96 ms for copies out; later checked steps waited 12-28 ms), leaving out a step that waited
    for more than ``WAIT_SHARE`` of its forward where another did not (its waits and the host's lateness overlap, and
    the difference reads below the compute: 27.7-41.6 ms for that 46.5 ms forward). A compute time below
    ``TIME_SLACK`` x the profiled forward scales every unit's time by the ratio, once per plan lineage, and plans again:
    the moved bytes then compete with the real compute time. Either way the plan's times are then *checked*
    (``plan.times_checked``).

    The order is explicit: the time and link feedback below judges only a plan whose times are checked, from its
    second checked step on (the first is not steady), and never the step that rescaled them (that step ran under
    the plan built on the unscaled times, which had hidden copies behind compute that was not there; its late
    copies say nothing about the link). A step under a plan with unchecked times (no usable forward timing) is
    not judged on its time; the log says so.

    Forward and backward together are timed, and the cache's copies back measured (`late`: a callable giving the
    cumulative (bytes late or missed, moved bytes unpacked[, seconds the device waited for them])). Bytes, not
    tensors: a few small tensors (position tables, masks) do not stand for a model's 64 MiB block inputs; and late
    on the host is no stall, as the host runs ahead of the device: the device's own wait decides where measured.
    Where the device's wait is measured (CUDA events), a wait beyond the predicted stalls by more than
    ``STALL_SLACK`` x the predicted time means the copies back do not keep up: the plan is made again with the
    link's rates halved, at most ``LINK_HALVINGS`` times (each said in the log with the rates it leaves). Without
    that measure, more than ``LATE_SLACK`` of the moved bytes late, or a step above ``SPEED_SLACK`` x its predicted
    time, does the same. A step above ``OVERHEAD_SLACK`` x its prediction while the device did not wait for copies
    back is a cost of the moves that the link does not explain (host work in the hooks, copies that slow compute):
    the excess is charged to each moved unit (``plan.move_overhead_s``, once per plan lineage) and the plan made
    again, so moves that do not pay give way to recompute."""

    TIME_SLACK = 0.8
    TIMED_STEPS = 2
    SPEED_SLACK = 1.15
    LATE_SLACK = 0.1
    STALL_SLACK = 0.02
    OVERHEAD_SLACK = 1.05
    LINK_HALVINGS = 2
    WAIT_SHARE = 0.5  # a timed forward that waited for copies out longer than this share of it measures no compute

    def __init__(
        self,
        memory,
        *,
        clock=None,
        late=None,
        waits=None,
        limit: int = 2,
        verbose: bool = False,
        passes: int = 2,
        timed: TimedForwards | None = None,
    ):
        self.memory = memory
        self.clock = clock
        self.late = late
        self.waits = waits
        self._late_base: tuple | None = None
        self._waits_base: float | None = None
        self._forward_waits: float | None = None
        # The host's own time from the checked step's start to its forward's end: near the measured (device) time,
        # the host set the pace and the measure is not the device's compute (logged with each timed step).
        self._host_start: float | None = None
        self._host_forward: float | None = None
        self._forward: list | None = None  # [start, forward's end, backward's end] marks of the checked step
        self.timed = timed if timed is not None else TimedForwards()  # (the least of TIMED_STEPS of them counts)
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
            self._host_start, self._host_forward = time.perf_counter(), None
        self._late_base = self.late() if self.late is not None else None
        self._waits_base = self.waits() if self.waits is not None else None
        self._forward_waits = None

    def forward_done(self) -> None:
        """The checked step's forward ended."""
        if self._check is not None and self._forward is not None and self._forward[1] is None:
            self._forward[1] = self.clock.mark()
            self._host_forward = time.perf_counter() - self._host_start
            if self._waits_base is not None:
                self._forward_waits = max(0.0, self.waits() - self._waits_base)

    def cancel(self) -> None:
        self._check = None
        self._forward = None

    @property
    def checking(self) -> bool:
        return self._check is not None

    @property
    def measured(self) -> bool:
        """The checked step's peak was read when its backward ended."""
        return self._peak is not None

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
        # First the unit times (from this step's forward), then the peak, then, only where the times were not
        # rescaled now, the link (`_steady`): a step run under times found wrong says nothing about the link.
        ran = plan
        ran_prediction = ran.predict(grads, held)  # the choices this step ran (not the rescaled plan's)
        rescale = self._time_scale(plan, marks, ran_prediction.seconds, step)
        if rescale is not None:
            plan = self._rescaled(plan, *rescale, step)
        predicted = ran_prediction.peak
        limit = plan.budget if plan.budget is not None else plan.speed_target
        # Upward always (the budget is at stake); downward (a faster plan) only on the first check and only when
        # the prediction was far too high.
        if peak <= predicted and (peak > 0.8 * predicted or plan.calibrations or getattr(plan, "_passes", 0)):
            return plan if rescale is not None else self._steady(plan, grads, held, marks, step)
        correction = max(-plan.working_bytes, ran.correction + peak - predicted)
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

    def _forward_seconds(self, marks) -> tuple[float, float] | None:
        """(measured forward, host's waits for the link in it) of the checked step, or None."""
        if marks is None or marks[1] is None:
            return None
        try:
            measured = self.clock.seconds(marks[0], marks[1])
        except RuntimeError:  # an event not recorded (a step interrupted between the marks)
            return None
        return measured, min(self._forward_waits or 0.0, measured)

    def _time_scale(self, plan: Plan, marks, predicted: float, step: int) -> tuple[float, str, float] | None:
        """(the factor to scale the plan's unit times by, why, the host's time to issue a forward without moves:
        ``host_forward_base``) from the checked steps, the last of which (`step`) had ``predicted`` seconds
        predicted; None to keep them (and the plan's times are then checked, where the forward was measured in
        ``TIMED_STEPS`` steps; before that, they stay unchecked; found right, the host's time is set on the plan).

        Two witnesses: the forward's compute (the measured forward less the host's waits for copies out), and the
        whole step against its prediction. A plan's copies can slow its forward beyond the host's waits (the device
        waits for them too), so a forward as slow as profiled does not prove the times right; but a forward and
        backward well below the predicted time can only mean unit times too slow (copies only add time)."""
        timed = self.timed
        if plan.time_scale != 1.0 or plan.times_checked:
            timed.steps.clear()
            return None
        forward = self._forward_seconds(marks)
        profiled = sum(u.forward_s for u in plan.units)
        if forward is None or profiled <= 0:
            return None
        this_forward, waited = forward
        if this_forward - waited <= 0:
            return None  # the forward waited for the link throughout: no measure of compute
        # The forward's compute does not depend on the plan's choices (moves add none, recompute runs in backward),
        # so the steps of plans made from one profile count together; a new profile starts again.
        profile = tuple(u.forward_s for u in plan.units)
        if profile != timed.profile:
            timed.steps.clear()
            timed.profile = profile
        host = self._host_forward if self._host_forward is not None else this_forward
        timed.steps.append((step - 1, this_forward, waited, host))
        if len(timed.steps) < self.TIMED_STEPS:
            self._say(
                f"step {step - 1}: forward compute {(this_forward - waited) * 1e3:.1f} ms (measured "
                f"{this_forward * 1e3:.1f} ms less {waited * 1e3:.1f} ms waited for copies out; "
                f"{_host_part(host, this_forward)}): the next checked step is timed too, the least of them counts"
            )
            return None
        # A forward that waited for copies out most of its time is no measure of compute: the host's own lateness
        # overlaps those waits and both come off the measure (an H100 read 27.7 ms for a Llama forward that computes
        # in 47, having waited 114 of its 142 ms). Such a step counts only where every timed step waited so.
        measures = [t for t in timed.steps if t[2] <= self.WAIT_SHARE * t[1]] or timed.steps
        least, measured, waited, host = min(measures, key=lambda t: t[1] - t[2])
        others = ", ".join(
            f"{(m - w) * 1e3:.1f}" + ("" if (s, m, w, h) in measures else f" (waited {w * 1e3:.1f} of {m * 1e3:.1f})")
            for s, m, w, h in timed.steps
            if s != least
        )
        timed.steps.clear()
        compute = measured - waited
        host_base = host_forward_base(plan, host)
        if compute < self.TIME_SLACK * profiled:
            scale = compute / profiled
            return scale, (
                f"forward compute {compute * 1e3:.1f} ms at step {least}"
                + (f" (measured {measured * 1e3:.1f} ms less {waited * 1e3:.1f} ms waited for copies out; "
                   f"{_host_part(host, measured)})" if waited else f" ({_host_part(host, measured)})")
                + f", the least of {self.TIMED_STEPS} checked steps (others {others} ms), profiled "
                + f"{profiled * 1e3:.1f} ms: unit times scaled by {scale:.2f}"
            ), host_base  # fmt: skip
        total = self._step_seconds(marks)
        if total is not None and predicted > 0 and total < self.TIME_SLACK * predicted:
            scale = total / predicted
            return scale, (
                f"forward+backward {total * 1e3:.1f} ms against {predicted * 1e3:.1f} ms predicted (the forward, "
                f"{this_forward * 1e3:.1f} ms, slowed by the plan's copies): unit times scaled by {scale:.2f}"
            ), host_base
        plan.times_checked = True
        plan.host_forward_s = host_base
        return None

    def _step_seconds(self, marks) -> float | None:
        """The checked step's forward and backward, measured, or None."""
        if marks is None or marks[2] is None:
            return None
        try:
            return self.clock.seconds(marks[0], marks[2])
        except RuntimeError:
            return None

    def _rescaled(self, plan: Plan, scale: float, why: str, host: float, step: int) -> Plan:
        """`plan` planned again with every unit's time scaled by `scale` and the host's time to issue a forward
        without moves `host` (0: unknown), with the same budget and correction."""
        line = f"step {step - 1}: {why}"
        if host:
            line += f"; the host issues a forward without moves in {host * 1e3:.1f} ms"
        try:
            new = replan(plan, units=scaled_units(plan.units, scale), time_scale=scale, host_forward_s=host)
        except BudgetError:
            # The same bytes with less time to move them: no plan fits any more. Keep the plan; the peak check that
            # follows guards the budget.
            plan.time_scale = scale
            plan.times_checked = True
            plan.host_forward_s = host
            plan.calibrations.append(f"{line}; no plan fits the budget with those times: the plan is kept")
            plan.timing_calibrations += 1
            return plan
        return self._replanned(plan, new, line, timing=True)

    def _steady(self, plan: Plan, grads: bool, held: bool, marks, step: int) -> Plan | None:
        """The checked step's peak is within the prediction. From the second checked step of a plan that moves
        bytes and whose times are checked: copies back that kept the device waiting (or, unmeasured, late or a
        slow step) halve the link's rates for planning; a slow step without such waits charges its excess to the
        moved units. Else the step counts as a pass."""
        prediction = plan.predict(grads, held)
        steady = bool(prediction.moved) and getattr(plan, "_passes", 0) >= 1
        if not steady:
            return self._passed(plan)
        if not plan.times_checked:
            self._say(
                f"step {step - 1}: not judged by its time or its late copies: the plan's unit times are not yet "
                "checked against a measured forward"
            )
            return self._passed(plan)
        measured = None
        if marks is not None and marks[2] is not None:
            try:
                measured = self.clock.seconds(marks[0], marks[2])
            except RuntimeError:
                measured = None
        late_bytes = unpacked = 0
        device_wait = None
        if self._late_base is not None:
            now = self.late()
            late_bytes, unpacked = now[0] - self._late_base[0], now[1] - self._late_base[1]
            if len(now) > 2 and now[2] is not None and len(self._late_base) > 2 and self._late_base[2] is not None:
                device_wait = max(0.0, now[2] - self._late_base[2])
        slow = measured is not None and measured > self.SPEED_SLACK * prediction.seconds
        over = measured is not None and measured > self.OVERHEAD_SLACK * prediction.seconds
        if device_wait is not None:
            behind = device_wait > prediction.stall_s + self.STALL_SLACK * prediction.seconds
            link = behind
        else:
            behind = unpacked > 0 and late_bytes > self.LATE_SLACK * unpacked
            link = behind or slow
        why = []
        if measured is not None and (slow or over):
            why.append(f"forward+backward {measured * 1e3:.1f} ms against {prediction.seconds * 1e3:.1f} predicted")
        if device_wait is not None and behind:
            why.append(
                f"the device waited {device_wait * 1e3:.1f} ms for copies back (predicted stalls "
                f"{prediction.stall_s * 1e3:.1f} ms; {format_bytes(late_bytes)} of {format_bytes(unpacked)} late)"
            )
        elif behind:
            why.append(f"{format_bytes(late_bytes)} of {format_bytes(unpacked)} moved late or not prefetched")
        if link:
            if plan.link_scale <= 0.5**self.LINK_HALVINGS:
                if not getattr(plan, "_said_bound", False):
                    plan._said_bound = True
                    self._say(
                        f"step {step - 1}: {'; '.join(why)}: link rates not halved again (already "
                        f"{plan.link_scale:g}x the measured rates, {self.LINK_HALVINGS} halvings at most)"
                    )
                return self._passed(plan)
            bw = plan.bandwidth
            scale = plan.link_scale / 2
            halving = round(math_log2(1 / scale))
            line = (
                f"step {step - 1}: {'; '.join(why)}: link rates halved for planning, to {scale:g}x the measured "
                f"rates ({bw.h2d / 2e9:.1f} GB/s H2D; halving {halving} of {self.LINK_HALVINGS})"
            )
            try:
                new = replan(plan, bandwidth=Bandwidth(bw.d2h / 2, bw.h2d / 2), link_scale=scale)
            except BudgetError:
                return self._passed(plan)  # the budget needs the moves: keep them
            return self._replanned(plan, new, line, timing=True)
        if over and device_wait is not None and not plan.move_overhead_s:
            moved_units = sum(1 for u, c in zip(plan.units, plan.choices, strict=True) if split_choice(u, c)[1])
            excess = measured - prediction.seconds
            per_unit = excess / max(1, moved_units)
            line = (
                f"step {step - 1}: {'; '.join(why)}, while the device waited {device_wait * 1e3:.1f} ms for copies "
                f"back: the {excess * 1e3:.1f} ms excess charged to the {moved_units} moved units "
                f"({per_unit * 1e3:.2f} ms each)"
            )
            try:
                new = replan(plan, move_overhead_s=per_unit)
            except BudgetError:
                return self._passed(plan)
            return self._replanned(plan, new, line, timing=True)
        return self._passed(plan)

    def _say(self, message: str) -> None:
        log.info(f"ssdtrain: {message}")
        if self.verbose:
            print(f"ssdtrain: {message}", file=sys.stderr)

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
        return leanest_plan(plan, correction=correction)


def leanest_plan(plan: Plan, **changes) -> Plan:
    """`plan`'s measurements planned again with `changes` (those of ``replan``): the fastest plan within its budget,
    else the leanest, keeping the budget it was asked for (for a plan that no longer fits it)."""
    new = replan(plan, budget=None, budget_fraction=None, speed_target=plan.budget, **changes)
    new.budget, new.budget_fraction, new.speed_target = plan.budget, plan.budget_fraction, plan.speed_target
    new.fits = False
    return new
