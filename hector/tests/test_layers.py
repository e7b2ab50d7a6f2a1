import pytest
import torch
from conftest import make_graph, rel_err

import hector
import hector.nn as hn
from hector import GraphInputError
from hector.passes import Options
from hector.runtime import graph as graph_mod

R, N = 3, 14


@pytest.fixture
def data():
    ei, et, nt = make_graph(node_types=2)
    x = torch.randn(N, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    return x, ei, et, nt


def layers():
    return {
        "rgcn": lambda: hn.RGCNConv(5, 4, R),
        "rgcn-bases-add": lambda: hn.RGCNConv(5, 4, R, num_bases=2, aggr="add"),
        "rgat-per-relation": lambda: hn.RGATConv(5, 3, R, heads=2),
        "rgat-shared-mean-root": lambda: hn.RGATConv(5, 3, R, heads=2, concat=False, attention="shared",
                                                     root_weight=True),
        "rgat-bases": lambda: hn.RGATConv(5, 3, R, heads=1, num_bases=2),
        "hgt-skip": lambda: hn.HGTConv(5, 5, 2, R, heads=1),
        "hgt-heads": lambda: hn.HGTConv(5, 4, 2, R, heads=2),
    }


def randomize(m):
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return m


@pytest.mark.parametrize("name", list(layers()))
@pytest.mark.parametrize("optimize", ["none", "all"])
def test_layer_gradcheck_float64(name, optimize, data):
    x, ei, et, nt = data
    m = randomize(layers()[name]().double())
    m.optimize = optimize
    params = [p for p in m.parameters()]
    x = x.clone().requires_grad_()

    # gradcheck perturbs inputs, so route params through as inputs and bind them functionally instead
    from torch.func import functional_call

    names = [n for n, _ in m.named_parameters()]

    def g(x_, *ps):
        return functional_call(m, dict(zip(names, ps, strict=True)), (x_, ei, et, nt))

    inputs = (x,) + tuple(p.detach().clone().requires_grad_() for p in params)
    assert torch.autograd.gradcheck(g, inputs, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("name", list(layers()))
def test_optimisation_choices_agree(name, data):
    x, ei, et, nt = data
    outs = []
    for opts in ("none", "all", Options(compact=True, reorder=True, force_reorder=True), "auto", "memory"):
        m = randomize(layers()[name]().double())
        m.optimize = opts
        outs.append(m(x, ei, et, nt))
    for o in outs[1:]:
        assert rel_err(o, outs[0]) < 1e-12


def test_rgat_per_relation_matches_handwritten_reference(data):
    x, ei, et, _ = data
    m = randomize(hn.RGATConv(5, 3, R, heads=2, negative_slope=0.1, root_weight=True).double())
    x = x.clone().requires_grad_()
    out = m(x, ei, et)
    # reference: per-edge weights, per-relation attention, max-subtracted softmax by destination
    src, dst = ei
    w = m.weight[et]  # [E, in, H*C]
    hs = torch.bmm(x[src].unsqueeze(1), w).squeeze(1)
    hd = torch.bmm(x[dst].unsqueeze(1), w).squeeze(1)
    score = torch.nn.functional.leaky_relu(torch.bmm(hd.unsqueeze(1), m.q[et]).squeeze(1)
                                           + torch.bmm(hs.unsqueeze(1), m.k[et]).squeeze(1), 0.1)
    smax = torch.full((N, 2), -torch.inf, dtype=x.dtype).scatter_reduce(
        0, dst.unsqueeze(1).expand(-1, 2), score.detach(), "amax")
    e = torch.exp(score - smax[dst])
    alpha = e / torch.zeros(N, 2, dtype=x.dtype).index_add(0, dst, e)[dst]
    agg = torch.zeros(N, 2, 3, dtype=x.dtype).index_add(0, dst, alpha.unsqueeze(-1) * hs.view(-1, 2, 3))
    ref = agg.reshape(N, 6) + x @ m.root + m.bias
    assert rel_err(out, ref) < 1e-12
    params = [x] + list(m.parameters())
    ga = torch.autograd.grad(out.pow(2).sum(), params)
    gb = torch.autograd.grad(ref.pow(2).sum(), params)
    for a, b in zip(ga, gb, strict=True):
        assert rel_err(a, b) < 1e-10


def test_softmax_is_stable_for_huge_scores():
    ei, et, _ = make_graph()
    m = hn.RGATConv(5, 3, R, heads=1).double()
    with torch.no_grad():
        m.q.fill_(50.0)
        m.k.fill_(50.0)
    x = 100.0 * torch.randn(N, 5, dtype=torch.float64)
    out = m(x, ei, et)
    assert torch.isfinite(out).all()


def test_dropout_only_in_training_and_consistent_in_backward(data):
    x, ei, et, nt = data
    m = randomize(hn.RGATConv(5, 3, R, heads=2, dropout=0.5).double())
    m.eval()
    a, b = m(x, ei, et), m(x, ei, et)
    assert torch.equal(a, b)
    m.train()
    torch.manual_seed(0)
    c = m(x, ei, et)
    torch.manual_seed(0)
    d = m(x, ei, et)
    torch.manual_seed(1)
    e = m(x, ei, et)
    assert torch.equal(c, d) and not torch.equal(c, e) and not torch.equal(a, c)
    # the backward uses the forward's mask: gradients match finite differences with the RNG state fixed
    from torch.func import functional_call

    names = [n for n, _ in m.named_parameters()]

    def g(x_, *ps):
        torch.manual_seed(123)
        return functional_call(m, dict(zip(names, ps, strict=True)), (x_, ei, et))

    inputs = (x.clone().requires_grad_(),) + tuple(p.detach().clone().requires_grad_() for p in m.parameters())
    assert torch.autograd.gradcheck(g, inputs, atol=1e-7, rtol=1e-5, fast_mode=True)


def test_float32_default_dtype_runs(data):
    x, ei, et, nt = data
    for m in (hn.RGCNConv(5, 4, R), hn.RGATConv(5, 4, R, heads=2), hn.HGTConv(5, 4, 2, R, heads=2)):
        out = m(x.float(), ei, et, nt)
        out.sum().backward()
        used = [p for n, p in m.named_parameters() if n != "skip"]  # HGT's skip gate only exists when in == out
        assert out.dtype == torch.float32 and all(p.grad is not None for p in used)


def test_isolated_nodes_and_edgeless_graphs(data):
    x, ei, et, nt = data
    m = randomize(hn.RGCNConv(5, 4, R).double())
    out = m(x, ei, et)
    isolated = N - 1  # make_graph leaves the last node without edges
    assert torch.allclose(out[isolated], x[isolated] @ m.root + m.bias)
    empty_ei, empty_et = torch.empty(2, 0, dtype=torch.long), torch.empty(0, dtype=torch.long)
    out = m(x, empty_ei, empty_et)
    assert torch.allclose(out, x @ m.root + m.bias)
    att = randomize(hn.RGATConv(5, 3, R, heads=2).double())
    assert torch.allclose(att(x, empty_ei, empty_et), att.bias.expand(N, -1))


def test_a_prepared_graph_must_fit_the_layer(data):
    """A hector.Graph given in place of edge_index was checked against its own counts: one made with more
    relations or node types than the layer has is an error naming the counts (not an IndexError from inside the
    weights' gather), and one made without node types is refused by a layer typed by several (it would run every
    node as type 0). A graph with fewer types than the layer is valid and gives the layer's result."""
    from hector import GraphInputError, prepare_graph

    x, ei, et, nt = data
    hgt = randomize(hn.HGTConv(5, 4, 2, R, heads=2).double())
    with pytest.raises(GraphInputError, match="made without node_type"):
        hgt(x, prepare_graph(ei, et, N, R))
    with pytest.raises(GraphInputError, match="2 node types but the graph was made with 3"):
        hgt(x, prepare_graph(ei, et, N, R, nt, 3))
    for m in (hgt, randomize(hn.RGCNConv(5, 4, R).double())):
        with pytest.raises(GraphInputError, match=f"{R} relations but the graph was made with num_relations={R + 2}"):
            m(x, prepare_graph(ei, et + 2, N, R + 2, nt, 2))
    fewer = et.clamp(max=R - 2)
    assert rel_err(hgt(x, prepare_graph(ei, fewer, N, R - 1, nt, 2)), hgt(x, ei, fewer, nt)) < 1e-12
    one_type = torch.zeros_like(nt)
    assert rel_err(hgt(x, prepare_graph(ei, et, N, R, one_type)), hgt(x, ei, et, one_type)) < 1e-12


def test_settings_changed_after_a_call_take_effect(data):
    """A layer's settings changed after it has run (``conv.negative_slope = ...``, a dropout schedule setting
    ``conv.dropout``) apply from the next call, eager and under torch.compile, as on a layer made with them; they
    were traced into the first call's program and kept."""
    x, ei, et, nt = data

    def made_with(layer, **kwargs):
        m = type(layer)(5, 3, R, heads=2, **kwargs).double()
        m.load_state_dict(layer.state_dict())
        return m

    m = randomize(hn.RGATConv(5, 3, R, heads=2).double())
    before = m(x, ei, et)
    m.negative_slope = 0.7
    ref = made_with(m, negative_slope=0.7)
    assert rel_err(m(x, ei, et), ref(x, ei, et)) < 1e-12 and rel_err(before, ref(x, ei, et)) > 1e-3
    torch._dynamo.reset()
    compiled = torch.compile(lambda h: m(h, ei, et), fullgraph=True, backend="aot_eager")
    compiled(x)
    m.dropout = 0.5
    ref = made_with(m, negative_slope=0.7, dropout=0.5)
    for run in (lambda: m(x, ei, et), lambda: compiled(x)):
        torch.manual_seed(4)
        got = run()
        torch.manual_seed(4)
        assert rel_err(got, ref(x, ei, et)) < 1e-12
    m.dropout = 0.0
    assert rel_err(compiled(x), made_with(m, negative_slope=0.7)(x, ei, et)) < 1e-12
    # setting the value a setting has (a schedule that sets it every epoch) keeps the traced program and the id
    # the per-graph caches are keyed by
    layer_id, programs = m._layer_id, dict(m._compiled)
    m.dropout, m.negative_slope = 0.0, 0.7
    assert m._layer_id == layer_id and m._compiled == programs and programs


def test_graph_preprocessing_is_cached_per_tensor_pair(data):
    x, ei, et, nt = data
    m = hn.RGCNConv(5, 4, R).double()
    m(x, ei, et)
    g1 = graph_mod.graph_for(ei, et, N, R)
    m(x, ei, et)
    assert graph_mod.graph_for(ei, et, N, R) is g1
    ei2 = ei.clone()
    assert graph_mod.graph_for(ei2, et, N, R) is not g1
    ei.add_(0)  # in-place edit bumps the version: the cached preprocessing is not reused
    assert graph_mod.graph_for(ei, et, N, R) is not g1


def test_tensors_given_new_data_by_assignment_get_a_new_graph(data):
    """``edge_index.data = other`` (as code that reuses a buffer for each batch writes) swaps the ids of the same
    tensor object without bumping its version counter: the layer must not run the graph of the old ids."""
    x, ei, et, nt = data
    ei2, et2, _ = make_graph(num_edges=50, seed=9)
    for m in (hn.RGCNConv(5, 4, R).double(), hn.RGATConv(5, 3, R, heads=2).double()):
        edge_index, edge_type = ei.clone(), et.clone()
        m(x, edge_index, edge_type)
        edge_index.data, edge_type.data = ei2.clone(), et2.clone()
        assert torch.equal(m(x, edge_index, edge_type), m(x, ei2, et2))


def test_ids_edited_in_place_after_the_graph_was_built_are_refused(data):
    """A loader that writes each batch's ids into one buffer (``buf.copy_(next_ids)``) before the previous step's
    backward: the graph shares the buffer's memory, so its backward read the new ids and returned wrong gradients
    without an error (PyG's RGATConv raises autograd's in-place error; its RGCNConv copies the ids)."""
    x, ei, et, nt = data
    ei2, et2, _ = make_graph(seed=9)
    for m in (hn.RGCNConv(5, 4, R).double(), hn.RGATConv(5, 3, R, heads=2).double(),
              hn.HGTConv(5, 4, 2, R, heads=2).double()):
        buf_ei, buf_et, buf_nt = ei.clone(), et.clone(), nt.clone()
        out = m(x.clone().requires_grad_(), buf_ei, buf_et, buf_nt)
        buf_ei.copy_(ei2)
        with pytest.raises(GraphInputError, match="edge_index, edge_type or node_type was modified in place"):
            out.sum().backward()
        if m.num_node_types is not None:  # (the untyped layers do not read node_type)
            out = m(x.clone().requires_grad_(), buf_ei, buf_et, buf_nt)  # the new ids: a new graph
            buf_nt.copy_(1 - buf_nt)
            with pytest.raises(GraphInputError, match="modified in place"):
                out.sum().backward()
    graph = hector.Graph(buf_ei, buf_et, N, R)  # a graph the caller holds, its ids edited before its use
    buf_et.copy_(et)
    with pytest.raises(GraphInputError, match="modified in place after hector built its graph"):
        hn.RGCNConv(5, 4, R).double()(x, graph)
    m = hn.RGCNConv(5, 4, R).double()  # int32 ids are copied (to long) by the graph: an edit changes nothing
    ids = ei.int()
    xg = x.clone().requires_grad_()
    out = m(xg, ids, et)
    ids.copy_(ei2.int())
    out.sum().backward()
    ref = x.clone().requires_grad_()
    m(ref, ei, et).sum().backward()
    assert torch.equal(xg.grad, ref.grad)


def test_sampled_subgraph_minibatch(data):
    """A mini-batch subgraph (relabelled nodes, fewer edges) runs and matches the same layer on the same
    subgraph computed by the hand-checked full path; the full graph's cache is not reused for it."""
    utils = pytest.importorskip("torch_geometric.utils")
    x, ei, et, nt = data
    m = randomize(hn.RGATConv(5, 3, R, heads=2).double())
    subset, sub_ei, _, edge_mask = utils.k_hop_subgraph(torch.tensor([0, 1]), 2, ei, relabel_nodes=True,
                                                        num_nodes=N)
    sub_et = et[edge_mask]
    out = m(x[subset], sub_ei, sub_et)
    m.optimize = "none"
    ref = m(x[subset], sub_ei, sub_et)
    assert out.shape == (subset.numel(), 6) and rel_err(out, ref) < 1e-12


def test_neighbor_loader_batches():
    pyg = pytest.importorskip("torch_geometric")
    from torch_geometric.data import Data
    from torch_geometric.loader import NeighborLoader

    ei, et, _ = make_graph(num_nodes=40, num_edges=300)
    data = Data(x=torch.randn(40, 5), edge_index=ei, edge_type=et, num_nodes=40)
    try:
        import warnings

        with warnings.catch_warnings():  # PyG deprecates its pure-Python sampler (pyg-lib is the fast one)
            warnings.simplefilter("ignore", UserWarning)
            loader = NeighborLoader(data, num_neighbors=[5, 5], batch_size=8)
            batches = list(loader)
    except ImportError as e:  # PyG's sampler needs pyg-lib or torch-sparse
        pytest.skip(f"NeighborLoader unavailable here: {e}")
    m = hn.RGCNConv(5, 4, R)
    for batch in batches:
        out = m(batch.x, batch.edge_index, batch.edge_type)
        assert out.shape == (batch.num_nodes, 4)
    del pyg


@pytest.mark.parametrize("name", ["rgcn", "rgat-per-relation", "hgt-heads"])
def test_tiled_reference_execution_matches(name, data, monkeypatch, env_settings):
    """Edge-parallel kernels run tile by tile (bounded temporaries) give the same values and gradients."""
    x, ei, et, nt = data
    results = []
    for tile in (None, "48"):
        if tile:
            monkeypatch.setenv("HECTOR_REFERENCE_TILE_BYTES", tile)
            env_settings()
        m = randomize(layers()[name]().double())
        xx = x.clone().requires_grad_()
        out = m(xx, ei, et, nt)
        grads = torch.autograd.grad(out.pow(2).sum(), [xx] + list(p for n, p in m.named_parameters()
                                                                    if n != "skip"))
        results.append((out, grads))
    (a, ga), (b, gb) = results
    assert rel_err(b, a) < 1e-12
    for u, v in zip(ga, gb, strict=True):
        assert rel_err(u, v) < 1e-12


def test_double_backward_is_refused_clearly(data):
    x, ei, et, _ = data
    m = hn.RGCNConv(5, 4, R).double()
    xx = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(m(xx, ei, et).pow(2).sum(), xx, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|twice"):
        g.sum().backward()


@pytest.mark.parametrize("name", list(layers()))
def test_graph_first_seen_under_inference_mode_trains_afterwards(name, data):
    """A full-graph loop that evaluates before it trains (Lightning's validation sanity check runs under
    torch.inference_mode) prepares the graph inside inference mode; the training step on the same edge tensors
    reuses that graph, and a backward through it must work and give the gradients of a graph made outside."""
    x, _, _, nt = data
    ei, et, _ = make_graph(seed=21)  # tensors no other test has handed to a layer: the graph is made below
    m = randomize(layers()[name]().double())
    with torch.inference_mode():
        evaluated = m(x, ei, et, nt)
    xx = x.clone().requires_grad_()
    out = m(xx, ei, et, nt)
    out.pow(2).sum().backward()
    assert rel_err(out, evaluated) < 1e-12
    fresh = x.clone().requires_grad_()
    m(fresh, ei.clone(), et.clone(), nt).pow(2).sum().backward()  # new tensors: a graph made outside
    assert rel_err(xx.grad, fresh.grad) < 1e-12


def test_torch_func_transforms_are_refused_by_name(data):
    """torch.func.grad / vmap over a layer: an error that names the transforms and the way that works (instead
    of torch's complaint about an autograd.Function's setup_context, which the user never wrote)."""
    from torch.func import functional_call, grad, vmap

    x, ei, et, _ = data
    m = hn.RGCNConv(5, 4, R).double()
    params = dict(m.named_parameters())
    with pytest.raises(NotImplementedError, match="torch.func transforms"):
        grad(lambda p: functional_call(m, p, (x, ei, et)).sum())(params)
    with pytest.raises(NotImplementedError, match="torch.func transforms"):
        vmap(lambda h: m(h, ei, et))(x.expand(2, -1, -1))
    # what the message points to works
    grads = torch.autograd.grad(functional_call(m, params, (x, ei, et)).sum(), list(params.values()))
    assert all(g is not None for g in grads)
