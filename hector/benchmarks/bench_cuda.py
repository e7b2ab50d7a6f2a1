"""hector's generated CUDA kernels vs the strongest baselines a user can run: RGCN, RGAT, HGT on the eight twins.

For each dataset (full size by default) and model: one training step (forward + backward, gradients of all
parameters and the input) and one inference forward, hector's default path (a new user's: ``HECTOR_BACKEND=auto``,
fp32, PyTorch's default matmul precision), its reference backend (torch ops), and in the same process the
baselines: every PyG layer for the model (RGCN: ``RGCNConv`` and ``FastRGCNConv``; RGAT: ``RGATConv``; HGT:
``HGTConv``) eager and under ``torch.compile``, and a competent PyTorch user's model (``baselines.py``:
relation-sorted edges, ``torch._grouped_mm`` in bf16 eager and compiled, one fp32 matmul per relation eager and
compiled, ``index_add_``, a segment softmax). Speedups are against the fastest of them. One-layer rows also time
hector with a new ``edge_index`` each call (a mini-batch loop), under ``torch.compile`` and under autocast bf16,
and give the step's HBM floor (the bytes the cost model counts for the kernel plan over the spec bandwidth) and
the roofline fraction (floor / step). Configurations (``--configs``): hidden 64 for all, 32 and 128 for RGAT, one
layer and a 2-layer model (ReLU between). Out-of-memory is recorded as OOM; a baseline slower than ``--cap-s`` per
step is timed once and marked ``1 run``. Also: peak memory of the training step, a sampled mini-batch workload, an
ablation (compaction / reordering / fusion off), and the achieved HBM bandwidth of the largest traversal and GEMM
kernels (compulsory bytes: every buffer a kernel touches, once).

    python hector/benchmarks/bench_cuda.py --csv out.csv --png out.png            # full matrix (GPU)
    python hector/benchmarks/bench_cuda.py --scale 0.002 --datasets aifb --device cpu   # smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import baselines  # noqa: E402
from hector_bench_common import hetero_inputs, human  # noqa: E402

import hector.nn as hn  # noqa: E402
from hector import config, datasets  # noqa: E402
from hector.passes import Options  # noqa: E402

ORDER = ["aifb", "mutag", "fb15k", "bgs", "biokg", "am", "wikikg2", "mag"]
SPEC_BW = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}
COMPILE = {"backend": "inductor", "max_relations": 64}  # --compile-backend, --compile-max-relations


# ------------------------------------------------------------------------------------------------- timing


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def one_call(fn, device):
    """(seconds, peak bytes allocated above the start) of one synchronised call."""
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t = time.perf_counter()
    fn()
    _sync(device)
    seconds = time.perf_counter() - t
    return seconds, torch.cuda.max_memory_allocated() - base if device == "cuda" else float("nan")


def measure(fn, device, cap_s, slow_first_s=None):
    """(ms per call, runs, peak bytes above the start). One warm-up call (hector compiles its kernels there), then
    timed calls; a call slower than ``cap_s`` is the result. ``slow_first_s`` (baselines, which compile nothing):
    a warm-up slower than this is the result itself (a PyG layer taking many seconds per step)."""
    first, peak = one_call(fn, device)
    if slow_first_s is not None and first > slow_first_s:
        return first * 1e3, 1, peak
    one, peak = one_call(fn, device)
    if one > cap_s:
        return one * 1e3, 1, peak
    n = max(3, min(30, int(0.2 / max(one, 1e-6))))
    t = time.perf_counter()
    for _ in range(n):
        fn()
    _sync(device)
    return (time.perf_counter() - t) / n * 1e3, n, peak


def guarded(fn, device, cap_s, slow_first_s=None):
    try:
        return measure(fn, device, cap_s, slow_first_s)
    except torch.cuda.OutOfMemoryError:
        return "OOM", 0, float("nan")
    except Exception as e:  # a failing baseline is recorded, not fatal
        if "out of memory" in str(e).lower():
            return "OOM", 0, float("nan")
        text = (str(e).splitlines() or [""])[0][:60]
        return f"error: {type(e).__name__} {text}", 0, float("nan")
    finally:
        if device == "cuda":
            torch.cuda.empty_cache()


def host_ms(fn, device, n=10):
    """Host CPU time of one call (ms): the calling thread's CPU time over ``n`` calls issued back to back, without
    waiting for the GPU in between (a few steps' launches fit the GPU's queue, so none blocks). On a small graph
    the step's wall time is this (the GPU idles between launches); a host synchronisation inside the step shows
    up here as the GPU time it waits for. A failure is recorded as its text."""
    try:
        fn()
        _sync(device)
        start = time.thread_time()
        for _ in range(n):
            fn()
        spent = time.thread_time() - start
        _sync(device)
        return spent / n * 1e3
    except Exception as e:  # noqa: BLE001 - recorded in the row like the timings' failures
        return f"error: {type(e).__name__} {(str(e).splitlines() or [''])[0][:60]}"


# ------------------------------------------------------------------------------------------------- models


class Stack(torch.nn.Module):
    """``layers`` layers with ReLU between; ``call(layer, x)`` adapts the calling convention."""

    def __init__(self, layers, call):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)
        self.call = call

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            out = self.call(layer, x)
            if isinstance(out, dict):
                # PyG's HGTConv returns nothing for node types without in-edges: they keep their features
                out = {k: out[k] if out.get(k) is not None else v for k, v in x.items()}
            x = out
            if i + 1 < len(self.layers):
                x = {k: v.relu() for k, v in x.items()} if isinstance(x, dict) else x.relu()
        return x


def hector_model(kind, dim, twin, layers, optimize="auto"):
    r, t = twin.num_relations, twin.num_node_types
    heads = 4
    if kind == "rgcn":
        return [hn.RGCNConv(dim, dim, r, optimize=optimize) for _ in range(layers)]
    if kind == "rgat":
        return [hn.RGATConv(dim, dim // heads, r, heads=heads, attention="shared", optimize=optimize)
                for _ in range(layers)]
    return [hn.HGTConv(dim, dim, t, r, heads=heads, optimize=optimize) for _ in range(layers)]


def pyg_models(kind, dim, twin, layers, meta):
    try:
        import torch_geometric.nn as pyg
    except ImportError:
        return {}
    r = twin.num_relations
    if kind == "rgcn":
        return {"RGCNConv": [pyg.RGCNConv(dim, dim, r) for _ in range(layers)],
                "FastRGCNConv": [pyg.FastRGCNConv(dim, dim, r) for _ in range(layers)]}
    if kind == "rgat":
        return {"RGATConv": [pyg.RGATConv(dim, dim // 4, r, heads=4) for _ in range(layers)]}
    return {"HGTConv": [pyg.HGTConv(dim, dim, meta, heads=4) for _ in range(layers)]}


def _loss(out):
    if isinstance(out, dict):
        return sum(v.float().sum() for v in out.values() if v is not None)
    return out.float().sum()


def steps(model, x, needs_grad):
    """(train step, inference) closures."""

    def train():
        model.zero_grad(set_to_none=True)
        xx = x.requires_grad_() if needs_grad else x
        _loss(model(xx)).backward()

    def infer():
        with torch.no_grad():
            model(x)

    return train, infer


# ------------------------------------------------------------------------------------------------- matrix


def run_config(twin, graph_tensors, pyg_inputs, kind, dim, layers, device, cap_s, reference=True, shallow=None,
               deep_limit_s=5.0, compile_baselines=True, extras=True, hector_only=False, newgraph=False):
    """One row. ``shallow``: the row of the same model with one layer; a PyG layer that ran out of memory there or
    took longer than ``deep_limit_s`` per training step is not run again with more layers (recorded as skipped).
    One-layer rows (``extras``) also time hector with a new edge_index per call, under torch.compile and under
    autocast bf16, the plain-PyTorch baselines (:mod:`baselines`), and compiled PyG (``compile_baselines``).
    ``hector_only``: hector eager and under torch.compile only (host time, GPU operations), no baseline;
    ``newgraph``: with ``hector_only``, also hector with a new edge_index per call."""
    ei, et, nt = graph_tensors
    row = {"dataset": twin.name, "model": kind, "hidden": dim, "layers": layers, "edges": twin.num_edges,
           "relations": twin.num_relations}
    torch.manual_seed(0)
    x = twin.features(dim).to(device)
    m = Stack(hector_model(kind, dim, twin, layers), lambda layer, h: layer(h, ei, et, nt)).to(device).train()
    train, infer = steps(m, x.clone(), True)
    with contextlib.suppress(Exception):  # errors and OOM are recorded by guarded below
        # a first call on a graph sizes its compacted rows before their count reaches the host without waiting;
        # one more call settles them, so that the timed calls below all run the full-graph loop's steady state
        train()
        _sync(device)
    row["hector_train_ms"], row["hector_runs"], row["hector_peak"] = guarded(train, device, cap_s)
    row["hector_infer_ms"], _, _ = guarded(infer, device, cap_s)
    if isinstance(row["hector_train_ms"], float):
        row["hector_host_ms"] = host_ms(train, device)
    graph = m.layers[0].graph(x, ei, et, nt)
    opts = m.layers[0].options_for(graph)
    row["hector_opts"] = f"c{int(opts.compact)}r{int(opts.reorder)}s{int(opts.sorted_scatter)}"
    if not hector_only:
        scatter_variants(row, opts, train, device, cap_s)
    row["hbm_floor_ms"] = hbm_floor_ms(m, graph, device)
    if isinstance(row["hector_train_ms"], float) and _num(row["hbm_floor_ms"]):
        row["roofline_train"] = row["hbm_floor_ms"] / row["hector_train_ms"]
    if extras:
        hector_variants(row, m, x, graph_tensors, device, cap_s, compile_baselines, compiled_only=hector_only,
                        newgraph=newgraph)
    if hector_only:
        return row
    if reference:
        config.set_backend("reference")
        try:
            row["ref_train_ms"], row["ref_runs"], _ = guarded(train, device, cap_s)
            row["ref_infer_ms"], _, _ = guarded(infer, device, cap_s)
        finally:
            config.set_backend(None)
    del m
    xd, eid, meta = pyg_inputs(dim) if kind == "hgt" else (None, None, None)
    for name, convs in pyg_models(kind, dim, twin, layers, meta).items():
        before = (shallow or {}).get(f"{name}_train_ms")
        if before == "OOM" or (isinstance(before, float) and before > deep_limit_s * 1e3):
            reason = "OOM" if before == "OOM" else f"{before / 1e3:.0f} s"
            row[f"{name}_train_ms"] = row[f"{name}_infer_ms"] = f"skipped ({reason} at L=1)"
            row[f"{name}_runs"] = 0
            continue
        if kind == "hgt":
            pm = Stack(convs, lambda layer, h: layer(h, eid)).to(device).train()
            xin = {k: v.to(device) for k, v in xd.items()}
            train_p, infer_p = steps(pm, xin, False)
        else:
            pm = Stack(convs, lambda layer, h: layer(h, ei, et)).to(device).train()
            train_p, infer_p = steps(pm, x.clone(), True)
        row[f"{name}_train_ms"], row[f"{name}_runs"], row[f"{name}_peak"] = guarded(train_p, device, cap_s,
                                                                                    slow_first_s=5 * cap_s)
        row[f"{name}_infer_ms"], _, _ = guarded(infer_p, device, cap_s, slow_first_s=5 * cap_s)
        loops = name in ("RGCNConv", "HGTConv")  # a Python loop over relations / edge types, unrolled when compiled
        if extras and compile_baselines and loops and twin.num_relations > COMPILE["max_relations"]:
            row[f"{name}_compiled_train_ms"] = row[f"{name}_compiled_infer_ms"] = \
                f"skipped (R > {COMPILE['max_relations']}: per-relation loop)"
        elif extras and compile_baselines and isinstance(row[f"{name}_train_ms"], float):
            torch._dynamo.reset()
            cm = torch.compile(pm, backend=COMPILE["backend"])
            train_c, infer_c = steps(cm, xin, False) if kind == "hgt" else steps(cm, x.clone(), True)
            row[f"{name}_compiled_train_ms"], row[f"{name}_compiled_runs"], _ = guarded(train_c, device, cap_s,
                                                                                     slow_first_s=60 * cap_s)
            row[f"{name}_compiled_infer_ms"], _, _ = guarded(infer_c, device, cap_s, slow_first_s=60 * cap_s)
        del pm
    if extras and layers == 1:
        user_baselines(row, twin, kind, dim, graph_tensors, x, device, cap_s, compile_baselines)
    return row


def scatter_variants(row, opts, train, device, cap_s):
    """The training step with sums by source and pair as atomic adds and as target-centric walks over sorted
    layouts (``HECTOR_SORTED_SCATTER`` off / on; the cost model's pick is the row's hector time, the other one is
    timed here): ``atomic_train_ms``, ``sorted_train_ms`` and ``sorted_speedup`` (atomic / sorted)."""
    mine, other = ("sorted", "atomic") if opts.sorted_scatter else ("atomic", "sorted")
    row[f"{mine}_train_ms"] = row["hector_train_ms"]
    config.set_sorted_scatter(other == "sorted")
    try:
        row[f"{other}_train_ms"], _, _ = guarded(train, device, cap_s)
    finally:
        config.set_sorted_scatter(None)
    if isinstance(row["atomic_train_ms"], float) and isinstance(row["sorted_train_ms"], float):
        row["sorted_speedup"] = row["atomic_train_ms"] / row["sorted_train_ms"]


def hbm_floor_ms(model, graph, device):
    """The HBM floor of hector's training step: bytes its kernel plan moves (the cost model's count: materialised
    values written once and read by each kernel that reads them, gathered rows, for every layer) over the GPU's
    spec bandwidth."""
    if device != "cuda":
        return float("nan")
    from hector.cost import training_estimate

    spec = next((v for k, v in SPEC_BW.items() if k in torch.cuda.get_device_name(0)), None)
    if spec is None:
        return float("nan")
    stats = graph.size_stats()
    moved = sum(training_estimate(layer.compiled(graph), stats).moved_bytes for layer in model.layers)
    return moved / spec * 1e3


def device_work(fn, device):
    """(GPU operations, their summed GPU time in ms) of one call of ``fn``, from torch.profiler: every kernel,
    memset and copy on the device, generated or torch's. Against the step's wall time it says whether a step is
    bound by its kernels or by launching them (the host)."""
    if device != "cuda":
        return float("nan"), float("nan")
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    work = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    return len(work), sum(e.time_range.elapsed_us() for e in work) / 1e3


def hector_variants(row, m, x, graph_tensors, device, cap_s, compiled_too=True, compiled_only=False,
                    newgraph=False):
    """hector's training step with a new edge_index/edge_type each call (what a mini-batch loop does), under
    torch.compile, and under autocast bf16 (``compiled_only``: under torch.compile only). Under torch.compile also
    the host time per step against eager's (``compiled_host_ratio``: eager / compiled, >= 1 when compiling adds no
    host time) and the GPU operations and busy time of a compiled step (the same as eager's when it launches the
    same kernels and recomputes nothing). ``newgraph``: the new edge_index step also where ``compiled_only``."""
    ei, et, nt = graph_tensors

    def fresh(layer, h):
        return layer(h, ei.clone(), et.clone(), nt.clone())

    train, _ = steps(m, x.clone(), True)
    if not compiled_only or newgraph:
        fresh_model = Stack(list(m.layers), fresh)
        train_new, _ = steps(fresh_model, x.clone(), True)
        row["hector_newgraph_train_ms"], _, _ = guarded(train_new, device, cap_s)
        if isinstance(row["hector_newgraph_train_ms"], float) and isinstance(row.get("hector_train_ms"), float):
            row["newgraph_ratio"] = row["hector_newgraph_train_ms"] / row["hector_train_ms"]
            try:
                row["hector_launches"], row["hector_gpu_ms"] = device_work(train, device)
                row["hector_newgraph_launches"], row["hector_newgraph_gpu_ms"] = device_work(train_new, device)
            except Exception as e:  # noqa: BLE001 - a profiler that cannot start leaves the columns empty
                row["hector_launches"] = f"error ({type(e).__name__})"
    elif isinstance(row.get("hector_train_ms"), float):
        with contextlib.suppress(Exception):  # a profiler that cannot start leaves the columns empty
            row["hector_launches"], row["hector_gpu_ms"] = device_work(train, device)
    if compiled_too:
        torch._dynamo.reset()
        compiled = torch.compile(m, fullgraph=True, backend=COMPILE["backend"])
        train_c, infer_c = steps(compiled, x.clone(), True)
        row["hector_compiled_train_ms"], _, _ = guarded(train_c, device, cap_s)
        row["hector_compiled_infer_ms"], _, _ = guarded(infer_c, device, cap_s)
        if isinstance(row["hector_compiled_train_ms"], float) and isinstance(row.get("hector_train_ms"), float):
            row["compiled_vs_eager"] = row["hector_train_ms"] / row["hector_compiled_train_ms"]
            row["hector_compiled_host_ms"] = host_ms(train_c, device)
            if _num(row["hector_compiled_host_ms"]) and _num(row.get("hector_host_ms")):
                row["compiled_host_ratio"] = row["hector_host_ms"] / row["hector_compiled_host_ms"]
            with contextlib.suppress(Exception):  # a profiler that cannot start leaves the columns empty
                row["hector_compiled_launches"], row["hector_compiled_gpu_ms"] = device_work(train_c, device)
        eager_ms = row.get("hector_train_ms")
        if device == "cuda" and isinstance(eager_ms, float) and eager_ms < 5.0:
            # torch.compile(mode="reduce-overhead"): the compiled step replayed as CUDA graphs (hector's kernels
            # launch on the current stream without host synchronisation, so they are captured with the rest); on
            # a small graph, whose step is bound by launches and Python, this is where compiling can pay (a step
            # of 5 ms or more is bound by the GPU: not timed there, to keep the run short)
            torch._dynamo.reset()
            graphed = torch.compile(m, fullgraph=True, backend=COMPILE["backend"], mode="reduce-overhead")
            train_g, infer_g = steps(graphed, x.clone(), True)
            row["hector_cudagraph_train_ms"], _, _ = guarded(train_g, device, cap_s)
            row["hector_cudagraph_infer_ms"], _, _ = guarded(infer_g, device, cap_s)
            if isinstance(row["hector_cudagraph_train_ms"], float) and isinstance(row.get("hector_train_ms"), float):
                row["cudagraph_vs_eager"] = row["hector_train_ms"] / row["hector_cudagraph_train_ms"]
            torch._dynamo.reset()
    if compiled_only:
        return
    train_a, _ = steps(m, x.clone(), True)

    def autocast_train():
        with torch.autocast(device, dtype=torch.bfloat16):
            train_a()

    row["hector_autocast_train_ms"], _, _ = guarded(autocast_train, device, cap_s)


def user_baselines(row, twin, kind, dim, graph_tensors, x, device, cap_s, compile_baselines):
    """The competent-PyTorch-user models (benchmarks/baselines.py) on hector's layer's weights: torch._grouped_mm
    in bf16, eager and compiled; one fp32 matmul per relation, eager (and compiled when ``compile_baselines``)."""
    ei, et, nt = graph_tensors
    (layer,) = hector_model(kind, dim, twin, 1)
    layer = layer.to(device).train()
    g = baselines.prepare(ei, et, twin.num_nodes, twin.num_relations, nt, twin.num_node_types)
    why = baselines.grouped_mm_available(device)
    for mode in ("grouped", "loop"):
        for compiled in (False, True):
            name = f"user_{'grouped_bf16' if mode == 'grouped' else 'loop_fp32'}{'_compiled' if compiled else ''}"
            if mode == "grouped" and why:
                row[f"{name}_train_ms"] = row[f"{name}_infer_ms"] = f"n/a ({why[:40]})"
                continue
            if compiled and not compile_baselines:
                row[f"{name}_train_ms"] = row[f"{name}_infer_ms"] = "skipped (not compiled on this graph)"
                continue
            if compiled and mode == "loop" and twin.num_relations > COMPILE["max_relations"]:
                row[f"{name}_train_ms"] = row[f"{name}_infer_ms"] = \
                    f"skipped (R > {COMPILE['max_relations']}: per-relation loop)"
                continue
            torch._dynamo.reset()
            train, infer = baselines.user_steps(kind, layer, x, g, mode, compiled, COMPILE["backend"])
            row[f"{name}_train_ms"], row[f"{name}_runs"], _ = guarded(train, device, cap_s, slow_first_s=60 * cap_s)
            row[f"{name}_infer_ms"], _, _ = guarded(infer, device, cap_s, slow_first_s=60 * cap_s)


# timing columns of hector itself (its variants, its reference backend): never a baseline
HECTOR_COLUMNS = ("hector", "ref", "atomic", "sorted")


def best_pyg(row, what):
    """(ms, name) of the fastest baseline of the row (PyG eager or compiled, the plain-PyTorch user models)."""
    vals = [(v, k[: -len(f"_{what}_ms")]) for k, v in row.items()
            if k.endswith(f"_{what}_ms") and not k.startswith(HECTOR_COLUMNS) and isinstance(v, float)]
    return min(vals) if vals else (None, None)


def fmt_ms(v):
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def add_ratios(row):
    """speedup_{train,infer} (fastest baseline / hector, and which baseline) and vs_ref_{train,infer} (reference /
    hector), where both ran."""
    for what in ("train", "infer"):
        b, name = best_pyg(row, what)
        h = row.get(f"hector_{what}_ms")
        if b is not None and isinstance(h, float):
            row[f"speedup_{what}"] = b / h
            row[f"best_baseline_{what}"] = name
        r = row.get(f"ref_{what}_ms")
        if isinstance(r, float) and isinstance(h, float):
            row[f"vs_ref_{what}"] = r / h
    return row


def print_row(row):
    peak = row.get("hector_peak")
    parts = [f"{row['dataset']:8s} {row['model']:4s} d={row['hidden']:<3d} L={row['layers']}",
             f"hector train {fmt_ms(row.get('hector_train_ms'))} inf {fmt_ms(row.get('hector_infer_ms'))} ms "
             f"({row.get('hector_opts', '')}, peak {human(peak) if _num(peak) else '-'})"]
    if "ref_train_ms" in row:
        parts.append(f"ref {fmt_ms(row['ref_train_ms'])}/{fmt_ms(row['ref_infer_ms'])}")
    for k in row:
        if k.endswith("_train_ms") and not k.startswith(("hector", "ref", "atomic", "sorted")):
            name = k[:-9]
            runs = row.get(f"{name}_runs")
            parts.append(f"{name} {fmt_ms(row[k])}/{fmt_ms(row.get(f'{name}_infer_ms'))}"
                         + (" (1 run)" if runs == 1 else ""))
    for key, label in (("hector_newgraph_train_ms", "new edge_index"), ("hector_compiled_train_ms", "compiled"),
                       ("hector_cudagraph_train_ms", "compiled reduce-overhead"),
                       ("hector_autocast_train_ms", "autocast bf16"), ("hbm_floor_ms", "HBM floor")):
        if key in row:
            ratio = f" ({row['newgraph_ratio']:.2f}x)" if key == "hector_newgraph_train_ms" and \
                _num(row.get("newgraph_ratio")) else ""
            parts.append(f"{label} {fmt_ms(row[key])}{ratio}")
    if _num(row.get("hector_compiled_host_ms")) and _num(row.get("hector_host_ms")):
        parts.append(f"host ms/step eager {row['hector_host_ms']:.2f} compiled {row['hector_compiled_host_ms']:.2f} "
                     f"({row['compiled_host_ratio']:.2f}x)")
    if _num(row.get("hector_compiled_launches")):
        parts.append(f"compiled GPU ops/step {row['hector_compiled_launches']} "
                     f"({row['hector_compiled_gpu_ms']:.2f} ms busy)")
    if _num(row.get("roofline_train")):
        parts.append(f"roofline {row['roofline_train']:.0%}")
    if "sorted_train_ms" in row:
        ratio = f" ({row['sorted_speedup']:.2f}x)" if _num(row.get("sorted_speedup")) else ""
        parts.append(f"scatter atomic {fmt_ms(row['atomic_train_ms'])} / sorted {fmt_ms(row['sorted_train_ms'])}"
                     f"{ratio}")
    if _num(row.get("hector_launches")):
        new = (f", new edge_index {row['hector_newgraph_launches']} ({row['hector_newgraph_gpu_ms']:.2f} ms busy)"
               if _num(row.get("hector_newgraph_launches")) else "")  # (not measured with --hector-only)
        parts.append(f"GPU ops/step {row['hector_launches']} ({row['hector_gpu_ms']:.2f} ms busy){new}")
    if "speedup_train" in row or "speedup_infer" in row:
        parts.append(f"x best {row.get('speedup_train', float('nan')):.2f}/"
                     f"{row.get('speedup_infer', float('nan')):.2f} ({row.get('best_baseline_train', '-')})")
    print(" | ".join(parts), flush=True)


def _num(v):
    return isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v))


def geomean(xs):
    xs = [x for x in xs if _num(x) and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def summary(rows):
    lines = ["", "summary (hector vs the fastest baseline that ran: PyG eager/compiled, plain-PyTorch grouped-GEMM "
             "bf16 and per-relation fp32, eager/compiled; OOM/errors excluded from ratios):"]
    for kind in ("rgcn", "rgat", "hgt"):
        sel = [r for r in rows if r["model"] == kind and r["layers"] == 1 and r["hidden"] == 64]
        for what in ("train", "infer"):
            sp = [r.get(f"speedup_{what}") for r in sel]
            ok = [x for x in sp if _num(x)]
            low = min(ok) if ok else float("nan")
            none_ran = sum(1 for r in sel if best_pyg(r, what)[0] is None)
            if none_ran == len(sel):  # no baseline timed (--hector-only), or no row of this model
                continue
            met = "met" if ok and low >= 3 else "MISSED"
            lines.append(f"  {kind:4s} {what:5s}: geomean x{geomean(sp):.2f} over the best baseline (min x{low:.2f}, "
                         f"{len(ok)} graphs; no baseline ran on {none_ran}) [target >=3x on every graph: {met}]")
        new = [r["newgraph_ratio"] for r in sel if _num(r.get("newgraph_ratio"))]
        comp = [r["compiled_vs_eager"] for r in sel if _num(r.get("compiled_vs_eager"))]
        roof = [r["roofline_train"] for r in sel if _num(r.get("roofline_train"))]
        sort = [f"{r['dataset']} {r['atomic_train_ms']:.2f}/{r['sorted_train_ms']:.2f} ms "
                f"({r['sorted_speedup']:.2f}x, picked {'sorted' if r['hector_opts'].endswith('s1') else 'atomic'})"
                for r in sel if _num(r.get("sorted_speedup"))]
        if sort:
            lines.append(f"  {kind:4s} train step, sums by source/pair atomic/sorted: " + ", ".join(sort))
        if new:
            lines.append(f"  {kind:4s} new edge_index per call: worst {max(new):.2f}x the persistent-graph step "
                         f"[target <=1.1x: {'met' if max(new) <= 1.1 else 'MISSED'}]")
        if comp:
            each = ", ".join(f"{r['dataset']} {r['compiled_vs_eager']:.2f}x" for r in sel
                             if _num(r.get("compiled_vs_eager")))
            lines.append(f"  {kind:4s} torch.compile vs eager: worst {min(comp):.2f}x ({each}) [target >=1.0x: "
                         f"{'met' if min(comp) >= 1.0 else 'MISSED'}]")
        host = [f"{r['dataset']} {r['hector_host_ms']:.2f}/{r['hector_compiled_host_ms']:.2f} ms "
                f"({r['compiled_host_ratio']:.2f}x)" for r in sel if _num(r.get("compiled_host_ratio"))]
        if host:
            lines.append(f"  {kind:4s} host ms per train step, eager/compiled (eager over compiled; >=1 when "
                         "compiling adds no host time): " + ", ".join(host))
        ops_c = [f"{r['dataset']} {r['hector_launches']}/{r['hector_compiled_launches']} "
                 f"({r['hector_gpu_ms']:.2f}/{r['hector_compiled_gpu_ms']:.2f} ms busy)" for r in sel
                 if _num(r.get("hector_compiled_launches")) and _num(r.get("hector_launches"))]
        if ops_c:
            lines.append(f"  {kind:4s} GPU ops per train step eager/compiled: " + ", ".join(ops_c))
        graphed = [f"{r['dataset']} {r['cudagraph_vs_eager']:.2f}x" for r in sel if _num(r.get("cudagraph_vs_eager"))]
        if graphed:
            lines.append(f"  {kind:4s} torch.compile(mode='reduce-overhead') vs eager: " + ", ".join(graphed))
        if roof:
            lines.append(f"  {kind:4s} training step at {geomean(roof):.0%} of its HBM floor (geomean; best "
                         f"{max(roof):.0%})")
        ops = [f"{r['dataset']} {r['hector_launches']}/{r['hector_newgraph_launches']} "
               f"({r['hector_gpu_ms']:.2f}/{r['hector_train_ms']:.2f} ms)" for r in sel
               if _num(r.get("hector_launches")) and _num(r.get("hector_newgraph_launches"))
               and _num(r.get("hector_train_ms"))]
        if ops:
            lines.append(f"  {kind:4s} GPU ops per train step, persistent/new edge_index (GPU busy/step wall): "
                         + ", ".join(ops))
    failed = [f"{r['dataset']} {r['model']} d={r['hidden']} L={r['layers']}: {r.get(f'hector_{w}_ms')}"
              for r in rows for w in ("train", "infer") if not isinstance(r.get(f"hector_{w}_ms"), float)]
    lines.append(f"  hector OOM or errors: {'; '.join(failed) if failed else 'none'} "
                 f"({len({r['dataset'] for r in rows})} graphs)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- extras


@contextlib.contextmanager
def timed_launches():
    """Yields a list to which, while active, every generated kernel launch appends (name, grid, bytes of the
    buffers it touches, start event, end event): CUDA events recorded around it on the launch stream."""
    from hector.runtime import backend as backend_mod

    records = []
    executor = backend_mod.cuda_backend().executor
    original = executor.launch

    def timed(kernel, grid, block, args, smem, stream):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        original(kernel, grid, block, args, smem, stream)
        end.record()
        records.append((kernel.name, grid, touched_bytes(args), start, end))

    executor.launch = timed
    try:
        yield records
    finally:
        executor.launch = original


def touched_bytes(args):
    """Bytes of the distinct tensors a kernel was given: each buffer counted once."""
    seen, nbytes = set(), 0
    for a in args:
        if isinstance(a, torch.Tensor) and a.data_ptr() not in seen:
            seen.add(a.data_ptr())
            nbytes += a.numel() * a.element_size()
    return nbytes


def bandwidth(twin, graph_tensors, device):
    """Per-kernel times of one hector RGAT, HGT and RGCN inference on this graph, with GB/s counting every buffer
    each kernel touches once, and a device-to-device copy's GB/s for comparison."""
    ei, et, nt = graph_tensors
    out = []
    copy = torch.empty(1 << 28, device=device)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(5):
        copy.clone()
    torch.cuda.synchronize()
    copy_bw = 2 * copy.numel() * 4 * 5 / (time.perf_counter() - t)
    del copy
    for kind in ("rgat", "hgt", "rgcn"):
        (layer,) = hector_model(kind, 64, twin, 1)
        layer = layer.to(device).eval()
        x = twin.features(64).to(device)
        with torch.no_grad():
            layer(x, ei, et, nt)
            torch.cuda.synchronize()
            with timed_launches() as records:
                layer(x, ei, et, nt)
        torch.cuda.synchronize()
        for name, _, nbytes, s, e in records:
            ms = s.elapsed_time(e)
            out.append({"model": kind, "kernel": name, "ms": ms, "bytes": nbytes, "GBps": nbytes / ms / 1e6,
                        "copy_GBps": copy_bw / 1e9})
    return out


