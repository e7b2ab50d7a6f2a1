"""ssdtrain: activation offload for LLM training.

Saved activations stream to pinned host RAM and NVMe (io_uring via liburing, GPUDirect Storage via cuFile) or are
recomputed, per layer, as a planner chooses under a memory budget, and come back before backward needs them:

    with ssdtrain.offload(model, budget="20GiB") as session:
        loss = model(**batch).loss
        loss.backward()
    print(session.plan); print(session.stats())
"""

from importlib.metadata import version as _version

from . import _core, _shared_cuda
from ._core import CompileError, CudaError, UnavailableError
from .api import offload, plan
from .entries import OffloadError, OffloadWarning
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
    settings,
)
from .model import find_blocks
from .planner import BudgetError, Choice, Plan
from .resources import release
from .session import OffloadSession

__version__ = _version("ssdtrain")

__all__ = [
    "BudgetError",
    "ChecksumError",
    "Choice",
    "OffloadCallback",
    "OffloadError",
    "OffloadSession",
    "OffloadWarning",
    "Plan",
    "find_blocks",
    "offload",
    "plan",
    "release",
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
    "settings",
]


def __getattr__(name: str):
    # The Hugging Face callback imports transformers, which ssdtrain itself does not need: loaded on first use.
    if name == "OffloadCallback":
        from .huggingface import OffloadCallback

        return OffloadCallback
    raise AttributeError(f"module 'ssdtrain' has no attribute {name!r}")


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
