"""The sampler's CUDA kernels (``cpp/src/sample_kernels.cuh``) against the torch path (the reference): on the CPU,
the kernels compiled for it (``tests/cpp/emulate_sample.cpp``, every thread run in turn) drive the package's kernel
sampler (``_sample_cuda.KernelSampler``), so its bookkeeping and the kernels' index math are checked here; on a GPU,
the real kernels. Both paths must give the same guarantees (every sampled edge exists, exact per-node counts per
hop, no edge twice without replacement, seeds first then each hop's new nodes in ascending id, ``e_id``, edge and
node types), not the same random draws; the kernel path must repeat itself under a seeded generator."""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import shutil
import subprocess
from pathlib import Path
from unittest import mock

import pytest
import torch
from test_sampling import check_subgraph, csc_from_edges, skewed_edges, skewed_graph

import pytorch_direct as pd
from pytorch_direct import _sample, _sample_cuda
from pytorch_direct._sample import Blocks
from pytorch_direct.sampling import NeighborSampler, Topology

ROOT = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")


class Emulated:
    """``_core``'s sample_*_cuda entry points, run by the kernels compiled for the CPU (the stream is ignored)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, ptr, i32, flag = ctypes.c_int64, ctypes.c_size_t, ctypes.c_int, ctypes.c_bool
        graph = [ptr, i32, ptr, i32, i64, i64, ptr, i32, i64]
        lib.emulated_take.argtypes = graph + [ptr, i64, ptr, i32, ptr, flag, ptr, ptr, ptr]
        lib.emulated_edges.argtypes = graph + [ptr, i64, ptr, i32, ptr, flag, ptr, i32, ptr, ptr, i64, ptr, ptr,
                                               ptr, ptr]
        lib.emulated_popcount.argtypes = [ptr, i64, ptr]
        lib.emulated_number.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr]
        lib.emulated_batch_workspace_bytes.argtypes = [i64, i64, i64]
        lib.emulated_batch_workspace_bytes.restype = i64
        lib.emulated_batch.argtypes = graph + [ptr, i64, ptr, i32, ptr, flag, ptr, ptr, ptr, i64, ptr, ptr, i64, i64,
                                               i64, ptr, ptr, i64, ptr]
        lib.emulated_last_error.restype = ctypes.c_char_p
        self.lib = lib
        self.launches = 0
        self.batch_calls = 0

    def sample_batch_workspace_bytes(self, slot_cap, edge_cap, words):
        return self.lib.emulated_batch_workspace_bytes(slot_cap, edge_cap, words)

    def sample_batch_cuda(self, *args):
        graph, (seeds, batch, fanouts), rest = args[:9], args[9:12], args[12:-2]  # (no device, no stream)
        hops = len(fanouts)
        fans = (ctypes.c_int * max(hops, 1))(*fanouts)
        result = (ctypes.c_int64 * (4 + 2 * hops + 1))()
        launches = self.lib.emulated_batch(*graph, seeds, batch, ctypes.addressof(fans), hops, *rest,
                                           ctypes.addressof(result))
        if launches < 0:  # (as the compiled module raises the library's invalid_argument)
            raise ValueError(self.lib.emulated_last_error().decode())
        self.launches += launches
        self.batch_calls += 1
        return list(result)

    def sample_take_cuda(self, *args):
        self.launches += 1
        self.lib.emulated_take(*args[:-1])

    def sample_edges_cuda(self, *args):
        self.launches += 1
        self.lib.emulated_edges(*args[:-1])

    def sample_popcount_cuda(self, *args):
        self.launches += 1
        self.lib.emulated_popcount(*args[:-1])

    def sample_number_cuda(self, *args):
        self.launches += 1
        self.lib.emulated_number(*args[:-1])


@pytest.fixture(scope="module")
def emulated(tmp_path_factory) -> Emulated:
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler on PATH")
    lib = tmp_path_factory.mktemp("emulate") / "libemulate_sample.so"
    build = subprocess.run(
        [cxx, "-std=c++17", "-O1", "-Wall", "-shared", "-fPIC", "-I", str(ROOT / "cpp" / "include"),
         "-I", str(ROOT / "shared-cuda" / "include"), str(ROOT / "tests" / "cpp" / "emulate_sample.cpp"),
         "-o", str(lib)],
        capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-4000:]
    return Emulated(ctypes.CDLL(str(lib)))


def kernel_sampler(topo: Topology, fanouts, emulated: Emulated | None, **kw) -> NeighborSampler:
    """A sampler on the kernel path: the real kernels on a GPU (``emulated`` None), else on the CPU through the
    emulated ones."""
    if emulated is None:
        sampler = NeighborSampler(topo, fanouts, kernels=True, **kw)
        assert sampler.kernels
        return sampler
    # (a shell whose torch path never runs: its check of the whole topology is left out, so that a bad topology
    # meets the kernels' own checks)
    with mock.patch.object(_sample, "check_topology", lambda topology: None):
        sampler = NeighborSampler(topo, fanouts, kernels=False, **kw)
    table = sampler._fanout_table if sampler.blocks is not None else None
    run = _sample_cuda.KernelSampler(topo, sampler.device, table)
    run.core = emulated
    sampler._kernel_run, sampler._use_kernels, sampler._run = run, True, run
    return sampler


def graphs():
    """(name, topology): skewed degrees (a hub, nodes without in-edges, multi-edges, self-loops), with typed edges,
    edge ids and node types; narrow index dtypes; an empty graph part; a chain (every frontier one node)."""
    src, dst = skewed_edges(300, 2, 4000)
    skewed = csc_from_edges(src, dst, 300, seed=2)
    gen = torch.Generator().manual_seed(4)
    with_ids = Topology(skewed.colptr, skewed.row, edge_type=skewed.edge_type,
                        edge_id=torch.randperm(skewed.num_edges, generator=gen),
                        node_type=torch.randint(3, (300,), generator=gen).to(torch.int8))
    narrow = Topology(skewed.colptr.to(torch.int32), skewed.row.to(torch.int32),
                      edge_type=skewed.edge_type.to(torch.uint8))
    # nodes 0..59 have in-edges, 60..299 none; 64 nodes make two bitmap words and a partial third
    few = csc_from_edges(torch.randint(300, (500,), generator=gen), torch.randint(60, (500,), generator=gen), 300)
    chain = csc_from_edges(torch.arange(1, 40), torch.arange(0, 39), 40)
    return [("skewed", skewed), ("ids", with_ids), ("narrow", narrow), ("few", few), ("chain", chain)]


# (the last repeats seeds, the hub 0 among them: each occurrence is a seed of its own)
SEED_SETS = [torch.tensor([0, 5, 3, 299]), torch.arange(0, 300, 3).flip(0), torch.tensor([3]), torch.tensor([62]),
             torch.tensor([5, 0, 5, 3, 0, 0, 8, 3, 5])]


def check_against_reference(topo: Topology, fanout, replace: bool, emulated: Emulated | None, device):
    placed = topo if device.type == "cpu" else topo.placed("device", device)
    ours = kernel_sampler(placed, fanout, emulated, replace=replace, device=device,
                          generator=torch.Generator(device).manual_seed(1))
    reference = NeighborSampler(placed, fanout, replace=replace, device=device, kernels=False,
                                generator=torch.Generator(device).manual_seed(1))
    for seeds in SEED_SETS:
        seeds = seeds[seeds < topo.num_nodes]
        if seeds.numel() == 0:
            continue
        sub = ours.sample(seeds.to(device))
        ref = reference.sample(seeds.to(device))
        try:  # (check_subgraph reads e_id as CSC positions)
            check_subgraph(dataclasses.replace(sub, e_id=sub.pos), seeds, topo, fanout, replace)
        except AssertionError as e:
            raise AssertionError(f"kernel path, seeds {seeds.tolist()[:8]}...: {e}") from e
        assert len(sub.num_sampled_nodes) == len(ref.num_sampled_nodes), "hops counted"
        assert sub.num_sampled_nodes[0] == ref.num_sampled_nodes[0]
        assert sub.num_sampled_edges[0] == ref.num_sampled_edges[0], "the first hop's counts are not random"
        if topo.edge_id is not None:
            assert torch.equal(sub.e_id.cpu(), topo.edge_id[sub.pos.cpu()].long()), "e_id: the edge ids of pos"
        else:
            assert torch.equal(sub.e_id, sub.pos), "e_id: the CSC positions"
        if topo.node_type is not None:
            assert torch.equal(sub.node_type.cpu(), topo.node_type[sub.n_id.cpu()].long()), "node_type"
        for name in ("n_id", "edge_index", "e_id", "pos"):
            assert getattr(sub, name).dtype == getattr(ref, name).dtype == torch.long, name
        assert bool((ours._local == -1).all()), "the id map is reset after the batch"
        run = ours._kernel_run
        assert int(run.unseen.count_nonzero()) == 0 and int(run.error.count_nonzero()) == 0, "the bitmap is reset"
    if fanout[0] < 0 or all(k < 0 for k in fanout):
        return
    # the same generator seed gives the same batch
    again = kernel_sampler(placed, fanout, emulated, replace=replace, device=device,
                           generator=torch.Generator(device).manual_seed(1))
    first = kernel_sampler(placed, fanout, emulated, replace=replace, device=device,
                           generator=torch.Generator(device).manual_seed(1))
    seeds = SEED_SETS[1][SEED_SETS[1] < topo.num_nodes].to(device)
    a, b = first.sample(seeds), again.sample(seeds)
    for x, y, name in zip(a.tensors(), b.tensors(), ("n_id", "edge_index", "e_id", "types", "kinds", "pos"),
                          strict=False):
        assert torch.equal(x, y), f"{name} differs between two samplers seeded alike"


FANOUTS = [[4, 3], [1], [-1, 2], [50, 50, 50], [2, -1], [3, 3, 3, 3], [3, 0], [0, 2]]


@pytest.mark.parametrize("fanout", FANOUTS)
@pytest.mark.parametrize("replace", [False, True])
@pytest.mark.parametrize("graph", [name for name, _ in graphs()])
def test_emulated_kernels_keep_the_samplers_guarantees(emulated, graph, fanout, replace):
    topo = dict(graphs())[graph]
    check_against_reference(topo, fanout, replace, emulated, CPU)


def test_emulated_kernels_read_a_unified_topology(emulated):
    # the kernels take a unified tensor's pointer (its host address); e_id and types are read from unified tensors
    topo = dict(graphs())["ids"]
    host = topo.placed("host", CPU)
    assert all(pd.is_unified(t) for t in host.tensors().values())
    sampler = kernel_sampler(host, [5, 3], emulated, device=CPU, generator=torch.Generator().manual_seed(2))
    plain = kernel_sampler(topo, [5, 3], emulated, device=CPU, generator=torch.Generator().manual_seed(2))
    for seeds in SEED_SETS:
        sub, ref = sampler.sample(seeds), plain.sample(seeds)
        check_subgraph(dataclasses.replace(sub, e_id=sub.pos), seeds, topo, [5, 3])
        for name in ("n_id", "edge_index", "e_id", "edge_type", "node_type"):
            assert torch.equal(getattr(sub, name), getattr(ref, name)), name


@pytest.mark.parametrize("replace", [False, True])
def test_emulated_kernels_sample_uniformly(emulated, replace):
    # one destination with 10 in-edges, 3 drawn (Floyd's algorithm: 9 <= 2 * 10) and one with 40 in-edges, 12
    # drawn (reservoir sampling: 144 > 80): each edge with probability 0.3, never twice without replacement
    src = torch.cat([torch.arange(2, 12), torch.arange(12, 52)])
    dst = torch.cat([torch.zeros(10, dtype=torch.long), torch.ones(40, dtype=torch.long)])
    topo = csc_from_edges(src, dst, 52)
    for node, fan, degree in ((0, 3, 10), (1, 12, 40)):
        sampler = kernel_sampler(topo, [fan], emulated, replace=replace, device=CPU,
                                 generator=torch.Generator().manual_seed(0))
        counts = torch.zeros(degree)
        trials, repeated = 3000, 0
        base = int(topo.colptr[node])
        for _ in range(trials):
            e = sampler.sample(torch.tensor([node])).e_id - base
            assert e.numel() == fan and bool(((e >= 0) & (e < degree)).all())
            repeated += e.unique().numel() < fan
            counts.index_add_(0, e, torch.ones(fan))
        freq = counts / trials
        assert bool(((freq - fan / degree).abs() < 0.05).all()), (node, freq)
        assert (repeated > 0) if replace else (repeated == 0)


def test_emulated_kernels_launch_four_kernels_per_hop(emulated):
    sampler = kernel_sampler(skewed_graph(), [4, 3, 2], emulated, device=CPU)
    emulated.launches = emulated.batch_calls = 0
    sub = sampler.sample(torch.arange(0, 300, 10))
    assert all(n > 0 for n in sub.num_sampled_edges)
    # one call into the core for the batch: four kernels per hop, then the id map's reset
    assert emulated.batch_calls == 1 and emulated.launches == 4 * 3 + 1
    sampler._kernel_run.one_call = False
    emulated.launches = emulated.batch_calls = 0
    sampler.sample(torch.arange(0, 300, 10))
    assert emulated.batch_calls == 0 and emulated.launches == 4 * 3, "per hop from Python"


def aten_ops(fn) -> int:
    """The torch operations ``fn`` dispatches (outermost ones)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    ops = 0
    for event in prof.events():
        if event.name.startswith("aten::"):
            parent = event.cpu_parent
            while parent is not None and not parent.name.startswith("aten::"):
                parent = parent.cpu_parent
            ops += parent is None
    return ops


