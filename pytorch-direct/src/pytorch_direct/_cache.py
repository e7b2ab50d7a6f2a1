"""Layer 3: a GPU cache of a table's hot rows (:func:`cached`). Gathers of the table serve the cached rows from GPU
memory and the others zero-copy from host memory, in one kernel; the package's writes to the table keep the cached
copies equal to the table's rows.

A cache belongs to the table's memory: every gather of that memory with the same row width (``table[idx]``,
``pd.gather``, ``F.embedding``, a ``UnifiedFeatureStore``, inside ``torch.compile`` and CUDA graphs) finds it by the
table's address, so code that only ever sees the table gets it. It lives as long as the tensor it was made for (or
the :class:`RowCache` object, whichever lives longer), or until :meth:`RowCache.release`.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
import weakref
from collections.abc import Iterable

import torch
from torch import Tensor

from . import _kernels, _memory

log = logging.getLogger("pytorch_direct")

# Bytes after the last cached row: the unaligned kernel loads whole aligned 16-byte words around a row.
SLACK = 16
_ATTRIBUTE = "_pytorch_direct_cache"
# The live caches by the address of their table's first row.
_CACHES: dict[int, weakref.ref] = {}
# Indices a counting cache adds to its counts per gather, at most. Counting is one atomic add per index, and on a
# skewed stream most of them hit the same few rows and wait for each other: counting every index of 1M-row Zipf 1.3
# batches took longer than the cached gather itself (a counting cache ran at 0.85x the uncached gather, one filled
# from a pre-sampling pass of the same stream at 3.4x, at the same 99.5% hit rate). A strided sample of this many
# indices per call estimates the same frequencies within a few calls.
COUNT_SAMPLE = 1 << 14


def count_sample(idx: Tensor, offset: int = 0) -> tuple[Tensor, float, int]:
    """(indices to count, the weight of each, the next call's offset) for a gather of the 1-D indices `idx`: all of
    them, weight 1, when there are at most COUNT_SAMPLE; else every step-th index from `offset` (COUNT_SAMPLE of
    them), each weighing len(idx) / COUNT_SAMPLE, so that the counts stay in gathered rows. The offset turns from
    call to call so that every position of a batch is counted in turn."""
    n = idx.numel()
    if n <= COUNT_SAMPLE:
        return idx, 1.0, offset
    step = n // COUNT_SAMPLE
    offset %= step
    return idx[offset::step][:COUNT_SAMPLE], n / COUNT_SAMPLE, offset + 1


def _callers_level() -> int:
    """The ``stacklevel`` (for a warning issued by the function calling this) of the first frame outside
    pytorch-direct and torch: the user's line, whichever way (``pd.gather``, ``table[idx]``, a loader) led here."""
    skip = (os.path.dirname(__file__), os.path.dirname(torch.__file__))
    level, frame = 2, sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1
    return level


class RowCache:
    """The hot rows of one table on one device (see :func:`cached`). Holds, on `device`: a slot per table row
    (int32, -1 where not cached), the cached rows, the table row of each slot (int64) and, with counting, a count per
    table row (float32). :attr:`bytes` is what they take, never more than the budget it was made with."""

    def __init__(self, table: Tensor, gpu_bytes: int, device: torch.device, count: bool) -> None:
        with torch._C.DisableTorchFunctionSubclass():
            plain = table.detach()
            rows, rb = _kernels.row_layout(plain)
        if rb == 0 or rows == 0:
            raise ValueError("a cache needs a table with rows of at least one byte")
        fixed = rows * 4 * (2 if count else 1) + SLACK  # the slot map (+ the counts)
        per_row = rb + 8
        if gpu_bytes < fixed + per_row:
            raise ValueError(
                f"gpu_bytes={gpu_bytes} is too small for a cache of this table: its slot map alone takes {fixed} "
                f"bytes (4 per table row{', 8 with count=True' if count else ''}) and each cached row {per_row}: "
                f"give at least {fixed + per_row}, e.g. 5% of the table ({rows * rb // 20} bytes)"
            )
        self.table = plain  # (keeps the memory alive: its address is this cache's key)
        self.rows, self.row_bytes, self.device = rows, rb, device
        self.capacity = min(rows, (gpu_bytes - fixed) // per_row)
        self.budget = int(gpu_bytes)
        self.slot_of_row = torch.full((rows,), -1, dtype=torch.int32, device=device)
        self.row_of_slot = torch.empty(self.capacity, dtype=torch.int64, device=device)
        self.rows_buffer = torch.empty(self.capacity * rb + SLACK, dtype=torch.uint8, device=device)
        self.counts = torch.zeros(rows, dtype=torch.float32, device=device) if count else None
        self._count_offset = 0  # where the next call's count sample starts (count_sample)
        self.cached_rows = 0
        # Scores that fill the slots a fill's frequency leaves empty (kept on the host: not the cache's device
        # memory), and how many rows the last fill took from each source.
        self.top_up: Tensor | None = None
        self.filled_from = {"frequency": 0, "top_up": 0}
        self._key = plain.data_ptr()
        self.released = False
        self._bypass_warned = False

    def warn_bypassed(self, device: torch.device) -> None:
        """A gather whose indices are on another device than this cache reads every row from host memory: a cache
        that silently serves nothing. Said once per cache."""
        if self._bypass_warned:
            return
        self._bypass_warned = True
        warnings.warn(f"pytorch_direct: this table's row cache is on {self.device}, but a gather's indices are on "
                      f"{device}: such gathers read every row from host memory and the cache serves none of them; "
                      f"put the indices on {self.device} (idx.to('{self.device}'))", stacklevel=_callers_level())

    # ------------------------------------------------------------------------------------------------ state

    @property
    def bytes(self) -> int:
        """Device memory this cache holds (slot map, rows, row of each slot, counts)."""
        held = [self.slot_of_row, self.row_of_slot, self.rows_buffer]
        if self.counts is not None:
            held.append(self.counts)
        return sum(t.numel() * t.element_size() for t in held)

    def stats(self) -> dict:
        """``rows`` (of the table), ``capacity`` and ``cached_rows`` (rows the cache holds), ``row_bytes``,
        ``bytes`` (device memory held), ``budget``, ``device``, ``counting``."""
        return {"rows": self.rows, "capacity": self.capacity, "cached_rows": self.cached_rows,
                "row_bytes": self.row_bytes, "bytes": self.bytes, "budget": self.budget, "device": str(self.device),
                "counting": self.counts is not None, "filled_from": dict(self.filled_from)}

    def hit_rate(self, index: Tensor) -> float:
        """The fraction of `index` this cache holds (one reduction and a host round trip). An index outside the
        table raises ``IndexError``, as a gather's does (negative ones are not wrapped)."""
        self._check_live("hit_rate()")
        _kernels.check_index(index)
        if index.numel() == 0:
            return 0.0
        _kernels.precheck(index, self.rows)
        slots = self.slot_of_row[index.reshape(-1).to(self.device)]
        return float((slots >= 0).float().mean())

    def rows_view(self) -> Tensor:
        """The cached rows as a (capacity, row_bytes) uint8 tensor (the first ``cached_rows`` are in use)."""
        return self.rows_buffer[: self.capacity * self.row_bytes].view(self.capacity, self.row_bytes)

    # ------------------------------------------------------------------------------------------------ filling

    def _scores(self, frequency: Tensor, what: str, device: torch.device | str | None = None) -> Tensor:
        """`frequency` checked, as a new float32 tensor on `device` (default: the cache's) with NaN scores as 0."""
        if not isinstance(frequency, Tensor) or frequency.shape != (self.rows,):
            got = tuple(frequency.shape) if isinstance(frequency, Tensor) else type(frequency).__name__
            raise ValueError(f"{what} must be a tensor with one number per table row, shape ({self.rows},); "
                             f"got {got}")
        if frequency.dtype == torch.bool or frequency.is_complex():
            raise TypeError(f"{what} must be real numbers (counts, degrees), got {frequency.dtype}")
        scores = frequency.detach().to(self.device if device is None else device, torch.float32)
        # A NaN score says nothing about a row (a ratio such as hits / visits of a row never visited): it ranks
        # lowest, as a score of 0, and is never cached. topk ranks NaN above every number, so left as it is the
        # NaN rows would take the slots of the hottest rows.
        return scores.masked_fill(scores.isnan(), 0.0)

    def set_top_up(self, top_up: Tensor | None) -> None:
        """Scores (one per table row, e.g. node degree) that fill the slots a later fill's frequency leaves empty:
        a pre-sampling pass or counts of a few batches see a small part of the table (0.2-4% of its rows in the
        cache benchmark), and the rest of the budget would hold nothing. Kept in host memory. None: no top-up."""
        if top_up is not None:
            # (checked now, not at the next fill; a new tensor: the caller's is theirs)
            top_up = self._scores(top_up, "top_up", "cpu")
        self.top_up = top_up

    def fill(self, frequency: Tensor, top_up: Tensor | None = None) -> None:
        """Caches the rows with the highest `frequency` (one number per table row: degree, counts from a sampling
        pass, ...; rows scored 0 or less, or NaN, are never cached), as many as fit, replacing what was cached.
        Slots left over (fewer rows scored above 0 than fit) go to the rows with the highest `top_up` score among
        the others (`top_up` given here, else the one set with :meth:`set_top_up` or ``cached(top_up=...)``); how
        many rows came from each is logged and kept in ``stats()["filled_from"]``."""
        self._check_live("fill()")
        scores = self._scores(frequency, "frequency")
        if top_up is not None:
            self.set_top_up(top_up)
        k = min(self.capacity, int((scores > 0).sum()))
        hot = torch.topk(scores, k, sorted=False).indices if k else scores.new_empty(0, dtype=torch.int64)
        extra = 0
        if k < self.capacity and self.top_up is not None:
            rest = self.top_up.to(self.device, copy=True)  # (a copy: the stored scores stay as given)
            rest[hot] = 0.0  # (rows already chosen are not chosen twice)
            extra = min(self.capacity - k, int((rest > 0).sum()))
            if extra:
                hot = torch.cat([hot, torch.topk(rest, extra, sorted=False).indices])
        self.filled_from = {"frequency": k, "top_up": extra}
        if k + extra == 0:
            warnings.warn("pytorch_direct: the cache was filled with no rows (every frequency is 0 or less, or NaN): "
                          "it holds its device memory and serves no gather; pass a frequency with positive scores "
                          "(degree, pd.count_rows over a few batches) or a top_up", stacklevel=3)
        elif k + extra < self.capacity:
            log.info("pytorch_direct: cache filled with %d rows of the %d it has room for: %d from the frequency, "
                     "%d from the top-up; no other row has a positive score", k + extra, self.capacity, k, extra)
        elif extra:
            log.info("pytorch_direct: cache filled with %d rows: %d from the frequency (every row it scored above "
                     "0), %d from the top-up", k + extra, k, extra)
        self._load(torch.sort(hot).values)

    def refill(self, frequency: Tensor | None = None) -> None:
        """:meth:`fill` from `frequency`, or from the counts of the gathers seen so far (``count=True``); the counts
        are then halved, so that later calls weigh as much as all the earlier ones. The top-up (if set) fills what
        either leaves."""
        self._check_live("refill()")
        if frequency is not None:
            self.fill(frequency)
            return
        if self.counts is None:
            raise ValueError("refill() without frequency needs a cache made with count=True (it counts the rows "
                             "gathered); or pass frequency=")
        self.fill(self.counts)
        self.counts.mul_(0.5)

    def refresh(self) -> None:
        """Reads every cached row again from the table: after writes to its memory that did not go through the
        package's row operations (torch ops on ``table.plain()``, ``copy_``, the tensor registered in place)."""
        if self.cached_rows:
            self._load(self.row_of_slot[: self.cached_rows].clone())

    def _check_live(self, what: str) -> None:
        if self.released:
            raise RuntimeError(f"{what} on a released cache: it holds no device memory and no gather uses it; make a "
                               f"new one with pytorch_direct.cached(table, gpu_bytes, ...)")

    def release(self) -> None:
        """Frees the device memory; gathers of the table read host memory only again. The cache cannot be filled
        again (``fill``, ``refill`` and ``hit_rate`` raise): make a new one."""
        self.released = True
        ref = _CACHES.get(self._key)
        if ref is not None and ref() is self:
            del _CACHES[self._key]
        self.cached_rows = self.capacity = 0
        self.slot_of_row = self.row_of_slot = self.rows_buffer = torch.empty(0, dtype=torch.uint8)
        self.counts = None

    def _load(self, hot: Tensor) -> None:
        """Caches the rows `hot` (ascending, on the device), slots in that order."""
        k = hot.numel()
        self.slot_of_row.fill_(-1)
        self.cached_rows = k
        if k == 0:
            return
        self.row_of_slot[:k] = hot
        self.slot_of_row[hot] = torch.arange(k, dtype=torch.int32, device=self.device)
        dest = self.rows_view()[:k]
        if self.device.type == "cuda":
            with _kernels.on_device(self.device):  # ascending rows: the table is read in address order
                _kernels.launch_gather(self.table, self.rows, self.row_bytes, hot, dest, None,
                                       _kernels.KERNEL_VECTOR, 0, _kernels.raw_stream(self.device))
        else:
            _kernels.gather_host(self.table, self.rows, self.row_bytes, hot, dest, dedupe=False)

    # ------------------------------------------------------------------------------------------------ calls

    def count(self, idx: Tensor) -> None:
        """Adds the rows of a gather (1-D indices on the device) to the counts, if counting: every index of a call
        of at most COUNT_SAMPLE rows, else an evenly strided sample of COUNT_SAMPLE of them, each weighing for the
        indices it stands for (:func:`count_sample`)."""
        if self.counts is not None and idx.numel():
            sample, weight, self._count_offset = count_sample(idx, self._count_offset)
            ones = torch.ones(sample.numel(), dtype=torch.float32, device=idx.device)
            self.counts.index_add_(0, sample, ones, alpha=weight)

    def gather_host(self, idx: Tensor, out: Tensor, rows: int | None = None) -> None:
        """out (n rows, contiguous) = the table's rows at idx (1-D CPU indices, checked here against ``rows``: the
        rows of the tensor gathered from, a view of the table's first rows perhaps; default all of them) for a
        cache on the CPU: cached rows from the cache, the others from the table."""
        n, rb = idx.numel(), self.row_bytes
        _kernels.check_host_indices(idx, self.rows if rows is None else rows)
        self.count(idx)
        flat = out.reshape(-1).view(torch.uint8).view(n, rb)
        slots = self.slot_of_row[idx].long()
        hit = slots >= 0
        flat[hit] = self.rows_view()[slots[hit]]
        miss = (~hit).nonzero().squeeze(1)
        if miss.numel():
            rows = torch.empty((miss.numel(), rb), dtype=torch.uint8)
            _kernels.gather_host(self.table, self.rows, rb, idx[miss].contiguous(), rows, dedupe=False)
            flat[miss] = rows

    def after_write(self, idx: Tensor) -> None:
        """The rows at idx (1-D, any device) were written in the table: their cached copies are read again (on
        the device's current stream, after the write). Bad indices are skipped (the write raised for them)."""
        if self.cached_rows == 0 or idx.numel() == 0:
            return
        idx = idx.to(self.device)
        if self.device.type == "cuda":
            with _kernels.on_device(self.device):
                _kernels.launch_cached(self.table, self.rows, self.row_bytes, idx, self.rows_buffer, None,
                                       self.slot_of_row, self.rows_buffer, True, 0, _kernels.raw_stream(self.device))
            return
        idx = idx[(idx >= 0) & (idx < self.rows)]
        slots = self.slot_of_row[idx].long()
        hit = slots >= 0
        rows = idx[hit].contiguous()
        if rows.numel():
            fresh = torch.empty((rows.numel(), self.row_bytes), dtype=torch.uint8)
            _kernels.gather_host(self.table, self.rows, self.row_bytes, rows, fresh, dedupe=False)
            self.rows_view()[slots[hit]] = fresh

    def __repr__(self) -> str:
        return (f"RowCache({self.cached_rows}/{self.rows} rows of {self.row_bytes} B on {self.device}, "
                f"{self.bytes / 2**20:.1f} MiB)")


def cache_for(table: Tensor, rows: int, row_bytes: int) -> RowCache | None:
    """The live cache of the memory `table` starts at, if its rows are `row_bytes` wide and `table` has no more
    rows than it (a view of the cached table's first rows)."""
    if not _CACHES:
        return None
    ref = _CACHES.get(table.data_ptr())
    cache = ref() if ref is not None else None
    if cache is None or cache.row_bytes != row_bytes or rows > cache.rows:
        return None
    return cache


def caches_in(table: Tensor) -> list[RowCache]:
    """The live caches whose table lies in `table`'s storage (for writes through any view of it)."""
    if not _CACHES:
        return []
    with torch._C.DisableTorchFunctionSubclass():
        storage = table.untyped_storage()
        start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    found = []
    for ref in list(_CACHES.values()):
        cache = ref()
        if cache is not None and start <= cache._key < end:
            found.append(cache)
    return found


def cached(table: Tensor, gpu_bytes: int, *, frequency: Tensor | None = None, count: bool = False,
           top_up: Tensor | None = None, device: str | torch.device | None = None) -> RowCache:
    """Keeps the hottest rows of `table` (a unified tensor) in `device` memory within `gpu_bytes` bytes, and returns
    the :class:`RowCache`. From then on every gather of the table with indices on that device (``table[idx]``,
    ``pd.gather``, ``F.embedding``, ``UnifiedFeatureStore``; eager, ``torch.compile`` and CUDA graphs) serves the
    cached rows from device memory and the others zero-copy from host memory, in one kernel. Results are exact.

    Which rows: `frequency`, one number per table row (node degree, counts from a sampling pass over a few batches:
    :func:`count_rows`), the highest first (rows scored 0 or less, or NaN, never); and/or ``count=True``: the cache
    counts the rows it is asked for (a bounded sample of each large call's indices, :meth:`RowCache.count`), and
    :meth:`RowCache.refill` re-selects from those counts (e.g. after the first epoch). Without either it is an
    error: an empty cache would only cost memory. `top_up`: scores (one per row, e.g. node degree) that fill the
    budget the frequency or the counts leave: a pre-sampling pass or a few batches' counts see only a small part of
    the table, so without it most of the budget holds nothing (what filled the cache is logged, and in
    :meth:`RowCache.stats`). With ``count=True`` and a `top_up` but no frequency, the cache starts filled from the
    top-up.

    The budget covers everything the cache holds on the device: 4 bytes per table row for the slot map (8 with
    counting) and the row width + 8 bytes per cached row. Filling briefly needs the frequency on the device too.

    Writes through the package's row operations (``table[idx] = v``, ``index_copy_``, ``index_add_``,
    ``pd.scatter_``, ``pd.index_add_``) and in-place torch ops on the unified tensor keep the cached copies equal to
    the table. Writes through other aliases of its memory (``table.plain()``, the tensor registered in place by
    ``pd.unified(t)``) are not seen: call :meth:`RowCache.refresh` after them.

    `device`: where the copies live (default: the current CUDA device, or the CPU where CUDA is not usable, where
    the cache serves CPU indices and exists for testing). Forced strategies (``strategy="vector"``, ...) read
    host memory only; ``"auto"`` and the cached strategies use the cache."""
    if not isinstance(table, Tensor):
        raise TypeError(f"cached() takes a table (a unified tensor), got {type(table).__name__}")
    _kernels.check_table(table)
    if isinstance(gpu_bytes, bool) or not isinstance(gpu_bytes, int) or gpu_bytes <= 0:
        raise ValueError(f"gpu_bytes must be a positive number of bytes, got {gpu_bytes!r}")
    if frequency is None and not count:
        raise ValueError("cached() needs frequency= (one number per row: node degree, or pd.count_rows(batches)) "
                         "or count=True (count the rows gathered and refill() later)")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if _memory.cuda_usable() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and not _memory.cuda_usable():
        raise RuntimeError(f"cached(device={str(device)!r}): no usable CUDA GPU here (or pytorch-direct was built "
                           f"without CUDA); leave device unset or pass device='cpu'")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":
        with torch._C.DisableTorchFunctionSubclass():
            _kernels.table_for_device(table.detach(), device.index)
    elif device.type != "cpu":
        raise ValueError(f"a cache lives on a CUDA device or the CPU, not on {device}")
    with torch._C.DisableTorchFunctionSubclass():
        key = table.data_ptr()
    old = _CACHES.get(key)
    if old is not None and old() is not None:
        raise ValueError("this table has a cache already: release() it first, or refill() it")
    cache = RowCache(table, int(gpu_bytes), device, count)
    cache.set_top_up(top_up)
    if frequency is not None:
        cache.fill(frequency)
    elif top_up is not None:
        cache.fill(torch.zeros(cache.rows))
    _CACHES[key] = weakref.ref(cache, lambda _, key=key: _forget(key))
    table.__dict__[_ATTRIBUTE] = cache  # lives as long as the tensor (and the returned object)
    log.debug("pytorch_direct: %r", cache)
    return cache


def _forget(key: int) -> None:
    ref = _CACHES.get(key)
    if ref is not None and ref() is None:
        del _CACHES[key]


def count_rows(batches: Iterable[Tensor], rows: int, *, device: str | torch.device | None = None) -> Tensor:
    """How often each of `rows` rows occurs in `batches` (index tensors, e.g. the node ids of a few sampled
    mini-batches): a pre-sampling pass for :func:`cached`'s frequency. float32, on `device` (default: the first
    batch's device)."""
    counts = None
    for batch in batches:
        _kernels.check_index(batch, "a batch")
        flat = batch.reshape(-1)
        if counts is None:
            counts = torch.zeros(rows, dtype=torch.float32, device=device if device is not None else flat.device)
        flat = flat.to(counts.device)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= rows):
            raise IndexError(f"a batch holds a row index outside 0..{rows - 1}")
        counts.index_add_(0, flat, torch.ones(flat.numel(), dtype=torch.float32, device=counts.device))
    if counts is None:
        raise ValueError("count_rows() needs at least one batch")
    return counts
