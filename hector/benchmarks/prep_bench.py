"""GPU time of a new graph's preparation, piece by piece, on the dataset twins: what a new ``edge_index`` per call
costs before the layer's kernels run, with the previous way of each piece timed beside it in the same run.

Rows per twin (milliseconds, the median of ``--reps`` timed with CUDA events after warm-up; on a CPU with the wall
clock, for the smoke test):

* ``pairs``: the unique (source, relation) pairs, each edge's pair row and their count (``prep.unique_pairs``, by
  the path it picks: ``marks`` or ``sort``); ``pairs_sort`` and ``pairs_marks``: each path forced (marks only where
  its table fits ``--marks-limit-gb``); ``pairs_previous``: the previous way (a sort, ``index_copy_`` of the pair
  rows back to edge order, ``scatter_`` of every edge's key);
* ``counts``: pairs per relation by binary search in the relation-major pairs (``prep.sorted_counts``);
  ``counts_previous``: by ``index_add_`` of ones (every pair's atomic on one of R addresses);
* ``graph``: the whole preparation a layer call makes on new tensors: ``Graph`` (id check, pairs, the one host
  read) and ``DeviceGraph`` (destination order, int32 columns, CSC offsets, pairs per relation), with the edges'
  per-relation counts and order.

``--profile`` prints torch.profiler's kernels of five ``graph`` preparations instead (self CUDA time), to tell
which op a kernel of a training step's profile belongs to.

    python hector/benchmarks/prep_bench.py --datasets biokg,wikikg2
    python hector/benchmarks/prep_bench.py --datasets wikikg2 --profile
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from hector import datasets
from hector.ir import Domain
from hector.runtime import prep
from hector.runtime.device_graph import DeviceGraph
from hector.runtime.graph import Graph


def previous_pairs(key: torch.Tensor, table: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pairs as computed before (the reference of ``pairs_previous``): one sort, the pair rows put back in
    edge order by ``index_copy_``, the pairs' keys written by a scatter of every edge's key."""
    edges = key.numel()
    values, order = prep.sort_keys(key, table)
    row = torch.zeros(edges, dtype=torch.long, device=key.device)
    torch.cumsum(values[1:] != values[:-1], 0, dtype=torch.long, out=row[1:])
    inverse = torch.empty(edges, dtype=torch.long, device=key.device).index_copy_(0, order, row)
    pairs = torch.zeros(edges, dtype=torch.long, device=key.device).scatter_(0, row, values.long())
    return pairs, inverse, row[-1:] + 1


def timed(fn: Callable[[], Any], device: torch.device, reps: int, warmup: int = 2) -> float:
    """Median milliseconds of ``fn()``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


def new_graph(ei: torch.Tensor, et: torch.Tensor, n: int, r: int) -> DeviceGraph:
    """What a layer call on new tensors prepares before its kernels (its plans' tile schedules aside)."""
    dg = DeviceGraph(Graph(ei, et, n, r))
    dg.type_counts(Domain.EDGE, ("etype",))
    dg.perm(Domain.EDGE, ("etype",))
    return dg


def measure(name: str, dev: torch.device, reps: int, scale: float = 1.0, marks_limit_gb: float = 4.0) -> dict:
    """One twin's row (see the module docstring)."""
    twin = datasets.load(name, scale=scale, seed=0)
    ei, et = twin.edge_index.to(dev), twin.edge_type.to(dev)
    n, r, edges = twin.num_nodes, twin.num_relations, twin.num_edges
    src, table = ei[0].contiguous(), n * r
    key = src.add(et, alpha=n)
    _, pair_type, _, count = prep.run(prep.unique_pairs, src, et, n, r)
    pairs = int(count)
    real_types = pair_type[:pairs]
    ones = torch.ones_like(real_types)
    row: dict[str, Any] = {"dataset": name, "edges": edges, "num_pairs": pairs, "table": table,
                           "path": "marks" if prep.marks_pairs(n, r, edges) else "sort"}
    row["pairs"] = timed(lambda: prep.run(prep.unique_pairs, src, et, n, r), dev, reps)
    row["pairs_sort"] = timed(lambda: prep.run(prep.pairs_by_sort, key, table), dev, reps)
    fits = table * 12 <= marks_limit_gb * 2**30
    row["pairs_marks"] = timed(lambda: prep.run(prep.pairs_by_marks, key, table), dev, reps) if fits else None
    row["pairs_previous"] = timed(lambda: previous_pairs(key, table), dev, reps)
    row["counts"] = timed(lambda: prep.sorted_counts(real_types, r), dev, reps)
    row["counts_previous"] = timed(
        lambda: torch.zeros(r, dtype=torch.long, device=dev).index_add_(0, real_types, ones), dev, reps)
    row["graph"] = timed(lambda: new_graph(ei, et, n, r), dev, reps)
    return row


def run(names: list[str], device: str, reps: int, scale: float = 1.0, marks_limit_gb: float = 4.0) -> list[dict]:
    rows = []
    for name in names:
        rows.append(measure(name, torch.device(device), reps, scale, marks_limit_gb))
        print(format_row(rows[-1]), flush=True)
    return rows


def format_row(row: dict) -> str:
    def ms(key: str) -> str:
        value = row.get(key)
        return "-" if value is None else f"{value:.3f}"

    return (f"{row['dataset']:>8} edges {row['edges']:>9} pairs {row['num_pairs']:>9} ({row['path']}) | pairs "
            f"{ms('pairs')} ms (sort {ms('pairs_sort')}, marks {ms('pairs_marks')}, previous "
            f"{ms('pairs_previous')}) | counts {ms('counts')} (previous {ms('counts_previous')}) | whole graph "
            f"{ms('graph')}")


def profile(names: list[str], device: str, scale: float = 1.0) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    dev = torch.device(device)
    for name in names:
        twin = datasets.load(name, scale=scale, seed=0)
        ei, et = twin.edge_index.to(dev), twin.edge_type.to(dev)
        new_graph(ei, et, twin.num_nodes, twin.num_relations)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with torch_profile(activities=activities) as prof:
            for _ in range(5):
                new_graph(ei, et, twin.num_nodes, twin.num_relations)
            if dev.type == "cuda":
                torch.cuda.synchronize()
        sort = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
        print(f"{name}: five new graphs' preparation")
        print(prof.key_averages().table(sort_by=sort, row_limit=20), flush=True)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--datasets", default="biokg,wikikg2", help=f"comma list of {sorted(datasets.SPECS)}")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where to prepare the graphs (default: cuda when available)")
    ap.add_argument("--reps", type=int, default=10, help="timed preparations per row (the median is reported)")
    ap.add_argument("--scale", type=float, default=1.0, help="twins scaled down (nodes and edges), for tests")
    ap.add_argument("--marks-limit-gb", type=float, default=4.0, help="largest key table pairs_marks is timed on")
    ap.add_argument("--profile", action="store_true", help="print the kernels of five preparations instead")
    a = ap.parse_args(argv)
    names = [s.strip() for s in a.datasets.split(",") if s.strip()]
    if a.profile:
        profile(names, a.device, a.scale)
        return []
    return run(names, a.device, a.reps, a.scale, a.marks_limit_gb)


if __name__ == "__main__":
    main()
