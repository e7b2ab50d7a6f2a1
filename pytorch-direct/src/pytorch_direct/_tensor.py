"""Layer 5: ``UnifiedTensor``, a CPU tensor whose memory the GPU can read (pinned or registered host memory), which
indexes like any tensor and gathers rows on the GPU when the indices are CUDA tensors.

Only row indexing is redirected (``t[idx]``, ``index_select``, ``F.embedding``, ``torch.gather`` on dim 0 and the
writes ``t[idx] = v``, ``index_copy_``, ``index_add_``); every other operation behaves as on a CPU tensor. Results
that alias the unified memory (views, slices) stay unified tensors; new results are plain tensors.

Inside ``torch.compile`` Dynamo inlines ``__torch_function__`` (it always does for a subclass since
pytorch/pytorch#149792; checked with torch 2.13): the row operations become the custom ops of ``_ops``, and every op
receives a plain alias of the unified tensor instead of the tensor itself (see ``_CompileAlias``), so the compiled
graph holds only plain tensors. There, results of the other operations are plain tensors, views included.
"""

from __future__ import annotations

import copy
import weakref

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import Tensor

from . import _cache, _kernels, _memory, _ops
from ._config import settings


def _plain_int_index(key) -> bool:
    """True for row indices the package gathers (int32/int64 tensors). Index tensors torch would misread raise the
    package's TypeError: floating point or complex ones, and boolean masks on a GPU (a unified tensor's memory is on
    the host, so torch would say "indices should be either on cpu or on the same device")."""
    if not isinstance(key, Tensor):
        return False
    if key.dtype in _ops.INDEX_DTYPES:
        return True
    if key.dtype.is_floating_point or key.dtype.is_complex or (key.dtype == torch.bool and key.device.type != "cpu"):
        _ops.check_index(key)  # raises
    return False


# In-place methods that change no element (the cached rows of a table stay valid).
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "retain_grad", "record_stream", "register_hook"})


def _refresh_after_write(func, args, kwargs) -> None:
    """After an in-place torch op (not a row operation) on a unified tensor with a GPU cache of hot rows, or with a
    unified ``out=``: the cache reads every cached row again (the op may have changed any element).

    The written tensor is the op's first argument: ``t.mul_(2)``, ``t[5:9] = 0``; a list of them for the
    multi-tensor ops of optimizers (``torch._foreach_add_(params, ...)`` with ``foreach=True``,
    ``torch._fused_adam_(params, ...)`` with ``fused=True``); or the ``tensor=`` keyword of ``torch.nn.init``'s
    functions, which hand their arguments over by keyword."""
    name = getattr(func, "__name__", "")
    targets = []
    out = kwargs.get("out")
    if out is not None:
        targets.extend(out if isinstance(out, (list, tuple)) else (out,))
    if name == "__setitem__" or (name.endswith("_") and not name.endswith("__") and name not in _NOT_WRITES):
        written = args[0] if args else kwargs.get("tensor", kwargs.get("input", kwargs.get("self")))
        targets.extend(written if isinstance(written, (list, tuple)) else (written,))
    for t in targets:
        if isinstance(t, UnifiedTensor):
            for cache in _cache.caches_in(t):
                cache.refresh()


class _CompileAlias:
    """``t._compile_alias``: a plain ``torch.Tensor`` alias of the unified tensor ``t`` (same memory and
    metadata), what ops receive instead of ``t`` inside torch.compile.

    Dynamo reads the attribute for real when it traces (the alias becomes a graph input of its own, guarded like any
    tensor) and again on each call of the compiled code, so the graph only ever receives plain tensors: torch 2.13
    fails the first call of a compiled graph that hands a ``__torch_function__`` subclass to an op
    (pytorch/pytorch#193932), and the custom ops' fake kernels describe plain tensors anyway. The alias is kept in
    ``t.__dict__`` (Dynamo's no-aliasing guard compares the ids of the tensors it reads, so every read must give the
    same object) and made anew when ``t``'s data pointer, shape, strides, dtype or requires_grad changed.

    While ``t`` requires grad the alias is a detached leaf that requires grad and names ``t`` (weakly): the gather's
    backward, which returns no gradient for its table, adds into ``t.grad`` (``_ops.accumulate_grad_op``), and the
    gradient that other ops give the alias moves to ``t.grad`` once accumulated (``_pass_grad_to_owner``). A leaf,
    not an autograd view of ``t``: AOTAutograd detaches a non-leaf input that gets no gradient, which would cut the
    compiled gather out of autograd, and a view kept in ``t.__dict__`` would keep ``t`` alive through its grad_fn,
    a cycle through C++ that the garbage collector cannot break."""

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        alias = obj.__dict__.get("_pytorch_direct_alias")
        with torch._C.DisableTorchFunctionSubclass():
            if alias is not None and _same_view(alias, obj):
                return alias
            if obj.requires_grad and not obj.is_leaf:
                raise NotImplementedError(_NON_LEAF_MESSAGE)
            alias = obj.detach()
            if obj.requires_grad:
                alias.requires_grad_(True)
                alias._pytorch_direct_leaf = weakref.ref(obj)
                alias.register_post_accumulate_grad_hook(_pass_grad_to_owner)
        obj.__dict__["_pytorch_direct_alias"] = alias
        return alias

    def __set__(self, obj, value):
        raise AttributeError("_compile_alias is read-only")


