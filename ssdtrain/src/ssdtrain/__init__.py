"""ssdtrain: activation offload for LLM training.

Saved activations stream to pinned host RAM and NVMe (io_uring via liburing, GPUDirect Storage via cuFile) and are
prefetched before backward needs them.
"""

from importlib.metadata import version as _version

from . import _core, _shared_cuda
from ._core import CompileError, CudaError, UnavailableError

__version__ = _version("ssdtrain")

__all__ = ["CompileError", "CudaError", "UnavailableError", "__version__", "backends", "info"]


def backends() -> dict[str, dict]:
    """Each I/O backend: whether it is compiled in, usable here, and a detail (version or reason)."""
    return {"io_uring": _core.io_uring_status(), "gds": _core.cufile_status()}


def _backend_lines() -> dict[str, str]:
    lines = {}
    for name, status in backends().items():
        state = "usable" if status["usable"] else ("built, not usable" if status["compiled"] else "not built")
        lines[name] = f"{state} ({status['detail']})"
    lines["threads"] = "usable (portable pread/pwrite fallback)"
    return lines


def info() -> dict:
    """This build and machine: version, CUDA, GPUs, NVRTC, and the I/O backends (liburing, cuFile) found or not."""
    return _shared_cuda.build_info(_core, "ssdtrain", __version__, _backend_lines())
