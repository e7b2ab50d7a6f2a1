"""Creating unified tensors (the public factories): host memory from ``_memory`` wrapped in ``UnifiedTensor``."""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Sequence

import torch
from torch import Tensor

from . import _core
from ._memory import cuda_usable, element_size, host_empty, host_zeros, register_in_place, shape_of
from ._tensor import UnifiedTensor


def empty(*shape: int | Sequence[int], dtype: torch.dtype | None = torch.float32, pin: bool | None = None,
          memory: str = "auto") -> UnifiedTensor:
    """An uninitialised unified tensor in a new host allocation (page-aligned) that every GPU reads with no copy.

    memory: "managed" (CUDA managed memory kept in host RAM, mapped into each GPU with large pages: random rows of
    large tables read several times faster; a forked child process cannot read it), "pinned" (cudaHostAlloc:
    forked children can read it on the CPU) or "auto" (managed for 256 MiB and more where every GPU supports it,
    pinned otherwise). pin=None makes GPU-readable memory when CUDA is usable; on a CPU-only machine (or pin=False)
    the memory is ordinary page-aligned host memory and the same API runs on the CPU. dtype=None: torch's default
    dtype, as in torch.empty."""
    dtype = torch.get_default_dtype() if dtype is None else dtype  # (generic code passes dtype=None to torch's)
    return host_empty(shape_of(shape), dtype, pin=pin, memory=memory).as_subclass(UnifiedTensor)


def zeros(*shape: int | Sequence[int], dtype: torch.dtype | None = torch.float32, pin: bool | None = None,
          memory: str = "auto") -> UnifiedTensor:
    """Like :func:`empty`, filled with zeros (new managed memory is zero already: no second pass over it)."""
    dtype = torch.get_default_dtype() if dtype is None else dtype
    return host_zeros(shape_of(shape), dtype, pin=pin, memory=memory).as_subclass(UnifiedTensor)


def unified(t: Tensor, *, copy: bool = False, memory: str = "auto") -> UnifiedTensor:
    """A unified tensor with t's contents.

    copy=False registers t's own memory with CUDA (cudaHostRegister, mapped) and shares it: writes through either
    are seen by both, and t stays alive as long as the unified tensor does. copy=True copies t into a new allocation
    of kind `memory` (see :func:`empty`); for tables of many GiB read at random rows it is the faster choice
    (registered memory is mapped with 4 KiB pages, like "pinned"). On a CPU-only machine copy=False simply shares
    t's memory.

    Registration pins whole pages. A small tensor from torch's heap shares its first and last page with unrelated
    allocations; a CUDA copy of one of those that starts inside the registered pages and ends outside them fails
    with "invalid argument". Register tensors that own their pages (large ones, :func:`empty`) or use copy=True.

    Autograd: as torch's copies and moves (``t.to(...)``, ``t.pin_memory()``), the result requires grad when ``t``
    does (and grad mode is on). Unlike theirs, its gradient is not sent back to ``t``: a unified table that requires
    grad is a leaf whose gradient accumulates in its own host-resident ``.grad``, so train the unified tensor
    (``torch.optim.SGD([table], ...)``), not ``t``; with copy=False it shares ``t``'s memory, so ``t`` sees the
    updates. A ``t`` with autograd history (not a leaf, e.g. ``w * 2``), whose gradient torch would pass on to
    ``w``, raises ``RuntimeError`` rather than cutting the graph silently.
    """
    if not isinstance(t, Tensor):
        raise TypeError(f"unified() takes a torch.Tensor, got {type(t).__name__}")
    if memory != "auto" and not copy:
        raise ValueError(
            f"unified(t, memory={memory!r}) needs copy=True: copy=False registers t's own memory in place, whose "
            "kind is t's"
        )
    if isinstance(t, UnifiedTensor) and not copy:
        return t
    if t.device.type != "cpu":
        raise ValueError(
            f"unified() takes a CPU tensor, got one on {t.device}: a unified tensor lives in host memory; "
            "move it with t.cpu() first"
        )
    if t.is_sparse or t.layout != torch.strided:
        raise ValueError("unified() takes a dense (strided) tensor")
    # (grad mode as torch's t.to(...): a copy made under torch.no_grad() does not require grad)
    requires_grad = t.requires_grad and torch.is_grad_enabled()
    if requires_grad and not t.is_leaf:
        raise RuntimeError(
            f"unified(t) of a tensor with autograd history (grad_fn={type(t.grad_fn).__name__}): a unified table "
            "is a leaf whose gradient stays in its own .grad, so gradients would not reach the tensors t was made "
            "from. Pass t.detach(), then call .requires_grad_() on the result to train the table itself"
        )
    if copy:
        out = empty(tuple(t.shape), dtype=t.dtype, memory=memory)
        with torch._C.DisableTorchFunctionSubclass():
            out.copy_(t.detach())
        return out.requires_grad_(requires_grad)
    if not t.is_contiguous():
        raise ValueError(
            "unified(t, copy=False) registers t's memory in place, which needs a contiguous tensor: "
            "pass t.contiguous() or copy=True"
        )
    plain = t.detach().as_subclass(Tensor) if isinstance(t, UnifiedTensor) else t.detach()
    return register_in_place(plain).as_subclass(UnifiedTensor).requires_grad_(requires_grad)


