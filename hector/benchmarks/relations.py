"""Per-batch cost of hector's layers against the number of relations the model has.

A mini-batch loop (a new ``edge_index``/``edge_type`` per batch, as a sampler gives) with RGCN, RGAT and HGT models
of R relations, R in ``--relations`` (default 16, 1000, 10000), with a fixed batch size: the relations present in a
batch are at most its edge count, so its cost should grow with those, not with R. Per model and R it prints the
median milliseconds per training step (forward + backward) and the number of torch operations dispatched per step
(a machine-independent count: per-relation Python loops show up as operations growing with R), the per-batch graph
preparation time alone (``hector.prepare_graph``), the size of the per-relation weights (``per_relation_mb``) and the
megabytes tensor copies wrote in a step (``copy_mb``, the largest copy in ``largest_copy_mb``: a step's copies should
scale with the batch, never be as large as the weights). Then the same on graphs prepared ahead with the layer
(``hector.prepare_graph(..., layers=layer)``, what a loader thread does): the preparation's time
(``prepare_layers_ms``), the step's (``prepared_step_ms``), the host time until the step's launches have returned
(``prepared_host_ms``, against ``host_ms`` for a graph the step prepares itself: what a loader thread takes off the
training thread) and its torch operations (``ops_prepared``). Last, the step on one graph's tensors reused for every
step (``persistent_step_ms``) and each mini-batch step against it (``new_vs_persistent``: a graph the step prepares
itself; ``prepared_vs_persistent``: one prepared ahead with the layer). Then the host time per new graph split
as a mini-batch pays it (medians, no wait between the parts): ``split_prepare_ms`` (``prepare_graph`` without
layers, its one wait for the device included), ``split_plans_ms`` (the layer's launch plans on that graph),
``split_step_host_ms`` (the step until its launches have returned) and their sum ``split_host_ms``, with the step
until the GPU is done (``split_step_ms``, against the persistent step in ``split_vs_persistent``).

``--profile N``: instead, N training steps of each model on graphs prepared ahead with it, under cProfile: the
Python functions taking the step's host time (a step bound by the host is explained here, not by the device).

    python hector/benchmarks/relations.py                       # CPU, reference backend
    python hector/benchmarks/relations.py --device cuda --edges 200000 --csv rel.csv
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hector
import hector.nn as hn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hector_bench_common import GNN2  # noqa: E402

# operations that copy a tensor's elements into another (``.contiguous()``, ``.clone()``, ``.to()`` and in-place
# copies dispatch to these)
COPIES = frozenset({"aten.copy_.default", "aten.copy.default", "aten.clone.default", "aten._to_copy.default"})


class CountOps(TorchDispatchMode):
    """Counts the aten operations dispatched while active, and the bytes written by tensor copies among them
    (``copied_bytes``, the largest one in ``largest_copy``: a copy of a whole per-relation weight in a step shows
    up as one as large as the weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.copied_bytes = 0
        self.largest_copy = 0
        self.copies: list[tuple[str, tuple[int, ...]]] = []  # (operation, output shape) of each copy

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if name in COPIES:
            dst = args[0] if name == "aten.copy_.default" else out
            nbytes = dst.numel() * dst.element_size()
            self.copied_bytes += nbytes
            self.largest_copy = max(self.largest_copy, nbytes)
            self.copies.append((name, tuple(dst.shape)))
        return out


def make_layer(kind: str, dim: int, relations: int, node_types: int) -> torch.nn.Module:
    if kind == "gnn2":  # the GNN benchmark's model: two RGAT layers (16 x 4 heads) and a classifier
        return GNN2(dim, 16, 4, relations, 16)
    if kind == "rgcn":
        return hn.RGCNConv(dim, dim, relations)
    if kind == "rgat":
        return hn.RGATConv(dim, dim // 4, relations, heads=4, attention="shared")
    return hn.HGTConv(dim, dim, node_types, relations, heads=4)


def batches(count: int, nodes: int, edges: int, relations: int, skew: float, seed: int, device: str):
    """Random mini-batch graphs: relation ids drawn with a power-law skew (``u ** skew * R``), so a few relations
    are frequent and most of a large R is absent from any one batch, as in a sampled knowledge graph."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ei = torch.randint(0, nodes, (2, edges), generator=g)
        et = (torch.rand(edges, generator=g) ** skew * relations).long().clamp_(max=relations - 1)
        out.append((ei.to(device), et.to(device)))
    return out


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run(kind: str, relations: int, a: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    node_types = 4
    layer = make_layer(kind, a.dim, relations, node_types).to(a.device).train()
    x = torch.randn(a.nodes, a.dim, device=a.device)
    nt = torch.randint(0, node_types, (a.nodes,), device=a.device)
    data = batches(a.batches + 2, a.nodes, a.edges, relations, a.skew, 1, a.device)

    def step(ei, et):
        layer.zero_grad(set_to_none=True)
        layer(x, ei, et, nt).float().sum().backward()

    typed = (nt, node_types) if kind == "hgt" else (None, None)

    def timed(batches_, prepare=None):
        """Median (step ms, host ms until the step returned, prepare ms) over ``batches_``."""
        steps, hosts, preps = [], [], []
        for ei, et in batches_:
            t = time.perf_counter()
            if prepare is not None:
                prepare(ei, et)
                _sync(a.device)
            ready = time.perf_counter()
            step(ei, et)
            launched = time.perf_counter()
            _sync(a.device)
            steps.append(time.perf_counter() - ready)
            hosts.append(launched - ready)
            preps.append(ready - t)
        return tuple(statistics.median(v) * 1e3 for v in (steps, hosts, preps))

    def plain(ei, et):
        hector.prepare_graph(ei, et, a.nodes, relations, *typed)

    def with_layer(ei, et):
        hector.prepare_graph(ei, et, a.nodes, relations, *typed, layers=layer)

    for ei, et in data[:2]:  # warm-up: compilation, the cost model's choice for this size class
        step(ei, et)
    _sync(a.device)
    step_ms, host_ms, _ = timed(data[2:])
    # the same graph tensors every step (plans and layout found again, nothing rebuilt): what a new graph's step is
    # compared with
    persistent_step_ms, _, _ = timed([data[2]] * a.batches)
    _, _, prepare_ms = timed(batches(a.batches, a.nodes, a.edges, relations, a.skew, 2, a.device), plain)
    prepared = batches(a.batches + 1, a.nodes, a.edges, relations, a.skew, 3, a.device)
    prepared_step_ms, prepared_host_ms, prepare_layers_ms = timed(prepared[1:], with_layer)
    split = split_host(batches(a.batches, a.nodes, a.edges, relations, a.skew, 5, a.device), step, plain, with_layer,
                       a.device)
    fresh = batches(1, a.nodes, a.edges, relations, a.skew, 4, a.device)
    ei, et = fresh[0]
    with CountOps() as counter:
        step(ei, et)
    ei, et = prepared[0]
    with_layer(ei, et)
    with CountOps() as counted_prepared:
        step(ei, et)
    present = round(statistics.mean(int(torch.unique(b[1]).numel()) for b in data[2:]))
    per_relation = sum(p.numel() * p.element_size() for p in layer.parameters() if p.dim() and p.size(0) == relations)
    return {"model": kind, "relations": relations, "present_per_batch": present, "edges": a.edges,
            "step_ms": step_ms, "host_ms": host_ms, "prepare_ms": prepare_ms, "ops_per_step": counter.count,
            "per_relation_mb": per_relation / 1e6, "copy_mb": counter.copied_bytes / 1e6,
            "largest_copy_mb": counter.largest_copy / 1e6,
            "prepared_step_ms": prepared_step_ms, "prepared_host_ms": prepared_host_ms,
            "prepare_layers_ms": prepare_layers_ms, "ops_prepared": counted_prepared.count,
            "persistent_step_ms": persistent_step_ms, "new_vs_persistent": step_ms / persistent_step_ms,
            "prepared_vs_persistent": prepared_step_ms / persistent_step_ms, **split,
            "split_vs_persistent": split["split_step_ms"] / persistent_step_ms}


def split_host(batches_: list, step, plain, with_layer, device: str) -> dict[str, float]:
    """The host time per new graph, split as a mini-batch pays it (medians over ``batches_``, ms): preparing the
    graph (``plain``: ``hector.prepare_graph`` without layers, its one wait for the device included), building the
    layer's launch plans on it (``with_layer``: ``prepare_graph(..., layers=layer)``), and the step until its
    launches have returned; nothing waits between them, as in a training loop. ``split_host_ms`` is their sum, the
    host work one new graph costs whichever thread pays it; ``split_step_ms`` the step until the GPU is done."""
    prep, plans, hosts, steps = [], [], [], []
    for ei, et in batches_:
        _sync(device)
        start = time.perf_counter()
        plain(ei, et)
        prepared = time.perf_counter()
        with_layer(ei, et)
        planned = time.perf_counter()
        step(ei, et)
        launched = time.perf_counter()
        _sync(device)
        done = time.perf_counter()
        prep.append(prepared - start)
        plans.append(planned - prepared)
        hosts.append(launched - planned)
        steps.append(done - planned)
    med = {name: statistics.median(v) * 1e3 for name, v in (("split_prepare_ms", prep), ("split_plans_ms", plans),
                                                              ("split_step_host_ms", hosts),
                                                              ("split_step_ms", steps))}
    med["split_host_ms"] = med["split_prepare_ms"] + med["split_plans_ms"] + med["split_step_host_ms"]
    return med


def profile_steps(kind: str, relations: int, a: argparse.Namespace, top: int = 25) -> None:
    """Prints the Python functions by own time over ``a.profile`` training steps of ``kind`` on graphs prepared
    ahead with it (the host work a training thread does per step once a loader has prepared the batch)."""
    import cProfile
    import pstats

    torch.manual_seed(0)
    layer = make_layer(kind, a.dim, relations, 4).to(a.device).train()
    x = torch.randn(a.nodes, a.dim, device=a.device)
    nt = torch.randint(0, 4, (a.nodes,), device=a.device)
    graphs = []
    for ei, et in batches(a.profile + 2, a.nodes, a.edges, relations, a.skew, 6, a.device):
        graphs.append((hector.prepare_graph(ei, et, a.nodes, relations, *((nt, 4) if kind == "hgt" else ()),
                                            layers=layer), et))

    def step(graph, et):
        layer.zero_grad(set_to_none=True)
        layer(x, graph, et, nt).float().sum().backward()

    for graph, et in graphs[:2]:
        step(graph, et)
    _sync(a.device)
    prof = cProfile.Profile()
    start = time.perf_counter()
    # (backward on this thread, not on autograd's device thread, so that the profile sees it)
    with torch.autograd.set_multithreading_enabled(False):
        prof.enable()
        for graph, et in graphs[2:]:
            step(graph, et)
        prof.disable()
    host = (time.perf_counter() - start) / a.profile * 1e3
    _sync(a.device)
    print(f"\n{kind}, {relations} relations: {a.profile} prepared steps under cProfile, {host:.2f} ms of host time "
          f"per step (profiled); functions by own time, ms per step:", flush=True)
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    for (path, line, name), (_, calls, own, cumulative, _) in rows:
        where = f"{path.rsplit('/', 1)[-1]}:{line}"
        print(f"  {own / a.profile * 1e3:7.3f} own {cumulative / a.profile * 1e3:7.3f} cum "
              f"{calls / a.profile:7.1f} calls  {name} ({where})", flush=True)


def main(argv: list[str] | None = None) -> list[dict] | None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="rgcn,rgat,hgt",
                    help="comma-separated layers: rgcn, rgat, hgt; or gnn2, the GNN benchmark's two-layer RGAT model "
                         "(input width --dim)")
    ap.add_argument("--relations", default="16,1000,10000", help='comma-separated relation counts of the model')
    ap.add_argument("--nodes", type=int, default=4000, help='nodes per mini-batch graph')
    ap.add_argument("--edges", type=int, default=8000, help='edges per mini-batch graph')
    ap.add_argument("--dim", type=int, default=32, help='feature width')
    ap.add_argument("--skew", type=float, default=3.0, help="relation id = u ** skew * R (1: uniform)")
    ap.add_argument("--batches", type=int, default=5, help='mini-batches timed per configuration')
    ap.add_argument("--device", default="cpu", help='where to run')
    ap.add_argument("--csv", help='also write every row to this CSV file (after each row)')
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="instead of the table: N prepared training steps per model under cProfile (the first "
                         "relation count of --relations)")
    a = ap.parse_args(argv)
    rows = []
    if a.profile:
        for kind in a.models.split(","):
            profile_steps(kind, int(a.relations.split(",")[0]), a)
        return None  # (no table: the profiles are the output)
    print(f"{'model':5s} {'R':>6s} {'present':>7s} {'step ms':>8s} {'host ms':>8s} {'prepare ms':>10s} "
          f"{'ops/step':>8s} {'weights MB':>10s} {'copied MB':>9s} | prepared with the layer: {'step ms':>8s} "
          f"{'host ms':>8s} {'prepare ms':>10s} {'ops/step':>8s} | persistent graph: {'step ms':>8s} "
          f"{'new x':>6s} {'prepared x':>10s} | host per new graph: {'prepare':>7s} {'plans':>6s} {'step':>6s} "
          f"{'total':>6s}", flush=True)
    for kind in a.models.split(","):
        for r in (int(v) for v in a.relations.split(",")):
            row = run(kind, r, a)
            rows.append(row)
            print(f"{kind:5s} {r:6d} {row['present_per_batch']:7d} {row['step_ms']:8.2f} {row['host_ms']:8.2f} "
                  f"{row['prepare_ms']:10.2f} {row['ops_per_step']:8d} {row['per_relation_mb']:10.1f} "
                  f"{row['copy_mb']:9.2f} | {'':24s} {row['prepared_step_ms']:8.2f} "
                  f"{row['prepared_host_ms']:8.2f} {row['prepare_layers_ms']:10.2f} {row['ops_prepared']:8d} | "
                  f"{'':17s} {row['persistent_step_ms']:8.2f} {row['new_vs_persistent']:6.2f} "
                  f"{row['prepared_vs_persistent']:10.2f} | {'':20s} {row['split_prepare_ms']:7.2f} "
                  f"{row['split_plans_ms']:6.2f} {row['split_step_host_ms']:6.2f} {row['split_host_ms']:6.2f}",
                  flush=True)
            if a.csv:  # after every row: a run stopped by a time limit keeps what it measured
                with open(a.csv, "w", newline="") as f:
                    w = csv.DictWriter(f, fieldnames=list(rows[0]))
                    w.writeheader()
                    w.writerows(rows)
    return rows


if __name__ == "__main__":
    result = main()
    sys.exit(0 if result is None or result else 1)
