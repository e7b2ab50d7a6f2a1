"""Host work per training step of the CUDA backend, measured on the CPU: torch ops, kernel launches, host time.

On small graphs and mini-batches a training step is bound by the host: every torch op the backend issues around
its generated kernels is a launch (and a few microseconds of Python and dispatcher), every generated kernel one
more. This CLI runs the CUDA backend's whole step (device graph, plans, allocations, bindings, autograd) on CPU
tensors with a *null executor*: kernels are generated but never compiled or run, a launch only packs its arguments
(as the GPU's executor does before its driver call) and counts. So it needs no GPU and no compiler, and what it
measures is the host's share of a GPU step but for the driver's own time per launch:

* ``torch_ops``: aten ops dispatched per step (forward + backward + autograd's own), counted by a dispatch mode;
* ``device_ops``: those of them that launch work on a GPU (views, ``empty`` and other metadata-only ops left out);
* ``kernels``: generated-kernel launches per step;
* ``launches``: ``device_ops + kernels``, the launches a GPU step makes;
* ``host_ms``: wall time of a step (the best of five batches of ``--steps``) with the null executor (Python,
  dispatcher, the packing of each launch's arguments, and the CPU execution of the torch ops above at this
  graph's size: the ``tiny`` graph keeps that
  small, so its ``host_ms`` is close to the host time a GPU step pays; on the larger graphs the CPU fills and
  sorts dominate it).

Graph modes: ``persistent`` (one graph object for every step, as a full-graph training loop), ``new`` (new
``edge_index`` / ``edge_type`` tensors each step, as every mini-batch does: the graph is prepared again, in the
step) and ``prepared`` (new tensors each step, prepared before the step with ``hector.prepare_graph(...,
layers=layer)``, as a loader thread does: its ``prepare_ms`` column is the host time that moved there; the step
itself should launch what a persistent step launches; its ``host_ms`` is a little above the persistent step's, as
the preparation just ran on the same core and left its caches cold). A fourth,
``compiled``, runs the persistent step under ``torch.compile(fullgraph=True, backend="aot_eager")`` (the layer as
one custom op, AOTAutograd around it): its ``host_ms`` against ``persistent``'s is what compiling adds to a step's
host time (dynamo's guards, AOTAutograd's wrappers, the custom op's dispatch), which a GPU step on a small graph
pays in full (``vs_eager``: the persistent step's ``host_ms`` over the compiled one's, >= 1 when compiling adds
no host time; ``graphs`` and ``breaks``: dynamo's compiled graphs and graph breaks over the row's steps, 1 and 0
when no step recompiles or breaks). Its torch ops are not counted (a dispatch mode cannot run under torch.compile).

``--split`` measures instead the host work per new graph of the GNN benchmark's model (``gnn2``: two RGAT layers,
128 -> 16 x 4 heads -> 16 x 4 heads, attention shared by the relations, each with a linear root term, then a
linear classifier, as ``integration-tests/gnn_train.py`` trains), split as a mini-batch pays it: ``prepare_ms``
(``hector.prepare_graph`` without layers: the id check, the unique pairs, the device layout), ``plans_ms``
(``prepare_graph(..., layers=model)`` on that graph: the layers' launch plans, their graph bindings and tile
schedules), ``step_ms`` (the training step on the prepared graph), ``total_ms`` (their sum: what one new graph
costs the host, whichever thread pays it), ``persistent_ms`` (the step on one graph reused every step) and
``new_vs_persistent`` (total over persistent), ``prepare_gil_ms`` / ``plans_gil_ms`` (the part of
``prepare_ms`` / ``plans_ms`` spent outside hector's TorchScript calls, which release the interpreter lock: the
host time that holds it, which a loader thread takes from the training thread beside it; a torch op called from
Python counts as holding it, as its launch does on a GPU), with the launches (``*_launches``: torch ops that
launch on a GPU and generated kernels), host reads (``host_reads``: each waits for the GPU) and Python function
calls (``*_calls``, from cProfile: a count, free of the machine's noise) of a new graph. Any of the models
can be split (``--models gnn2,rgat``).

    python hector/benchmarks/host_overhead.py --graphs small,batch1000 --modes persistent,new,prepared --csv host.csv
    python hector/benchmarks/host_overhead.py --split --graphs minibatch --models gnn2 --csv split.csv
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import csv
import pstats
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hector_bench_common import GNN2, LAYERS, hector_layer  # noqa: E402

import hector  # noqa: E402
from hector import _shared_cuda  # noqa: E402
from hector.datasets.synthetic import DatasetSpec, generate  # noqa: E402
from hector.nn import _ops  # noqa: E402
from hector.runtime import compiled as compiled_mod  # noqa: E402
from hector.runtime import prep as prep_mod  # noqa: E402
from hector.runtime.cuda import CudaBackend, Slot, device_graph  # noqa: E402

# graphs: a small full graph (aifb's size and relation count) and a mini-batch with 1,000 relations
GRAPHS = {
    "small": DatasetSpec("small", 7_262, 48_810, 104, 7, 2.5),
    "batch1000": DatasetSpec("batch1000", 20_000, 50_000, 1_000, 4, 1.3),
    "tiny": DatasetSpec("tiny", 200, 800, 20, 3, 2.0),  # the smoke test's
    # a mini-batch of the GNN benchmark's kind (16 relations, 4 node types) small enough that the CPU's execution of
    # the torch ops stays below their dispatch: the host time is what a GPU step pays
    "minibatch": DatasetSpec("minibatch", 400, 1_600, 16, 4, 2.0),
    # the same mini-batch drawn from a model of 10,000 relations (a knowledge graph's): the --split relation ids are
    # skewed, so a few hundred are present; its counts should be minibatch's (no per-relation loop anywhere)
    "minibatch10k": DatasetSpec("minibatch10k", 400, 1_600, 10_000, 4, 2.0),
    # a mini-batch of the GNN benchmark's large size (1,024 seeds, fanout 15 then 10 on a graph of average degree
    # 10: ~100K nodes and ~110K edges, few repeated (source, relation) pairs): its counts are what a GPU step pays,
    # its host_ms mostly the CPU's execution of its torch ops at this size
    "gnnbatch": DatasetSpec("gnnbatch", 100_000, 110_000, 16, 4, 1.05),
}

MODES = ("persistent", "new", "prepared", "compiled")

# aten ops that launch nothing on a GPU (views, allocation, metadata)
NO_LAUNCH = frozenset({
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "view", "_unsafe_view", "as_strided",
    "t", "transpose", "expand", "select", "slice", "detach", "alias", "unsqueeze", "squeeze", "permute", "reshape",
    "split", "unbind", "lift_fresh", "_reshape_alias", "view_as", "set_", "resize_", "chunk", "narrow", "numpy_T",
    "is_nonzero", "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "diagonal",
    "expand_as", "unflatten", "flatten", "movedim", "split_with_sizes", "indices", "values",
    "_has_compatible_shallow_copy_type",
})


class NullKernel:
    """A kernel of the :class:`NullExecutor`: its parameters' packers, as shared-cuda's ``Kernel`` holds them."""

    def __init__(self, name: str, signature: str) -> None:
        self.name = name
        self._packers = [(kind == "ptr", _shared_cuda._PACKERS[kind])
                         for kind in (part.strip() for part in signature.split(",")) if kind]


class NullExecutor:
    """A :class:`~hector.runtime.cuda.CudaBackend` executor that launches nothing: kernels are generated but not
    compiled; a launch packs its arguments as the GPU executor's does (its Python part) and is counted, without
    the driver call (outputs keep whatever their allocation held). A batch of launches is packed once when a
    program's layout is made, costs one call per graph (its instance) and one call when launched, as the GPU
    executor's (whose copies and driver calls, one per kernel, are not made here either way)."""

    def __init__(self, multiprocessors: int = 132, arch: int = 90):
        self.multiprocessors = multiprocessors
        self.arch = arch
        self.launches = 0

    def load(self, module: Any, filename: str) -> Any:
        return filename

    def kernel(self, handle: Any, name: str, signature: str, smem: int) -> Any:
        return NullKernel(name, signature)

    def launch(self, kernel: Any, grid: tuple[int, int], block: int, args: list, smem: int, stream: int) -> None:
        # what JitExecutor.launch does before its driver call
        [pack(value.data_ptr() if pointer and not isinstance(value, int) else value)
         for (pointer, pack), value in zip(kernel._packers, args, strict=True)]
        self.launches += 1

    def batch(self, launches: list) -> tuple[list, int]:
        # what JitExecutor.batch packs when a program's layout is made (the numbers each graph gives: 0 here)
        packed = []
        for kernel, _, _, _, args in launches:
            packed.append([pack(0 if type(value) in (tuple, Slot) else value.data_ptr() if pointer and not
                                isinstance(value, int) else value)
                           for (pointer, pack), value in zip(kernel._packers, args, strict=True)])
        return packed, len(launches)

    def instantiate(self, batch: tuple[list, int], values: list[int]) -> tuple[list, int]:
        # JitExecutor.instantiate: one call per batch and graph (its copy with the graph's numbers made in C++)
        return batch

    def launch_batch(self, batch: tuple[list, int], bases: list[int], stream: int) -> None:
        self.launches += batch[1]

    def stream(self) -> int:
        return 0

    def properties(self, device: torch.device) -> dict:
        return {"multiprocessors": self.multiprocessors, "arch": self.arch}


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def device_ops(self) -> int:
        return sum(n for name, n in self.ops.items() if name not in NO_LAUNCH)


