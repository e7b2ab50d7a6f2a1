"""Print RGAT's IR before and after the passes, its kernel plan, and the generated backward program.

    python hector/benchmarks/rgat_ir.py --dataset aifb --scale 0.2
"""

from __future__ import annotations

import argparse

import hector.nn as hn
from hector import datasets
from hector.cost import estimate


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dataset", default="aifb", help='synthetic twin to build the graph from')
    ap.add_argument("--scale", type=float, default=0.2, help="fraction of the twin's nodes and edges")
    ap.add_argument("--dim", type=int, default=64, help='input and output feature width')
    ap.add_argument("--heads", type=int, default=4, help='attention heads (RGAT, HGT)')
    ap.add_argument("--attention", default="per_relation", choices=["per_relation", "shared"],
                    help="RGAT attention form: per relation (Hector's) or shared (PyG's)")
    a = ap.parse_args(argv)
    twin = datasets.load(a.dataset, scale=a.scale)
    g = twin.graph()
    m = hn.RGATConv(a.dim, a.dim // a.heads, twin.num_relations, heads=a.heads, attention=a.attention).eval()
    before = m.trace(training=False)
    opts = m.options_for(g)
    compiled = m.compiled(g, training=False)
    print(f"# {a.dataset} twin x{a.scale}: {g.stats()}")
    print(f"# cost model choice: compact={opts.compact} reorder={opts.reorder}\n")
    print("## before passes\n" + str(before) + "\n")
    print("## after passes\n" + str(compiled.forward) + "\n")
    print("## kernel plan (inference forward)\n" + str(compiled.inference_lowered) + "\n")
    print("## generated backward (optimised)\n" + str(compiled.full_backward.program) + "\n")
    est = estimate(compiled.inference_lowered, g.stats())
    print(f"# forward: {est.kernels} kernels, {est.materialized_bytes} bytes materialised, {est.flops} flops")


if __name__ == "__main__":
    main()
