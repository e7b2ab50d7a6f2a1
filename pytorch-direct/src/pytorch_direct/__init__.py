"""pytorch_direct: unified tensors for GNN training on feature tables larger than GPU memory.

Pinned host memory is mapped into the GPU's address space and CUDA kernels gather (and scatter) rows over PCIe
with no intermediate copy; on a machine without a GPU the same API gathers on the CPU.

    table = pytorch_direct.unified(features)        # registers features' memory in place
    rows = table[index.cuda()]                       # CUDA rows, gathered zero-copy on the current stream
"""

from __future__ import annotations

from importlib.metadata import version as _version
from typing import TYPE_CHECKING

from . import _core, _shared_cuda
from ._auto import calibrate
from ._cache import RowCache, cached, count_rows
from ._config import (
    BOUNDS_CHECKS,
    set_auto_calibrate,
    set_bounds_check,
    set_cache_dir,
    set_calibration,
    set_host_spin_us,
    set_max_sms,
    set_sampler,
    set_threads,
    settings,
)
from ._core import CompileError, CudaError, UnavailableError
from ._create import empty, flush, from_file, is_unified, unified, zeros
from ._memory import cuda_usable
from ._sharing import share, shared_memory, unlink_shared_memory
from ._strategies import STRATEGIES, get_strategy, set_strategy
from ._tensor import UnifiedTensor, op_input

if TYPE_CHECKING:
    from torch import Tensor

__version__ = _version("pytorch-direct")

__all__ = [
    "BOUNDS_CHECKS", "STRATEGIES", "CompileError", "CudaError", "RowCache", "UnavailableError", "UnifiedTensor",
    "__version__", "auto_status", "cached", "calibrate", "check_errors", "count_rows", "cuda_usable", "empty",
    "flush", "from_file", "gather",
    "get_strategy", "index_add_", "info", "is_unified", "scatter_", "set_auto_calibrate", "set_bounds_check",
    "set_cache_dir", "set_calibration", "set_host_spin_us", "set_max_sms", "set_sampler", "set_strategy",
    "set_threads", "share", "settings", "shared_memory", "unified", "unlink_shared_memory", "zeros",
]


def gather(table: Tensor, index: Tensor, *, strategy: str = "auto", max_sms: int = 0) -> Tensor:
    """Rows of ``table`` (a unified tensor) at ``index`` (int32/int64): shape ``index.shape + table.shape[1:]``.

    CUDA indices give a CUDA result gathered zero-copy on the current stream; CPU indices a CPU result.
    ``strategy``: one of :data:`STRATEGIES` ("auto" uses the default set by :func:`set_strategy`, then the
    calibration; a table with a GPU cache of hot rows, :func:`cached`, is read through it by "auto" and the
    "cached" strategies, from host memory only by the others). ``max_sms`` caps the SMs the kernel occupies (0: the
    default from :func:`set_max_sms`). Out-of-range or negative indices raise ``IndexError`` (see
    :func:`set_bounds_check`). If ``table`` requires grad, the backward adds into ``table.grad``, a host-resident
    unified tensor (the full gradient never lives on the GPU)."""
    import torch

    from . import _ops

    with torch._C.DisableTorchFunctionSubclass():  # (a unified tensor's attribute reads cost ~10x a plain one's)
        _ops.check_table(table)
        _ops.check_index(index)
        return _ops.gather(op_input(table), op_input(index), strategy, int(max_sms))


def scatter_(table: Tensor, index: Tensor, values: Tensor, *, strategy: str = "auto", max_sms: int = 0) -> Tensor:
    """``table[index[i]] = values[i]`` into host memory (from CUDA values on the current stream, or on the CPU).
    With duplicate indices one writer wins per element. Returns ``table``."""
    import torch

    from . import _ops

    with torch._C.DisableTorchFunctionSubclass():
        _ops.check_table(table)
        _ops.check_index(index)
        _ops.scatter(op_input(table), op_input(index), op_input(values), strategy, int(max_sms))
    return table


def index_add_(table: Tensor, index: Tensor, values: Tensor, *, alpha: float = 1.0, strategy: str = "auto",
               max_sms: int = 0) -> Tensor:
    """``table[index[i]] += alpha * values[i]`` with duplicate indices summed. Returns ``table``."""
    import torch

    from . import _ops

    with torch._C.DisableTorchFunctionSubclass():
        _ops.check_table(table)
        _ops.check_index(index)
        _ops.index_add(op_input(table), op_input(index), op_input(values), float(alpha), strategy, int(max_sms))
    return table


def auto_status() -> dict:
    """What ``auto`` did in this process, to log beside a training loop's timings: ``strategy`` and ``source`` of the
    last ``auto`` call with CUDA indices ("measured now": this call measured the candidates; "measured": a measured
    cell; "nearest", "rules", "small"), its index features (``order``: sorted / clustered / random; ``duplicates``:
    the estimated fraction of repeated indices), ``measuring_s`` (seconds this process spent measuring, at most
    ~2 s) and ``measured_cells`` (cells known on this machine, from this process and the cache file).

    >>> import pytorch_direct as pd
    >>> sorted(pd.auto_status())
    ['duplicates', 'measured_cells', 'measuring_s', 'order', 'source', 'strategy']
    """
    from ._auto import auto_status as status

    return status()


def check_errors() -> None:
    """Raises ``IndexError`` if a kernel saw an out-of-range index since the last check (``async`` bounds
    checking). Reads a host-mapped word: no CUDA call, no synchronisation (synchronise first to cover work
    still queued)."""
    from ._ops import raise_pending_device_error

    raise_pending_device_error()


def info() -> dict:
    """This build and machine: version, CUDA compiled or not, architectures, GPUs seen, NVRTC found or not, and the
    memory new tables of 256 MiB and more get (``empty(..., memory="auto")``)."""
    from . import _memory

    d = _shared_cuda.build_info(_core, "pytorch-direct", __version__)
    d["kernels_compiled"] = _core.kernels_compiled()
    if not _memory.cuda_usable():
        d["large_tables"] = "pageable (no GPU)"
    else:
        d["large_tables"] = "managed" if _memory.managed_supported() else "pinned (no concurrent managed access)"
    return d
