"""Layer 1: host memory the GPU can read (managed and pinned allocations, registrations), as plain ``torch.Tensor``
objects.

Lifetime is tied to torch's: a tensor's storage owns (through its DLPack deleter) the pinned allocation or the
registration, and a registration also keeps the tensor it registered alive. Views share the storage, so the memory
is released (unregistered exactly once, by shared-cuda's registry) only after the last view is gone.

Nothing here knows about strategies or the ``UnifiedTensor`` subclass (``_create`` wraps these tensors in it).
"""

from __future__ import annotations

import math
import os

import torch
from torch import Tensor

from . import _core

_CUDA = None
_MANAGED = None

# Host memory kinds of new allocations (host_empty's `memory`). "managed": CUDA managed memory kept in host RAM and
# mapped into every GPU (shared-cuda's host_managed_buffer): the driver maps it with large pages, so random rows of
# a table of many GiB read 3-11x faster zero-copy than from "pinned" (cudaHostAlloc, 4 KiB mappings; measured on an
# H200 host), and a 48 GiB table was made in 8-9 s instead of 25-28. But a forked child
# process cannot read it (see README), so "auto" takes it only for allocations of at least MANAGED_MIN_BYTES, where
# address translation starts to matter, and only where every GPU supports it.
MEMORY_KINDS = ("auto", "managed", "pinned")
MANAGED_MIN_BYTES = 256 << 20

# True in a process forked from one that imported this package: it cannot read managed memory (the first read kills
# it with SIGSEGV), so the row operations refuse it there with an error that names the fix.
forked = False


def _after_fork_in_child() -> None:
    global forked
    forked = True


os.register_at_fork(after_in_child=_after_fork_in_child)

MANAGED_AFTER_FORK = (
    "this unified tensor is in managed memory, which a forked process (e.g. a DataLoader worker started with fork) "
    "cannot read: create it with memory='pinned' (pytorch_direct.empty/zeros/unified(..., copy=True, "
    "memory='pinned'), or UnifiedFeatureStore(memory='pinned')), start workers with "
    "multiprocessing_context='spawn', or gather in the main process"
)


def check_readable_here(t: Tensor) -> None:
    """Raises RuntimeError in a forked child for a tensor in managed memory (see ``forked``)."""
    if forked and host_kind(t) == "managed":
        raise RuntimeError(MANAGED_AFTER_FORK)


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


def managed_supported() -> bool:
    """True when managed host memory can be allocated: CUDA usable and every GPU has concurrent managed access."""
    global _MANAGED
    if _MANAGED is None:
        _MANAGED = cuda_usable() and bool(_core.managed_host_supported())
    return _MANAGED


def memory_kind(nbytes: int, memory: str) -> str:
    """The kind ("managed" or "pinned") a new GPU-readable allocation of nbytes gets for the `memory` asked."""
    if memory not in MEMORY_KINDS:
        raise ValueError(f"memory must be one of {MEMORY_KINDS}, got {memory!r}")
    if memory == "auto":
        return "managed" if nbytes >= MANAGED_MIN_BYTES and managed_supported() else "pinned"
    if memory == "managed" and cuda_usable() and not managed_supported():
        raise _core.UnavailableError(
            "memory='managed' needs every GPU to access managed memory concurrently with the CPU "
            "(cudaDevAttrConcurrentManagedAccess: Linux, Pascal or newer); use memory='pinned'"
        )
    return memory


def host_empty(shape: tuple[int, ...], dtype: torch.dtype, *, pin: bool | None = None,
               memory: str = "auto") -> Tensor:
    """An uninitialised plain tensor in a new page-aligned host allocation: readable by the GPU when ``pin``
    (default: when CUDA is usable), as ``memory`` (see MEMORY_KINDS), ordinary memory otherwise."""
    nbytes = math.prod(shape) * element_size(dtype)
    kind = memory_kind(nbytes, memory)
    pin = cuda_usable() if pin is None else pin
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    if not pin or kind == "managed":  # (pages are reserved when touched: more than the host has gets it killed)
        check_host_room(nbytes)
    try:
        if not pin:
            owner = _core.pageable_memory(nbytes)
        elif kind == "managed":
            owner = _core.managed_memory(nbytes)
        else:
            owner = _core.pinned_memory(nbytes)
    except MemoryError as e:
        raise MemoryError(f"allocating a unified tensor of {describe_bytes(nbytes)} (shape {shape}, {dtype}) "
                          f"failed ({e}): free host memory, or use a smaller table (pytorch_direct.from_file maps a "
                          f"file instead)") from e
    return owner.tensor().view(dtype).view(shape)


def describe_bytes(nbytes: int) -> str:
    """``nbytes`` in the largest binary unit it fills at least once (``"3.00 MiB"``)."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.2f} {unit}"
    return f"{nbytes} bytes"


def available_host_bytes() -> int | None:
    """Linux's estimate of the host memory available without swapping (MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_host_room(nbytes: int) -> None:
    """Raises MemoryError when a managed or pageable allocation of nbytes cannot fit in host memory. Their pages
    are reserved when touched (a managed one's when it is made, a pageable one's by ``zeros`` or the first write),
    and touching more than the host has gets the process killed by Linux's OOM killer, with no Python error
    (cudaHostAlloc, by contrast, fails with an error)."""
    available = available_host_bytes()
    if available is not None and nbytes > available:
        raise MemoryError(
            f"a unified tensor of {describe_bytes(nbytes)} does not fit in the {describe_bytes(available)} of host "
            "memory available (MemAvailable in /proc/meminfo): free host memory, or use a smaller table "
            "(pytorch_direct.from_file maps a file instead)"
        )


def host_kind(t: Tensor) -> str:
    """"managed" or "pinned" for memory this package allocated or registered (t lies inside one allocation),
    "" for any other."""
    return _HOST_KINDS[_core.tracked_host_kind(t.data_ptr(), t.numel() * t.element_size())]


_HOST_KINDS = ("", "pinned", "managed")  # shared-cuda's host_kind: none, pinned, managed


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype, *, pin: bool | None = None,
               memory: str = "auto") -> Tensor:
    """Like :func:`host_empty`, filled with zeros: by CPU threads, except in new managed memory, whose pages were
    just faulted in zeroed (a second pass over a table of many GiB costs seconds)."""
    t = host_empty(shape, dtype, pin=pin, memory=memory)
    if host_kind(t) != "managed":
        with torch._C.DisableTorchFunctionSubclass():
            t.zero_()
    return t


def register_in_place(t: Tensor) -> Tensor:
    """A plain alias of contiguous CPU tensor ``t`` whose memory the GPU can read: ``t`` registered with CUDA
    (``cudaHostRegister``, mapped; the registration keeps ``t`` alive), or ``t`` itself when no registration is
    needed (CPU-only machine, empty, already ours, or already page-locked, e.g. by ``pin_memory()``: CUDA refuses a
    second registration)."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0 or not cuda_usable() or host_kind(t) or t.is_pinned():
        return t
    memory = _core.register_memory(t.data_ptr(), nbytes, t)
    return memory.tensor().view(t.dtype).view(tuple(t.shape))
