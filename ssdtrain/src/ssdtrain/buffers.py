"""Host buffers the I/O engine moves in place: tensors on transparent huge pages (pinned where CUDA is present)
and page-aligned tensors for O_DIRECT."""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Sequence

import torch

_HUGE = 2 << 20
_huge_ranges: dict[int, tuple[int, int]] = {}  # id -> [start, end) of memory from huge_empty()


def _is_huge(address: int, nbytes: int) -> bool:
    return any(start <= address and address + nbytes <= end for start, end in list(_huge_ranges.values()))


def _forget_huge(key: int, address: int, pinned: bool) -> None:
    _huge_ranges.pop(key, None)
    if pinned:
        try:
            torch.cuda.cudart().cudaHostUnregister(address)
        except Exception:  # noqa: BLE001 - interpreter shutdown: the process is going away with its memory
            pass


def huge_empty(
    shape: int | Sequence[int], dtype: torch.dtype = torch.uint8, *, pin_memory: bool | None = None
) -> torch.Tensor:
    """An uninitialised CPU tensor on transparent huge pages (2 MiB aligned), pinned where CUDA is present.

    Its 1 MiB blocks are physically contiguous, so the engine moves them in place as one device request each;
    a tensor of scattered 4 KiB pages (``torch.empty``, ``pin_memory=True``) is copied through the staging buffers
    instead (stage_host=auto), which costs a memcpy. Huge pages are a request (``madvise``), not a guarantee:
    with transparent_hugepage=never the tensor still works, only slower. ``pin_memory`` (default: CUDA available)
    registers it with CUDA (cudaHostRegister through torch's runtime) for fast device copies; if that fails, or torch
    does not then report ``is_pinned()``, it raises RuntimeError with the cause (never a silently pageable tensor).
    """
    shape = torch.Size(shape if isinstance(shape, (tuple, list, torch.Size)) else (shape,))
    nbytes = shape.numel() * torch.empty((), dtype=dtype).element_size()
    rounded = max(_HUGE, (nbytes + _HUGE - 1) // _HUGE * _HUGE)
    raw = torch.empty(rounded + _HUGE, dtype=torch.uint8)  # not touched yet: pages fault in after madvise
    start = raw.data_ptr() + (-raw.data_ptr()) % _HUGE
    _madvise_hugepage(start, rounded)
    view = raw[start - raw.data_ptr() :][:rounded]
    view.zero_()  # fault the pages in now, as huge pages where the kernel has them
    pinned = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
    if pinned:
        # The whole allocation, not only the aligned range: torch's is_pinned() asks CUDA about the *storage's* base
        # address (raw.data_ptr(), up to 2 MiB before `start`); registering only [start, start+rounded) gave a
        # tensor that worked but was not pinned in torch's eyes. Through torch's own CUDA runtime.
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(raw.data_ptr(), raw.numel(), 0)
        if int(err) != 0:
            raise RuntimeError(
                f"huge_empty: cannot pin: cudaHostRegister of {raw.numel()} bytes failed "
                f"({_cuda_error_text(err)}); pass pin_memory=False"
            )
        if not view.is_pinned():  # never hand out a tensor that silently is not pinned
            cudart.cudaHostUnregister(raw.data_ptr())
            raise RuntimeError(
                "huge_empty: cannot pin: cudaHostRegister succeeded but torch does not see the memory "
                "as pinned (is_pinned() is False); pass pin_memory=False"
            )
    storage = raw.untyped_storage()  # lives as long as any view of the memory
    key = id(storage)
    _huge_ranges[key] = (start, start + rounded)
    weakref.finalize(storage, _forget_huge, key, raw.data_ptr(), pinned)
    return view[:nbytes].view(dtype).view(shape)


def _cuda_error_text(err) -> str:
    try:
        return f"{err}: {torch.cuda.cudart().cudaGetErrorString(err)}"
    except Exception:  # noqa: BLE001 - the code alone still names the cause
        return str(err)


def _madvise_hugepage(address: int, nbytes: int) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc.madvise(address, nbytes, 14) == 0  # MADV_HUGEPAGE


def aligned_empty(shape: int | Sequence[int], dtype: torch.dtype = torch.uint8, alignment: int = 4096) -> torch.Tensor:
    """An uninitialised CPU tensor whose data starts on an `alignment` boundary, so O_DIRECT moves it in place.

    (Host tensors at other addresses work too, through the staging buffers; pinned tensors from
    ``torch.empty(..., pin_memory=True)`` are page aligned already.)
    """
    shape = torch.Size(shape if isinstance(shape, (tuple, list, torch.Size)) else (shape,))
    nbytes = shape.numel() * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(nbytes + alignment, dtype=torch.uint8)
    shift = (-raw.data_ptr()) % alignment
    return raw[shift : shift + nbytes].view(dtype).view(shape)