def test_emulated_batch_dispatches_few_torch_operations(emulated):
    counts = {}
    for name, topo in graphs()[:2]:  # (without, then with edge ids and node types: gathers after the call)
        sampler = kernel_sampler(topo, [4, 3, 2], emulated, device=CPU)
        run = sampler._kernel_run
        seeds = torch.arange(0, 300, 10)
        sampler.sample(seeds)  # (the workspace made)
        for one_call in (True, False):
            run.one_call = one_call
            args = (topo.colptr, topo.row, sampler._local, seeds, sampler._sentinel, sampler._hop_fanouts, False,
                    None, topo.edge_id, topo.edge_type, topo.node_type)
            counts[name, one_call] = aten_ops(functools.partial(run, *args))
    # the random seed, the output buffer and its three views (5); then per id or type array a gather, and a
    # conversion to int64 where it is narrower (skewed: int32 edge types; ids: int64 edge ids, int8 node types too)
    assert counts["skewed", True] <= 7 and counts["ids", True] <= 10, counts
    assert counts["skewed", False] > 20, counts


@pytest.mark.parametrize("typed", [False, True])
def test_emulated_one_call_and_per_hop_draw_the_same_batch(emulated, typed):
    if typed:
        topo, blocks = typed_graph()
        fanout, kw = [[3, 1, 2], [2, -1, 1]], {"blocks": blocks}
    else:
        topo, fanout, kw = graphs()[1][1], [4, 3, 2], {}
    one = kernel_sampler(topo, fanout, emulated, device=CPU, generator=torch.Generator().manual_seed(3), **kw)
    hops = kernel_sampler(topo, fanout, emulated, device=CPU, generator=torch.Generator().manual_seed(3), **kw)
    hops._kernel_run.one_call = False
    for seeds in (torch.arange(0, 200, 7), torch.tensor([3])):
        a, b = one.sample(seeds), hops.sample(seeds)
        assert a.num_sampled_nodes == b.num_sampled_nodes and a.num_sampled_edges == b.num_sampled_edges
        for x, y in zip(a.tensors(), b.tensors(), strict=True):
            assert (x is None and y is None) or torch.equal(x, y)
        assert a.edge_index.is_contiguous()


