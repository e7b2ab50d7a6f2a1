"""A new graph's tensor work in TorchScript (``hector.runtime.prep``): the CUDA backend's layout checked against a
plain-torch reference on random graphs (empty, one edge, one relation, duplicate edges, many relations, edges
already in destination order, pairs exact or padded), and the scripted functions against the same functions run
as Python."""

import pytest
import torch

from hector.ir import Domain
from hector.runtime import prep
from hector.runtime.device_graph import DeviceGraph
from hector.runtime.graph import Graph

CASES = [  # (edges, nodes, relations, seed)
    (0, 5, 3, 0), (1, 1, 1, 1), (40, 6, 1, 2), (300, 8, 2, 3),  # few sources: many duplicate pairs
    (500, 120, 7, 4), (400, 50, 1500, 5), (64, 64, 4, 6),
    (70_000, 300, 5, 13),  # enough edges for relations and nodes to sort as int8 / int16 (prep.sort_keys)
]


def _graph(edges, nodes, relations, seed, dst_sorted=False):
    g = torch.Generator().manual_seed(seed)
    ei = torch.randint(0, nodes, (2, edges), generator=g)
    et = torch.randint(0, relations, (edges,), generator=g)
    if dst_sorted:
        order = torch.argsort(ei[1], stable=True)
        ei, et = ei[:, order], et[order]
    return ei, et


def _in_order(ei):
    return ei.size(1) <= 1 or bool((ei[1][1:] >= ei[1][:-1]).all())


