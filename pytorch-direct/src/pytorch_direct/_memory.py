"""Creating unified tensors: host memory the GPU reads directly (pinned allocations or registered memory).

Lifetime is tied to torch's: a unified tensor's storage owns (through its DLPack deleter) the pinned allocation or
the registration, and a registration also keeps the tensor it registered alive. Views share the storage, so the
memory is released (unregistered exactly once, by shared-cuda's registry) only after the last view is gone.
"""

from __future__ import annotations

import math
import os
from typing import Sequence

import torch
from torch import Tensor

from . import _core
from ._tensor import UnifiedTensor

_CUDA = None


def cuda_usable() -> bool:
    """True when this build has kernels and a CUDA device is usable (never initialises torch's CUDA)."""
    global _CUDA
    if _CUDA is None:
        _CUDA = bool(_core.kernels_compiled() and _core.cuda_available())
    return _CUDA


def _shape(shape) -> tuple[int, ...]:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"negative dimension in shape {shape}")
    return shape


def _element_size(dtype: torch.dtype) -> int:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    return torch.empty((), dtype=dtype).element_size()


def _wrap(flat_bytes: Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> UnifiedTensor:
    t = flat_bytes.view(dtype).view(shape) if flat_bytes.numel() else torch.empty(shape, dtype=dtype)
    return t.as_subclass(UnifiedTensor)


def empty(*shape, dtype: torch.dtype = torch.float32, pin: bool | None = None) -> UnifiedTensor:
    """An uninitialised unified tensor in a new pinned, mapped host allocation (page-aligned).

    pin=None pins when CUDA is usable; on a CPU-only machine the memory is ordinary page-aligned host memory and
    the same API runs on the CPU."""
    shape = _shape(shape)
    nbytes = math.prod(shape) * _element_size(dtype)
    pin = cuda_usable() if pin is None else pin
    memory = _core.pinned_memory(nbytes) if pin else _core.pageable_memory(nbytes)
    return _wrap(memory.tensor(), shape, dtype)


def zeros(*shape, dtype: torch.dtype = torch.float32, pin: bool | None = None) -> UnifiedTensor:
    """Like :func:`empty`, filled with zeros (by CPU threads)."""
    t = empty(*shape, dtype=dtype, pin=pin)
    with torch._C.DisableTorchFunctionSubclass():
        t.zero_()
    return t


def unified(t: Tensor, *, copy: bool = False) -> UnifiedTensor:
    """A unified tensor with t's contents.

    copy=False registers t's own memory with CUDA (cudaHostRegister, mapped) and shares it: writes through either
    are seen by both, and t stays alive as long as the unified tensor does. copy=True copies t into a new pinned
    allocation. On a CPU-only machine copy=False simply shares t's memory.
    """
    if not isinstance(t, Tensor):
        raise TypeError(f"unified() takes a torch.Tensor, got {type(t).__name__}")
    if isinstance(t, UnifiedTensor) and not copy:
        return t
    if t.device.type != "cpu":
        raise ValueError(
            f"unified() takes a CPU tensor, got one on {t.device}: a unified tensor lives in host memory; "
            "move it with t.cpu() first"
        )
    if t.is_sparse or t.layout != torch.strided:
        raise ValueError("unified() takes a dense (strided) tensor")
    if copy:
        out = empty(tuple(t.shape), dtype=t.dtype)
        with torch._C.DisableTorchFunctionSubclass():
            out.copy_(t.detach())
        return out
    if not t.is_contiguous():
        raise ValueError(
            "unified(t, copy=False) registers t's memory in place, which needs a contiguous tensor: "
            "pass t.contiguous() or copy=True"
        )
    plain = t.detach().as_subclass(Tensor) if isinstance(t, UnifiedTensor) else t.detach()
    nbytes = plain.numel() * plain.element_size()
    if nbytes == 0 or not cuda_usable():
        return plain.as_subclass(UnifiedTensor)
    if plain.is_pinned():
        # Already page-locked (e.g. by torch's pin_memory): CUDA refuses a second registration, and none is needed.
        return plain.as_subclass(UnifiedTensor)
    memory = _core.register_memory(plain.data_ptr(), nbytes, plain)
    return _wrap(memory.tensor(), tuple(plain.shape), plain.dtype)


def from_file(path: str | os.PathLike, shape: Sequence[int], dtype: torch.dtype = torch.float32, *,
              writable: bool = False, offset: int = 0) -> UnifiedTensor:
    """A unified tensor backed by a memory-mapped file of raw rows (C order, no header).

    writable=True maps the file shared: writes reach the file. writable=False maps it privately: the process sees
    the file's contents and its own writes stay in memory. Registration pins the pages, so the data is read from
    disk once, here; the file must hold at least offset + prod(shape) * itemsize bytes."""
    shape = _shape(tuple(shape))
    path = os.fspath(path)
    nbytes = math.prod(shape) * _element_size(dtype)
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise FileNotFoundError(e.errno, f"from_file: cannot open {path!r}: {e.strerror}") from None
    if offset < 0 or size < offset + nbytes:
        raise ValueError(
            f"from_file: {path!r} holds {size} bytes, but offset {offset} + shape {shape} of {dtype} needs "
            f"{offset + nbytes}: check shape, dtype and offset"
        )
    mapped = torch.from_file(path, shared=writable, size=offset + nbytes, dtype=torch.uint8)
    data = mapped[offset:offset + nbytes]
    if offset % _element_size(dtype):
        raise ValueError(f"from_file: offset {offset} is not a multiple of the {dtype} element size")
    return unified(data.view(dtype).view(shape), copy=False)


def is_unified(t: object) -> bool:
    """True for tensors created by this package (their memory is readable by the GPU where CUDA is usable)."""
    return isinstance(t, UnifiedTensor)
