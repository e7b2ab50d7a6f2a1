"""pytorch_direct.sampling: the neighbour sampler against the graph (every sampled edge exists, exact per-node counts
per hop and edge type, no edge twice, uniform frequencies, the id map reset) and the loader against PyG (the same
batches as PyG's own NodeLoader assembles from the same samples; its input forms and errors)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import torch

import pytorch_direct as pd
from pytorch_direct.sampling import NeighborLoader, NeighborSampler, Topology

CPU = torch.device("cpu")


def pyg():
    """torch_geometric and pytorch_direct.pyg, imported when a test needs them (not at collection: importing
    torch_geometric early changes how another file's torch.compile tests trace index_select)."""
    pytest.importorskip("torch_geometric")
    import torch_geometric.data
    import torch_geometric.loader

    import pytorch_direct.pyg

    class Names:
        Data, HeteroData = torch_geometric.data.Data, torch_geometric.data.HeteroData
        NodeLoader = torch_geometric.loader.NodeLoader
        NodeSampler = pytorch_direct.pyg.NodeSampler
        UnifiedFeatureStore = pytorch_direct.pyg.UnifiedFeatureStore
        make_graph_store = staticmethod(pytorch_direct.pyg.make_graph_store)

    return Names


def csc_from_edges(src, dst, num_nodes, num_relations=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    etype = torch.randint(num_relations, (src.numel(),), generator=gen)
    dst_sorted, order = torch.sort(dst, stable=True)
    colptr = torch.zeros(num_nodes + 1, dtype=torch.long)
    colptr[1:] = torch.cumsum(torch.bincount(dst_sorted, minlength=num_nodes), 0)
    return Topology(colptr, src[order].to(torch.int32), edge_type=etype[order].to(torch.int32))


def skewed_edges(num_nodes=300, seed=0, e=4000):
    """A hub with most in-edges, nodes without any, duplicate (multi-)edges and self-loops."""
    gen = torch.Generator().manual_seed(seed)
    dst = (torch.rand(e, generator=gen).pow(3) * num_nodes).long()
    dst[dst % 7 == 3] = 0  # nodes 3, 10, 17, ... never receive edges; node 0 is a hub
    src = torch.randint(num_nodes, (e,), generator=gen)
    src[:50] = dst[:50]  # self-loops
    src[50:100] = src[100:150]
    dst[50:100] = dst[100:150]  # duplicated edges
    return src, dst


def skewed_graph(num_nodes=300, seed=0):
    return csc_from_edges(*skewed_edges(num_nodes, seed), num_nodes, seed=seed)


def check_subgraph(sub, seeds, topo, fanout, replace=False):
    colptr, row = topo.colptr.cpu(), topo.row.cpu()
    sub = sub.to("cpu")
    seeds = seeds.cpu()
    n_id, (src_l, dst_l) = sub.n_id, sub.edge_index
    assert torch.equal(n_id[: sub.batch_size], seeds)
    repeats = seeds.numel() - seeds.unique().numel()
    assert n_id.unique().numel() == n_id.numel() - repeats, "every node appears once (a repeated seed per occurrence)"
    later = torch.tensor([v in seeds[:i].tolist() for i, v in enumerate(seeds.tolist())], dtype=torch.bool)
    assert not bool(torch.isin(src_l, later.nonzero().flatten()).any()), \
        "an edge from a repeated seed points at its first occurrence"
    assert sub.num_sampled_nodes[0] == sub.batch_size and sum(sub.num_sampled_nodes) == n_id.numel()
    assert len(sub.num_sampled_edges) == len(fanout) and sum(sub.num_sampled_edges) == sub.num_edges
    e_dst = torch.searchsorted(colptr, sub.e_id, right=True) - 1
    assert torch.equal(n_id[src_l], row[sub.e_id].long())
    assert torch.equal(n_id[dst_l], e_dst)
    if topo.edge_type is not None:
        assert torch.equal(sub.edge_type, topo.edge_type.cpu()[sub.e_id].long())
    node_lo, edge_lo = 0, 0
    for hop, k in enumerate(fanout):
        n_nodes, n_edges = sub.num_sampled_nodes[hop], sub.num_sampled_edges[hop]
        frontier = n_id[node_lo: node_lo + n_nodes]
        eids, dsts = sub.e_id[edge_lo: edge_lo + n_edges], dst_l[edge_lo: edge_lo + n_edges]
        assert bool(((dsts >= node_lo) & (dsts < node_lo + n_nodes)).all())
        degree = colptr[frontier + 1] - colptr[frontier]
        if k < 0:
            expected = degree
        elif replace:
            expected = torch.where(degree > 0, k, 0)
        else:
            expected = degree.clamp(max=k)
        assert torch.equal(torch.bincount(dsts - node_lo, minlength=n_nodes), expected)
        if not replace:
            # (an edge's destination is one node, so per destination slot: a repeated seed's occurrences draw apart)
            assert torch.stack([dsts, eids]).unique(dim=1).size(1) == eids.numel(), "no edge drawn twice"
        new = n_id[node_lo + n_nodes: node_lo + n_nodes + sub.num_sampled_nodes[hop + 1]]
        assert torch.equal(new, new.sort().values), "new nodes of a hop are numbered in ascending id"
        node_lo, edge_lo = node_lo + n_nodes, edge_lo + n_edges


# ---- the sampler -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fanout", [[4, 3], [1], [-1, 2], [50, 50, 50]])
@pytest.mark.parametrize("replace", [False, True])
def test_sampled_subgraph_is_valid(fanout, replace):
    topo = skewed_graph()
    sampler = NeighborSampler(topo, fanout, replace=replace, generator=torch.Generator().manual_seed(1))
    for seeds in (torch.tensor([0, 5, 3, 299]), torch.randperm(300)[:64], torch.tensor([3]), REPEATED):
        check_subgraph(sampler.sample(seeds), seeds, topo, fanout, replace)


# repeated seeds (the hub 0, a node without in-edges, 3, and others), as over-sampling a class gives them
REPEATED = torch.tensor([5, 0, 5, 3, 0, 0, 8, 3, 5])


def test_map_is_reset_between_batches():
    sampler = NeighborSampler(skewed_graph(), [5, 5])
    sampler.sample(torch.arange(40))
    assert bool((sampler._local == -1).all())
    sampler.sample(torch.tensor([1, 2, 1]))
    assert bool((sampler._local == -1).all())


@pytest.mark.parametrize("script", [True, False])
def test_repeated_seeds_are_a_seed_per_occurrence(script):
    # PyG's samplers (pyg-lib, torch-sparse) take seeds as given: n_id starts with them, repeats included, and
    # every place draws its own in-edges. This sampler refused repeated seeds ("must be distinct").
    topo = skewed_graph()
    sampler = NeighborSampler(topo, [3, 2], generator=torch.Generator().manual_seed(3), script=script)
    seeds = torch.tensor([0] * 12 + [7, 7, 3])  # (the hub 0; node 3 has no in-edges)
    sub = sampler.sample(seeds)
    assert sub.batch_size == 15 and sub.num_sampled_nodes[0] == 15
    check_subgraph(sub, seeds, topo, [3, 2])  # (seeds first, as given; edges from a repeat at its first place)
    first_hop = slice(0, sub.num_sampled_edges[0])
    per_place = torch.bincount(sub.edge_index[1, first_hop], minlength=15)
    assert per_place.tolist() == [3] * 14 + [0], "every occurrence draws in-edges of its own"
    # the hub's 12 occurrences drew apart (3 of its many in-edges each), not one draw copied 12 times
    dst, e_id = sub.edge_index[1, first_hop], sub.e_id[first_hop]
    assert len({tuple(sorted(e_id[dst == place].tolist())) for place in range(12)}) > 1
    assert bool((sampler._local == -1).all())


def _sample_ops(sampler, seeds):
    """(operations dispatched that make a tensor: views left out, host round trips: size reads and the operations
    that read a size on a GPU). The round trips are counted on the Python path (``script=False``): the
    TorchScript interpreter reads sizes without dispatching an operation."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = reads = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += not func.is_view
            self.reads += func.overloadpacket in (torch.ops.aten._unique2, torch.ops.aten.unique_dim,
                                                  torch.ops.aten._local_scalar_dense, torch.ops.aten.nonzero)
            return func(*args, **(kwargs or {}))

    tolist = torch.Tensor.tolist
    lists = []
    script = sampler.script
    try:
        with Count() as count:
            sampler.sample(seeds, check=False)
        torch.Tensor.tolist = lambda t: lists.append(1) or tolist(t)
        sampler.script = False
        with Count() as python:
            sampler.sample(seeds, check=False)
    finally:
        torch.Tensor.tolist = tolist
        sampler.script = script
    return count.ops, python.reads + len(lists)


def test_per_batch_host_work_is_a_few_operations_per_hop():
    # a loader thread's host work competes with the training thread's for the GIL, and its host round trips wait
    # for a GPU busy with training: the sampler makes a batch in a fixed, small number of operations (no per-node or
    # per-edge Python work) and one host round trip per hop plus one (a hop's new nodes are counted on the device)
    topo = csc_from_edges(*skewed_edges(num_nodes=3000, e=60_000), 3000)
    sampler = NeighborSampler(topo, [15, 10], generator=torch.Generator().manual_seed(0))
    assert sampler.script
    small, large = _sample_ops(sampler, torch.arange(16)), _sample_ops(sampler, torch.arange(0, 3000, 3))
    assert small == large, (small, large)
    assert small[0] <= 95 and small[1] <= 2 + 1, small
    three = NeighborSampler(topo, [15, 10, 5], generator=torch.Generator().manual_seed(0))
    ops, reads = _sample_ops(three, torch.arange(16))
    assert ops - small[0] <= 40 and reads == 3 + 1, (ops, reads)


@pytest.mark.parametrize("replace", [False, True])
def test_the_torchscript_path_gives_the_python_paths_batches(replace):
    topo = skewed_graph(seed=3)
    topo.node_type = torch.arange(300) % 3
    batches = []
    for script in (True, False):
        sampler = NeighborSampler(topo, [6, -1, 3], replace=replace, generator=torch.Generator().manual_seed(5),
                                  script=script)
        assert sampler.script is script, "TorchScript compiles the sampler here"
        batches.append([sampler.sample(seeds) for seeds in (torch.arange(0, 300, 7), torch.tensor([3]))])
    for a, b in zip(*batches, strict=True):
        for x, y in zip(a.tensors(), b.tensors(), strict=True):
            assert torch.equal(x, y)
        assert (a.num_sampled_nodes, a.num_sampled_edges) == (b.num_sampled_nodes, b.num_sampled_edges)


def test_a_torch_without_torchscript_samples_through_python(monkeypatch, caplog):
    from pytorch_direct import _sample_script

    def no_script(fn):
        raise RuntimeError("TorchScript is not available")

    monkeypatch.setattr(torch.jit, "script", no_script)
    monkeypatch.setattr(_sample_script, "_compiled", {})
    with caplog.at_level("WARNING", logger="pytorch_direct"):
        sampler = NeighborSampler(skewed_graph(), [4, 3])
    assert not sampler.script
    assert "did not compile" in caplog.text and "TorchScript is not available" in caplog.text
    seeds = torch.arange(0, 300, 9)
    check_subgraph(sampler.sample(seeds), seeds, skewed_graph(), [4, 3])


def test_sampling_leaves_the_gil_to_other_threads():
    # a loader thread samples while the training thread runs Python: the TorchScript path releases the GIL for the
    # whole batch (host round trips included), so another thread runs meanwhile. Without a release it could not
    # before the switch interval (longer than the call here): so for pure Python work of the same length.
    import sys

    topo = csc_from_edges(*skewed_edges(num_nodes=20_000, e=400_000), 20_000)
    sampler = NeighborSampler(topo, [15, 10])
    assert sampler.script
    sampler.sample(torch.arange(500))

    def python_work():
        end = time.perf_counter() + 0.05
        while time.perf_counter() < end:
            pass

    ran = {}
    for name, work in (("sampler", lambda: sampler.sample(torch.arange(500))), ("python", python_work)):
        go, stop, count = threading.Event(), threading.Event(), [0]

        def spin(go=go, stop=stop, count=count):
            go.wait()
            while not stop.is_set():
                count[0] += 1

        thread = threading.Thread(target=spin)
        thread.start()
        before = sys.getswitchinterval()
        sys.setswitchinterval(1.0)
        try:
            go.set()
            work()
            ran[name] = count[0]
        finally:
            stop.set()
            sys.setswitchinterval(before)
            thread.join()
    assert ran["sampler"] > 0 and ran["python"] == 0, ran


@pytest.mark.parametrize("replace", [False, True])
def test_sampling_is_uniform(replace):
    # one destination with 10 in-edges, 3 drawn: each edge drawn with probability 0.3 (without replacement) or
    # 3 / 10 times on average (with), never twice without replacement
    topo = csc_from_edges(torch.arange(1, 11), torch.zeros(10, dtype=torch.long), 11)
    sampler = NeighborSampler(topo, [3], replace=replace, generator=torch.Generator().manual_seed(0))
    counts = torch.zeros(10)
    trials, twice = 4000, 0
    for _ in range(trials):
        sub = sampler.sample(torch.tensor([0]))
        assert sub.e_id.numel() == 3
        twice += sub.e_id.unique().numel() < 3
        counts.index_add_(0, sub.e_id, torch.ones(3))
    assert bool(((counts / trials - 0.3).abs() < 0.04).all()), counts / trials  # > 5 standard deviations
    if replace:
        assert 0.2 < twice / trials < 0.36  # P(some edge twice) = 1 - 0.9 * 0.8 = 0.28
    else:
        assert twice == 0


@pytest.mark.parametrize("replace", [False, True])
def test_typed_sampling_is_uniform_per_edge_type(replace):
    # node 0 of type "p" has 6 in-edges of one edge type (fan-out 2) and 4 of another (fan-out 3, given between
    # them in the edge list): each edge drawn with probability 2/6 and 3/4 (or as often on average, with
    # replacement), each type's own fan-out, never an edge twice without replacement
    from pytorch_direct import _topology

    h = pyg().HeteroData()
    h["p"].num_nodes, h["q"].num_nodes = 1, 10
    h["q", "x", "p"].edge_index = torch.stack([torch.arange(6), torch.zeros(6, dtype=torch.long)])
    h["q", "y", "p"].edge_index = torch.stack([torch.arange(6, 10), torch.zeros(4, dtype=torch.long)])
    source = _topology.source_of(h)
    fanouts = _topology.fanouts(source, {("q", "x", "p"): [2], ("q", "y", "p"): [3]})
    sampler = NeighborSampler(source.topology, fanouts, replace=replace, blocks=source.blocks,
                              generator=torch.Generator().manual_seed(0))
    assert sampler.script
    counts = {0: torch.zeros(6), 1: torch.zeros(4)}
    trials = 3000
    for _ in range(trials):
        sub = sampler.sample(torch.tensor([source.node_offset("p")]))
        for k, fan in ((0, 2), (1, 3)):
            ids = sub.e_id[sub.edge_type == k]
            assert ids.numel() == fan and (replace or ids.unique().numel() == fan)
            counts[k].index_add_(0, ids, torch.ones(fan))
    assert bool(((counts[0] / trials - 2 / 6).abs() < 0.05).all()), counts[0] / trials
    assert bool(((counts[1] / trials - 3 / 4).abs() < 0.05).all()), counts[1] / trials


def test_bad_input_is_named():
    topo = skewed_graph()
    with pytest.raises(ValueError, match="num_neighbors must list a fan-out per hop"):
        NeighborSampler(topo, 5)
    with pytest.raises(ValueError, match="one entry per edge"):
        Topology(topo.colptr, topo.row, edge_type=topo.edge_type[:-1])
    with pytest.raises(TypeError, match="integers"):
        Topology(topo.colptr.double(), topo.row)
    sampler = NeighborSampler(topo, [2])
    with pytest.raises(IndexError, match=r"\[0, 300\)"):
        sampler.sample(torch.tensor([0, 300]))
    with pytest.raises(ValueError, match="non-empty"):
        sampler.sample(torch.tensor([], dtype=torch.long))


def test_seeds_that_are_not_integer_ids_are_refused():
    # float seeds were truncated to ids (1.5 sampled node 1) and a boolean mask was read as the ids 0 and 1
    sampler = NeighborSampler(skewed_graph(), [2])
    for seeds in (torch.tensor([1.5, 4.0]), torch.tensor([True, False, True]), torch.tensor([2.0 + 0j])):
        with pytest.raises(TypeError, match=f"seeds must be a tensor of integer node ids, got {seeds.dtype}"):
            sampler.sample(seeds)
    with pytest.raises(TypeError, match="got list"):
        sampler.sample([1, 2])
    for dtype in (torch.int32, torch.int16, torch.uint8):
        assert torch.equal(sampler.sample(torch.tensor([4, 1], dtype=dtype)).n_id[:2], torch.tensor([4, 1]))


@pytest.mark.parametrize("where", ["plain", "host"])
def test_a_broken_csc_is_named_before_sampling(where):
    # the torch path indexes with colptr and row unchecked: a source past the last node silently became an edge to
    # no node, and a decreasing colptr (a negative in-degree) failed inside TorchScript or aborted the process
    topo = skewed_graph()

    def sampler(colptr, row):
        t = Topology(colptr, row)
        return NeighborSampler(t if where == "plain" else t.placed("host", CPU), [-1])

    row = topo.row.clone()
    row[int(topo.colptr[5])] = 300  # node 5's first in-edge comes from no node
    with pytest.raises(IndexError, match=r"topology.row holds source ids outside \[0, 300\) \(got \[0, 300\]\)"):
        sampler(topo.colptr, row)
    for last in (topo.num_edges + 7, topo.num_edges - 7):
        colptr = topo.colptr.clone()
        colptr[-1] = last
        with pytest.raises(ValueError, match=f"end at the number of edges .*colptr\\[-1\\] = {last}"):
            sampler(colptr, topo.row)
    colptr = topo.colptr.clone()
    colptr[9] = colptr[11] + 1
    with pytest.raises(ValueError, match="colptr decreases at destination 9"):
        sampler(colptr, topo.row)
    seeds = torch.arange(0, 300, 7)
    check_subgraph(sampler(topo.colptr, topo.row).sample(seeds), seeds, Topology(topo.colptr, topo.row), [-1])


def test_topology_in_unified_host_memory_gives_the_same_batches():
    assert not NeighborSampler(skewed_graph().placed("host", CPU), [2]).script  # (its reads dispatch in Python)
    topo = skewed_graph(seed=3)
    seeds = torch.randperm(300, generator=torch.Generator().manual_seed(0))[:32]
    plain = NeighborSampler(topo, [6, 4], generator=torch.Generator().manual_seed(5)).sample(seeds)
    host = NeighborSampler(topo.placed("host", CPU), [6, 4], generator=torch.Generator().manual_seed(5)).sample(seeds)
    for name in ("n_id", "edge_index", "edge_type", "e_id"):
        assert torch.equal(getattr(plain, name), getattr(host, name)), name


def test_a_topology_on_another_device_is_named():
    topo = skewed_graph()
    with pytest.raises(ValueError, match="placed"):
        NeighborSampler(topo, [2], device="cuda")


# ---- the loader against PyG ------------------------------------------------------------------------------------

@pytest.mark.parametrize("fanout", [[3, 0], [0, 3], [0], [2, 0, 4], [-1, 0]])
@pytest.mark.parametrize("replace", [False, True])
@pytest.mark.parametrize("script", [True, False])
def test_a_zero_fanout_hop_samples_no_edges_as_in_pyg(fanout, replace, script):
    # pyg-lib's neighbour sampler returns at once for a count of 0 (neighbor_kernel.cpp, uniform_sample: "if
    # ((row_end - row_start == 0) || (count == 0)) return;"), so the hop draws no edge and adds no node, and every
    # later hop has an empty frontier. This sampler refused a 0 fan-out ("must list a positive fan-out").
    topo = skewed_graph()
    gen = torch.Generator().manual_seed(1)
    sampler = NeighborSampler(topo, fanout, replace=replace, script=script, generator=gen)
    for seeds in (torch.tensor([0, 5, 3, 299]), torch.randperm(300)[:64], REPEATED):
        state = gen.get_state()
        sub = sampler.sample(seeds)
        if fanout[0] == 0:  # (a hop that takes no edge draws no random keys for its frontier's in-edges)
            assert torch.equal(gen.get_state(), state)
        check_subgraph(sub, seeds, topo, fanout, replace)
        zero = fanout.index(0)
        assert sub.num_sampled_edges[zero:] == [0] * (len(fanout) - zero)
        assert sub.num_sampled_nodes[zero + 1:] == [0] * (len(fanout) - zero)
        assert bool((sampler._local == -1).all())
    if fanout[0] == 0:
        assert sub.num_edges == 0 and torch.equal(sub.n_id, REPEATED)


@pytest.mark.parametrize("replace", [False, True])
@pytest.mark.parametrize("script", [True, False])
def test_a_typed_hop_that_samples_nothing_draws_no_random_numbers(replace, script):
    # The typed torch path drew a random key per in-edge of a hop's frontier even where every fan-out was 0, so the
    # random stream of the batches after depended on a hop that samples nothing: [[...], [0, 0, 0]] gave other
    # batches than [[...]] from the second batch on. (The homogeneous path draws nothing there.)
    from test_sample_kernels import check_typed, typed_graph

    topo, blocks = typed_graph()
    first = [2, 1, 3]
    for tail in ([[0, 0, 0]], [[0, 0, 0], [0, 0, 0]], [[-1, -1, -1]] if replace else [[999, 999, 999]]):
        table = [first] + tail
        gens = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
        ours = NeighborSampler(topo, table, replace=replace, script=script, blocks=blocks, generator=gens[0])
        alone = NeighborSampler(topo, [first], replace=replace, script=script, blocks=blocks, generator=gens[1])
        for seeds in (torch.tensor([0, 5, 3, 199]), REPEATED, torch.arange(0, 200, 7), torch.tensor([4])):
            sub, ref = ours.sample(seeds), alone.sample(seeds)
            check_typed(sub, seeds, topo, table, replace)
            assert torch.equal(gens[0].get_state(), gens[1].get_state()), tail
            if tail[0][0] == 0:  # the same batch, with a hop of nothing (or two) after
                assert sub.num_sampled_edges == ref.num_sampled_edges + [0] * len(tail)
                assert sub.num_sampled_nodes == ref.num_sampled_nodes + [0] * len(tail)
                for a, b in zip(sub.tensors(), ref.tensors(), strict=True):
                    assert torch.equal(a, b)
        gen = torch.Generator().manual_seed(5)
        state = gen.get_state()
        sub = NeighborSampler(topo, tail, replace=replace, script=script, blocks=blocks, generator=gen).sample(
            torch.arange(0, 200, 7))
        assert torch.equal(gen.get_state(), state), "a batch that draws from no run draws no random numbers"


@pytest.mark.parametrize("replace", [False, True])
@pytest.mark.parametrize("script", [True, False])
@pytest.mark.parametrize("typed", [False, True])
def test_any_negative_fanout_takes_every_neighbour_as_in_pyg(replace, script, typed):
    # pyg-lib takes a node's whole neighbourhood for any count < 0, with or without replacement (neighbor_kernel.cpp,
    # _sample: "if (count < 0 || (!replace && count >= population))"); this sampler refused every fan-out below -1
    # ("fan-outs must be >= 0, or -1 for all neighbours"). Now each is -1, the same batches as -1 gives.
    if typed:
        from test_sample_kernels import check_typed, typed_graph

        topo, blocks = typed_graph()
        forms = [([[-2, 3, -5], [1, -(2**40), 0]], [[-1, 3, -1], [1, -1, 0]]), ([-3, 2], [[-1] * 3, [2] * 3])]
    else:
        topo, blocks = skewed_graph(), None
        forms = [([-2, 3], [[-1], [3]]), ([2, -(2**40)], [[2], [-1]]), ([-7], [[-1]])]
    for given, normalised in forms:
        sampler = NeighborSampler(topo, given, replace=replace, script=script, blocks=blocks,
                                  generator=torch.Generator().manual_seed(3))
        assert sampler.fanouts == normalised
        minus_one = [row if typed else row[0] for row in normalised]
        reference = NeighborSampler(topo, minus_one, replace=replace, script=script, blocks=blocks,
                                    generator=torch.Generator().manual_seed(3))
        for seeds in (torch.tensor([0, 5, 3, 199]), REPEATED):
            sub, ref = sampler.sample(seeds), reference.sample(seeds)
            if typed:
                check_typed(sub, seeds, topo, normalised, replace)
            else:
                check_subgraph(sub, seeds, topo, minus_one, replace)
            assert sub.num_sampled_nodes == ref.num_sampled_nodes
            for a, b in zip(sub.tensors(), ref.tensors(), strict=True):
                assert torch.equal(a, b)


@pytest.mark.parametrize("script", [True, False])
@pytest.mark.parametrize("typed", [False, True])
def test_no_hops_is_a_batch_of_the_seeds_alone_as_in_pyg(script, typed):
    # pyg-lib samples len(num_neighbors) hops (neighbor_kernel.cpp: "for (size_t ell = 0; ell <
    # num_neighbors.size(); ++ell)"; L, the longest list, for a heterogeneous graph), after putting the seeds in the
    # batch: num_neighbors=[] gives the seeds alone, num_sampled_nodes [seeds], num_sampled_edges []. This sampler
    # refused [] ("must list a fan-out per hop"), and its torch path failed on it (torch.cat of no hops).
    if typed:
        from test_sample_kernels import typed_graph

        topo, blocks = typed_graph()
    else:
        base = skewed_graph()
        gen = torch.Generator().manual_seed(2)
        topo = Topology(base.colptr, base.row, edge_type=base.edge_type,
                        edge_id=torch.randperm(base.num_edges, generator=gen),
                        node_type=torch.randint(3, (300,), generator=gen).to(torch.int8))
        blocks = None
    sampler = NeighborSampler(topo, [], script=script, blocks=blocks)
    assert sampler.num_hops == 0
    for seeds in (torch.tensor([0, 5, 3, 199]), REPEATED):
        sub = sampler.sample(seeds)
        check_subgraph(sub, seeds, topo, [])
        assert torch.equal(sub.n_id, seeds) and sub.batch_size == seeds.numel()
        assert sub.num_sampled_nodes == [seeds.numel()] and sub.num_sampled_edges == []
        for name in ("e_id", "pos", "edge_type"):
            t = getattr(sub, name)
            assert t.shape == (0,) and t.dtype == torch.long, name
        assert sub.edge_index.shape == (2, 0) and sub.edge_index.dtype == torch.long
        if typed:
            assert torch.equal(sub.node_type, torch.zeros(seeds.numel(), dtype=torch.long))
        else:
            assert torch.equal(sub.node_type, topo.node_type[seeds].long())
    assert bool((sampler._local == -1).all())


def random_data(n=400, e=3000, seed=0):
    gen = torch.Generator().manual_seed(seed)
    src, dst = skewed_edges(n, seed, e)
    return pyg().Data(x=torch.randn(n, 7, generator=gen), y=torch.randint(0, 5, (n,), generator=gen),
                edge_index=torch.stack([src, dst]), edge_attr=torch.randn(e, 3, generator=gen),
                train_mask=torch.rand(n, generator=gen) < 0.3, name="toy")


def random_hetero(seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = pyg().HeteroData()
    sizes = {"paper": 300, "author": 200, "venue": 10}
    for t, n in sizes.items():
        h[t].x = torch.randn(n, 4 + len(t), generator=gen)
    h["paper"].y = torch.randint(0, 3, (300,), generator=gen)

    def edges(a, b, e):
        return torch.stack([torch.randint(0, sizes[a], (e,), generator=gen),
                            (torch.rand(e, generator=gen).pow(2) * sizes[b]).long()])

    h["author", "writes", "paper"].edge_index = edges("author", "paper", 1500)
    h["paper", "cites", "paper"].edge_index = edges("paper", "paper", 2000)
    h["paper", "in", "venue"].edge_index = edges("paper", "venue", 300)
    h["venue", "has", "paper"].edge_index = h["paper", "in", "venue"].edge_index.flip(0)
    h["paper", "written_by", "author"].edge_index = h["author", "writes", "paper"].edge_index.flip(0)
    h["author", "writes", "paper"].edge_weight = torch.rand(1500, generator=gen)
    return h


def assert_same_batch(ours, theirs):
    """Every attribute PyG's NodeLoader gives a batch, equal in ours (ours lie on the loader's device)."""
    stores = zip(ours.stores, theirs.stores, strict=True) if isinstance(ours, pyg().HeteroData) else \
        [(ours._store, theirs._store)]
    for mine, ref in stores:
        for key, value in ref.items():
            if value is None:
                continue
            assert key in mine, key
            got = mine[key]
            if isinstance(value, torch.Tensor):
                assert torch.equal(got.cpu(), value.cpu()), key
            else:
                assert got == value, key


def oversampled(data, gen_seed=0):
    """The training nodes with those of class 0 three times over (over-sampling a class): repeated input nodes."""
    train = data.train_mask.nonzero().flatten()
    rare = train[data.y[train] == 0]
    nodes = torch.cat([train, rare, rare])
    return nodes[torch.randperm(nodes.numel(), generator=torch.Generator().manual_seed(gen_seed))]


@pytest.mark.parametrize("inputs", ["all", "index", "mask", "repeated"])
def test_data_batches_equal_pygs_own_loader(inputs):
    data = random_data()
    input_nodes = {"all": None, "index": torch.randperm(400)[:150], "mask": data.train_mask,
                   "repeated": oversampled(data)}.get(inputs)
    ours = NeighborLoader(data, [5, 3], input_nodes=input_nodes, batch_size=40, seed=7)
    sampler = pyg().NodeSampler(data, [5, 3], seed=7)
    theirs = pyg().NodeLoader(data, node_sampler=sampler, input_nodes=input_nodes, batch_size=40)
    count = 0
    for a, b in zip(ours, theirs, strict=True):
        assert_same_batch(a, b)
        assert a.name == "toy" and a.batch_size == b.batch_size
        count += 1
    assert count == len(ours) == len(theirs)


def test_numpy_attributes_are_gathered_and_lists_refused_as_in_pyg():
    # PyG's loaders gather node and edge attributes held as numpy arrays (their rows arrive as tensors) and raise
    # for lists; here both reached every batch whole (all the graph's rows, whatever the batch's nodes)
    import numpy as np

    data = random_data()
    data.code = np.arange(400 * 2).reshape(400, 2)
    data.edge_code = np.arange(3000)
    theirs = pyg().NodeLoader(data, node_sampler=pyg().NodeSampler(data, [5, 3], seed=7), batch_size=40)
    for a, b in zip(NeighborLoader(data, [5, 3], batch_size=40, seed=7), theirs, strict=True):
        assert_same_batch(a, b)
        assert torch.equal(a.code, torch.from_numpy(data.code)[a.n_id]) and torch.equal(a.edge_code, a.e_id)
    hetero = random_hetero()
    hetero["author"].code = np.arange(200)
    batch = next(iter(NeighborLoader(hetero, [2], input_nodes="paper", batch_size=16)))
    assert torch.equal(batch["author"].code, batch["author"].n_id)
    data.names = [f"node {i}" for i in range(400)]
    with pytest.raises(TypeError, match="'names' is a list with one entry per node or edge"):
        NeighborLoader(data, [2])


def test_hetero_batches_equal_pygs_own_loader():
    data = random_hetero()
    fanouts = {et: [4, 2] for et in data.edge_types}
    fanouts["paper", "in", "venue"] = [0, 1]
    ours = NeighborLoader(data, fanouts, input_nodes=("paper", torch.arange(0, 300, 3)), batch_size=16, seed=2)
    theirs = pyg().NodeLoader(data, node_sampler=pyg().NodeSampler(data, fanouts, seed=2),
                        input_nodes=("paper", torch.arange(0, 300, 3)), batch_size=16)
    for a, b in zip(ours, theirs, strict=True):
        assert_same_batch(a, b)


@pytest.mark.parametrize("num_neighbors", [[10, 0], [0, 4], [0], []])
def test_zero_fanouts_and_no_hops_give_pygs_batches(num_neighbors):
    # PyG's NeighborLoader passes num_neighbors to its sampler unchecked (NumNeighbors keeps the list; pyg-lib
    # draws nothing for a count of 0 and samples len(num_neighbors) hops): a 0 fan-out is a hop without edges and
    # [] a batch of the seeds alone. Ours refused both; now its batches are those PyG's own NodeLoader assembles.
    data = random_data()
    ours = NeighborLoader(data, num_neighbors, input_nodes=data.train_mask, batch_size=40, seed=3)
    theirs = pyg().NodeLoader(data, node_sampler=pyg().NodeSampler(data, num_neighbors, seed=3),
                              input_nodes=data.train_mask, batch_size=40)
    for a, b in zip(ours, theirs, strict=True):
        assert_same_batch(a, b)
        assert len(a.num_sampled_edges) == len(num_neighbors) and len(a.num_sampled_nodes) == len(num_neighbors) + 1
        check_counts(a, data.edge_index, num_neighbors)
        if 0 in num_neighbors:
            zero = num_neighbors.index(0)
            assert a.num_sampled_edges[zero:] == [0] * (len(num_neighbors) - zero)
        if not num_neighbors or num_neighbors[0] == 0:
            assert a.edge_index.shape == (2, 0) and torch.equal(a.n_id, a.input_id)
            assert torch.equal(a.x, data.x[a.input_id]) and a.edge_attr.shape == (0, 3)


@pytest.mark.parametrize("form", ["types at 0", "a hop at 0", "[]", "{}"])
def test_hetero_zero_fanouts_and_no_hops_give_pygs_batches(form):
    # as for a Data: per edge type a 0 fan-out draws no edge of that type (pyg-lib's count == 0), a hop of zeros
    # draws none at all, and no hops ([] or empty lists for every type) is the seeds alone
    data = random_hetero()
    if form == "types at 0":
        fanouts = {et: [3, 2] for et in data.edge_types}
        fanouts["author", "writes", "paper"] = [0, 0]
        fanouts["paper", "cites", "paper"] = [4, 0]
    elif form == "a hop at 0":
        fanouts = {et: [3, 0] for et in data.edge_types}
    else:
        fanouts = [] if form == "[]" else {et: [] for et in data.edge_types}
    seeds = ("paper", torch.arange(0, 300, 3))
    ours = NeighborLoader(data, fanouts, input_nodes=seeds, batch_size=16, seed=2)
    theirs = pyg().NodeLoader(data, node_sampler=pyg().NodeSampler(data, fanouts, seed=2), input_nodes=seeds,
                              batch_size=16)
    hops = 2 if isinstance(fanouts, dict) and form != "{}" else 0
    for a, b in zip(ours, theirs, strict=True):
        assert_same_batch(a, b)
        for et in data.edge_types:
            sampled = a[et].num_sampled_edges
            assert len(sampled) == hops
            per_hop = fanouts[et] if hops else []
            assert all(n == 0 for n, k in zip(sampled, per_hop, strict=True) if k == 0), (et, sampled)
        if form == "a hop at 0":
            assert all(a[et].num_sampled_edges[1] == 0 for et in data.edge_types)
        if hops == 0:
            size = a["paper"].batch_size
            assert torch.equal(a["paper"].n_id, seeds[1][a["paper"].input_id])
            assert a["paper"].num_sampled_nodes == [size]
            assert all(a[t].n_id.numel() == 0 for t in ("author", "venue"))
            assert all(a[et].edge_index.shape == (2, 0) for et in data.edge_types)


def test_hetero_batches_after_a_hop_of_zero_fanouts_are_those_without_it():
    # PyG (pyg-lib) draws nothing for a count of 0; this loader's typed sampler drew a key per in-edge of such a
    # hop's frontier, so the batches after the first differed from those of the same loader without that hop
    check_a_hop_of_zero_fanouts_changes_no_batch("cpu")


def check_a_hop_of_zero_fanouts_changes_no_batch(device):
    data = random_hetero()
    seeds = ("paper", torch.arange(0, 300, 2))
    with_zeros = {et: [3, 0] if et[1] != "cites" else [2, 0] for et in data.edge_types}
    without = {et: v[:1] for et, v in with_zeros.items()}
    batches = 0
    for a, b in zip(NeighborLoader(data, with_zeros, input_nodes=seeds, batch_size=16, seed=2, device=device),
                    NeighborLoader(data, without, input_nodes=seeds, batch_size=16, seed=2, device=device),
                    strict=True):
        for t in data.node_types:
            assert a[t].num_sampled_nodes == b[t].num_sampled_nodes + [0]
            assert torch.equal(a[t].n_id, b[t].n_id) and torch.equal(a[t].x, b[t].x)
        for et in data.edge_types:
            assert a[et].num_sampled_edges == b[et].num_sampled_edges + [0]
            assert torch.equal(a[et].edge_index, b[et].edge_index) and torch.equal(a[et].e_id, b[et].e_id)
        batches += 1
    assert batches == 10


def test_repeated_input_nodes_are_a_seed_each_as_in_pyg():
    # PyG's NeighborLoader batches positions into input_nodes, repeats included, and its samplers keep every
    # occurrence as a seed: batch_size seeds per batch, n_id[:batch_size] = input_nodes[input_id], one output row
    # each. This loader refused them ("input nodes must be distinct").
    data = random_data()
    input_nodes = oversampled(data)
    assert input_nodes.unique().numel() < input_nodes.numel()
    for shuffle in (False, True):
        loader = NeighborLoader(data, [4, 2], input_nodes=input_nodes, batch_size=32, shuffle=shuffle, seed=1)
        seen = []
        for batch in loader:
            size = batch.batch_size
            assert size == batch.input_id.numel() and size in (32, input_nodes.numel() % 32)
            assert torch.equal(batch.n_id[:size], input_nodes[batch.input_id])
            assert torch.equal(batch.y[:size], data.y[input_nodes[batch.input_id]])
            assert torch.equal(batch.n_id[batch.edge_index], data.edge_index[:, batch.e_id])
            seen.append(batch.input_id)
        order = torch.cat(seen)
        assert len(loader) == len(seen) and order.numel() == input_nodes.numel()
        assert torch.equal(order.sort().values, torch.arange(input_nodes.numel()))
        if not shuffle:
            assert torch.equal(order, torch.arange(input_nodes.numel())), "batches in the order given"
    hetero = random_hetero()
    papers = torch.tensor([4, 9, 4, 4, 120, 9])
    fanouts = {et: [3, 2] for et in hetero.edge_types}
    ours = NeighborLoader(hetero, fanouts, input_nodes=("paper", papers), batch_size=4, seed=2)
    theirs = pyg().NodeLoader(hetero, node_sampler=pyg().NodeSampler(hetero, fanouts, seed=2),
                              input_nodes=("paper", papers), batch_size=4)
    for a, b in zip(ours, theirs, strict=True):
        assert_same_batch(a, b)
        size = a["paper"].batch_size
        assert torch.equal(a["paper"].n_id[:size], papers[a["paper"].input_id])


def input_node_forms(n):
    """input_nodes forms PyG's NeighborLoader takes for a node type of ``n`` nodes, as PyG's ``get_input_nodes``
    reads them (ids as given, a mask's True entries)."""
    mask = torch.zeros(n, dtype=torch.bool)
    mask[torch.randperm(n, generator=torch.Generator().manual_seed(3))[: n // 3]] = True
    ids = torch.randperm(n, generator=torch.Generator().manual_seed(4))[:50]
    return {"ids [k, 1]": ids.view(-1, 1), "int32 ids": ids.int(), "list": ids.tolist(), "tuple": tuple(ids.tolist()),
            "ndarray": ids.numpy(), "range": range(5, 60, 2), "empty list": [],
            "short mask": mask[: n // 2], "long mask": torch.cat([mask, torch.zeros(7, dtype=torch.bool)])}


@pytest.mark.parametrize("hetero", [False, True])
def test_input_nodes_in_every_form_pyg_takes_give_its_batches(hetero):
    # PyG reads ids of shape [k, 1] as the k ids and a mask of any length by its True entries (mask.nonzero()
    # .view(-1)); both were refused here ("must be a 1-D tensor", "must have one entry per node"), and so was an
    # empty list (torch reads [] as float)
    data = random_hetero() if hetero else random_data()
    num_neighbors = {et: [3, 2] for et in data.edge_types} if hetero else [3, 2]
    for name, form in input_node_forms(300 if hetero else 400).items():
        input_nodes = ("paper", form) if hetero else form
        ours = NeighborLoader(data, num_neighbors, input_nodes=input_nodes, batch_size=16, seed=5)
        theirs = pyg().NodeLoader(data, node_sampler=pyg().NodeSampler(data, num_neighbors, seed=5),
                                  input_nodes=input_nodes, batch_size=16)
        count = 0
        for a, b in zip(ours, theirs, strict=True):
            assert_same_batch(a, b)
            count += 1
        assert count == len(ours) == len(theirs), name


def test_input_nodes_pyg_misreads_are_refused_with_the_fix():
    # forms PyG takes but reads as something else than meant, or fails on later: a list or array of booleans
    # (PyG: ids 1 and 0), ids of shape [1, k] (PyG: one batch of batch_size 1 whose other seeds are never
    # expanded), a 0-d id, a mask of shape [n, 1], float ids, a mask selecting nodes past the graph
    import numpy as np

    data = random_data(n=100)
    mask = torch.rand(100, generator=torch.Generator().manual_seed(0)) < 0.5
    cases = [([True, False, True], "list of booleans.*torch.as_tensor"),
             (mask.numpy(), "ndarray of booleans.*torch.as_tensor"),
             (torch.tensor([[3, 1, 4]]), r"shape \[k\] \(or \[k, 1\]\).*got shape \(1, 3\)"),
             (torch.tensor(3), r"got shape \(\)"),
             (mask.view(-1, 1), r"mask must be 1-D.*mask.view\(-1\)"),
             (torch.tensor([3.0, 1.0]), r"integer node ids.*ids.long\(\)"),
             (torch.cat([mask, torch.tensor([False, True])]), "selects node 101, past the 100 nodes")]
    for input_nodes, message in cases:
        with pytest.raises(ValueError, match=message):
            NeighborLoader(data, [2], input_nodes=input_nodes)
    assert len(NeighborLoader(data, [2], input_nodes=np.array([3, 1]), batch_size=1)) == 2


def test_hetero_batches_follow_pyg_semantics():
    check_hetero_semantics("cpu")


def check_hetero_semantics(device):
    # per hop and edge type: the frontier nodes of the edge type's destination type draw min(in-degree, fanout)
    # distinct edges of that type each; seeds first; ids within each node type
    data = random_hetero(seed=1)
    fanouts = {et: [3, 2] for et in data.edge_types}
    fanouts["venue", "has", "paper"] = [-1, 0]
    loader = NeighborLoader(data, fanouts, input_nodes="paper", batch_size=24, shuffle=True, seed=5, device=device)
    seen = []
    for batch in loader:
        assert batch["paper"].n_id.device.type == torch.device(device).type
        batch = batch.to("cpu")
        seeds = batch["paper"].n_id[: batch["paper"].batch_size]
        seen.append(seeds)
        assert torch.equal(batch["paper"].input_id, seeds)
        for t in data.node_types:
            ids = batch[t].n_id
            assert ids.unique().numel() == ids.numel() and sum(batch[t].num_sampled_nodes) == ids.numel()
            assert torch.equal(batch[t].x, data[t].x[ids])
        frontier = {t: (0, batch[t].num_sampled_nodes[0]) for t in data.node_types}
        edge_lo = {et: 0 for et in data.edge_types}
        for hop in range(2):
            for et in data.edge_types:
                s, _, d = et
                k = fanouts[et][hop]
                n_edges = batch[et].num_sampled_edges[hop]
                ei = batch[et].edge_index[:, edge_lo[et]: edge_lo[et] + n_edges]
                eid = batch[et].e_id[edge_lo[et]: edge_lo[et] + n_edges]
                assert eid.unique().numel() == eid.numel()
                ref = data[et].edge_index
                assert torch.equal(batch[s].n_id[ei[0]], ref[0, eid]) and torch.equal(batch[d].n_id[ei[1]], ref[1, eid])
                lo, n = frontier[d]
                assert bool(((ei[1] >= lo) & (ei[1] < lo + n)).all())
                nodes = batch[d].n_id[lo: lo + n]
                degree = torch.bincount(ref[1], minlength=data[d].num_nodes)[nodes]
                expected = degree if k < 0 else degree.clamp(max=k)
                assert torch.equal(torch.bincount(ei[1] - lo, minlength=n), expected), (hop, et)
                edge_lo[et] += n_edges
            frontier = {t: (frontier[t][0] + frontier[t][1], batch[t].num_sampled_nodes[hop + 1])
                        for t in data.node_types}
        if "edge_weight" in data["author", "writes", "paper"]:
            et = ("author", "writes", "paper")
            assert torch.equal(batch[et].edge_weight, data[et].edge_weight[batch[et].e_id])
    every = torch.cat(seen)
    assert torch.equal(every.sort().values, torch.arange(300)), "each seed once per epoch"


def test_feature_and_graph_store_pair_without_input_nodes():
    # PyG's own NeighborLoader stops here with a bare AssertionError (and needs pyg-lib to sample)
    data = random_data(seed=2)
    fs = pyg().UnifiedFeatureStore()
    assert fs.device == (torch.device("cuda", torch.cuda.current_device()) if pd.cuda_usable() else CPU)
    fs.put_tensor(data.x, group_name=None, attr_name="x", index=None)
    fs.put_tensor(data.y, group_name=None, attr_name="y", index=None)
    gs = pyg().make_graph_store(data.edge_index, num_nodes=data.num_nodes)
    loader = NeighborLoader((fs, gs), [4, 4], batch_size=100, device="cpu")
    batches = list(loader)
    assert len(batches) == 4 and sum(b.batch_size for b in batches) == 400
    for b in batches:
        assert torch.equal(b.x, data.x[b.n_id]) and torch.equal(b.y, data.y[b.n_id])
        assert torch.equal(b.n_id[b.edge_index], data.edge_index[:, b.e_id])  # e_id: ids in the edge list
        check_counts(b, data.edge_index, [4, 4])


def check_counts(batch, edge_index, fanout):
    """Each hop's frontier nodes drew min(in-degree, fanout) distinct edges."""
    degree_of = torch.bincount(edge_index[1], minlength=int(edge_index.max()) + 1)
    node_lo, edge_lo = 0, 0
    for hop, k in enumerate(fanout):
        n, m = batch.num_sampled_nodes[hop], batch.num_sampled_edges[hop]
        dst = batch.edge_index[1, edge_lo: edge_lo + m] - node_lo
        degree = degree_of[batch.n_id[node_lo: node_lo + n]]
        assert torch.equal(torch.bincount(dst, minlength=n), degree.clamp(max=k))
        assert batch.e_id[edge_lo: edge_lo + m].unique().numel() == m
        node_lo, edge_lo = node_lo + n, edge_lo + m


def test_hetero_store_pair():
    from torch_geometric.distributed import LocalGraphStore

    data = random_hetero(seed=4)
    fs = pyg().UnifiedFeatureStore(device="cpu")
    for t in data.node_types:
        fs.put_tensor(data[t].x, group_name=t, attr_name="x", index=None)
    gs = LocalGraphStore.from_hetero_data({et: torch.arange(data[et].num_edges) for et in data.edge_types},
                                          dict(data.edge_index_dict), {t: data[t].num_nodes for t in data.node_types})
    loader = NeighborLoader((fs, gs), [3, 2], input_nodes="author", batch_size=50)
    n = 0
    for b in loader:
        n += b["author"].batch_size
        for t in data.node_types:
            assert torch.equal(b[t].x, data[t].x[b[t].n_id])
        for et in data.edge_types:
            ei = b[et].edge_index
            assert torch.equal(b[et[0]].n_id[ei[0]], data[et].edge_index[0, b[et].e_id])
    assert n == 200


def test_topology_pair_carries_edge_and_node_types():
    topo = skewed_graph(seed=5)
    topo.node_type = torch.arange(300) % 4
    x, y = torch.randn(300, 5), torch.randint(0, 3, (300,))
    loader = NeighborLoader(({"x": x, "y": y}, topo), [5, 5], input_nodes=torch.arange(64), batch_size=16)
    for b in loader:
        assert torch.equal(b.x, x[b.n_id]) and torch.equal(b.y, y[b.n_id])
        assert torch.equal(b.edge_type, topo.edge_type[b.e_id].long())
        assert torch.equal(b.node_type, topo.node_type[b.n_id])
        assert b.num_nodes == b.n_id.numel()
    with pytest.raises(ValueError, match="one row per node"):
        NeighborLoader(({"x": x[:10]}, topo), [2])


@pytest.mark.parametrize("thread", [False, True])
def test_prepare_sees_the_sampled_graph_and_sets_attributes(thread):
    topo = skewed_graph(seed=4)
    x = torch.randn(300, 5)
    seen = []

    def prepare(sub):
        seen.append(sub.num_nodes)
        return {"degree_sum": int(sub.edge_index[1].bincount(minlength=sub.num_nodes).sum()), "n": sub.num_nodes}

    loader = NeighborLoader(({"x": x}, topo), [4, 2], input_nodes=torch.arange(48), batch_size=16, prepare=prepare,
                            prefetch=1 if thread else 0, thread=thread)
    batches = list(loader)
    assert [b.n for b in batches] == seen == [b.num_nodes for b in batches]
    assert all(b.degree_sum == b.num_edges and torch.equal(b.x, x[b.n_id]) for b in batches)
    with pytest.raises(TypeError, match="must return a dict"):
        list(NeighborLoader(({"x": x}, topo), [2], input_nodes=torch.arange(8), batch_size=4,
                            prepare=lambda sub: sub.num_nodes))


def test_prepare_when_ahead_runs_only_while_the_loader_is_ahead_of_training():
    data = random_data(seed=7)
    marked = []

    def when_ahead(batch):
        batch.ahead = True
        marked.append(batch.n_id[0].item())

    # training slower than the loader: from the third batch on, the one before still waits in the queue
    loader = NeighborLoader(data, [4, 2], batch_size=40, prefetch=1, thread=True, prepare_when_ahead=when_ahead)
    slow = []
    for batch in loader:
        slow.append(getattr(batch, "ahead", False))
        time.sleep(0.1)
    assert len(slow) == 10 and all(slow[2:]) and not slow[0]
    assert loader.stats()["ahead_batches"] == sum(slow) == len(marked)

    # the loader slower than training (which takes each batch at once): never ahead, never called
    marked.clear()
    loader = NeighborLoader(data, [4, 2], batch_size=40, prefetch=1, thread=True, prepare_when_ahead=when_ahead,
                            prepare=lambda sub: (time.sleep(0.05), {})[1])
    assert not any(getattr(b, "ahead", False) for b in loader) and not marked
    assert loader.stats()["ahead_batches"] == 0
    # without a loader thread there is no "ahead": never called, and the loader says so
    with pytest.warns(UserWarning, match="prepare_when_ahead=.... is never called without a loader thread"):
        unused = NeighborLoader(data, [4, 2], batch_size=40, prefetch=0, prepare_when_ahead=when_ahead)
    list(unused)
    assert not marked


@pytest.mark.filterwarnings("ignore:NeighborLoader")
@pytest.mark.parametrize("prefetch,thread,pipeline", [(0, False, True), (1, False, True), (1, True, True),
                                                      (3, True, True), (1, True, False)])
def test_every_way_of_loading_gives_the_same_batches(prefetch, thread, pipeline):
    data = random_data(seed=6)
    ref = [b.n_id for b in NeighborLoader(data, [4, 2], batch_size=64, shuffle=True, seed=11, prefetch=0)]
    loader = NeighborLoader(data, [4, 2], batch_size=64, shuffle=True, seed=11, prefetch=prefetch, thread=thread,
                            pipeline=pipeline)
    names, samplers = set(), set()
    loader.transform = lambda b: (names.add(threading.current_thread().name), b)[1]
    sample = loader.sampler.sample
    loader.sampler.sample = lambda *a, **k: (samplers.add(threading.current_thread().name), sample(*a, **k))[1]
    got = [b.n_id for b in loader]
    assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    assert names == ({"pytorch-direct-loader"} if thread else {threading.current_thread().name})
    # a pipelined loader thread samples in a thread of its own, the next batch while it assembles one
    assert samplers == ({"pytorch-direct-sampler"} if thread and pipeline else names)
    stats = loader.stats()
    assert stats["batches"] == len(ref) and stats["wait_s"] >= 0 and stats["sample_s"] > 0
    assert stats["sample_cpu_s"] > 0 and stats["gather_cpu_s"] > 0
    # a second epoch: another order, the same seeds
    again = [b.n_id[: b.batch_size] for b in loader]
    assert not all(torch.equal(a[: 64], b[: 64]) for a, b in zip(got, again, strict=True))
    assert torch.equal(torch.cat(again).sort().values, torch.arange(400))


def test_shuffle_drop_last_and_len():
    data = random_data(n=100)
    loader = NeighborLoader(data, [2], batch_size=30, drop_last=True, shuffle=True, seed=0)
    batches = list(loader)
    assert len(loader) == len(batches) == 3 and all(b.batch_size == 30 for b in batches)
    assert len(NeighborLoader(data, [2], batch_size=30)) == 4


@pytest.mark.parametrize("thread", [False, True])
def test_drop_last_with_fewer_input_nodes_than_a_batch_gives_no_batches(thread):
    # as PyG's loaders (a DataLoader with drop_last=True): len 0 and no batch. The epoch held one empty batch,
    # whose sampling raised "seeds must be a non-empty 1-D tensor"
    data, hetero = random_data(n=100), random_hetero()
    kwargs = dict(batch_size=128, drop_last=True, prefetch=int(thread), thread=thread)
    for loader in (NeighborLoader(data, [2], **kwargs),
                   NeighborLoader(hetero, [2], input_nodes=("paper", torch.arange(100)), **kwargs)):
        assert len(loader) == 0
        assert list(loader) == []
    assert len(list(NeighborLoader(data, [2], batch_size=128))) == 1


@pytest.mark.parametrize("thread", [False, True])
def test_input_nodes_that_select_none_make_a_loader_of_no_batches(thread):
    # as PyG's loaders (an empty split or mask: len 0, no batch); this loader refused them ("input_nodes selects no
    # nodes: there is nothing to load")
    data, hetero = random_data(n=100), random_hetero()
    kwargs = dict(batch_size=16, prefetch=int(thread), thread=thread)
    for loader in (NeighborLoader(data, [2], input_nodes=torch.zeros(100, dtype=torch.bool), **kwargs),
                   NeighborLoader(data, [2], input_nodes=torch.tensor([], dtype=torch.long), **kwargs),
                   NeighborLoader(hetero, [2], input_nodes=("paper", torch.zeros(300, dtype=torch.bool)), **kwargs)):
        assert len(loader) == 0
        assert list(loader) == []


def test_an_error_in_the_loader_thread_reaches_training_and_ends_the_thread():
    data = random_data()

    def broken(batch):
        if int(batch.input_id[0]) >= 80:
            raise KeyError("bad batch")
        return batch

    before = threading.active_count()
    loader = NeighborLoader(data, [2], batch_size=40, prefetch=2, thread=True, transform=broken)
    seen = 0
    with pytest.raises(KeyError, match="bad batch"):
        for _ in loader:
            seen += 1
    assert seen == 2
    # an error while sampling (the pipelined loader's sampler thread) reaches training too
    loader = NeighborLoader(data, [2], batch_size=40, prefetch=1, thread=True)
    sample, calls = loader.sampler.sample, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("sampler broke")
        return sample(*args, **kwargs)

    loader.sampler.sample = failing
    seen = 0
    with pytest.raises(RuntimeError, match="sampler broke"):
        for _ in loader:
            seen += 1
    assert seen == 2
    for pipeline in (True, False):
        for i, _ in enumerate(NeighborLoader(data, [2], batch_size=10, prefetch=2, thread=True, pipeline=pipeline)):
            if i == 2:
                break  # stopping early
    import gc

    gc.collect()
    assert threading.active_count() == before


@pytest.mark.parametrize("prefetch, thread, pipeline", [(0, False, False), (1, False, False), (2, True, False),
                                                      (2, True, True)])
def test_after_an_error_in_a_batch_the_epoch_goes_on_as_in_pyg(prefetch, thread, pipeline):
    # PyG's loaders raise a batch's error with its own type and traceback, and the next call gives the next batch.
    # Here the next call raised "IndexError: pop from an empty deque" with a loader thread, and the last call of
    # the epoch "IndexError: list index out of range" without one
    import traceback
    import warnings

    data = random_data()

    def broken(batch):
        if int(batch.input_id[0]) == 80:
            raise KeyError("bad batch")
        return batch

    before = threading.active_count()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (prefetch without a thread on the CPU)
        loader = NeighborLoader(data, [2], batch_size=40, prefetch=prefetch, thread=thread, pipeline=pipeline,
                                transform=broken, device="cpu")
    it, got = iter(loader), []
    for _ in range(len(loader)):
        try:
            got.append(int(next(it).input_id[0]))
        except KeyError as e:
            got.append("error")
            assert "broken" in "".join(traceback.format_exception(e))  # (raised where the transform raised it)
    assert got == [0, 40, "error", *range(120, 400, 40)]
    with pytest.raises(StopIteration):
        next(it)
    assert loader.stats()["batches"] == len(loader) - 1
    # an error that ends a for loop ends the epoch's thread with it
    try:
        for _ in loader:
            pass
    except KeyError:
        pass
    assert threading.active_count() == before


def test_an_epoch_ended_by_the_next_one_says_so():
    # iter(loader) ends the loader's previous epoch (one sampler, not shared between threads); with a loader
    # thread the old iterator raised "IndexError: pop from an empty deque"
    data = random_data()
    loader = NeighborLoader(data, [2], batch_size=40, prefetch=1, thread=True)
    first = iter(loader)
    next(first)
    assert len(list(loader)) == len(loader)
    with pytest.raises(RuntimeError, match="one epoch at a time"):
        next(first)
    # without a loader thread both go on, in the training thread
    loader = NeighborLoader(data, [2], batch_size=40, device="cpu")
    first = iter(loader)
    next(first)
    assert len(list(loader)) == len(loader) and len(list(first)) == len(loader) - 1


EXIT_WITH_AN_EPOCH_OPEN = """
import torch
from torch_geometric.data import Data
from pytorch_direct.sampling import NeighborLoader

n = 2000
data = Data(x=torch.randn(n, 4), edge_index=torch.randint(0, n, (2, 20000)))
epochs = [iter(NeighborLoader(data, [5, 5], batch_size=10, prefetch=2, thread=True, pipeline=p)) for p in (True, False)]
for epoch in epochs:
    next(epoch)
print("leaving")
"""


def test_a_script_that_ends_during_an_epoch_exits_cleanly():
    # a script whose iterator was still alive at exit (an epoch left open at module level) was aborted by SIGABRT
    # ("terminate called without an active exception") in most runs: Python stopped the loader's daemon thread
    # while it sampled inside torch's C++
    pyg()
    for _ in range(2):
        run = subprocess.run([sys.executable, "-c", EXIT_WITH_AN_EPOCH_OPEN], capture_output=True, text=True,
                             timeout=120)
        assert run.returncode == 0 and run.stdout.strip() == "leaving", run.stderr[-2000:]
        assert "terminate called" not in run.stderr


def test_num_neighbors_in_every_form_pyg_takes():
    # PyG's loaders also take edge types by name ("src__rel__dst") and a NumNeighbors (with a default for the edge
    # types it does not name): they failed with "names edge types not in the graph" and "'NumNeighbors' object is
    # not iterable"
    from torch_geometric.sampler import NumNeighbors

    hetero, data = random_hetero(), random_data()
    fanouts = {et: [3, 0] if et[1] == "cites" else [2, 1] for et in hetero.edge_types}
    forms = [{"__".join(et): v for et, v in fanouts.items()},
             NumNeighbors({("paper", "cites", "paper"): [3, 0]}, default=[2, 1])]
    for form in forms:
        expected = NeighborLoader(hetero, fanouts, input_nodes=("paper", torch.arange(100)), batch_size=32, seed=4)
        got = NeighborLoader(hetero, form, input_nodes=("paper", torch.arange(100)), batch_size=32, seed=4)
        for a, b in zip(got, expected, strict=True):
            assert_same_batch(a, b)
    expected = NeighborLoader(data, [4, 2], batch_size=64, seed=4)
    for a, b in zip(NeighborLoader(data, NumNeighbors([4, 2]), batch_size=64, seed=4), expected, strict=True):
        assert_same_batch(a, b)


def test_negative_fan_outs_in_every_form_are_all_neighbours_as_in_pyg():
    # PyG hands any negative fan-out to pyg-lib, which takes every in-edge for it (count < 0), per edge type too;
    # the loader refused all below -1. Each form now gives the batches of -1.
    from torch_geometric.sampler import NumNeighbors

    data, hetero = random_data(), random_hetero()
    for form in ([-2, 3], (-100, 3), NumNeighbors([-5, 3])):
        expected = NeighborLoader(data, [-1, 3], batch_size=64, seed=4)
        got = NeighborLoader(data, form, batch_size=64, seed=4)
        assert got.sampler.fanouts == [[-1], [3]]
        for a, b in zip(got, expected, strict=True):
            assert_same_batch(a, b)
        check_counts(a, data.edge_index, [data.num_edges, 3])
    fanouts = {et: [-1, 2] if et[1] == "cites" else [2, -1] for et in hetero.edge_types}
    seeds = ("paper", torch.arange(100))
    negative = {et: [-3, 2] if et[1] == "cites" else [2, -(2**40)] for et in hetero.edge_types}
    for form in (negative, {"__".join(et): v for et, v in negative.items()},
                 NumNeighbors({("paper", "cites", "paper"): [-7, 2]}, default=[2, -2])):
        expected = NeighborLoader(hetero, fanouts, input_nodes=seeds, batch_size=32, seed=4)
        got = NeighborLoader(hetero, form, input_nodes=seeds, batch_size=32, seed=4)
        for a, b in zip(got, expected, strict=True):
            assert_same_batch(a, b)


def test_fan_outs_are_integers_as_in_pyg():
    # pyg-lib takes num_neighbors as int[] (a float, a string or a bool is refused when PyG samples); here int() read
    # 2.5 as 2 and "3" as 3, silently. Integers of other types (numpy's, a 0-d tensor) are taken, as int() did.
    import numpy as np

    data, hetero = random_data(), random_hetero()
    for bad, named in (([2.5], "2.5"), ([3, 2.0], "2.0 at hop 1"), (["3"], "'3'"), ([True, 2], "True")):
        with pytest.raises(TypeError, match=f"fan-outs are integers .* got {named}"):
            NeighborLoader(data, bad)
    with pytest.raises(TypeError, match="fan-outs are integers"):
        NeighborLoader(hetero, {et: [1.5] for et in hetero.edge_types}, input_nodes="paper")
    with pytest.raises(TypeError, match="fan-outs are integers"):
        NeighborSampler(skewed_graph(), [[2.0]])
    expected = NeighborLoader(data, [3, 2], batch_size=64, seed=4)
    got = NeighborLoader(data, [np.int64(3), torch.tensor(2)], batch_size=64, seed=4)
    assert got.sampler.fanouts == [[3], [2]] and all(type(k) is int for row in got.sampler.fanouts for k in row)
    for a, b in zip(got, expected, strict=True):
        assert_same_batch(a, b)


def test_a_fan_out_past_a_c_int_is_every_neighbour_or_named():
    # the kernels take a homogeneous graph's fan-outs as C ints: 2**40 failed there (or wrapped); without
    # replacement a fan-out of at least the graph's edges takes every in-edge, as -1 does; with replacement it
    # would draw 2**40 edges per node
    topo = skewed_graph()
    assert NeighborSampler(topo, [2**40, 3]).fanouts == [[-1], [3]]
    assert NeighborSampler(topo, [2**31 - 1]).fanouts == [[2**31 - 1]]
    with pytest.raises(ValueError, match=r"fan-out 1099511627776 at hop 1 is past .* with replace=True"):
        NeighborSampler(topo, [3, 2**40], replace=True)


def test_bad_arguments_are_named():
    data, hetero = random_data(), random_hetero()
    with pytest.raises(ValueError, match="node type"):
        NeighborLoader(hetero, [2])
    with pytest.raises(ValueError, match="not in the graph"):
        NeighborLoader(hetero, [2], input_nodes="nope")
    with pytest.raises(ValueError, match="no fan-outs for edge types"):
        NeighborLoader(hetero, {("paper", "cites", "paper"): [2]}, input_nodes="paper")
    with pytest.raises(NotImplementedError, match="worker processes"):
        NeighborLoader(data, [2], num_workers=2)
    NeighborLoader(data, [2], num_workers=0)
    with pytest.raises(TypeError, match="unexpected argument 'bogus'"):
        NeighborLoader(data, [2], bogus=1)
    with pytest.raises(NotImplementedError, match="directional"):
        NeighborLoader(data, [2], subgraph_type="induced")
    with pytest.raises(IndexError, match="input node ids"):
        NeighborLoader(data, [2], input_nodes=torch.tensor([0, 400]))
    with pytest.raises(ValueError, match="selects node 401, past the 400 nodes"):
        NeighborLoader(data, [2], input_nodes=torch.ones(402, dtype=torch.bool))
    with pytest.raises(ValueError, match="thread=True needs prefetch"):
        NeighborLoader(data, [2], prefetch=0, thread=True)
    with pytest.raises(TypeError, match="takes a Data"):
        NeighborLoader([1, 2], [2])
    with pytest.warns(UserWarning, match="overlap nothing"):
        NeighborLoader(data, [2], prefetch=1, thread=False, device="cpu")
    with pytest.warns(UserWarning, match="no effect on the CPU"):
        NeighborLoader(data, [2], topology="host", device="cpu")


def test_batch_size_is_a_positive_integer_as_in_pyg():
    # PyG's loaders hand batch_size to torch's DataLoader, which refuses anything but a positive int ("batch_size
    # should be a positive integer value"); here int() read 2.5 as batches of 2 and True as batches of 1
    import numpy as np

    data = random_data(n=100)
    for bad in (2.5, 2.0, True, None, "8", 0, -3):
        with pytest.raises(ValueError, match=f"batch_size must be a positive integer, got {bad!r}"):
            NeighborLoader(data, [2], batch_size=bad)
    for size in (30, np.int64(30), torch.tensor(30)):
        loader = NeighborLoader(data, [2], batch_size=size)
        assert loader.batch_size == 30 and type(loader.batch_size) is int and len(loader) == 4


def test_pygs_defaults_passed_explicitly_are_taken():
    # code written for PyG's NeighborLoader passes its defaults (pin_memory=False, directed=True, time_attr=None,
    # ...); each raised NotImplementedError here, as if it asked for what the loader does not do
    data = random_data()
    defaults = dict(num_workers=0, time_attr=None, temporal_strategy="uniform", weight_attr=None, input_time=None,
                    transform_sampler_output=None, directed=True, neighbor_sampler=None, filter_per_worker=None,
                    persistent_workers=False, pin_memory=False, collate_fn=None, sampler=None, batch_sampler=None,
                    input_id=None, custom_cls=None, dataset=None)
    expected = NeighborLoader(data, [3, 2], batch_size=64, seed=1)
    for a, b in zip(NeighborLoader(data, [3, 2], batch_size=64, seed=1, **defaults), expected, strict=True):
        assert_same_batch(a, b)
    for key, value in [("time_attr", "t"), ("directed", False), ("persistent_workers", True),
                       ("input_time", torch.zeros(400)), ("dataset", [1])]:
        with pytest.raises(NotImplementedError, match=key):
            NeighborLoader(data, [2], **{key: value})


def test_the_dataloader_arguments_pyg_passes_on_are_taken():
    # PyG's loaders pass their other keyword arguments to torch's DataLoader: a generator fixes the shuffle, and
    # without worker processes it ignores worker_init_fn, in_order and pin_memory_device and takes timeout=0,
    # prefetch_factor=None and multiprocessing_context=None. Each was "an unexpected argument" here.
    data = random_data()
    state = torch.random.get_rng_state()
    runs = []
    for _ in range(2):
        loader = NeighborLoader(data, [3, 2], batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(9),
                                worker_init_fn=lambda worker: None, in_order=True, pin_memory_device="", timeout=0,
                                prefetch_factor=None, multiprocessing_context=None)
        runs.append(list(loader))
    assert torch.equal(torch.random.get_rng_state(), state), "the global generator is not drawn from"
    for a, b in zip(*runs, strict=True):
        assert_same_batch(a, b)
    other = list(NeighborLoader(data, [3, 2], batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(8)))
    assert not torch.equal(other[0].input_id, runs[0][0].input_id), "another generator, another shuffle"
    for key, value in (("timeout", 5), ("prefetch_factor", 2), ("multiprocessing_context", "spawn")):
        with pytest.raises(NotImplementedError, match=f"{key}=.*worker processes"):
            NeighborLoader(data, [2], **{key: value})


def test_the_arguments_that_change_nothing_without_workers_or_time_are_taken_as_in_pyg():
    # filter_per_worker (features gathered in a worker or in the main process), temporal_strategy="last" without
    # time_attr (pyg-lib samples uniformly then) and pin_memory=True without a GPU (torch's DataLoader ignores it)
    # give PyG the batches it gives without them; each raised NotImplementedError here
    data = random_data()
    expected = list(NeighborLoader(data, [3, 2], batch_size=64, seed=1))
    for kwargs in (dict(filter_per_worker=True), dict(filter_per_worker=False), dict(temporal_strategy="last"),
                   dict(pin_memory=True) if not pd.cuda_usable() else {}):
        for a, b in zip(NeighborLoader(data, [3, 2], batch_size=64, seed=1, **kwargs), expected, strict=True):
            assert_same_batch(a, b)
    with pytest.raises(ValueError, match="temporal_strategy must be 'uniform' or 'last'"):
        NeighborLoader(data, [2], temporal_strategy="newest")
    with pytest.raises(ValueError, match="subgraph_type must be 'directional', 'bidirectional' or 'induced'"):
        NeighborLoader(data, [2], subgraph_type="directed")


def test_input_id_labels_the_input_nodes_as_in_pygs_node_loader():
    # PyG's NeighborLoader passes input_id= on to its NodeLoader: each batch's input_id are the given labels of its
    # input nodes (for ids and masks alike); "an unexpected argument" here
    data, hetero = random_data(), random_hetero()
    labels = torch.arange(1000, 1150)
    fanouts = {et: [3, 2] for et in hetero.edge_types}
    for graph, nodes, num_neighbors in ((data, torch.randperm(400)[:150], [3, 2]),
                                        (data, data.train_mask, [3, 2]),
                                        (hetero, ("paper", torch.randperm(300)[:150]), fanouts)):
        count = nodes.sum() if isinstance(nodes, torch.Tensor) and nodes.dtype == torch.bool else 150
        ids = labels[:count]
        ours = NeighborLoader(graph, num_neighbors, input_nodes=nodes, input_id=ids, batch_size=32, seed=3)
        theirs = pyg().NodeLoader(graph, node_sampler=pyg().NodeSampler(graph, num_neighbors, seed=3),
                                  input_nodes=nodes, input_id=ids, batch_size=32)
        seen = []
        for a, b in zip(ours, theirs, strict=True):
            assert_same_batch(a, b)
            seen.append(a["paper"].input_id if graph is hetero else a.input_id)
        assert torch.equal(torch.cat(seen), ids)
    with pytest.raises(ValueError, match=r"one id per input node \(150\), got shape \(3,\)"):
        NeighborLoader(data, [2], input_nodes=torch.arange(150), input_id=torch.arange(3))
    for every in (None, "paper", ("paper", None)):
        graph = data if every is None else hetero
        with pytest.raises(ValueError, match=r"PyG ignores it where input_nodes selects every node"):
            NeighborLoader(graph, fanouts if graph is hetero else [2], input_nodes=every, input_id=torch.arange(3))


def test_custom_cls_is_the_class_of_a_store_pairs_batches_as_in_pyg():
    # PyG's NodeLoader builds a store pair's batches as custom_cls() (for remote backends); "an unexpected
    # argument" here
    class MyData(pyg().Data):
        pass

    class MyHetero(pyg().HeteroData):
        pass

    data = random_data(seed=2)
    fs = pyg().UnifiedFeatureStore(device="cpu")
    fs.put_tensor(data.x, group_name=None, attr_name="x", index=None)
    gs = pyg().make_graph_store(data.edge_index, num_nodes=data.num_nodes)
    nodes = torch.arange(0, 400, 3)
    ours = NeighborLoader((fs, gs), [3, 2], input_nodes=nodes, custom_cls=MyData, batch_size=40, seed=4)
    theirs = pyg().NodeLoader((fs, gs), node_sampler=pyg().NodeSampler((fs, gs), [3, 2], seed=4), input_nodes=nodes,
                              custom_cls=MyData, batch_size=40)
    for a, b in zip(ours, theirs, strict=True):
        assert type(a) is type(b) is MyData
        assert torch.equal(a.x, data.x[a.n_id]) and torch.equal(a.n_id, b.n_id) and torch.equal(a.input_id, b.input_id)
    hfs = pyg().UnifiedFeatureStore(device="cpu")
    hfs.put_tensor(data.x, group_name="a", attr_name="x", index=None)
    hgs = pyg().make_graph_store(data.edge_index, num_nodes=data.num_nodes, edge_type=("a", "to", "a"))
    batch = next(iter(NeighborLoader((hfs, hgs), [2], input_nodes="a", custom_cls=MyHetero, batch_size=8)))
    assert type(batch) is MyHetero and torch.equal(batch["a"].x, data.x[batch["a"].n_id])
    with pytest.raises(ValueError, match="custom_cls= sets the class of the batches of a .FeatureStore, GraphStore"):
        NeighborLoader(data, [2], custom_cls=MyData)
    with pytest.raises(TypeError, match="custom_cls= must be a subclass of HeteroData for this graph"):
        NeighborLoader((hfs, hgs), [2], input_nodes="a", custom_cls=MyData)


def test_sampler_and_batch_sampler_draw_the_batches_as_in_pyg():
    # PyG's loaders hand sampler= and batch_sampler= to torch's DataLoader, which draws positions into input_nodes
    # from them each epoch (e.g. a DistributedSampler splitting the input nodes between ranks); both were refused
    from torch.utils.data import DistributedSampler

    data = random_data()
    nodes = data.train_mask.nonzero().view(-1)
    n = nodes.numel()
    forms = [dict(sampler=DistributedSampler(range(n), num_replicas=2, rank=1, shuffle=True, seed=5), batch_size=16),
             dict(sampler=list(range(n - 1, -1, -3)), batch_size=8, drop_last=True),
             dict(batch_sampler=[[4, 0, 9], [1], list(range(10, 40))])]
    for kwargs in forms:
        ours = NeighborLoader(data, [3, 2], input_nodes=nodes, seed=6, **kwargs)
        theirs = pyg().NodeLoader(data, node_sampler=pyg().NodeSampler(data, [3, 2], seed=6), input_nodes=nodes,
                                  **kwargs)
        assert len(ours) == len(theirs)
        for epoch in range(2):
            if isinstance(kwargs.get("sampler"), DistributedSampler):
                kwargs["sampler"].set_epoch(epoch)
            count = 0
            for a, b in zip(ours, theirs, strict=True):
                assert_same_batch(a, b)
                count += 1
            assert count == len(ours)
    with pytest.raises(ValueError, match="sampler= is mutually exclusive with shuffle=True"):
        NeighborLoader(data, [2], sampler=range(10), shuffle=True)
    with pytest.raises(ValueError, match="batch_sampler= is mutually exclusive with batch_size"):
        NeighborLoader(data, [2], batch_sampler=[[0, 1]], batch_size=2)
    with pytest.raises(IndexError, match=r"yielded positions in \[0, 400\], but there are 400 input nodes"):
        next(iter(NeighborLoader(data, [2], sampler=range(401), batch_size=8)))


def test_pygs_node_loader_with_node_sampler_takes_ids_of_shape_k_1_and_refuses_input_time():
    # PyG's NodeLoader hands the sampler seeds of the shape input_nodes has ([b, 1] for [k, 1]), which pyg-lib
    # reads as the b ids (here: "seeds must be a non-empty 1-D tensor"), and input_time, which was ignored here
    data = random_data()
    ids = torch.randperm(400, generator=torch.Generator().manual_seed(1))[:60]
    batches = []
    for nodes in (ids, ids.view(-1, 1)):
        loader = pyg().NodeLoader(data, node_sampler=pyg().NodeSampler(data, [3, 2], seed=2), input_nodes=nodes,
                                  batch_size=16)
        batches.append(list(loader))
    for a, b in zip(*batches, strict=True):
        assert_same_batch(a, b)
    loader = pyg().NodeLoader(data, node_sampler=pyg().NodeSampler(data, [3]), input_nodes=ids,
                              input_time=torch.zeros(60, dtype=torch.long), batch_size=16)
    with pytest.raises(NotImplementedError, match="no temporal sampling.*input_time"):
        next(iter(loader))


def test_a_node_type_without_a_node_count_is_named():
    # a node type with no attribute and no num_nodes (PyG warns that its num_nodes is undefined) failed with
    # "int() argument must be a string, a bytes-like object or a real number, not 'NoneType'"
    import warnings

    hetero = random_hetero()
    del hetero["venue"].x
    with warnings.catch_warnings(), pytest.raises(ValueError, match=r"node type 'venue' has no node count"):
        warnings.simplefilter("ignore")  # (PyG's)
        NeighborLoader(hetero, [2], input_nodes="paper")
    hetero["venue"].num_nodes = 10
    assert len(list(NeighborLoader(hetero, [2], input_nodes="paper", batch_size=100))) == 3


def test_edges_from_nodes_past_the_graph_are_named():
    # a source id past the last node (num_nodes set too small) was sampled as an edge from some other node: the
    # batch's edge_index did not map back to the graph's edges
    data = random_data()
    data.edge_index[0, 5] = 400
    with pytest.raises(IndexError, match=r"edge_index has sources outside \[0, 400\) \(got \[0, 400\]\)"):
        NeighborLoader(data, [-1], device="cpu")
    data.edge_index[0, 5] = -1
    with pytest.raises(IndexError, match="sources outside"):
        NeighborLoader(data, [-1], device="cpu")
    data.edge_index[0, 5], data.edge_index[1, 7] = 0, 401
    with pytest.raises(IndexError, match=r"destinations outside \[0, 400\) \(got \[0, 401\]\)"):
        NeighborLoader(data, [-1], device="cpu")


def test_unified_feature_store_errors_say_the_fix():
    fs = pyg().UnifiedFeatureStore(device="cpu")
    with pytest.raises(KeyError, match="put it first"):
        fs.get_tensor(group_name=None, attr_name="x", index=torch.tensor([0]))
    with pytest.raises(KeyError, match="put the whole tensor first"):
        fs.put_tensor(torch.zeros(2, 3), group_name=None, attr_name="x", index=torch.tensor([0, 1]))
    fs.put_tensor(torch.arange(12.0).view(6, 2), group_name=None, attr_name="x", index=None)
    mask = torch.tensor([True, False, True, False, False, True])
    rows = fs.get_tensor(group_name=None, attr_name="x", index=mask)
    assert torch.equal(rows, torch.tensor([[0., 1], [4, 5], [10, 11]]))
    with pytest.raises(IndexError, match="integer ids or a boolean mask"):
        fs.get_tensor(group_name=None, attr_name="x", index=torch.tensor([0.5]))
    if not pd.cuda_usable():
        with pytest.raises(RuntimeError, match="leave device unset or pass device='cpu'"):
            pyg().UnifiedFeatureStore(device="cuda")


def test_unified_feature_store_names_whole_tensors_without_an_index():
    # as PyG's LocalFeatureStore: (group, name) without an index is the whole tensor. PyG's TensorAttr leaves the
    # index unset, and get_tensor / remove_tensor raised "not fully specified", store[group, name] a TypeError.
    from torch_geometric.distributed import LocalFeatureStore

    x = torch.randn(6, 3)
    for fs in (pyg().UnifiedFeatureStore(device="cpu"), LocalFeatureStore()):
        fs.put_tensor(x, group_name="paper", attr_name="x", index=None)
        fs.put_tensor(torch.arange(6), group_name="paper", attr_name="y")
        assert torch.equal(fs.get_tensor(group_name="paper", attr_name="x"), x)
        assert torch.equal(fs["paper", "y"], torch.arange(6))
        assert torch.equal(fs.get_tensor(group_name="paper", attr_name="x", index=torch.tensor([4, 1])), x[[4, 1]])
        assert fs.remove_tensor(group_name="paper", attr_name="x")
        assert [a.attr_name for a in fs.get_all_tensor_attrs()] == ["y"]


def test_unified_feature_store_memory_applies_to_the_copies_it_makes(monkeypatch):
    # with copy=False, memory= was ignored, and a tensor the store could not register (not contiguous) was copied
    # into managed memory from 256 MiB on, which forked DataLoader workers cannot read (the README names copy=False
    # as the way to feed such workers)
    from pytorch_direct import _memory

    monkeypatch.setattr(_memory, "_MANAGED", True)  # (as on a GPU with concurrent managed access)
    monkeypatch.setattr(_memory, "MANAGED_MIN_BYTES", 1 << 10)
    kinds = []
    choose = _memory.memory_kind
    monkeypatch.setattr(_memory, "memory_kind", lambda nbytes, memory: kinds.append(choose(nbytes, memory))
                        or kinds[-1])
    x = torch.randn(64, 200).t()  # 50 KiB, not contiguous: copied
    expected = {(False, "auto"): "pinned", (False, "managed"): "managed", (True, "auto"): "managed",
                (True, "pinned"): "pinned"}
    for (copy, memory), kind in expected.items():
        kinds.clear()
        fs = pyg().UnifiedFeatureStore(device="cpu", copy=copy, memory=memory)
        fs.put_tensor(x, group_name=None, attr_name="x", index=None)
        assert kinds == [kind], (copy, memory, kinds)
        assert torch.equal(fs.get_tensor(group_name=None, attr_name="x", index=torch.tensor([3, 0])), x[[3, 0]])
    with pytest.raises(ValueError, match="memory must be one of"):
        pyg().UnifiedFeatureStore(device="cpu", memory="host")


def test_small_tables_sharing_their_pages_are_copied_not_registered():
    # registering pins whole pages: a small heap tensor shares its first and last page with other allocations, and
    # a CUDA copy of one of those straddling the registered range fails, so such a table is copied
    from pytorch_direct import _topology

    small = torch.randn(100, 7)[1:]  # (not starting on a page boundary)
    assert not _topology.owns_its_pages(small)
    table = _topology.unify_table(small, "x")
    assert pd.is_unified(table) and table.data_ptr() != small.data_ptr() and torch.equal(table, small)
    large = torch.empty(_topology.OWN_PAGES_BYTES // 4, dtype=torch.float32)
    assert _topology.owns_its_pages(large)
    assert _topology.unify_table(large, "x").data_ptr() == large.data_ptr(), "a large table is registered in place"
    own = pd.empty((1000, 8))
    assert _topology.unify_table(own, "x") is own
    fs = pyg().UnifiedFeatureStore(device="cpu")
    fs.put_tensor(small, group_name=None, attr_name="x", index=None)
    assert torch.equal(fs.get_tensor(group_name=None, attr_name="x", index=torch.tensor([0, 5])), small[[0, 5]])


def test_the_loaders_tables_carry_no_autograd_registered_or_copied():
    # the loader reads a Data's feature tables (on a GPU made unified by unify_table); a copied table was detached,
    # and a table registered in place must be too now that unified(t) keeps t.requires_grad
    from pytorch_direct import _topology

    large = torch.empty(_topology.OWN_PAGES_BYTES // 4, dtype=torch.float32).requires_grad_()
    small = torch.randn(100, 7, requires_grad=True)
    for t in (large, small):
        table = _topology.unify_table(t, "x")
        assert pd.is_unified(table) and not table.requires_grad
    assert table.data_ptr() != small.data_ptr() and _topology.unify_table(large, "x").data_ptr() == large.data_ptr()


def _batch_work(loader):
    """(operations that make a tensor, host round trips) of one batch made by ``loader`` on this thread: the
    sampler's, the assembly's and the gathers'. Round trips: size reads, and the operations that read a size on a
    GPU (unique, nonzero, bincount, repeat_interleave without output_size), counted on the sampler's Python path."""
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    sized = (aten._unique2, aten.unique_dim, aten._local_scalar_dense, aten.nonzero, aten.bincount, aten.masked_select)

    class Count(TorchDispatchMode):
        ops = reads = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            self.ops += not func.is_view
            self.reads += func.overloadpacket in sized or (
                func.overloadpacket is aten.repeat_interleave and kwargs.get("output_size") is None)
            return func(*args, **kwargs)

    positions = torch.arange(loader.batch_size)
    loader.make(positions)  # (first-call work out of the way)
    with Count() as count:
        loader.make(positions)
    tolist, lists = torch.Tensor.tolist, []
    script = loader.sampler.script
    try:
        torch.Tensor.tolist = lambda t: lists.append(1) or tolist(t)
        loader.sampler.script = False
        with Count() as python:
            loader.make(positions)
    finally:
        torch.Tensor.tolist = tolist
        loader.sampler.script = script
    return count.ops, python.reads + len(lists)


def hetero_with(edge_types: int, seed=0):
    """A HeteroData of two node types and ``edge_types`` edge types between them."""
    gen = torch.Generator().manual_seed(seed)
    h = pyg().HeteroData()
    h["a"].x, h["b"].x = torch.randn(200, 4, generator=gen), torch.randn(100, 3, generator=gen)
    for k in range(edge_types):
        src, dst = ("a", "b") if k % 2 else ("b", "a")
        n_src, n_dst = h[src].num_nodes, h[dst].num_nodes
        h[src, f"r{k}", dst].edge_index = torch.stack([torch.randint(0, n_src, (400,), generator=gen),
                                                       torch.randint(0, n_dst, (400,), generator=gen)])
    return h


def test_a_batchs_host_work_does_not_grow_with_the_edge_types():
    # a loader thread's host work competes with training for the GIL, and each host round trip waits for a GPU busy
    # with training: a batch is a fixed number of operations whatever the number of edge types (their parts are
    # views) and a fixed number of round trips
    data = random_data(n=3000, e=40_000, seed=13)
    ops, reads = _batch_work(NeighborLoader(data, [15, 10], batch_size=256, device="cpu"))
    assert ops <= 100 and reads <= 2 + 1, (ops, reads)
    few, many = (_batch_work(NeighborLoader(hetero_with(k), [5, 3], input_nodes="a", batch_size=32, device="cpu"))
                 for k in (4, 40))
    assert few == many and few[1] <= 2 * 2 + 1 + 1, (few, many)  # (two per hop, one at the end, one to split)
    loader = NeighborLoader(hetero_with(6), [5, 3], input_nodes="a", batch_size=32, device="cpu")
    batch = loader.make(torch.arange(32))
    for et in batch.edge_types:
        assert batch[et].edge_index.is_contiguous() and batch[et].edge_index.shape[0] == 2


def test_make_graph_store_is_pygs_local_graph_store():
    from torch_geometric.distributed import LocalGraphStore

    edge_index = torch.tensor([[0, 1, 2], [2, 0, 1]])
    gs = pyg().make_graph_store(edge_index, num_nodes=3)
    assert isinstance(gs, LocalGraphStore)
    row, colptr, _ = gs.csc()
    assert colptr.tolist() == [0, 1, 2, 3] and row.tolist() == [1, 2, 0]
    typed = pyg().make_graph_store(edge_index, num_nodes=3, edge_type=("a", "r", "a"))
    assert typed.get_all_edge_attrs()[0].edge_type == ("a", "r", "a")


def test_readme_sampling_examples_run():
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = text.split("## GNN mini-batches", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) >= 4
    for i, block in enumerate(blocks):
        exec(compile(block, f"README.md GNN block {i}", "exec"), {})


# ---- on the GPU ------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("where", ["device", "host"])
def test_sampler_on_the_gpu(where):
    topo = skewed_graph(seed=7)
    gpu = torch.device("cuda")
    placed = topo.placed(where, gpu)
    sampler = NeighborSampler(placed, [5, 3], device=gpu, generator=torch.Generator(gpu).manual_seed(0))
    for seeds in (torch.tensor([0, 5, 3, 299]), torch.randperm(300)[:64]):
        sub = sampler.sample(seeds.cuda())
        assert sub.n_id.is_cuda and sub.edge_index.is_cuda
        check_subgraph(sub, seeds, topo, [5, 3])


@pytest.mark.gpu
def test_the_torchscript_path_on_the_gpu_gives_the_python_paths_batches():
    topo = skewed_graph(seed=11).placed("device", torch.device("cuda"))
    stream = torch.cuda.Stream()
    batches = []
    for script in (True, False):
        gen = torch.Generator("cuda").manual_seed(3)
        sampler = NeighborSampler(topo, [6, 3], device="cuda", generator=gen, script=script, kernels=False)
        assert sampler.script is script
        with torch.cuda.stream(stream):  # as the loader samples: on a side stream
            batches.append([sampler.sample(torch.arange(0, 300, k).cuda()) for k in (5, 7)])
        stream.synchronize()
    for a, b in zip(*batches, strict=True):
        for x, y in zip(a.tensors(), b.tensors(), strict=True):
            assert x.is_cuda and torch.equal(x, y)
        assert a.num_sampled_nodes == b.num_sampled_nodes


@pytest.mark.gpu
@pytest.mark.parametrize("prefetch,thread,pipeline", [(0, False, True), (2, False, True), (1, True, True),
                                                      (3, True, True), (1, True, False)])
def test_loader_on_the_gpu(prefetch, thread, pipeline):
    data = random_data(n=3000, e=40000, seed=8)
    data.x = torch.randn(3000, 300)  # 3.4 MiB: copied to the GPU; larger tables are registered (below)
    loader = NeighborLoader(data, [6, 4], batch_size=128, shuffle=True, seed=1, prefetch=prefetch, thread=thread,
                            pipeline=pipeline)
    ref = NeighborLoader(data, [6, 4], batch_size=128, shuffle=True, seed=1, device="cuda", prefetch=0)
    for a, b in zip(loader, ref, strict=True):
        assert a.x.is_cuda and a.edge_index.is_cuda
        assert torch.equal(a.n_id, b.n_id) and torch.equal(a.x, b.x)
        assert torch.equal(a.x.cpu(), data.x[a.n_id.cpu()])
        assert torch.equal(a.edge_attr.cpu(), data.edge_attr[a.e_id.cpu()])
        (a.x.sum() * 2).item()  # used on the training stream
    stats = loader.stats()
    assert stats["batches"] == len(loader) and stats["wait_s"] >= 0
    if loader._stream is not None:  # the loader's streams run at high priority unless asked otherwise
        assert loader._stream.priority < 0 and loader._gather_stream.priority < 0
        plain = NeighborLoader(data, [6, 4], batch_size=128, prefetch=prefetch, thread=thread, high_priority=False)
        assert plain._stream.priority == 0 and plain._gather_stream.priority == 0


@pytest.mark.gpu
@pytest.mark.parametrize("topology", ["device", "host"])
def test_zero_fanouts_and_no_hops_on_the_gpu(topology):
    # the loader's batches on the GPU (the kernel path, from GPU memory or zero-copy) for PyG's 0 fan-out and no
    # hops: a hop without edges, and the seeds alone (then the same batches as PyG's own NodeLoader's)
    data = random_data()
    for num_neighbors in ([10, 0], [0, 4], []):
        loader = NeighborLoader(data, num_neighbors, input_nodes=data.train_mask, batch_size=40, seed=3,
                                topology=topology)
        assert loader.sampler.kernels
        theirs = pyg().NodeLoader(data, node_sampler=pyg().NodeSampler(data, num_neighbors, seed=3),
                                  input_nodes=data.train_mask, batch_size=40)
        for a, b in zip(loader, theirs, strict=True):
            assert a.x.is_cuda
            a = a.to("cpu")
            check_counts(a, data.edge_index, num_neighbors)
            assert len(a.num_sampled_edges) == len(num_neighbors)
            if not num_neighbors or num_neighbors[0] == 0:
                assert_same_batch(a, b)
                assert a.edge_index.shape == (2, 0) and torch.equal(a.n_id, a.input_id)
            else:
                assert a.num_sampled_edges[1] == 0 and a.num_sampled_nodes[2] == 0
    hetero = random_hetero()
    for fanouts in ({et: [3, 0] for et in hetero.edge_types}, []):
        loader = NeighborLoader(hetero, fanouts, input_nodes="paper", batch_size=32, seed=2, topology=topology)
        for batch in loader:
            assert all(batch[et].num_sampled_edges == ([] if fanouts == [] else [batch[et].num_sampled_edges[0], 0])
                       for et in hetero.edge_types)
            if fanouts == []:
                assert torch.equal(batch["paper"].n_id.cpu(), batch["paper"].input_id.cpu())


@pytest.mark.gpu
def test_loader_on_the_gpu_reads_large_tables_and_the_topology_zero_copy():
    data = random_data(n=20000, e=100000, seed=9)
    data.x = torch.randn(20000, 256)  # 20 MiB: registered in place, read zero-copy
    loader = NeighborLoader(data, [5, 5], batch_size=512, topology="host", seed=0)
    assert pd.is_unified(loader.source.node_tables[(None, "x")]) and pd.is_unified(loader.source.topology.colptr)
    cpu = NeighborLoader(data, [5, 5], batch_size=512, device="cpu", seed=0)
    plain = NeighborLoader(data, [5, 5], batch_size=512, unify=False, seed=0)
    for a, b, c in zip(loader, cpu, plain, strict=True):
        assert torch.equal(a.x.cpu(), data.x[a.n_id.cpu()]) and torch.equal(c.x.cpu(), data.x[c.n_id.cpu()])
        assert a.num_nodes == a.n_id.numel() and b.batch_size == a.batch_size


@pytest.mark.gpu
@pytest.mark.parametrize("prefetch,thread", [(0, False), (1, False), (1, True)])
def test_store_pair_on_the_gpu(prefetch, thread):
    data = random_data(seed=10)
    fs = pyg().UnifiedFeatureStore()
    assert fs.device == torch.device("cuda", torch.cuda.current_device())
    fs.put_tensor(data.x, group_name=None, attr_name="x", index=None)  # small: copied, not registered in place
    fs.put_tensor(data.y, group_name=None, attr_name="y", index=None)
    gs = pyg().make_graph_store(data.edge_index, num_nodes=data.num_nodes)
    loader = NeighborLoader((fs, gs), [4, 4], batch_size=100, prefetch=prefetch, thread=thread)
    seen = 0
    for b in loader:
        assert b.x.device == fs.device and b.y.device == fs.device and b.n_id.device == fs.device, (
            b.x.device, b.y.device, b.n_id.device)
        n_id = b.n_id.cpu()
        assert torch.equal(b.x.cpu(), data.x[n_id]) and torch.equal(b.y.cpu(), data.y[n_id])
        assert torch.equal(n_id[b.edge_index.cpu()], data.edge_index[:, b.e_id.cpu()])
        check_counts(b.to("cpu"), data.edge_index, [4, 4])
        seen += b.batch_size
    assert seen == data.num_nodes


@pytest.mark.gpu
def test_hetero_batches_on_the_gpu_follow_pyg_semantics():
    check_hetero_semantics("cuda")


@pytest.mark.gpu
def test_hetero_batches_on_the_gpu_after_a_hop_of_zero_fanouts_are_those_without_it():
    check_a_hop_of_zero_fanouts_changes_no_batch("cuda")


@pytest.mark.gpu
def test_a_cpu_store_feeds_a_loader_on_the_gpu():
    # the store reads the index on the host: it gets a CPU copy made before it reads it, and the rows it returns
    # are moved to the loader's device
    data = random_data(seed=12)
    fs = pyg().UnifiedFeatureStore(device="cpu")
    fs.put_tensor(data.x, group_name=None, attr_name="x", index=None)
    gs = pyg().make_graph_store(data.edge_index, num_nodes=data.num_nodes)
    for b in NeighborLoader((fs, gs), [4, 4], batch_size=64, device="cuda"):
        assert b.x.is_cuda and torch.equal(b.x.cpu(), data.x[b.n_id.cpu()])


@pytest.mark.gpu
def test_pin_memory_pins_batches_made_on_the_cpu_as_in_pyg():
    # PyG's DataLoader pins CPU batches where there is a GPU to copy them to; batches made on the GPU are there
    data = random_data(seed=13)
    pinned = next(iter(NeighborLoader(data, [3], batch_size=64, device="cpu", pin_memory=True)))
    plain = next(iter(NeighborLoader(data, [3], batch_size=64, device="cpu")))
    assert pinned.x.is_pinned() and pinned.n_id.is_pinned() and not plain.x.is_pinned()
    assert next(iter(NeighborLoader(data, [3], batch_size=64, device="cuda", pin_memory=True))).x.is_cuda


@pytest.mark.gpu
def test_pygs_node_loader_with_the_sampler_on_the_gpu():
    data = random_data(seed=10)
    theirs = pyg().NodeLoader(data, node_sampler=pyg().NodeSampler(data, [4, 4], device="cuda", seed=0), batch_size=50)
    seen = 0
    for b in theirs:
        assert b.n_id.device.type == "cpu", "PyG's loaders assemble batches on the CPU"
        assert torch.equal(b.n_id[b.edge_index], data.edge_index[:, b.e_id])
        assert torch.equal(b.x, data.x[b.n_id])
        check_counts(b, data.edge_index, [4, 4])
        seen += b.batch_size
    assert seen == data.num_nodes


def test_sampling_benchmark_runs_on_the_cpu(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    pyg()
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "sampling.py"
    spec = importlib.util.spec_from_file_location("pd_bench_sampling", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "sampling.csv"
    rows = bench.main(["--nodes", "3000", "--edges", "30000", "--edge-types", "2,50", "--batches", "2",
                       "--batch-size", "64", "--device", "cpu", "--csv", str(out)])
    assert [(r["graph"], r["edge_types"]) for r in rows] == [("hetero", 2), ("typed", 2), ("hetero", 50),
                                                             ("typed", 50)]
    assert all(r["ms_per_batch"] > 0 and r["edges_per_batch"] > 0 for r in rows)
    assert "edges/batch" in capsys.readouterr().out and len(out.read_text().splitlines()) == 5


def test_loader_host_benchmark_runs_on_the_cpu(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    pyg()
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "loader_host.py"
    spec = importlib.util.spec_from_file_location("pd_bench_loader_host", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "loader_host.csv"
    rows = bench.main(["--nodes", "3000", "--batch-size", "64", "--batches", "3", "--warmup", "1", "--top", "3",
                       "--csv", str(out)])
    assert [r["sampler"] for r in rows] == ["torch"], "the CPU has the torch path only"
    row = rows[0]
    assert row["batch_ms"] >= row["sampler_ms"] > 0 and row["py_calls"] > 0 and row["python_ms"] > 0
    # the sampler alone: TorchScript's operations are seen by the profiler (some 35 per hop)
    assert row["sample_ms"] > 0 and 20 < row["aten_ops"] < 400 and row["launches"] == 0, row
    # a batch's host work is a fixed, small number of Python calls (it was 138 before the loader's Python was cut)
    assert row["py_calls"] < 100, row
    text = capsys.readouterr().out
    assert "Python functions by own time" in text and "python_ms" in text
    assert len(out.read_text().splitlines()) == 2


def test_a_batch_is_the_data_that_setting_its_attributes_makes():
    # batches are assembled without Data's per-attribute __setattr__: the same Data as setting them one by one
    from pytorch_direct._loader import _new_data

    Data = pyg().Data
    topo = skewed_graph(seed=3)
    x, y = torch.randn(300, 4), torch.randint(0, 5, (300,))
    loader = NeighborLoader(({"x": x, "y": y}, topo), [4, 3], batch_size=32, device="cpu", seed=2)
    batch = next(iter(loader))
    slow = Data()
    for key, value in batch.to_dict().items():
        setattr(slow, key, value)
    assert list(batch.keys()) == list(slow.keys()) and batch.num_nodes == slow.num_nodes == batch.n_id.numel()
    assert batch.is_node_attr("x") and batch.is_edge_attr("edge_type") and batch.num_edges == slow.num_edges
    assert torch.equal(batch.x, x[batch.n_id]) and torch.equal(batch.y, y[batch.n_id])
    assert torch.equal(batch.input_id, torch.arange(32)) and batch.batch_size == 32
    assert batch.num_sampled_nodes[0] == 32 and sum(batch.num_sampled_edges) == batch.num_edges
    made = _new_data(Data, {"x": x[:3], "num_nodes": 3})
    assert made.num_nodes == 3 and made.x.shape == (3, 4) and made.is_node_attr("x")


def test_an_epochs_seeds_made_at_once_give_the_batches_of_make():
    # an epoch gathers its seeds and input ids on the device once, not per batch: the same batches as make(positions)
    topo = skewed_graph(seed=4)
    mask = torch.zeros(300, dtype=torch.bool)
    mask[::3] = True
    for nodes in (torch.arange(50, 250), mask):
        epoch = NeighborLoader(({}, topo), [3, 2], input_nodes=nodes, batch_size=24, shuffle=True, device="cpu",
                               seed=5)
        turn = NeighborLoader(({}, topo), [3, 2], input_nodes=nodes, batch_size=24, shuffle=True, device="cpu",
                              seed=5)
        order = turn._epoch_order()
        turn._epoch += 1  # (as iterating it would)
        for batch, positions in zip(epoch, order, strict=True):
            made = turn.make(positions)
            assert torch.equal(batch.n_id, made.n_id) and torch.equal(batch.input_id, made.input_id)
            assert torch.equal(batch.edge_index, made.edge_index)


def test_gather_in_range_is_the_gather():
    table = pd.unified(torch.randn(100, 8), copy=True)
    idx = torch.tensor([5, 0, 99, 5])
    expected = table.plain()[idx]
    assert torch.equal(pd._ops.gather_in_range(table, idx), expected)
    assert torch.equal(pd._ops.gather_in_range(table, idx, pd._ops.row_layout(table)), expected)
    with torch.profiler.profile() as prof:  # (through the custom op, which the profiler sees)
        assert torch.equal(pd._ops.gather_in_range(table, idx), expected)
    assert any(e.name == "pytorch_direct::gather" for e in prof.events())
    with pytest.raises(IndexError):  # (CPU indices: the host gather checks each index as it reads it)
        pd._ops.gather_in_range(table, torch.tensor([100]))


@pytest.mark.gpu
def test_gather_in_range_on_the_gpu():
    table = pd.unified(torch.randn(1000, 8), copy=True)
    idx = torch.randint(0, 1000, (5000,), device="cuda")
    expected = table.plain()[idx.cpu()]
    assert torch.equal(pd._ops.gather_in_range(table, idx).cpu(), expected)
    assert torch.equal(pd._ops.gather_in_range(table, idx, pd._ops.row_layout(table)).cpu(), expected)
    with torch.profiler.profile():  # through the custom op, still without the bounds check
        assert torch.equal(pd._ops.gather_in_range(table, idx).cpu(), expected)
    table.requires_grad_(True)  # through the custom op, with autograd
    rows = pd._ops.gather_in_range(table, idx)
    rows.sum().backward()
    assert torch.equal(rows.detach().cpu(), expected)
    assert torch.equal(table.grad.plain().sum(1), torch.bincount(idx.cpu(), minlength=1000).float() * 8)
