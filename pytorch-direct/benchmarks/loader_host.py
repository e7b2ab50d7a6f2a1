"""The host work of the GNN loader per batch, outside the sampler's TorchScript function: what a loader thread asks
of the interpreter lock, which the training thread beside it needs for its own launches.

    python3 pytorch-direct/benchmarks/loader_host.py                   # CPU: a small graph, the large GNN preset's
    python3 pytorch-direct/benchmarks/loader_host.py --device cuda     # batch shape (1024 seeds, fan-outs 15, 10)
    python3 pytorch-direct/benchmarks/loader_host.py --top 25 --csv loader_host.csv

A random graph with typed edges (``Topology.edge_type`` / ``node_type``, as ``integration-tests/gnn_train.py`` feeds
the loader), a unified feature table ``x`` and a label table ``y``; batches made in turn (``prefetch=0``) so that all of
their host work runs in this thread (on a GPU ``prefetch=1, thread=False``: made ahead by this thread on the
loader's streams, their stream and event work included). Per batch (the mean over ``--batches`` after warm-up batches):

- ``batch_ms``: wall time of one ``next()``; ``sampler_ms``: of it, the sampler's TorchScript function (which runs
  without the interpreter lock); ``rest_ms``: the remainder (on the CPU this includes the feature gathers' copying,
  which also runs without the lock);
- ``py_calls`` / ``c_calls`` / ``torch_calls``: Python function calls, calls of built-in (C) functions, and of those
  the torch operations called from Python (each parses its arguments and dispatches with the lock held), counted by
  ``sys.setprofile``;
- ``python_ms``: the own CPU time of the Python functions under cProfile (inflated by the profiler, but the same
  inflation before and after a change): the interpreted work, all of it with the lock held.

``--top N`` also prints the Python functions by own time per batch.

``--sampler`` picks the sampler's path (on a GPU: ``both``, the package's CUDA kernels and the torch path, one row
each; ``all`` adds the kernels launched hop by hop from Python, as before a batch was one call; the CPU has the
torch path only). Per path, the sampler alone on the same batches (``sampler.sample``):

- ``sample_ms``: wall time per batch, the GPU's work included (synchronised after the batches);
- ``aten_ops``: the torch operations it dispatches per batch (outermost ones, from the torch profiler);
- ``launches`` / ``copies``: the kernels it launches (the package's own included) and the memory copies and fills
  it queues per batch, from the profiler's CUDA runtime calls.
"""

from __future__ import annotations

import argparse
import cProfile
import csv
import pstats
import sys
import time

import torch


def typed_graph(nodes: int, avg_degree: float, relations: int, node_types: int, seed: int = 0):
    """A random ``Topology`` with ``nodes * avg_degree`` edges: each node's in-edges grouped by relation, node
    types in contiguous blocks."""
    from pytorch_direct.sampling import Topology

    gen = torch.Generator().manual_seed(seed)
    edges = int(nodes * avg_degree)
    dst = torch.randint(0, nodes, (edges,), generator=gen)
    src = torch.randint(0, nodes, (edges,), generator=gen)
    rel = torch.randint(0, relations, (edges,), generator=gen)
    order = torch.argsort(dst * relations + rel)
    colptr = torch.zeros(nodes + 1, dtype=torch.long)
    colptr[1:] = torch.bincount(dst, minlength=nodes).cumsum(0)
    node_type = (torch.arange(nodes) * node_types // nodes).long()
    return Topology(colptr, src[order], edge_type=rel[order], node_type=node_type)


def _is_torch_call(fn) -> bool:
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, torch.Tensor):
        return True
    module = getattr(fn, "__module__", None) or getattr(type(owner), "__module__", "") or ""
    return module.startswith("torch")


