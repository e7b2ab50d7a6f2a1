"""hector: a compiler for relational graph neural networks (RGCN, RGAT, HGT).

A model written once in Python (:mod:`hector.ir`'s builder DSL) becomes an inter-operator IR; passes
(:mod:`hector.passes`: canonicalisation, CSE, DCE, compact materialisation, linear-operator reordering) rewrite
it; automatic differentiation generates the backward program; :mod:`hector.lower` fuses both into GEMM-like and
traversal-like kernel specifications; the reference backend (:mod:`hector.runtime`) runs them with torch ops on
CPU or GPU. :mod:`hector.nn` has PyG-compatible layers; :mod:`hector.datasets` the synthetic evaluation graphs.
"""

import warnings
from importlib.metadata import version as _version
from typing import Any

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
                  node_type: torch.Tensor | None = None, num_node_types: int | None = None, *,
                  layers: Any = (), dtype: torch.dtype | None = None, input_grad: bool | None = None,
                  sorted_by_destination: bool | None = None) -> Graph:
    """Validates a (mini-batch) graph on the host and does now the preprocessing that reads the GPU (the unique
    (source, relation) pair count), so that hector's layers called on it only launch kernels, with their compacted
    rows sized exactly. Returns the :class:`Graph` the layers will use (pass it in place of ``edge_index``; the
    same tensors with the same arguments find it too).

    ``layers``: hector layers (or modules holding them, e.g. the whole model) to prepare the graph for: each
    one's :meth:`~hector.nn.base.RelationalLayer.prepare` builds now what its first call on the graph would
    build (the cost model's choice, and on the CUDA backend the graph's layout and the launch plans of the
    forward and backward), so a training step on a prepared graph launches about what a step on a graph reused
    for every step launches. ``dtype`` and ``input_grad`` are passed on to it (the dtype the layers run in, e.g.
    ``torch.bfloat16`` under autocast; whether their ``x`` needs a gradient: None prepares what each layer's last
    training call needed, both before its first).
    ``sorted_by_destination``: see :class:`Graph` (None: found out with the id check, without a wait of its own;
    edges already in destination order skip the CUDA backend's sort).

    Optional: a layer given new tensors prepares the graph itself on first use, the same way. Call it where a
    mini-batch is made (a loader thread: it is thread-safe, and its GPU work runs on that thread's current
    stream) so that the training step does not wait for the GPU nor build plans, and for an error that names a
    bad id before any kernel runs (``hector.Graph(..., sync_free=True)`` builds a graph that never waits, at the
    cost of rows padded to the edge count)::

        sub = sampler.sample(seeds)
        graph = hector.prepare_graph(sub.edge_index, sub.edge_type, sub.n_id.numel(), num_relations, layers=model)
        x = features[sub.n_id]                          # queued; the layers below do not wait for it
        out = model(x, graph, sub.edge_type)

    The arguments are those the layers get (``num_nodes`` = ``x.size(0)``; ``node_type``/``num_node_types`` only
    for layers typed by node type). A graph made on one CUDA stream and used on another needs
    ``graph.record_stream(stream)`` where it is handed over (pytorch-direct's loader does it)."""
    graph = prepare(graph_for(edge_index, edge_type, num_nodes, num_relations, node_type, num_node_types,
                              sync_free=False, sorted_by_destination=sorted_by_destination))
    for layer in _hector_layers(layers):
        layer.prepare(graph, dtype=dtype, input_grad=input_grad)
    return graph


def _hector_layers(layers: Any) -> list:
    """The hector layers in ``layers``: a module (its submodules included) or an iterable of modules."""
    from .nn.base import RelationalLayer

    modules = [layers] if isinstance(layers, torch.nn.Module) else list(layers)
    found = []
    for module in modules:
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"prepare_graph(layers=...) takes torch modules holding hector layers, got "
                            f"{type(module).__name__}")
        found.extend(m for m in module.modules() if isinstance(m, RelationalLayer))
    if modules and not found:
        warnings.warn("prepare_graph(layers=...) found no hector layer in the modules given: nothing was prepared "
                      "for them", stacklevel=3)
    return found


def info() -> dict:
    """This build and machine: version, CUDA compiled or not, architectures, GPUs seen, NVRTC found or not."""
    return _shared_cuda.build_info(_core, "hector", __version__)