@pytest.mark.parametrize("fanout", [[-1], [-1, -1], [2, -1], [50, 50]])
def test_emulated_batch_grows_its_capacity_and_runs_again(emulated, fanout):
    """A hub and fan-out -1: the bound is the capacity, smaller than the batch; the batch stops before drawing past
    it, and runs again with the same draws on a grown capacity."""
    topo = skewed_graph()  # (node 0 is a hub)
    small = kernel_sampler(topo, fanout, emulated, device=CPU, generator=torch.Generator().manual_seed(5))
    large = kernel_sampler(topo, fanout, emulated, device=CPU, generator=torch.Generator().manual_seed(5))
    small._kernel_run.edge_capacity = 3
    seeds = torch.tensor([0, 7, 11])
    emulated.batch_calls = 0
    a = small.sample(seeds)
    assert emulated.batch_calls > 1, "the batch ran again"
    assert small._kernel_run.edge_capacity >= a.edge_index.size(1) > 3
    b = large.sample(seeds)
    for x, y in zip(a.tensors(), b.tensors(), strict=True):
        assert (x is None and y is None) or torch.equal(x, y)
    check_subgraph(a, seeds, topo, fanout)
    assert bool((small._local == -1).all()), "the id map is reset after the batch (and after each stop)"
    emulated.batch_calls = 0
    small.sample(seeds)
    assert emulated.batch_calls == 1, "the grown capacity is kept"


