"""Layer 8: the row operations as ``torch.library`` custom ops (``torch.ops.pytorch_direct.*``), with fake kernels so
they trace under ``torch.compile`` without graph breaks, and the gather's autograd formula (gradients go into a
host-resident ``table.grad``).

Each CUDA call is the same three steps, in :func:`gather_impl` and :func:`scatter_impl`: check the arguments and lay
the call out as typed values (a ``Call``, a ``RowJob``), get a decision (``_auto`` for an ``auto`` call: its measured
or built-in choice, or measuring the candidates on this very call), run it (``_strategies``). With CPU indices
everything stays on the host (multithreaded). A table with a GPU cache of hot rows (``_cache``) has its own gather
strategies; writes refresh its cached rows.
"""

import functools

import torch
from torch import Tensor

from . import _auto, _cache, _kernels, _memory
from ._cell import Call
from ._config import settings
from ._kernels import INDEX_DTYPES, check_index, check_table, raise_pending_device_error, row_layout
from ._strategies import REGISTRY, RowJob, check_name

__all__ = ["INDEX_DTYPES", "check_index", "check_table", "gather", "index_add", "raise_pending_device_error",
           "row_layout", "scatter"]


def _plain_tensors(impl):
    """Runs `impl` with tensor subclasses' ``__torch_function__`` off: the unified table's attribute reads (shape,
    strides, data pointer, ...) then cost what a plain tensor's do. On an H200 host a 47 B x 131072 staged gather ran
    at 13.96 GB/s through this function and 17.03 through the ``_kernels`` call under it, ~80 us per call, mostly
    these reads; ``table[idx]`` reaches the implementation through a handler that turns them off already."""

    @functools.wraps(impl)
    def wrapper(*args, **kwargs):
        with torch._C.DisableTorchFunctionSubclass():
            return impl(*args, **kwargs)

    return wrapper


# Whole-tensor copies of managed memory to the GPU are zero-copy reads of rows of this many bytes: cudaMemcpy from
# managed memory ran at 7-11 GB/s on an H200 host, against 55 from pinned memory, while sequential zero-copy reads
# of it run at ~50.
COPY_ROW_BYTES = 4096


@_plain_tensors
def copy_to_cuda(src: Tensor, out: Tensor, non_blocking: bool) -> Tensor:
    """out (CUDA, contiguous) = src (contiguous, same dtype and element count, in host memory the GPU reads), by
    the vector kernel on out's device's current stream; waits for it unless `non_blocking` (as torch's copy from
    pageable memory does, so the caller may then change src)."""
    nbytes = src.numel() * src.element_size()
    if nbytes == 0:
        return out
    flat_src, flat_out = src.reshape(-1).view(torch.uint8), out.view(-1).view(torch.uint8)
    full = nbytes // COPY_ROW_BYTES
    with torch.cuda.device(out.device):
        stream = _kernels.raw_stream(out.device)
        for start, rows, rb in ((0, full, COPY_ROW_BYTES), (full * COPY_ROW_BYTES, 1, nbytes % COPY_ROW_BYTES)):
            if rows and rb:
                end = start + rows * rb
                idx = torch.arange(rows, device=out.device)
                _kernels.launch_gather(flat_src[start:end].view(rows, rb), rows, rb, idx,
                                       flat_out[start:end].view(rows, rb), None, _kernels.KERNEL_VECTOR, 0, stream)
        if not non_blocking:
            torch.cuda.current_stream().synchronize()
    return out


def _strategy_name(strategy: str) -> str:
    return check_name(settings.strategy if strategy == "auto" else strategy)


def _decision(call: Call, name: str, idx: Tensor, checked: bool, capturing: bool,
              cached: bool) -> tuple[_auto.Decision, bool, bool]:
    """The decision of one CUDA call (or, for an ``auto`` call of a kind never measured, the candidates to measure
    on it), after the sync-mode bounds check where it must come first: nothing runs for a scatter with a bad index.
    A gather whose plan is known leaves the check to its run (``_strategies.run``, which overlaps it with a device
    plan). Returns the decision, whether the run must check the bounds, and whether the indices are known in
    range."""
    if name == "auto":
        decision, _, bounds = _auto.choose(call, idx, capturing=capturing, cached=cached)
    else:
        decision, bounds = _auto.forced(call, name), None
    check_bounds, in_range = False, False
    if checked:
        if bounds is not None:
            if bounds[0] < 0 or bounds[1] >= call.rows:
                raise _kernels.bounds_error(bounds[0] if bounds[0] < 0 else bounds[1], call.rows)
            in_range = True
        elif decision.plan is None:
            _kernels.precheck(idx, call.rows)
            in_range = True
        else:
            check_bounds, in_range = True, True
    if decision.plan is not None and decision.plan.needs_host and capturing:
        allowed = ", ".join(repr(n) for n, s in REGISTRY.items() if s.runs_on == "device")
        raise RuntimeError(
            f"strategy {decision.plan.strategy!r} copies indices to the host, which CUDA graph capture forbids: use "
            f"{allowed} or 'auto' inside a captured region"
        )
    return decision, check_bounds, in_range


