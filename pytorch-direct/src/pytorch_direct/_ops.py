"""The row operations as ``torch.library`` custom ops (``torch.ops.pytorch_direct.*``), with fake kernels so they
trace under ``torch.compile`` without graph breaks, and an autograd formula for the gather.

Every op takes the table as a host (CPU) tensor. With CUDA indices the table must be pinned or registered (a unified
tensor); rows move on the current CUDA stream. With CPU indices everything stays on the host (multithreaded).
"""

import contextlib
import threading

import torch
from torch import Tensor

from . import _core
from ._config import STRATEGIES, settings

INDEX_DTYPES = (torch.int32, torch.int64)
_KIND = {"vector": 0, "naive": 1}


class _Side:
    """One side stream per device for the staged half of a split gather."""

    streams: dict = {}

    @classmethod
    def get(cls, device: torch.device) -> torch.cuda.Stream:
        stream = cls.streams.get(device.index)
        if stream is None:
            stream = cls.streams[device.index] = torch.cuda.Stream(device=device)
        return stream


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


def _table_for_device(table: Tensor, device: int) -> None:
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
    if _core.is_tracked_host_range(table.data_ptr(), nbytes):
        return
    if not _core.is_device_accessible_host(table.data_ptr(), nbytes):
        raise ValueError(
            "the table is not in pinned or registered host memory, so the GPU cannot read it: wrap it once with "
            "pytorch_direct.unified(t) (registers in place) or pytorch_direct.unified(t, copy=True)"
        )


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


def _on_device(device: torch.device):
    """torch.cuda.device(device), or nothing to do when it is current already (the common case, a few us saved)."""
    if device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def _capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


def _precheck(index: Tensor, rows: int) -> None:
    """Sync-mode bounds check on the device: one reduction, one small copy to the host."""
    if index.numel() == 0:
        return
    lo, hi = torch.aminmax(index)
    lo, hi = int(lo), int(hi)
    if lo < 0 or hi >= rows:
        bad = lo if lo < 0 else hi
        raise IndexError(
            f"index {bad} is out of range for a table of {rows} rows (valid: 0..{rows - 1}); "
            "negative indices are not wrapped"
        )


def _resolve(strategy: str, op: str, row_bytes: int, count: int, rows: int) -> str:
    if strategy == "auto":
        strategy = settings.strategy
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
    if strategy == "auto":
        from ._strategy import choose

        strategy = choose(op, row_bytes, count, rows, capturing=_capturing())
    if strategy in ("staged", "split") and _capturing():
        raise RuntimeError(
            f"strategy {strategy!r} copies indices to the host, which CUDA graph capture forbids: use 'vector', "
            "'sorted' or 'auto' inside a captured region"
        )
    return strategy


# ---------------------------------------------------------------------------------------------------- entry points


def use_dispatcher(*tensors) -> bool:
    """Whether a call must go through its custom op (torch's dispatcher): to record autograd, or to be seen by
    torch.compile / export / fake tensors / functorch transforms / torch function modes / the profiler. A plain
    eager call runs the implementation directly: the dispatcher cost ~30 us per call, about 4 % of a 34 MB
    gather on an H200 (benchmarks/RESULTS.md, run F)."""
    if torch.compiler.is_compiling():  # first: Dynamo folds it and never traces the checks below
        return True
    if (torch._C._len_torch_dispatch_stack() > 0 or torch._C._is_torch_function_mode_enabled()
            or torch.autograd._profiler_enabled()):
        return True
    grad = torch.is_grad_enabled()
    for t in tensors:
        if isinstance(t, Tensor) and ((grad and t.requires_grad) or torch._C._functorch.is_functorch_wrapped_tensor(t)):
            return True
    return False


def gather(table: Tensor, index: Tensor, strategy: str = "auto", max_sms: int = 0,
           padding_idx: int | None = None) -> Tensor:
    """table[index] through the custom op when autograd or tracing needs it, else directly."""
    if use_dispatcher(table, index):
        return gather_op(table, index, strategy, max_sms, padding_idx)
    return gather_impl(table, index, strategy, max_sms)


