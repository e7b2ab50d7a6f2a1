"""hector: a compiler for relational graph neural networks (RGCN, RGAT, HGT).

A model written once in Python (:mod:`hector.ir`'s builder DSL) becomes an inter-operator IR; passes
(:mod:`hector.passes`: canonicalisation, CSE, DCE, compact materialisation, linear-operator reordering) rewrite
it; automatic differentiation generates the backward program; :mod:`hector.lower` fuses both into GEMM-like and
traversal-like kernel specifications; the reference backend (:mod:`hector.runtime`) runs them with torch ops on
CPU or GPU. :mod:`hector.nn` has PyG-compatible layers; :mod:`hector.datasets` the synthetic evaluation graphs.
"""

from importlib.metadata import version as _version

from . import _core, _shared_cuda
from ._core import CompileError, CudaError, UnavailableError
from .errors import DSLTypeError, GraphInputError, HectorError, IRVerificationError
from .ir import Builder
from .passes import Options
from .runtime.graph import Graph

__version__ = _version("hector")

__all__ = ["Builder", "CompileError", "CudaError", "DSLTypeError", "Graph", "GraphInputError", "HectorError",
           "IRVerificationError", "Options", "UnavailableError", "__version__", "info"]


def info() -> dict:
    """This build and machine: version, CUDA compiled or not, architectures, GPUs seen, NVRTC found or not."""
    return _shared_cuda.build_info(_core, "hector", __version__)
