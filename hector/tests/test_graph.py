import pytest
import torch
from conftest import make_graph
from hypothesis import given, settings
from hypothesis import strategies as st

import hector.nn as hn
from hector.errors import GraphInputError
from hector.ir import Domain
from hector.runtime.graph import Graph

R, N = 3, 14


def test_unique_pairs_and_inverse_index(small_graph):
    g = small_graph
    pairs = {(int(s), int(r)) for s, r in zip(g.src, g.etype, strict=True)}
    assert g.num_unique == len(pairs) < g.num_edges
    back = torch.stack([g.unique_src[g.edge_to_unique], g.unique_etype[g.edge_to_unique]])
    assert torch.equal(back, torch.stack([g.src, g.etype]))
    assert g.stats()["num_unique"] == g.num_unique


def test_csr_csc_and_relation_segments(small_graph):
    g = small_graph
    perm, ptr = g.csc()
    assert ptr[-1] == g.num_edges and torch.equal(torch.diff(ptr), torch.bincount(g.dst, minlength=N))
    assert bool((torch.diff(g.dst[perm]) >= 0).all())
    perm, ptr = g.csr()
    assert bool((torch.diff(g.src[perm]) >= 0).all())
    perm, counts = g.segments(Domain.EDGE, ("etype",))
    assert counts == torch.bincount(g.etype, minlength=R).tolist()
    assert bool((torch.diff(g.etype[perm]) >= 0).all())
    assert g.relation_ptr()[-1] == g.num_edges


def test_preprocessing_is_computed_once(small_graph, monkeypatch):
    g = small_graph
    calls = []
    real = torch.unique

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(torch, "unique", counting)
    for _ in range(3):
        _ = g.edge_to_unique, g.unique_src
    assert len(calls) == 1


def test_degree_normalisers(small_graph):
    g = small_graph
    inv = g.graph_const("inv_deg_dst_rel", torch.float64)
    for e in range(0, g.num_edges, 7):
        same = ((g.dst == g.dst[e]) & (g.etype == g.etype[e])).sum()
        assert inv[e] == pytest.approx(1.0 / float(same))
    node = g.graph_const("inv_in_degree", torch.float64)
    assert node[N - 1] == 0.0  # the isolated node


@pytest.mark.parametrize("mutate, match", [
    (lambda ei, et: (ei, et.clone().fill_(R)), "edge_type holds relation id 3, outside \\[0, 3\\)"),
    (lambda ei, et: (ei, et - 1), "relation id -1"),
    (lambda ei, et: (ei.float(), et), "integer ids.*dtype torch.float32"),
    (lambda ei, et: (ei, et.double()), "edge_type must hold integer ids"),
    (lambda ei, et: (ei.t(), et), "shape \\[2, num_edges\\].*transpose"),
    (lambda ei, et: (ei[0], et), "must have 2 dimension"),
    (lambda ei, et: (ei, et[:-1]), "one relation id per edge"),
    (lambda ei, et: (ei + N, et), "node id .* outside \\[0, 14\\)"),
    (lambda ei, et: (ei.tolist(), et), "must be a torch.Tensor"),
])
def test_bad_graphs_raise_clear_errors(small, mutate, match):
    ei, et = mutate(*small)
    m = hn.RGCNConv(5, 4, R)
    with pytest.raises(GraphInputError, match=match):
        m(torch.randn(N, 5), ei, et)


def test_bad_features_and_empty_graphs(small):
    ei, et = small
    m = hn.RGCNConv(5, 4, R)
    with pytest.raises(GraphInputError, match="the graph is empty"):
        m(torch.randn(0, 5), torch.empty(2, 0, dtype=torch.long), torch.empty(0, dtype=torch.long))
    with pytest.raises(GraphInputError, match="x has 3 features, the layer expects in_channels=5"):
        m(torch.randn(N, 3), ei, et)
    with pytest.raises(GraphInputError, match="floating point"):
        m(torch.ones(N, 5, dtype=torch.long), ei, et)
    with pytest.raises(GraphInputError, match="float64.*float32"):
        m(torch.randn(N, 5, dtype=torch.float64), ei, et)
    with pytest.raises(GraphInputError, match="needs edge_type"):
        m(torch.randn(N, 5), ei, None)
    with pytest.raises(GraphInputError, match="empty"):
        Graph(ei, et, 0, R)


def test_bad_node_types():
    ei, et, nt = make_graph(node_types=2)
    m = hn.HGTConv(5, 5, 2, R)
    with pytest.raises(GraphInputError, match="node type id 2, outside \\[0, 2\\)"):
        m(torch.randn(N, 5), ei, et, nt + 1)
    with pytest.raises(GraphInputError, match="node_type has 13 entries for 14 nodes"):
        m(torch.randn(N, 5), ei, et, nt[:-1])


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 20), e=st.integers(0, 60), r=st.integers(1, 5), seed=st.integers(0, 1000))
def test_any_valid_graph_preprocesses_consistently(n, e, r, seed):
    g = torch.Generator().manual_seed(seed)
    ei = torch.randint(0, n, (2, e), generator=g)
    et = torch.randint(0, r, (e,), generator=g)
    graph = Graph(ei, et, n, r)
    assert graph.num_unique <= max(e, 0)
    if e:
        assert torch.equal(graph.unique_src[graph.edge_to_unique], graph.src)
    perm, counts = graph.segments(Domain.UNIQUE, ("etype",))
    assert sum(counts) == graph.num_unique and perm.numel() == graph.num_unique
    m = hn.RGCNConv(3, 2, r)
    out = m(torch.randn(n, 3), ei, et)
    assert out.shape == (n, 2) and torch.isfinite(out).all()


def test_config_setters_mirror_environment(monkeypatch):
    from hector import config

    monkeypatch.setenv("HECTOR_REFERENCE_TILE_BYTES", "4096")
    assert config.tile_bytes("cpu") == 4096
    config.set_tile_bytes(128)
    try:
        assert config.tile_bytes("cpu") == 128
    finally:
        config.set_tile_bytes(None)
    monkeypatch.setenv("HECTOR_REFERENCE_TILE_BYTES", "0")
    with pytest.raises(ValueError, match="positive"):
        config.tile_bytes("cpu")
    monkeypatch.delenv("HECTOR_REFERENCE_TILE_BYTES")
    assert config.tile_bytes("cpu") == 1 << 20 and config.tile_bytes("cuda") == 64 << 20
    monkeypatch.setenv("HECTOR_DEBUG", "1")
    assert config.debug()
    config.set_debug(False)
    try:
        assert not config.debug()
    finally:
        config.set_debug(None)