def measure(loader, batches: int, warmup: int, device: torch.device, top: int = 0) -> dict:
    """The loader's host work per batch (see the module docstring), in three passes over fresh epochs: timed, call
    counts, cProfile."""
    sampler = loader.sampler
    inner = sampler._run
    in_sampler = [0.0]

    def timed_sampler(*args):
        start = time.perf_counter()
        try:
            return inner(*args)
        finally:
            in_sampler[0] += time.perf_counter() - start

    def epoch():
        it = iter(loader)
        for _ in range(warmup):
            next(it)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return it

    sampler._run = timed_sampler
    try:
        it = epoch()
        in_sampler[0] = 0.0
        start = time.perf_counter()
        for _ in range(batches):
            next(it)
        batch_s = (time.perf_counter() - start) / batches
        sampler_s = in_sampler[0] / batches
    finally:
        sampler._run = inner

    counts = {"call": 0, "c_call": 0, "torch": 0}

    def count(frame, event, arg):
        if event == "call":
            counts["call"] += 1
        elif event == "c_call":
            counts["c_call"] += 1
            if _is_torch_call(arg):
                counts["torch"] += 1

    it = epoch()
    sys.setprofile(count)
    try:
        for _ in range(batches):
            next(it)
    finally:
        sys.setprofile(None)

    it = epoch()
    # (this thread's CPU time, not wall time: what the thread itself ran, whatever else the machine runs)
    prof = cProfile.Profile(time.thread_time_ns, 1e-9)
    prof.enable()
    for _ in range(batches):
        next(it)
    prof.disable()
    stats = pstats.Stats(prof).stats
    # Python functions (built-in ones are filed under "~"), less those whose own time is a call that cProfile does
    # not see (nanobind and TorchScript functions are not built-ins) and that runs without the lock
    python = {k: v for k, v in stats.items() if k[0] != "~" and (k[0].rsplit("/", 1)[-1], k[2]) not in NATIVE}
    python_s = sum(v[2] for v in python.values()) / batches
    if top:
        print(f"Python functions by own time per batch (cProfile, {batches} batches):")
        for (path, line, func), (_, calls, own, cumulative, _) in sorted(
                python.items(), key=lambda kv: kv[1][2], reverse=True)[:top]:
            print(f"  {own / batches * 1e3:7.3f} ms own {cumulative / batches * 1e3:7.3f} ms cum "
                  f"{calls / batches:6.1f} calls  {func} ({path.rsplit('/', 2)[-1]}:{line})")
    return {"batch_ms": batch_s * 1e3, "sampler_ms": sampler_s * 1e3, "rest_ms": (batch_s - sampler_s) * 1e3,
            "py_calls": counts["call"] / batches, "c_calls": counts["c_call"] / batches,
            "torch_calls": counts["torch"] / batches, "python_ms": python_s * 1e3}


def sampler_work(sampler, batches: list[torch.Tensor], device: torch.device) -> dict:
    """The sampler alone on ``batches`` of seeds (see the module docstring): wall time per batch, and the torch
    operations, kernel launches and copies per batch."""
    from torch.profiler import ProfilerActivity, profile

    for seeds in batches[:2]:  # (first-call work out of the way)
        sampler.sample(seeds, check=False)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
    sync(device)
    start = time.perf_counter()
    for seeds in batches:
        sampler.sample(seeds, check=False)
    sync(device)
    sample_s = (time.perf_counter() - start) / len(batches)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for seeds in batches:
            sampler.sample(seeds, check=False)
        sync(device)
    ops = launches = copies = 0
    for event in prof.events():
        name = event.name
        if name.startswith("aten::"):
            parent = event.cpu_parent
            while parent is not None and not parent.name.startswith("aten::"):
                parent = parent.cpu_parent
            ops += parent is None
        elif name.startswith(("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")):
            launches += 1
        elif name.startswith(("cudaMemcpy", "cudaMemset")):
            copies += 1
    n = len(batches)
    return {"sample_ms": sample_s * 1e3, "aten_ops": ops / n, "launches": launches / n, "copies": copies / n}


