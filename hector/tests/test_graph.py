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


def test_preprocessing_is_computed_once(small, monkeypatch):
    """The unique (source, relation) pairs are computed once per graph, when it is made (their count comes to the
    host in the same read as the id check), never again on use."""
    from hector.runtime import prep

    calls = []
    real = prep.run

    def counting(fn, *a):
        calls.append(fn.__name__)
        return real(fn, *a)

    monkeypatch.setattr(prep, "run", counting)
    monkeypatch.setattr(torch, "unique", lambda *a, **k: pytest.fail("torch.unique reads its size on the host"))
    g = Graph(*small, 14, 3)
    for _ in range(3):
        _ = g.edge_to_unique, g.unique_src, g.num_unique, g.size_stats()
    assert calls == ["check_and_pair"]


def test_one_host_read_per_new_graph(small, monkeypatch):
    """A graph made from new tensors reads the device once: the ids' ranges, the destinations' order and the pair
    count come in one transfer (each read waits for the GPU)."""
    reads = []
    real = torch.Tensor.tolist

    def counting(self):
        reads.append(self.numel())
        return real(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting)
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("a second host read"))
    ei, et = small
    g = Graph(ei, et, 14, 3, torch.arange(14) % 2, 2)
    assert g.num_unique == torch.unique(et * 14 + ei[0]).numel()
    g.size_stats()
    assert len(reads) == 1 and reads[0] == 2 * 3 + 2  # three (min, max), the smallest step, the pair count


@pytest.mark.parametrize("make", [lambda: hn.RGCNConv(8, 8, 3), lambda: hn.RGATConv(8, 8, 3, heads=2),
                                  lambda: hn.HGTConv(8, 8, 2, 3, heads=2)])
def test_a_new_graph_per_call_releases_the_graphs_of_freed_tensors(make):
    """A mini-batch loop (new edge_index / edge_type each step, the old ones dropped): the graphs of earlier
    batches, with their device layouts, are freed once their tensors are, not kept for the next fifteen batches
    (which grew the GPU's memory by a graph's layout per batch, a device allocation in each step). Graphs whose
    tensors are still held stay cached and are found again."""
    import gc
    import weakref

    from hector.runtime import graph as graph_mod

    layer = make()
    typed = isinstance(layer, hn.HGTConv)
    x = torch.randn(20, 8, requires_grad=True)
    nt = torch.arange(20) % 2
    gen = torch.Generator().manual_seed(0)
    kept_ei, kept_et = torch.randint(0, 20, (2, 40), generator=gen), torch.randint(0, 3, (40,), generator=gen)
    layer(x, kept_ei, kept_et, nt).sum().backward()
    kept = graph_mod.graph_for(kept_ei, kept_et, 20, 3, nt if typed else None, 2 if typed else None)
    refs = []
    for _ in range(4):
        ei, et = torch.randint(0, 20, (2, 50), generator=gen), torch.randint(0, 3, (50,), generator=gen)
        layer(x, ei, et, nt).sum().backward()
        refs.append(weakref.ref(graph_mod.graph_for(ei, et, 20, 3, nt if typed else None, 2 if typed else None)))
        del ei, et
    # freed by reference counting alone (a cycle would keep a GPU layout until the collector ran); the last one at
    # the next lookup
    assert [r() is None for r in refs] == [True, True, True, False]
    assert graph_mod.graph_for(kept_ei, kept_et, 20, 3, nt if typed else None, 2 if typed else None) is kept
    gc.collect()
    assert refs[-1]() is None
    assert graph_mod.cached_graphs() >= 1


