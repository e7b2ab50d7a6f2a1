"""Layer 6: measuring strategies. :func:`race` runs the candidates on a call and returns the measurement;
:func:`judge` turns a host plan's calls as seen in use into an updated measurement; :func:`calibrate` races a grid of
synthetic calls on a table up front. None of them keeps state: ``_auto`` records what they return."""

from __future__ import annotations

import dataclasses
import math
import time

import torch
from torch import Tensor

from . import _core, _features, _kernels, _memory, _strategies
from ._cell import Call, Cell, Measurement
from ._config import settings
from ._decide import SMALL_CALL_BYTES, candidates, pick, plan_from
from ._strategies import Plan, RowJob, Split

# Candidates within this factor of the fastest are timed again before one is kept (one noisy run must not decide a
# cell: measured once each, auto kept plans whose steady speed was down to 0.73x another candidate's on an H200
# host); calls shorter than SHORT_CALL_S are timed three times from the start.
RETIME_WITHIN = 1.3
SHORT_CALL_S = 3e-3
# A host plan watched in use (``_auto``) whose fastest call ran below this share of its measured rate takes the
# observed rate instead.
CHECK_SLOWER = 0.7
# calibrate(): row widths of a scratch table, counts, and the index patterns measured.
ROW_BYTES = (64, 128, 256, 512, 1024, 2048, 4096)
CALIBRATION_COUNTS = (1 << 13, 1 << 15, 1 << 17, 1 << 19, 1 << 21)
# (pattern, Zipf exponent): no duplicates in three orders, some and many duplicates.
CALIBRATION_PATTERNS = (("uniform", 0), ("sorted", 0), ("clustered", 0), ("zipf", 0.9), ("zipf", 1.1))
CALIBRATION_TABLE_BYTES = 1 << 30

_clock = time.perf_counter  # (tests replace it with a simulated clock)
execute = _strategies.run  # (tests replace it with timed stand-ins)


@dataclasses.dataclass(frozen=True)
class RaceResult:
    """What :func:`race` measured: the plan kept, the measurement to record, the seconds it took."""

    plan: Plan
    measurement: Measurement
    seconds: float


def _sync() -> None:
    if torch.cuda.is_initialized():  # (never on a CPU-only machine, where the tests time stand-ins)
        torch.cuda.synchronize()


def _timed(job: RowJob, plan: Plan, check_bounds: bool) -> float:
    start = _clock()
    execute(job, plan, check_bounds=check_bounds, in_range=check_bounds)
    _sync()
    return _clock() - start


def race(cell: Cell, job: RowJob, names: tuple[str, ...], *, budget_s: float, check_bounds: bool,
         span: int = 0) -> RaceResult:
    """Runs `job` (the call itself, all of it, with the bounds check `check_bounds` that a later call of that plan
    makes) with each candidate: once untimed (a first run allocates its buffers and fills caches: with only a
    warm-up on a few rows, cells kept strategies up to 2.3x slower than the best one), then timed (three times for
    calls under SHORT_CALL_S, which vary more); those within RETIME_WITHIN of the fastest are timed in two more
    interleaved rounds; keeps the fastest (``pick``). Stops early, keeping what was measured, once `budget_s` is
    spent; the measurement is then marked incomplete. Split's share comes from the kernel and staged times.

    A candidate that runs out of GPU memory (``dedupe`` needs a second buffer as large as the output) is left out:
    measuring must not fail a call that another plan can serve. The kept plan runs last when a failed run may have
    written part of the output."""
    start = _clock()
    seconds: dict = {}
    plans: dict = {}
    out_of_memory: list = []
    complete = True
    output_from_failed_run = False
    for name in names:
        if seconds and _clock() - start > budget_s:
            complete = False
            break
        plan = Split.plan_from_times(seconds) if name == Split.name else Plan(name)
        if plan is None:
            continue
        plans[name] = plan
        try:
            _timed(job, plan, check_bounds)  # warm-up
            seconds[name] = _timed(job, plan, check_bounds)
            if seconds[name] < SHORT_CALL_S:
                seconds[name] = min(seconds[name], _timed(job, plan, check_bounds), _timed(job, plan, check_bounds))
            output_from_failed_run = False
        except torch.cuda.OutOfMemoryError as e:
            out_of_memory.append(e)
            output_from_failed_run = True  # it may have written part of the output
    if not seconds:
        raise out_of_memory[0]
    fastest = min(seconds.values())
    finalists = [s for s, t in seconds.items() if t <= RETIME_WITHIN * fastest]
    if len(finalists) > 1:
        # Timed again in two rounds, each running every finalist once, the second in reverse order: measured one
        # after the other, whichever ran last was favoured (10 cells of one H200 benchmark kept split, measured
        # last, whose steady speed was 0.73-0.97x staged's).
        for order in (finalists, finalists[::-1]):
            for name in order:
                seconds[name] = min(seconds[name], _timed(job, plans[name], check_bounds))
    call = cell.call
    gbps = {s: call.bytes / max(t, 1e-9) / 1e9 for s, t in seconds.items()}
    split = plans.get(Split.name) if Split.name in seconds else None
    m = Measurement(cell.key, gbps, pick(gbps), span, complete,
                    split.split_fraction if split else None, split.split_kernel if split else None,
                    measured_on={"table_bytes": call.table_bytes, "row_bytes": call.row_bytes, "count": call.count})
    kept = plan_from(m, capturing=False)
    m = dataclasses.replace(m, best=kept.strategy)
    if output_from_failed_run:
        execute(job, kept, check_bounds=check_bounds, in_range=check_bounds)
    return RaceResult(kept, m, _clock() - start)


