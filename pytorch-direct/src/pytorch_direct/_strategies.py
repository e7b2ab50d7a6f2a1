"""Layer 4: the strategies, one small type each, in one registry (:data:`REGISTRY`), and :func:`run`, which
carries out a decided :class:`Plan` on a :class:`RowJob`.

A strategy says what it is (``name``, where it runs: ``runs_on``), how it moves rows (``gather``, ``scatter``, made
of ``_kernels``'s primitives) and when ``auto`` should measure it (``candidate``). Deciding which one to run is not
here: ``_decide`` (pure) and ``_auto`` (the measured cells, the measuring) do that, by name.

Adding a strategy is one class here with ``@register``: ``pd.STRATEGIES``, forcing it by name, ``auto``'s
measuring and the cell store all follow from the registry (README, "How to add a strategy").
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from torch import Tensor

from . import _kernels
from ._cache import RowCache
from ._cell import Cell
from ._config import settings

REGISTRY: dict = {}
"""Every strategy by name, in the order ``auto`` measures them (after the rules' choice)."""


def register(cls):
    """Class decorator: adds one instance of a Strategy subclass to :data:`REGISTRY`."""
    if not cls.name or cls.name in REGISTRY or cls.name == "auto":
        raise ValueError(f"strategy name {cls.name!r} is empty, taken, or reserved")
    REGISTRY[cls.name] = cls()
    return cls


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one call moves its rows: a strategy by name and, for ``split``, its parameters (the share of rows the
    kernel moves, the rest going through ``staged`` on a side stream at the same time, and whether that kernel
    sorts its indices first)."""

    strategy: str
    split_fraction: float = 0.5
    split_kernel: str = "vector"

    def __post_init__(self) -> None:
        if self.strategy not in REGISTRY:
            raise ValueError(f"unknown plan {self.strategy!r}; one of {', '.join(REGISTRY)}")
        if not 0.0 <= self.split_fraction <= 1.0 or self.split_kernel not in Split.KERNELS:
            raise ValueError(f"bad split parameters in {self}")

    @property
    def kind(self) -> Strategy:
        return REGISTRY[self.strategy]

    @property
    def needs_host(self) -> bool:
        """Copies indices to the host and waits for the stream: impossible inside CUDA graph capture, and holds the
        calling thread until the rows are moved."""
        return REGISTRY[self.strategy].runs_on == "host"


@dataclasses.dataclass(frozen=True)
class RowJob:
    """One row operation with CUDA indices, checked and laid out: what a strategy runs. ``idx``: 1-D, contiguous,
    non-empty; ``dense``: the gather's output or the scatter's values, ``count`` rows, contiguous; ``cache``: the
    table's GPU cache of hot rows on idx's device, if any."""

    op: str
    table: Tensor
    rows: int
    row_bytes: int
    idx: Tensor
    dense: Tensor
    max_sms: int = 0
    cache: RowCache | None = None


class Strategy:
    """One way to move a call's rows. Subclasses set the class attributes and override what they do."""

    name: ClassVar[str] = ""
    # "device": GPU kernels only (allowed in CUDA graph capture; returns once queued). "host": CPU threads and
    # copies (copies the indices to the host and waits for them).
    runs_on: ClassVar[str] = "device"
    # Reads every index on the host, raising IndexError for a bad one itself: no separate bounds check.
    checks_on_host: ClassVar[bool] = False
    # Reads the table's GPU cache of hot rows (only for cached tables; the others never read it).
    uses_cache: ClassVar[bool] = False
    # The strategy a scatter forced to this one runs (None: its own scatter).
    scatter_as: ClassVar[str | None] = None
    # With CPU indices, gather each distinct row once, then expand (the CPU path has no other strategies).
    host_dedupe: ClassVar[bool] = False

    def candidate(self, cell: Cell) -> bool:
        """Whether ``auto`` should measure this strategy on a call like `cell` (features known). The base rule: the
        cached strategies only for gathers of a table with a GPU cache; the others always (on a cached table too,
        where a host strategy may still beat the cache's kernel on the misses: auto is then never slower than the
        uncached gather it also measured)."""
        return not self.uses_cache or (cell.cached and cell.call.op == "gather")

    def gather(self, job: RowJob, plan: Plan, in_range: bool) -> None:
        """job.dense = rows of job.table at job.idx, on the current stream. `in_range`: every index is known (or
        checked at this call) to be in range."""
        raise NotImplementedError

    def scatter(self, job: RowJob, plan: Plan, in_range: bool) -> None:
        """job.table[job.idx] = job.dense (one writer wins per element for duplicates), on the current stream."""
        raise ValueError(f"strategy {self.name!r} has no scatter; use one of {', '.join(scatter_names())}")


def _stream(job: RowJob) -> int:
    return _kernels.raw_stream(job.idx.device)


@register
class Vector(Strategy):
    """Our kernel: the widest aligned loads (up to 16 B), lane groups sized to the row, 128-byte-aligned warp
    windows; odd widths load aligned 16 B words and store bytes."""

    name = "vector"

    def gather(self, job, plan, in_range):
        _kernels.launch_gather(job.table, job.rows, job.row_bytes, job.idx, job.dense, None, _kernels.KERNEL_VECTOR,
                               job.max_sms, _stream(job))

    def scatter(self, job, plan, in_range):
        _kernels.launch_scatter(job.table, job.rows, job.row_bytes, job.idx, job.dense, None,
                                _kernels.KERNEL_VECTOR, job.max_sms, _stream(job))


@register
class Sorted(Strategy):
    """Sorts the indices on the GPU, moves rows in address order, each to/from its original position."""

    name = "sorted"

    def candidate(self, cell):
        return super().candidate(cell) and cell.features.order != "sorted"  # sorting sorted indices is wasted

    def gather(self, job, plan, in_range):
        ordered, perm = _kernels.sort_indices(job.idx, job.rows, in_range)
        _kernels.launch_gather(job.table, job.rows, job.row_bytes, ordered, job.dense, perm,
                               _kernels.KERNEL_VECTOR, job.max_sms, _stream(job))

    def scatter(self, job, plan, in_range):
        ordered, perm = _kernels.sort_indices(job.idx, job.rows, in_range)
        _kernels.launch_scatter(job.table, job.rows, job.row_bytes, ordered, job.dense, perm,
                                _kernels.KERNEL_VECTOR, job.max_sms, _stream(job))


@register
class Dedupe(Strategy):
    """Sorts, gathers each distinct row once (the kernel reads how many on the device: no host synchronisation),
    expands the duplicates on the GPU."""

    name = "dedupe"
    scatter_as = "sorted"
    host_dedupe = True

    def candidate(self, cell):
        # (its extra passes cost more than they save without repeated rows)
        return super().candidate(cell) and cell.call.op == "gather" and cell.features.duplicates >= 0.01

    def gather(self, job, plan, in_range):
        unique, count, inverse = _kernels.dedupe_indices(job.idx, job.rows, in_range)
        buf = torch.empty((job.idx.numel(), job.row_bytes), dtype=torch.uint8, device=job.idx.device)
        _kernels.launch_gather(job.table, job.rows, job.row_bytes, unique, buf, None, _kernels.KERNEL_VECTOR,
                               job.max_sms, _stream(job), count)
        _kernels.expand_rows(buf, inverse, job.dense, job.row_bytes)


@register
class Staged(Strategy):
    """CPU threads gather the rows chunk by chunk into pinned buffers, each chunk's copy to the GPU queued on the
    caller's stream while the next is gathered."""

    name = "staged"
    runs_on = "host"
    checks_on_host = True

    def gather(self, job, plan, in_range):
        _kernels.gather_staged(job.table, job.rows, job.row_bytes,
                               _kernels.staged_index(job.idx, job.row_bytes, job.rows), job.dense,
                               torch.cuda.current_stream())

    def scatter(self, job, plan, in_range):
        _kernels.scatter_staged(job.table, job.rows, job.row_bytes, job.idx, job.dense, torch.cuda.current_stream())


@register
class DedupeStaged(Strategy):
    """torch.unique on the GPU, the distinct rows through ``staged``, the duplicates expanded on the GPU."""

    name = "dedupe_staged"
    runs_on = "host"
    checks_on_host = True
    scatter_as = "staged"
    host_dedupe = True

    def candidate(self, cell):
        # Also without duplicates: its host gather reads the distinct rows in address order, which beat staged's
        # call order by 1.08-1.33x for 1M uniform rows of 47-400 B on 16/48 GiB tables on an H200 host.
        return super().candidate(cell) and cell.call.op == "gather"

    def gather(self, job, plan, in_range):
        # The host needs the distinct indices anyway, so torch.unique's wait for their count costs nothing extra,
        # and only they cross to the host (the device-only dedupe_indices would copy all of them).
        unique, inverse = torch.unique(job.idx, sorted=True, return_inverse=True)
        buf = torch.empty((unique.numel(), job.row_bytes), dtype=torch.uint8, device=job.idx.device)
        _kernels.gather_staged(job.table, job.rows, job.row_bytes,
                               _kernels.staged_index(unique, job.row_bytes, job.rows), buf,
                               torch.cuda.current_stream())
        _kernels.expand_rows(buf, inverse, job.dense, job.row_bytes)


@register
class Split(Strategy):
    """Part kernel (``vector`` or ``sorted``), part ``staged`` on a side stream, at the same time, in proportion to
    their measured rates (:meth:`plan_from_times`). Measured after those three."""

    name = "split"
    runs_on = "host"
    scatter_as = "staged"  # (both halves of a split would compete for the same rows)
    KERNELS = ("vector", "sorted")

    def candidate(self, cell):
        return super().candidate(cell) and cell.call.op == "gather"

    @classmethod
    def plan_from_times(cls, seconds: dict) -> Plan | None:
        """The split plan from the seconds its parts took alone (None until a kernel and staged were timed)."""
        kernel = min((s for s in cls.KERNELS if s in seconds), key=seconds.get, default=None)
        if kernel is None or "staged" not in seconds:
            return None
        gpu, cpu = 1 / max(seconds[kernel], 1e-12), 1 / max(seconds["staged"], 1e-12)
        return Plan(cls.name, gpu / (gpu + cpu), kernel)

    def gather(self, job, plan, in_range):
        idx, n, rb = job.idx, job.idx.numel(), job.row_bytes
        stream = torch.cuda.current_stream()
        k = min(n, max(0, int(round(n * plan.split_fraction))))
        host_rest = _kernels.staged_index(idx[k:], rb, job.rows)  # before the kernel: host_index waits for the stream
        side = _kernels._Side.get(idx.device)
        # The output was allocated on `stream`: the side stream waits for the work queued so far, not for the kernel.
        side.wait_stream(stream)
        rows_out = job.dense.reshape(n, -1)
        if k > 0 and plan.split_kernel == "sorted":
            ordered, perm = _kernels.sort_indices(idx[:k], job.rows, in_range)  # positions 0..k-1: the first k rows
            _kernels.launch_gather(job.table, job.rows, rb, ordered, job.dense, perm, _kernels.KERNEL_VECTOR,
                                   job.max_sms, stream.cuda_stream)
        elif k > 0:
            _kernels.launch_gather(job.table, job.rows, rb, idx[:k], job.dense, None, _kernels.KERNEL_VECTOR,
                                   job.max_sms, stream.cuda_stream)
        if k < n:
            _kernels.gather_staged(job.table, job.rows, rb, host_rest, rows_out[k:], side)
            stream.wait_stream(side)
            job.dense.record_stream(side)


@register
class Naive(Strategy):
    """One warp per row, 4-byte loads: the PyTorch-Direct paper's kernel, a baseline for benchmarks (never
    measured by ``auto``)."""

    name = "naive"

    def candidate(self, cell):
        return False

    def gather(self, job, plan, in_range):
        _kernels.launch_gather(job.table, job.rows, job.row_bytes, job.idx, job.dense, None, _kernels.KERNEL_NAIVE,
                               job.max_sms, _stream(job))

    def scatter(self, job, plan, in_range):
        _kernels.launch_scatter(job.table, job.rows, job.row_bytes, job.idx, job.dense, None,
                                _kernels.KERNEL_NAIVE, job.max_sms, _stream(job))


class _CachedBase(Strategy):
    uses_cache = True
    scatter_as = "vector"

    @staticmethod
    def _cache(job: RowJob) -> RowCache:
        if job.cache is None:
            raise ValueError(
                "the cached strategies need a table with a GPU cache on the indices' device: make one with "
                "pytorch_direct.cached(table, gpu_bytes, ...)"
            )
        return job.cache


@register
class Cached(_CachedBase):
    """Through the table's GPU cache (``pd.cached``): one kernel serves each row from the cache where it is held
    and zero-copy from host memory where not, in the caller's order."""

    name = "cached"

    def gather(self, job, plan, in_range):
        cache = self._cache(job)
        _kernels.launch_cached(job.table, job.rows, job.row_bytes, job.idx, job.dense, None, cache.slot_of_row,
                               cache.rows_buffer, False, job.max_sms, _stream(job))


@register
class CachedSorted(_CachedBase):
    """``cached`` with the indices sorted first: the misses are read from host memory in address order."""

    name = "cached_sorted"

    def candidate(self, cell):
        return super().candidate(cell) and cell.features.order != "sorted"

    def gather(self, job, plan, in_range):
        cache = self._cache(job)
        ordered, perm = _kernels.sort_indices(job.idx, job.rows, in_range)
        _kernels.launch_cached(job.table, job.rows, job.row_bytes, ordered, job.dense, perm, cache.slot_of_row,
                               cache.rows_buffer, False, job.max_sms, _stream(job))


STRATEGIES = ("auto", *REGISTRY)
"""The names a call may pass: ``auto`` (measured per kind of call, ``_auto``) and every registered strategy."""


def scatter_names() -> tuple[str, ...]:
    """The strategies with a scatter of their own."""
    return tuple(name for name, s in REGISTRY.items() if s.scatter_as is None and type(s).scatter is not
                 Strategy.scatter)


def check_name(name: str, what: str = "strategy") -> str:
    if name not in STRATEGIES:
        raise ValueError(f"{what}={name!r} is not one of {', '.join(STRATEGIES)}")
    return name


def set_strategy(strategy: str) -> None:
    """Default strategy for calls that pass none (one of :data:`STRATEGIES`); mirrors ``PYTORCH_DIRECT_STRATEGY``."""
    settings.set("strategy", check_name(strategy))


def get_strategy() -> str:
    return settings.strategy


check_name(settings.strategy, "PYTORCH_DIRECT_STRATEGY")  # (read from the environment at import)


# ---------------------------------------------------------------------------------------------------- running


def scatter_plan(plan: Plan) -> Plan:
    """The plan a scatter runs for `plan`: its own, or its ``scatter_as`` (dedupe -> sorted, split -> staged...)."""
    target = plan.kind.scatter_as
    return plan if target is None else Plan(target)


def run(job: RowJob, plan: Plan, *, check_bounds: bool, in_range: bool) -> None:
    """Carries out `plan` on `job`. `check_bounds`: make the sync-mode bounds check this plan needs (IndexError at
    the call; for a gather on the device it overlaps the gather, ``_kernels.bounds_checked``; a scatter writes
    nothing when an index is bad). `in_range`: the indices were checked already."""
    with _kernels.on_device(job.idx.device):
        if job.op == "scatter":
            plan = scatter_plan(plan)
            strategy = plan.kind
            if check_bounds and not strategy.checks_on_host:
                _kernels.precheck(job.idx, job.rows)
            strategy.scatter(job, plan, in_range or check_bounds)
            return
        strategy = plan.kind
        if not check_bounds:
            strategy.gather(job, plan, in_range)
        elif strategy.runs_on == "host":
            if not strategy.checks_on_host:
                _kernels.precheck(job.idx, job.rows)
            strategy.gather(job, plan, True)
        else:
            with _kernels.bounds_checked(job.idx, job.rows):
                strategy.gather(job, plan, True)