@pytest.mark.parametrize("fanout", [[-1], [2]])
def test_emulated_batch_with_repeated_seeds_grows_past_its_bound(emulated, fanout):
    """The buffers' bound assumes distinct seeds (at most every edge once without replacement, or with fan-out -1):
    a seed repeated past it needs more, and the batch, stopped, must run again on more, not stop at the same place
    on every run."""
    chain = csc_from_edges(torch.arange(1, 40), torch.arange(0, 39), 40)  # 39 edges: node v's one in-edge from v + 1
    sampler = kernel_sampler(chain, fanout, emulated, device=CPU)
    seeds = torch.tensor([0] * 50 + [5])
    emulated.batch_calls = 0
    sub = sampler.sample(seeds)
    assert sub.num_sampled_edges == [51] and 1 < emulated.batch_calls <= 3
    check_subgraph(sub, seeds, chain, fanout)
    assert bool((sampler._local == -1).all())


def test_emulated_batch_bounds_its_buffers_without_a_round_trip(emulated):
    topo = skewed_graph()
    run = kernel_sampler(topo, [4, 3], emulated, device=CPU)._kernel_run
    assert run._edge_bound(10, [4, 3], False) == 10 * 4 + 10 * 4 * 3
    assert run._edge_bound(10, [-1], False) == topo.num_edges
    # (with replacement past the graph's edges; a frontier is at most every node)
    assert run._edge_bound(10, [100, 100], True) == 10 * 100 + topo.num_nodes * 100
    assert run._edge_bound(10, [100, 100], False) == 1000 + topo.num_edges
    run.edge_capacity = 50
    assert run._edge_bound(10, [4, 3], False) == 50
    typed, blocks = typed_graph()
    sampler = kernel_sampler(typed, [[3, 1, 2], [2, -1, 0]], emulated, device=CPU, blocks=blocks)
    assert sampler._kernel_run._edge_bound(5, [0, 0], False) == 5 * 6 + typed.num_edges


def test_the_compiled_batch_call_takes_the_samplers_arguments(emulated):
    """The compiled module's sample_batch_cuda with the very arguments the sampler passes (only a null workspace):
    refused for that by its first check, before any CUDA call, so the argument list is checked without a GPU."""
    sampler = kernel_sampler(skewed_graph(), [4, 3], emulated, device=CPU)
    run = sampler._kernel_run
    calls = []

    class Capture:
        def sample_batch_workspace_bytes(self, *args):
            return emulated.sample_batch_workspace_bytes(*args)

        def sample_batch_cuda(self, *args):
            calls.append(args)
            return emulated.sample_batch_cuda(*args)

    run.core = Capture()
    sampler.sample(torch.arange(0, 300, 10))
    args = list(calls[0])
    args[19] = 0  # (the workspace)
    with pytest.raises((ValueError, pd.UnavailableError), match="null sampler buffer|without CUDA"):
        pd._core.sample_batch_cuda(*args)


def test_emulated_batch_names_bad_buffers(emulated):
    sampler = kernel_sampler(skewed_graph(), [4, 3], emulated, device=CPU)
    run = sampler._kernel_run
    seeds = torch.arange(0, 300, 10)
    sampler.sample(seeds)
    run.workspace_bytes //= 2
    with pytest.raises(ValueError, match="workspace is smaller than sample_batch_workspace_bytes"):
        sampler.sample(seeds)
    assert bool((sampler._local == -1).all()) and int(run.unseen.count_nonzero()) == 0


def test_emulated_kernels_name_a_bad_topology(emulated):
    topo = skewed_graph()
    bad_row = Topology(topo.colptr, topo.row.clone())
    bad_row.row[int(topo.colptr[5])] = 300  # node 5's first in-edge comes from no node
    sampler = kernel_sampler(bad_row, [-1], emulated, device=CPU)
    with pytest.raises(ValueError, match=r"topology.row\[\d+\] holds a node id outside \[0, 300\)"):
        sampler.sample(torch.tensor([5]))
    assert bool((sampler._local == -1).all())
    assert int(sampler._kernel_run.error.count_nonzero()) == 0, "the error pair is cleared for the next batch"
    with pytest.raises(IndexError, match=r"seed ids must lie in \[0, 300\)"):  # refused before any kernel runs
        sampler.sample(torch.tensor([1, 2, 300]))
    check_subgraph(sampler.sample(torch.tensor([6])), torch.tensor([6]), bad_row, [-1])
    bad_colptr = Topology(topo.colptr.clone(), topo.row)
    bad_colptr.colptr[8] = topo.num_edges + 5
    sampler = kernel_sampler(bad_colptr, [2], emulated, device=CPU)
    with pytest.raises(ValueError, match="colptr is not a CSC offset array at node 7"):
        sampler.sample(torch.tensor([7]))


