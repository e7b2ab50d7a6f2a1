"""The neighbour sampler's cost per batch against the number of edge types: a heterogeneous graph (two node types,
the edges spread evenly over --edge-types types) and the same edges as one graph with typed edges (homogeneous,
``Topology.edge_type``), sampled with the same fan-outs.

    python3 pytorch-direct/benchmarks/sampling.py                           # 2M nodes, 20M edges, on the GPU
    python3 pytorch-direct/benchmarks/sampling.py --edge-types 4,1000 --csv sampling.csv

Per configuration: milliseconds per batch (the mean over --batches batches of --batch-size random seeds, after one
warm-up batch, synchronised), sampled edges per batch, and sampled edges per second. The heterogeneous sampler's
work is that of the frontier's in-edges: its time per sampled edge should not grow with the edge types (a
heterogeneous batch with more edge types samples more edges, a fan-out per edge type into each node). Prints a
table, writes CSV.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time

import torch


def hetero_graph(nodes: int, edges: int, edge_types: int, seed: int = 0):
    """(HeteroData of node types "a" and "b", nodes split 2:1, ``edges`` random edges over ``edge_types`` types
    alternating a->b and b->a)."""
    from torch_geometric.data import HeteroData

    gen = torch.Generator().manual_seed(seed)
    data = HeteroData()
    sizes = {"a": nodes - nodes // 3, "b": nodes // 3}
    for t, n in sizes.items():
        data[t].num_nodes = n
    per_type = max(1, edges // edge_types)
    for k in range(edge_types):
        src, dst = ("a", "b") if k % 2 else ("b", "a")
        data[src, f"r{k}", dst].edge_index = torch.stack([
            torch.randint(0, sizes[src], (per_type,), generator=gen),
            torch.randint(0, sizes[dst], (per_type,), generator=gen)])
    return data


def measure(sampler, seeds_of, batches: int, device: torch.device) -> dict:
    """Mean milliseconds and sampled edges per batch over ``batches`` batches (one warm-up batch first)."""
    sampler.sample(seeds_of(0), check=False)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    edges = 0
    start = time.perf_counter()
    for i in range(batches):
        edges += sampler.sample(seeds_of(i + 1), check=False).num_edges
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - start) / batches
    return {"ms_per_batch": seconds * 1e3, "edges_per_batch": edges / batches,
            "edges_per_s": edges / batches / seconds}


def run(nodes: int, edges: int, kinds: list[int], fanout: list[int], batch_size: int, batches: int,
        device: torch.device) -> list[dict]:
    from pytorch_direct import _topology
    from pytorch_direct.sampling import NeighborSampler, Topology

    rows = []
    for k in kinds:
        data = hetero_graph(nodes, edges, k)
        source = _topology.source_of(data)
        topo = source.topology.placed("device", device) if device.type == "cuda" else source.topology
        offset = source.node_offset("a")
        count = data["a"].num_nodes

        def seeds_of(i, offset=offset, count=count):
            gen = torch.Generator().manual_seed(1000 + i)
            return (torch.randperm(count, generator=gen)[:batch_size] + offset).to(device)

        gen = torch.Generator(device).manual_seed(0)
        hetero = NeighborSampler(topo, _topology.fanouts(source, fanout), device=device, generator=gen,
                                 blocks=source.blocks)
        rows.append({"graph": "hetero", "edge_types": k, **measure(hetero, seeds_of, batches, device)})
        # the same edges as one graph with typed edges: a fan-out per node, whatever its edges' types
        typed = Topology(topo.colptr, topo.row, edge_type=topo.edge_type, edge_id=topo.edge_id)
        plain = NeighborSampler(typed, fanout, device=device, generator=torch.Generator(device).manual_seed(0))
        rows.append({"graph": "typed", "edge_types": k, **measure(plain, seeds_of, batches, device)})
        del data, source, topo, typed, hetero, plain
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--nodes", type=int, default=2_000_000, help="nodes of the synthetic graph")
    parser.add_argument("--edges", type=int, default=20_000_000, help="edges of the synthetic graph")
    parser.add_argument("--edge-types", default="4,100,1000,10000", help="comma-separated edge-type counts")
    parser.add_argument("--fanout", default="15,10", help="neighbours per hop (per edge type for the hetero graph)")
    parser.add_argument("--batch-size", type=int, default=1024, help="seed nodes per batch")
    parser.add_argument("--batches", type=int, default=20, help="timed batches per graph")
    parser.add_argument("--device", default="auto", help="auto (the GPU if usable), cuda or cpu")
    parser.add_argument("--csv", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    if args.device == "auto":
        from pytorch_direct import cuda_usable

        device = torch.device("cuda" if cuda_usable() else "cpu")
    else:
        device = torch.device(args.device)
    kinds = [int(k) for k in args.edge_types.split(",") if k]
    fanout = [int(k) for k in args.fanout.split(",") if k]
    rows = run(args.nodes, args.edges, kinds, fanout, args.batch_size, args.batches, device)
    print(f"# sampler on {device}: {args.nodes:,} nodes, {args.edges:,} edges, fan-out {fanout}, "
          f"{args.batch_size} seeds per batch")
    print(f"{'graph':>7s} {'edge types':>10s} {'ms/batch':>9s} {'edges/batch':>12s} {'edges/s':>12s}")
    for r in rows:
        print(f"{r['graph']:>7s} {r['edge_types']:>10,d} {r['ms_per_batch']:9.2f} {r['edges_per_batch']:12,.0f} "
              f"{r['edges_per_s']:12,.0f}")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