@contextlib.contextmanager
def null_backend():
    """Every layer call in the block runs on a CUDA backend with a :class:`NullExecutor` (yielded)."""
    executor = NullExecutor()
    backend = CudaBackend(executor)
    select = compiled_mod.select
    op_select = _ops.select  # what a compiled layer's custom op calls
    compiled_mod.select = _ops.select = lambda device, dtype: backend
    try:
        yield executor
    finally:
        compiled_mod.select, _ops.select = select, op_select


def _model(model: str, dim: int, spec: DatasetSpec, heads: int) -> torch.nn.Module:
    if model == "gnn2":
        return GNN2(128, 16, 4, spec.num_relations, 16)
    return hector_layer(model, dim, spec.num_relations, spec.num_node_types, heads)


# aten ops that read a size on the host before they return on a GPU (a wait for every kernel queued before them)
SYNC_OPS = frozenset({"_unique2", "unique_dim", "unique_consecutive", "_unique", "nonzero", "masked_select",
                      "_local_scalar_dense", "bincount", "repeat_interleave"})


class HostReads:
    """Counts the device -> host reads (``tolist``, ``item`` and the conversions to Python numbers) while active:
    on a GPU each one waits for every kernel queued before it."""

    NAMES = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__")

    def __init__(self) -> None:
        self.count = 0
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> HostReads:
        for name in self.NAMES:
            real = getattr(torch.Tensor, name)
            self._saved[name] = real

            def counting(t, *a, _real=real, **k):
                self.count += 1
                return _real(t, *a, **k)

            setattr(torch.Tensor, name, counting)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, real in self._saved.items():
            setattr(torch.Tensor, name, real)