def typed_graph(num_nodes=200, edges=3000, types=3, seed=0):
    """(topology, blocks): one node type, ``types`` edge types; a hub, nodes without in-edges, each node's in-edges
    grouped by type (the layout of a heterogeneous graph's CSC)."""
    gen = torch.Generator().manual_seed(seed)
    src, dst = skewed_edges(num_nodes, seed, edges)
    etype = torch.randint(types, (edges,), generator=gen)
    order = torch.argsort(dst * types + etype)
    colptr = torch.zeros(num_nodes + 1, dtype=torch.long)
    colptr[1:] = torch.bincount(dst, minlength=num_nodes).cumsum(0)
    topo = Topology(colptr, src[order].to(torch.int32), edge_type=etype[order].to(torch.int32))
    return topo, Blocks(node_offset=(0, num_nodes), src_type=(0,) * types, dst_type=(0,) * types)


def check_typed(sub, seeds, topo: Topology, table: list[list[int]], replace: bool) -> None:
    """Every sampled edge exists; per hop, per frontier node and edge type, the fan-out's count of its in-edges of
    that type; no edge twice without replacement; seeds first, then each hop's new nodes in ascending id."""
    colptr, row, etype = topo.colptr, topo.row.long(), topo.edge_type.long()
    sub = sub.to("cpu")
    n_id, (src_l, dst_l) = sub.n_id, sub.edge_index
    assert torch.equal(n_id[: sub.batch_size], seeds), "the seeds come first, in order"
    repeats = seeds.numel() - seeds.unique().numel()
    assert n_id.unique().numel() == n_id.numel() - repeats, "every node appears once (a repeated seed per occurrence)"
    later = torch.tensor([v in seeds[:i].tolist() for i, v in enumerate(seeds.tolist())], dtype=torch.bool)
    assert not bool(torch.isin(src_l, later.nonzero().flatten()).any()), \
        "an edge from a repeated seed points at its first occurrence"
    assert torch.equal(n_id[src_l], row[sub.pos]), "sources are the sampled edges' sources"
    assert torch.equal(n_id[dst_l], torch.searchsorted(colptr, sub.pos, right=True) - 1), "destinations"
    assert torch.equal(sub.edge_type, etype[sub.pos]), "edge types"
    node_lo, edge_lo = 0, 0
    for hop, fans in enumerate(table):
        n_nodes, n_edges = sub.num_sampled_nodes[hop], sub.num_sampled_edges[hop]
        pos, dsts = sub.pos[edge_lo: edge_lo + n_edges], dst_l[edge_lo: edge_lo + n_edges]
        for local in range(node_lo, node_lo + n_nodes):
            v = int(n_id[local])
            types = etype[colptr[v]: colptr[v + 1]]
            mine = pos[dsts == local]
            for t, fan in enumerate(fans):
                degree = int((types == t).sum())
                expected = degree if fan < 0 else (fan if degree > 0 else 0) if replace else min(degree, fan)
                got = int((etype[mine] == t).sum())
                assert got == expected, f"hop {hop}, node {v}, edge type {t}: {got} edges, expected {expected}"
        if not replace:  # (per destination place: a repeated seed's occurrences draw apart)
            assert torch.stack([dsts, pos]).unique(dim=1).size(1) == pos.numel(), f"hop {hop}: an edge drawn twice"
        new = n_id[node_lo + n_nodes: node_lo + n_nodes + sub.num_sampled_nodes[hop + 1]]
        assert torch.equal(new, new.sort().values), f"hop {hop}: new nodes not in ascending id"
        node_lo, edge_lo = node_lo + n_nodes, edge_lo + n_edges


TYPED_FANOUTS = [[[2, -1, 0], [1, 3, 2]], [[5, 5, 5]], [[-1, -1, -1], [0, 1, 0]], [[40, 1, 3], [2, 2, 2], [1, 1, 1]],
                 [[2, 0, 1], [0, 0, 0]]]


def check_typed_against_reference(table, replace: bool, emulated: Emulated | None, device):
    topo, blocks = typed_graph()
    placed = topo if device.type == "cpu" else topo.placed("device", device)
    ours = kernel_sampler(placed, table, emulated, replace=replace, device=device, blocks=blocks,
                          generator=torch.Generator(device).manual_seed(1))
    reference = NeighborSampler(placed, table, replace=replace, device=device, blocks=blocks, kernels=False,
                                generator=torch.Generator(device).manual_seed(1))
    for seeds in (torch.tensor([0, 5, 3, 199]), torch.arange(0, 200, 3).flip(0), torch.tensor([3]),
                  torch.tensor([5, 0, 5, 3, 0, 0, 8, 3, 5])):
        sub, ref = ours.sample(seeds.to(device)), reference.sample(seeds.to(device))
        check_typed(sub, seeds, topo, table, replace)
        check_typed(ref, seeds, topo, table, replace)  # (the check itself, on the reference)
        assert sub.num_sampled_edges[0] == ref.num_sampled_edges[0], "the first hop's counts are not random"
        assert bool((sub.node_type == 0).all()) and sub.node_type.numel() == sub.n_id.numel(), "node types"
        assert bool((ours._local == -1).all()), "the id map is reset after the batch"