def from_file(path: str | os.PathLike, shape: Sequence[int], dtype: torch.dtype = torch.float32, *,
              writable: bool = False, offset: int = 0) -> UnifiedTensor:
    """A unified tensor backed by a memory-mapped file of raw rows (C order, no header).

    writable=False maps the file privately and registers the mapping: the process sees the file's contents, its own
    writes stay in memory, and the data is read from disk once, here (registration pins the pages).

    writable=True: writes must reach the file. On a CPU-only machine the tensor is the shared mapping itself. With
    CUDA the file's contents are copied into pinned memory instead, because Linux >= 6.5 refuses long-term writable
    pins of file-backed pages (cudaHostRegister fails); the rows are written back to the file by
    :func:`flush` and when the returned tensor is garbage-collected (or at interpreter exit).

    The file must hold at least offset + prod(shape) * itemsize bytes."""
    shape = shape_of(tuple(shape))
    path = os.fspath(path)
    nbytes = math.prod(shape) * element_size(dtype)
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise FileNotFoundError(e.errno, f"from_file: cannot open {path!r}: {e.strerror}") from None
    if offset < 0 or size < offset + nbytes:
        raise ValueError(
            f"from_file: {path!r} holds {size} bytes, but offset {offset} + shape {shape} of {dtype} needs "
            f"{offset + nbytes}: check shape, dtype and offset"
        )
    if offset % element_size(dtype):
        raise ValueError(f"from_file: offset {offset} is not a multiple of the {dtype} element size")
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype).as_subclass(UnifiedTensor)
    mapped = torch.from_file(path, shared=writable, size=offset + nbytes, dtype=torch.uint8)
    data = mapped[offset:offset + nbytes]
    if writable and cuda_usable():
        out = empty(shape, dtype=dtype)
        with torch._C.DisableTorchFunctionSubclass():
            pinned = out.view(-1).view(torch.uint8)
            pinned.copy_(data)
        # The finalizer holds the mapping and a view of the pinned bytes (not `out`), so it runs when `out` dies.
        _WRITE_BACK[id(out)] = weakref.finalize(out, _write_back, id(out), data, pinned)
        return out
    try:
        return unified(data.view(dtype).view(shape), copy=False)
    except _core.CudaError as e:
        raise _core.CudaError(
            f"from_file: registering the mapping of {path!r} with CUDA failed ({e}). Linux >= 6.5 refuses "
            "long-term writable pins of file-backed pages; copy the file into pinned memory instead: "
            "pytorch_direct.unified(torch.from_file(...), copy=True)"
        ) from e


_WRITE_BACK: dict = {}


def _write_back(key: int, mapped: Tensor, pinned: Tensor, keep: bool = False) -> None:
    if not keep:
        _WRITE_BACK.pop(key, None)
    if torch.cuda.is_initialized():
        try:
            torch.cuda.synchronize()  # GPU scatters into the pinned copy must land before it is written back
        except RuntimeError:
            pass  # at interpreter exit CUDA may be gone; what reached the host is written
    mapped.copy_(pinned)


def flush(t: Tensor) -> None:
    """Writes a ``from_file(..., writable=True)`` tensor's rows back to its file now, after pending GPU work (it
    also happens when the tensor is garbage-collected). Any other tensor: nothing to do."""
    fin = _WRITE_BACK.get(id(t))
    if fin is None or not fin.alive:
        return
    key, mapped, pinned = fin.peek()[2]
    _write_back(key, mapped, pinned, keep=True)


def is_unified(t: object) -> bool:
    """True for tensors created by this package (their memory is readable by the GPU where CUDA is usable)."""
    return isinstance(t, UnifiedTensor)
