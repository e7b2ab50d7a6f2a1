"""``UnifiedTensor``: a CPU tensor whose memory the GPU can read (pinned or registered host memory), which
indexes like any tensor and gathers rows on the GPU when the indices are CUDA tensors.

Only row indexing is redirected (``t[idx]``, ``index_select``, ``F.embedding``, ``torch.gather`` on dim 0 and the
writes ``t[idx] = v``, ``index_copy_``, ``index_add_``); every other operation behaves as on a CPU tensor. Results
that alias the unified memory (views, slices) stay unified tensors; new results are plain tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _ops


def _plain_int_index(key) -> bool:
    return isinstance(key, Tensor) and key.dtype in _ops.INDEX_DTYPES


class UnifiedTensor(Tensor):
    """A host tensor mapped into the GPU; see the module docs. Create with :func:`pytorch_direct.unified`,
    :func:`pytorch_direct.empty`, :func:`pytorch_direct.zeros` or :func:`pytorch_direct.from_file`."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            with torch._C.DisableTorchFunctionSubclass():
                result = handler(*args, **kwargs)
            if result is not NotImplemented:
                return result
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        return _keep_unified(result, args)

    def plain(self) -> Tensor:
        """A plain ``torch.Tensor`` alias of the same memory (same pinning, no redirection). Use it inside
        ``torch.compile``: Dynamo cannot trace this subclass yet, while ``pytorch_direct.gather(u.plain(), idx)``
        and ``torch.ops.pytorch_direct.gather`` compile with no graph break."""
        with torch._C.DisableTorchFunctionSubclass():
            return self.as_subclass(Tensor)

    def __repr__(self, *, tensor_contents=None):  # noqa: D105 - say what it is, then the data
        with torch._C.DisableTorchFunctionSubclass():
            return "unified " + Tensor.__repr__(self.as_subclass(Tensor))

    def __reduce_ex__(self, protocol):
        # Pickling (e.g. to a spawned process) sends the data as a plain CPU tensor: registration is per process.
        with torch._C.DisableTorchFunctionSubclass():
            return Tensor.__reduce_ex__(self.as_subclass(Tensor), protocol)


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


def _getitem(self, key):
    if isinstance(self, UnifiedTensor) and _plain_int_index(key):
        return _ops.gather(self, key)
    return NotImplemented


def _setitem(self, key, value):
    if not (isinstance(self, UnifiedTensor) and _plain_int_index(key)):
        return NotImplemented
    row_shape = tuple(self.shape[1:])
    if not isinstance(value, Tensor):
        value = torch.tensor(value, dtype=self.dtype, device=key.device)
    if value.device != key.device and value.dim() == 0:
        value = value.to(key.device)
    value = value.to(dtype=self.dtype).expand(tuple(key.shape) + row_shape)
    _ops.scatter(self, key, value.contiguous())
    return None


def _index_select(self, dim, index, *, out=None):
    if isinstance(self, UnifiedTensor) and dim == 0 and out is None and _plain_int_index(index):
        if index.dim() > 1:
            raise IndexError("index_select(): index must be a vector (1-D)")
        return _ops.gather(self, index)
    return NotImplemented


def _embedding(input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
               sparse=False):
    if not (isinstance(weight, UnifiedTensor) and _plain_int_index(input) and weight.dim() == 2):
        return NotImplemented
    if max_norm is not None or scale_grad_by_freq or sparse:
        raise NotImplementedError(
            "F.embedding on a unified tensor supports padding_idx only (max_norm would rewrite host rows in place, "
            "scale_grad_by_freq and sparse gradients are not implemented): drop those arguments"
        )
    if padding_idx is not None and padding_idx < 0:
        padding_idx += weight.shape[0]
    return _ops.gather(weight, input, padding_idx=padding_idx)


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
    if index.device.type == "cpu" or _ops.settings.bounds_check == "sync":
        if index.device.type == "cpu" or not torch.cuda.is_current_stream_capturing():
            _ops._precheck(index, rows)
    flat = index.long() * input.stride(0) + offset
    # Out-of-range rows must raise, not land on a neighbouring element: map them outside the flat range.
    flat = torch.where((index >= 0) & (index < rows), flat, torch.full_like(flat, -1))
    elements = input.reshape(-1)
    return _ops.gather(elements, flat)


def _index_copy_(self, dim, index, source):
    if isinstance(self, UnifiedTensor) and dim == 0 and _plain_int_index(index):
        _ops.scatter(self, index, source)
        return self
    return NotImplemented


def _index_add_(self, dim, index, source, *, alpha=1):
    if isinstance(self, UnifiedTensor) and dim == 0 and _plain_int_index(index):
        _ops.index_add(self, index, source, float(alpha))
        return self
    return NotImplemented


_HANDLERS = {
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
