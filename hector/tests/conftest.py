import contextlib

import pytest
import torch

from hector.runtime import reference
from hector.runtime.graph import Graph


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm().clamp(min=1e-300))


def make_graph(num_nodes=14, num_edges=80, num_relations=3, seed=0, dup=True, node_types=None):
    """A random multigraph; with ``dup`` half of the edges reuse another edge's (source, relation) pair, so
    unique pairs < edges. One node is left isolated (no in- or out-edges)."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, num_nodes - 1, (num_edges,), generator=g)
    dst = torch.randint(0, num_nodes - 1, (num_edges,), generator=g)
    et = torch.randint(0, num_relations, (num_edges,), generator=g)
    if dup:
        h = num_edges // 2
        src[:h], et[:h] = src[h:2 * h], et[h:2 * h]
    nt = None
    if node_types:
        nt = torch.randint(0, node_types, (num_nodes,), generator=g)
    return torch.stack([src, dst]), et, nt


def hub_graph(num_nodes: int, light_max: int, heavy: int, heavy_degrees: tuple[int, int], hub: int, hub_degree: int,
              relations: int, seed: int):
    """A graph for destination walks that split hub destinations: every node has 0..light_max - 1 in-edges, except
    ``heavy`` nodes with ``heavy_degrees`` (inclusive range) and node ``hub`` with ``hub_degree``; edges in random
    order, of even relations only (the odd ones of 0..2 * relations - 1 stay empty); three node types."""
    g = torch.Generator().manual_seed(seed)
    degrees = torch.randint(0, light_max, (num_nodes,), generator=g)
    degrees[torch.randperm(num_nodes, generator=g)[:heavy]] = torch.randint(heavy_degrees[0], heavy_degrees[1] + 1,
                                                                         (heavy,), generator=g)
    degrees[hub] = hub_degree
    dst = torch.repeat_interleave(torch.arange(num_nodes), degrees)
    dst = dst[torch.randperm(dst.numel(), generator=g)]
    src = torch.randint(0, num_nodes, (dst.numel(),), generator=g)
    et = torch.randint(0, relations, (dst.numel(),), generator=g) * 2
    nt = torch.randint(0, 3, (num_nodes,), generator=g)
    return torch.stack([src, dst]), et, nt, num_nodes


@contextlib.contextmanager
def half_storage_reference():
    """The reference backend with every value of a bf16/fp16 program stored in that dtype, as the generated
    kernels store them (they accumulate in float32 but write each materialised value in the model's dtype). By
    default the reference computes such programs in float32 and rounds only their outputs, which leaves out the
    rounding of the intermediates: a bound for the CUDA backend's 16-bit error must come from this mode."""
    wide = reference.run_lowered

    def stored(lowered, graph, leaves, dtype=None, keep=None):
        half = next((t.dtype for t in leaves.values() if torch.is_tensor(t) and t.dtype in reference._HALF), None)
        return wide(lowered, graph, leaves, dtype if dtype is not None else half, keep)

    reference.run_lowered = stored
    try:
        yield
    finally:
        reference.run_lowered = wide


@pytest.fixture
def small():
    ei, et, _ = make_graph()
    return ei, et


@pytest.fixture
def small_graph(small):
    ei, et = small
    return Graph(ei, et, 14, 3)


@pytest.fixture
def env_settings(monkeypatch):
    """Re-read hector's settings from the environment inside a test; the process's own again after it."""
    from hector import config

    def read():
        config.settings.reload()
        return config.settings

    yield read
    monkeypatch.undo()
    config.settings.reload()