@contextlib.contextmanager
def scripted_time(clock: Any):
    """Yields a one-element list that accumulates the ``clock`` time spent inside hector's TorchScript calls
    (:func:`hector.runtime.prep.run`) while the block runs: time a thread spends without the interpreter lock."""
    spent = [0.0]
    real = prep_mod.run

    def timed(fn, *args):
        start = clock()
        try:
            return real(fn, *args)
        finally:
            spent[0] += clock() - start

    prep_mod.run = timed
    try:
        yield spent
    finally:
        prep_mod.run = real


def measure_split(graph: str | DatasetSpec, model: str, dim: int = 64, heads: int = 4, steps: int = 20,
                  warmup: int = 3) -> dict[str, Any]:
    """One row of ``--split``: the host time per new graph of ``model`` on ``graph`` (a name in ``GRAPHS`` or a
    spec), split into preparing the graph, building the layers' plans and the step (see the module docstring)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure_split(graph, model, dim, heads, steps, warmup)
    finally:
        torch.set_num_threads(threads)


def _measure_split(graph: str | DatasetSpec, model: str, dim: int, heads: int, steps: int,
                   warmup: int) -> dict[str, Any]:
    spec = GRAPHS[graph] if isinstance(graph, str) else graph
    torch.manual_seed(0)
    net = _model(model, dim, spec, heads).train()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(spec.num_nodes, net.in_channels, generator=gen)
    if model != "gnn2":
        x.requires_grad_()
    typed = net.num_node_types is not None
    nt = torch.randint(0, spec.num_node_types, (spec.num_nodes,), generator=gen) if typed else None
    count = spec.num_node_types if typed else None

    def batch():
        """A new random graph of the spec's sizes, its relation ids drawn with a power-law skew (``u ** 3 * R``):
        a few relations frequent, most of a large R absent from any one batch, as in a sampled knowledge graph."""
        ei = torch.randint(0, spec.num_nodes, (2, spec.num_edges), generator=gen)
        et = (torch.rand(spec.num_edges, generator=gen) ** 3 * spec.num_relations).long()
        return ei, et

    def step(graph_):
        net.zero_grad(set_to_none=True)
        x.grad = None
        out = net(x, graph_, None, nt)
        out.float().sum().backward()

    def prepare(ei, et):
        """``prepare_graph`` without layers, with the device layout it builds for a GPU's graph (a CPU graph's
        is built on first use)."""
        graph_ = hector.prepare_graph(ei, et, spec.num_nodes, spec.num_relations, nt, count)
        device_graph(graph_)
        return graph_

    # the thread's CPU time, not the wall clock: nothing here waits (the null executor launches nothing), and on a
    # shared machine the wall clock would add the time other processes held the core
    clock = time.thread_time

    def one(ei, et):
        with scripted_time(clock) as scripted:
            start = clock()
            prepared = prepare(ei, et)
            planned = clock()
            prepare_free = scripted[0]
            hector.prepare_graph(ei, et, spec.num_nodes, spec.num_relations, nt, count, layers=net)
            stepping = clock()
            plans_free = scripted[0] - prepare_free
        step(prepared)
        done = clock()
        return (planned - start, stepping - planned, done - stepping, planned - start - prepare_free,
                stepping - planned - plans_free)

    with null_backend() as executor:
        for _ in range(warmup):
            one(*batch())
        # launches and host reads of each phase, on one new graph
        ei, et = batch()
        counts = {}
        phases = (("prepare", lambda: prepare(ei, et)),
                  ("plans", lambda: hector.prepare_graph(ei, et, spec.num_nodes, spec.num_relations, nt, count,
                                                         layers=net)),
                  ("step", lambda: step(hector.prepare_graph(ei, et, spec.num_nodes, spec.num_relations, nt,
                                                             count))))
        for phase, run_phase in phases:  # the lambdas read ei, et when called: the graph of the loop's pass
            counter, reads, kernels = OpCounter(), HostReads(), executor.launches
            with counter, reads:
                run_phase()
            syncs = sum(counter.ops[name] for name in SYNC_OPS)
            counts[phase] = [counter.device_ops + executor.launches - kernels, reads.count + syncs]
        # Python function calls of each phase on another new graph, without the counters above (their own calls)
        ei, et = batch()
        for phase, run_phase in phases:
            profile = cProfile.Profile()
            profile.enable()
            run_phase()
            profile.disable()
            counts[phase].append(pstats.Stats(profile).total_calls)
        if steps <= 0:  # counts only
            return _split_row(spec, model, counts, None)
        batches = [batch() for _ in range(5 * steps)]
        best = [float("inf")] * 5
        for k in range(5):  # each phase's best of five batches of new graphs: the machine may be shared
            sums = [0.0] * 5
            for ei, et in batches[k * steps:(k + 1) * steps]:
                for i, t in enumerate(one(ei, et)):
                    sums[i] += t
            best = [min(b, t) for b, t in zip(best, sums, strict=True)]
        persistent = hector.prepare_graph(*batches[0], spec.num_nodes, spec.num_relations, nt, count, layers=net)
        step(persistent)
        times = []
        for _ in range(5):
            start = clock()
            for _ in range(steps):
                step(persistent)
            times.append((clock() - start) / steps)
    best = [t / steps * 1e3 for t in best]
    return _split_row(spec, model, counts, best[:3] + [min(times) * 1e3], best[3:])


def _split_row(spec: DatasetSpec, model: str, counts: dict[str, list[int]], times: list[float] | None,
               gil: list[float] | None = None) -> dict[str, Any]:
    """A ``--split`` row: times (prepare, plans, step, persistent step; ms) and the host time with the interpreter
    lock of preparing and planning (ms), as "-" when not measured."""
    row: dict[str, Any] = {"graph": spec.name, "model": model, "edges": spec.num_edges,
                           "relations": spec.num_relations}
    if times is None:
        row.update(dict.fromkeys(("prepare_ms", "plans_ms", "step_ms", "total_ms", "persistent_ms",
                                  "new_vs_persistent"), "-"))
    else:
        prepare_ms, plans_ms, step_ms, persistent_ms = times
        total = prepare_ms + plans_ms + step_ms
        row.update(prepare_ms=round(prepare_ms, 3), plans_ms=round(plans_ms, 3), step_ms=round(step_ms, 3),
                   total_ms=round(total, 3), persistent_ms=round(persistent_ms, 3),
                   new_vs_persistent=round(total / persistent_ms, 2))
    row.update(prepare_gil_ms="-" if gil is None else round(gil[0], 3),
               plans_gil_ms="-" if gil is None else round(gil[1], 3))
    row.update(prepare_launches=counts["prepare"][0], plans_launches=counts["plans"][0],
               step_launches=counts["step"][0], host_reads=sum(c[1] for c in counts.values()),
               prepare_calls=counts["prepare"][2], plans_calls=counts["plans"][2], step_calls=counts["step"][2])
    return row


def run_split(graphs: list[str], models: list[str], steps: int, csv_path: str | None,
              verbose: bool = True) -> list[dict[str, Any]]:
    rows = [measure_split(graph, model, steps=steps) for graph in graphs for model in models]
    _report(rows, list(rows[0]), csv_path, verbose)
    return rows


def _report(rows: list[dict[str, Any]], cols: list[str], csv_path: str | None, verbose: bool,
            extra: str | None = None) -> None:
    """Prints `cols` of `rows` as a table (each row followed by its `extra` column, if named) and writes every
    column to `csv_path`."""
    if verbose:
        print(" | ".join(f"{c:>10}" for c in cols))
        for r in rows:
            print(" | ".join(f"{r[c]!s:>10}" for c in cols))
            if extra:
                print(f"{'':>10}   {extra}: {r[extra]}")
    if csv_path:
        with open(csv_path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)


def _inputs(spec: DatasetSpec, dim: int, seed: int = 0):
    g = generate(spec, seed)
    x = g.features(dim)
    return g, x


def measure(graph: str, model: str, mode: str, dim: int = 64, heads: int = 4, steps: int = 20,
            warmup: int = 3) -> dict[str, Any]:
    """One row: per-step ops, launches and host ms of ``model`` on ``graph`` in ``mode`` (persistent / new)."""
    # one intra-op thread: on a GPU the host only launches, and on a shared machine a thread pool's barriers
    # would time the other processes
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure(graph, model, mode, dim, heads, steps, warmup)
    finally:
        torch.set_num_threads(threads)


def _measure(graph: str, model: str, mode: str, dim: int, heads: int, steps: int, warmup: int) -> dict[str, Any]:
    spec = GRAPHS[graph]
    g, x = _inputs(spec, dim)
    torch.manual_seed(0)
    layer = hector_layer(model, dim, spec.num_relations, spec.num_node_types, heads)
    x = x.requires_grad_()
    persistent = g.graph()

    ei, et, nt = g.edge_index, g.edge_type, g.node_type
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; known: {', '.join(MODES)}")
    if mode == "compiled":
        torch._dynamo.reset()  # each row's lambda is the same code object: no cache of an earlier row's layer
        torch._dynamo.utils.counters.clear()
    compiled = torch.compile(lambda h: layer(h, ei, et, nt), fullgraph=True, backend="aot_eager") \
        if mode == "compiled" else None

    typed = layer.num_node_types is not None

    def prepare():
        """What a loader thread does for ``prepared`` (the step's graph tensors; nothing for the other modes)."""
        if mode != "prepared":
            return None
        batch = (g.edge_index.clone(), g.edge_type.clone(), g.node_type.clone())
        hector.prepare_graph(batch[0], batch[1], spec.num_nodes, spec.num_relations, batch[2] if typed else None,
                             layer.num_node_types, layers=layer)
        return batch

    def step(batch):
        layer.zero_grad(set_to_none=True)
        x.grad = None
        if mode == "persistent":
            out = layer(x, persistent, g.edge_type, g.node_type)
        elif compiled is not None:  # the same tensors each call: one graph, prepared once
            out = compiled(x)
        elif batch is not None:  # new tensors, prepared before the step (found by the layer from the tensors)
            out = layer(x, *batch)
        else:  # new tensors, same values: the graph is prepared again, as for a mini-batch
            out = layer(x, g.edge_index.clone(), g.edge_type.clone(), g.node_type.clone())
        out.sum().backward()

    with null_backend() as executor:
        for _ in range(warmup):
            step(prepare())
        batch = prepare()
        counter = OpCounter()
        launches = executor.launches
        with counter if compiled is None else contextlib.nullcontext():
            step(batch)
        kernels = executor.launches - launches
        batches, prepares = [], []
        for _ in range(5):  # the best of five batches: the machine may be shared, a mean would time the others
            spent = prepared = 0.0
            for _ in range(steps):
                start = time.perf_counter()
                batch = prepare()
                ready = time.perf_counter()
                step(batch)
                spent += time.perf_counter() - ready
                prepared += ready - start
            batches.append(spent / steps)
            prepares.append(prepared / steps)
        host_ms = min(batches) * 1e3
    # a compiled step must stay one graph: no recompilation per step, no graph break
    counters = torch._dynamo.utils.counters
    graphs = counters["stats"]["unique_graphs"] if compiled is not None else "-"
    breaks = sum(counters["graph_break"].values()) if compiled is not None else "-"
    return {"graph": graph, "model": model, "mode": mode, "edges": spec.num_edges,
            "relations": spec.num_relations, "torch_ops": "-" if compiled else counter.total,
            "device_ops": "-" if compiled else counter.device_ops, "kernels": kernels,
            "launches": "-" if compiled else counter.device_ops + kernels, "host_ms": round(host_ms, 3),
            "prepare_ms": round(min(prepares) * 1e3, 3) if mode == "prepared" else "-",
            "graphs": graphs, "breaks": breaks,
            "top_ops": " ".join(f"{k}:{v}" for k, v in counter.ops.most_common(8))}


def run(graphs: list[str], models: list[str], modes: list[str], steps: int, csv_path: str | None,
        verbose: bool = True) -> list[dict[str, Any]]:
    rows = []
    for graph in graphs:
        for model in models:
            for mode in modes:
                rows.append(measure(graph, model, mode, steps=steps))
    for r in rows:  # what compiling costs the host: the persistent step's host time over the compiled one's
        eager = next((e for e in rows if e["mode"] == "persistent" and e["graph"] == r["graph"]
                      and e["model"] == r["model"]), None)
        r["vs_eager"] = round(eager["host_ms"] / r["host_ms"], 2) if r["mode"] == "compiled" and eager else "-"
    cols = ["graph", "model", "mode", "torch_ops", "device_ops", "kernels", "launches", "host_ms", "prepare_ms",
            "vs_eager", "graphs", "breaks"]
    _report(rows, cols, csv_path, verbose, extra="top_ops")
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--graphs", default="small,batch1000", help=f"comma list of {sorted(GRAPHS)}")
    p.add_argument("--models", default=None,
                   help="comma list of rgcn, rgat, hgt (and gnn2 with --split); default: rgcn,rgat,hgt, with --split "
                        "gnn2")
    p.add_argument("--modes", default="persistent,new,prepared",
                   help="comma list of persistent, new, prepared, compiled")
    p.add_argument("--steps", type=int, default=20, help="timed steps per row")
    p.add_argument("--csv", default=None, help="write the rows here")
    p.add_argument("--split", action="store_true",
                   help="host ms per new graph split into prepare / plans / step (and the persistent step)")
    a = p.parse_args(argv)
    models = (a.models or ("gnn2" if a.split else ",".join(LAYERS))).split(",")
    for model in models:
        if model not in (*LAYERS, "gnn2") or (model == "gnn2" and not a.split):
            p.error(f"unknown model {model!r}; known: {', '.join(LAYERS)} (and gnn2 with --split)")
    for name in a.graphs.split(","):
        if name not in GRAPHS:
            p.error(f"unknown graph {name!r}; known: {sorted(GRAPHS)}")
    for mode in a.modes.split(","):
        if mode not in MODES:
            p.error(f"unknown mode {mode!r}; known: {', '.join(MODES)}")
    if a.split:
        run_split(a.graphs.split(","), models, a.steps, a.csv)
        return
    run(a.graphs.split(","), models, a.modes.split(","), a.steps, a.csv)


if __name__ == "__main__":
    main()
