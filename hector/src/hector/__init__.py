"""hector: a compiler for relational graph neural networks (RGCN, RGAT, HGT).

A model written once in Python (:mod:`hector.ir`'s builder DSL) becomes an inter-operator IR; passes
(:mod:`hector.passes`: canonicalisation, CSE, DCE, compact materialisation, linear-operator reordering) rewrite
it; automatic differentiation generates the backward program; :mod:`hector.lower` fuses both into GEMM-like and
traversal-like kernel specifications; the reference backend (:mod:`hector.runtime`) runs them with torch ops on
CPU or GPU. :mod:`hector.nn` has PyG-compatible layers; :mod:`hector.datasets` the synthetic evaluation graphs.
"""

from importlib.metadata import version as _version

import torch

from . import _core, _shared_cuda
from ._core import CompileError, CudaError, UnavailableError
from .config import settings
from .errors import DSLTypeError, GraphInputError, HectorError, IRVerificationError
from .ir import Builder
from .passes import Options
from .runtime.backend import prepare
from .runtime.graph import Graph, graph_for

__version__ = _version("hector")

__all__ = ["Builder", "CompileError", "CudaError", "DSLTypeError", "Graph", "GraphInputError", "HectorError",
           "IRVerificationError", "Options", "UnavailableError", "__version__", "info", "prepare_graph",
           "settings"]


def prepare_graph(edge_index: torch.Tensor, edge_type: torch.Tensor, num_nodes: int, num_relations: int,
                  node_type: torch.Tensor | None = None,
                  num_node_types: int | None = None) -> Graph:
    """Validates a (mini-batch) graph on the host and does now the preprocessing that reads the GPU (the unique
    (source, relation) pair count), so that hector's layers called on the same tensors only launch kernels, with
    their compacted rows sized exactly. Returns the :class:`Graph` the layers will use (also accepted by them in
    place of ``edge_index``).

    Optional: a layer given new tensors prepares the graph itself on first use, the same way. Call it where a
    mini-batch is made (a loader thread) so that the layers' step does not wait for the GPU, and for an error
    that names a bad id before any kernel runs (``hector.Graph(..., sync_free=True)`` builds a graph that never
    waits, at the cost of rows padded to the edge count)::

        sub = sampler.sample(seeds)
        hector.prepare_graph(sub.edge_index, sub.edge_type, sub.n_id.numel(), num_relations)
        x = features[sub.n_id]                          # queued; the layers below do not wait for it
        out = model(x, sub.edge_index, sub.edge_type)

    The arguments are those the layers get (``num_nodes`` = ``x.size(0)``; ``node_type``/``num_node_types`` only
    for layers typed by node type)."""
    return prepare(graph_for(edge_index, edge_type, num_nodes, num_relations, node_type, num_node_types,
                             sync_free=False))


def info() -> dict:
    """This build and machine: version, CUDA compiled or not, architectures, GPUs seen, NVRTC found or not."""
    return _shared_cuda.build_info(_core, "hector", __version__)
