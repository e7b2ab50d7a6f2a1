"""``ssdtrain.offload(model, budget=...)``: saved activations to host RAM / NVMe / recompute under a memory budget.

    with ssdtrain.offload(model, budget="20GiB") as session:
        for batch in loader:
            loss = model(**batch).loss
            loss.backward()
            optimizer.step(); optimizer.zero_grad()
    print(session.plan)       # per-layer keep / host / nvme / recompute, predicted step time and peak
    print(session.stats())    # bytes per tier, prefetch hits, stalls, fallbacks

``ssdtrain.plan(model, step_fn, budget=...)`` profiles a step and returns the plan ``offload()`` would use, to print,
adjust and pass back. Both are thin: the work is ``OffloadSession`` (``ssdtrain.session``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from .planner import Plan
from .planning import ModelState
from .session import OffloadSession

__all__ = ["offload", "plan"]


def offload(model: nn.Module, budget: int | float | str | None = None, **options: Any) -> OffloadSession:
    """Offload `model`'s saved activations to fit `budget`: bytes, a size such as ``"20GiB"``, or a float in
    (0, 1]: that fraction of the activation peak of keeping everything (as predicted from the profiled step, like
    ``torch.compile``'s ``activation_memory_budget``).

    ``budget=None`` plans for speed: keep what fits in the free device memory (measured when the plan is made)
    and move or recompute only the rest. Options: ``plan=`` (a Plan from ``ssdtrain.plan()``, used as is),
    ``overrides={"transformer.h.0": "keep", "transformer.h.5": "recompute+host"}``, ``host_memory=`` (pinned pool
    limit; default half the available RAM), ``nvme_memory=`` / ``directories=`` (the NVMe tier; default the
    SSDTRAIN_IO_DIRS directories or the temp dir, up to 90% of their free space; checked here), ``min_bytes="1M"``
    (smaller saved tensors stay on the device; with ``plan=``: the plan's), ``prefetch_units=2`` (units backward
    restores ahead; with ``plan=``: the plan's, and another one runs the plan's choices with that window),
    ``on_full="fallback"`` (or ``"raise"``),
    ``profile_steps=2`` (forwards of a new input shape before the plan: warm-ups, then one measured step; not with
    ``plan=``, which profiles nothing),
    ``verbose=False`` (True: one line on stderr when a plan is made; it always goes to the ``ssdtrain`` logger
    at INFO).
    """
    return OffloadSession(model, budget, **options)


def plan(
    model: nn.Module, step_fn: Callable[[], object], budget: int | float | str | None = None, **options: Any
) -> Plan:
    """Profile `step_fn()` (a forward and backward of `model`; called ``profile_steps`` times, default 2: a
    warm-up, then the measured step) and return the plan ``offload()`` would use for `budget`. ``print()`` it for
    per-layer choices and predictions; pass it to ``offload(model, plan=...)`` (after ``plan.override(...)`` if you
    like). The steps are real: they accumulate gradients like any other."""
    options.setdefault("verbose", False)
    state = ModelState()
    session = OffloadSession(model, budget, _state=state, **options)
    session._quiet = True
    with session:
        for _ in range(session.profile_steps):
            step_fn()
        if session.profiler.pending is None:
            raise RuntimeError(
                "plan(): step_fn() did not call the model's forward; it must run model(...) "
                "(and backward) on the model passed to plan()"
            )
        session._finish_profile()
    return next(iter(state.plans.values()))
