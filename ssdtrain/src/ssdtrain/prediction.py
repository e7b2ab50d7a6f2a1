"""The planner's cost model: what one profiled step measured per unit (``UnitProfile``), a choice per unit
(``Choice``: what to recompute, which tier holds what it still saves) and ``simulate()``, which predicts
forward+backward time and the activation peak of a set of choices.

``simulate()`` works from the measured link rates and each tier's rates: offloads queue on the device-to-host link
behind forward compute (then on the tier's own stage) and hold GPU memory until copied; backward prefetches a window
of units ahead over the tier's stage and the host-to-device link, and a unit whose data is late stalls. The peak
also holds what never moves: small tensors, the parameters' casts saved by autocast (unless the block is
recomputed: then only while it runs, as the session clears autocast's cache after it), the gradients backward
allocates when a step starts without them, and the measured working memory (temporaries never saved).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .tiers import TIER_NAMES as TIERS
from .tiers import TierSpec

RECOMPUTE = ("none", "cheap", "derive", "selective", "full")
_MIB = float(1 << 20)
# Host time of one moved tensor: the pack's bookkeeping, issuing its copy out and its copy back on the side
# streams, and its release (events, a pinned buffer from the pool). On an H100 host (benchmarks/host_cost.py
# --device cuda, copies launched once per unit) a moved tensor added ~80 us to its forward and ~40 us to its
# backward; on the Llama-style eager benchmark, six `derive+host` blocks cost 29-37 ms per step of 4 micro-batches
# over every block `derive` (how many tensors a block moves there was not counted). A move that hides behind
# compute still costs this: where recompute alone fits the budget at the same predicted device time, it wins.
# Charged where copies run behind compute.
MOVE_HOST_S = 1e-4


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
    # Saved bytes made again in backward by elementwise ops from what the block saves anyway (``ssdtrain.derive``),
    # and the time that costs (their memory traffic at the device's elementwise rate, plus the host's time per op).
    derive_bytes: int = 0
    derive_s: float = 0.0
    tensors: int = 0
    selective_bytes: int = 0  # what its matrix products and attention output (kept by selective recompute)
    selective_s: float = 0.0  # the forward time of everything else (run again by selective recompute)
    pinned_bytes: int = 0  # casts of parameters saved inside it (autocast's bf16 weights): held unless recomputed
    grad_bytes: int = 0  # gradients of its parameters (allocated by its backward when a step starts without them)

    @property
    def backward_s(self) -> float:
        return (1.0 if self.kind == "stem" else 2.0) * self.forward_s  # backward ~ 2x forward FLOPs

    def options(self, tiers=TIERS) -> list[Choice]:
        recomputes = ["none"]
        if self.kind == "head" and (self.derive_bytes > 0 or self.derive_s > 0):
            # The head derives only: its final norm's results and the casts of its input and of the LM head's
            # weight (on a Llama-3 vocabulary that cast alone is 1 GiB), made again when its projection's backward
            # runs. Recomputing it whole would run its largest temporaries (the logits) twice.
            recomputes.append("derive")
        if self.kind == "block":
            if self.cheap_bytes > 0:
                recomputes.append("cheap")
            if self.derive_bytes > 0 or self.derive_s > 0:  # activations or weight casts to derive
                recomputes.append("derive")
            # Selective recompute is not chosen by the planner, only by an override: torch's selective
            # checkpointing sends every op of the block through a Python policy, in forward and again in the
            # recompute, which its measured recompute time does not show. On an H100 (Llama-style 16 x 2048, fp32
            # weights under autocast) torch's own selective checkpointing took 1.52x keep's step against 1.30x for
            # full recompute, and plans with selective blocks ran 1.2x slower than their prediction.
            recomputes.append("full")
        # Cheap recompute is combined with keep only (an override may still move the rest): on an H100 (the same
        # Llama model, three calls) each plan with a `cheap+host` block ran 60-100 ms per step slower than the
        # same plan with that block `host` or `cheap`, none of which its prediction showed. `derive` combines with
        # a tier (`derive+host`: what its recipes start from moves): on an H100 (Llama-style 16 x 2048, autocast,
        # accumulation 4) the 0.5x-keep plan with it ran 1.12-1.19x keep's step over the fourteenth to sixteenth
        # sessions, 1.14x without it (one call), and 1.11-1.21x on the seventeenth's H100 machine, where the host
        # issued each such forward more slowly than the device ran it. Plans that move many blocks run slower than
        # predicted; halving the host's time per moved tensor (sixteenth session) did not change that measurably
        # (ssdtrain/benchmarks/RESULTS.md).
        return [Choice(r, t) for r in recomputes for t in tiers if r != "cheap" or t == "keep"]


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
        name = "recompute" if self.recompute == "full" else self.recompute
        return name if self.tier == "keep" else f"{name}+{self.tier}"

    @staticmethod
    def parse(text) -> Choice:
        """'keep', 'host', 'nvme', 'recompute', 'cheap', 'derive', 'selective', 'recompute+host', 'selective+host',
        ... (or a Choice)."""
        if isinstance(text, Choice):
            return text
        parts = [p.strip().lower() for p in str(text).split("+") if p.strip()]
        recompute, tier = "none", "keep"
        for p in parts:
            if p in ("recompute", "full", "checkpoint"):
                recompute = "full"
            elif p == "cheap":
                recompute = "cheap"
            elif p == "derive":
                recompute = "derive"
            elif p in ("selective", "sac"):
                recompute = "selective"
            elif p in TIERS:
                tier = p
            else:
                raise ValueError(
                    f"cannot read {text!r} as a choice: use keep, host, nvme, recompute, selective, derive or cheap, "
                    "optionally joined with '+' (e.g. 'recompute+host')"
                )
        return Choice(recompute, tier)


@dataclass
class Bandwidth:
    """Bytes per second of the device link in each direction (measured when the plan is made)."""

    d2h: float
    h2d: float


@dataclass
class Prediction:
    seconds: float  # forward + backward
    peak: int  # activation peak on the device (bytes)
    stall_s: float
    moved: dict[str, int]  # bytes per tier
    per_unit_stall: list[float]
    # Where the peak is ("forward of <unit>", "backward of <unit>") and what it is made of (bytes by kind, before the
    # calibration's correction): what a leaner plan would have to remove.
    peak_at: str = ""
    peak_parts: dict[str, int] = field(default_factory=dict)

    @property
    def host_bytes(self) -> int:
        return self.moved.get("host", 0)

    @property
    def nvme_bytes(self) -> int:
        return self.moved.get("nvme", 0)


def split_choice(u: UnitProfile, c: Choice) -> tuple[int, int, float, int]:
    """(resident bytes, moved bytes, recompute seconds, transient bytes during its backward)."""
    if c.recompute == "full":
        movable, extra_s = u.input_bytes, u.forward_s
        transient = u.saved_bytes + u.small_bytes + u.pinned_bytes
        small = 0
    elif c.recompute == "cheap":
        movable, extra_s = max(0, u.saved_bytes - u.cheap_bytes), u.cheap_s
        transient = u.cheap_bytes
        small = u.small_bytes + u.pinned_bytes
    elif c.recompute == "derive":
        # The derived tensors come back one recipe at a time in the block's backward, each freed after the op that
        # uses it; results shared by several (a norm's output and its cast) are held until the last is unpacked. On
        # a Llama-style block at most about a third of the derived bytes are made at once: half is a safe bound.
        movable, extra_s = max(0, u.saved_bytes - u.derive_bytes), u.derive_s
        # Its weight casts too are recipes, made again from the parameters in backward (counted as a recomputed
        # block's: held while it runs in forward, see `simulate`).
        transient = u.derive_bytes // 2 + u.pinned_bytes
        small = u.small_bytes
    elif c.recompute == "selective":
        # Only the block's inputs pass through the tiers; the kept outputs of its matrix products and attention stay
        # on the device (torch's selective checkpointing holds them); casts of its weights are made again.
        movable, extra_s = u.input_bytes, u.selective_s
        transient = max(0, u.saved_bytes - u.selective_bytes) + u.pinned_bytes
        small = u.selective_bytes + u.small_bytes
    else:
        movable, extra_s, transient, small = u.saved_bytes, 0.0, 0, u.small_bytes + u.pinned_bytes
    if c.tier == "keep":
        return movable + small, 0, extra_s, transient
    return small, movable, extra_s, transient


def moved_tensors(u: UnitProfile, c: Choice) -> int:
    """Tensors a unit's choice sends through a tier: its inputs under full or selective recompute (the
    block's hidden states; counted as one), else what it saves (small ones included: an upper bound)."""
    if c.tier == "keep":
        return 0
    if c.recompute in ("full", "selective"):
        return 1
    if c.recompute == "derive" and u.saved_bytes > 0:
        # the recipes' tensors stay behind: about their share of the bytes (the profile counts no tensors per recipe)
        return max(1, round(u.tensors * max(0, u.saved_bytes - u.derive_bytes) / u.saved_bytes))
    return max(1, u.tensors)