_NON_LEAF_MESSAGE = (
    "torch.compile of a function that takes a view of a unified tensor that requires grad: pass the table itself "
    "(the leaf) and slice or offset inside the compiled function"
)


def _same_view(alias: Tensor, t: Tensor) -> bool:
    return (
        alias.data_ptr() == t.data_ptr()
        and alias.dtype == t.dtype
        and alias.shape == t.shape
        and alias.stride() == t.stride()
        and alias.requires_grad == t.requires_grad
    )


def _pass_grad_to_owner(alias: Tensor) -> None:
    """Post-accumulate-grad hook of a compile alias that requires grad: moves the gradient that a compiled graph's
    other ops (not the row operations) gave the alias into the unified tensor's .grad, summing as autograd does."""
    owner = alias._pytorch_direct_leaf()
    grad, alias.grad = alias.grad, None
    if owner is None or grad is None:
        return  # the unified tensor is gone, and its .grad with it
    with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
        if owner.grad is None:
            owner.grad = grad
        else:
            owner.grad += grad


class UnifiedTensor(Tensor):
    """A host tensor mapped into the GPU; see the module docs. Create with :func:`pytorch_direct.unified`,
    :func:`pytorch_direct.empty`, :func:`pytorch_direct.zeros` or :func:`pytorch_direct.from_file`."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_dynamo_compiling():  # True only in code that Dynamo traces, never in eager
            return _traced_torch_function(func, args, kwargs)
        handler = _HANDLERS.get(func)
        if handler is not None:
            with torch._C.DisableTorchFunctionSubclass():
                result = handler(*args, **kwargs)
            if result is not NotImplemented:
                return result
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        if _cache._CACHES:
            _refresh_after_write(func, args, kwargs)
        if func == _BASE_GETTER:
            # A unified tensor is an alias (as_subclass makes a view) of a plain tensor that owns the memory: return
            # that base as it is. Wrapping it would make a new view whose _base is the same plain tensor, wrapped
            # anew on the next read: an endless chain of bases, which Dynamo walks when it wraps a graph input.
            return result
        return _keep_unified(result, args)

    # Inside torch.compile, what ops receive instead of the tensor itself (see _CompileAlias).
    _compile_alias = _CompileAlias()

    def plain(self) -> Tensor:
        """A plain ``torch.Tensor`` alias of the same memory (same pinning, no redirection; an autograd view of
        this tensor). Not needed for ``torch.compile``, which traces unified tensors (``t[idx]``, ``F.embedding``,
        ``pytorch_direct.gather(t, idx)``, ... compile to the custom ops with no graph break); ``plain()`` gives
        torch's own behaviour, e.g. to index rows with torch's CPU indexing."""
        if torch.compiler.is_dynamo_compiling():
            return op_input(self)  # Dynamo cannot trace as_subclass(Tensor) of a subclass; see _CompileAlias
        with torch._C.DisableTorchFunctionSubclass():
            return self.as_subclass(Tensor)

    def __repr__(self, *, tensor_contents=None):  # noqa: D105 - say what it is, then the data
        with torch._C.DisableTorchFunctionSubclass():
            return "unified " + Tensor.__repr__(self.as_subclass(Tensor))

    def __format__(self, format_spec):
        # torch formats only plain 0-d tensors as numbers (f"{t:.3f}"); an element of a table (u[3, 2], a view, so
        # a unified tensor) raised "unsupported format string". Format it as torch formats a plain one.
        if self.dim() == 0:
            return self.item().__format__(format_spec)
        return object.__format__(self, format_spec)  # str(self), "unified tensor(...)"

    def __deepcopy__(self, memo):
        # torch's deepcopy of a tensor subclass asks new_empty() for an instance of the subclass, which fails here
        # (new results are plain tensors), so copy.deepcopy of a table or of a module holding one raised. The copy
        # is a new host allocation of the same memory kind; views copied together share one copy of their memory,
        # as torch's deepcopy does with storages.
        if id(self) in memo:
            return memo[id(self)]
        with torch._C.DisableTorchFunctionSubclass():
            src = self.as_subclass(Tensor).detach()
            storage = src.untyped_storage()
            key = ("pytorch_direct storage", storage.data_ptr(), storage.nbytes())
            buf = memo.get(key)
            if buf is None:
                whole = torch.empty(0, dtype=torch.uint8).set_(storage)
                buf = _memory.host_empty((storage.nbytes(),), torch.uint8, memory=_memory.host_kind(whole) or "auto")
                buf.copy_(whole)
                memo[key] = buf
            new = torch.empty(0, dtype=src.dtype).set_(buf.untyped_storage(), src.storage_offset(), src.shape,
                                                       src.stride())
            new = new.as_subclass(UnifiedTensor)
            new.requires_grad_(self.requires_grad)
            if self.grad is not None:
                new.grad = copy.deepcopy(self.grad, memo)
        # Python attributes (a Parameter's flag, ...), but not the compile alias of this tensor's memory.
        state = {k: v for k, v in self.__dict__.items() if k != "_pytorch_direct_alias"}
        new.__dict__.update(copy.deepcopy(state, memo))
        memo[id(self)] = new
        return new

    def __reduce_ex__(self, protocol):
        # Pickling (e.g. to a spawned process) sends the data as a plain CPU tensor: registration is per process.
        with torch._C.DisableTorchFunctionSubclass():
            return Tensor.__reduce_ex__(self.as_subclass(Tensor), protocol)


_BASE_GETTER = Tensor._base.__get__


def op_input(t):
    """What the package's custom ops receive for ``t``: ``t`` itself, but a unified tensor's plain alias inside
    torch.compile (see _CompileAlias)."""
    if not (isinstance(t, UnifiedTensor) and torch.compiler.is_dynamo_compiling()):
        return t
    with torch._C.DisableTorchFunctionSubclass():
        if t.requires_grad and not t.is_leaf:
            # The alias would be a leaf of its own: gradients would reach neither the view nor its base.
            raise NotImplementedError(_NON_LEAF_MESSAGE)
    return t._compile_alias


def _traced_torch_function(func, args, kwargs):
    """``__torch_function__`` as Dynamo traces it (inside torch.compile): the row operations become the package's
    custom ops; every other function runs on the plain aliases, so its results are plain tensors (views too)."""
    handler = _HANDLERS.get(func)
    if handler is not None:
        with torch._C.DisableTorchFunctionSubclass():
            result = handler(*args, **kwargs)
        if result is not NotImplemented:
            return result
    if func in _AUTOGRAD_GETTERS:  # about the tensor itself (a view, perhaps), not about its alias (a leaf)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    args, kwargs = pytree.tree_map_only(UnifiedTensor, op_input, (args, kwargs))
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _unified_storages(args) -> set[int]:
    found = set()
    for a in args:
        if isinstance(a, UnifiedTensor):
            with torch._C.DisableTorchFunctionSubclass():
                found.add(a.untyped_storage().data_ptr())
    return found


def _keep_unified(result, args):
    if isinstance(result, Tensor) and not isinstance(result, UnifiedTensor) and result.device.type == "cpu":
        storages = _unified_storages(args)
        if storages:
            with torch._C.DisableTorchFunctionSubclass():
                same = result.untyped_storage().data_ptr() in storages
            if same:
                return result.as_subclass(UnifiedTensor)
    elif isinstance(result, (tuple, list)) and any(isinstance(r, Tensor) for r in result):
        return type(result)(_keep_unified(r, args) for r in result)
    return result


# ---------------------------------------------------------------------------------------------- handlers
# Each returns NotImplemented for the cases it does not redirect (they run as on a CPU tensor).


def _torch_rows(table: Tensor, index: Tensor) -> bool:
    """CPU indices into a view whose rows are not contiguous (``t.t()``, ``t[:, 1:3]``): torch's own indexing gives
    the rows (the package's row copies need each row to be one contiguous byte range, and would raise)."""
    return index.device.type == "cpu" and not table.is_contiguous()


def _getitem(self, key):
    if isinstance(self, UnifiedTensor) and _plain_int_index(key) and not _torch_rows(self, key):
        return _ops.gather(op_input(self), op_input(key))
    return NotImplemented


def _setitem(self, key, value):
    if not (isinstance(self, UnifiedTensor) and _plain_int_index(key)) or _torch_rows(self, key):
        return NotImplemented
    target = tuple(key.shape) + tuple(self.shape[1:])
    if not isinstance(value, Tensor):
        value = torch.tensor(value, dtype=self.dtype, device=key.device)
    elif value.dtype != self.dtype:
        # As torch's index_put_: a silent cast would, e.g., drop a complex value's imaginary part.
        raise RuntimeError(
            f"Index put requires the source and destination dtypes match, got {self.dtype} for the destination "
            f"and {value.dtype} for the source: convert the values with .to({self.dtype})"
        )
    if value.device != key.device and value.dim() == 0:
        value = value.to(key.device)
    # torch's broadcasting rule for index_put_: leading dimensions of size 1 beyond the target's are dropped.
    given = tuple(value.shape)
    while value.dim() > len(target) and value.shape[0] == 1:
        value = value[0]
    try:
        value = value.expand(target)
    except RuntimeError:
        raise RuntimeError(
            f"shape mismatch: value tensor of shape {list(given)} cannot be broadcast to indexing result of shape "
            f"{list(target)}"
        ) from None
    _ops.scatter(op_input(self), op_input(key), op_input(value).contiguous())
    return None


def _index_select(self, dim, index, *, out=None):
    if (isinstance(self, UnifiedTensor) and dim == 0 and out is None and _plain_int_index(index)
            and not _torch_rows(self, index)):
        if index.dim() > 1:
            raise IndexError("index_select(): index must be a vector (1-D)")
        if index.dim() == 0:  # (torch's index_select keeps the dimension: one row of shape (1, ...))
            index = index.reshape(1)
        return _ops.gather(op_input(self), op_input(index))
    return NotImplemented


def _embedding(input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
               sparse=False):
    if (not (isinstance(weight, UnifiedTensor) and _plain_int_index(input) and weight.dim() == 2)
            or _torch_rows(weight, input)):
        return NotImplemented
    if max_norm is not None or scale_grad_by_freq or sparse:
        raise NotImplementedError(
            "F.embedding on a unified tensor supports padding_idx only (max_norm would rewrite host rows in place, "
            "scale_grad_by_freq and sparse gradients are not implemented): drop those arguments"
        )
    if padding_idx is not None and padding_idx < 0:
        padding_idx += weight.shape[0]
    return _ops.gather(op_input(weight), op_input(input), padding_idx=padding_idx)


def _gather(input, dim, index, *, sparse_grad=False, out=None):
    """torch.gather along dim 0: out[i][j]... = input[index[i][j]...][j]..., element by element."""
    if not (isinstance(input, UnifiedTensor) and dim == 0 and out is None and _plain_int_index(index)):
        return NotImplemented
    if index.dim() != input.dim():
        raise RuntimeError("gather(): index must have the same number of dimensions as input")
    for d in range(1, input.dim()):
        if index.shape[d] > input.shape[d]:
            raise RuntimeError(f"gather(): index.size({d}) = {index.shape[d]} exceeds input.size({d})")
    if not input.is_contiguous():
        return NotImplemented
    if input.requires_grad and torch.is_grad_enabled():
        # The element-wise gather reads through a flat view, which has no host-resident gradient of its own.
        raise NotImplementedError(
            "torch.gather on a unified tensor that requires grad is not supported: gather whole rows "
            "(t[idx], index_select, F.embedding) and select columns afterwards, or run it under torch.no_grad()"
        )
    # One element per "row": flat = index * stride(0) + offset of the other coordinates. For a contiguous input
    # that offset is < stride(0), so flat is in range exactly when index is.
    offset = torch.zeros((1,) * index.dim(), dtype=torch.int64, device=index.device)
    for d in range(1, input.dim()):
        shape = [1] * index.dim()
        shape[d] = index.shape[d]
        offset = offset + torch.arange(index.shape[d], device=index.device).view(shape) * input.stride(d)
    rows = input.shape[0]
    # (Not in code that Dynamo traces, which cannot branch on the indices' values: a bad index raises from the op,
    # which reports it as -1.)
    precheck = index.device.type == "cpu" or settings.bounds_check == "sync"
    if precheck and not torch.compiler.is_dynamo_compiling():
        if index.device.type == "cpu" or not torch.cuda.is_current_stream_capturing():
            _kernels.precheck(index, rows)
    flat = index.long() * input.stride(0) + offset
    # Out-of-range rows must raise, not land on a neighbouring element: map them outside the flat range.
    flat = torch.where((index >= 0) & (index < rows), flat, torch.full_like(flat, -1))
    elements = op_input(input).reshape(-1)
    return _ops.gather(elements, flat)


def _check_vector_index(name: str, index: Tensor) -> None:
    # torch's index_copy_ and index_add_ take a 0-d or 1-D index; the package's writes would take any shape.
    if index.dim() > 1:
        raise IndexError(f"{name}(): index must be a vector (0-d or 1-D), got {index.dim()}-D of shape "
                         f"{list(index.shape)}: flatten it and the source with it")


def _index_copy_(self, dim, index, source):
    if isinstance(self, UnifiedTensor) and dim == 0 and _plain_int_index(index) and not _torch_rows(self, index):
        _check_vector_index("index_copy_", index)
        if self.dim() == 1 and isinstance(source, Tensor) and source.dim() == 0 and index.numel() == 1:
            source = source.reshape(index.shape)  # torch takes a 0-d source for one index into a 1-D tensor
        _ops.scatter(op_input(self), op_input(index), op_input(source))
        return self
    return NotImplemented


def _index_add_(self, dim, index, source, *, alpha=1):
    if isinstance(self, UnifiedTensor) and dim == 0 and _plain_int_index(index) and not _torch_rows(self, index):
        _check_vector_index("index_add_", index)
        if isinstance(alpha, complex):  # (the custom op's alpha is a float: scale the source instead)
            source, alpha = source * alpha, 1.0
        _ops.index_add(op_input(self), op_input(index), op_input(source), float(alpha))
        return self
    return NotImplemented


def _copy_target(src, device, dtype, memory_format) -> torch.device | None:
    """The CUDA device a copy of `src` to (device, dtype, memory_format) goes to through ``_ops.copy_to_cuda``, or
    None for torch's own copy: only plain same-dtype copies of contiguous managed memory (torch's cudaMemcpy from
    pinned memory runs at the link's speed already)."""
    if not isinstance(src, UnifiedTensor) or device is None or torch.device(device).type != "cuda":
        return None
    if dtype not in (None, src.dtype) or memory_format not in (None, torch.preserve_format, torch.contiguous_format):
        return None
    if src.requires_grad and torch.is_grad_enabled():
        return None  # torch's copy records the autograd edge
    if torch.compiler.is_dynamo_compiling() or not src.is_contiguous() or _memory.host_kind(src) != "managed":
        return None
    device = torch.device(device)
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def _copied_to(src, target: torch.device, non_blocking: bool) -> Tensor:
    out = torch.empty(tuple(src.shape), dtype=src.dtype, device=target)
    return _ops.copy_to_cuda(src, out, non_blocking)


def _to(self, *args, **kwargs):
    kwargs = dict(kwargs)
    kwargs.pop("copy", None)  # (a new tensor either way)
    if args and isinstance(args[0], Tensor):
        return NotImplemented  # to(other): torch's
    device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    target = _copy_target(self, device, dtype, memory_format)
    return NotImplemented if target is None else _copied_to(self, target, bool(non_blocking))


def _cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
    if device is None:
        device = torch.device("cuda")
    elif isinstance(device, int):
        device = torch.device("cuda", device)
    target = _copy_target(self, device, None, memory_format)
    return NotImplemented if target is None else _copied_to(self, target, non_blocking)


def _copy_(self, src, non_blocking=False):
    if (isinstance(self, UnifiedTensor) or not isinstance(self, Tensor) or self.shape != src.shape
            or not self.is_contiguous() or (self.requires_grad and torch.is_grad_enabled())):
        return NotImplemented
    if _copy_target(src, self.device, self.dtype, None) is None:
        return NotImplemented
    _ops.copy_to_cuda(src, self, non_blocking)
    return self


_HANDLERS = {
    Tensor.to: _to,
    Tensor.cuda: _cuda,
    Tensor.copy_: _copy_,
    Tensor.__getitem__: _getitem,
    Tensor.__setitem__: _setitem,
    torch.index_select: _index_select,
    Tensor.index_select: _index_select,
    F.embedding: _embedding,
    torch.gather: _gather,
    Tensor.gather: _gather,
    Tensor.index_copy_: _index_copy_,
    Tensor.index_add_: _index_add_,
}
# Autograd facts that inside torch.compile are read from the unified tensor, not from its alias (always a leaf).
_AUTOGRAD_GETTERS = (Tensor.is_leaf.__get__, Tensor.grad_fn.__get__)
