"""pytorch_direct: unified tensors for GNN training on feature tables larger than GPU memory.

Pinned host memory is mapped into the GPU's address space and CUDA kernels gather (and scatter) rows over PCIe
with no intermediate copy; on a machine without a GPU the same API gathers on the CPU.
"""

from importlib.metadata import version as _version

from . import _core, _shared_cuda
from ._core import CompileError, CudaError, UnavailableError

__version__ = _version("pytorch-direct")

__all__ = ["CompileError", "CudaError", "UnavailableError", "__version__", "info"]


def info() -> dict:
    """This build and machine: version, CUDA compiled or not, architectures, GPUs seen, NVRTC found or not."""
    return _shared_cuda.build_info(_core, "pytorch-direct", __version__)
