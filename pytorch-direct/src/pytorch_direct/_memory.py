"""Layer 1: host memory the GPU can read (pinned allocations and registrations), as plain ``torch.Tensor`` objects.

Lifetime is tied to torch's: a tensor's storage owns (through its DLPack deleter) the pinned allocation or the
registration, and a registration also keeps the tensor it registered alive. Views share the storage, so the memory
is released (unregistered exactly once, by shared-cuda's registry) only after the last view is gone.

Nothing here knows about strategies or the ``UnifiedTensor`` subclass (``_create`` wraps these tensors in it).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import _core

_CUDA = None


def cuda_usable() -> bool:
    """True when this build has kernels and a CUDA device is usable (never initialises torch's CUDA)."""
    global _CUDA
    if _CUDA is None:
        _CUDA = bool(_core.kernels_compiled() and _core.cuda_available())
    return _CUDA


def shape_of(shape) -> tuple[int, ...]:
    """A shape given as ``(2, 3)`` or ``((2, 3),)`` as a tuple of non-negative ints."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"negative dimension in shape {shape}")
    return shape


def element_size(dtype: torch.dtype) -> int:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    return torch.empty((), dtype=dtype).element_size()


def host_empty(shape: tuple[int, ...], dtype: torch.dtype, *, pin: bool | None = None) -> Tensor:
    """An uninitialised plain tensor in a new page-aligned host allocation: pinned and mapped into the GPU when
    ``pin`` (default: when CUDA is usable), ordinary memory otherwise."""
    nbytes = math.prod(shape) * element_size(dtype)
    pin = cuda_usable() if pin is None else pin
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    memory = _core.pinned_memory(nbytes) if pin else _core.pageable_memory(nbytes)
    return memory.tensor().view(dtype).view(shape)


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """Like :func:`host_empty`, filled with zeros (by CPU threads)."""
    t = host_empty(shape, dtype)
    with torch._C.DisableTorchFunctionSubclass():
        t.zero_()
    return t


def register_in_place(t: Tensor) -> Tensor:
    """A plain alias of contiguous CPU tensor ``t`` whose memory the GPU can read: ``t`` registered with CUDA
    (``cudaHostRegister``, mapped; the registration keeps ``t`` alive), or ``t`` itself when no registration is
    needed (CPU-only machine, empty, or already page-locked, e.g. by ``pin_memory()``: CUDA refuses a second
    registration)."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0 or not cuda_usable() or t.is_pinned():
        return t
    memory = _core.register_memory(t.data_ptr(), nbytes, t)
    return memory.tensor().view(t.dtype).view(tuple(t.shape))
