import pytest
import torch

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
