"""Materialised bytes per layer, hector vs PyG, on the synthetic twins.

For each dataset twin and layer (RGCN, RGAT, HGT; inference forward, fp32):

* full size, from statistics only: hector's cost model (bytes its kernels write, and the peak of values alive at
  once) with the optimisations the cost model picks, and PyG 2.8's float tensors as read off its source;
* a scaled twin (about ``--measure-edges`` edges): the same model numbers, and the *measured* peak of torch's
  allocations (CPU profiler, or CUDA peak stats with ``--device cuda``) for hector's reference backend and for
  PyG's layer. The measured hector peak includes the temporaries torch allocates inside a kernel (a gathered
  operand, a per-segment product), which the generated CUDA kernels will not.

    python hector/benchmarks/memory_table.py --datasets aifb,mutag --csv out.csv
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

from hector_bench_common import (  # noqa: E402
    LAYERS,
    cpu_peak_bytes,
    cuda_peak_bytes,
    hector_layer,
    hetero_inputs,
    human,
    pyg_layer,
    pyg_materialized_bytes,
    pyg_peak_bytes,
)

from hector import datasets  # noqa: E402
from hector.cost import choose_options, estimate, peak_bytes  # noqa: E402


def src_type_nodes(g) -> int:
    sizes = torch.bincount(g.node_type, minlength=g.num_node_types)
    src_t = torch.zeros(g.num_relations, dtype=torch.long)
    src_t[g.edge_type] = g.node_type[g.edge_index[0]]
    return int(sizes[src_t].sum())


def model_numbers(kind, g, twin, dim, heads, objective="time"):
    m = hector_layer(kind, dim, twin.num_relations, twin.num_node_types, heads).eval()
    opts = choose_options(m, g, objective)
    compiled = m.compiled(g, training=False, options=opts)
    stats = g.stats()
    est = estimate(compiled.inference_lowered, stats)
    return m, opts, est.materialized_bytes, peak_bytes(compiled.inference_lowered, stats)


def measure(fn, device):
    return cuda_peak_bytes(fn) if device == "cuda" else cpu_peak_bytes(fn)


def run(names, layers, dim, heads, measure_edges, device, pyg_limit, out_csv=None, full=True, seed=0):
    rows = []
    for name in names:
        spec = datasets.SPECS[name]
        t0 = time.time()
        full_twin = datasets.load(name, seed=seed) if full else None
        full_graph = full_twin.graph() if full else None
        scale = min(1.0, measure_edges / spec.num_edges)
        twin = datasets.load(name, scale=scale, seed=seed)
        g = twin.graph()
        x = twin.features(dim).to(device)
        ei, et, nt = twin.edge_index.to(device), twin.edge_type.to(device), twin.node_type.to(device)
        gen_s = time.time() - t0
        for kind in layers:
            row = {"dataset": name, "layer": kind, "edges": spec.num_edges, "relations": spec.num_relations}
            if full:
                fs = full_graph.stats()
                _, opts, mat, peak = model_numbers(kind, full_graph, full_twin, dim, heads)
                _, _, _, peak_mem = model_numbers(kind, full_graph, full_twin, dim, heads, "memory")
                row.update(unique_pairs=fs["num_unique"], compact=opts.compact, reorder=opts.reorder,
                           hector_model_bytes=mat, hector_model_peak=peak, hector_memory_objective_peak=peak_mem,
                           pyg_model_bytes=pyg_materialized_bytes(kind, fs, dim, heads, src_type_nodes(full_twin)),
                           pyg_model_peak=pyg_peak_bytes(kind, fs, dim, heads, src_type_nodes(full_twin)))
            m, opts_s, mat_s, peak_s = model_numbers(kind, g, twin, dim, heads)
            m = m.to(device)
            st = g.stats()
            row.update(scale=round(scale, 5), scaled_edges=st["num_edges"], scaled_unique=st["num_unique"],
                       scaled_hector_model_peak=peak_s)
            with torch.no_grad():
                m(x, ei, et, nt)  # warm-up: graph preprocessing is cached per graph, not per call
                row["scaled_hector_measured_peak"] = measure(functools.partial(m, x, ei, et, nt), device)
            pyg_est = pyg_materialized_bytes(kind, st, dim, heads, src_type_nodes(twin))
            row["scaled_pyg_model_bytes"] = pyg_est
            row["scaled_pyg_model_peak"] = pyg_peak_bytes(kind, st, dim, heads, src_type_nodes(twin))
            p = pyg_layer(kind, dim, twin.num_relations, twin.num_node_types, heads,
                          *(hetero_inputs(twin, x.cpu())[:2] if kind == "hgt" else (None, None)))
            if p is None:
                row["scaled_pyg_measured_peak"] = "no PyG"
            elif pyg_est > pyg_limit:
                row["scaled_pyg_measured_peak"] = f"skipped (> {human(pyg_limit)})"
            else:
                p = p.to(device).eval()
                if kind == "hgt":
                    _, _, xd, eid = hetero_inputs(twin, x.cpu())
                    xd = {k: v.to(device) for k, v in xd.items()}
                    eid = {k: v.to(device) for k, v in eid.items()}
                    fn = functools.partial(p, xd, eid)
                else:
                    fn = functools.partial(p, x, ei, et)
                with torch.no_grad():
                    fn()
                    row["scaled_pyg_measured_peak"] = measure(fn, device)
            row["setup_s"] = round(gen_s, 1)
            rows.append(row)
            print(format_row(row), flush=True)
            if out_csv:  # rewritten after every row, so a run cut short keeps what it measured
                keys = list(dict.fromkeys(k for r in rows for k in r))
                with open(out_csv, "w", newline="") as f:
                    w = csv.DictWriter(f, fieldnames=keys)
                    w.writeheader()
                    w.writerows(rows)
    return rows


def _h(v):
    return human(v) if isinstance(v, (int, float)) else str(v)


def format_row(r):
    full = ""
    if "hector_model_bytes" in r:
        ratio = r["pyg_model_bytes"] / max(r["hector_model_bytes"], 1)
        full = (f"E/U={r['edges'] / r['unique_pairs']:.2f} compact={int(r['compact'])} reorder={int(r['reorder'])} "
                f"| full: hector {_h(r['hector_model_bytes'])} (peak {_h(r['hector_model_peak'])}, "
                f"memory objective {_h(r['hector_memory_objective_peak'])}) "
                f"pyg {_h(r['pyg_model_bytes'])} (peak {_h(r['pyg_model_peak'])}) x{ratio:.1f} ")
    return (f"{r['dataset']:8s} {r['layer']:5s} {full}| scaled E={r['scaled_edges']}: hector model peak "
            f"{_h(r['scaled_hector_model_peak'])} measured {_h(r['scaled_hector_measured_peak'])}; "
            f"pyg model peak {_h(r['scaled_pyg_model_peak'])} measured {_h(r['scaled_pyg_measured_peak'])}")


def markdown(rows) -> str:
    lines = ["| dataset | layer | E / unique pairs | compact, reorder | hector written | PyG written | "
             "hector peak (time / memory objective) | PyG peak | scaled E | hector peak model / measured | "
             "PyG peak model / measured |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['dataset']} | {r['layer']} | {r['edges'] / r['unique_pairs']:.2f} | "
            f"{int(r['compact'])}, {int(r['reorder'])} | {_h(r['hector_model_bytes'])} | "
            f"{_h(r['pyg_model_bytes'])} | {_h(r['hector_model_peak'])} / {_h(r['hector_memory_objective_peak'])} | "
            f"{_h(r['pyg_model_peak'])} | "
            f"{r['scaled_edges']} | {_h(r['scaled_hector_model_peak'])} / {_h(r['scaled_hector_measured_peak'])} | "
            f"{_h(r['scaled_pyg_model_peak'])} / {_h(r['scaled_pyg_measured_peak'])} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datasets", default=",".join(datasets.SPECS),
                    help='comma-separated synthetic twins (hector.datasets)')
    ap.add_argument("--layers", default=",".join(LAYERS), help='comma-separated layers to measure')
    ap.add_argument("--dim", type=int, default=64, help='input and output feature width')
    ap.add_argument("--heads", type=int, default=4, help='attention heads (RGAT, HGT)')
    ap.add_argument("--measure-edges", type=int, default=50_000, help='edges of the scaled twin whose peak is measured')
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help='where the measured runs execute')
    ap.add_argument("--pyg-limit", type=float, default=4e9, help="skip PyG measurements above this estimate")
    ap.add_argument("--no-full", action="store_true", help="skip the full-size twins (model columns)")
    ap.add_argument("--csv", help='also write the rows to this CSV file')
    ap.add_argument("--markdown", action="store_true", help='print the table as Markdown')
    a = ap.parse_args(argv)
    rows = run(a.datasets.split(","), a.layers.split(","), a.dim, a.heads, a.measure_edges, a.device, a.pyg_limit,
               a.csv, full=not a.no_full)
    if a.markdown and not a.no_full:
        print(markdown(rows))
    return rows


if __name__ == "__main__":
    main()