def _reference(ei, et, nodes, relations, keep=None):
    """The layout from plain torch ops: (destination, relation) order (the edges' own where they are kept:
    by default where they come in destination order), CSC offsets, heaviest destinations first, the unique
    (source, relation) pairs relation-major, per-type counts and orders."""
    keep = _in_order(ei) if keep is None else keep
    order = torch.arange(ei.size(1)) if keep else torch.argsort(ei[1] * relations + et, stable=True)
    src, dst, etype = ei[0][order], ei[1][order], et[order]
    deg = torch.bincount(dst, minlength=nodes)
    ptr = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(deg, 0)])
    keys = torch.unique(etype * nodes + src)
    return {"order": order, "src": src, "dst": dst, "etype": etype, "csc_ptr": ptr,
            "dst_order": torch.argsort(-deg, stable=True), "pair_src": keys % nodes, "pair_etype": keys // nodes,
            "edge_counts": torch.bincount(etype, minlength=relations),
            "edge_perm": torch.argsort(etype, stable=True),
            "pair_counts": torch.bincount(keys // nodes, minlength=relations)}


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("dst_sorted", [False, True])
@pytest.mark.parametrize("edges,nodes,relations,seed", CASES)
def test_device_layout_matches_a_plain_torch_reference(edges, nodes, relations, seed, dst_sorted, padded):
    ei, et = _graph(edges, nodes, relations, seed, dst_sorted)
    graph = Graph(ei, et, nodes, relations, sync_free=padded)
    # a sync-free graph knows the order only from a promise (as on a GPU): sorted again
    assert graph.dst_sorted == (not padded and _in_order(ei))
    ref = _reference(ei, et, nodes, relations, keep=graph.dst_sorted)
    dg = DeviceGraph(graph)
    g = dg.graph
    count = ref["pair_src"].numel()
    assert dg.padded == padded
    if graph.dst_sorted:
        assert dg.order is None
        assert torch.equal(g.src, ei[0]) and torch.equal(g.dst, ei[1]) and torch.equal(g.etype, et)
    else:
        assert torch.equal(dg.order, ref["order"])
        assert torch.equal(g.src, ref["src"]) and torch.equal(g.dst, ref["dst"]) and torch.equal(g.etype, ref["etype"])
    assert dg.csc_ptr.dtype == torch.int32 and torch.equal(dg.csc_ptr.long(), ref["csc_ptr"])
    assert dg.dst_order.dtype == torch.int32 and torch.equal(dg.dst_order.long(), ref["dst_order"])
    assert int(dg.unique_count) == count and dg.unique_count.dtype == torch.int32
    assert dg.num_unique == (edges if padded else count)
    assert torch.equal(g.unique_src[:count], ref["pair_src"]) and torch.equal(g.unique_etype[:count],
                                                                             ref["pair_etype"])
    if padded:
        assert bool((g.unique_src[count:] == 0).all() and (g.unique_etype[count:] == 0).all())
        assert torch.equal(dg._valid, torch.arange(edges) < count)
    inverse = g.edge_to_unique
    assert bool((inverse < count).all())
    assert torch.equal(g.unique_src[inverse], g.src) and torch.equal(g.unique_etype[inverse], g.etype)
    # the kernels' int32 indices
    for via, expect in (("src", g.src), ("dst", g.dst), ("unique", inverse), ("unique_src", g.unique_src)):
        got = dg.gather(via)
        assert got.dtype == torch.int32 and got.is_contiguous() and torch.equal(got.long(), expect), via
    assert torch.equal(dg.index(Domain.EDGE, ("etype",)).long(), g.etype)
    # per-relation counts and orders (edges; real pairs only)
    assert torch.equal(dg.type_counts(Domain.EDGE, ("etype",)), ref["edge_counts"])
    assert torch.equal(dg.perm(Domain.EDGE, ("etype",)).long(), ref["edge_perm"])
    assert torch.equal(dg.type_counts(Domain.UNIQUE, ("etype",)), ref["pair_counts"])
    assert torch.equal(dg.type_counts(Domain.UNIQUE, ()), torch.tensor([count]))


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("hint", [None, True, False])
def test_destination_sorted_edges_kept_or_sorted_by_relation_as_a_gpu_would(padded, hint):
    """Edges in destination order but not in relation order within a destination: a checked graph finds the
    order with its id check and keeps the edges as they are; a sync-free graph (which on a GPU cannot look
    without a wait) keeps them only on the promise, and otherwise sorts them by (destination, relation), stably,
    on the CPU too, so that the layout is the one a GPU builds from the same graph."""
    ei = torch.tensor([[4, 1, 2, 0, 3, 5, 2], [0, 0, 0, 1, 2, 2, 2]])
    et = torch.tensor([2, 0, 1, 1, 1, 0, 1])
    graph = Graph(ei, et, 6, 3, sync_free=padded, sorted_by_destination=hint)
    kept = hint is True or (hint is None and not padded)
    assert graph.dst_sorted == kept
    dg = DeviceGraph(graph)
    expected = [0, 1, 2, 3, 4, 5, 6] if kept else [1, 2, 0, 3, 5, 4, 6]
    assert (dg.order is None) == kept
    if not kept:
        assert dg.order.tolist() == expected
    assert dg.graph.src.tolist() == ei[0, expected].tolist() and dg.graph.etype.tolist() == et[expected].tolist()
    assert dg.graph.dst_etype_sorted == (not kept)


def test_node_type_layout_matches_a_plain_torch_reference():
    ei, et = _graph(300, 40, 5, 7)
    ntype = torch.arange(40) % 3
    dg = DeviceGraph(Graph(ei, et, 40, 5, ntype, 3))
    counts, perm = dg.type_counts(Domain.NODE, ("ntype",)), dg.perm(Domain.NODE, ("ntype",))
    assert torch.equal(counts, torch.bincount(ntype, minlength=3))
    assert perm.dtype == torch.int32 and torch.equal(perm.long(), torch.argsort(ntype, stable=True))
    by = ("src_ntype", "etype")
    types = ntype[dg.graph.src] * 5 + dg.graph.etype
    assert torch.equal(dg.type_counts(Domain.EDGE, by), torch.bincount(types, minlength=15))
    assert torch.equal(dg.perm(Domain.EDGE, by).long(), torch.argsort(types, stable=True))


@pytest.mark.parametrize("method", ["marks", "sort"])
@pytest.mark.parametrize("edges,nodes,relations,seed", CASES[1:] + [(3000, 30, 3, 11), (2000, 2000, 1, 12)])
def test_unique_pairs_by_marks_and_by_sort_match_torch_unique(edges, nodes, relations, seed, method):
    """Both ways to the unique (source, relation) pairs give torch.unique's sorted keys in the first rows, 0 in
    the padding rows, its inverse as each edge's pair row and its count; scripted or not. unique_pairs takes the
    marks where the key table is small against the edges, and its columns split the keys."""
    ei, et = _graph(edges, nodes, relations, seed)
    key = et * nodes + ei[0]
    uniq, expect_inverse = torch.unique(key, sorted=True, return_inverse=True)
    count = uniq.numel()
    fn = prep.pairs_by_marks if method == "marks" else prep.pairs_by_sort
    for f in (fn, prep.scripted(fn)):
        pairs, inverse, n = f(key, nodes * relations)
        assert n.tolist() == [count]
        assert torch.equal(pairs[:count], uniq) and bool((pairs[count:] == 0).all()) and pairs.numel() == edges
        assert torch.equal(inverse, expect_inverse)
    src, etype, inverse, n = prep.unique_pairs(ei[0], et, nodes, relations)
    assert prep.marks_pairs(nodes, relations, edges) == (nodes * relations <= max(4 * edges, 2**16))
    assert torch.equal(src[:count], uniq % nodes) and torch.equal(etype[:count], uniq // nodes)
    assert torch.equal(inverse, expect_inverse) and n.tolist() == [count]


@pytest.mark.parametrize("dst_sorted", [False, True])
@pytest.mark.parametrize("edges,nodes,relations,seed", CASES)
def test_degrees_and_compressed_offsets_match_bincount(edges, nodes, relations, seed, dst_sorted):
    """In-degrees (by binary search where the edges are in destination order) and the CSC / CSR offsets (from
    the sorted keys) and the relational mean's normaliser against bincount."""
    ei, et = _graph(edges, nodes, relations, seed, dst_sorted)
    graph = Graph(ei, et, nodes, relations)
    assert graph.dst_sorted == _in_order(ei)
    assert torch.equal(graph.in_degree(), torch.bincount(ei[1], minlength=nodes))
    for (perm, ptr), ids in ((graph.csc(), ei[1]), (graph.csr(), ei[0])):
        assert torch.equal(ptr, torch.cat([torch.zeros(1, dtype=torch.long),
                                           torch.cumsum(torch.bincount(ids, minlength=nodes), 0)]))
        assert torch.equal(perm, torch.argsort(ids, stable=True))
    pair = ei[1] * relations + et  # the relational mean's normaliser: edges per (destination, relation)
    expect = 1.0 / torch.bincount(pair, minlength=nodes * relations)[pair].double()
    assert torch.equal(graph.graph_const("inv_deg_dst_rel", torch.float64), expect)


def test_pairs_by_marks_of_ids_out_of_range_do_not_index_out_of_range():
    """An unchecked graph's pairs are made before its ids' range reaches the host: keys out of range (negative,
    or past the table) give some pairs, not an indexing error (on a GPU, a device-side assertion)."""
    key = torch.tensor([-3, 0, 5, 99, 5])
    pairs, inverse, count = prep.pairs_by_marks(key, 10)
    assert pairs.numel() == inverse.numel() == 5 and count.numel() == 1


@pytest.mark.parametrize("rows", [1000, 2**16])
@pytest.mark.parametrize("bound", [1, 100, 127, 128, 2**15 - 1, 2**15, 2**31, 2**40])
def test_sort_keys_in_the_narrowest_type_sorts_as_int64_does(rows, bound):
    """Keys sorted in a narrower type than given (int8, int16, int32 by their bound, the narrow ones only for many
    keys): the same stable order and the same key values as an int64 sort, scripted or not."""
    g = torch.Generator().manual_seed(bound % 1000 + rows)
    key = torch.randint(0, min(bound, 2**62), (rows,), generator=g) if bound > 1 else torch.zeros(rows,
                                                                                                  dtype=torch.long)
    expect = torch.sort(key, stable=True)
    for fn in (prep.sort_keys, prep.scripted(prep.sort_keys)):
        values, order = fn(key, bound)
        assert torch.equal(order, expect.indices) and torch.equal(values.long(), expect.values)
        narrow = bound <= 2**15 - 1 and rows >= 2**16
        assert values.element_size() == (1 if narrow and bound < 128 else 2 if narrow else 4 if bound < 2**31
                                         else 8)


@pytest.mark.parametrize("rows,types,seed", [(0, 3, 0), (1, 1, 1), (500, 1, 2), (500, 7, 3), (300, 1500, 4)])
def test_counts_from_the_sorted_types_match_bincount(rows, types, seed):
    """Per-type counts by binary search in the sorted types (no atomics), padding rows (typed ``types``) left out,
    with the stable type order from the same sort."""
    g = torch.Generator().manual_seed(seed)
    index = torch.randint(0, types + 1, (rows,), generator=g)
    expect = torch.bincount(index, minlength=types + 1)[:types]
    assert torch.equal(prep.sorted_counts(torch.sort(index).values, types), expect)
    for fn in (prep.type_layout, prep.scripted(prep.type_layout)):
        counts, order = fn(index, types)
        assert torch.equal(counts, expect)
        assert order.dtype == torch.int32 and torch.equal(order.long(), torch.argsort(index, stable=True))


@pytest.mark.parametrize("edges,nodes,relations,seed", CASES)
def test_scripted_functions_match_the_same_functions_run_as_python(edges, nodes, relations, seed):
    """TorchScript (which runs without the GIL) and the Python fallback give identical tensors."""
    assert isinstance(prep.scripted(prep.check_and_pair), torch.jit.ScriptFunction)
    ei, et = _graph(edges, nodes, relations, seed)
    nt = torch.arange(nodes) % 2
    for args in ((ei, et, None, nodes, relations, True, True), (ei, et, nt, nodes, relations, False, False)):
        for a, b in zip(prep.run(prep.check_and_pair, *args), prep.check_and_pair(*args), strict=True):
            assert torch.equal(a, b)
    graph = Graph(ei, et, nodes, relations)
    for exact in (False, True):
        args = (graph.src, graph.dst, graph.etype, graph.edge_to_unique if exact else None,
                graph.unique_src if exact else None, graph.unique_etype if exact else None, nodes, relations, False)
        for a, b in zip(prep.run(prep.destination_layout, *args), prep.destination_layout(*args), strict=True):
            assert (a is None and b is None) or torch.equal(a, b)


def test_bad_ids_are_named_after_the_scripted_check():
    from hector.errors import GraphInputError

    ei, et = _graph(50, 10, 3, 8)
    with pytest.raises(GraphInputError, match="edge_index holds node id 10, outside"):
        Graph(torch.cat([ei, torch.tensor([[10], [0]])], 1), torch.cat([et, torch.zeros(1, dtype=torch.long)]), 10,
              3)
    with pytest.raises(GraphInputError, match="edge_type holds relation id -1"):
        Graph(ei, torch.where(et == 0, -1, et), 10, 3)
    with pytest.raises(GraphInputError, match="node_type holds node type id 2"):
        Graph(ei, et, 10, 3, torch.arange(10) % 3, 2)


def test_without_torchscript_the_same_functions_run_as_python(monkeypatch, caplog):
    """Where TorchScript cannot compile a function, it runs as Python (holding the GIL for each operation), with a
    warning that says so, and the graph and its layout come out the same."""
    ei, et = _graph(500, 120, 7, 9)
    scripted = DeviceGraph(Graph(ei, et, 120, 7))

    def fail(fn):
        raise RuntimeError("no TorchScript here")

    monkeypatch.setattr(prep, "_compiled", {})
    monkeypatch.setattr(torch.jit, "script", fail)
    with caplog.at_level("WARNING", logger="hector"):
        plain = DeviceGraph(Graph(ei, et, 120, 7))
    assert "did not compile" in caplog.text and "runs as Python" in caplog.text
    assert prep.scripted(prep.check_and_pair) is prep.check_and_pair
    assert torch.equal(plain.graph.src, scripted.graph.src) and torch.equal(plain.csc_ptr, scripted.csc_ptr)
    assert torch.equal(plain.dst_order, scripted.dst_order)
    assert torch.equal(plain.graph.edge_to_unique, scripted.graph.edge_to_unique)
    assert torch.equal(plain.perm(Domain.EDGE, ("etype",)), scripted.perm(Domain.EDGE, ("etype",)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device available")
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("dst_sorted", [False, True])
@pytest.mark.parametrize("edges,nodes", [(5000, 700), (70_000, 3000), (70_000, 20_000)])
def test_device_layout_on_a_gpu_matches_the_cpu_and_waits_for_nothing(padded, dst_sorted, edges, nodes):
    """The scripted layout on a GPU: the same tensors as on the CPU, built without a host synchronisation (the
    graph's one read, the id check with the pair count, comes before). The pairs by marks (the first two sizes)
    and by sort (the third); 70,000 edges sort their relations as int8 (prep.sort_keys)."""
    ei, et = _graph(edges, nodes, 30, 10, dst_sorted)
    cpu = DeviceGraph(Graph(ei, et, nodes, 30, sync_free=padded))
    graph = Graph(ei.cuda(), et.cuda(), nodes, 30, sync_free=padded)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gpu = DeviceGraph(graph)
        perm, counts = gpu.perm(Domain.EDGE, ("etype",)), gpu.type_counts(Domain.EDGE, ("etype",))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert gpu.padded == cpu.padded == padded
    assert (gpu.order is None) == (cpu.order is None)
    if gpu.order is not None:
        assert torch.equal(gpu.order.cpu(), cpu.order)
    for a, b in ((gpu.graph.src, cpu.graph.src), (gpu.graph.dst, cpu.graph.dst), (gpu.csc_ptr, cpu.csc_ptr),
                 (gpu.dst_order, cpu.dst_order), (gpu.graph.edge_to_unique, cpu.graph.edge_to_unique),
                 (gpu.graph.unique_src, cpu.graph.unique_src), (gpu.gather("unique_src"), cpu.gather("unique_src")),
                 (gpu.unique_count, cpu.unique_count), (perm, cpu.perm(Domain.EDGE, ("etype",))),
                 (counts, cpu.type_counts(Domain.EDGE, ("etype",))),
                 (gpu.type_counts(Domain.UNIQUE, ("etype",)), cpu.type_counts(Domain.UNIQUE, ("etype",))),
                 (gpu.graph.in_degree(), cpu.graph.in_degree()),
                 (gpu.graph.graph_const("inv_deg_dst_rel", torch.float32),
                  cpu.graph.graph_const("inv_deg_dst_rel", torch.float32))):
        assert torch.equal(a.cpu(), b)