# (file, function) of the Python functions whose own time is a call of native code that runs without the lock: the
# sampler's TorchScript function, the sampler kernels' batch call, the CPU gather's copy
NATIVE = {("_sample_script.py", "run"), ("_sample_cuda.py", "_native_batch"), ("_kernels.py", "gather_host")}
COLUMNS = ("batch_ms", "sampler_ms", "rest_ms", "py_calls", "c_calls", "torch_calls", "python_ms", "sample_ms",
           "aten_ops", "launches", "copies")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=200_000, help="nodes of the random graph")
    parser.add_argument("--avg-degree", type=float, default=10.0, help="average in-degree of the random graph")
    parser.add_argument("--relations", type=int, default=16, help="edge types (relations)")
    parser.add_argument("--node-types", type=int, default=4, help="node types")
    parser.add_argument("--feature-dim", type=int, default=128, help="features per node (fp32)")
    parser.add_argument("--batch-size", type=int, default=1024, help="seed nodes per batch")
    parser.add_argument("--fanout", default="15,10", help="fan-outs per hop, comma-separated")
    parser.add_argument("--batches", type=int, default=20, help="measured batches per pass")
    parser.add_argument("--warmup", type=int, default=2, help="batches made before each pass")
    parser.add_argument("--device", default="cpu", help="where sampling runs and batches arrive: cpu or cuda")
    parser.add_argument("--top", type=int, default=0, help="also print the N Python functions with most own time")
    parser.add_argument("--sampler", choices=("both", "kernels", "torch", "kernels-per-hop", "all"), default="both",
                        help="the sampler's path: the package's CUDA kernels (a batch in one call), the torch path, "
                             "or both (a row each); kernels-per-hop: the kernels launched hop by hop from Python; "
                             "all: the three (the CPU has the torch path only)")
    parser.add_argument("--csv", default=None, help="write the rows here")
    args = parser.parse_args(argv)

    import pytorch_direct as pd
    from pytorch_direct.sampling import NeighborLoader

    device = torch.device(args.device)
    fanout = [int(f) for f in args.fanout.split(",")]
    topo = typed_graph(args.nodes, args.avg_degree, args.relations, args.node_types)
    x = pd.empty((args.nodes, args.feature_dim))
    x.copy_(torch.randn(args.nodes, args.feature_dim, generator=torch.Generator().manual_seed(1)))
    y = torch.randint(0, 16, (args.nodes,), generator=torch.Generator().manual_seed(2))
    seeds = torch.randperm(args.nodes, generator=torch.Generator().manual_seed(3))
    seeds = seeds[: args.batch_size * (args.batches + args.warmup)]
    # on a GPU, made ahead by this thread on the loader's streams (prefetch=1, thread=False): the stream and event
    # work of a loader thread included
    ahead = device.type == "cuda"
    loader = NeighborLoader(({"x": x, "y": y}, topo), fanout, input_nodes=seeds, batch_size=args.batch_size,
                            shuffle=True, drop_last=True, device=device, prefetch=int(ahead), thread=False, seed=0)
    paths = {"both": ["kernels", "torch"], "all": ["kernels", "kernels-per-hop", "torch"]}.get(args.sampler,
                                                                                              [args.sampler])
    if device.type != "cuda":
        if args.sampler.startswith("kernels"):
            raise SystemExit("--sampler kernels needs --device cuda: the sampler's kernels run on a GPU")
        paths = ["torch"]
    batches = [seeds[k: k + args.batch_size].to(device) for k in range(0, args.batches * args.batch_size,
                                                                          args.batch_size)]
    rows = []
    for path in paths:
        loader.sampler.kernels = path.startswith("kernels")
        if loader.sampler.kernels:
            loader.sampler._kernel_run.one_call = path == "kernels"
        row = {"device": str(device), "sampler": path, "batch_size": args.batch_size, "fanout": args.fanout,
               **measure(loader, args.batches, args.warmup, device, args.top),
               **sampler_work(loader.sampler, batches, device)}
        rows.append(row)
    print(f"| sampler | {' | '.join(COLUMNS)} |")
    print(f"|---|{'---:|' * len(COLUMNS)}")
    for row in rows:
        cells = (f"{row[c]:.3f}" if c.endswith("_ms") else f"{row[c]:.0f}" for c in COLUMNS)
        print(f"| {row['sampler']} | {' | '.join(cells)} |")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return rows


if __name__ == "__main__":
    main()
