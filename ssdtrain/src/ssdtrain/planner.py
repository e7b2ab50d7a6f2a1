"""The planner: from one profiled step to a keep / host / NVMe / recompute choice per layer under a memory budget.

A *unit* is a repeated block of the model (found automatically, e.g. GPT-2's ``transformer.h.3``), or the parts
before the first block (``<stem>``: embeddings) and after the last one (``<head>``: final norm, LM head, loss).
For each unit the profile holds its forward time, the bytes of the activations saved inside it (deduplicated by
storage, parameters excluded), which of them are too small to move, the bytes of its inputs (what full recompute
keeps) and its *cheap* submodules: parameter-free submodules (activation functions written as several elementwise
ops, e.g. GPT-2's tanh GELU) whose saved tensors can be recomputed for a fraction of the block's time.

Each unit gets a ``Choice``: recompute ``none`` / ``cheap`` (checkpoint the cheap submodules) / ``full``
(checkpoint the block) and a tier for what it still saves: ``keep`` (GPU), ``host`` (pinned RAM), ``nvme``.
``simulate()`` predicts forward+backward time and the activation peak of a set of choices from the measured link
and disk bandwidths: offloads queue on the device-to-host link behind forward compute and hold GPU memory until
copied; backward prefetches a window of units ahead over the host-to-device link (and the disk), and a unit whose
data is late stalls. ``make_plan()`` starts from keep-everything and greedily applies the change with the least
predicted time per byte of peak saved until the peak fits the budget, then undoes changes that are no longer needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

RECOMPUTE = ("none", "cheap", "full")
BUDGET_MARGIN = 0.03
TIERS = ("keep", "host", "nvme")
_GIB = float(1 << 30)
_MIB = float(1 << 20)


class BudgetError(ValueError):
    """No plan fits the budget; ``minimum`` is the smallest activation peak (bytes) any plan reaches."""

    def __init__(self, message: str, minimum: int):
        super().__init__(message)
        self.minimum = minimum


@dataclass
class UnitProfile:
    """What one profiled step measured for one unit."""

    name: str
    kind: str  # "stem", "block", "head"
    forward_s: float = 0.0
    saved_bytes: int = 0  # unique saved bytes that may move (>= min_bytes)
    small_bytes: int = 0  # saved bytes always kept (below min_bytes)
    input_bytes: int = 0  # bytes of the block's tensor inputs (kept or moved under full recompute)
    cheap_bytes: int = 0  # saved bytes that checkpointing the cheap submodules removes
    cheap_s: float = 0.0  # their forward time (the recompute cost)
    cheap_modules: list[str] = field(default_factory=list)
    tensors: int = 0

    @property
    def backward_s(self) -> float:
        return (1.0 if self.kind == "stem" else 2.0) * self.forward_s  # backward ~ 2x forward FLOPs

    def options(self) -> list[Choice]:
        recomputes = ["none"]
        if self.kind == "block":
            if self.cheap_bytes > 0:
                recomputes.append("cheap")
            recomputes.append("full")
        return [Choice(r, t) for r in recomputes for t in TIERS]


@dataclass(frozen=True)
class Choice:
    recompute: str = "none"
    tier: str = "keep"

    def __post_init__(self):
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
        if self.tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {self.tier!r}")

    def __str__(self) -> str:
        if self.recompute == "none":
            return self.tier
        name = "recompute" if self.recompute == "full" else "cheap"
        return name if self.tier == "keep" else f"{name}+{self.tier}"

    @staticmethod
    def parse(text) -> Choice:
        """'keep', 'host', 'nvme', 'recompute', 'cheap', 'recompute+host', 'cheap+nvme', ... (or a Choice)."""
        if isinstance(text, Choice):
            return text
        parts = [p.strip().lower() for p in str(text).split("+") if p.strip()]
        recompute, tier = "none", "keep"
        for p in parts:
            if p in ("recompute", "full", "checkpoint"):
                recompute = "full"
            elif p in ("cheap", "selective"):
                recompute = "cheap"
            elif p in TIERS:
                tier = p
            else:
                raise ValueError(
                    f"cannot read {text!r} as a choice: use keep, host, nvme, recompute or cheap, "
                    "optionally joined with '+' (e.g. 'recompute+host')"
                )
        return Choice(recompute, tier)


@dataclass
class Bandwidth:
    """Bytes per second of each path (measured when the plan is made)."""

    d2h: float
    h2d: float
    disk_write: float
    disk_read: float
    disk_measured: bool = False


@dataclass
class Prediction:
    seconds: float  # forward + backward
    peak: int  # activation peak on the device (bytes)
    stall_s: float
    host_bytes: int
    nvme_bytes: int
    per_unit_stall: list[float]


def _split(u: UnitProfile, c: Choice) -> tuple[int, int, float, int]:
    """(resident bytes, moved bytes, recompute seconds, transient bytes during its backward)."""
    if c.recompute == "full":
        movable, extra_s = u.input_bytes, u.forward_s
        transient = u.saved_bytes + u.small_bytes
        small = 0
    elif c.recompute == "cheap":
        movable, extra_s = max(0, u.saved_bytes - u.cheap_bytes), u.cheap_s
        transient = u.cheap_bytes
        small = u.small_bytes
    else:
        movable, extra_s, transient, small = u.saved_bytes, 0.0, 0, u.small_bytes
    if c.tier == "keep":
        return movable + small, 0, extra_s, transient
    return small, movable, extra_s, transient


def simulate(
    units: list[UnitProfile], choices: list[Choice], bw: Bandwidth, window_units: int = 2, working_bytes: int = 0
) -> Prediction:
    """Predict forward+backward seconds and the activation peak (bytes) of `choices` (one per unit);
    `working_bytes` (temporaries that are never saved: measured when profiling) is added to the peak."""
    n = len(units)
    parts = [_split(u, c) for u, c in zip(units, choices, strict=True)]
    # Forward: compute back to back; each unit's moved bytes queue on the D2H link and hold GPU memory until sent.
    t, link = 0.0, 0.0
    end = [0.0] * n
    sent = [0.0] * n
    resident = 0
    peak = 0
    disk_free = 0.0
    on_disk = [0.0] * n
    queued = []  # (sent time, bytes) in link order: sent times never decrease
    head = 0
    backlog = 0
    for i, (u, (res, moved, _, _)) in enumerate(zip(units, parts, strict=True)):
        t += u.forward_s
        end[i] = t
        resident += res
        if moved:
            link = max(link, t - u.forward_s) + moved / bw.d2h
            sent[i] = link
            queued.append((link, moved))
            backlog += moved
            if choices[i].tier == "nvme":
                disk_free = max(disk_free, link) + moved / bw.disk_write
                on_disk[i] = disk_free
        # At the end of unit i its own moved bytes are counted whole (conservative: the link took some already).
        while head < len(queued) - (1 if moved else 0) and queued[head][0] <= t:
            backlog -= queued[head][1]
            head += 1
        peak = max(peak, resident + backlog)
        while head < len(queued) and queued[head][0] <= t:
            backlog -= queued[head][1]
            head += 1
    forward_end = t
    # Backward, last unit first: unit i's moved bytes come back over H2D (after the disk read for NVMe), starting
    # once the unit `window_units` later has started its backward; data still on the device is used in place.
    start = [0.0] * n
    h2d_free = forward_end
    disk_read_free = forward_end
    stall = 0.0
    per_unit_stall = [0.0] * n
    live = resident
    for i in range(n - 1, -1, -1):
        res, moved, extra_s, transient = parts[i]
        ready = t
        on_device = 0
        if moved:
            trigger = start[i + window_units] if i + window_units < n else forward_end
            if sent[i] > trigger:  # still being copied out when needed: forwarded, never left the device
                on_device = moved
            else:
                if choices[i].tier == "nvme":
                    disk_read_free = max(disk_read_free, trigger, on_disk[i]) + moved / bw.disk_read
                    source_ready = disk_read_free
                else:
                    source_ready = max(trigger, sent[i])
                h2d_free = max(h2d_free, source_ready) + moved / bw.h2d
                ready = max(t, h2d_free)
                on_device = moved
        wait = ready - t
        stall += wait
        per_unit_stall[i] = wait
        start[i] = ready
        # During unit i's backward: what is still kept, its moved bytes (back), the next units' prefetched bytes,
        # and what its recompute re-creates.
        ahead = sum(parts[k][1] for k in range(max(0, i - window_units), i))
        peak = max(peak, live + on_device + ahead + transient)
        t = ready + extra_s + units[i].backward_s
        live -= res
    host = sum(p[1] for p, c in zip(parts, choices, strict=True) if c.tier == "host")
    nvme = sum(p[1] for p, c in zip(parts, choices, strict=True) if c.tier == "nvme")
    return Prediction(t, int(peak + working_bytes), stall, host, nvme, per_unit_stall)


@dataclass
class Plan:
    """Per-unit choices with the measurements they came from; ``print(plan)`` explains it.

    Override a unit with ``plan.override("transformer.h.0", "keep")`` (or ``offload(..., overrides=...)``); the
    prediction is recomputed.
    """

    model: str
    units: list[UnitProfile]
    choices: list[Choice]
    bandwidth: Bandwidth
    budget: int | None
    host_limit: int
    nvme_limit: int
    block_container: str
    window_units: int = 2
    working_bytes: int = 0  # temporaries on top of saved activations (measured while profiling)
    order_bounds: list[int] = field(default_factory=list)  # compiled models: pack index where each unit starts
    speed_target: int | None = None  # budget=None: the free device memory the plan had to fit
    calibrations: list[str] = field(default_factory=list)  # measured peaks that corrected working_bytes
    overridden: set[str] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)

    @property
    def prediction(self) -> Prediction:
        return simulate(self.units, self.choices, self.bandwidth, self.window_units, self.working_bytes)

    @property
    def keep_prediction(self) -> Prediction:
        return simulate(self.units, [Choice()] * len(self.units), self.bandwidth, self.window_units, self.working_bytes)

    def replan(self, budget=None, **limits) -> Plan:
        """The same measurements planned for another budget (bytes or "20GiB"; ``host_limit=``/``nvme_limit=``)."""
        from .io import parse_size

        return replan(self, budget=None if budget is None else parse_size(budget), **limits)

    def choice(self, name: str) -> Choice:
        return self.choices[self._index(name)]

    def as_dict(self) -> dict[str, str]:
        return {u.name: str(c) for u, c in zip(self.units, self.choices, strict=True)}

    def override(self, name: str, choice) -> Plan:
        i = self._index(name)
        c = Choice.parse(choice)
        if c.recompute != "none" and self.units[i].kind != "block":
            raise ValueError(f"{name} is not a repeated block: only blocks can be recomputed (keep, host or nvme)")
        self.choices[i] = c
        self.overridden.add(name)
        return self

    def _index(self, name: str) -> int:
        for i, u in enumerate(self.units):
            if u.name == name:
                return i
        raise KeyError(f"no unit {name!r} in this plan; units: {', '.join(u.name for u in self.units)}")

    def __str__(self) -> str:
        p, k = self.prediction, self.keep_prediction
        bw = self.bandwidth
        lines = [
            f"ssdtrain plan for {self.model}: {len(self.units)} units ({self.block_container or 'no repeated blocks'}),"
            f" budget {format_bytes(self.budget) if self.budget is not None else 'none (fastest plan that fits)'}",
            f"  measured: forward {sum(u.forward_s for u in self.units) * 1e3:.1f} ms; working memory "
            f"{format_bytes(self.working_bytes)} (never-saved temporaries, in every peak below); link D2H "
            f"{bw.d2h / 1e9:.1f} GB/s, H2D {bw.h2d / 1e9:.1f} GB/s; disk write {bw.disk_write / 1e9:.2f} GB/s, "
            f"read {bw.disk_read / 1e9:.2f} GB/s ({'measured' if bw.disk_measured else 'assumed, not measured'})",
            f"  {'unit':<28} {'fwd ms':>7} {'saved MiB':>10} {'cheap ms/MiB':>13} {'choice':>15} {'on GPU MiB':>11}"
            f" {'moved MiB':>10} {'stall ms':>9}",
        ]
        for u, c, s in zip(self.units, self.choices, p.per_unit_stall, strict=True):
            res, moved, _, _ = _split(u, c)
            mark = " *" if u.name in self.overridden else ""
            cheap = f"{u.cheap_s * 1e3:.2f}/{u.cheap_bytes / _MIB:.0f}" if u.cheap_bytes else "-"
            lines.append(
                f"  {u.name:<28} {u.forward_s * 1e3:7.2f} {(u.saved_bytes + u.small_bytes) / _MIB:10.1f}"
                f" {cheap:>13} {str(c) + mark:>15} {res / _MIB:11.1f} {moved / _MIB:10.1f} {s * 1e3:9.2f}"
            )
        lines.append(
            f"  predicted forward+backward {p.seconds * 1e3:.1f} ms (keep everything: "
            f"{k.seconds * 1e3:.1f} ms, {p.seconds / k.seconds:.2f}x), activation peak {format_bytes(p.peak)}"
            " (keep everything: "
            f"{format_bytes(k.peak)}), stalls {p.stall_s * 1e3:.1f} ms; host RAM {format_bytes(p.host_bytes)} "
            f"of {format_bytes(self.host_limit)}, NVMe {format_bytes(p.nvme_bytes)}"
        )
        cheap = sorted({m for u in self.units for m in u.cheap_modules})
        if cheap:
            lines.append(
                f"  cheap = recompute the parameter-free submodules {', '.join(cheap[:4])}"
                f"{' ...' if len(cheap) > 4 else ''}; recompute = checkpoint the whole block;"
                " * = overridden"
            )
        lines += [f"  note: {n}" for n in self.notes]
        lines += [f"  calibrated: {c}" for c in self.calibrations]
        return "\n".join(lines)


def format_bytes(n) -> str:
    if n is None:
        return "-"
    return f"{n / _GIB:.2f} GiB" if n >= (1 << 30) else f"{n / _MIB:.1f} MiB"


def _feasible(pred: Prediction, host_limit: int, nvme_limit: int) -> bool:
    return pred.host_bytes <= host_limit and pred.nvme_bytes <= nvme_limit


def _search(units, choices, bw, target, fixed, host_limit, nvme_limit, allow_nvme, window, by_peak=False, working=0):
    """Greedy: the change with the least added time per byte of peak removed, until the peak fits `target`
    (`by_peak`: the change that lowers the peak most, for the leanest plan)."""
    current = simulate(units, choices, bw, window, working)
    while current.peak > target:
        best = None
        for i, u in enumerate(units):
            if u.name in fixed:
                continue
            for c in u.options():
                if c == choices[i] or (c.tier == "nvme" and not allow_nvme):
                    continue
                trial = choices[:i] + [c] + choices[i + 1 :]
                pred = simulate(units, trial, bw, window, working)
                if pred.peak >= current.peak or not _feasible(pred, host_limit, nvme_limit):
                    continue
                # Least time per byte; a change that reaches the target outright is judged by its time alone.
                cost = max(pred.seconds - current.seconds, 0.0) + 1e-9
                gain = current.peak - pred.peak
                score = cost if pred.peak <= target else cost / gain * (1 << 30)
                key = (pred.peak, pred.seconds) if by_peak else (pred.peak > target, score, pred.seconds)
                if best is None or key < best[0]:
                    best = (key, i, c, pred)
        if best is None:
            return choices, current, False
        _, i, c, current = best
        choices = choices[:i] + [c] + choices[i + 1 :]
    return choices, current, True


def _relax(units, choices, bw, target, fixed, host_limit, nvme_limit, allow_nvme, window, working=0):
    """Undo what is no longer needed: any single change that is faster and still fits, best first."""
    current = simulate(units, choices, bw, window, working)
    improved = True
    while improved:
        improved = False
        best = None
        for i, u in enumerate(units):
            if u.name in fixed:
                continue
            for c in u.options():
                if c == choices[i] or (c.tier == "nvme" and not allow_nvme):
                    continue
                trial = choices[:i] + [c] + choices[i + 1 :]
                pred = simulate(units, trial, bw, window, working)
                if (
                    pred.peak <= target
                    and pred.seconds < current.seconds - 1e-7
                    and _feasible(pred, host_limit, nvme_limit)
                ):
                    if best is None or pred.seconds < best[2].seconds:
                        best = (i, c, pred)
        if best is not None:
            i, c, current = best
            choices = choices[:i] + [c] + choices[i + 1 :]
            improved = True
    return choices


def make_plan(
    model_name: str,
    units: list[UnitProfile],
    bw: Bandwidth,
    budget: int | None,
    *,
    host_limit: int,
    nvme_limit: int,
    block_container: str,
    overrides: dict | None = None,
    window_units: int = 2,
    speed_target: int | None = None,
    working_bytes: int = 0,
) -> Plan:
    """The fastest plan whose predicted activation peak fits `budget` (None: `speed_target`, else keep all)."""
    overrides = {k: Choice.parse(v) for k, v in (overrides or {}).items()}
    names = {u.name for u in units}
    unknown = set(overrides) - names
    if unknown:
        raise KeyError(f"overrides name unknown units {sorted(unknown)}; units: {', '.join(u.name for u in units)}")
    choices = [overrides.get(u.name, Choice()) for u in units]
    for u, c in zip(units, choices, strict=True):
        if c.recompute != "none" and u.kind != "block":
            raise ValueError(f"override {u.name}={c}: only repeated blocks can be recomputed")
    # The budget is planned with a margin (BUDGET_MARGIN): measured peaks landed within a few percent of the
    # prediction on an H200 (benchmarks/RESULTS.md), on either side.
    target = (
        budget * (1 - BUDGET_MARGIN) if budget is not None else (speed_target if speed_target is not None else math.inf)
    )
    fixed = set(overrides)
    allow_nvme = nvme_limit > 0
    w = working_bytes
    plan_choices, pred, ok = _search(
        units, choices, bw, target, fixed, host_limit, nvme_limit, allow_nvme, window_units, working=w
    )
    if not ok:  # the cheapest-first path got stuck: try the leanest-first one
        plan_choices, pred, ok = _search(
            units, choices, bw, target, fixed, host_limit, nvme_limit, allow_nvme, window_units, by_peak=True, working=w
        )
    if not ok:
        # The least memory any plan reaches (the leanest-first search towards 0 bytes), for the error message.
        _, low, _ = _search(
            units, choices, bw, 0, fixed, host_limit, nvme_limit, allow_nvme, window_units, by_peak=True, working=w
        )
        if budget is not None:
            minimum = int(math.ceil(low.peak / (1 - BUDGET_MARGIN)))
            raise BudgetError(
                f"ssdtrain: no plan fits the activation budget {format_bytes(budget)}; the smallest predicted peak "
                f"is {format_bytes(low.peak)}, so the smallest budget is {minimum} bytes ({format_bytes(minimum)}, "
                f"with the {BUDGET_MARGIN:.0%} margin): pass budget >= that, give more host RAM "
                f"(host_memory=, now {format_bytes(host_limit)}) or an NVMe directory, or reduce the batch",
                minimum,
            )
        plan_choices = _search(
            units, choices, bw, 0, fixed, host_limit, nvme_limit, allow_nvme, window_units, by_peak=True, working=w
        )[0]
    plan_choices = _relax(
        units, plan_choices, bw, target, fixed, host_limit, nvme_limit, allow_nvme, window_units, working=w
    )
    plan = Plan(
        model_name,
        units,
        plan_choices,
        bw,
        budget,
        host_limit,
        nvme_limit,
        block_container,
        window_units,
        working_bytes=w,
        overridden=set(overrides),
        speed_target=speed_target,
    )
    if budget is None and speed_target is not None and not ok:
        plan.notes.append(
            f"even the leanest plan ({format_bytes(plan.prediction.peak)}) exceeds the free device "
            f"memory estimate ({format_bytes(speed_target)}); expect an out-of-memory error"
        )
    return plan


def replan(plan: Plan, **changes) -> Plan:
    """The same profile planned again with other limits (budget=, host_limit=, nvme_limit=, working_bytes=)."""
    fields = {
        "budget": plan.budget,
        "host_limit": plan.host_limit,
        "nvme_limit": plan.nvme_limit,
        "working_bytes": plan.working_bytes,
    }
    fields.update(changes)
    overrides = {u.name: c for u, c in zip(plan.units, plan.choices, strict=True) if u.name in plan.overridden}
    new = make_plan(
        plan.model,
        plan.units,
        plan.bandwidth,
        fields["budget"],
        host_limit=fields["host_limit"],
        nvme_limit=fields["nvme_limit"],
        block_container=plan.block_container,
        overrides=overrides,
        window_units=plan.window_units,
        working_bytes=fields["working_bytes"],
        speed_target=plan.speed_target,
    )
    new.calibrations = plan.calibrations
    new.notes = list(plan.notes)
    new.order_bounds = list(plan.order_bounds)
    return new


__all__ = ["Bandwidth", "BudgetError", "Choice", "Plan", "Prediction", "UnitProfile", "make_plan", "replan", "simulate"]