def move_host_s(u: UnitProfile, c: Choice) -> float:
    """The host's work in a forward for what unit `u` moves under choice `c`: ``MOVE_HOST_S`` per moved tensor."""
    return MOVE_HOST_S * moved_tensors(u, c) if split_choice(u, c)[1] else 0.0


def window_bytes(units: list[UnitProfile], choices: list[Choice], window_units: int) -> int:
    """Device bytes the cache may hold for moved activations in either direction: prefetched but not yet used in
    backward, and waiting for their copy out in forward (``window_units`` x the largest unit's moved bytes)."""
    biggest = max((split_choice(u, c)[1] for u, c in zip(units, choices, strict=True)), default=0)
    return window_units * biggest


def _prefetch_bound(moved: list[int], i: int, window: int, window_units: int) -> int:
    """The most bytes of units below `i` the cache holds prefetched during unit i's backward: it restores whole
    units among the `window_units` below i, in backward order, while what it holds unused plus the next unit
    stays within `window` (one unit at least)."""
    total = 0
    for k in range(i - 1, max(0, i - window_units) - 1, -1):
        if not moved[k]:
            continue
        if total and total + moved[k] > window:
            break
        total += moved[k]
        if total >= window:
            break
    return total


def simulate(
    units: list[UnitProfile],
    choices: list[Choice],
    bw: Bandwidth,
    window_units: int = 2,
    working_bytes: int = 0,
    tiers: dict[str, TierSpec] | None = None,
    grads: bool = False,
    *,
    forward_working: int | None = None,
    block_working: int | None = None,
    correction: int = 0,
    async_copies: bool = True,
    held_grads: bool = False,
    move_overhead_s: float = 0.0,
    hold_head: bool = False,
    clear_casts: bool = True,
    inflight_bytes: int = 0,
    drain_at_head: bool = False,
    host_forward_s: float = 0.0,
) -> Prediction:
    """Predict forward+backward seconds and the activation peak (bytes) of `choices` (one per unit).

    The peak is the largest of what the allocator holds at the end of each unit's forward and during each unit's
    backward. Forward: what the units so far keep (and autocast's weight casts of the recomputed ones: with
    `clear_casts` those of the unit running only, as the session clears autocast's cache when a recomputed block's
    forward returns; without, all of them, cached until the forward ends), plus the moved bytes still waiting for
    their copy out (at most the cache's window: the host runs ahead of the device, so the allocator sees a copy as
    done only when the cache polls it; past the window the cache makes the compute stream wait, delaying compute),
    plus `forward_working` (the forward's never-saved temporaries, largest at the head: logits, their fp32 cast).
    Backward of unit i: what is still kept, its moved bytes (back), the units below it prefetched within the
    window, what its recompute re-creates, the gradients allocated so far (with `grads`: the step starts without
    them), and the working memory of that backward: `working_bytes` for the head (the logits' gradients), else
    `block_working`. `correction` (from calibration by a measured peak) is added to the peak. A working value of
    None falls back to `working_bytes`. Without `async_copies` (CPU: copies are done when the cache returns) a
    moved byte is held only while the link, as timed, has not sent it. With `async_copies` backward begins only
    when every copy out is done (the cache waits for them at the first unpack and frees their device bytes), so a
    moved unit is always brought back over the link, the head first. `held_grads`: the step starts with every
    gradient held (gradient accumulation after a step that set them to None): they count at every point of the
    step, forward included. `move_overhead_s`: seconds each moved unit costs beyond its copies' time on the link
    (measured by calibration: a step that ran slower than predicted while the device did not wait for copies
    back), counted as a stall at the unit's backward. `hold_head`: the head's backward (the logits' gradients, often
    the step's peak) runs with no block below it prefetched; the blocks' copies back start when it is done, the
    first block's then on demand. `inflight_bytes`: the cache's bound on copies out in flight in forward when larger
    than the window (the host may then run further ahead of the device; the plan gives it where the peak has room).
    `drain_at_head`: compute waits for every copy out when the last block's forward returns (the session does, on
    a GPU with block hooks), so none is in flight during the head's forward (its logits are the forward's largest
    temporaries); the head's compute starts no earlier than the last copy's end.
    `host_forward_s`: the host's own time to issue a forward without moves (measured by calibration; 0: unknown).
    With it the forward runs on two clocks: the host issues each unit in its share of that time (by the unit's
    compute) plus its moves' host work (``MOVE_HOST_S`` per moved tensor), and the device runs a unit no sooner
    than the host has issued it. A move's host work then costs the device time only where the host sets the pace;
    without it, that work is counted as the device's (as if the host were never ahead).
    """
    tiers = tiers or {}
    n = len(units)
    fwd_work = working_bytes if forward_working is None else forward_working
    blk_work = working_bytes if block_working is None else block_working
    parts = [split_choice(u, c) for u, c in zip(units, choices, strict=True)]
    moved_bytes = [p[1] for p in parts]
    window = window_bytes(units, choices, window_units)
    ahead_limit = max(window, inflight_bytes)  # copies out in flight in forward before compute waits
    held = sum(u.grad_bytes for u in units) if held_grads else 0
    # Autocast caches its weight casts until the autocast region ends (after the forward, where backward runs
    # outside it): a recomputed block saves none of its casts, yet the cache holds them through the rest of the
    # forward unless it is cleared when the block returns (`clear_casts`: the session does, where no parameter of a
    # block is used elsewhere).
    casts = [
        u.pinned_bytes if c.recompute in ("full", "selective", "derive") else 0
        for u, c in zip(units, choices, strict=True)
    ]
    held_casts = 0
    # Forward: compute back to back; each unit's moved bytes queue on the D2H link and hold GPU memory until sent;
    # a tier with a stage of its own (the disk) then queues them there.
    t, link = 0.0, 0.0
    end = [0.0] * n
    sent = [0.0] * n
    resident = 0
    peak = 0
    stage_free: dict[str, float] = {}
    staged = [0.0] * n
    queued = []  # (sent time, bytes) in link order: sent times never decrease
    peak_at, composition = "", {}
    head = 0
    backlog = 0
    cumulative = 0
    profiled = sum(u.forward_s for u in units)
    host_share = host_forward_s / profiled if host_forward_s > 0 and profiled > 0 else 0.0
    host = 0.0  # the host's clock (two clocks only with `host_forward_s`)
    for i, (u, (res, moved, _, _)) in enumerate(zip(units, parts, strict=True)):
        if drain_at_head and async_copies and u.kind == "head" and queued:
            t = max(t, queued[-1][0])
            head, backlog, cumulative = len(queued), 0, 0
        t += u.forward_s
        # The host's work for the moves, in this forward (on CPU the copies are synchronous: their time is the
        # link's, counted below).
        move_host = move_host_s(u, choices[i]) if moved and async_copies else 0.0
        if host_share:
            host += host_share * u.forward_s + move_host
            t = max(t, host)
        else:
            t += move_host
        end[i] = t
        resident += res
        held_casts = casts[i] if clear_casts else held_casts + casts[i]
        if moved:
            link = max(link, t) + moved / bw.d2h  # (a unit's copies start together as the next unit begins)
            sent[i] = link
            queued.append((link, moved))
            backlog += moved
            cumulative += moved
            spec = tiers.get(choices[i].tier)
            if spec is not None and spec.write_rate:
                stage_free[spec.name] = max(stage_free.get(spec.name, 0.0), link) + moved / spec.write_rate
                staged[i] = stage_free[spec.name]
        while head < len(queued) and queued[head][0] <= t:
            backlog -= queued[head][1]
            head += 1
        # More than the window in flight: the device's compute waits for copies out.
        while backlog > ahead_limit and head < len(queued):
            t = max(t, queued[head][0])
            backlog -= queued[head][1]
            head += 1
        end[i] = t
        inflight = max(backlog, min(ahead_limit, cumulative)) if async_copies else backlog
        here = resident + held_casts + inflight + fwd_work + held
        if here > peak:
            peak, peak_at = here, f"forward of {u.name}"
            composition = {"kept": resident, "weight casts": held_casts, "in flight": inflight, "working": fwd_work}
            composition["gradients"] = held
    if async_copies and queued:
        # The first unpack of backward waits for the copies out still running (and frees their device bytes).
        t = max(t, queued[-1][0])
    forward_end = t
    head_done = t
    # Backward, last unit first: unit i's moved bytes come back over H2D (after the disk read for NVMe), starting
    # once the unit `window_units` later has started its backward; data still on the device is used in place.
    start = [0.0] * n
    h2d_free = forward_end
    read_free: dict[str, float] = {}
    stall = 0.0
    per_unit_stall = [0.0] * n
    live = resident
    grads_live = 0
    for i in range(n - 1, -1, -1):
        res, moved, extra_s, transient = parts[i]
        ready = t
        on_device = 0
        if grads and not held_grads:
            grads_live += units[i].grad_bytes
        if moved:
            # The cache restores a unit when backward unpacks a saved tensor of one of the `window_units` units
            # above it, moved or kept (the farthest of them comes first), or when backward begins.
            trigger = start[i + window_units] if i + window_units < n else forward_end
            if hold_head and i < n - 1 and i + window_units >= n - 1:
                trigger = head_done
            if sent[i] > trigger:  # still being copied out when needed: forwarded, never left the device
                on_device = moved
            else:
                spec = tiers.get(choices[i].tier)
                if spec is not None and spec.read_rate:
                    free = max(read_free.get(spec.name, forward_end), trigger, staged[i]) + moved / spec.read_rate
                    read_free[spec.name] = free
                    source_ready = free
                else:
                    source_ready = max(trigger, sent[i])
                h2d_free = max(h2d_free, source_ready) + moved / bw.h2d
                ready = max(t, h2d_free)
                on_device = moved
        if moved:
            ready += move_overhead_s
        wait = ready - t
        if i == n - 1:
            wait += forward_end - end[-1] if n else 0.0  # the wait for the copies out at backward's start
        stall += wait
        per_unit_stall[i] = wait
        start[i] = ready
        ahead = 0 if hold_head and i == n - 1 else _prefetch_bound(moved_bytes, i, window, window_units)
        work = working_bytes if i == n - 1 else blk_work
        if i == n - 1 and transient:
            # The head's recipes are made as its projection's backward runs, after the loss's backward has made
            # and freed the largest of the logits' gradients (its working memory at most): the two do not add up,
            # and half the working memory (the logits' gradient in half precision) is held with the recipes.
            transient = max(0, transient + work // 2 - work)
        here = live + on_device + ahead + transient + max(grads_live, held) + work
        if here > peak:
            peak, peak_at = here, f"backward of {units[i].name}"
            composition = {"kept": live, "brought back": on_device, "prefetched ahead": ahead}
            composition.update({"recomputed": transient, "working": work, "gradients": max(grads_live, held)})
        t = ready + extra_s + units[i].backward_s
        if i == n - 1:
            head_done = t
        live -= res
    moved_by_tier: dict[str, int] = {}
    for p, c in zip(parts, choices, strict=True):
        if p[1]:
            moved_by_tier[c.tier] = moved_by_tier.get(c.tier, 0) + p[1]
    composition = {k: v for k, v in composition.items() if v}
    return Prediction(t, int(max(0, peak + correction)), stall, moved_by_tier, per_unit_stall, peak_at, composition)
