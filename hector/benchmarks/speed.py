"""Training-step time and peak memory, hector (reference backend: torch ops driven by the kernel plan) vs PyG.

This measures the *reference* backend (torch ops), the fallback where generated CUDA kernels cannot run; its
numbers show the effect of compaction/reordering on the same torch ops, not generated-kernel speed.

    python hector/benchmarks/speed.py --datasets aifb,am --device cuda --csv speed.csv
"""

from __future__ import annotations

import argparse
import csv
import functools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hector_bench_common import LAYERS, hector_layer, hetero_inputs, human, pyg_layer  # noqa: E402

from hector import datasets  # noqa: E402


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _train_step(module, loss):
    module.zero_grad(set_to_none=True)
    loss(module).backward()


def _typed_loss(module, x, ei, et, nt):
    return module(x, ei, et, nt).sum()


def _homo_loss(module, x, ei, et):
    return module(x, ei, et).sum()


def _hetero_loss(module, xd, eid):
    return sum(v.sum() for v in module(xd, eid).values() if v is not None)


def time_steps(step, device, iters):
    step()  # warm-up (graph preprocessing, compilation, allocator)
    _sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t = time.perf_counter()
    for _ in range(iters):
        step()
    _sync(device)
    ms = (time.perf_counter() - t) / iters * 1e3
    peak = torch.cuda.max_memory_allocated() - base if device == "cuda" else float("nan")
    return ms, peak


def run(names, layers, dim, heads, scale, device, iters, budget_s, out_csv=None):
    rows = []
    start = time.time()
    for name in names:
        if time.time() - start > budget_s:
            print(f"time budget reached: skipping {name}", flush=True)
            continue
        twin = datasets.load(name, scale=scale)
        x = twin.features(dim).to(device)
        ei, et, nt = twin.edge_index.to(device), twin.edge_type.to(device), twin.node_type.to(device)
        for kind in layers:
            row = {"dataset": name, "layer": kind, "edges": twin.num_edges, "device": device}
            m = hector_layer(kind, dim, twin.num_relations, twin.num_node_types, heads).to(device).train()
            try:
                step = functools.partial(_train_step, m, functools.partial(_typed_loss, x=x, ei=ei, et=et, nt=nt))
                row["hector_ms"], row["hector_peak"] = time_steps(step, device, iters)
                opts = m.options_for(m.graph(x, ei, et, nt))
                row["hector_opts"] = f"compact={int(opts.compact)} reorder={int(opts.reorder)}"
            except torch.cuda.OutOfMemoryError:
                row["hector_ms"] = "OOM"
            del m
            p = pyg_layer(kind, dim, twin.num_relations, twin.num_node_types, heads,
                          *(hetero_inputs(twin, x.cpu())[:2] if kind == "hgt" else (None, None)))
            if p is None:
                row["pyg_ms"] = "no PyG"
            else:
                p = p.to(device).train()
                if kind == "hgt":
                    _, _, xd, eid = hetero_inputs(twin, x.cpu())
                    xd = {k: v.to(device) for k, v in xd.items()}
                    eid = {k: v.to(device) for k, v in eid.items()}
                    fwd = functools.partial(_hetero_loss, xd=xd, eid=eid)
                else:
                    fwd = functools.partial(_homo_loss, x=x, ei=ei, et=et)
                try:
                    row["pyg_ms"], row["pyg_peak"] = time_steps(functools.partial(_train_step, p, fwd), device, iters)
                except torch.cuda.OutOfMemoryError:
                    row["pyg_ms"] = "OOM"
                del p
            if device == "cuda":
                torch.cuda.empty_cache()
            rows.append(row)
            print(fmt(row), flush=True)
            if out_csv:  # rewritten after every row, so a run cut short keeps what it measured
                keys = ["dataset", "layer", "edges", "device", "hector_opts", "hector_ms", "hector_peak", "pyg_ms",
                        "pyg_peak"]
                with open(out_csv, "w", newline="") as f:
                    w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
                    w.writeheader()
                    w.writerows(rows)
    return rows


def _v(v, unit=""):
    if isinstance(v, float) and v != v:
        return "-"
    if isinstance(v, float):
        return f"{v:.1f}{unit}"
    return str(v) if v is not None else "-"


def fmt(r):
    return (f"{r['dataset']:8s} {r['layer']:5s} E={r['edges']:>9d} | hector {_v(r.get('hector_ms'), ' ms')} "
            f"peak {human(r['hector_peak']) if isinstance(r.get('hector_peak'), int) else '-'} "
            f"({r.get('hector_opts', '')}) | PyG {_v(r.get('pyg_ms'), ' ms')} "
            f"peak {human(r['pyg_peak']) if isinstance(r.get('pyg_peak'), int) else '-'}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datasets", default="aifb,mutag,bgs,fb15k,biokg,am",
                    help='comma-separated synthetic twins (hector.datasets)')
    ap.add_argument("--layers", default=",".join(LAYERS), help='comma-separated layers to measure')
    ap.add_argument("--dim", type=int, default=64, help='input and output feature width')
    ap.add_argument("--heads", type=int, default=4, help='attention heads (RGAT, HGT)')
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of each twin's nodes and edges")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help='where to run (default: cuda when available)')
    ap.add_argument("--iters", type=int, default=3, help='timed training steps per layer (after one warm-up)')
    ap.add_argument("--budget-s", type=float, default=150.0, help="stop starting new datasets after this")
    ap.add_argument("--csv", help='also write the rows to this CSV file')
    a = ap.parse_args(argv)
    return run(a.datasets.split(","), a.layers.split(","), a.dim, a.heads, a.scale, a.device, a.iters, a.budget_s,
               a.csv)


if __name__ == "__main__":
    main()
