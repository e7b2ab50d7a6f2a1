"""The planner's searches over per-unit choices (``ssdtrain.planner``): cheapest-first (the least added time per
byte of peak removed), leanest-first, from every unit's leanest choice, and the undoing of changes a plan no
longer needs. A model here is the planner's ``_Model``: ``model(choices)`` is a ``Prediction``."""

from __future__ import annotations

from .prediction import Choice, split_choice


def _single_changes(model, choices, fixed):
    """Every plan one change away from `choices` (units not in `fixed`): (unit index, its new choice, prediction)."""
    names = model.tier_names()
    for i, u in enumerate(model.units):
        if u.name in fixed:
            continue
        for c in u.options(names):
            if c != choices[i]:
                yield i, c, model(choices[:i] + [c] + choices[i + 1 :])


def _search(model, choices, target, fixed, by_peak=False):
    """Greedy: the change with the least added time per byte of peak removed, until the peak fits `target`
    (`by_peak`: the change that lowers the peak most, for the leanest plan)."""
    current = model(choices)
    while current.peak > target:
        best = None
        for i, c, pred in _single_changes(model, choices, fixed):
            if pred.peak >= current.peak or not model.feasible(pred):
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


def _lean_seed(model, choices, fixed):
    """Every unit not fixed at its leanest choice: the least bytes left on the device, then the least moved (the
    cache's window is a multiple of the largest moved unit). The one-change search can stall above it: while one
    unit moves a whole block, no other unit's change from moving its block to moving its inputs lowers the peak."""
    seed = list(choices)
    for i, u in enumerate(model.units):
        if u.name not in fixed:
            seed[i] = min(u.options(model.tier_names()), key=lambda c, u=u: (*split_choice(u, c)[:2], c != Choice()))
    return seed, model(seed)


def _fit(model, choices, target, fixed) -> tuple[list, bool]:
    """Choices whose peak fits `target`: cheapest-first, else leanest-first, else from every unit's leanest choice
    (`_relax` then undoes what is not needed)."""
    found, _, ok = _search(model, choices, target, fixed)
    if not ok:
        found, _, ok = _search(model, choices, target, fixed, by_peak=True)
    if not ok:
        seed, seeded = _lean_seed(model, choices, fixed)
        if model.feasible(seeded) and seeded.peak <= target:
            found, ok = seed, True
    return found, ok


def _leanest(model, choices, fixed):
    """(choices, prediction) of the leanest plan found: leanest-first towards 0 bytes, or every unit's leanest."""
    lean, low, _ = _search(model, choices, 0, fixed, by_peak=True)
    seed, seeded = _lean_seed(model, choices, fixed)
    return (seed, seeded) if model.feasible(seeded) and seeded.peak < low.peak else (lean, low)


def _relax(model, choices, target, fixed):
    """Undo what is no longer needed: any single change that is faster and still fits, best first."""
    current = model(choices)
    improved = True
    while improved:
        improved = False
        best = None
        for i, c, pred in _single_changes(model, choices, fixed):
            if pred.peak <= target and pred.seconds < current.seconds - 1e-7 and model.feasible(pred):
                if best is None or pred.seconds < best[2].seconds:
                    best = (i, c, pred)
        if best is not None:
            i, c, current = best
            choices = choices[:i] + [c] + choices[i + 1 :]
            improved = True
    return choices