def _host_zeros_like(table: Tensor) -> Tensor:
    """A zeroed pinned host tensor of the table's shape, dtype and class (a unified table's gradient is a unified
    tensor too)."""
    grad = _memory.host_zeros(tuple(table.shape), table.dtype)
    cls = type(table)
    if cls is not Tensor and not issubclass(cls, torch.nn.Parameter):
        grad = grad.as_subclass(cls)
    return grad


# ---------------------------------------------------------------------------------------------------- entry points


def use_dispatcher(*tensors) -> bool:
    """Whether a call must go through its custom op (torch's dispatcher): to record autograd, or to be seen by
    torch.compile / export / fake tensors / functorch transforms / torch function modes / the profiler. A plain
    eager call runs the implementation directly: the dispatcher cost ~30 us per call, about 4 % of a 34 MB
    gather on an H200."""
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


def _at_graph_break(fn):
    """`fn` as torch.compile must run it: eagerly, at a graph break (``torch.compiler.disable``). torch's lazy form
    of it imports the compiler only when it is first called, where ``torch.compiler.disable`` imports it (~1.5 s)
    when applied, at ``import pytorch_direct``."""
    lazy = getattr(torch, "_disable_dynamo", None)
    return lazy(fn) if lazy is not None else torch.compiler.disable(fn)


# Writes run eagerly even inside torch.compile (a graph break): a traced write to a graph input is functionalized,
# and a torch 2.11 inductor graph then wrote into a pageable copy of the whole table instead of the table (H200);
# at best that costs a copy of a table as large as host memory allows.
def scatter(table: Tensor, index: Tensor, values: Tensor, strategy: str = "auto", max_sms: int = 0) -> None:
    """table[index] = values through the custom op when tracing needs it, else directly."""
    if torch.compiler.is_compiling():
        _scatter_at_graph_break(table, index, values, strategy, max_sms)
    else:
        _scatter_eager(table, index, values, strategy, max_sms)


def index_add(table: Tensor, index: Tensor, values: Tensor, alpha: float = 1.0, strategy: str = "auto",
              max_sms: int = 0) -> None:
    """table[index] += alpha * values through the custom op when tracing needs it, else directly."""
    if torch.compiler.is_compiling():  # a write: see scatter
        _index_add_at_graph_break(table, index, values, alpha, strategy, max_sms)
    else:
        _index_add_eager(table, index, values, alpha, strategy, max_sms)


def _check_write_autograd(table: Tensor, values) -> None:
    """The writes are not recorded by autograd (they have no backward): where torch's own in-place op would raise
    or record one, raise instead of writing while gradients silently go missing."""
    if not torch.is_grad_enabled():
        return
    if table.requires_grad and table.is_leaf:
        raise RuntimeError(
            "a leaf Variable that requires grad is being used in an in-place operation (a write into a unified "
            "table that requires grad): write under torch.no_grad(), as optimizers do"
        )
    if table.requires_grad or getattr(values, "requires_grad", False):
        raise NotImplementedError(
            "writes into a unified tensor are not recorded by autograd, so gradients would not flow through the "
            "written values: write under torch.no_grad() or pass values.detach()"
        )


def _scatter_eager(table, index, values, strategy, max_sms) -> None:
    _check_write_autograd(table, values)
    if use_dispatcher(table, index, values):
        scatter_op(table, index, values, strategy, max_sms)
    else:
        scatter_impl(table, index, values, strategy, max_sms)


def _index_add_eager(table, index, values, alpha, strategy, max_sms) -> None:
    _check_write_autograd(table, values)
    if use_dispatcher(table, index, values):
        index_add_op(table, index, values, alpha, strategy, max_sms)
    else:
        index_add_impl(table, index, values, alpha, strategy, max_sms)


_scatter_at_graph_break = _at_graph_break(_scatter_eager)
_index_add_at_graph_break = _at_graph_break(_index_add_eager)


# ---------------------------------------------------------------------------------------------------- gather