@pytest.mark.parametrize("table", TYPED_FANOUTS)
@pytest.mark.parametrize("replace", [False, True])
def test_emulated_typed_kernels_keep_the_samplers_guarantees(emulated, table, replace):
    check_typed_against_reference(table, replace, emulated, CPU)


def test_emulated_typed_kernels_name_a_bad_edge_type(emulated):
    topo, blocks = typed_graph()
    types = topo.edge_type.clone()
    types[int(topo.colptr[0])] = 7
    bad = Topology(topo.colptr, topo.row, edge_type=types)
    sampler = kernel_sampler(bad, [[2, 2, 2]], emulated, device=CPU, blocks=blocks)
    with pytest.raises(ValueError, match=r"topology.edge_type\[\d+\] is outside \[0, 3\)"):
        sampler.sample(torch.tensor([0]))
    assert bool((sampler._local == -1).all())


def check_no_hops(emulated: Emulated | None, device) -> None:
    """num_neighbors=[] (PyG: zero hops, the seeds alone) on the kernel path, homogeneous and typed: the sampler
    answers it without calling the kernels (a batch of no hops draws nothing), whose state stays clean."""
    topo, blocks = typed_graph()
    placed = topo if device.type == "cpu" else topo.placed("device", device)
    seeds = torch.tensor([5, 0, 5, 3, 199])
    for kw in ({}, {"blocks": blocks}):
        sampler = kernel_sampler(placed, [], emulated, device=device, **kw)
        if emulated is not None:
            emulated.launches = emulated.batch_calls = 0
        sub = sampler.sample(seeds.to(device)).to("cpu")
        assert torch.equal(sub.n_id, seeds) and sub.edge_index.shape == (2, 0) and sub.e_id.numel() == 0
        assert sub.num_sampled_nodes == [5] and sub.num_sampled_edges == []
        assert torch.equal(sub.edge_type, torch.empty(0, dtype=torch.long))
        if emulated is not None:
            assert emulated.launches == emulated.batch_calls == 0
        assert bool((sampler._local == -1).all())
        assert int(sampler._kernel_run.unseen.count_nonzero()) == 0


def test_emulated_kernel_path_takes_no_hops(emulated):
    # the sampler refused num_neighbors=[]; with it accepted, the kernel sampler of a typed graph failed to start
    # (its fan-out table, made from no rows, was 1-D: "Dimension out of range" reading its edge types)
    check_no_hops(emulated, CPU)


def check_negative_fanouts(emulated: Emulated | None, device) -> None:
    """Any negative fan-out (pyg-lib: every in-edge) reaches the kernels as -1, whatever its size: the homogeneous
    fan-outs are C ints (a value past them, such as -2**40, read as 0 there, took no edge), the typed table int64;
    the batches are those of -1."""
    topo, blocks = typed_graph()
    placed = topo if device.type == "cpu" else topo.placed("device", device)
    seeds = torch.tensor([5, 0, 5, 3, 199])
    cases = [([-2, 3], [-1, 3], {}), ([3, -(2**40)], [3, -1], {}),
             ([[-3, 2, -(2**40)], [1, -9, 0]], [[-1, 2, -1], [1, -1, 0]], {"blocks": blocks})]
    for replace in (False, True):
        for given, normalised, kw in cases:
            ours = kernel_sampler(placed, given, emulated, device=device, replace=replace,
                                  generator=torch.Generator(device).manual_seed(2), **kw)
            ref = kernel_sampler(placed, normalised, emulated, device=device, replace=replace,
                                 generator=torch.Generator(device).manual_seed(2), **kw)
            run = ours._kernel_run
            if kw:
                assert run.fanout_table.tolist() == normalised
            else:
                assert ours._hop_fanouts == normalised
            sub, expected = ours.sample(seeds.to(device)), ref.sample(seeds.to(device))
            if kw:
                check_typed(sub, seeds, topo, normalised, replace)
            else:
                check_subgraph(dataclasses.replace(sub, e_id=sub.pos), seeds, topo, normalised, replace)
            assert sub.num_sampled_edges == expected.num_sampled_edges
            for a, b in zip(sub.tensors(), expected.tensors(), strict=True):
                assert torch.equal(a, b)


def test_emulated_kernels_take_any_negative_fanout_as_minus_one(emulated):
    check_negative_fanouts(emulated, CPU)


def check_fanouts_past_a_c_int(emulated: Emulated | None, device) -> None:
    """A fan-out past a C int (the kernels' homogeneous fan-outs; the emulated ones read 2**32 + 3 as 3, the
    compiled module refused it) reaches them as -1 without replacement: every in-edge, as on the torch path."""
    topo = skewed_graph()
    placed = topo if device.type == "cpu" else topo.placed("device", device)
    sampler = kernel_sampler(placed, [2**32 + 3, 2], emulated, device=device)
    assert sampler._hop_fanouts == [-1, 2]
    for seeds in SEED_SETS:
        sub = sampler.sample(seeds.to(device))
        check_subgraph(dataclasses.replace(sub, e_id=sub.pos), seeds, topo, [-1, 2])


def test_emulated_kernels_take_a_fanout_past_a_c_int(emulated):
    check_fanouts_past_a_c_int(emulated, CPU)