# Writes run eagerly even inside torch.compile (a graph break): a traced write to a graph input is functionalized,
# and a torch 2.11 inductor graph then wrote into a pageable copy of the whole table instead of the table (H200,
# run G); at best that costs a copy of a table as large as host memory allows.
@torch.compiler.disable
def scatter(table: Tensor, index: Tensor, values: Tensor, strategy: str = "auto", max_sms: int = 0) -> None:
    """table[index] = values through the custom op when tracing needs it, else directly."""
    if use_dispatcher(table, index, values):
        scatter_op(table, index, values, strategy, max_sms)
    else:
        scatter_impl(table, index, values, strategy, max_sms)


@torch.compiler.disable  # a write: see scatter
def index_add(table: Tensor, index: Tensor, values: Tensor, alpha: float = 1.0, strategy: str = "auto",
              max_sms: int = 0) -> None:
    """table[index] += alpha * values through the custom op when tracing needs it, else directly."""
    if use_dispatcher(table, index, values):
        index_add_op(table, index, values, alpha, strategy, max_sms)
    else:
        index_add_impl(table, index, values, alpha, strategy, max_sms)


# ---------------------------------------------------------------------------------------------------- gather


def _host_index(idx: Tensor) -> Tensor:
    """The indices on the host for the staged strategy: through a pinned buffer (torch's caching host allocator),
    about 5x faster than a pageable .cpu() copy; waits for the current stream (the indices may be made there)."""
    host = torch.empty(idx.shape, dtype=idx.dtype, pin_memory=True)
    host.copy_(idx, non_blocking=True)
    torch.cuda.current_stream(idx.device).synchronize()
    return host


def _sort(idx: Tensor, rows: int, checked: bool) -> tuple[Tensor, Tensor]:
    """Indices in ascending order and the position each came from. With every index already checked in range and
    row numbers below 2^31, the keys are sorted as int32: the radix sort makes half the passes. (Unchecked int64
    indices keep their width: narrowing could turn a bad index into a valid one.)"""
    if checked and idx.dtype == torch.int64 and rows <= 2**31:
        ordered, perm = torch.sort(idx.to(torch.int32))
        return ordered, perm
    return torch.sort(idx)


def _launch_gather(table, rows, rb, idx, out, positions, kind, max_sms, stream):
    _core.gather_cuda(
        table.data_ptr(), rows, rb, idx.data_ptr(), idx.element_size(), idx.numel(),
        positions.data_ptr() if positions is not None else 0, out.data_ptr(), _KIND[kind], max_sms, stream,
    )


def _gather_staged(table, rows, rb, host_idx, dest, stream) -> None:
    """dest (CUDA, rows of rb bytes) = table[host_idx], gathered on the host into pinned slots one chunk at a time,
    each chunk's copy to the GPU queued on `stream` while the next chunk is gathered. The host gather is torch's
    ``index_select`` (its OpenMP threads, kept hot by the back-to-back chunks) or the package's own threads,
    whichever the calibration measured faster on this machine."""
    from ._strategy import host_gather_engine

    n = host_idx.numel()
    if host_gather_engine() == "native" or rb > _Slots.BYTES or rows == 0:  # (no rows: it raises the IndexError)
        _core.gather_staged(table.data_ptr(), rows, rb, host_idx.data_ptr(), host_idx.element_size(), n,
                            dest.data_ptr(), settings.threads, stream.cuda_stream)
        return
    with torch._C.DisableTorchFunctionSubclass():
        src = table.detach().reshape(rows, -1).view(torch.uint8)  # (rows, rb) bytes
        dst = dest.view(n, -1).view(torch.uint8)
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
                _core.check_host_indices(host_idx.data_ptr(), host_idx.element_size(), n, rows, settings.threads)
                raise
            dst[start:end].copy_(staged, non_blocking=True)
            events[slot].record(stream)


