"""Layer 2: the primitives that move rows: kernel launches, index sorting and deduplication, the CPU gather into
pinned buffers with pipelined copies, host gathers and scatters, and the checks every call makes.

Everything here takes plain tensors: a host table (pinned or registered for CUDA indices), 1-D contiguous indices
and a dense output (gather) or source (scatter) of ``count`` rows. Nothing here knows strategies by name: each
strategy (``_strategies``) is a small composition of these primitives.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch import Tensor

from . import _core, _memory
from ._config import settings

INDEX_DTYPES = (torch.int32, torch.int64)
# The device kernels' kinds (rows.hpp's kernel_kind).
KERNEL_VECTOR = 0
KERNEL_NAIVE = 1


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

    A chunk fills one slot. On an H200 host 8 MiB chunks beat 4 MiB ones by 0-9 % (each ``index_select`` call and
    each copy costs ~15 us on the host), and chunks growing from 1 MiB (to start the DMA sooner) did not measure
    better."""

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
    getter costs ~0.3 us; ``torch.cuda.current_stream()`` ~5 us on an H200 host."""
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
    ~140 us per call this way, a quarter of a 131072-row gather of small rows."""
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


@contextlib.contextmanager
def bounds_checked(idx: Tensor, rows: int):
    """The sync-mode bounds check of CUDA indices, overlapped with the GPU work queued inside the block (a gather,
    whose kernels skip a bad row and never touch it): the check's reduction is queued first, then the block's work,
    and the host waits for the reduction alone; IndexError for a bad index on leaving the block. Checked first and
    then launched, the GPU sat idle for the host's round trip between the two, ~20-30 us per call on an H200 host,
    a tenth of a 131072-row gather of small rows. On a bad index the kernels' own record of it is cleared, so that
    the next call does not raise it again; the block's output is then to be discarded."""
    with on_device(idx.device):
        _core.index_bounds_start(idx.data_ptr(), idx.element_size(), idx.numel(), raw_stream(idx.device))
        try:
            yield
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


def launch_gather(table: Tensor, rows: int, rb: int, idx: Tensor, out: Tensor, positions: Tensor | None,
                  kernel: int, max_sms: int, stream: int, device_count: Tensor | None = None) -> None:
    """out[positions[i] or i] = table[idx[i]] by the device kernel `kernel` (KERNEL_VECTOR or KERNEL_NAIVE) on the
    raw stream `stream`; `device_count`: a 1-element int64 device tensor bounding how many indices move."""
    _core.gather_cuda(
        table.data_ptr(), rows, rb, idx.data_ptr(), idx.element_size(), idx.numel(),
        positions.data_ptr() if positions is not None else 0, out.data_ptr(), kernel, max_sms, stream,
        device_count.data_ptr() if device_count is not None else 0,
    )


def launch_cached(table: Tensor, rows: int, rb: int, idx: Tensor, dense: Tensor, positions: Tensor | None,
                  slot_of_row: Tensor, cache_rows: Tensor, refresh: bool, max_sms: int, stream: int) -> None:
    """Through a GPU cache of hot rows (``slot_of_row``: int32 slot per table row, -1 where the row is not cached;
    ``cache_rows``: the cached rows, contiguous, 16 bytes of slack after the last), one kernel on the raw stream:
    gather (refresh False): dense[positions[i] or i] = the cached copy of row idx[i] where there is one, else the
    row read zero-copy from the table; refresh: the cached copy of each cached row idx[i] = the table's row (after
    writes; rows not cached are skipped)."""
    _core.gather_cached_cuda(
        table.data_ptr(), rows, rb, idx.data_ptr(), idx.element_size(), idx.numel(),
        positions.data_ptr() if positions is not None else 0, dense.data_ptr(), slot_of_row.data_ptr(),
        cache_rows.data_ptr(), refresh, max_sms, stream,
    )


def _native_staged(rb: int, rows: int) -> bool:
    """Whether a staged gather of rows of rb bytes runs the package's pipeline (else torch's index_select engine)."""
    return rb <= NATIVE_STAGED_MAX_ROW or rb > _Slots.BYTES or rows == 0  # (no rows: the native path raises)