def check_hops_of_zero_fanouts_change_no_batch(emulated: Emulated | None, device) -> None:
    """Hops whose fan-outs are all 0 after the last that samples: the same batches, one after another, as without
    them (the kernels draw one random seed per batch, and nothing in a hop that takes no edge), as the torch path."""
    topo, blocks = typed_graph()
    placed = topo if device.type == "cpu" else topo.placed("device", device)
    for replace in (False, True):
        ours = kernel_sampler(placed, [[2, 1, 3], [0, 0, 0], [0, 0, 0]], emulated, device=device, replace=replace,
                              blocks=blocks, generator=torch.Generator(device).manual_seed(4))
        alone = kernel_sampler(placed, [[2, 1, 3]], emulated, device=device, replace=replace, blocks=blocks,
                               generator=torch.Generator(device).manual_seed(4))
        for seeds in (torch.tensor([0, 5, 3, 199]), torch.arange(0, 200, 7), torch.tensor([5, 0, 5, 3])):
            sub, ref = ours.sample(seeds.to(device)), alone.sample(seeds.to(device))
            assert sub.num_sampled_edges == ref.num_sampled_edges + [0, 0]
            assert sub.num_sampled_nodes == ref.num_sampled_nodes + [0, 0]
            for a, b in zip(sub.tensors(), ref.tensors(), strict=True):
                assert torch.equal(a, b)


def test_emulated_hops_of_zero_fanouts_change_no_batch(emulated):
    check_hops_of_zero_fanouts_change_no_batch(emulated, CPU)


def test_the_kernel_path_is_chosen_and_refused_by_name():
    topo = skewed_graph()
    assert not NeighborSampler(topo, [2]).kernels  # the CPU: the torch path, silently
    with pytest.raises(ValueError, match="kernels cannot be used: sampling runs on cpu"):
        NeighborSampler(topo, [2], kernels=True)
    compiled = pd._core.kernels_compiled()
    for blocks in (None, typed_graph()[1]):
        reason = _sample_cuda.unsupported(topo, torch.device("cuda", 0), blocks)
        assert reason is None if compiled else "built without CUDA kernels" in reason
    floats = Topology(topo.colptr, topo.row, edge_type=topo.edge_type)
    floats.edge_type = floats.edge_type.float()  # (past Topology's own check)
    if compiled:
        assert "edge_type has dtype torch.float32" in _sample_cuda.unsupported(floats, torch.device("cuda", 0),
                                                                               typed_graph()[1])