def judge(m: Measurement, plan: Plan, call: Call, observed: list[float], between: list[float]) -> Measurement:
    """A host plan's measurement after watching it in use: `observed`, seconds from each call's start until it
    returned to the caller; `between`, seconds the caller worked between calls. A host plan holds the calling
    thread until its rows are gathered, where a device plan returns once they are queued, so:

    - when the caller's work between calls (the median) takes longer than the call as measured (a training step
      between two gathers, not a loop that only gathers), the cell serves device plans only from then on
      (``caller_busy``): one GNN training process in four had kept ``split`` (measured 36.9 GB/s against vector's
      28.3) and spent 0.44-0.79 s per epoch in its gather phase, against 0.28-0.29 s in the processes that kept a
      device plan;
    - when the fastest call ran below CHECK_SLOWER x the measured rate (it waits for the GPU work making its
      indices, or for the CPU), the measurement takes the observed rate.

    Either way the plan counts as watched (``observed``), and the kept plan is chosen again."""
    observed, between = sorted(observed), sorted(between)
    rate = call.bytes / max(observed[0], 1e-9) / 1e9
    measured = m.gbps.get(plan.strategy, rate)
    new = dataclasses.replace(m, observed={**m.observed, plan.strategy: rate})
    # (Against the measured call, which lasts until its GPU work is done: split's GPU half may outlast the call's
    # return, and a loop that synchronises after each call then waits for it between calls.)
    if between[len(between) // 2] > call.bytes / max(measured, 1e-9) / 1e9:
        new = dataclasses.replace(new, caller_busy=True)
    elif rate < CHECK_SLOWER * measured:
        new = dataclasses.replace(new, gbps={**m.gbps, plan.strategy: rate})
    kept = plan_from(new, capturing=False)
    if kept is None:  # no device plan was measured in this cell (the budget ran out): the host plan stays
        new = dataclasses.replace(new, caller_busy=False)
        kept = plan_from(new, capturing=False)
    return dataclasses.replace(new, best=kept.strategy)


def calibrate(*, table=None, table_bytes: int = CALIBRATION_TABLE_BYTES, row_bytes=None, counts=None,
              log=None) -> dict:
    """Races the gather strategies on `table` (reads only) or on a scratch pinned table of `table_bytes`, for index
    patterns uniform / sorted / clustered / Zipf (exponents 0.9 and 1.1) at several counts; returns the
    measurements by key (see ``pytorch_direct.calibrate``). `log(measurement)` is called after each."""
    if not _memory.cuda_usable():
        raise _core.UnavailableError("calibration needs a CUDA device")
    device = torch.device("cuda", torch.cuda.current_device())
    if table is None:
        plain = _memory.host_empty((table_bytes,), torch.uint8)
        plain.fill_(1)
        widths = tuple(row_bytes or ROW_BYTES)
        memory = _memory.host_kind(plain)
    else:
        with torch._C.DisableTorchFunctionSubclass():
            plain = table.detach()
            if not plain.is_contiguous():
                raise ValueError("calibrate(table=...) needs a contiguous table")
            widths = (_kernels.row_layout(plain)[1],) if row_bytes is None else tuple(row_bytes)
            plain = plain.reshape(-1).view(torch.uint8)
        memory = _kernels.table_for_device(plain, device.index)
    total = plain.numel()
    checked = settings.bounds_check == "sync"
    generator = torch.Generator(device=device).manual_seed(0)
    measured: dict = {}
    for rb in widths:
        rows = total // rb
        if rows == 0:
            continue
        with torch._C.DisableTorchFunctionSubclass():
            view = plain[: rows * rb].view(rows, rb)
        for pattern, zipf_s in CALIBRATION_PATTERNS:
            for n in counts or CALIBRATION_COUNTS:
                n = min(n, rows, max(1, (1 << 30) // rb))
                idx = _features.synthetic_indices(pattern, n, rows, generator, zipf_s=zipf_s)
                features, _, _ = _features.index_features(idx, rows, rb)
                cell = Cell(Call("gather", total, rows, rb, n, memory), features)
                if cell.call.bytes < SMALL_CALL_BYTES:
                    continue
                out: Tensor = torch.empty((n, rb), dtype=torch.uint8, device=device)
                job = RowJob("gather", view, rows, rb, idx, out)
                result = race(cell, job, candidates(cell), budget_s=math.inf, check_bounds=checked,
                              span=1 if counts is None else 0)
                measured[result.measurement.key] = result.measurement
                if log is not None:
                    log(result.measurement)
    return measured