def gather_impl(table: Tensor, index: Tensor, strategy: str, max_sms: int) -> Tensor:
    check_table(table)
    check_index(index)
    rows, rb = row_layout(table)
    out = torch.empty(tuple(index.shape) + tuple(table.shape[1:]), dtype=table.dtype, device=index.device)
    idx = index.contiguous().view(-1)
    n = idx.numel()
    if rb == 0:  # rows of zero bytes: only the bounds check has work to do
        if index.device.type == "cpu":
            _core.check_host_indices(idx.data_ptr(), idx.element_size(), n, rows, settings.threads)
        else:
            _precheck(idx, rows)
        return out
    if index.device.type == "cpu":
        _core.gather_host(table.data_ptr(), rows, rb, idx.data_ptr(), idx.element_size(), n, 0, out.data_ptr(),
                          settings.threads)
        return out
    if index.device.type != "cuda":
        raise ValueError(f"indices on {index.device} are not supported: use CPU or CUDA indices")
    _table_for_device(table, index.device.index)
    raise_pending_device_error()
    if n == 0:
        return out
    checked = settings.bounds_check == "sync" and not _capturing()
    if checked:
        _precheck(idx, rows)
    max_sms = max_sms if max_sms > 0 else settings.max_sms
    strategy = _resolve(strategy, "gather", rb, n, rows)
    with _on_device(index.device):
        stream = torch.cuda.current_stream()
        if strategy in ("vector", "naive"):
            _launch_gather(table, rows, rb, idx, out, None, strategy, max_sms, stream.cuda_stream)
        elif strategy == "sorted":
            ordered, perm = _sort(idx, rows, checked)
            _launch_gather(table, rows, rb, ordered, out, perm, "vector", max_sms, stream.cuda_stream)
        elif strategy == "staged":
            _gather_staged(table, rows, rb, _host_index(idx), out, stream)
        elif strategy == "split":
            from ._strategy import split_fraction, split_kernel

            k = min(n, max(0, int(round(n * split_fraction(rb, n, rows)))))
            kernel = split_kernel(rb, n, rows)
            host_rest = _host_index(idx[k:])  # before the kernel is queued: this waits for the stream
            side = _Side.get(index.device)
            # `out` was allocated on `stream`: the side stream waits for the work queued so far, not for the kernel.
            side.wait_stream(stream)
            if k > 0 and kernel == "sorted":
                ordered, perm = _sort(idx[:k], rows, checked)  # positions 0..k-1: the first k output rows
                _launch_gather(table, rows, rb, ordered, out, perm, "vector", max_sms, stream.cuda_stream)
            elif k > 0:
                _launch_gather(table, rows, rb, idx[:k], out, None, "vector", max_sms, stream.cuda_stream)
            if k < n:
                rest = out.view(n, -1)[k:] if out.dim() > 0 else out
                _gather_staged(table, rows, rb, host_rest, rest, side)
                stream.wait_stream(side)
                out.record_stream(side)
        else:  # pragma: no cover - _resolve returns a known strategy
            raise AssertionError(strategy)
    return out


@torch.library.custom_op("pytorch_direct::gather", mutates_args=())
def gather_op(table: Tensor, index: Tensor, strategy: str = "auto", max_sms: int = 0,
              padding_idx: int | None = None) -> Tensor:
    """out[i, ...] = table[index[i], ...]; out is on index's device. padding_idx only affects the gradient."""
    return gather_impl(table, index, strategy, max_sms)


@gather_op.register_fake
def _gather_fake(table, index, strategy="auto", max_sms=0, padding_idx=None):
    return table.new_empty(tuple(index.shape) + tuple(table.shape[1:]), device=index.device)


_NOT_A_LEAF = (
    "gathering from a view of a unified tensor that requires grad: gather from the table itself "
    "(the leaf), e.g. table[idx + offset] instead of table[offset:][idx]"
)


def _functionalized(t: Tensor) -> bool:
    from torch._subclasses.functional_tensor import FunctionalTensor

    return isinstance(t, FunctionalTensor)


def _gather_setup(ctx, inputs, output):
    table, index, _strategy, _max_sms, padding_idx = inputs
    if table.requires_grad and not table.is_leaf and not _functionalized(table):
        # The gradient goes into table.grad directly (never a dense table-sized tensor through autograd), which
        # only a leaf has. (AOTAutograd traces a compiled graph with functional wrappers, no leaves, of tables that
        # Dynamo checked here already as fake tensors.)
        raise NotImplementedError(_NOT_A_LEAF)
    ctx.table = table  # the leaf itself: its .grad receives the rows' gradients
    ctx.padding_idx = padding_idx
    ctx.save_for_backward(index)


