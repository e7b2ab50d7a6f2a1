"""The planner: from one profiled step to a keep / host / NVMe / recompute choice per layer under a memory budget.

A *unit* is a repeated block of the model (found automatically, e.g. GPT-2's ``transformer.h.3``), or the parts
before the first block (``<stem>``: embeddings) and after the last one (``<head>``: final norm, LM head, loss).
For each unit the profile holds its forward time, the bytes of the activations saved inside it (deduplicated by
storage, parameters excluded), which of them are too small to move, the bytes of its inputs (what full recompute
keeps) and its *cheap* submodules: elementwise ones (activation functions written as several elementwise ops, e.g.
GPT-2's tanh GELU; normalisation layers) whose saved tensors can be recomputed for a fraction of the block's time.

Each unit gets a ``Choice``: recompute ``none`` / ``cheap`` (checkpoint the cheap submodules) / ``derive`` (saved
results of elementwise ops made again in backward from the block's other saved tensors: ``ssdtrain.derive``) /
``selective``
(checkpoint the block keeping the outputs of its matrix products and attention: only norms, activations, elementwise
code and casts run again) / ``full`` (checkpoint the block) and a tier for what it still saves (``ssdtrain.tiers``:
``keep`` on the GPU, ``host`` pinned RAM, ``nvme``). The planner sees a tier as a ``TierSpec``: its capacity and the
rates of the stage behind the device link (the disk, for NVMe). ``prediction.simulate()`` predicts forward+backward
time and the activation peak of a set of choices. ``make_plan()`` starts from keep-everything and greedily applies
the change with the least predicted time per byte of peak saved until the peak fits the budget, then undoes changes
that are no longer needed.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, replace

from .entries import OffloadWarning
from .prediction import (
    RECOMPUTE,
    Bandwidth,
    Choice,
    Prediction,
    UnitProfile,
    simulate,
    split_choice,
    window_bytes,
)
from .search import _fit, _lean_seed, _leanest, _relax, _search  # noqa: F401 (_lean_seed, _search: tests)
from .tiers import TierSpec

__all__ = [
    "RECOMPUTE",
    "Bandwidth",
    "BudgetError",
    "Choice",
    "Plan",
    "Prediction",
    "UnitProfile",
    "format_bytes",
    "make_plan",
    "replan",
    "scaled_units",
    "simulate",
    "window_bytes",
]

# The budget is planned with a margin for the prediction's error. Measured peaks: within 0.06 GiB (0.6%) of the
# prediction in every plan of the eager Llama-style suite on an H100 (fourteenth to sixteenth sessions), 0.93-0.97 of
# the budget under a 3% margin over three model families (the budget suite); and every checked step that measures
# a peak above its prediction corrects the plan (``planning.Calibrator``). 3% of that suite's 10.5 GiB budget is
# 0.31 GiB, most of what one more moved block saves (0.38 GiB), and each moved block costs time.
BUDGET_MARGIN = 0.01
# Disk rates the planner assumes where none was measured (a plan made by make_plan() with nvme_limit= alone).
ASSUMED_DISK_RATE = 2e9
_GIB = float(1 << 30)
_MIB = float(1 << 20)


def _may_recompute(u: UnitProfile, c: Choice) -> bool:
    """Whether unit `u` can take choice `c`: any recompute in a block, `derive` in the head, none elsewhere."""
    return c.recompute == "none" or u.kind == "block" or (u.kind == "head" and c.recompute == "derive")


class BudgetError(ValueError):
    """No plan fits the budget; ``minimum`` is the smallest activation peak (bytes) any plan reaches."""

    def __init__(self, message: str, minimum: int):
        super().__init__(message)
        self.minimum = minimum


@dataclass
class _Model:
    """Everything a prediction depends on besides the choices (shared by the search and the plan)."""

    units: list[UnitProfile]
    bw: Bandwidth
    window: int
    working: int
    tiers: dict[str, TierSpec]
    grads: bool
    forward_working: int | None = None
    block_working: int | None = None
    correction: int = 0
    async_copies: bool = True
    held_grads: bool = False  # some steps start with every gradient held (accumulation): the peak covers both
    move_overhead_s: float = 0.0  # measured cost of each moved unit beyond its copies' link time
    hold_head: bool = False  # no block prefetched during the head's backward
    clear_casts: bool = True  # autocast's cache is cleared after each recomputed block (the session's default)
    inflight_bytes: int = 0  # copies out in flight in forward before compute waits for them, when above the window
    drain_at_head: bool = False  # compute waits for every copy out before the head's forward
    host_forward_s: float = 0.0  # the host's time to issue a forward without moves (0: unknown; see simulate)

    def __call__(self, choices) -> Prediction:
        pred = self._run(choices, self.grads, False)
        if self.held_grads:
            held = self._run(choices, False, True)
            if held.peak > pred.peak:
                pred = replace(pred, peak=held.peak, peak_at=held.peak_at, peak_parts=held.peak_parts)
        return pred

    def _run(self, choices, grads: bool, held: bool) -> Prediction:
        return simulate(
            self.units,
            choices,
            self.bw,
            self.window,
            self.working,
            self.tiers,
            grads,
            forward_working=self.forward_working,
            block_working=self.block_working,
            correction=self.correction,
            async_copies=self.async_copies,
            held_grads=held,
            move_overhead_s=self.move_overhead_s,
            hold_head=self.hold_head,
            clear_casts=self.clear_casts,
            inflight_bytes=self.inflight_bytes,
            drain_at_head=self.drain_at_head,
            host_forward_s=self.host_forward_s,
        )

    def feasible(self, pred: Prediction) -> bool:
        return all(b <= self.tiers[name].capacity for name, b in pred.moved.items())

    def tier_names(self) -> tuple[str, ...]:
        return ("keep",) + tuple(name for name, spec in self.tiers.items() if spec.capacity > 0)


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
    tiers: dict[str, TierSpec]
    block_container: str
    window_units: int = 2
    working_bytes: int = 0  # never-saved temporaries of the head's backward (measured while profiling)
    forward_working: int | None = None  # never-saved temporaries of the forward (None: working_bytes)
    block_working: int | None = None  # never-saved temporaries of a block's backward (None: working_bytes)
    correction: int = 0  # added to every predicted peak by calibration (measured peak - predicted)
    async_copies: bool = True  # copies out run behind compute (a GPU); False: done when the cache returns (CPU)
    grads: bool = False  # steps start without gradients: backward allocates them (counted in the peak)
    held_grads: bool = False  # other steps start with them all held (gradient accumulation): counted throughout
    order_bounds: list[int] = field(default_factory=list)  # compiled models: pack index where each unit starts
    # The blocks' forwards are torch.compile'd (regional compilation): recomputing one is recomputing it whole,
    # where the compiler's own activation_memory_budget recomputes single ops inside it (the plan text says so).
    compiled_blocks: bool = False
    speed_target: int | None = None  # budget=None: the free device memory the plan had to fit
    budget_fraction: float | None = None  # the budget was given as this fraction of keep's predicted peak
    calibrations: list[str] = field(default_factory=list)  # measured peaks that set the correction
    time_scale: float = 1.0  # the units' times were scaled by this (a measured forward faster than profiled)
    link_scale: float = 1.0  # the link rates were scaled by this (measured steps slower than their moves predicted)
    timing_calibrations: int = 0  # lines of `calibrations` that rescaled times or link rates (not peaks)
    # The unit times were checked against a measured forward (rescaled, or found right): until then a step's late
    # copies or its time say nothing about the link, as the plan may have hidden copies behind compute that its
    # profiled times overstated.
    times_checked: bool = False
    move_overhead_s: float = 0.0  # seconds charged per moved unit beyond its copies' link time (calibration)
    hold_head: bool = False  # the head's backward runs with no block prefetched (only where the budget needs it)
    # Autocast's weight casts of a recomputed block are freed when it returns (the session clears the cache there,
    # unless a parameter of a block is used elsewhere too): False counts them until the forward ends.
    clear_casts: bool = True
    # Copies out the cache lets the host leave in flight in forward before it waits (0: the window): more where the
    # step's peak is elsewhere (see ``ahead_bytes``).
    inflight_bytes: int = 0
    # The compute stream waits for the copies out still in flight when the last block's forward returns, so their
    # device bytes are free before the head makes its logits (the session does on a GPU, where block hooks run).
    drain_at_head: bool = False
    # The host's own time to issue a forward without moves (calibration: a timed forward's host time less its moves'
    # host work; 0 until measured). With it a move's host work costs the device time only where the host sets the
    # pace (``simulate``'s two clocks).
    host_forward_s: float = 0.0
    fits: bool = True  # False: budget=None and even the leanest plan is predicted above the free device memory
    # Saved tensors below this stayed on the device, unmeasured, in the profile (None: a plan not from a session).
    min_bytes: int | None = None
    overridden: set[str] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)

    def _model(self, grads: bool | None = None, held: bool | None = None) -> _Model:
        g = self.grads if grads is None else grads
        h = self.held_grads if held is None else held
        return _Model(
            self.units,
            self.bandwidth,
            self.window_units,
            self.working_bytes,
            self.tiers,
            g,
            self.forward_working,
            self.block_working,
            self.correction,
            self.async_copies,
            h,
            self.move_overhead_s,
            self.hold_head,
            self.clear_casts,
            self.inflight_bytes,
            self.drain_at_head,
            self.host_forward_s,
        )

    @property
    def window_bytes(self) -> int:
        """Device bytes the cache gives moved activations: prefetched ahead in backward, in flight in forward."""
        return window_bytes(self.units, self.choices, self.window_units)

    @property
    def prediction(self) -> Prediction:
        return self._model()(self.choices)

    @property
    def keep_prediction(self) -> Prediction:
        return self._model()([Choice()] * len(self.units))

    def predict(self, grads: bool, held: bool = False) -> Prediction:
        """The prediction for a step that starts without gradients (`grads`: backward allocates them), with
        every gradient held and counted (`held`: an accumulation step after one that set them to None), or with
        them outside the count (neither)."""
        return self._model(grads and not held, held)(self.choices)

    @property
    def host_limit(self) -> int:
        return self.tiers["host"].capacity if "host" in self.tiers else 0

    @property
    def nvme_limit(self) -> int:
        return self.tiers["nvme"].capacity if "nvme" in self.tiers else 0

    def replan(self, budget: int | float | str | None = None, **limits: int | str | None) -> Plan:
        """The same measurements planned for another budget (bytes, "20GiB", or a float in (0, 1]: that fraction
        of keep's predicted peak); ``host_limit=`` / ``nvme_limit=`` change the tiers' capacities."""
        from .io import parse_size

        if isinstance(budget, float) and 0 < budget <= 1:
            limits["budget_fraction"] = budget
            budget = None
        return replan(self, budget=None if budget is None else parse_size(budget), **limits)

    def with_window(self, window_units: int) -> Plan:
        """A copy of this plan whose backward prefetches `window_units` units ahead (``offload()``'s
        ``prefetch_units=``): the same choices, their prediction made again for that window. The window says how far
        ahead moved units come back, not what is moved, so no choice changes; the peak may (more units back early)."""
        new = replace(
            self,
            window_units=window_units,
            choices=list(self.choices),
            overridden=set(self.overridden),
            calibrations=list(self.calibrations),
            notes=list(self.notes),
            order_bounds=list(self.order_bounds),
        )
        new.inflight_bytes = ahead_bytes(new._model(), new.choices, window_units)
        new.notes.append(f"prefetch window {window_units} units ahead (the plan was made for {self.window_units})")
        return new

    def choice(self, name: str) -> Choice:
        return self.choices[self._index(name)]

    def as_dict(self) -> dict[str, str]:
        return {u.name: str(c) for u, c in zip(self.units, self.choices, strict=True)}

    def override(self, name: str, choice: str | Choice) -> Plan:
        i = self._index(name)
        c = Choice.parse(choice)
        if not _may_recompute(self.units[i], c):
            raise ValueError(
                f"{name} is not a repeated block: only blocks can be recomputed (keep, host or nvme; the head may "
                "also be 'derive')"
            )
        self.choices[i] = c
        self.overridden.add(name)
        self.inflight_bytes = ahead_bytes(self._model(), self.choices, self.window_units)
        peak = self.prediction.peak
        if self.budget is not None and peak > self.budget:
            # The plan is used as the user now has it; running it past its budget without a word would break the
            # budget's promise.
            warnings.warn(
                f"ssdtrain: plan.override({name!r}, {str(c)!r}): the plan's predicted activation peak "
                f"{format_bytes(peak)} is now above its budget {format_bytes(self.budget)}; make another unit leaner "
                "(plan.override) or plan again (plan.replan(budget=...))",
                OffloadWarning,
                stacklevel=2,
            )
        return self

    def _index(self, name: str) -> int:
        for i, u in enumerate(self.units):
            if u.name == name:
                return i
        raise KeyError(f"no unit {name!r} in this plan; units: {', '.join(u.name for u in self.units)}")

    def __str__(self) -> str:
        p, k = self.prediction, self.keep_prediction
        bw = self.bandwidth
        if self.budget is None:
            budget = "none (fastest plan that fits)"
        elif self.budget_fraction is not None:
            budget = f"{format_bytes(self.budget)} ({self.budget_fraction:g} x keep's predicted peak)"
        else:
            budget = format_bytes(self.budget)
        stages = []
        for spec in self.tiers.values():
            if spec.write_rate and spec.capacity > 0:
                how = "measured" if spec.measured else "assumed, not measured"
                stages.append(
                    f"{spec.name} write {spec.write_rate / 1e9:.2f} GB/s, read {spec.read_rate / 1e9:.2f} GB/s ({how})"
                )
        lines = [
            f"ssdtrain plan for {self.model}: {len(self.units)} units ({self.block_container or 'no repeated blocks'}),"
            f" budget {budget}",
            f"  measured: forward {sum(u.forward_s for u in self.units) * 1e3:.1f} ms; working memory (never-saved "
            f"temporaries) forward {format_bytes(_or(self.forward_working, self.working_bytes))}, head's backward "
            f"{format_bytes(self.working_bytes)}, a block's backward "
            f"{format_bytes(_or(self.block_working, self.working_bytes))}"
            + (f"; calibration {self.correction / _GIB:+.2f} GiB" if self.correction else "")
            + (
                f"; gradients {format_bytes(sum(u.grad_bytes for u in self.units))} ("
                + ("allocated by backward" if self.grads else "")
                + (" / " if self.grads and self.held_grads else "")
                + ("held through accumulation steps" if self.held_grads else "")
                + ")"
                if self.grads or self.held_grads
                else ""
            )
            + f"; link D2H {bw.d2h / 1e9:.1f} GB/s, H2D {bw.h2d / 1e9:.1f} GB/s"
            + (f" ({self.link_scale:g}x the measured rates)" if self.link_scale != 1.0 else "")
            + (f"; {self.move_overhead_s * 1e3:.2f} ms per moved unit (measured)" if self.move_overhead_s else "")
            + (
                f"; the host issues a forward without moves in {self.host_forward_s * 1e3:.1f} ms"
                if self.host_forward_s
                else ""
            )
            + (f"; {'; '.join(stages)}" if stages else ""),
            f"  {'unit':<28} {'fwd ms':>7} {'saved MiB':>10} {'cheap ms/MiB':>13} {'derive ms/MiB':>14}"
            f" {'select ms/MiB':>14}"
            f" {'choice':>16} {'on GPU MiB':>11} {'moved MiB':>10} {'stall ms':>9}",
        ]
        for u, c, s in zip(self.units, self.choices, p.per_unit_stall, strict=True):
            res, moved, _, _ = split_choice(u, c)
            mark = " *" if u.name in self.overridden else ""
            cheap = f"{u.cheap_s * 1e3:.2f}/{u.cheap_bytes / _MIB:.0f}" if u.cheap_bytes else "-"
            sel = f"{u.selective_s * 1e3:.2f}/{u.selective_bytes / _MIB:.0f}" if u.selective_s else "-"
            der = f"{u.derive_s * 1e3:.2f}/{u.derive_bytes / _MIB:.0f}" if u.derive_bytes else "-"
            lines.append(
                f"  {u.name:<28} {u.forward_s * 1e3:7.2f} {(u.saved_bytes + u.small_bytes) / _MIB:10.1f}"
                f" {cheap:>13} {der:>14} {sel:>14} {str(c) + mark:>16} {res / _MIB:11.1f} {moved / _MIB:10.1f}"
                f" {s * 1e3:9.2f}"
            )
        capacity = ", ".join(
            f"{name} {format_bytes(p.moved.get(name, 0))} of {format_bytes(spec.capacity)}"
            for name, spec in self.tiers.items()
        )
        lines.append(
            f"  predicted forward+backward {p.seconds * 1e3:.1f} ms (keep everything: "
            f"{k.seconds * 1e3:.1f} ms, {p.seconds / k.seconds:.2f}x), activation peak {format_bytes(p.peak)}"
            " (keep everything: "
            f"{format_bytes(k.peak)}), stalls {p.stall_s * 1e3:.1f} ms; moved per step: {capacity or 'nothing'}"
        )
        if self.hold_head:
            lines.append(
                "  the head's backward runs with no block prefetched (the budget needs it): the blocks' copies back "
                "start when it is done, the first block's on demand"
            )
        if p.peak_parts:
            what = ", ".join(f"{name} {format_bytes(b)}" for name, b in p.peak_parts.items())
            lines.append(f"  the peak is at the {p.peak_at}: {what}")
        if self.inflight_bytes > self.window_bytes:
            lines.append(
                f"  copies out in flight in forward: up to {format_bytes(self.inflight_bytes)} before compute waits "
                f"(the window is {format_bytes(self.window_bytes)}; the peak is elsewhere)"
            )
        cheap = sorted({m for u in self.units for m in u.cheap_modules})
        legend = []
        if cheap:
            more = " ..." if len(cheap) > 4 else ""
            legend.append(f"cheap = recompute the elementwise submodules {', '.join(cheap[:4])}{more}")
        if any(u.derive_bytes for u in self.units):
            legend.append(
                "derive = make the saved results of norms, activations and casts again in backward from the block's "
                "other saved tensors (ms and MiB in 'derive')"
            )
        if any(u.selective_s for u in self.units):
            legend.append(
                "selective = keep what matrix products and attention output (MiB in 'select'), recompute the rest "
                "(ms in 'select')"
            )
        if legend:
            lines.append(f"  {'; '.join(legend)}; recompute = checkpoint the whole block; * = overridden")
        lines += [f"  note: {n}" for n in self.notes]
        pairs = zip(self.units, self.choices, strict=True)
        whole = sum(1 for u, c in pairs if u.kind == "block" and c.recompute == "full")
        if self.compiled_blocks and whole:
            lines.append(
                f"  note: {whole} compiled block{'s are' if whole > 1 else ' is'} recomputed whole; compiling the "
                "blocks under a lower torch._functorch.config.activation_memory_budget lets the compiler recompute "
                "single ops inside them instead, at less cost per byte freed (README: ssdtrain with torch.compile)"
            )
        lines += [f"  calibrated: {c}" for c in self.calibrations]
        return "\n".join(lines)


def _or(value, default):
    return default if value is None else value


def format_bytes(n) -> str:
    if n is None:
        return "-"
    return f"{n / _GIB:.2f} GiB" if n >= (1 << 30) else f"{n / _MIB:.1f} MiB"


def make_tiers(host_limit: int = 0, nvme_limit: int = 0) -> dict[str, TierSpec]:
    """Tier specs from capacities alone (NVMe at an assumed disk rate: the plan text says so)."""
    return {
        "host": TierSpec("host", int(host_limit)),
        "nvme": TierSpec("nvme", int(nvme_limit), ASSUMED_DISK_RATE, ASSUMED_DISK_RATE, measured=False),
    }


# Units of copies out the host may leave in flight in forward, where the peak has room (see ``ahead_bytes``).
AHEAD_UNITS = 8


def ahead_bytes(model: _Model, choices: list[Choice], window_units: int) -> int:
    """The most bytes of copies out in flight in forward (up to ``AHEAD_UNITS`` x the largest moved unit) that leave
    the predicted peak where it is: 0 where only the window fits. The cache makes compute wait for copies out
    beyond its bound; with the window alone (two block inputs of 64 MiB on a Llama model) that held the host within
    two blocks of the device, so any pause of the host's (a collection, a hook's work) left the device idle. Where
    the step peaks elsewhere (the head's backward, as it usually does), more copies in flight in forward cost
    nothing."""
    biggest = max((split_choice(u, c)[1] for u, c in zip(model.units, choices, strict=True)), default=0)
    if not biggest or not model.async_copies:
        return 0
    base = replace(model, inflight_bytes=0)(choices).peak  # (the window alone, whatever the plan had before)
    for k in range(AHEAD_UNITS, window_units, -1):
        if replace(model, inflight_bytes=k * biggest)(choices).peak <= base:
            return k * biggest
    return 0


def make_plan(
    model_name: str,
    units: list[UnitProfile],
    bw: Bandwidth,
    budget: int | None,
    *,
    tiers: dict[str, TierSpec] | None = None,
    host_limit: int | None = None,
    nvme_limit: int | None = None,
    block_container: str,
    overrides: dict | None = None,
    window_units: int = 2,
    speed_target: int | None = None,
    working_bytes: int = 0,
    grads: bool = False,
    budget_fraction: float | None = None,
    forward_working: int | None = None,
    block_working: int | None = None,
    correction: int = 0,
    async_copies: bool = True,
    held_grads: bool = False,
    move_overhead_s: float = 0.0,
    clear_casts: bool = True,
    drain_at_head: bool = False,
    host_forward_s: float = 0.0,
) -> Plan:
    """The fastest plan whose predicted activation peak fits `budget` (None: `speed_target`, else keep all).

    `tiers` are the offload tiers' specs (``ssdtrain.tiers``); `host_limit=` / `nvme_limit=` instead build them
    from capacities. With `budget_fraction` the budget is that fraction of keep's predicted peak. Working memory
    (never-saved temporaries): `working_bytes` during the head's backward, `forward_working` in forward,
    `block_working` during a block's backward (None: `working_bytes`); `correction` is added to every peak.
    `grads`: steps start without gradients (backward allocates them); `held_grads`: other steps start with them
    all (gradient accumulation), so they count at every point of those steps. `move_overhead_s`: seconds each
    moved unit costs beyond its copies' link time (set by calibration). `clear_casts`: autocast's weight casts of a
    recomputed block are freed when its forward returns (the session clears the cache there), else held until the
    forward ends. `drain_at_head`: compute waits for every copy out as the last block's forward returns (see
    ``simulate``). `host_forward_s`: the host's time to issue a forward without moves (see ``simulate``)."""
    if tiers is None:
        tiers = make_tiers(host_limit or 0, nvme_limit or 0)
    else:
        tiers = dict(tiers)
        if host_limit is not None and "host" in tiers:
            tiers["host"] = replace(tiers["host"], capacity=int(host_limit))
        if nvme_limit is not None and "nvme" in tiers:
            tiers["nvme"] = replace(tiers["nvme"], capacity=int(nvme_limit))
    overrides = {k: Choice.parse(v) for k, v in (overrides or {}).items()}
    names = {u.name for u in units}
    unknown = set(overrides) - names
    if unknown:
        raise KeyError(f"overrides name unknown units {sorted(unknown)}; units: {', '.join(u.name for u in units)}")
    choices = [overrides.get(u.name, Choice()) for u in units]
    for u, c in zip(units, choices, strict=True):
        if not _may_recompute(u, c):
            raise ValueError(f"override {u.name}={c}: only repeated blocks can be recomputed (the head: 'derive' too)")
    nothing = [
        u.name
        for u, c in zip(units, choices, strict=True)
        if c.recompute == "derive" and not u.derive_bytes and not u.derive_s
    ]
    if nothing:
        warnings.warn(
            f"ssdtrain: overrides plan {', '.join(nothing)} 'derive', but the profile found no saved tensor there "
            "that elementwise ops make from the block's other saved tensors: those blocks keep everything (use "
            "'recompute' or a tier to save memory there)",
            stacklevel=3,
        )
    nothing = [u.name for u, c in zip(units, choices, strict=True) if c.recompute == "cheap" and not u.cheap_modules]
    if nothing:
        warnings.warn(
            f"ssdtrain: overrides plan {', '.join(nothing)} 'cheap', but the profile found no elementwise submodule "
            "there (an activation function or normalisation layer, with no matrix product) to recompute: those "
            "blocks keep everything (use 'recompute' or a tier to save memory there)",
            stacklevel=3,
        )
    model = _Model(
        units,
        bw,
        window_units,
        working_bytes,
        tiers,
        grads,
        forward_working,
        block_working,
        correction,
        async_copies,
        held_grads,
        move_overhead_s,
        clear_casts=clear_casts,
        drain_at_head=drain_at_head,
        host_forward_s=host_forward_s,
    )
    if budget_fraction is not None and budget is None:  # resolved once: replans keep the bytes
        budget = int(model([Choice()] * len(units)).peak * budget_fraction)
    # The budget is planned with a margin (BUDGET_MARGIN, which says why it is what it is).
    target = (
        budget * (1 - BUDGET_MARGIN) if budget is not None else (speed_target if speed_target is not None else math.inf)
    )
    fixed = set(overrides)
    plan_choices, ok = _fit(model, choices, target, fixed)
    held = replace(model, hold_head=True)
    if not ok:  # below every plan that prefetches during the head's backward: one that waits for it may fit
        plan_choices, ok = _fit(held, choices, target, fixed)
        model = held if ok else model
    if not ok:
        # The least memory any plan reaches, for the error message (or, with no budget, the plan used).
        (lean, low), (held_lean, held_low) = _leanest(model, choices, fixed), _leanest(held, choices, fixed)
        if held_low.peak < low.peak:
            model, lean, low = held, held_lean, held_low
        if budget is not None:
            minimum = int(math.ceil(low.peak / (1 - BUDGET_MARGIN)))
            held_note = (
                f" (counting the {format_bytes(sum(u.grad_bytes for u in units))} of gradients held through "
                "gradient accumulation)"
                if held_grads
                else ""
            )
            raise BudgetError(
                f"ssdtrain: no plan fits the activation budget {format_bytes(budget)}; the smallest predicted peak "
                f"is {format_bytes(low.peak)}{held_note}, so the smallest budget is {minimum} bytes "
                f"({format_bytes(minimum)}, "
                f"with the {BUDGET_MARGIN:.0%} margin): pass budget >= that, give more host RAM "
                f"(host_memory=, now {format_bytes(tiers['host'].capacity if 'host' in tiers else 0)}) or an NVMe "
                "directory, or reduce the batch",
                minimum,
            )
        plan_choices = lean
    plan_choices = _relax(model, plan_choices, target, fixed)
    plan = Plan(
        model_name,
        units,
        plan_choices,
        bw,
        budget,
        tiers,
        block_container,
        window_units,
        working_bytes=working_bytes,
        forward_working=forward_working,
        block_working=block_working,
        correction=correction,
        async_copies=async_copies,
        grads=grads,
        held_grads=held_grads,
        overridden=set(overrides),
        speed_target=speed_target,
        budget_fraction=budget_fraction,
        move_overhead_s=move_overhead_s,
        hold_head=model.hold_head,
        clear_casts=clear_casts,
        inflight_bytes=ahead_bytes(model, plan_choices, window_units),
        drain_at_head=drain_at_head,
        host_forward_s=host_forward_s,
    )
    if budget is None and speed_target is not None and not ok:
        plan.fits = False
        plan.notes.append(
            f"even the leanest plan ({format_bytes(plan.prediction.peak)}) exceeds the free device "
            f"memory estimate ({format_bytes(speed_target)}); expect an out-of-memory error"
        )
    return plan


