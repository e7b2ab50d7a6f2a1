"""The planner's searches over per-unit choices (``ssdtrain.planner``): cheapest-first (the least added time per
byte of peak removed), leanest-first, from every unit's leanest choice, and the undoing of changes a plan no
longer needs. A model here is the planner's ``_Model``: ``model(choices)`` is a ``Prediction``."""

from __future__ import annotations

from .prediction import Choice, split_choice

# Whole-block recompute: where cheapest-first takes it, ``_moved_prefixes`` competes.
WHOLE = ("full", "selective")


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
    (`_relax` then undoes what is not needed). Where cheapest-first fits, the plans seeded with moved first blocks
    (``_moved_prefixes``) compete with it where it recomputes whole blocks, and the fastest is taken."""
    found, _, ok = _search(model, choices, target, fixed)
    if ok and any(c.recompute in WHOLE for c in found):
        found = _relax(model, found, target, fixed)
        best = model(found).seconds
        worse = 0
        for other in _moved_prefixes(model, choices, target, fixed):
            seconds = model(other).seconds
            if seconds < best:
                found, best, worse = other, seconds, 0
            else:
                worse += 1
                if worse == 2:  # (past the best number of moved blocks: each more moves more for nothing)
                    break
    if not ok:
        found, _, ok = _search(model, choices, target, fixed, by_peak=True)
    if not ok:
        seed, seeded = _lean_seed(model, choices, fixed)
        if model.feasible(seeded) and seeded.peak <= target:
            found, ok = seed, True
    return found, ok


def _moved_prefixes(model, choices, target, fixed):
    """Plans whose first n blocks with recipes (n = 1, 2, ...) derive and move the rest of what they save
    (``derive+host``), the rest found by cheapest-first, each relaxed.

    Cheapest-first judges each change by the peak it removes at once. Moving a block removes little at once where
    the cache's bound on copies in flight (the window) is added at the peak, and much once several blocks move;
    the first blocks are where moves hide best (their copies out run behind the rest of the forward, their copies
    back behind most of the backward). So cheapest-first can recompute whole blocks where moving was faster."""
    blocks = [i for i, u in enumerate(model.units) if u.kind == "block" and u.name not in fixed]
    names = model.tier_names()
    seed = list(choices)
    for i in blocks:
        u = model.units[i]
        lean = min(
            (c for c in u.options(names) if c.recompute == "derive"),
            key=lambda c, u=u: (*split_choice(u, c)[:2], c != Choice()),
            default=None,
        )
        if lean is None or lean.tier == "keep":
            continue  # (no recipes, or no tier: whole-block moves are cheapest-first's alone, as measured before)
        seed[i] = lean
        prefix = {model.units[k].name for k in blocks if k <= i}
        found, pred, ok = _search(model, seed, target, fixed | prefix)
        if ok and model.feasible(pred):
            yield _relax(model, found, target, fixed)
        if model(seed).peak <= target:
            return  # (more moved blocks only add moves that relaxing undoes)


def _leanest(model, choices, fixed):
    """(choices, prediction) of the leanest plan found: leanest-first towards 0 bytes, or every unit's leanest."""
    lean, low, _ = _search(model, choices, 0, fixed, by_peak=True)
    seed, seeded = _lean_seed(model, choices, fixed)
    return (seed, seeded) if model.feasible(seeded) and seeded.peak < low.peak else (lean, low)


def _relax(model, choices, target, fixed):
    """Undo what is no longer needed: any single change that is faster and still fits, best first (whole-block
    recompute included)."""
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
