"""The neighbour sampler (PyG-compatible output, exact per-node counts, no replacement, uniform) and the synthetic
graph generator."""

from __future__ import annotations

import pytest
import torch

import pytorch_direct as pd
from gnn_data import GraphSpec, fill_features, generate
from sampling import NeighborSampler, PygSampler, pyg_neighbor_loader_available


def csc_from_edges(src: torch.Tensor, dst: torch.Tensor, num_nodes: int, num_relations: int = 3, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    etype = torch.randint(num_relations, (src.numel(),), generator=gen)
    dst_sorted, order = torch.sort(dst, stable=True)
    colptr = torch.zeros(num_nodes + 1, dtype=torch.long)
    colptr[1:] = torch.cumsum(torch.bincount(dst_sorted, minlength=num_nodes), 0)
    return colptr, src[order].to(torch.int32), etype[order].to(torch.int32)


def skewed_graph(num_nodes: int = 300, seed: int = 0):
    """A hub with most in-edges, nodes without any, duplicate (multi-)edges and self-loops."""
    gen = torch.Generator().manual_seed(seed)
    e = 4000
    dst = (torch.rand(e, generator=gen).pow(3) * num_nodes).long()  # node 0.. are popular
    dst[dst % 7 == 3] = 0  # nodes 3, 10, 17, ... never receive edges; node 0 is a hub
    src = torch.randint(num_nodes, (e,), generator=gen)
    src[:50] = dst[:50]  # self-loops
    src[50:100] = src[100:150]
    dst[50:100] = dst[100:150]  # duplicated edges
    return csc_from_edges(src, dst, num_nodes, seed=seed)


def check_subgraph(sub, seeds, colptr, row, etype, fanout):
    n_id, (src_l, dst_l) = sub.n_id, sub.edge_index
    assert torch.equal(n_id[: sub.batch_size], seeds)
    assert n_id.unique().numel() == n_id.numel(), "every node appears once"
    assert sub.num_sampled_nodes[0] == sub.batch_size and sum(sub.num_sampled_nodes) == n_id.numel()
    assert len(sub.num_sampled_edges) == len(fanout) and sum(sub.num_sampled_edges) == sub.num_edges
    # every sampled edge is the graph's edge e_id, oriented source -> destination
    e_dst = torch.searchsorted(colptr, sub.e_id, right=True) - 1
    assert torch.equal(n_id[src_l], row[sub.e_id].long())
    assert torch.equal(n_id[dst_l], e_dst)
    assert torch.equal(sub.edge_type, etype[sub.e_id].long())
    # hop by hop: destinations are the previous hop's nodes, each with min(degree, fanout) distinct in-edges
    node_lo, edge_lo = 0, 0
    for hop, k in enumerate(fanout):
        n_nodes, n_edges = sub.num_sampled_nodes[hop], sub.num_sampled_edges[hop]
        frontier = n_id[node_lo: node_lo + n_nodes]
        eids, dsts = sub.e_id[edge_lo: edge_lo + n_edges], dst_l[edge_lo: edge_lo + n_edges]
        assert bool(((dsts >= node_lo) & (dsts < node_lo + n_nodes)).all())
        degree = colptr[frontier + 1] - colptr[frontier]
        expected = degree if k < 0 else degree.clamp(max=k)
        assert torch.equal(torch.bincount(dsts - node_lo, minlength=n_nodes), expected)
        assert eids.unique().numel() == eids.numel(), "no edge drawn twice"
        new = n_id[node_lo + n_nodes: node_lo + n_nodes + sub.num_sampled_nodes[hop + 1]]
        assert torch.equal(new, new.sort().values), "new nodes of a hop are numbered in ascending id"
        node_lo, edge_lo = node_lo + n_nodes, edge_lo + n_edges


@pytest.mark.parametrize("fanout", [[4, 3], [1], [-1, 2], [50, 50, 50]])
def test_sampled_subgraph_is_valid(fanout):
    colptr, row, etype = skewed_graph()
    sampler = NeighborSampler(colptr, row, etype, fanout, generator=torch.Generator().manual_seed(1))
    for seeds in (torch.tensor([0, 5, 3, 299]), torch.randperm(300)[:64], torch.tensor([3])):
        sub = sampler.sample(seeds)
        check_subgraph(sub, seeds, colptr, row, etype, fanout)


def test_map_is_reset_between_batches():
    colptr, row, etype = skewed_graph()
    sampler = NeighborSampler(colptr, row, etype, [5, 5])
    sampler.sample(torch.arange(40))
    assert bool((sampler._local == -1).all())
    with pytest.raises(ValueError, match="distinct"):
        sampler.sample(torch.tensor([1, 2, 1]))
    assert bool((sampler._local == -1).all())


def test_sampling_is_uniform_without_replacement():
    # one destination with 10 in-edges, 3 drawn: each edge with probability 0.3, never twice
    src = torch.arange(1, 11)
    dst = torch.zeros(10, dtype=torch.long)
    colptr, row, etype = csc_from_edges(src, dst, 11)
    sampler = NeighborSampler(colptr, row, etype, [3], generator=torch.Generator().manual_seed(0))
    counts = torch.zeros(10)
    trials = 4000
    for _ in range(trials):
        sub = sampler.sample(torch.tensor([0]))
        assert sub.e_id.unique().numel() == 3
        counts[sub.e_id] += 1
    freq = counts / trials
    assert bool(((freq - 0.3).abs() < 0.04).all()), freq  # 0.04 is > 5 standard deviations


def test_bad_input():
    colptr, row, etype = skewed_graph()
    with pytest.raises(ValueError, match="num_neighbors"):
        NeighborSampler(colptr, row, etype, [0])
    with pytest.raises(ValueError, match="one entry per edge"):
        NeighborSampler(colptr, row, etype[:-1], [2])
    sampler = NeighborSampler(colptr, row, etype, [2])
    with pytest.raises(IndexError, match=r"\[0, 300\)"):
        sampler.sample(torch.tensor([0, 300]))
    with pytest.raises(ValueError, match="non-empty"):
        sampler.sample(torch.tensor([], dtype=torch.long))


def test_topology_in_unified_host_memory_gives_the_same_batches():
    colptr, row, etype = skewed_graph(seed=3)
    seeds = torch.randperm(300, generator=torch.Generator().manual_seed(0))[:32]
    plain = NeighborSampler(colptr, row, etype, [6, 4], generator=torch.Generator().manual_seed(5)).sample(seeds)
    host = NeighborSampler(pd.unified(colptr, copy=True), pd.unified(row, copy=True), pd.unified(etype, copy=True),
                           [6, 4], generator=torch.Generator().manual_seed(5)).sample(seeds)
    for name in ("n_id", "edge_index", "edge_type", "e_id"):
        assert torch.equal(getattr(plain, name), getattr(host, name)), name


@pytest.mark.skipif(not pyg_neighbor_loader_available(), reason="PyG's sampler needs pyg-lib or torch-sparse")
def test_pyg_sampler_output_matches_ours_in_structure():
    colptr, row, etype = skewed_graph()
    seeds = torch.randperm(300)[:16]
    sub = PygSampler(colptr, row, etype, [4, 3]).sample(seeds)
    check_subgraph(sub, seeds, colptr, row, etype, [4, 3])


def test_pyg_sampler_says_what_is_missing():
    if pyg_neighbor_loader_available():
        pytest.skip("pyg-lib or torch-sparse is installed")
    colptr, row, etype = skewed_graph()
    with pytest.raises(RuntimeError, match="pyg-lib"):
        PygSampler(colptr, row, etype, [4])


SPEC = GraphSpec(num_nodes=5_000, avg_degree=6, num_node_types=3, num_relations=7, num_classes=5, feature_dim=12,
                 num_train=600, num_val=200, seed=4)


def test_generated_graph_is_valid_and_deterministic():
    g = generate(SPEC)
    assert g.num_nodes == SPEC.num_nodes and g.num_edges == SPEC.num_edges
    assert g.colptr[0] == 0 and g.colptr[-1] == g.num_edges and bool((g.colptr[1:] >= g.colptr[:-1]).all())
    assert int(g.row.min()) >= 0 and int(g.row.max()) < g.num_nodes
    assert set(g.edge_type.unique().tolist()) == set(range(SPEC.num_relations))
    assert bool((g.node_type[g.train_idx] == 0).all()) and bool((g.node_type[g.val_idx] == 0).all())
    both = torch.cat([g.train_idx, g.val_idx])
    assert both.unique().numel() == both.numel(), "train and validation nodes are distinct"
    again = generate(SPEC)
    assert torch.equal(g.row, again.row) and torch.equal(g.labels, again.labels)
    other = generate(GraphSpec(**{**SPEC.__dict__, "seed": 5}))
    assert not torch.equal(g.row, other.row)


def test_homophilous_relations_connect_same_class_nodes():
    g = generate(SPEC)
    dst = torch.repeat_interleave(torch.arange(g.num_nodes), g.colptr[1:] - g.colptr[:-1])
    same = (g.labels[g.row.long()] == g.labels[dst]).double()
    for r in range(SPEC.num_relations):
        mask = g.edge_type == r
        if int(mask.sum()) < 300:
            continue
        expected = g.homophily[r] + (1 - g.homophily[r]) / SPEC.num_classes
        assert abs(float(same[mask].mean()) - float(expected)) < 0.08, (r, float(same[mask].mean()), expected)


def test_features_carry_the_class():
    g = generate(SPEC)
    table = torch.empty(g.num_nodes, SPEC.feature_dim)
    fill_features(table, g, rows_per_chunk=999)
    means = torch.stack([table[g.labels == c].mean(0) for c in range(SPEC.num_classes)])
    nearest = torch.cdist(table, means).argmin(1)
    accuracy = float((nearest == g.labels).double().mean())
    assert 1.5 / SPEC.num_classes < accuracy < 0.9, accuracy  # informative, but not enough without the graph
    with pytest.raises(ValueError, match="shape"):
        fill_features(torch.empty(10, SPEC.feature_dim), g)


def test_spec_rejects_impossible_graphs():
    with pytest.raises(ValueError, match="num_relations"):
        GraphSpec(num_nodes=1000, avg_degree=2, num_node_types=4, num_relations=2, num_classes=2, feature_dim=4,
                  num_train=10, num_val=10)
    with pytest.raises(ValueError, match="labelled type"):
        generate(GraphSpec(num_nodes=1000, avg_degree=2, num_node_types=2, num_relations=2, num_classes=2,
                           feature_dim=4, num_train=900, num_val=10))
