"""The synthetic graph generator: valid CSC, deterministic, homophily as specified, relation skew, features
informative but not sufficient. (The neighbour sampler is pytorch_direct.sampling, tested in pytorch-direct.)"""

from __future__ import annotations

import pytest
import torch

from gnn_data import GraphSpec, fill_features, generate

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


def test_relation_skew_and_many_relations():
    spec = GraphSpec(**{**SPEC.__dict__, "num_relations": 300, "relation_skew": 0.0})
    g = generate(spec)
    counts = torch.bincount(g.edge_type.long(), minlength=300)
    per_type = [counts[torch.arange(300) % spec.num_node_types == t] for t in range(spec.num_node_types)]
    assert all(int(c.max()) - int(c.min()) <= 1 for c in per_type), "skew 0: equal counts per destination type"
    skewed = generate(GraphSpec(**{**spec.__dict__, "relation_skew": 1.5}))
    counts = torch.bincount(skewed.edge_type.long(), minlength=300).double()
    top = counts.sort(descending=True).values
    assert top[0] > 20 * top[100], "a power law: the first relations get most edges"
    with pytest.raises(ValueError, match="relation_skew"):
        GraphSpec(**{**spec.__dict__, "relation_skew": -1.0})