def staged_index(idx: Tensor, rb: int, rows: int) -> Tensor:
    """The indices a staged gather takes: the CUDA indices themselves for the package's pipeline (it copies them to
    the host chunk group by chunk group, overlapped with the gather), else on the host (this waits for the stream)."""
    return idx if _native_staged(rb, rows) else host_index(idx)


def launch_gather_staged(table, rows, rb, idx, dest, stream) -> None:
    _core.gather_staged(table.data_ptr(), rows, rb, idx.data_ptr(), idx.element_size(), idx.numel(),
                        dest.data_ptr(), _host_threads(), stream.cuda_stream, index_on_device=idx.is_cuda)


def gather_staged(table, rows, rb, idx, dest, stream) -> None:
    """dest (CUDA, rows of rb bytes) = table[idx], gathered on the host into pinned slots one chunk at a time, each
    chunk's copy to the GPU queued on `stream` while the next chunk is gathered; `idx` from :func:`staged_index`.

    Rows up to NATIVE_STAGED_MAX_ROW bytes (and rows wider than a slot) go through the package's pipeline: its
    threads claim ~32 KiB pieces of 2 MiB chunks, and whichever finishes a chunk queues its copy, with no Python per
    chunk. Wider rows go through torch's ``index_select`` (its OpenMP threads) into 8 MiB slots, which moved 1 KiB
    rows 1.04-1.42x faster than the pipeline on an H200 host, while the pipeline moved 131072 rows of 47-256 B
    1.18-2.03x faster than this path (same process)."""
    if _native_staged(rb, rows):
        launch_gather_staged(table, rows, rb, idx, dest, stream)
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


def gather_host(table: Tensor, rows: int, rb: int, idx: Tensor, out: Tensor, dedupe: bool) -> None:
    """out = table[idx] on the CPU. Bad indices raise IndexError naming the first one.

    Without `dedupe`: the package's threads. With `dedupe` (each distinct row copied once, then expanded: pays when
    the indices repeat rows many times) every step runs on torch's own threads (its sort needs them): the package's
    threads, which poll for work a while after each call (``PYTORCH_DIRECT_HOST_SPIN_US``), would otherwise hold
    the cores that torch's threads wait for, at every hand-over between the two pools."""
    n = idx.numel()
    if rows == 0 and n:
        # A table of no rows has no memory (a null pointer, which the C++ core refuses with a cryptic error):
        # every index is out of range.
        check_host_indices(idx, rows)
    if not dedupe or n == 0:
        _core.gather_host(table.data_ptr(), rows, rb, idx.data_ptr(), idx.element_size(), n, 0, out.data_ptr(),
                          _host_threads())
        return
    lo, hi = torch.aminmax(idx)
    if int(lo) < 0 or int(hi) >= rows:
        check_host_indices(idx, rows)  # (only to name the first bad index; raises)
    unique, inverse = torch.unique(idx, sorted=True, return_inverse=True)
    with torch._C.DisableTorchFunctionSubclass():
        src = _word_rows(table.detach(), rows, rb)
    buf = torch.index_select(src, 0, unique)
    torch.index_select(buf, 0, inverse, out=_word_rows(out, n, rb))


def launch_scatter(table, rows, rb, idx, values, positions, kernel, max_sms, stream) -> None:
    _core.scatter_cuda(
        table.data_ptr(), rows, rb, idx.data_ptr(), idx.element_size(), idx.numel(),
        positions.data_ptr() if positions is not None else 0, values.data_ptr(), kernel, max_sms, stream,
    )


def scatter_staged(table: Tensor, rows: int, rb: int, idx: Tensor, vals: Tensor, stream) -> None:
    """table[idx] = vals (CUDA): the rows copied to pinned staging, then written by the package's CPU threads;
    returns when the table holds them."""
    host_idx = host_index(idx)
    _core.scatter_staged(table.data_ptr(), rows, rb, host_idx.data_ptr(), host_idx.element_size(), idx.numel(),
                         vals.data_ptr(), _host_threads(), stream.cuda_stream)


def scatter_host(table: Tensor, rows: int, rb: int, idx: Tensor, vals: Tensor) -> None:
    if rows == 0 and idx.numel():
        check_host_indices(idx, rows)  # (as in gather_host: a table of no rows has a null pointer)
    _core.scatter_host(table.data_ptr(), rows, rb, idx.data_ptr(), idx.element_size(), idx.numel(), 0,
                       vals.data_ptr(), _host_threads())