def scaled_units(units: list[UnitProfile], scale: float) -> list[UnitProfile]:
    """Copies of `units` with every measured time multiplied by `scale` (bytes unchanged). Not ``derive_s``: it is
    no time measured in the profiled step (whose hooks slow it down) but the recipes' traffic at a rate measured
    alone."""
    return [
        replace(
            u,
            forward_s=u.forward_s * scale,
            cheap_s=u.cheap_s * scale,
            selective_s=u.selective_s * scale,
            cheap_modules=list(u.cheap_modules),
        )
        for u in units
    ]


def replan(plan: Plan, **changes) -> Plan:
    """The same profile planned again with other limits (budget=, budget_fraction=, host_limit=, nvme_limit=,
    working_bytes=, forward_working=, block_working=, correction=, speed_target=, grads=, held_grads=), or with
    rescaled measurements (units= and time_scale=: see ``scaled_units``; bandwidth= and link_scale=;
    move_overhead_s=; host_forward_s=)."""
    fields = {
        "budget": plan.budget,
        "budget_fraction": plan.budget_fraction,
        "working_bytes": plan.working_bytes,
        "forward_working": plan.forward_working,
        "block_working": plan.block_working,
        "correction": plan.correction,
        "speed_target": plan.speed_target,
        "grads": plan.grads,
        "held_grads": plan.held_grads,
    }
    if "budget" in changes and "budget_fraction" not in changes:
        fields["budget_fraction"] = None
    fields.update(changes)
    overrides = {u.name: c for u, c in zip(plan.units, plan.choices, strict=True) if u.name in plan.overridden}
    new = make_plan(
        plan.model,
        changes.get("units", plan.units),
        changes.get("bandwidth", plan.bandwidth),
        fields["budget"],
        tiers=plan.tiers,
        host_limit=fields.get("host_limit"),
        nvme_limit=fields.get("nvme_limit"),
        block_container=plan.block_container,
        overrides=overrides,
        window_units=plan.window_units,
        working_bytes=fields["working_bytes"],
        forward_working=fields["forward_working"],
        block_working=fields["block_working"],
        correction=fields["correction"],
        async_copies=plan.async_copies,
        speed_target=fields["speed_target"],
        grads=fields["grads"],
        held_grads=fields["held_grads"],
        budget_fraction=fields["budget_fraction"],
        move_overhead_s=changes.get("move_overhead_s", plan.move_overhead_s),
        clear_casts=plan.clear_casts,
        drain_at_head=plan.drain_at_head,
        host_forward_s=changes.get("host_forward_s", plan.host_forward_s),
    )
    new.calibrations = list(plan.calibrations)
    new.time_scale = changes.get("time_scale", plan.time_scale)
    new.link_scale = changes.get("link_scale", plan.link_scale)
    new.timing_calibrations = plan.timing_calibrations
    new.times_checked = changes.get("time_scale") is not None or plan.times_checked
    new.notes = list(plan.notes)
    new.order_bounds = list(plan.order_bounds)
    new.compiled_blocks = plan.compiled_blocks
    new.min_bytes = plan.min_bytes
    return new


__all__ = [
    "Bandwidth",
    "BudgetError",
    "Choice",
    "Plan",
    "Prediction",
    "TierSpec",
    "UnitProfile",
    "make_plan",
    "make_tiers",
    "replan",
    "scaled_units",
    "simulate",
    "window_bytes",
]
