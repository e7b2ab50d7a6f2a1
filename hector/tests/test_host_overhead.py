"""Host work per training step of the CUDA backend (``benchmarks/host_overhead.py``, a null executor on the CPU):
the launches a step makes must not grow back. Counts, never times: a small graph's GPU step is bound by them."""

import csv
import importlib.util
import struct
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import hector
from hector.runtime import graph as graph_mod

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))


def _load():
    spec = importlib.util.spec_from_file_location("hector_bench_host_overhead", BENCH / "host_overhead.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


host_overhead = _load()

# launches per forward + backward step (torch ops that launch on a GPU + generated kernels) reached on the tiny
# graph; before the launch plans, the zero-fill pool and the leaner graph preparation: rgcn 20 / 76, rgat 33 / 89,
# hgt 53 / 111 (persistent graph / new edge_index tensors). Where the cost model picks sorted scatter (RGCN and HGT
# here; RGAT's sorted plan has two kernels more and loses on this graph), a new graph also builds one sorted layout
# per index summed by (a sort, a binary search, a cast: 4 launches each, 8 in all), which the 60 / 80 before it did
# not have; a new graph also reads whether its destinations are already sorted (2 launches, with the id check's
# host read: where they are, the sort and four gathers are left out; this graph's edges are shuffled). The unique
# (source, relation) pairs of a new graph are computed with 13 launches of hector's own (their count read with the
# ids' check: one host read per graph), where torch.unique counted as one op here but launches several kernels on a
# GPU and reads its size on the host before it returns; the edges' columns are reordered in one gather and cast to
# int32 in one cast; a small graph's pairs are then found from marks in a table of every (source, relation) key,
# without the sort (one launch fewer than the 13 before, three fewer than the sort, which no longer scatters keys)
LIMITS = {
    ("rgcn", "persistent"): 16, ("rgcn", "new"): 65,
    ("rgat", "persistent"): 26, ("rgat", "new"): 72,
    ("hgt", "persistent"): 38, ("hgt", "new"): 86,
}


# a step on a graph prepared ahead (hector.prepare_graph(..., layers=...), as a loader thread does) may launch at
# most this many more than a step on a persistent graph: everything per graph is built before the step
PREPARED_EXTRA = 2


@pytest.mark.parametrize("graph", ["tiny", "batch1000"])
@pytest.mark.parametrize("model", ["rgcn", "rgat", "hgt"])
def test_prepared_graph_steps_launch_as_persistent_ones(model, graph):
    """A new graph each step, prepared before the step for the layer: the step launches (nearly) what a step on
    one graph reused for every step launches; the same step on an unprepared new graph launches more (the plans,
    layouts and indices built in it), so the count measures what preparing moved out of the step."""
    persistent = host_overhead.measure(graph, model, "persistent", steps=1, warmup=2)
    prepared = host_overhead.measure(graph, model, "prepared", steps=1, warmup=2)
    new = host_overhead.measure(graph, model, "new", steps=1, warmup=2)
    assert prepared["launches"] <= persistent["launches"] + PREPARED_EXTRA, (
        f"{model} on {graph}: a prepared graph's step launches {prepared['launches']}, a persistent graph's "
        f"{persistent['launches']}; ops: {prepared['top_ops']}")
    assert prepared["kernels"] == persistent["kernels"] > 0
    assert new["launches"] > prepared["launches"] + 10, (new["launches"], prepared["launches"])


@pytest.mark.parametrize("model", ["rgcn", "rgat", "hgt"])
def test_launches_per_step_do_not_regress(model):
    for mode in ("persistent", "new"):
        row = host_overhead.measure("tiny", model, mode, steps=1, warmup=2)
        limit = LIMITS[(model, mode)]
        assert row["launches"] <= limit, (f"{model} {mode}: {row['launches']} launches per step, more than "
                                          f"{limit}; ops: {row['top_ops']}")
        assert row["kernels"] > 0 and row["device_ops"] > 0


def test_null_backend_is_scoped():
    """The benchmark's backend swap and thread setting end with it: later layer calls run as before."""
    from hector.runtime import compiled as compiled_mod

    select, threads = compiled_mod.select, torch.get_num_threads()
    with host_overhead.null_backend() as executor:
        assert compiled_mod.select(torch.device("cpu"), torch.float32).executor is executor
    host_overhead.measure("tiny", "rgcn", "persistent", steps=1, warmup=1)
    assert compiled_mod.select is select and torch.get_num_threads() == threads


def test_compiled_mode_runs_the_same_kernels():
    """The compiled step (the layer as one custom op under torch.compile) launches the same generated kernels as
    the eager one: nothing recomputed, nothing re-lowered; only its host time differs."""
    for model in ("rgcn", "hgt"):
        eager = host_overhead.measure("tiny", model, "persistent", steps=1, warmup=2)
        compiled = host_overhead.measure("tiny", model, "compiled", steps=1, warmup=2)
        assert compiled["kernels"] == eager["kernels"] > 0, (model, compiled["kernels"], eager["kernels"])


def test_cli_smoke(tmp_path, capsys):
    out = tmp_path / "host.csv"
    host_overhead.main(["--graphs", "tiny", "--models", "rgcn,hgt", "--modes", "persistent,new,compiled", "--steps",
                        "1", "--csv", str(out)])
    text = capsys.readouterr().out
    assert "launches" in text and "hgt" in text and "vs_eager" in text
    lines = out.read_text().splitlines()
    assert len(lines) == 7 and lines[0].startswith("graph,model,mode")
    rows = list(csv.DictReader(lines))
    for r in rows:  # the compiled rows give the eager step's host time over theirs, the others nothing
        if r["mode"] == "compiled":
            eager = next(e for e in rows if e["mode"] == "persistent" and e["model"] == r["model"])
            assert float(r["vs_eager"]) == pytest.approx(float(eager["host_ms"]) / float(r["host_ms"]), abs=0.01)
        else:
            assert r["vs_eager"] == "-"


# Python function calls (cProfile's count: the same on every machine) to build the launch plans of the GNN
# benchmark's two RGAT layers on a new graph (prepare_graph(..., layers=model) after a first training step): 2,534
# when every program resolved each kernel's grid and graph arguments through the graph's caches on its own and both
# backward variants were built per layer; each graph argument and grid is now resolved once per graph, and a
# layer builds the backward its last training call used. 1,029 before the call records: they pack each kernel's
# arguments once per graph (here, in the plans) where the step packed them at every launch, so the plans grew and
# the step shrank (1,549 -> 806 calls), and a new graph's plans and step together cost fewer calls (2,578 -> 2,489).
# 1,694 -> 1,770 when the launch batches' temporaries began to share their allocation's ranges once dead (a take
# and a give per temporary, placed once per graph), which keeps a call's memory to what kernel by kernel holds;
# 1,793 -> 1,809 when the backward's zero fill (its pool's) became a launch of its batch, packed once per graph
# (the step: 706 -> 610 calls, with the lighter autograd entry and exit). 1,825 -> 726 when a new graph's records
# became its programs' layouts with the graph's numbers written in (one executor instantiate per launch batch, no
# packing per graph), prepare_graph replayed the programs worked out on the first graph, and the tile schedules'
# launches were packed once (plans and step: 2,475 -> 1,356)
PLANS_CALLS = 780
NEW_GRAPH_CALLS = 1450


def test_split_counts_per_new_graph():
    """The host work of one new graph of the GNN benchmark's model (``--split``): one host read in all (the ids'
    check, the destinations' order and the unique-pair count in one transfer), launch plans built from each graph
    argument once, and a step on the prepared graph that launches what a persistent graph's step launches."""
    row = host_overhead.measure_split("minibatch", "gnn2", steps=0, warmup=2)
    assert row["host_reads"] == 1, row
    assert row["plans_calls"] <= PLANS_CALLS, row
    assert row["plans_calls"] + row["step_calls"] <= NEW_GRAPH_CALLS, row
    assert row["prepare_launches"] > 0 and row["plans_launches"] > 0 and row["step_launches"] > 0
    persistent = host_overhead.measure("tiny", "rgat", "persistent", steps=1, warmup=2)
    prepared = host_overhead.measure_split("tiny", "rgat", steps=0, warmup=2)
    assert prepared["step_launches"] <= persistent["launches"] + PREPARED_EXTRA, (prepared, persistent)


@pytest.mark.parametrize("model", ["gnn2", "hgt"])
def test_new_graph_host_work_does_not_grow_with_relations(model):
    """A new graph's preparation, launch plans and step cost the host what the batch holds, not what the model
    has: the same launches, host reads and (within a few) Python calls at 16 and at 10,000 relations, the batch's
    relation ids skewed so that a few hundred of the 10,000 are present. A per-relation loop anywhere would add
    thousands of calls or launches. Counts, never times."""
    from hector.datasets.synthetic import DatasetSpec

    few = host_overhead.measure_split(DatasetSpec("r16", 300, 1200, 16, 3, 2.0), model, steps=0, warmup=1)
    many = host_overhead.measure_split(DatasetSpec("r10000", 300, 1200, 10_000, 3, 2.0), model, steps=0, warmup=1)
    assert many["host_reads"] == few["host_reads"] == 1
    for phase in ("prepare", "plans", "step"):
        assert many[f"{phase}_calls"] <= few[f"{phase}_calls"] * 1.1 + 20, (phase, few, many)
    # launches of a new graph in all: at 10,000 relations the cost model may segment the edges by relation where
    # at 16 it segments the pairs, whose layout comes with the graph's (5 launches in the plans instead); and at 16
    # the table of every (source, relation) key is small enough for the pairs to be marked in it (3 launches fewer
    # than their sort, which 10,000 relations take: a fixed number either way)
    launches = [sum(row[f"{phase}_launches"] for phase in ("prepare", "plans", "step")) for row in (few, many)]
    assert launches[1] <= launches[0] + 6 + 3, (few, many)


def test_split_cli_smoke(tmp_path, capsys):
    out = tmp_path / "split.csv"
    host_overhead.main(["--split", "--graphs", "tiny", "--models", "gnn2,rgcn", "--steps", "1", "--csv", str(out)])
    text = capsys.readouterr().out
    assert "plans_ms" in text and "gnn2" in text
    lines = out.read_text().splitlines()
    assert len(lines) == 3 and lines[0].startswith("graph,model,edges,relations,prepare_ms,plans_ms,step_ms")
    row = dict(zip(lines[0].split(","), lines[1].split(","), strict=True))
    assert float(row["total_ms"]) == pytest.approx(float(row["prepare_ms"]) + float(row["plans_ms"])
                                                   + float(row["step_ms"]), abs=2e-3)
    assert float(row["persistent_ms"]) > 0 and int(row["host_reads"]) == 1
    with pytest.raises(SystemExit):
        host_overhead.main(["--graphs", "tiny", "--models", "gnn2"])  # the two-layer model is --split's only


def test_jit_launch_packs_what_the_checked_call_packs(monkeypatch):
    """The GPU executor's lean launch gives the driver exactly what shared-cuda's checked kernel call gives it:
    the same argument bytes (tensors as device pointers, integers and floats by the signature), grid, block,
    shared memory and stream."""
    from hector import _shared_cuda
    from hector.runtime.cuda import JitExecutor

    class Recorder:
        name = "k"

        def __init__(self):
            self.calls = []

        def launch(self, grid, block, smem, stream, packed):
            self.calls.append((list(grid), list(block), smem, stream, list(packed)))

    monkeypatch.setattr(_shared_cuda, "_on_cuda", lambda value: True)  # CPU tensors stand in for the GPU's
    recorder = Recorder()
    kernel = _shared_cuda.Kernel(recorder, "ptr, i64, ptr, i32, f32, u64, ptr, f64")
    a, b, c = torch.arange(4.0), torch.zeros(3, dtype=torch.int32), torch.ones(2)
    args = [a, 2**40 + 3, b, -7, 0.5, 2**63 + 1, c, -1.25]
    kernel((9, 2), 128, *args, shared_memory=4096, stream=1234)
    JitExecutor().launch(kernel, (9, 2), 128, args, 4096, 1234)
    assert len(recorder.calls) == 2 and recorder.calls[0] == recorder.calls[1]
    assert recorder.calls[1][4][0] == struct.pack("Q", a.data_ptr())
    with pytest.raises(ValueError):  # one argument per parameter: a plan that lost one fails, never shifts
        JitExecutor().launch(kernel, (9, 2), 128, args[:-1], 4096, 1234)


def test_model_prepared_after_its_first_step_builds_what_its_step_uses():
    """``prepare_graph(..., layers=model)`` for the GNN benchmark's model: before its first training step, every
    layer's forward and both backwards (x with and without a gradient); after it, the backward each layer used
    (none for x of the first layer, on fixed features; x's for the second): four plans, and the step builds none."""
    from hector.runtime.cuda import device_graph

    def plans(graph):
        return len(device_graph(graph).calls)

    torch.manual_seed(0)
    net = host_overhead.GNN2(16, 4, 2, 8, 3).train()
    x = torch.randn(60, 16)
    g = torch.Generator().manual_seed(0)
    with host_overhead.null_backend():
        for expected in (6, 4, 4):
            ei, et = torch.randint(0, 60, (2, 200), generator=g), torch.randint(0, 8, (200,), generator=g)
            graph = hector.prepare_graph(ei, et, 60, 8, layers=net)
            assert plans(graph) == expected
            net(x, graph, None).sum().backward()
            assert plans(graph) == expected, "the step built a plan of its own"


# Python function calls (cProfile) of one training step on a mini-batch graph prepared ahead: a count, free of the
# machine's noise. With the CUDA backend's call records (launches packed once per graph and run as batches, the
# layer's bindings resolved once per graph) they halved: gnn2 1,549 -> 810, rgat 787 -> 389, hgt 1,402 -> 554
STEP_CALLS = {"gnn2": 880, "rgat": 430, "hgt": 610}


@pytest.mark.parametrize("model", sorted(STEP_CALLS))
def test_python_calls_per_step_do_not_regress(model):
    row = host_overhead.measure_split("minibatch", model, steps=0)
    assert row["step_calls"] <= STEP_CALLS[model], (model, row["step_calls"])


# sorts per new graph (each a multi-pass radix sort on a GPU, the largest part of a new graph's GPU time), as
# (over the edges, over the nodes). Over the edges: the unique (source, relation) pairs, the (destination, relation)
# order (which the relational mean's normaliser reads without a sort of its own), and for RGAT and HGT the edges
# by relation (their segment GEMMs over edges); over the nodes: the destinations by in-degree (made only where a
# program traverses node by node) and for HGT the nodes by type
NEW_GRAPH_SORTS = {"rgcn": (2, 1), "rgat": (3, 1), "hgt": (3, 2)}


class _Sorts(TorchDispatchMode):
    """The sizes of the tensors sorted while active."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ == "sort":
            self.sizes.append(args[0].numel())
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("model", ["rgcn", "rgat", "hgt"])
def test_new_graph_sorts_and_host_reads_do_not_regress(model):
    """A training step on new edge tensors (a mini-batch's) prepares its graph with at most the sorts above and
    one host read (the ids' check, the order check and the pair count in one transfer); a step on a graph it has
    seen sorts and reads nothing. Counted with the null executor, so on any machine."""
    spec = host_overhead.GRAPHS["batch1000"]
    torch.manual_seed(0)
    net = host_overhead._model(model, 16, spec, 2).train()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(spec.num_nodes, net.in_channels, generator=gen).requires_grad_()
    nt = torch.randint(0, spec.num_node_types, (spec.num_nodes,), generator=gen)

    def batch():
        ei = torch.randint(0, spec.num_nodes, (2, spec.num_edges), generator=gen)
        return ei, torch.randint(0, spec.num_relations, (spec.num_edges,), generator=gen)

    def counted(ei, et):
        sorts, reads = _Sorts(), host_overhead.HostReads()
        with sorts, reads:
            net(x, ei, et, nt).sum().backward()
        edges = sum(n == spec.num_edges for n in sorts.sizes)
        assert edges + sum(n == spec.num_nodes for n in sorts.sizes) == len(sorts.sizes), sorts.sizes
        return (edges, len(sorts.sizes) - edges), reads.count

    with host_overhead.null_backend():
        kept = batch()
        for _ in range(2):
            counted(*kept)
            counted(*batch())
        assert counted(*kept) == ((0, 0), 0)
        sorts, reads = counted(*batch())
    assert reads == 1, f"{model}: a new graph read the device {reads} times"
    limit = NEW_GRAPH_SORTS[model]
    assert sorts[0] <= limit[0] and sorts[1] <= limit[1], (
        f"{model}: a new graph sorted {sorts[0]} times over its edges and {sorts[1]} over its nodes, at most "
        f"{limit[0]} and {limit[1]}")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5000)), max_size=60))
def test_arena_ranges_never_overlap_live_temporaries(ops):
    """A call's temporaries' ranges (:class:`~hector.runtime.cuda._ArenaRanges`): a range taken never overlaps
    another still taken, each is 256-byte aligned and inside the allocation, and freed ranges are reused (the
    allocation grows no larger than the most bytes live at once would need without gaps, plus what first fit
    leaves between them)."""
    from hector.runtime.cuda import _ArenaRanges

    ranges = _ArenaRanges()
    live: list[tuple[int, int]] = []
    for take, nbytes in ops:
        if take or not live:
            offset = ranges.take(nbytes)
            size = -(-nbytes // 256) * 256
            assert offset % 256 == 0 and offset + size <= ranges.size
            for other, other_size in live:  # an empty range (a 0-byte temporary) holds no byte to share
                assert (size == 0 or other_size == 0 or offset + size <= other
                        or other + other_size <= offset), (offset, size, other, other_size)
            live.append((offset, size))
        else:
            ranges.give(*live.pop(nbytes % len(live)))
        for (a, n), (b, _) in zip(ranges.free, ranges.free[1:], strict=False):
            assert a + n < b  # sorted, disjoint, merged
    for offset, size in live:
        ranges.give(offset, size)
    assert ranges.free in ([], [(0, ranges.size)])


def test_launch_batches_reuse_the_ranges_of_dead_temporaries(monkeypatch):
    """A call run as launch batches gives a temporary's range of the call's allocation to later temporaries once
    no kernel reads it any more (as the kernel-by-kernel path's allocator reuses a released buffer): RGAT's
    backward on aifb's twin takes a smaller allocation than with every temporary in a range of its own, and each
    call's allocation stays within what the records without reuse took."""
    from hector import datasets
    from hector.runtime import cuda as cuda_mod
    from hector.runtime.device_graph import device_graph
    from hector.runtime.graph import graph_for

    twin = datasets.load("aifb", scale=1.0, seed=0)
    ei, et = twin.edge_index, twin.edge_type

    def arenas() -> list[int]:
        torch.manual_seed(0)
        layer = hector.nn.RGATConv(64, 16, twin.num_relations, heads=4).train()
        x = torch.randn(twin.num_nodes, 64, requires_grad=True)
        with host_overhead.null_backend():
            layer(x, ei, et).sum().backward()
        calls = device_graph(graph_for(ei, et, twin.num_nodes, twin.num_relations)).calls.values()
        return sorted(c.batched.arena_bytes for c in calls if c.batched is not None)

    reused = arenas()
    monkeypatch.setattr(cuda_mod, "_last_readers", lambda kernels: {})
    monkeypatch.setattr(graph_mod, "_GRAPHS", type(graph_mod._GRAPHS)())
    separate = arenas()
    assert len(reused) == len(separate) == 2
    assert all(a <= b for a, b in zip(reused, separate, strict=True))
    assert reused[-1] < 0.8 * separate[-1], (reused, separate)


def test_launch_batches_past_the_arena_limit_hold_at_most_the_allowed_extra(monkeypatch):
    """A call whose temporaries take more than ``_ARENA_BYTES`` (a mini-batch of the GNN benchmark's size) still
    runs as launch batches where its buffers take at most ``HECTOR_BATCH_EXTRA_MB`` more than the kernel-by-kernel
    path holds at its peak: measured, a batched backward's peak allocation exceeds the kernel-by-kernel one's by no
    more than that; with no extra allowed past the limit, the same calls run kernel by kernel (the setting is a
    part of a call record's key: the same graph gets new records when it changes)."""
    from hector_bench_common import cpu_peak_bytes

    from hector.runtime import cuda as cuda_mod
    from hector.runtime.device_graph import device_graph

    spec = host_overhead.GRAPHS["minibatch"]
    gen = torch.Generator().manual_seed(0)
    ei = torch.randint(0, spec.num_nodes, (2, spec.num_edges), generator=gen)
    et = torch.randint(0, spec.num_relations, (spec.num_edges,), generator=gen)
    torch.manual_seed(0)
    layer = hector.nn.RGATConv(64, 16, spec.num_relations, heads=4, attention="shared").train()
    x = torch.randn(spec.num_nodes, 64, generator=gen, requires_grad=True)
    monkeypatch.setattr(cuda_mod, "_ARENA_BYTES", 0)  # every call is past it
    graph = hector.prepare_graph(ei, et, spec.num_nodes, spec.num_relations)

    def backward_peak(batches: bool, extra_mb: int) -> tuple[int, list]:
        monkeypatch.setattr(hector.config.settings, "launch_batches", batches)
        monkeypatch.setattr(hector.config.settings, "batch_extra_mb", extra_mb)
        with host_overhead.null_backend():
            layer(x, graph).sum().backward()  # the records made
            out = layer(x, graph)
            grad = torch.randn_like(out)
            peak = cpu_peak_bytes(lambda: out.backward(grad))
        key = (batches, extra_mb)
        return peak, [r for k, r in device_graph(graph).calls.items() if k[-2:] == key]

    batched, records = backward_peak(True, 1)
    assert len(records) == 2 and all(r.batched is not None for r in records), "forward and backward batched"
    kernel_by_kernel, _ = backward_peak(False, 1)
    assert kernel_by_kernel < batched <= kernel_by_kernel + (1 << 20), (batched, kernel_by_kernel)
    _, records = backward_peak(True, 0)
    assert len(records) == 2 and any(r.batched is None for r in records), "past both limits: kernel by kernel"


class _Resolving(host_overhead.NullExecutor):
    """The null executor, with each batch's instances resolved (slots replaced by the graph's values): records
    that can be compared launch by launch."""

    def batch(self, launches):
        return list(launches)

    def instantiate(self, batch, values):
        from hector.runtime.cuda import Slot

        def number(v):
            return values[v.index] if type(v) is Slot else v

        return [(kernel.name, (number(grid[0]), grid[1]), block, smem,
                 [(a[0], number(a[1])) if type(a) is tuple else number(a) for a in args])
                for kernel, grid, block, smem, args in batch]

    def launch_batch(self, batch, bases, stream):
        self.launches += len(batch)


def _record_fields(call) -> tuple:
    """A call record's contents, comparable with ``==`` (its graph constants by identity)."""
    b = call.batched
    assert b is not None
    consts = tuple((name, id(t)) for name, t in call.consts)
    return (consts, sorted(call.release), b.bases, b.arena_bytes, b.arena_dtypes, b.pool_bytes, b.pool_dtypes,
            b.leaves, b.allocs, b.views, b.aliases, b.program, b.leaf_names, b.pool_at)


@pytest.mark.parametrize("pool", ["all", "none"])
@pytest.mark.parametrize("model", ["gnn2", "rgcn", "rgat", "hgt"])
def test_layouts_reused_on_new_graphs_give_the_records_built_on_them(model, pool, monkeypatch):
    """A new graph's batched call record is its program's layout (made on an earlier graph of the same signature)
    with the graph's numbers written in: exactly the record a layout made on that graph itself gives (the same
    buffers, offsets, sizes, views, launches, grids and arguments), on mini-batches of other sizes and relations,
    with small buffers in the pool or (``none``) every zero-filled one at the head of the call's allocation."""
    from hector.runtime import compiled as compiled_mod
    from hector.runtime import cuda as cuda_mod
    from hector.runtime.cuda import CudaBackend, device_graph

    if pool == "none":
        monkeypatch.setattr(cuda_mod, "_POOL_ITEM_BYTES", 0)
    spec = host_overhead.GRAPHS["minibatch"]
    torch.manual_seed(0)
    net = host_overhead._model(model, 16, spec, 2).train()
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(spec.num_nodes, net.in_channels, generator=gen).requires_grad_(model != "gnn2")
    nt = torch.randint(0, spec.num_node_types, (spec.num_nodes,), generator=gen)
    typed = (nt, spec.num_node_types) if net.num_node_types else (None, None)
    backend = CudaBackend(_Resolving())
    monkeypatch.setattr(compiled_mod, "select", lambda device, dtype: backend)
    reused = 0
    for n, e, relations in ((400, 1600, 16), (350, 1500, 16), (400, 1700, 3), (390, 1650, 16)):
        ei = torch.randint(0, n, (2, e), generator=gen)
        et = torch.randint(0, relations, (e,), generator=gen)
        layouts = sum(len(t.layouts) for _, t in backend._templates.values())
        graph = hector.prepare_graph(ei, et, spec.num_nodes, spec.num_relations, *typed, layers=net)
        net(x, graph, None, typed[0]).sum().backward()
        reused += sum(len(t.layouts) for _, t in backend._templates.values()) == layouts
        dg = device_graph(graph)
        records = {key: _record_fields(call) for key, call in dg.calls.items()}
        assert records
        saved = [(template, dict(template.layouts)) for _, template in backend._templates.values()]
        for template, _ in saved:  # made anew on this graph
            template.layouts.clear()
        dg.calls.clear()
        hector.prepare_graph(ei, et, spec.num_nodes, spec.num_relations, *typed, layers=net)
        net(x, graph, None, typed[0]).sum().backward()
        again = {key: _record_fields(call) for key, call in dg.calls.items()}
        assert again and all(again[key] == records[key] for key in again)
        for template, layouts in saved:  # those of the earlier graphs again, for the next graph to reuse
            template.layouts.clear()
            template.layouts.update(layouts)
    assert reused >= 2, "later graphs reused the layouts made on earlier ones"