def _gather_backward(ctx, grad):
    (index,) = ctx.saved_tensors
    if ctx.table.requires_grad:
        if use_dispatcher(ctx.table, index, grad):  # e.g. AOTAutograd tracing the backward of a compiled graph
            accumulate_grad_op(ctx.table, index, grad, ctx.padding_idx)
        else:
            _accumulate_grad_of_leaf(ctx.table, index, grad, ctx.padding_idx)
    return None, None, None, None, None


gather_op.register_autograd(_gather_backward, setup_context=_gather_setup)


@torch.library.custom_op("pytorch_direct::accumulate_grad", mutates_args=())
def accumulate_grad_op(table: Tensor, index: Tensor, grad: Tensor, padding_idx: int | None = None) -> None:
    """The gather's backward as an op, for traced backward graphs (torch.compile)."""
    _accumulate_grad_of_leaf(table, index, grad, padding_idx)


@accumulate_grad_op.register_fake
def _accumulate_grad_fake(table, index, grad, padding_idx=None):
    return None


# It returns nothing and mutates no argument: graph passes would drop it as dead code without this.
torch.fx.node.has_side_effect(accumulate_grad_op._opoverload)


def _accumulate_grad_of_leaf(table: Tensor, index: Tensor, grad: Tensor, padding_idx: int | None) -> None:
    """accumulate_grad into the table, or, for a compiled graph's alias of a unified tensor, into the unified tensor
    that the alias names (see _tensor._CompileAlias)."""
    owner = getattr(table, "_pytorch_direct_leaf", None)  # a weak reference
    leaf = table if owner is None else owner()
    if leaf is None:
        return  # the unified tensor is gone, and its .grad with it
    if not leaf.is_leaf:
        raise NotImplementedError(_NOT_A_LEAF)
    accumulate_grad(leaf, index, grad, padding_idx)


def accumulate_grad(table: Tensor, index: Tensor, grad: Tensor, padding_idx: int | None) -> None:
    """Host-resident gradient: table.grad (a unified tensor of the table's shape, created on first use) +=
    the rows of grad at index (duplicates summed). The table's full gradient never exists on the GPU."""
    from ._memory import zeros

    if table.grad is None:
        table.grad = zeros(table.shape, dtype=table.dtype)
    g = grad.detach()
    if padding_idx is not None:
        keep = (index != padding_idx).to(g.dtype)
        g = g * keep.view(tuple(index.shape) + (1,) * (g.dim() - index.dim()))
    with torch.no_grad():
        rows = g.reshape((index.numel(),) + tuple(table.shape[1:]))
        index_add(table.grad, index.reshape(-1), rows, 1.0, "auto", 0)


# ---------------------------------------------------------------------------------------------------- scatter


def _launch_scatter(table, rows, rb, idx, values, positions, kind, max_sms, stream):
    _core.scatter_cuda(
        table.data_ptr(), rows, rb, idx.data_ptr(), idx.element_size(), idx.numel(),
        positions.data_ptr() if positions is not None else 0, values.data_ptr(), _KIND[kind], max_sms, stream,
    )


def _check_values(table: Tensor, index: Tensor, values: Tensor) -> Tensor:
    """values as a contiguous (n, *row) tensor of the table's dtype on the index's device."""
    row_shape = tuple(table.shape[1:])
    n = index.numel()
    if not isinstance(values, Tensor):
        raise TypeError(f"values must be a tensor, got {type(values).__name__}")
    if values.device != index.device:
        raise ValueError(f"values are on {values.device} but the indices on {index.device}: put both on one device")
    if values.dtype != table.dtype:
        raise TypeError(f"values have dtype {values.dtype}, the table {table.dtype}: convert with .to({table.dtype})")
    expected = tuple(index.shape) + row_shape
    if tuple(values.shape) != expected and tuple(values.shape) != (n,) + row_shape:
        raise ValueError(f"values have shape {tuple(values.shape)}; expected {expected} (index shape + row shape)")
    return values.contiguous().view((n,) + row_shape)