def gather_in_range(table: Tensor, index: Tensor, layout: tuple[int, int] | None = None) -> Tensor:
    """table[index] for indices the caller knows lie in the table (a sampler's node ids, read from a table checked
    once to hold a row per node): without the per-call bounds check of ``bounds_check="sync"``, a reduction over
    the indices and a wait for it on the host. ``layout``: the table's ``row_layout``, where the caller checked the
    table (``check_table``) and took it once (the table is then not checked again). Through the custom op,
    where autograd or tracing (the profiler included) needs it."""
    with torch._C.DisableTorchFunctionSubclass():  # (a unified table's attribute reads, as a plain tensor's)
        if use_dispatcher(table, index):
            return gather_op(table, index, "auto", 0, None, True)
        return _gather(table, index, "auto", 0, True, layout)


@_plain_tensors
def gather_impl(table: Tensor, index: Tensor, strategy: str, max_sms: int, in_range: bool = False) -> Tensor:
    return _gather(table, index, strategy, max_sms, in_range, None)


def _gather(table: Tensor, index: Tensor, strategy: str, max_sms: int, in_range: bool,
            layout: tuple[int, int] | None) -> Tensor:
    """:func:`gather_impl` (with tensor subclasses' ``__torch_function__`` off); ``in_range``: the caller knows
    every index lies in the table (no bounds check of CUDA indices); ``layout``: the table's ``row_layout``, taken
    by a caller that checked the table."""
    if layout is None:
        check_table(table)
        rows, rb = row_layout(table)
    else:
        rows, rb = layout
        if _memory.forked:
            _memory.check_readable_here(table)
    check_index(index)
    name = _strategy_name(strategy)
    out = torch.empty(tuple(index.shape) + tuple(table.shape[1:]), dtype=table.dtype, device=index.device)
    idx = index.contiguous().view(-1)
    n = idx.numel()
    if rb == 0:  # rows of zero bytes: only the bounds check has work to do
        if index.device.type == "cpu":
            _kernels.check_host_indices(idx, rows)
        else:
            _kernels.precheck(idx, rows)
        return out
    cache = _cache.cache_for(table, rows, rb) if name == "auto" or REGISTRY[name].uses_cache else None
    if cache is not None and cache.device != idx.device:
        cache.warn_bypassed(idx.device)
        cache = None
    if index.device.type == "cpu":
        if cache is not None:
            cache.gather_host(idx, out, rows)
        else:
            _kernels.gather_host(table, rows, rb, idx, out, dedupe=name != "auto" and REGISTRY[name].host_dedupe)
        return out
    if index.device.type != "cuda":
        raise ValueError(f"indices on {index.device} are not supported: use CPU or CUDA indices")
    memory = _kernels.table_for_device(table, index.device.index)
    raise_pending_device_error()
    if n == 0:
        return out
    capturing = _kernels.capturing()
    checked = settings.bounds_check == "sync" and not capturing and not in_range
    max_sms = max_sms if max_sms > 0 else settings.max_sms
    call = Call("gather", table.numel() * table.element_size(), rows, rb, n, memory)
    cached = cache is not None
    decision, check_bounds, checked_now = _decision(call, name, idx, checked, capturing, cached)
    in_range = in_range or checked_now
    job = RowJob("gather", table, rows, rb, idx, out.view(n, -1), max_sms, cache)
    if cached:
        cache.count(idx)
    if decision.plan is None:
        # A kind of call never measured: the candidates run on this call (each writes all of `out`), and the fastest
        # is kept for the next calls of this kind. Each run pays the bounds check a later call of its plan pays.
        _auto.measure(call, decision, job, check_bounds=checked, cached=cached)
        return out
    _auto.run(call, job, decision.plan, auto=name == "auto", cached=cached, check_bounds=check_bounds,
              in_range=in_range)
    return out


@torch.library.custom_op("pytorch_direct::gather", mutates_args=())
def gather_op(table: Tensor, index: Tensor, strategy: str = "auto", max_sms: int = 0,
              padding_idx: int | None = None, in_range: bool = False) -> Tensor:
    """out[i, ...] = table[index[i], ...]; out is on index's device. padding_idx only affects the gradient.
    ``in_range``: the caller knows every index lies in the table (no bounds check, see :func:`gather_in_range`)."""
    return gather_impl(table, index, strategy, max_sms, in_range)


@gather_op.register_fake
def _gather_fake(table, index, strategy="auto", max_sms=0, padding_idx=None, in_range=False):
    return table.new_empty(tuple(index.shape) + tuple(table.shape[1:]), device=index.device)


_NOT_A_LEAF = (
    "gathering from a view of a unified tensor that requires grad: gather from the table itself "
    "(the leaf), e.g. table[idx + offset] instead of table[offset:][idx]"
)


def _functionalized(t: Tensor) -> bool:
    from torch._subclasses.functional_tensor import FunctionalTensor

    return isinstance(t, FunctionalTensor)


