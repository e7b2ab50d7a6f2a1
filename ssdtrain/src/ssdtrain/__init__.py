"""ssdtrain: activation offload for LLM training.

Saved activations stream to pinned host RAM and NVMe (io_uring via liburing, GPUDirect Storage via cuFile) and are
prefetched before backward needs them.
"""

from importlib.metadata import version as _version

from . import _core, _shared_cuda
from ._core import CompileError, CudaError, UnavailableError
from .io import (
    ChecksumError,
    Engine,
    Future,
    Handle,
    aligned_empty,
    configure,
    cufile_config,
    defaults,
    find_cufile,
    huge_empty,
)

__version__ = _version("ssdtrain")

__all__ = [
    "ChecksumError",
    "CompileError",
    "CudaError",
    "Engine",
    "Future",
    "Handle",
    "UnavailableError",
    "__version__",
    "aligned_empty",
    "huge_empty",
    "cufile_config",
    "backends",
    "configure",
    "defaults",
    "info",
]


def backends() -> dict[str, dict]:
    """Each I/O backend: whether it is compiled in, usable here, and a detail (version or reason)."""
    library = defaults()["cufile_library"] or find_cufile()
    config = cufile_config()
    gds = dict(_core.cufile_status(library))
    gds["detail"] = f"{gds['detail']}; config {config or 'cuFile defaults'}"
    return {"io_uring": _core.io_uring_status(), "gds": gds}


def _backend_lines() -> dict[str, str]:
    lines = {}
    for name, status in backends().items():
        state = "usable" if status["usable"] else ("built, not usable" if status["compiled"] else "not built")
        lines[name] = f"{state} ({status['detail']})"
    lines["threads"] = "usable (portable pread/pwrite fallback)"
    try:
        lines["selected"] = f"SSDTRAIN_IO_BACKEND={defaults()['backend']}"
    except ValueError as e:
        lines["selected"] = f"invalid setting: {e}"
    return lines


def info() -> dict:
    """This build and machine: version, CUDA, GPUs, NVRTC, and the I/O backends (liburing, cuFile) found or not."""
    return _shared_cuda.build_info(_core, "ssdtrain", __version__, _backend_lines())