def profile_train(twin, graph_tensors, kind, dim=64):
    """Where one training step of hector's ``kind`` layer goes: each generated kernel's time (CUDA events around
    its launch, forward and backward), their sum, and the step's wall time (median of 7; the rest: torch ops such
    as zero fills and the host)."""
    ei, et, nt = graph_tensors
    (layer,) = hector_model(kind, dim, twin, 1)
    layer = layer.cuda().train()
    x = twin.features(dim).cuda().requires_grad_()

    def step():
        layer.zero_grad(set_to_none=True)
        layer(x, ei, et, nt).float().sum().backward()

    step()
    step()
    walls = []
    for _ in range(7):  # the median of several steps: one step's wall time varies by a few percent
        torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t) * 1e3)
    wall = sorted(walls)[len(walls) // 2]
    with timed_launches() as records:
        step()
    torch.cuda.synchronize()
    rows = sorted(((s.elapsed_time(e), name, grid) for name, grid, _, s, e in records), reverse=True)
    total = sum(ms for ms, _, _ in rows)
    print(f"profile {twin.name} {kind} d={dim} training step: {wall:.2f} ms wall, {len(rows)} generated kernels "
          f"{total:.2f} ms", flush=True)
    for ms, name, grid in rows:
        print(f"  {ms:8.3f} ms  {name:28s} grid {grid}", flush=True)
    return [{"kind": "profile", "dataset": twin.name, "model": kind, "kernel": name, "ms": ms, "wall_ms": wall}
            for ms, name, _ in rows]


def ablation(twin, graph_tensors, device, cap_s):
    ei, et, nt = graph_tensors
    rows = []
    variants = {"auto (default)": "auto", "all on": Options(compact=True, reorder=True),
                "compaction off": Options(compact=False, reorder=True),
                "reordering off": Options(compact=True, reorder=False),
                "fusion off": Options(compact=True, reorder=True, fuse=False)}
    for kind in ("rgcn", "rgat", "hgt"):  # RGCN: atomic scatter GEMM (compaction off) or destination traversal
        for label, opt in variants.items():
            torch.manual_seed(0)
            x = twin.features(64).to(device)
            m = Stack(hector_model(kind, 64, twin, 1, optimize=opt), lambda layer, h: layer(h, ei, et, nt)).to(device)
            train, infer = steps(m, x.clone(), True)
            tr, _, peak = guarded(train, device, cap_s)
            inf, _, _ = guarded(infer, device, cap_s)
            rows.append({"dataset": twin.name, "model": kind, "variant": label, "train_ms": tr, "infer_ms": inf,
                         "peak": peak})
            print(f"ablation {twin.name} {kind:4s} {label:15s} train {fmt_ms(tr)} ms, inference {fmt_ms(inf)} ms, "
                  f"peak {human(peak) if _num(peak) else '-'}", flush=True)
    return rows


def sample_batches(twin, batches, seeds, fanout_hops, gen):
    """Mini-batches: random seed nodes and their in-neighbourhood over ``fanout_hops`` hops (all in-edges), with
    nodes relabelled; the subgraph a full-neighbourhood sampler gives."""
    src, dst = twin.edge_index
    out = []
    for _ in range(batches):
        frontier = torch.randperm(twin.num_nodes, generator=gen)[:seeds]
        nodes = frontier
        keep = torch.zeros(src.numel(), dtype=torch.bool)
        for _ in range(fanout_hops):
            mask = torch.isin(dst, frontier)
            keep |= mask
            frontier = torch.unique(src[mask])
            nodes = torch.unique(torch.cat([nodes, frontier]))
        relabel = torch.full((twin.num_nodes,), -1, dtype=torch.long)
        relabel[nodes] = torch.arange(nodes.numel())
        ei = relabel[twin.edge_index[:, keep]]
        out.append((nodes, ei, twin.edge_type[keep]))
    return out


def minibatch(twin, device, cap_s):
    gen = torch.Generator().manual_seed(0)
    batches = sample_batches(twin, 8, 1024, 2, gen)
    x_all = twin.features(64)
    rows = []
    for kind in ("rgcn", "rgat"):
        torch.manual_seed(0)
        (h,) = hector_model(kind, 64, twin, 1)
        pyg = next(iter(pyg_models(kind, 64, twin, 1, None).values()), [None])[0]
        data = [(x_all[n].to(device), ei.to(device), et.to(device), twin.node_type[n].to(device))
                for n, ei, et in batches]
        for name, layer in (("hector", h), ("PyG", pyg)):
            if layer is None:
                continue
            layer = layer.to(device).train()

            def epoch(layer=layer, name=name, data=data):
                for x, ei, et, nt in data:
                    layer.zero_grad(set_to_none=True)
                    out = layer(x, ei, et, nt) if name == "hector" else layer(x, ei, et)
                    out.sum().backward()

            ms, runs, peak = guarded(epoch, device, cap_s)
            rows.append({"dataset": twin.name, "model": kind, "impl": name, "ms_per_batch": ms / len(data)
                         if isinstance(ms, float) else ms, "edges_per_batch": sum(b[1].shape[1] for b in batches)
                         / len(batches)})
            print(f"minibatch {twin.name} {kind} {name:6s}: {fmt_ms(rows[-1]['ms_per_batch'])} ms per batch "
                  f"({rows[-1]['edges_per_batch']:.0f} edges)", flush=True)
    return rows


# ------------------------------------------------------------------------------------------------- main


def write_csv(path, rows):
    if not rows:
        return
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def plot(path, rows):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sel = [r for r in rows if r["layers"] == 1 and r["hidden"] == 64]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, what in zip(axes, ("train", "infer"), strict=True):
        labels = [f"{r['dataset']}\n{r['model']}" for r in sel]
        vals = [r.get(f"speedup_{what}", float("nan")) for r in sel]
        ax.bar(range(len(sel)), [v if _num(v) else 0 for v in vals], color="tab:blue")
        ax.set_xticks(range(len(sel)), labels, fontsize=6, rotation=90)
        ax.set_yscale("log")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(5.0, color="tab:red", lw=0.8, ls="--")
        ax.set_title(f"hector (CUDA) speedup over the fastest PyG layer: {what}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datasets", default=",".join(ORDER), help="run in this order (smallest first by default)")
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of each twin's nodes and edges")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help='where to run (default: cuda when available)')
    ap.add_argument("--cap-s", type=float, default=1.0, help="a baseline slower than this per step runs once")
    ap.add_argument("--budget-s", type=float, default=240.0, help="no new dataset after this many seconds")
    ap.add_argument("--memory-gb", type=float, default=80.0, help="cap GPU memory (emulates an 80 GB H100)")
    ap.add_argument("--no-reference", action="store_true", help="skip hector's reference backend (torch ops)")
    ap.add_argument("--extras-dataset", default="am", help="graph for the ablation, mini-batches, bandwidth")
    ap.add_argument("--profile", default="", help="only profile a training step of these models (e.g. rgat,rgcn) "
                    "on --extras-dataset: per-kernel times")
    ap.add_argument("--configs", help="model:hidden:layers rows per graph",
                    default="rgcn:64:1,rgat:64:1,hgt:64:1,rgat:32:1,rgat:128:1,rgcn:64:2,rgat:64:2,hgt:64:2")
    ap.add_argument("--compile-datasets", default="all", help="graphs on which hector, PyG and the PyTorch "
                    "baselines are also timed under torch.compile ('all', 'none', or a list: each compile takes "
                    "seconds to minutes)")
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile backend of every compiled variant")
    ap.add_argument("--compile-max-relations", type=int, default=64, help="baselines that loop over relations in "
                    "Python (PyG's RGCNConv and HGTConv, the per-relation PyTorch model) are compiled only up to this "
                    "many relations (the loop unrolls: compile time grows with it)")
    ap.add_argument("--no-extras", action="store_true", help="skip the ablation, mini-batch and bandwidth extras")
    ap.add_argument("--hector-only", action="store_true", help="hector eager and under torch.compile only (wall "
                    "and host time per step, GPU operations, reduce-overhead where the step is short): no PyG, "
                    "plain-PyTorch or reference rows, no new-edge_index, scatter or autocast variants")
    ap.add_argument("--new-edge-index", action="store_true", help="with --hector-only: also time hector with a "
                    "new edge_index per call against the persistent graph (what a mini-batch loop does)")
    ap.add_argument("--csv", help='also write every row to this CSV file')
    ap.add_argument("--png", help='also plot the speedups to this PNG file')
    a = ap.parse_args(argv)
    device = a.device
    if device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        frac = min(1.0, a.memory_gb * 1e9 / total)
        torch.cuda.set_per_process_memory_fraction(frac)
        print(f"{torch.cuda.get_device_name(0)}: memory capped at {frac * total / 1e9:.0f} GB of "
              f"{total / 1e9:.0f} GB", flush=True)
    if a.profile:
        if device != "cuda":
            ap.error("--profile times generated CUDA kernels: it needs a CUDA GPU")
        twin = datasets.load(a.extras_dataset, scale=a.scale, seed=0)
        gt = (twin.edge_index.cuda(), twin.edge_type.cuda(), twin.node_type.cuda())
        for kind in a.profile.split(","):
            profile_train(twin, gt, kind)
        return [], []
    start = time.time()
    rows, extras = [], []
    configs = []
    for c in a.configs.split(","):
        kind, dim, layers = c.split(":")
        configs.append((kind, int(dim), int(layers)))
    compile_on = None if a.compile_datasets == "all" else set(a.compile_datasets.split(","))
    COMPILE["backend"], COMPILE["max_relations"] = a.compile_backend, a.compile_max_relations
    names = [n.strip() for n in a.datasets.split(",") if n.strip()]  # in the order given
    unknown = [n for n in names if n not in ORDER]
    if unknown:
        ap.error(f"unknown datasets {unknown}; choose from {', '.join(ORDER)}")
    for name in names:
        if time.time() - start > a.budget_s:
            print(f"budget reached: {name} not run", flush=True)
            continue
        twin = datasets.load(name, scale=a.scale, seed=0)
        gt = (twin.edge_index.to(device), twin.edge_type.to(device), twin.node_type.to(device))
        cache = {}

        def pyg_inputs(dim, twin=twin, cache=cache):
            if dim not in cache:
                node_types, edge_types, xd, eid = hetero_inputs(twin, twin.features(dim))
                cache[dim] = (xd, {k: v.to(device) for k, v in eid.items()}, (node_types, edge_types))
            return cache[dim]

        for kind, dim, layers in configs:
            shallow = next((r for r in rows if r["dataset"] == twin.name and r["model"] == kind
                            and r["hidden"] == dim and r["layers"] == 1), None)
            row = add_ratios(run_config(twin, gt, pyg_inputs, kind, dim, layers, device, a.cap_s,
                                        reference=not a.no_reference and layers == 1, shallow=shallow,
                                        compile_baselines=compile_on is None or name in compile_on,
                                        extras=layers == 1, hector_only=a.hector_only,
                                        newgraph=a.new_edge_index))
            print_row(row)
            rows.append(row)
            if a.csv:
                write_csv(a.csv, rows)
        if name == a.extras_dataset and not a.no_extras and not a.hector_only:
            extras += [dict(kind="ablation", **r) for r in ablation(twin, gt, device, a.cap_s)]
            extras += [dict(kind="minibatch", **r) for r in minibatch(twin, device, a.cap_s)]
            if device == "cuda":
                bw = bandwidth(twin, gt, device)
                for kind in ("traversal", "gemm"):
                    cand = [r for r in bw if kind in r["kernel"]]
                    if cand:
                        r = max(cand, key=lambda r: r["ms"])
                        spec = next((v for k, v in SPEC_BW.items() if k in torch.cuda.get_device_name(0)), None)
                        frac = f", {r['GBps'] * 1e9 / spec:.0%} of the {spec / 1e12:.2f} TB/s spec" if spec else ""
                        print(f"bandwidth {name} {r['model']} {r['kernel']}: {r['ms']:.3f} ms, "
                              f"{human(r['bytes'])} -> {r['GBps']:.0f} GB/s ({r['GBps'] / r['copy_GBps']:.0%} of a "
                              f"device copy's {r['copy_GBps']:.0f} GB/s{frac})", flush=True)
                extras += [dict(kind="bandwidth", dataset=name, **r) for r in bw]
    print(summary(rows), flush=True)
    if a.csv:
        write_csv(a.csv, rows)
        write_csv(str(Path(a.csv).with_suffix("")) + "_extras.csv", extras)
    if a.png:
        plot(a.png, rows)
    return rows, extras


if __name__ == "__main__":
    main()