def scatter_impl(table: Tensor, index: Tensor, values: Tensor, strategy: str, max_sms: int) -> None:
    check_table(table)
    check_index(index)
    rows, rb = row_layout(table)
    idx = index.contiguous().view(-1)
    vals = _check_values(table, index, values)
    n = idx.numel()
    if rb == 0:
        return
    if index.device.type == "cpu":
        _core.scatter_host(table.data_ptr(), rows, rb, idx.data_ptr(), idx.element_size(), n, 0, vals.data_ptr(),
                           settings.threads)
        return
    _table_for_device(table, index.device.index)
    raise_pending_device_error()
    if n == 0:
        return
    checked = settings.bounds_check == "sync" and not _capturing()
    if checked:
        _precheck(idx, rows)  # writes: nothing is written when an index is bad
    max_sms = max_sms if max_sms > 0 else settings.max_sms
    strategy = _resolve(strategy, "scatter", rb, n, rows)
    with _on_device(index.device):
        stream = torch.cuda.current_stream()
        if strategy in ("vector", "naive"):
            _launch_scatter(table, rows, rb, idx, vals, None, strategy, max_sms, stream.cuda_stream)
        elif strategy == "sorted":
            ordered, perm = _sort(idx, rows, checked)
            _launch_scatter(table, rows, rb, ordered, vals, perm, "vector", max_sms, stream.cuda_stream)
        else:  # staged (split falls back to staged for writes: both halves would compete for the same rows)
            host_idx = _host_index(idx)
            _core.scatter_staged(table.data_ptr(), rows, rb, host_idx.data_ptr(), host_idx.element_size(), n,
                                 vals.data_ptr(), settings.threads, stream.cuda_stream)


@torch.library.custom_op("pytorch_direct::scatter_", mutates_args=("table",))
def scatter_op(table: Tensor, index: Tensor, values: Tensor, strategy: str = "auto", max_sms: int = 0) -> None:
    """table[index[i], ...] = values[i, ...] (duplicates: one writer wins per element)."""
    scatter_impl(table, index, values, strategy, max_sms)


@scatter_op.register_fake
def _scatter_fake(table, index, values, strategy="auto", max_sms=0):
    return None


def index_add_impl(table: Tensor, index: Tensor, values: Tensor, alpha: float, strategy: str, max_sms: int) -> None:
    check_table(table)
    check_index(index)
    rows, _ = row_layout(table)
    vals = _check_values(table, index, values)
    idx = index.contiguous().view(-1)
    if not (table.dtype.is_floating_point or table.dtype.is_complex):
        if table.dtype == torch.bool:
            raise TypeError("index_add_ is not defined for bool tables (torch has no bool addition)")
        if alpha != int(alpha):
            raise ValueError(f"alpha={alpha} must be an integer for a {table.dtype} table")
        alpha = int(alpha)  # torch refuses a float alpha for integer tensors
    if index.device.type == "cpu":
        _core.check_host_indices(idx.data_ptr(), idx.element_size(), idx.numel(), rows, settings.threads)
        table.index_add_(0, idx, vals, alpha=alpha)
        return
    if idx.numel() == 0:
        return
    if settings.bounds_check == "sync" and not _capturing():
        _precheck(idx, rows)
    # Duplicates: sum per unique row on the GPU, then one read-modify-write per unique row over PCIe.
    # Half-precision sums accumulate in float32 (one rounding per row instead of one per duplicate).
    acc = torch.float32 if table.dtype in (torch.float16, torch.bfloat16) else table.dtype
    unique, inverse = torch.unique(idx, return_inverse=True)
    sums = torch.zeros((unique.numel(),) + tuple(table.shape[1:]), dtype=acc, device=vals.device)
    sums.index_add_(0, inverse, vals.to(acc), alpha=alpha)
    current = gather_impl(table, unique, strategy, max_sms)
    scatter_impl(table, unique, (current.to(acc) + sums).to(table.dtype), strategy, max_sms)


@torch.library.custom_op("pytorch_direct::index_add_", mutates_args=("table",))
def index_add_op(table: Tensor, index: Tensor, values: Tensor, alpha: float = 1.0, strategy: str = "auto",
                 max_sms: int = 0) -> None:
    """table[index[i], ...] += alpha * values[i, ...], duplicate indices summed."""
    index_add_impl(table, index, values, alpha, strategy, max_sms)


@index_add_op.register_fake
def _index_add_fake(table, index, values, alpha=1.0, strategy="auto", max_sms=0):
    return None
