import pytest
import torch

from hector import datasets

SMALL = 0.02


@pytest.mark.parametrize("name", sorted(datasets.SPECS))
def test_scaled_twin_matches_counts_and_skew(name):
    spec = datasets.SPECS[name]
    g = datasets.load(name, scale=SMALL, seed=0)
    s = g.stats()
    assert s["num_relations"] == spec.num_relations and s["num_node_types"] == spec.num_node_types
    assert s["num_edges"] == max(spec.num_relations, round(spec.num_edges * SMALL))
    assert s["num_nodes"] == round(spec.num_nodes * SMALL)
    assert torch.bincount(g.edge_type, minlength=spec.num_relations).min() >= 1  # every relation is used
    assert g.edge_index.max() < g.num_nodes and g.node_type.max() < spec.num_node_types
    if spec.num_relations >= 20:
        assert s["relation_edges_max_over_median"] > 5  # power-law relation sizes
    assert s["in_degree_max_over_mean"] > 3  # skewed in-degrees


@pytest.mark.parametrize("name", ["aifb", "mutag", "am", "fb15k", "wikikg2"])
def test_pair_ratio_is_controlled(name):
    for ratio in (2.0, 3.0, 5.0):  # (ratio 1 is infeasible where edges outnumber nodes x relations)
        s = datasets.load(name, scale=SMALL, pair_ratio=ratio).stats()
        assert s["pair_ratio"] == pytest.approx(ratio, rel=0.15)


def test_relations_have_fixed_endpoint_types():
    g = datasets.load("bgs", scale=SMALL)
    src_t = g.node_type[g.edge_index[0]]
    dst_t = g.node_type[g.edge_index[1]]
    for r in range(g.num_relations):
        mask = g.edge_type == r
        assert src_t[mask].unique().numel() == 1 and dst_t[mask].unique().numel() == 1


def test_deterministic_by_seed():
    a, b = datasets.load("aifb", scale=0.1, seed=3), datasets.load("aifb", scale=0.1, seed=3)
    c = datasets.load("aifb", scale=0.1, seed=4)
    assert torch.equal(a.edge_index, b.edge_index) and torch.equal(a.edge_type, b.edge_type)
    assert not torch.equal(a.edge_index, c.edge_index)
    assert torch.equal(a.features(8, seed=1), b.features(8, seed=1))


def test_full_size_aifb_counts():
    s = datasets.load("aifb").stats()
    assert (s["num_nodes"], s["num_edges"], s["num_relations"]) == (7_262, 48_810, 104)


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown dataset"):
        datasets.load("cora")
    with pytest.raises(ValueError, match="scale"):
        datasets.load("aifb", scale=0)
    with pytest.raises(ValueError, match="pair_ratio"):
        datasets.load("aifb", scale=0.1, pair_ratio=0.5)
