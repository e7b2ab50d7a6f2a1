"""The one place where a backend plugs in between :mod:`hector.lower` and execution.

A backend runs a lowered program (:class:`~hector.lower.kernels.Lowered`) on a graph: ``run(lowered, graph,
leaves, keep)`` returns the values by name, keeping only program outputs and the names in ``keep`` (None: keep
everything). Two backends exist:

* ``reference`` (:mod:`hector.runtime.reference`): torch ops; the CPU path and the correctness oracle.
* ``cuda`` (:mod:`hector.runtime.cuda`): CUDA C++ generated from the kernel specifications
  (:mod:`hector.codegen`), compiled by NVRTC through shared-cuda's JIT loader and cached on disk.

:func:`select` picks one per call: ``HECTOR_BACKEND`` / :func:`hector.config.set_backend` = ``auto`` (default:
``cuda`` for tensors on a CUDA GPU when it can run them, else ``reference``), ``reference`` or ``cuda`` (an error
where it cannot run). The forward and backward of one call always use the same backend (the backend may keep
values in its own row order).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from .. import config
from .graph import Graph


class Backend(Protocol):
    name: str

    def run(self, lowered: Any, graph: Graph, leaves: Mapping[str, Any], keep: Any = None, *,
            contiguous: bool = False) -> dict[str, torch.Tensor]:
        """Runs ``lowered`` on ``graph`` with its leaves bound by name; ``keep``: the values to hand back beyond
        the outputs (None: every value). ``contiguous``: the caller's promise that every leaf tensor is contiguous
        (values a run made and gradients it made contiguous, as a backward's leaves are), so that none is
        checked."""
        ...

    def unsupported(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """Why this backend cannot run tensors of ``dtype`` on ``device`` (None: it can)."""
        ...


class ReferenceBackend:
    name = "reference"

    def run(self, lowered, graph, leaves, keep=None, *, contiguous=False):
        from .reference import run_lowered

        return run_lowered(lowered, graph, leaves, keep=keep)

    def unsupported(self, device, dtype):
        return None


REFERENCE = ReferenceBackend()
_cuda_backend = None
_warned: set[str] = set()
_CUDA_LOCK = threading.Lock()


def cuda_backend():
    """The process-wide CUDA backend (JIT-compiled kernels on the current GPU)."""
    global _cuda_backend
    if _cuda_backend is None:
        from .cuda import CudaBackend

        with _CUDA_LOCK:  # one backend even when a loader thread asks first (hector.prepare_graph)
            if _cuda_backend is None:
                _cuda_backend = CudaBackend()
    return _cuda_backend


def select(device: torch.device, dtype: torch.dtype) -> Backend:
    """The backend for tensors of ``dtype`` on ``device`` under the current setting (see the module docstring)."""
    choice = config.backend()
    if choice == "reference":
        return REFERENCE
    if device.type != "cuda":
        if choice == "cuda":
            raise ValueError(f"HECTOR_BACKEND=cuda needs tensors on a CUDA device, got {device}; move the model and "
                             "inputs with .cuda(), or use the reference backend (HECTOR_BACKEND=reference)")
        return REFERENCE
    backend = cuda_backend()
    why = backend.unsupported(device, dtype)
    if why is None:
        return backend
    if choice == "cuda":
        raise ValueError(f"the CUDA backend cannot run this call: {why}")
    if why not in _warned:
        _warned.add(why)
        warnings.warn(f"hector: {why}; falling back to the reference backend (torch ops). Set HECTOR_BACKEND="
                      "reference to silence this.", RuntimeWarning, stacklevel=3)
    return REFERENCE


def prepare(graph: Graph) -> Graph:
    """Does now the preprocessing of ``graph`` that waits for the GPU: the unique (source, relation) pairs that
    size the layers' rows and, where the CUDA backend will run, its destination-sorted layout. The layers then
    only launch kernels (see :func:`hector.prepare_graph`). Returns ``graph``."""
    graph.num_unique  # noqa: B018 - the exact pair count (read with the ids when the graph was made)
    graph.size_stats()
    if graph.device.type == "cuda" and config.backend() != "reference":
        from .cuda import device_graph

        device_graph(graph)
    return graph


__all__ = ["REFERENCE", "Backend", "ReferenceBackend", "cuda_backend", "prepare", "select"]
