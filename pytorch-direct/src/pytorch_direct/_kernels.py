"""Layer 2: executing one row operation with a strategy that was already decided (a :class:`Plan`).

Everything here takes plain tensors: a host table (pinned or registered for CUDA indices), 1-D contiguous indices
and a dense output (gather) or source (scatter) of ``count`` rows. Which plan to run is decided by ``_strategy``;
this module only carries it out: the kernel launches (``vector``, ``naive``, ``sorted``), the deduplicating gather
(``dedupe``: each distinct row crosses PCIe once, duplicates are expanded on the GPU), the CPU gather into pinned
buffers with pipelined copies (``staged``, ``dedupe_staged``) and the mix of both (``split``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading

import torch
from torch import Tensor

from . import _core, _memory
from ._config import settings

INDEX_DTYPES = (torch.int32, torch.int64)
_KIND = {"vector": 0, "naive": 1}

GATHER_PLANS = ("vector", "naive", "sorted", "dedupe", "staged", "dedupe_staged", "split")
SCATTER_PLANS = ("vector", "naive", "sorted", "staged")
# Plans that copy indices to the host and wait for the stream: impossible inside CUDA graph capture.
HOST_PLANS = ("staged", "dedupe_staged", "split")
# Plans that read every index on the host, which raises IndexError for a bad one: no device-side check needed.
HOST_CHECKED_PLANS = ("staged", "dedupe_staged")


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one call moves its rows. ``split_fraction`` and ``split_kernel`` only matter for ``split``: the share of
    rows the kernel moves (the rest go through ``staged`` on a side stream at the same time), and whether that
    kernel sorts its indices first."""

    strategy: str
    split_fraction: float = 0.5
    split_kernel: str = "vector"

    def __post_init__(self) -> None:
        if self.strategy not in GATHER_PLANS:
            raise ValueError(f"unknown plan {self.strategy!r}; one of {', '.join(GATHER_PLANS)}")
        if not 0.0 <= self.split_fraction <= 1.0 or self.split_kernel not in ("vector", "sorted"):
            raise ValueError(f"bad split parameters in {self}")

    @property
    def needs_host(self) -> bool:
        return self.strategy in HOST_PLANS


class _Side:
    """One side stream per device for the staged half of a split gather."""

    streams: dict = {}

    @classmethod
    def get(cls, device: torch.device) -> torch.cuda.Stream:
        stream = cls.streams.get(device.index)
        if stream is None:
            stream = cls.streams[device.index] = torch.cuda.Stream(device=device)
        return stream


NATIVE_STAGED_MAX_ROW = 256
"""Widest row (bytes) the staged gather moves with the package's own pipeline rather than torch's index_select."""