@pytest.mark.parametrize("make", [lambda: hn.RGCNConv(8, 4, 3), lambda: hn.HGTConv(8, 8, 2, 3, heads=2)])
def test_swapping_the_ids_of_a_cached_graph(make):
    """``torch.utils.swap_tensors`` on the ``edge_index`` / ``edge_type`` / ``node_type`` of a graph hector has
    cached (a module conversion swaps tensors so): the swap works (the cache holds no weak reference to the
    caller's tensors), the graph built from the old ids keeps them (it holds none of the caller's tensor objects),
    and the next call on the swapped tensors builds a graph from their new ids, with the reference's result."""
    from hector.runtime import graph as graph_mod

    layer = make()
    typed = isinstance(layer, hn.HGTConv)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(20, 8)
    ei, et = torch.randint(0, 20, (2, 50), generator=gen), torch.randint(0, 3, (50,), generator=gen)
    nt = torch.arange(20) % 2
    old_ids = (ei.clone(), et.clone())
    before = layer(x, ei, et, nt)
    graph = graph_mod.graph_for(ei, et, 20, 3, nt if typed else None, 2 if typed else None)
    new_ei, new_et = torch.randint(0, 20, (2, 50), generator=gen), torch.randint(0, 3, (50,), generator=gen)
    expected = layer(x, new_ei.clone(), new_et.clone(), nt)
    torch.utils.swap_tensors(ei, new_ei)
    torch.utils.swap_tensors(et, new_et)
    if typed:
        torch.utils.swap_tensors(nt, (torch.arange(20) + 1) % 2)
        expected = layer(x, ei.clone(), et.clone(), nt.clone())
    assert torch.equal(graph.src, old_ids[0][0]) and torch.equal(graph.etype, old_ids[1]), "the old graph's ids"
    after = layer(x, ei, et, nt)
    assert graph_mod.graph_for(ei, et, 20, 3, nt if typed else None, 2 if typed else None) is not graph
    assert torch.equal(after, expected) and not torch.equal(after, before)
    # the tensors holding the old ids (swapped into new_ei / new_et) found their old graph no more than new ones
    assert graph_mod.graph_for(new_ei, new_et, 20, 3, nt if typed else None, 2 if typed else None) is not graph


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
    # PyG's layers also take a sparse adjacency adj_t; the advice was edge_index.long(), which keeps it sparse
    (lambda ei, et: (torch.sparse_coo_tensor(ei.flip(0), et, (N, N)), et),
     "edge_index is a sparse tensor \\(torch.sparse_coo\\).*adj_t.coalesce\\(\\).indices\\(\\).flip\\(0\\)"),
    (lambda ei, et: (torch.sparse_coo_tensor(ei.flip(0), et, (N, N)).to_sparse_csr(), et),
     "edge_index is a sparse tensor \\(torch.sparse_csr\\)"),
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


def test_config_setters_mirror_environment(monkeypatch, env_settings):
    from hector import config

    monkeypatch.setenv("HECTOR_REFERENCE_TILE_BYTES", "4096")
    env_settings()
    assert config.tile_bytes("cpu") == 4096
    config.set_tile_bytes(128)
    try:
        assert config.tile_bytes("cpu") == 128
    finally:
        config.set_tile_bytes(None)
    monkeypatch.setenv("HECTOR_REFERENCE_TILE_BYTES", "0")
    with pytest.raises(ValueError, match="HECTOR_REFERENCE_TILE_BYTES.*>= 1"):
        env_settings()
    monkeypatch.delenv("HECTOR_REFERENCE_TILE_BYTES")
    env_settings()
    assert config.tile_bytes("cpu") == 1 << 20 and config.tile_bytes("cuda") == 64 << 20
    monkeypatch.setenv("HECTOR_DEBUG", "on")
    env_settings()
    assert config.debug()
    monkeypatch.setenv("HECTOR_TF32", "maybe")
    with pytest.raises(ValueError, match="HECTOR_TF32.*auto"):
        env_settings()
    config.set_debug(False)
    try:
        assert not config.debug()
    finally:
        config.set_debug(None)


def _skewed_graph(n=500, e=4000, relations=5, seed=3, sync_free=False):
    g = torch.Generator().manual_seed(seed)
    ei = torch.randint(0, n, (2, e), generator=g)
    et = (torch.rand(e, generator=g) ** 3 * relations).long()  # skewed: some relations hold few edges, one most
    nt = torch.randint(0, 2, (n,), generator=g)
    return Graph(ei, et, n, relations, nt, 2, sync_free=sync_free)


def _emulated_schedule_builder():
    """The CUDA backend's tile-schedule kernel, run on the CPU by the kernel emulator (tests/emulation.py)."""
    from emulation import EmulatedExecutor, compiler

    from hector.runtime.cuda import CudaBackend

    if compiler() is None:
        pytest.skip("no C++ compiler for the kernel emulator")
    return CudaBackend(EmulatedExecutor()).build_schedule


LAYOUTS = [(Domain.EDGE, ("etype",)), (Domain.UNIQUE, ("etype",)), (Domain.EDGE, ("src_ntype", "etype")),
           (Domain.UNIQUE, ("src_ntype", "etype")), (Domain.NODE, ("ntype",)), (Domain.EDGE, ())]


