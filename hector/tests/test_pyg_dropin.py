"""hector's layers used the way a PyG user writes them: under torch.autocast, PyG's HGT call form (metadata,
x_dict, edge_index_dict), PyG's RGAT argument names, strict state_dict loading from PyG's layers, and clear errors
for what does not map."""

import copy
import re

import pytest
import torch
from conftest import make_graph, rel_err

import hector.nn as hn
from hector import GraphInputError
from hector.nn import hgt as hgt_mod

R, N = 5, 40

LAYERS = {
    "rgcn": lambda: hn.RGCNConv(16, 16, R),
    "rgcn-bases": lambda: hn.RGCNConv(16, 12, R, num_bases=3),
    "rgat": lambda: hn.RGATConv(16, 4, R, heads=4),
    "rgat-shared": lambda: hn.RGATConv(16, 4, R, heads=4, attention="shared"),
    "rgat-multiplicative": lambda: hn.RGATConv(16, 4, R, heads=2, attention="shared",
                                               attention_mode="multiplicative-self-attention"),
    "hgt": lambda: hn.HGTConv(16, 16, 3, R, heads=4),
    "hgt-in-ne-out": lambda: hn.HGTConv(16, 8, 3, R, heads=2),
}


@pytest.fixture(scope="module")
def graph():
    ei, et, nt = make_graph(num_nodes=N, num_edges=400, num_relations=R, seed=11, node_types=3)
    return ei, et, nt


