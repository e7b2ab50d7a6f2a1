"""hector: a compiler for relational graph neural networks (RGCN, RGAT, HGT).

A model written once in Python becomes an inter-operator IR; passes (compact materialisation, linear-operator
reordering, fusion) rewrite it; code generation emits CUDA kernels with generated backward passes, and a reference
backend runs the same IR with torch ops anywhere.
"""

from importlib.metadata import version as _version

from . import _core, _shared_cuda
from ._core import CompileError, CudaError, UnavailableError

__version__ = _version("hector")

__all__ = ["CompileError", "CudaError", "UnavailableError", "__version__", "info"]


def info() -> dict:
    """This build and machine: version, CUDA compiled or not, architectures, GPUs seen, NVRTC found or not."""
    return _shared_cuda.build_info(_core, "hector", __version__)