@pytest.mark.parametrize("sync_free", [False, True])
def test_device_layout_reads_nothing_on_the_host(monkeypatch, sync_free):
    """The CUDA backend's per-graph layout (destination order, CSC offsets, unique pairs, type orders, tile
    schedules) reads no value on the host: on a GPU each such read waits for every kernel queued before it (e.g.
    the mini-batch's feature gather). A graph that is not ``sync_free`` reads its unique-pair count once before;
    a ``sync_free`` one reads nothing at all, its cost-model statistics included."""
    from hector.runtime.cuda import DeviceGraph

    graph = _skewed_graph(sync_free=sync_free)
    if not sync_free:
        graph.size_stats()  # the one read: the number of unique pairs

    def host_read(*args, **kwargs):
        raise AssertionError("a tensor value was read on the host")

    build = _emulated_schedule_builder()
    for name in ("tolist", "item", "__int__", "__bool__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    stats = graph.size_stats()
    dg = DeviceGraph(graph)
    for domain, by in LAYOUTS:
        for rows in (7, 256):
            dg.tiles(domain, by, rows, build)
        if by:
            dg.perm(domain, by)
            dg.index(domain, by)
    monkeypatch.undo()
    assert dg.padded == sync_free
    assert dg.num_unique == (graph.num_edges if sync_free else graph.num_unique)
    assert int(dg.count(Domain.UNIQUE)) == graph.num_unique
    if sync_free:  # no pair ratio known for this size class before: the estimate is the upper bound
        assert stats["num_unique"] in (graph.num_edges, graph.num_unique)
    assert torch.equal(dg.csc_ptr.long(), torch.cat([torch.zeros(1, dtype=torch.long),
                                                     torch.cumsum(torch.bincount(graph.dst, minlength=500), 0)]))


@pytest.mark.parametrize("relations", [5, 1500])
@pytest.mark.parametrize("domain,by", LAYOUTS)
@pytest.mark.parametrize("rows", [1, 7, 64, 4096])
@pytest.mark.parametrize("padded", [False, True])
def test_tile_schedule_covers_each_row_once_within_its_type(domain, by, rows, relations, padded):
    """Tiles of at most ``rows`` rows, one type each, covering the type-sorted rows exactly once; the spare slots
    of the schedule (sized before the per-type counts are known) have count 0. With 1,500 relations (3,000
    combined types, most empty) the kernel's threads place the types in several chunks of one block. Padded
    UNIQUE rows (a layout built before the pair count is known on the host) are never in a tile."""
    from hector.runtime.cuda import DeviceGraph

    graph = _skewed_graph(e=4000 if relations == 5 else 600, relations=relations)
    exact = graph.segments(domain, by)[1] if by else [graph.num_rows(domain)]
    graph._cache.pop("unique", None)  # as a sync_free graph: the pairs are computed on the device
    if not padded:
        graph.size_stats()  # the unique pairs counted on the host: UNIQUE rows sized exactly
    dg = DeviceGraph(graph)
    assert dg.padded == padded
    table, slots = dg.tiles(domain, by, rows, _emulated_schedule_builder())
    assert table.shape == (slots, 3)
    total = dg.rows(domain)
    assert slots <= -(-total // rows) + min(total, dg.graph.num_combined_types(by)), "bounded by the rows"
    kind, begin, count = table.long().unbind(1)
    assert bool((count <= rows).all()) and bool((count >= 0).all())
    real = count > 0
    assert int(real.sum()) == sum(-(-c // rows) for c in exact)
    covered = torch.cat([torch.arange(b, b + c) for b, c in zip(begin[real].tolist(), count[real].tolist(),
                                                                strict=True)])
    assert torch.equal(covered, torch.arange(sum(exact))), "every real position of the type order once, in order"
    if by:
        types = dg.graph.combined_index(domain, by)[dg.perm(domain, by).long()]
        assert torch.equal(types[covered], torch.repeat_interleave(kind[real], count[real]))
        assert bool((dg.perm(domain, by)[covered].long() < sum(exact)).all()), "no padding row in a tile"


def _plain_schedule(counts: list[int], rows: int, slots: int) -> torch.Tensor:
    """The tile schedule written one tile at a time: (type, first row, rows) per tile, types in order, zeros after."""
    table, first = [], 0
    for t, c in enumerate(counts):
        table += [[t, first + off, min(rows, c - off)] for off in range(0, c, rows)]
        first += c
    table = table[:slots] + [[0, 0, 0]] * max(0, slots - len(table))
    return torch.tensor(table, dtype=torch.int32).reshape(slots, 3)


@pytest.mark.parametrize("types,rows,seed", [(1, 1, 0), (3, 1, 1), (5, 7, 2), (300, 2, 3), (1500, 5, 4), (2, 64, 5)])
def test_tile_schedule_kernel_matches_the_schedule_written_tile_by_tile(types, rows, seed):
    """The kernel's table equals the plain loop's, entry for entry: many empty types, types of hundreds of tiles
    (written by the whole block), several chunks of types, and a bound of slots below the tile count (the kernel
    stops at the table's end) as well as above it (zeros)."""
    g = torch.Generator().manual_seed(seed)
    counts = (torch.rand(types, generator=g) ** 4 * 900).long() * (torch.rand(types, generator=g) < 0.6)
    build = _emulated_schedule_builder()
    tiles = int((-(-counts // rows)).sum())
    for slots in (tiles + types, tiles, max(1, tiles // 2)):
        assert torch.equal(build(counts, rows, slots), _plain_schedule(counts.tolist(), rows, slots)), slots


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device available")
@pytest.mark.parametrize("types,rows,largest", [(3, 1, 1000), (1500, 5, 2000), (535, 256, 900_000)])
def test_tile_schedule_kernel_on_a_gpu_matches_the_schedule_written_tile_by_tile(types, rows, largest):
    """The same comparison on a GPU (relations of up to ``largest`` rows: thousands of tiles for one type)."""
    from hector.runtime.cuda import CudaBackend

    g = torch.Generator().manual_seed(types)
    counts = (torch.rand(types, generator=g) ** 4 * largest).long() * (torch.rand(types, generator=g) < 0.6)
    build = CudaBackend().build_schedule
    tiles = int((-(-counts // rows)).sum())
    for slots in (tiles + types, max(1, tiles // 2)):
        assert torch.equal(build(counts.cuda(), rows, slots).cpu(), _plain_schedule(counts.tolist(), rows, slots))


def test_prepare_graph_returns_the_graph_the_layers_use():
    """hector.prepare_graph preprocesses the graph that a layer called on the same tensors then uses (cached by
    tensor identity), so the layer's forward has nothing left that reads the device."""
    import hector

    g = _skewed_graph()
    ei, et = torch.stack([g.src, g.dst]), g.etype
    prepared = hector.prepare_graph(ei, et, g.num_nodes, g.num_relations)
    assert "size_stats" in prepared._cache and prepared.num_unique == g.num_unique
    layer = hn.RGATConv(4, 3, g.num_relations, heads=2)
    x = torch.randn(g.num_nodes, 4)
    assert layer.graph(x, ei, et) is prepared
    assert torch.allclose(layer(x, prepared), layer(x, ei, et))
    with pytest.raises(GraphInputError, match="outside"):
        hector.prepare_graph(ei, et, g.num_nodes, 2)  # relation ids up to 4 with num_relations=2


def test_record_stream_reaches_every_cached_tensor(monkeypatch):
    """Graph.record_stream marks the graph's tensors and those of its cached preprocessing, the CUDA backend's
    layout included (tensor.record_stream itself needs a GPU: counted here through a stand-in)."""
    from hector.runtime.cuda import device_graph

    graph = _skewed_graph()
    dg = device_graph(graph)
    dg.tiles(Domain.EDGE, ("etype",), 64, _emulated_schedule_builder())
    order = dg.dst_order  # made on first use, like the tiles
    graph.size_stats()
    marked = []
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, stream: marked.append(t))
    graph.record_stream("stream")
    ids = {id(t) for t in marked}
    for t in (graph.src, graph.edge_to_unique, dg.csc_ptr, order, dg.order, dg.graph.src,
              dg._cache[("tiles", Domain.EDGE, ("etype",), 64)][0]):
        assert id(t) in ids


@pytest.mark.parametrize("edges,nodes,relations", [(0, 3, 2), (1, 1, 1), (50, 4, 3), (400, 60, 7), (300, 300, 1)])
def test_unique_pairs_on_the_device_match_torch_unique(edges, nodes, relations):
    """The CUDA backend's host-read-free unique pairs: the count of torch.unique, each edge mapped to a row holding
    its own (source, relation), every real row distinct and in relation-major order, the padding after them."""
    from hector.runtime.cuda import unique_pairs

    g = torch.Generator().manual_seed(edges)
    src = torch.randint(0, nodes, (edges,), generator=g)
    et = torch.randint(0, relations, (edges,), generator=g)
    usrc, uet, inverse, count = unique_pairs(src, et, nodes, relations)
    expected = torch.unique(src * relations + et).numel()
    assert count.shape == (1,) and int(count) == expected
    assert usrc.shape == uet.shape == inverse.shape == (edges,)
    assert torch.equal(usrc[inverse], src) and torch.equal(uet[inverse], et)
    key = (uet * nodes + usrc)[:expected]
    assert bool((key[1:] > key[:-1]).all()), "distinct, relation-major"
    assert bool((inverse < expected).all()) and bool((usrc[expected:] == 0).all() and (uet[expected:] == 0).all())


def test_estimated_pair_count_learns_from_earlier_graphs_of_the_size_class(monkeypatch):
    """A sync_free graph's cost-model pair count: the edge count while nothing is known; once an earlier graph of
    the same size class has had its pairs counted on the device (the count reaching the host without waiting),
    that graph's pairs-per-edge ratio; and its own count once that has arrived."""
    from hector.runtime import graph as graph_mod
    from hector.runtime.cuda import DeviceGraph

    exact = _skewed_graph().num_unique
    monkeypatch.setattr(graph_mod, "_PAIR_RATIOS", {})  # forget the ratio that count recorded
    first, second = _skewed_graph(sync_free=True), _skewed_graph(sync_free=True)
    assert first.size_stats()["num_unique"] == first.num_edges > exact
    DeviceGraph(first)  # pairs counted on the device; the count is on its way
    assert second.size_stats()["num_unique"] == exact, "the ratio of the first graph"
    assert first.size_stats()["num_unique"] == exact, "its own count, arrived"
    assert "unique" not in second._cache, "no host read on the second graph"


def test_untyped_layer_ignores_node_types():
    """A layer made without num_node_types never reads node types: given some (as a PyG loop passes them to every
    layer), its graph does not count them (on a GPU that would read the device for every new graph)."""
    g = _skewed_graph()
    ei, et = torch.stack([g.src, g.dst]), g.etype
    layer = hn.RGCNConv(4, 3, g.num_relations)
    x = torch.randn(g.num_nodes, 4)
    graph = layer.graph(x, ei, et, g.ntype)
    assert graph.num_node_types == 1 and graph is layer.graph(x, ei, et, None)
    assert torch.allclose(layer(x, ei, et, g.ntype), layer(x, ei, et))


def test_sorted_by_destination_is_checked():
    """The destination-order hint is checked with the ids (one host read): a false promise is an error that says
    the fix; without the hint the order is found out; a graph of one edge or none is sorted."""
    import hector

    ei = torch.tensor([[0, 1, 2, 3], [1, 0, 2, 2]])
    et = torch.zeros(4, dtype=torch.long)
    with pytest.raises(hector.GraphInputError, match="sort the edges by destination or leave the hint out"):
        hector.Graph(ei, et, 4, 1, sorted_by_destination=True)
    assert not hector.Graph(ei, et, 4, 1).dst_sorted
    assert hector.Graph(ei[:, [1, 0, 2, 3]], et, 4, 1).dst_sorted
    assert not hector.Graph(ei[:, [1, 0, 2, 3]], et, 4, 1, sorted_by_destination=False).dst_sorted
    assert hector.Graph(ei[:, :1], et[:1], 4, 1).dst_sorted
    assert hector.Graph(ei[:, :0], et[:0], 4, 1, sorted_by_destination=True).dst_sorted
    # the reference's CSC layout of sorted edges is the identity permutation
    perm, ptr = hector.Graph(ei[:, [1, 0, 2, 3]], et, 4, 1).csc()
    assert perm.tolist() == [0, 1, 2, 3] and ptr.tolist() == [0, 1, 2, 4, 4]


def test_prepare_graph_layers_argument():
    """``layers=`` takes modules holding hector layers; a layer made for another relation count is an error; a
    module without any hector layer gets a warning (nothing prepared); a non-module is a TypeError."""
    import hector

    ei, et, _ = make_graph(seed=2)
    model = torch.nn.ModuleList([torch.nn.Linear(4, 4), hn.RGCNConv(4, 4, 3)])
    graph = hector.prepare_graph(ei, et, 14, 3, layers=model)
    assert graph.cached(("options", model[1]._layer_id, True, "time", hector.config.sorted_scatter()),
                        lambda: None) is not None, "the cost model's choice was made ahead"
    with pytest.raises(hector.GraphInputError, match="num_relations"):
        hector.prepare_graph(ei, et, 14, 3, layers=[hn.RGCNConv(4, 4, 5)])
    with pytest.warns(UserWarning, match="found no hector layer"):
        hector.prepare_graph(ei, et, 14, 3, layers=torch.nn.Linear(4, 4))
    with pytest.raises(TypeError, match="torch modules"):
        hector.prepare_graph(ei, et, 14, 3, layers=["rgcn"])