class _Slots:
    """Pinned staging slots (and an event per slot: when its last copy finished) for the staged gather whose host
    gather is torch's ``index_select`` (torch's OpenMP threads), one set per device; one such call at a time.

    A chunk fills one slot. On an H200 host (benchmarks/RESULTS.md, run F) 8 MiB chunks beat 4 MiB ones by 0-9 %
    (each ``index_select`` call and each copy costs ~15 us on the host), and chunks growing from 1 MiB (to start
    the DMA sooner) did not measure better (run F2)."""

    COUNT = 4
    BYTES = 8 << 20
    per_device: dict = {}
    lock = threading.Lock()

    @classmethod
    def get(cls, device: torch.device) -> tuple[list[Tensor], list[torch.cuda.Event]]:
        slots = cls.per_device.get(device.index)
        if slots is None:
            buffers = [torch.empty(cls.BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(cls.COUNT)]
            events = [torch.cuda.Event() for _ in range(cls.COUNT)]
            slots = cls.per_device[device.index] = (buffers, events)
        return slots

    @classmethod
    def chunks(cls, count: int, row_bytes: int):
        """(start, end) row ranges of a staged call: as many rows as fit a slot, at least one."""
        per_chunk = max(1, cls.BYTES // row_bytes)
        for start in range(0, count, per_chunk):
            yield start, min(count, start + per_chunk)


# ---------------------------------------------------------------------------------------------------- checks


def row_layout(table: Tensor) -> tuple[int, int]:
    """(rows, row_bytes) of a table whose rows are contiguous along dim 0."""
    if table.dim() == 0:
        raise ValueError("the table is a 0-d tensor: rows are indexed along dim 0, so it needs at least 1 dimension")
    if not table.is_contiguous():
        raise ValueError(
            "the table is not contiguous, so its rows are not contiguous byte ranges: index a contiguous "
            "unified tensor (pytorch_direct.unified(t.contiguous())) and slice columns after the gather"
        )
    rows = table.shape[0]
    row_elems = 1
    for s in table.shape[1:]:
        row_elems *= s
    return rows, row_elems * table.element_size()


def check_index(index: Tensor, what: str = "index") -> None:
    if not isinstance(index, Tensor):
        raise TypeError(f"{what} must be a torch.Tensor of int32 or int64, got {type(index).__name__}")
    if index.dtype not in INDEX_DTYPES:
        raise TypeError(
            f"{what} has dtype {index.dtype}; row indices must be int32 or int64 (convert with .long(); "
            "for a boolean mask use mask.nonzero().squeeze(1))"
        )


def check_table(table: Tensor) -> None:
    if not isinstance(table, Tensor):
        raise TypeError(f"the table must be a torch.Tensor (a unified tensor), got {type(table).__name__}")
    if table.device.type != "cpu":
        raise ValueError(
            f"the table is on {table.device}; a unified tensor lives in host memory: create it with "
            "pytorch_direct.unified(t.cpu()) and index it with CUDA indices to get CUDA rows"
        )
    if _memory.forked:
        _memory.check_readable_here(table)


def table_for_device(table: Tensor, device: int) -> str:
    """The kind of host memory `table` is in ("managed" or "pinned": pinned, registered, or page-locked by someone
    else); raises unless GPU `device` can read it."""
    if not _core.kernels_compiled():
        raise _core.UnavailableError(
            "pytorch_direct was built without CUDA kernels, so CUDA indices cannot be used: reinstall with nvcc "
            "available (SHARED_CUDA_CUDA=ON), or pass CPU indices"
        )
    nbytes = table.numel() * table.element_size()
    if device not in _UVA_CHECKED:
        props = _core.device_properties(device) or {}
        if not props.get("host_pointer_is_device_pointer", False):
            raise _core.UnavailableError(
                f"GPU {device} cannot address registered host memory by its host pointer "
                "(cudaDevAttrCanUseHostPointerForRegisteredMem is 0), which pytorch_direct's kernels need"
            )
        _UVA_CHECKED.add(device)
    # Our own allocations and registrations are known without a CUDA call; anything else (e.g. memory pinned by
    # torch) is asked of the driver.
    kind = _memory.host_kind(table)
    if kind:
        return kind
    if not _core.is_device_accessible_host(table.data_ptr(), nbytes):
        raise ValueError(
            "the table is not in pinned or registered host memory, so the GPU cannot read it: wrap it once with "
            "pytorch_direct.unified(t) (registers in place) or pytorch_direct.unified(t, copy=True)"
        )
    return "pinned"


_UVA_CHECKED: set = set()


def raise_pending_device_error() -> None:
    """Raises IndexError for a bad index a kernel recorded since the last check (async bounds checking)."""
    if not _core.kernels_compiled():
        return
    bad = _core.take_device_error()
    if bad is not None:
        raise IndexError(
            f"an earlier gather/scatter on the GPU saw index {bad}, out of range for its table; its row was "
            "skipped (left unwritten). Set pytorch_direct.set_bounds_check('sync') to raise at the call"
        )


def on_device(device: torch.device):
    """torch.cuda.device(device), or nothing to do when it is current already (the common case, a few us saved)."""
    if device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def raw_stream(device: torch.device) -> int:
    """The handle of `device`'s current CUDA stream (the current device's for an index-less device). torch's raw
    getter costs ~0.3 us; ``torch.cuda.current_stream()`` ~5 us (probe P5), paid twice per gather before."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch._C._cuda_getCurrentRawStream(index)


def capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


def bounds_error(bad: int, rows: int) -> IndexError:
    return IndexError(
        f"index {bad} is out of range for a table of {rows} rows (valid: 0..{rows - 1}); negative indices are not "
        "wrapped"
    )


def check_host_indices(idx: Tensor, rows: int) -> None:
    """Raises IndexError naming the first bad index of 1-D contiguous CPU indices."""
    _core.check_host_indices(idx.data_ptr(), idx.element_size(), idx.numel(), rows, _host_threads())


def precheck(index: Tensor, rows: int) -> None:
    """Sync-mode bounds check: the smallest and largest index, read on the host. CUDA indices take one kernel of the
    package's and a wait for the stream; on an H200 host torch's ``aminmax`` + ``stack`` + ``tolist()`` took
    ~140 us per call this way (probe P5, benchmarks/RESULTS.md), a quarter of a 131072-row gather of small rows."""
    n = index.numel()
    if n == 0:
        return
    if index.is_cuda and _core.kernels_compiled():
        idx = index if index.is_contiguous() else index.contiguous()
        with on_device(idx.device):
            lo, hi = _core.index_bounds_cuda(idx.data_ptr(), idx.element_size(), n, raw_stream(idx.device))
    else:
        lo, hi = torch.stack(torch.aminmax(index)).tolist()
    if lo < 0 or hi >= rows:
        raise bounds_error(lo if lo < 0 else hi, rows)


def precheck_for(plan: Plan, index: Tensor, rows: int) -> None:
    """The sync-mode bounds check that `plan` needs before it runs: none for plans that read every index on the host
    (they raise IndexError as they read it)."""
    if plan.strategy not in HOST_CHECKED_PLANS:
        precheck(index, rows)


def gather_cuda_checked(table: Tensor, rows: int, rb: int, idx: Tensor, out: Tensor, plan: Plan,
                        max_sms: int) -> None:
    """:func:`gather_cuda` with the sync-mode bounds check `plan` needs; IndexError for a bad index, at this call.

    For plans that run on the device only, the check overlaps the gather: its reduction is queued, then the gather
    (whose kernels skip a bad row and never touch it), and the host waits for the reduction alone. Checked first and
    then launched, the GPU sat idle for the host's round trip between the two, ~20-30 us per call (probe P5), a tenth
    of a 131072-row gather of small rows. A bad index still raises here; the gather's output is then discarded, and
    the kernels' own record of the row is cleared so that the next call does not raise it again."""
    if plan.needs_host:
        precheck_for(plan, idx, rows)
        gather_cuda(table, rows, rb, idx, out, plan, max_sms, True)
        return
    with on_device(idx.device):
        _core.index_bounds_start(idx.data_ptr(), idx.element_size(), idx.numel(), raw_stream(idx.device))
        try:
            gather_cuda(table, rows, rb, idx, out, plan, max_sms, True)
        finally:
            lo, hi = _core.index_bounds_finish()
        if lo < 0 or hi >= rows:
            torch.cuda.current_stream().synchronize()
            _core.take_device_error()
            raise bounds_error(lo if lo < 0 else hi, rows)


# ---------------------------------------------------------------------------------------------------- helpers


_spin_applied: int | None = None


def _host_threads() -> int:
    """The package's CPU thread count for a host call, after giving its pool the current spin setting (a setter in
    ``_config`` cannot reach the native pool: that layer imports nothing)."""
    global _spin_applied
    if _spin_applied != settings.host_spin_us:
        _core.set_host_spin_us(settings.host_spin_us)
        _spin_applied = settings.host_spin_us
    return settings.threads


def host_index(idx: Tensor) -> Tensor:
    """The indices on the host for the staged strategy: through a pinned buffer (torch's caching host allocator),
    about 5x faster than a pageable .cpu() copy; waits for the current stream (the indices may be made there)."""
    host = torch.empty(idx.shape, dtype=idx.dtype, pin_memory=True)
    host.copy_(idx, non_blocking=True)
    torch.cuda.current_stream(idx.device).synchronize()
    return host


def sort_indices(idx: Tensor, rows: int, checked: bool) -> tuple[Tensor, Tensor]:
    """Indices in ascending order and the position each came from (stable: equal indices keep their order). With
    every index already checked in range and row numbers below 2^31, the keys are sorted as int32: the radix sort
    makes half the passes. (Unchecked int64 indices keep their width: narrowing could turn a bad index into a valid
    one.)"""
    if checked and idx.dtype == torch.int64 and rows <= 2**31:
        idx = idx.to(torch.int32)
    ordered, perm = torch.sort(idx, stable=True)
    return ordered, perm


def dedupe_indices(idx: Tensor, rows: int, checked: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(unique, count, inverse) of non-empty 1-D indices with static shapes and no host synchronisation, so it runs
    inside CUDA graph capture: ``unique[:count]`` are the distinct indices in ascending order (the entries past
    ``count`` are unspecified), ``count`` a 1-element tensor on their device and ``idx[i] == unique[inverse[i]]``."""
    ordered, perm = sort_indices(idx, rows, checked)
    n = ordered.numel()
    first = torch.empty(n, dtype=torch.bool, device=idx.device)  # first of a run of equal indices
    first[:1] = True
    torch.ne(ordered[1:], ordered[:-1], out=first[1:])
    run = torch.cumsum(first, 0) - 1  # which distinct index each sorted position holds
    unique = torch.empty_like(ordered)
    unique.index_put_((run,), ordered)  # a run's entries all write the same value
    inverse = torch.empty_like(run)
    inverse[perm] = run
    return unique, run[-1:] + 1, inverse


def _word_rows(t: Tensor, n: int, row_bytes: int) -> Tensor:
    """`t`'s bytes as n rows of the widest integer words dividing the row (a faster device copy than bytes)."""
    flat = t.reshape(-1).view(torch.uint8)
    for width, dtype in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if row_bytes % width == 0 and flat.data_ptr() % width == 0:
            return flat.view(dtype).view(n, row_bytes // width)
    return flat.view(n, row_bytes)


def expand_rows(buf: Tensor, inverse: Tensor, out: Tensor, row_bytes: int) -> None:
    """out[i] = buf[inverse[i]] (rows of row_bytes; buf holds at least max(inverse) + 1 rows): duplicates of a
    deduplicated gather are filled from device memory."""
    n = inverse.numel()
    src = _word_rows(buf, buf.numel() * buf.element_size() // row_bytes, row_bytes)
    torch.index_select(src, 0, inverse, out=_word_rows(out, n, row_bytes))


def _launch_gather(table, rows, rb, idx, out, positions, kind, max_sms, stream, device_count=None):
    _core.gather_cuda(
        table.data_ptr(), rows, rb, idx.data_ptr(), idx.element_size(), idx.numel(),
        positions.data_ptr() if positions is not None else 0, out.data_ptr(), _KIND[kind], max_sms, stream,
        device_count.data_ptr() if device_count is not None else 0,
    )


def _native_staged(rb: int, rows: int) -> bool:
    """Whether a staged gather of rows of rb bytes runs the package's pipeline (else torch's index_select engine)."""
    return rb <= NATIVE_STAGED_MAX_ROW or rb > _Slots.BYTES or rows == 0  # (no rows: the native path raises)


def _staged_index(idx: Tensor, rb: int, rows: int) -> Tensor:
    """The indices a staged gather takes: the CUDA indices themselves for the package's pipeline (it copies them to
    the host chunk group by chunk group, overlapped with the gather), else on the host (this waits for the stream)."""
    return idx if _native_staged(rb, rows) else host_index(idx)


def _launch_gather_staged(table, rows, rb, idx, dest, stream) -> None:
    _core.gather_staged(table.data_ptr(), rows, rb, idx.data_ptr(), idx.element_size(), idx.numel(),
                        dest.data_ptr(), _host_threads(), stream.cuda_stream, index_on_device=idx.is_cuda)


def _gather_staged(table, rows, rb, idx, dest, stream) -> None:
    """dest (CUDA, rows of rb bytes) = table[idx], gathered on the host into pinned slots one chunk at a time, each
    chunk's copy to the GPU queued on `stream` while the next chunk is gathered; `idx` from :func:`_staged_index`.

    Rows up to NATIVE_STAGED_MAX_ROW bytes (and rows wider than a slot) go through the package's pipeline: its
    threads claim ~32 KiB pieces of 2 MiB chunks, and whichever finishes a chunk queues its copy, with no Python per
    chunk. Wider rows go through torch's ``index_select`` (its OpenMP threads) into 8 MiB slots, which moved 1 KiB
    rows 1.04-1.42x faster than the pipeline on an H200 host, while the pipeline moved 131072 rows of 47-256 B
    1.18-2.03x faster than this path (benchmarks/RESULTS.md, probe P2, same process)."""
    if _native_staged(rb, rows):
        _launch_gather_staged(table, rows, rb, idx, dest, stream)
        return
    host_idx = idx
    n = host_idx.numel()
    with torch._C.DisableTorchFunctionSubclass():
        src = table.detach().reshape(rows, -1).view(torch.uint8)  # (rows, rb) bytes
        dst = dest.reshape(-1).view(torch.uint8).view(n, rb)
    with _Slots.lock, torch.cuda.stream(stream):
        buffers, events = _Slots.get(dest.device)
        for k, (start, end) in enumerate(_Slots.chunks(n, rb)):
            slot = k % _Slots.COUNT
            events[slot].synchronize()  # the slot's previous copy (of this call or an earlier one) is done
            staged = buffers[slot][: (end - start) * rb].view(end - start, rb)
            try:
                torch.index_select(src, 0, host_idx[start:end], out=staged)
            except IndexError:
                # Name the first bad index the way every other path does (raises), else torch's error stands.
                _core.check_host_indices(host_idx.data_ptr(), host_idx.element_size(), n, rows, _host_threads())
                raise
            dst[start:end].copy_(staged, non_blocking=True)
            events[slot].record(stream)


# ---------------------------------------------------------------------------------------------------- gather


def gather_cuda(table: Tensor, rows: int, rb: int, idx: Tensor, out: Tensor, plan: Plan, max_sms: int,
                checked: bool) -> None:
    """out (n rows on idx's device, contiguous) = table[idx] with `plan`, on the current stream. `idx` is 1-D,
    contiguous and non-empty; `checked`: every index is known to be in range (sync bounds check done)."""
    n = idx.numel()
    with on_device(idx.device):
        s = plan.strategy
        if s in ("vector", "naive"):
            _launch_gather(table, rows, rb, idx, out, None, s, max_sms, raw_stream(idx.device))
            return
        if s == "sorted":
            ordered, perm = sort_indices(idx, rows, checked)
            _launch_gather(table, rows, rb, ordered, out, perm, "vector", max_sms, raw_stream(idx.device))
            return
        if s == "dedupe":
            # Each distinct row once over PCIe, in address order; the kernel reads the distinct count on the device.
            unique, count, inverse = dedupe_indices(idx, rows, checked)
            buf = torch.empty((n, rb), dtype=torch.uint8, device=idx.device)
            _launch_gather(table, rows, rb, unique, buf, None, "vector", max_sms, raw_stream(idx.device), count)
            expand_rows(buf, inverse, out, rb)
            return
        stream = torch.cuda.current_stream()  # (the host plans use the Stream object)
        if s == "dedupe_staged":
            # The host needs the distinct indices anyway, so torch.unique's wait for their count costs nothing extra,
            # and only they cross to the host (the device-only dedupe_indices would copy all of them).
            unique, inverse = torch.unique(idx, sorted=True, return_inverse=True)
            buf = torch.empty((unique.numel(), rb), dtype=torch.uint8, device=idx.device)
            _gather_staged(table, rows, rb, _staged_index(unique, rb, rows), buf, stream)
            expand_rows(buf, inverse, out, rb)
        elif s == "staged":
            _gather_staged(table, rows, rb, _staged_index(idx, rb, rows), out, stream)
        elif s == "split":
            k = min(n, max(0, int(round(n * plan.split_fraction))))
            host_rest = _staged_index(idx[k:], rb, rows)  # before the kernel is queued: host_index waits for the stream
            side = _Side.get(idx.device)
            # `out` was allocated on `stream`: the side stream waits for the work queued so far, not for the kernel.
            side.wait_stream(stream)
            rows_out = out.reshape(n, -1)
            if k > 0 and plan.split_kernel == "sorted":
                ordered, perm = sort_indices(idx[:k], rows, checked)  # positions 0..k-1: the first k output rows
                _launch_gather(table, rows, rb, ordered, out, perm, "vector", max_sms, stream.cuda_stream)
            elif k > 0:
                _launch_gather(table, rows, rb, idx[:k], out, None, "vector", max_sms, stream.cuda_stream)
            if k < n:
                _gather_staged(table, rows, rb, host_rest, rows_out[k:], side)
                stream.wait_stream(side)
                out.record_stream(side)
        else:  # pragma: no cover - Plan validates its strategy
            raise AssertionError(s)


def gather_host(table: Tensor, rows: int, rb: int, idx: Tensor, out: Tensor, dedupe: bool) -> None:
    """out = table[idx] on the CPU (package threads). `dedupe`: each distinct row is copied once, then expanded
    (pays when the indices repeat rows many times). Bad indices raise IndexError naming the first one."""
    n = idx.numel()
    if not dedupe or n == 0:
        _core.gather_host(table.data_ptr(), rows, rb, idx.data_ptr(), idx.element_size(), n, 0, out.data_ptr(),
                          _host_threads())
        return
    _core.check_host_indices(idx.data_ptr(), idx.element_size(), n, rows, _host_threads())
    unique, count, inverse = dedupe_indices(idx, rows, checked=True)
    u = int(count)
    buf = torch.empty((u, rb), dtype=torch.uint8)
    _core.gather_host(table.data_ptr(), rows, rb, unique.data_ptr(), unique.element_size(), u, 0, buf.data_ptr(),
                      _host_threads())
    expand_rows(buf, inverse, out, rb)


# ---------------------------------------------------------------------------------------------------- scatter


def _launch_scatter(table, rows, rb, idx, values, positions, kind, max_sms, stream):
    _core.scatter_cuda(
        table.data_ptr(), rows, rb, idx.data_ptr(), idx.element_size(), idx.numel(),
        positions.data_ptr() if positions is not None else 0, values.data_ptr(), _KIND[kind], max_sms, stream,
    )


def scatter_cuda(table: Tensor, rows: int, rb: int, idx: Tensor, vals: Tensor, plan: Plan, max_sms: int,
                 checked: bool) -> None:
    """table[idx] = vals (n rows on idx's device) with `plan` (one of SCATTER_PLANS), on the current stream."""
    with on_device(idx.device):
        stream = torch.cuda.current_stream()
        s = plan.strategy
        if s in ("vector", "naive"):
            _launch_scatter(table, rows, rb, idx, vals, None, s, max_sms, stream.cuda_stream)
        elif s == "sorted":
            ordered, perm = sort_indices(idx, rows, checked)
            _launch_scatter(table, rows, rb, ordered, vals, perm, "vector", max_sms, stream.cuda_stream)
        elif s == "staged":
            host_idx = host_index(idx)
            _core.scatter_staged(table.data_ptr(), rows, rb, host_idx.data_ptr(), host_idx.element_size(),
                                 idx.numel(), vals.data_ptr(), _host_threads(), stream.cuda_stream)
        else:
            raise ValueError(f"scatter has no {s!r} plan; one of {', '.join(SCATTER_PLANS)}")


def scatter_host(table: Tensor, rows: int, rb: int, idx: Tensor, vals: Tensor) -> None:
    _core.scatter_host(table.data_ptr(), rows, rb, idx.data_ptr(), idx.element_size(), idx.numel(), 0,
                       vals.data_ptr(), _host_threads())
