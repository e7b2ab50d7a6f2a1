"""Agreement with PyG's layers where the formulas match (float64, relative error < 1e-5, forward and backward)."""

import pytest
import torch
from conftest import make_graph, rel_err

import hector.nn as hn

pyg_nn = pytest.importorskip("torch_geometric.nn")

R, N = 4, 30
TOL = 1e-5


@pytest.fixture
def data():
    ei, et, _ = make_graph(num_nodes=N, num_edges=200, num_relations=R, seed=5)
    x = torch.randn(N, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return x, ei, et


def check(ours, theirs, x, ei, et, names):
    x1 = x.clone().requires_grad_()
    x2 = x.clone().requires_grad_()
    a, b = ours(x1, ei, et), theirs(x2, ei, et)
    assert rel_err(a, b) < TOL
    w = torch.randn_like(b)
    ga = torch.autograd.grad((a * w).sum(), [x1] + [ours.get_parameter(n) for n in names])
    gb = torch.autograd.grad((b * w).sum(), [x2] + [theirs.get_parameter(n) for n in names])
    for n, u, v in zip(["x"] + names, ga, gb, strict=True):
        assert rel_err(u, v) < TOL, n


@pytest.mark.parametrize("num_bases", [None, 2])
@pytest.mark.parametrize("aggr", ["mean", "add"])
@pytest.mark.parametrize("root_weight", [True, False])
def test_rgcn_matches_pyg(data, num_bases, aggr, root_weight):
    x, ei, et = data
    ours = hn.RGCNConv(6, 5, R, num_bases=num_bases, aggr=aggr, root_weight=root_weight).double()
    theirs = pyg_nn.RGCNConv(6, 5, R, num_bases=num_bases, aggr=aggr, root_weight=root_weight).double()
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_()
    theirs.load_state_dict(ours.state_dict())
    check(ours, theirs, x, ei, et, [n for n, _ in ours.named_parameters()])


@pytest.mark.parametrize("heads, concat, num_bases", [(1, True, None), (3, True, None), (2, False, None),
                                                      (2, True, 3)])
def test_rgat_shared_attention_matches_pyg(data, heads, concat, num_bases):
    x, ei, et = data
    ours = hn.RGATConv(6, 4, R, heads=heads, concat=concat, num_bases=num_bases, attention="shared").double()
    theirs = pyg_nn.RGATConv(6, 4, R, heads=heads, concat=concat, num_bases=num_bases).double()
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(std=0.5)
    ours_state = ours.state_dict()
    ours.load_state_dict(theirs.state_dict())  # strict: PyG's extra (mod-variant) parameters are dropped
    ours.load_state_dict(ours_state)
    theirs.load_state_dict(ours_state, strict=False)  # PyG also holds unused params of its other 'mod' variants
    check(ours, theirs, x, ei, et, [n for n, _ in ours.named_parameters()])


@pytest.mark.parametrize("heads", [3, 5])
def test_rgat_mean_over_heads_in_float64_is_exact(data, heads):
    """concat=False averages the heads through a constant map holding 1/heads: a layer moved to float64
    (``.double()``) holds it to float64's precision, not float32's (a 3e-8 error against PyG where heads is not a
    power of two), and so does a layer made in float64."""
    x, ei, et = data
    theirs = pyg_nn.RGATConv(6, 4, R, heads=heads, concat=False).double()
    ours = hn.RGATConv(6, 4, R, heads=heads, concat=False, attention="shared").double()
    ours.load_state_dict(theirs.state_dict())
    assert rel_err(ours(x, ei, et), theirs(x, ei, et)) < 1e-13
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        made = hn.RGATConv(6, 4, R, heads=heads, concat=False, attention="shared")
    finally:
        torch.set_default_dtype(previous)
    made.load_state_dict(theirs.state_dict())
    assert rel_err(made(x, ei, et), theirs(x, ei, et)) < 1e-13


@pytest.mark.parametrize("fin, fout, heads", [(8, 8, 2), (6, 8, 2), (8, 8, 1)])
def test_hgt_matches_pyg(fin, fout, heads):
    g = torch.Generator().manual_seed(0)
    node_types = ["a", "b", "c"]
    edge_types = [("a", "r0", "b"), ("b", "r1", "a"), ("a", "r2", "a"), ("c", "r3", "b"), ("b", "r4", "c")]
    counts = [7, 5, 6]
    offsets = [0, 7, 12]
    node_type = torch.cat([torch.full((c,), i) for i, c in enumerate(counts)])
    src, dst, rel, edge_index_dict = [], [], [], {}
    for r, (s, _, d) in enumerate(edge_types):
        si, di = node_types.index(s), node_types.index(d)
        ss = torch.randint(0, counts[si], (15,), generator=g)
        dd = torch.randint(0, counts[di], (15,), generator=g)
        edge_index_dict[edge_types[r]] = torch.stack([ss, dd])
        src.append(ss + offsets[si])
        dst.append(dd + offsets[di])
        rel.append(torch.full((15,), r))
    ei, et = torch.stack([torch.cat(src), torch.cat(dst)]), torch.cat(rel)
    theirs = pyg_nn.HGTConv(fin, fout, (node_types, edge_types), heads=heads).double()
    with torch.no_grad():
        for p in theirs.parameters():
            p.uniform_(-0.5, 0.5, generator=g)
    ours = hn.HGTConv(fin, fout, len(node_types), len(edge_types), heads=heads).double()
    hn.load_pyg_hgt(ours, theirs, node_types, edge_types)
    x = torch.randn(18, fin, dtype=torch.float64, generator=g)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = ours(x1, ei, et, node_type)
    ref_dict = theirs({n: x2[offsets[i]:offsets[i] + counts[i]] for i, n in enumerate(node_types)},
                      edge_index_dict)
    ref = torch.cat([ref_dict[n] for n in node_types])
    assert rel_err(out, ref) < TOL
    w = torch.randn_like(ref)
    ga = torch.autograd.grad((out * w).sum(), [x1, ours.k_rel, ours.q_weight, ours.p_rel])
    gb = torch.autograd.grad((ref * w).sum(), [x2, theirs.k_rel.weight] +
                             [theirs.kqv_lin.lins[n].weight for n in node_types] +
                             [theirs.p_rel["__".join(e)] for e in edge_types])
    assert rel_err(ga[0], gb[0]) < TOL
    k_rel_theirs = torch.stack([gb[1][h * 5 + r] for r in range(5) for h in range(heads)]).view(ga[1].shape)
    assert rel_err(ga[1], k_rel_theirs) < TOL
    q_theirs = torch.stack([w_.t()[:, fout:2 * fout] for w_ in gb[2:5]])
    assert rel_err(ga[2], q_theirs) < TOL
    assert rel_err(ga[3], torch.cat(gb[5:]).view(5, heads)) < TOL