def _gather_setup(ctx, inputs, output):
    table, index, _strategy, _max_sms, padding_idx, _in_range = inputs
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
    return None, None, None, None, None, None


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
    """Host-resident gradient: table.grad (pinned host memory of the table's shape and class, created on first use) +=
    the rows of grad at index (duplicates summed). The table's full gradient never exists on the GPU."""
    if table.grad is None:
        table.grad = _host_zeros_like(table)
    g = grad.detach()
    if padding_idx is not None:
        keep = (index != padding_idx).to(g.dtype)
        g = g * keep.view(tuple(index.shape) + (1,) * (g.dim() - index.dim()))
    with torch.no_grad():
        rows = g.reshape((index.numel(),) + tuple(table.shape[1:]))
        index_add(table.grad, index.reshape(-1), rows, 1.0, "auto", 0)


# ---------------------------------------------------------------------------------------------------- scatter


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


@_plain_tensors
def scatter_impl(table: Tensor, index: Tensor, values: Tensor, strategy: str, max_sms: int) -> None:
    check_table(table)
    check_index(index)
    name = _strategy_name(strategy)
    rows, rb = row_layout(table)
    idx = index.contiguous().view(-1)
    vals = _check_values(table, index, values)
    n = idx.numel()
    if rb == 0:
        return
    if index.device.type == "cpu":
        _kernels.scatter_host(table, rows, rb, idx, vals)
        _refresh_caches(table, idx)
        return
    memory = _kernels.table_for_device(table, index.device.index)
    raise_pending_device_error()
    if n == 0:
        return
    capturing = _kernels.capturing()
    checked = settings.bounds_check == "sync" and not capturing
    max_sms = max_sms if max_sms > 0 else settings.max_sms
    call = Call("scatter", table.numel() * table.element_size(), rows, rb, n, memory)
    # (writes: nothing is written when an index is bad)
    decision, check_bounds, in_range = _decision(call, name, idx, checked, capturing, False)
    job = RowJob("scatter", table, rows, rb, idx, vals, max_sms)
    if decision.plan is None:
        # Measured on this call: every candidate writes the same rows (with duplicate indices, one writer per
        # element wins either way).
        _auto.measure(call, decision, job, check_bounds=checked)
    else:
        _auto.run(call, job, decision.plan, auto=name == "auto", check_bounds=check_bounds, in_range=in_range)
    _refresh_caches(table, idx)


def _refresh_caches(table: Tensor, idx: Tensor) -> None:
    """After rows `idx` of `table` were written: autograd learns that the table changed (its version counter, which
    torch's own in-place ops bump: a backward that needs the values saved before the write then raises, as with
    torch, instead of using the new ones), and the caches of that memory read their copies of the rows again."""
    if not table.is_inference():
        torch.autograd.graph.increment_version(table)
    for cache in _cache.caches_in(table):
        if cache._key == table.data_ptr():
            cache.after_write(idx)
        else:
            cache.refresh()  # (a write through a view that starts elsewhere: its rows are not the cache's rows)


@torch.library.custom_op("pytorch_direct::scatter_", mutates_args=("table",))
def scatter_op(table: Tensor, index: Tensor, values: Tensor, strategy: str = "auto", max_sms: int = 0) -> None:
    """table[index[i], ...] = values[i, ...] (duplicates: one writer wins per element)."""
    scatter_impl(table, index, values, strategy, max_sms)


@scatter_op.register_fake
def _scatter_fake(table, index, values, strategy="auto", max_sms=0):
    return None


@_plain_tensors
def index_add_impl(table: Tensor, index: Tensor, values: Tensor, alpha: float, strategy: str, max_sms: int) -> None:
    check_table(table)
    check_index(index)
    rows, _ = row_layout(table)
    vals = _check_values(table, index, values)
    idx = index.contiguous().view(-1)
    if not (table.dtype.is_floating_point or table.dtype.is_complex):
        if alpha != int(alpha):
            raise ValueError(f"alpha={alpha} must be an integer for a {table.dtype} table")
        alpha = int(alpha)  # torch refuses a float alpha for integer tensors
    if index.device.type == "cpu":
        _kernels.check_host_indices(idx, rows)
        table.index_add_(0, idx, vals, alpha=alpha)
        _refresh_caches(table, idx)
        return
    if idx.numel() == 0:
        return
    if settings.bounds_check == "sync" and not _kernels.capturing():
        _kernels.precheck(idx, rows)
    # Duplicates: sum per unique row on the GPU, then one read-modify-write per unique row over PCIe.
    # Half-precision sums accumulate in float32 (one rounding per row instead of one per duplicate).
    # Bool tables, as torch's index_add_ on them: a row element becomes True where it or any added value is (the
    # sum, counted in int32, cast back).
    acc = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.bool: torch.int32}.get(table.dtype,
                                                                                                   table.dtype)
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