def _randomize(m, seed=3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(0.4 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return m


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(LAYERS))
def test_autocast_cpu_matches_float64(name, dtype, graph):
    """Under torch.autocast the layer runs in the autocast dtype: output in that dtype, float32 parameters get
    float32 gradients, values and gradients within 5e-2 of the float64 layer."""
    ei, et, nt = graph
    m = _randomize(LAYERS[name]())
    ref = copy.deepcopy(m).double()
    x = torch.randn(N, 16, generator=torch.Generator().manual_seed(5))
    xr = x.double().requires_grad_()
    out_ref = ref(xr, ei, et, nt)
    w = torch.randn(out_ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    grads_ref = torch.autograd.grad((out_ref * w).sum(), [xr] + list(ref.parameters()), allow_unused=True)
    xx = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=dtype):
        out = m(xx, ei, et, nt)
    assert out.dtype == dtype
    grads = torch.autograd.grad((out.float() * w.float()).sum(), [xx] + list(m.parameters()), allow_unused=True)
    assert all(g.dtype == torch.float32 for g in grads if g is not None)
    assert rel_err(out.double(), out_ref) < 5e-2
    for a, b in zip(grads, grads_ref, strict=True):
        assert (a is None) == (b is None)
        if b is not None:
            assert rel_err(a.double(), b) < 5e-2


def test_autocast_is_not_a_no_op(graph):
    """The autocast result differs from the float32 one by bf16 rounding: the layer really ran in bf16."""
    ei, et, nt = graph
    m = _randomize(LAYERS["rgat"]())
    x = torch.randn(N, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = m(x, ei, et, nt)
    high = m(x, ei, et, nt)
    assert high.dtype == torch.float32
    assert 1e-4 < rel_err(low.float(), high) < 5e-2


def test_autocast_accepts_half_input_with_float32_weights(graph):
    """A previous autocast layer hands on bf16 features; the float32 layer takes them under autocast and refuses
    the mix outside it, naming the fix."""
    ei, et, nt = graph
    m = LAYERS["hgt"]()
    x = torch.randn(N, 16).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert m(x, ei, et, nt).dtype == torch.bfloat16
    with pytest.raises(GraphInputError, match="torch.autocast"):
        m(x, ei, et, nt)


def test_autocast_with_float64_names_what_autocast_leaves(graph):
    """float64 is outside autocast's casts: float64 features into a float32 layer (or a float64 layer given float32
    features) under autocast is an error saying so, not one advising to run under torch.autocast."""
    ei, et, nt = graph
    m = LAYERS["rgat"]()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for layer, x in ((m, torch.randn(N, 16, dtype=torch.float64)), (copy.deepcopy(m).double(), torch.randn(N, 16))):
            with pytest.raises(GraphInputError, match=r"under torch.autocast, x .* leaves float64") as info:
                layer(x, ei, et)
            assert "run under torch.autocast" not in str(info.value)


def test_autocast_under_torch_compile(graph):
    ei, et, nt = graph

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = LAYERS["rgat"]()
            self.b = LAYERS["hgt"]()

        def forward(self, x):
            return self.b(self.a(x, ei, et).relu(), ei, et, nt)

    net = Net()
    x = torch.randn(N, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = net(x)
    ref_grads = torch.autograd.grad(ref.float().sum(), [x] + list(net.parameters()))
    torch._dynamo.reset()
    compiled = torch.compile(net, fullgraph=True, backend="aot_eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = compiled(x)
    grads = torch.autograd.grad(out.float().sum(), [x] + list(net.parameters()))
    assert out.dtype == torch.bfloat16 and rel_err(out.float(), ref.float()) < 1e-6
    for a, b in zip(grads, ref_grads, strict=True):
        assert rel_err(a, b) < 1e-6


def test_missing_node_type_is_an_error_with_several_types(graph):
    ei, et, nt = graph
    m = LAYERS["hgt"]()
    with pytest.raises(GraphInputError, match="3 node types but got no node_type"):
        m(torch.randn(N, 16), ei, et)
    one = hn.HGTConv(16, 16, 1, R)  # one node type: node_type may be left out
    assert one(torch.randn(N, 16), ei, et).shape == (N, 16)
    from hector import Graph

    with pytest.raises(GraphInputError, match="node_type is None"):
        Graph(ei, et, N, R, None, num_node_types=3)


# ------------------------------------------------------------------------------------------------- PyG


pyg_nn = pytest.importorskip("torch_geometric.nn")

NODE_TYPES = ["paper", "author", "venue"]
EDGE_TYPES = [("author", "writes", "paper"), ("paper", "written_by", "author"), ("paper", "cites", "paper"),
              ("paper", "in", "venue")]
COUNTS = {"paper": 9, "author": 6, "venue": 3}


def _hetero(seed=0, dim=8, edges=20):
    g = torch.Generator().manual_seed(seed)
    x = {k: torch.randn(n, dim, dtype=torch.float64, generator=g) for k, n in COUNTS.items()}
    eid = {e: torch.stack([torch.randint(0, COUNTS[e[0]], (edges,), generator=g),
                           torch.randint(0, COUNTS[e[2]], (edges,), generator=g)]) for e in EDGE_TYPES}
    return x, eid


@pytest.mark.parametrize("fin, fout, heads", [(8, 8, 2), (8, 6, 3)])
def test_hgt_pyg_form_matches_pyg(fin, fout, heads):
    x, eid = _hetero(dim=fin)
    theirs = pyg_nn.HGTConv(fin, fout, (NODE_TYPES, EDGE_TYPES), heads=heads).double()
    _randomize(theirs, seed=1)
    ours = hn.HGTConv(fin, fout, (NODE_TYPES, EDGE_TYPES), heads=heads).double()
    assert str(ours.load_state_dict(theirs.state_dict())) == "<All keys matched successfully>"  # strict
    x1 = {k: v.clone().requires_grad_() for k, v in x.items()}
    x2 = {k: v.clone().requires_grad_() for k, v in x.items()}
    a, b = ours(x1, eid), theirs(x2, eid)
    assert sorted(a) == sorted(b)  # PyG leaves out node types that are no edge type's destination
    for k in b:
        assert rel_err(a[k], b[k]) < 1e-10
    loss_a = sum((v * (i + 1)).sum() for i, (_, v) in enumerate(sorted(a.items())))
    loss_b = sum((v * (i + 1)).sum() for i, (_, v) in enumerate(sorted(b.items())))
    ga = torch.autograd.grad(loss_a, [x1[k] for k in NODE_TYPES])
    gb = torch.autograd.grad(loss_b, [x2[k] for k in NODE_TYPES])
    for u, v in zip(ga, gb, strict=True):
        assert rel_err(u, v) < 1e-10


def test_hgt_pyg_form_keywords_and_dict_in_channels():
    meta = (NODE_TYPES, EDGE_TYPES)
    m = hn.HGTConv({k: 8 for k in NODE_TYPES}, 8, metadata=meta, heads=2)
    assert (m.num_node_types, m.num_relations, m.in_channels) == (3, 4, 8)
    with pytest.raises(ValueError, match="pass heads by keyword"):
        hn.HGTConv(8, 8, meta, 2)
    with pytest.raises(NotImplementedError, match="one width for all types"):
        hn.HGTConv({"paper": 8, "author": 4, "venue": 8}, 8, meta)
    with pytest.raises(ValueError, match="both types in the node types"):
        hn.HGTConv(8, 8, (["a"], [("a", "r", "b")]))
    x, eid = _hetero()
    with pytest.raises(GraphInputError, match="not in the layer's metadata"):
        m.double()(x, {("venue", "hosts", "paper"): eid[EDGE_TYPES[0]]})
    with pytest.raises(GraphInputError, match="built without metadata"):
        hn.HGTConv(8, 8, 3, 4).double()(x, eid)


def test_hgt_pyg_form_prepares_the_graph_once():
    """Calls on the same edge_index_dict tensors share one joined graph (no per-call concatenation and
    preprocessing); new tensors (a new mini-batch) get a new one."""
    x, eid = _hetero()
    m = hn.HGTConv(8, 8, (NODE_TYPES, EDGE_TYPES), heads=2).double()
    hgt_mod._JOINED.clear()
    m(x, eid)
    first = next(iter(hgt_mod._JOINED.values()))[1]
    m(x, eid)
    assert len(hgt_mod._JOINED) == 1 and next(iter(hgt_mod._JOINED.values()))[1] is first
    assert first._graph is not None
    m(x, {k: v.clone() for k, v in eid.items()})
    assert len(hgt_mod._JOINED) == 2


def test_hgt_pyg_form_edge_index_given_new_data_by_assignment_gets_a_new_graph():
    """``edge_index_dict[e].data = other`` keeps the tensor object and its version counter: the joined graph of
    the old ids must not be reused."""
    x, eid = _hetero()
    m = hn.HGTConv(8, 8, (NODE_TYPES, EDGE_TYPES), heads=2).double()
    mine = {k: v.clone() for k, v in eid.items()}
    m(x, mine)
    key = next(iter(mine))
    mine[key].data = torch.stack([mine[key][0], mine[key][1].roll(1)])  # other edges, same ids in range
    fresh = {k: v.clone() for k, v in mine.items()}
    out, ref = m(x, mine), m(x, fresh)
    assert all(torch.equal(out[k], ref[k]) for k in ref)


def test_hgt_pyg_form_layers_of_other_edge_type_orders_share_the_dicts():
    """Two layers whose metadata lists the edge types in other orders (or one more edge type) number the
    relations differently; called on the same x_dict / edge_index_dict tensors, each must use its own numbering,
    not the joined graph the other layer made first."""
    x, eid = _hetero()
    orders = [EDGE_TYPES, EDGE_TYPES[::-1], EDGE_TYPES[1:] + [("venue", "has", "paper")] + EDGE_TYPES[:1]]
    pairs = []
    for seed, edge_types in enumerate(orders):
        theirs = _randomize(pyg_nn.HGTConv(8, 8, (NODE_TYPES, edge_types), heads=2).double(), seed=seed)
        ours = hn.HGTConv(8, 8, (NODE_TYPES, edge_types), heads=2).double()
        ours.load_state_dict(theirs.state_dict())
        pairs.append((ours, theirs, edge_types))
    for ours, theirs, edge_types in pairs + pairs[::-1]:
        # hector gets the one dict; PyG its keys in its own metadata order (its k_rel/v_rel HeteroLinear is told
        # the types come sorted, and reads them wrongly in another order)
        a, b = ours(x, eid), theirs(x, {e: eid[e] for e in edge_types if e in eid})
        for k in b:
            assert rel_err(a[k], b[k]) < 1e-10, k


@pytest.mark.parametrize("edge, row, value", [(("author", "writes", "paper"), 1, 9),  # past paper: an author
                                             (("paper", "in", "venue"), 1, 3),  # past the last type
                                             (("author", "writes", "paper"), 0, -1),  # before author: a paper
                                             (("paper", "cites", "paper"), 0, -1)])
def test_hgt_pyg_form_checks_ids_per_node_type(edge, row, value):
    """In x_dict/edge_index_dict each node type's ids count from 0 within its own rows: an id outside them is an
    error naming the edge type and node type (joined into one graph it would be a valid id of a neighbouring node
    type, silently read in its place)."""
    x, eid = _hetero()
    m = hn.HGTConv(8, 8, (NODE_TYPES, EDGE_TYPES), heads=2).double()
    bad = eid[edge].clone()
    bad[row, 3] = value
    nt = edge[0] if row == 0 else edge[2]
    with pytest.raises(GraphInputError, match=rf"edge_index_dict\[{re.escape(repr(edge))}\] row {row} .* node type "
                                              rf"'{nt}'.* outside \[0, {COUNTS[nt]}\)"):
        m(x, {**eid, edge: bad})


def test_hgt_pyg_form_checks_dtypes_and_widths():
    """Per-type inputs of the wrong kind are errors naming the dict entry, not a float edge_index truncated to
    ids, integer or mixed-dtype features promoted by the join, or torch.cat's message for another width."""
    x, eid = _hetero()
    m = hn.HGTConv(8, 8, (NODE_TYPES, EDGE_TYPES), heads=2).double()
    edge = EDGE_TYPES[2]
    with pytest.raises(GraphInputError, match=r"edge_index_dict\[.*cites.*\] must hold integer ids"):
        m(x, {**eid, edge: eid[edge].double()})
    with pytest.raises(GraphInputError, match=r"x_dict\['author'\] must be floating point"):
        m({**x, "author": x["author"].long()}, eid)
    with pytest.raises(GraphInputError, match=r"x_dict\['author'\] is torch.float32 .* x_dict\['paper'\] "
                                              "torch.float64"):
        m({**x, "author": x["author"].float()}, eid)
    with pytest.raises(GraphInputError, match=r"x_dict\['venue'\] has 5 features, .* in_channels=8"):
        m({**x, "venue": torch.randn(3, 5, dtype=torch.float64)}, eid)
    ref = m(x, eid)
    got = m(x, {k: v.int() for k, v in eid.items()})  # int32 ids are ids
    for k in ref:
        assert rel_err(got[k], ref[k]) < 1e-12


def test_hgt_pyg_state_dict_of_other_metadata_is_refused():
    """A strict load of a PyG HGTConv state_dict made from other metadata fails naming the difference: entries of a
    node type the layer lacks are unexpected keys (not dropped), another edge-type count is named (not a reshape
    error), and edge types in another order are refused (PyG's k_rel/v_rel rows follow its order: loaded in the
    layer's, they would land on the wrong relations). Node types in another order load and agree with PyG."""
    meta = (NODE_TYPES, EDGE_TYPES)
    ours = hn.HGTConv(8, 8, meta, heads=2).double()
    extra_type = pyg_nn.HGTConv(8, 8, (NODE_TYPES + ["org"], EDGE_TYPES), heads=2)
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\).*"kqv_lin.lins.org.weight"'):
        ours.load_state_dict(extra_type.state_dict())
    extra_edge = pyg_nn.HGTConv(8, 8, (NODE_TYPES, EDGE_TYPES + [("venue", "has", "paper")]), heads=2)
    with pytest.raises(RuntimeError, match="holds 10 = heads x edge types weights, this layer 2 x 4"):
        ours.load_state_dict(extra_edge.state_dict())
    reordered = pyg_nn.HGTConv(8, 8, (NODE_TYPES, EDGE_TYPES[::-1]), heads=2)
    with pytest.raises(RuntimeError, match="lists its edge types in another order"):
        ours.load_state_dict(reordered.state_dict())
    theirs = _randomize(pyg_nn.HGTConv(8, 8, (NODE_TYPES[::-1], EDGE_TYPES), heads=2).double(), seed=2)
    ours.load_state_dict(theirs.state_dict())
    x, eid = _hetero()
    a, b = ours(x, eid), theirs(x, eid)
    for k in b:
        assert rel_err(a[k], b[k]) < 1e-10


def test_hgt_pyg_state_dict_needs_metadata():
    theirs = pyg_nn.HGTConv(8, 8, (NODE_TYPES, EDGE_TYPES), heads=2)
    with pytest.raises(RuntimeError, match="build the layer from the same metadata"):
        hn.HGTConv(8, 8, 3, 4, heads=2).load_state_dict(theirs.state_dict())
    ours = hn.HGTConv(8, 8, 3, 4, heads=2)
    hn.load_pyg_hgt(ours, theirs)  # the loader function takes PyG's metadata order
    ref = hn.HGTConv(8, 8, (NODE_TYPES, EDGE_TYPES), heads=2)
    ref.load_state_dict(theirs.state_dict())
    for (n, a), (_, b) in zip(ours.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("kwargs", [dict(heads=2), dict(heads=3, concat=False), dict(heads=2, num_bases=3),
                                    dict(heads=2, attention_mode="multiplicative-self-attention"),
                                    dict(heads=1, bias=False, negative_slope=0.1)])
def test_rgat_pyg_arguments_and_strict_state_dict(kwargs):
    ei, et, _ = make_graph(num_nodes=N, num_edges=300, num_relations=R, seed=2)
    theirs = pyg_nn.RGATConv(6, 4, R, **kwargs).double()
    _randomize(theirs, seed=4)
    ours = hn.RGATConv(6, 4, R, attention="shared", **kwargs).double()
    ours.load_state_dict(theirs.state_dict())  # strict: PyG's unused mod-variant parameters are dropped
    x = torch.randn(N, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    a, b = ours(x1, ei, et), theirs(x2, ei, et)
    # (1e-7: the head-mean constant of concat=False is built in float32)
    assert rel_err(a, b) < 1e-7
    w = torch.randn_like(b)
    assert rel_err(torch.autograd.grad((a * w).sum(), x1)[0], torch.autograd.grad((b * w).sum(), x2)[0]) < 1e-7
    # the positional order is PyG's: num_bases is the fourth argument
    assert hn.RGATConv(6, 4, R, 3).num_bases == 3


def test_rgat_pyg_options_that_do_not_map():
    for kwargs, what in ((dict(num_blocks=2), "num_blocks"), (dict(mod="additive"), "mod"),
                         (dict(edge_dim=3), "edge_dim"), (dict(dim=2), "dim"),
                         (dict(attention_mechanism="within-relation"), "within-relation")):
        with pytest.raises(NotImplementedError, match=what):
            hn.RGATConv(6, 4, R, **kwargs)
    theirs = pyg_nn.RGATConv(6, 4, R, heads=2)
    with pytest.raises(RuntimeError, match="attention='shared'"):
        hn.RGATConv(6, 4, R, heads=2).load_state_dict(theirs.state_dict())  # per-relation Q/K by default


@pytest.mark.parametrize("make, error, match", [
    (lambda: hn.RGATConv(16, 8, R, heads=0), ValueError, r"RGATConv: heads must be a positive int, got 0; pass heads"),
    (lambda: hn.RGATConv(16, 0, R), ValueError, r"RGATConv: out_channels must be a positive int, got 0"),
    (lambda: hn.RGATConv(16, 8, R, heads=2.0), TypeError, r"RGATConv: heads must be an int, got float 2.0"),
    (lambda: hn.RGATConv(16, 8, R, 0), ValueError, r"RGATConv: num_bases must be a positive int, got 0"),
    (lambda: hn.RGCNConv(16, 8, 0), ValueError, r"RGCNConv: num_relations must be a positive int, got 0"),
    (lambda: hn.RGCNConv(16, 8, "4"), TypeError, r"RGCNConv: num_relations must be an int, got str '4'"),
    (lambda: hn.RGCNConv(-1, 8, R), ValueError, r"in_channels must be a positive int, got -1; PyG's lazy width -1"),
    (lambda: hn.RGCNConv(16, 8, R, num_bases=0), ValueError, r"RGCNConv: num_bases must be a positive int"),
    (lambda: hn.HGTConv(16, 8, 3, R, heads=0), ValueError, r"HGTConv: heads must be a positive int, got 0"),
    (lambda: hn.HGTConv(16, 8, 0, R), ValueError, r"HGTConv: num_node_types must be a positive int, got 0"),
    (lambda: hn.HGTConv(16, True, 3, R), TypeError, r"HGTConv: out_channels must be an int, got bool True"),
])
def test_layer_size_arguments_are_checked_by_name(make, error, match):
    # before: heads=0 was a bare ZeroDivisionError, a float or str size a TypeError from inside torch.empty
    with pytest.raises(error, match=match):
        make()


@pytest.mark.parametrize("x", [None, torch.arange(N)], ids=["none", "node-index"])
def test_rgcn_refuses_pyg_featureless_x_clearly(x, graph):
    """PyG's RGCNConv takes x=None or a node-index x (trainable node embeddings: x_j W_r is row x[j] of W_r, PyG's
    RGCN example on AIFB); hector's layers take features. The error names that form and a fix that gives PyG's
    result: before, it said "x must be a torch.Tensor" or advised x.float(), which fails next on x's shape."""
    ei, et, _ = graph
    m = hn.RGCNConv(N, 8, R)
    with pytest.raises(GraphInputError, match=r"RGCNConv: x is (None|node indices).*PyG's featureless form.*"
                                              r"torch\.eye\(num_nodes\)"):
        m(x, ei, et)
    pyg_nn = pytest.importorskip("torch_geometric.nn")
    theirs = pyg_nn.RGCNConv(N, 8, R)
    theirs.load_state_dict(m.state_dict())
    assert rel_err(m(torch.eye(N), ei, et), theirs(x, ei, et)) < 1e-5


def test_rgcn_refuses_pyg_bipartite_in_channels_clearly():
    # hector's program reads one x for the sources and the destinations, so PyG's (in_src, in_dst) has no mapping
    with pytest.raises(TypeError, match=r"RGCNConv: in_channels must be one int, got the tuple \(16, 8\): .*not "
                                        r"PyG's bipartite pair \(x_src, x_dst\)"):
        hn.RGCNConv((16, 8), 8, R)


def test_layer_size_arguments_accept_integer_types():
    import numpy as np

    conv = hn.RGATConv(np.int64(6), torch.tensor(4), R, heads=np.int32(2))
    assert (conv.in_channels, conv.out_channels, conv.heads) == (6, 4, 2)
    assert type(conv.heads) is int


def test_rgcn_strict_state_dict_both_ways():
    theirs = pyg_nn.RGCNConv(6, 5, R, num_bases=2)
    ours = hn.RGCNConv(6, 5, R, num_bases=2)
    ours.load_state_dict(theirs.state_dict())
    theirs.load_state_dict(ours.state_dict())


def test_parametrized_weights_as_in_pyg():
    """torch.nn.utils.parametrize on a layer's tensor (weight_norm, a custom map) moves it out of the module's
    parameters; the layer reads the parametrized value, as PyG's layer does: the same outputs and gradients of
    the original tensors."""
    from torch.nn.utils import parametrizations, parametrize

    class Double(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    ei, et, _ = make_graph(num_nodes=N, num_edges=200, num_relations=R, seed=4)
    x = torch.randn(N, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    pairs = [(hn.RGCNConv(16, 8, R, num_bases=2), pyg_nn.RGCNConv(16, 8, R, num_bases=2)),
             (hn.RGATConv(16, 4, R, heads=2, attention="shared"), pyg_nn.RGATConv(16, 4, R, heads=2))]
    for ours, theirs in pairs:
        ours, theirs = _randomize(ours.double()), _randomize(theirs.double(), seed=5)
        ours.load_state_dict(theirs.state_dict())
        for m in (ours, theirs):
            parametrize.register_parametrization(m, "bias", Double())
            parametrizations.weight_norm(m, "weight", dim=0)
        a, b = ours(x, ei, et), theirs(x, ei, et)
        assert rel_err(a, b) < 1e-10
        names = ["parametrizations.bias.original", "parametrizations.weight.original0",
                 "parametrizations.weight.original1"]
        ga = torch.autograd.grad(a.pow(2).sum(), [ours.get_parameter(n) for n in names])
        gb = torch.autograd.grad(b.pow(2).sum(), [theirs.get_parameter(n) for n in names])
        for n, u, v in zip(names, ga, gb, strict=True):
            assert rel_err(u, v) < 1e-10, n
    # under torch.compile (the layer's first call: its op's fake kernel traces the program, reading the
    # parametrized tensor's shape) the parametrized value is computed in the compiled graph
    torch._dynamo.reset()
    fresh = hn.RGCNConv(16, 8, R).double()
    parametrizations.weight_norm(fresh, "weight", dim=0)
    compiled = torch.compile(lambda h: fresh(h, ei, et), fullgraph=True, backend="aot_eager")
    assert rel_err(compiled(x), fresh(x, ei, et)) < 1e-12