# ---- the real kernels ------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("fanout", FANOUTS)
@pytest.mark.parametrize("replace", [False, True])
@pytest.mark.parametrize("graph", [name for name, _ in graphs()])
def test_gpu_kernels_keep_the_samplers_guarantees(graph, fanout, replace):
    topo = dict(graphs())[graph]
    check_against_reference(topo, fanout, replace, None, torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("table", TYPED_FANOUTS)
@pytest.mark.parametrize("replace", [False, True])
def test_gpu_typed_kernels_keep_the_samplers_guarantees(table, replace):
    check_typed_against_reference(table, replace, None, torch.device("cuda"))


@pytest.mark.gpu
def test_gpu_kernels_read_a_unified_topology_zero_copy():
    gpu = torch.device("cuda")
    topo = skewed_graph(seed=9)
    host = topo.placed("host", gpu)
    sampler = NeighborSampler(host, [5, 3], device=gpu, generator=torch.Generator(gpu).manual_seed(0))
    assert sampler.kernels
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # as the loader samples: on a side stream
        subs = [sampler.sample(s.to(gpu)) for s in SEED_SETS]
    stream.synchronize()
    for seeds, sub in zip(SEED_SETS, subs, strict=True):
        check_subgraph(sub, seeds, topo, [5, 3])


@pytest.mark.gpu
@pytest.mark.parametrize("replace", [False, True])
def test_gpu_kernels_sample_uniformly(replace):
    gpu = torch.device("cuda")
    src = torch.cat([torch.arange(2, 12), torch.arange(12, 52)])
    dst = torch.cat([torch.zeros(10, dtype=torch.long), torch.ones(40, dtype=torch.long)])
    topo = csc_from_edges(src, dst, 52).placed("device", gpu)
    samplers = {node: NeighborSampler(topo, [fan], replace=replace, device=gpu, kernels=True,
                                      generator=torch.Generator(gpu).manual_seed(node))
                for node, fan in ((0, 3), (1, 12))}
    trials = 2000
    counts = {0: torch.zeros(10, device=gpu), 1: torch.zeros(40, device=gpu)}
    for _ in range(trials):
        for node, fan in ((0, 3), (1, 12)):
            e = samplers[node].sample(torch.tensor([node], device=gpu)).e_id - int(topo.colptr[node])
            assert e.numel() == fan
            if not replace:
                assert e.unique().numel() == fan, "an edge drawn twice without replacement"
            counts[node].index_add_(0, e, torch.ones(fan, device=gpu))
    for node, fan, degree in ((0, 3, 10), (1, 12, 40)):
        freq = counts[node].cpu() / trials
        assert bool(((freq - fan / degree).abs() < 0.05).all()), (node, freq)


@pytest.mark.gpu
@pytest.mark.parametrize("typed", [False, True])
def test_gpu_one_call_and_per_hop_draw_the_same_batch(typed):
    gpu = torch.device("cuda")
    if typed:
        topo, blocks = typed_graph()
        fanout, kw = [[3, 1, 2], [2, -1, 1]], {"blocks": blocks}
    else:
        topo, fanout, kw = graphs()[1][1], [4, 3, 2], {}
    placed = topo.placed("device", gpu)
    one = NeighborSampler(placed, fanout, device=gpu, kernels=True, generator=torch.Generator(gpu).manual_seed(3),
                          **kw)
    hops = NeighborSampler(placed, fanout, device=gpu, kernels=True, generator=torch.Generator(gpu).manual_seed(3),
                           **kw)
    hops._kernel_run.one_call = False
    for seeds in (torch.arange(0, 200, 7), torch.tensor([3])):
        a, b = one.sample(seeds.to(gpu)), hops.sample(seeds.to(gpu))
        assert a.num_sampled_nodes == b.num_sampled_nodes and a.num_sampled_edges == b.num_sampled_edges
        for x, y in zip(a.tensors(), b.tensors(), strict=True):
            assert (x is None and y is None) or torch.equal(x, y)


@pytest.mark.gpu
@pytest.mark.parametrize("fanout", [[-1, -1], [50, 50]])
def test_gpu_batch_grows_its_capacity_and_runs_again(fanout):
    gpu = torch.device("cuda")
    topo = skewed_graph()
    placed = topo.placed("device", gpu)
    small = NeighborSampler(placed, fanout, device=gpu, kernels=True, generator=torch.Generator(gpu).manual_seed(5))
    large = NeighborSampler(placed, fanout, device=gpu, kernels=True, generator=torch.Generator(gpu).manual_seed(5))
    small._kernel_run.edge_capacity = 3
    seeds = torch.tensor([0, 7, 11], device=gpu)
    a, b = small.sample(seeds), large.sample(seeds)
    assert small._kernel_run.edge_capacity >= a.edge_index.size(1) > 3
    for x, y in zip(a.tensors(), b.tensors(), strict=True):
        assert (x is None and y is None) or torch.equal(x, y)
    check_subgraph(a, seeds.cpu(), topo, fanout)
    assert bool((small._local == -1).all())
    run = small._kernel_run
    run.workspace_bytes //= 2
    with pytest.raises(ValueError, match="workspace is smaller than sample_batch_workspace_bytes"):
        small.sample(seeds)
    assert bool((small._local == -1).all()) and int(run.unseen.count_nonzero()) == 0


@pytest.mark.gpu
def test_gpu_kernels_name_a_bad_topology():
    gpu = torch.device("cuda")
    topo = skewed_graph()
    row = topo.row.clone()
    row[int(topo.colptr[5])] = 300
    sampler = NeighborSampler(Topology(topo.colptr, row).placed("device", gpu), [-1], device=gpu, kernels=True)
    with pytest.raises(ValueError, match=r"topology.row\[\d+\] holds a node id outside \[0, 300\)"):
        sampler.sample(torch.tensor([5], device=gpu))
    assert bool((sampler._local == -1).all())
    sub = sampler.sample(torch.tensor([6], device=gpu))
    check_subgraph(sub, torch.tensor([6]), Topology(topo.colptr, row), [-1])


@pytest.mark.gpu
@pytest.mark.parametrize("replace", [False, True])
def test_gpu_kernels_take_zero_fanouts_and_no_hops(replace):
    # PyG (pyg-lib) draws nothing for a fan-out of 0 and samples len(num_neighbors) hops; the kernels' take count
    # for a fan-out of 0 is 0 (take_of), so the hop ends with no edge and the batch's later hops with it
    gpu = torch.device("cuda")
    for fanout in ([3, 0], [0, 2], [0], [2, 0, 4]):
        check_against_reference(dict(graphs())["skewed"], fanout, replace, None, gpu)
    for table in ([[2, 0, 1], [0, 0, 0]], [[0, 0, 0]], [[0, 3, 0], [1, 0, 2]]):
        check_typed_against_reference(table, replace, None, gpu)
    check_no_hops(None, gpu)
    topo = skewed_graph()
    for fanout in ([3, 0], [0, 2], []):
        for one_call in (True, False):
            sampler = NeighborSampler(topo.placed("device", gpu), fanout, replace=replace, device=gpu, kernels=True)
            sampler._kernel_run.one_call = one_call
            for seeds in SEED_SETS:
                sub = sampler.sample(seeds.to(gpu)).to("cpu")
                check_subgraph(sub, seeds, topo, fanout, replace)
                if not fanout or fanout[0] == 0:
                    assert sub.num_edges == 0 and torch.equal(sub.n_id, seeds)
                assert bool((sampler._local == -1).all())


@pytest.mark.gpu
def test_gpu_kernels_take_any_negative_fanout_as_minus_one():
    check_negative_fanouts(None, torch.device("cuda"))


@pytest.mark.gpu
def test_gpu_kernels_take_a_fanout_past_a_c_int():
    check_fanouts_past_a_c_int(None, torch.device("cuda"))


@pytest.mark.gpu
def test_gpu_hops_of_zero_fanouts_change_no_batch():
    check_hops_of_zero_fanouts_change_no_batch(None, torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("fanout", [[-1], [3, 2]])
def test_gpu_kernels_take_repeated_seeds_as_pyg_does(fanout):
    # A seed per occurrence, as PyG's samplers: the take kernel's id map keeps each repeated seed's first place
    # (atomicMin, whatever order its threads write in), and a batch past its buffers' bound runs again on more.
    gpu = torch.device("cuda")
    topo = skewed_graph()
    sampler = NeighborSampler(topo.placed("device", gpu), fanout, device=gpu, kernels=True)
    for seeds in (torch.tensor([0] * 64 + [7, 7, 3, 0]), torch.tensor([5, 1, 5, 1, 5])):
        sub = sampler.sample(seeds.to(gpu)).to("cpu")
        assert sub.batch_size == seeds.numel()
        check_subgraph(sub, seeds, topo, fanout)
        assert bool((sampler._local == -1).all())
