"""Shared helpers for hector's benchmarks: layer factories, peak-memory measurement, PyG's materialisation."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch

import hector.nn as hn

LAYERS = ("rgcn", "rgat", "hgt")


def hector_layer(kind: str, dim: int, num_relations: int, num_node_types: int, heads: int) -> torch.nn.Module:
    if kind == "rgcn":
        return hn.RGCNConv(dim, dim, num_relations)
    if kind == "rgat":
        return hn.RGATConv(dim, dim // heads, num_relations, heads=heads, attention="shared")
    return hn.HGTConv(dim, dim, num_node_types, num_relations, heads=heads)


class GNN2(torch.nn.Module):
    """The GNN benchmark's model: two RGAT layers (attention shared by the relations), each with a linear root
    term and ELU, and a linear classifier."""

    def __init__(self, in_dim: int, hidden: int, heads: int, num_relations: int, classes: int) -> None:
        super().__init__()
        width = hidden * heads
        self.conv1 = hn.RGATConv(in_dim, hidden, num_relations, heads=heads, attention="shared")
        self.root1 = torch.nn.Linear(in_dim, width)
        self.conv2 = hn.RGATConv(width, hidden, num_relations, heads=heads, attention="shared")
        self.root2 = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, classes)
        self.num_node_types = None
        self.in_channels = in_dim

    def forward(self, x, edge_index, edge_type, node_type=None):
        x = torch.nn.functional.elu(self.conv1(x, edge_index, edge_type) + self.root1(x))
        x = torch.nn.functional.elu(self.conv2(x, edge_index, edge_type) + self.root2(x))
        return self.head(x)


def pyg_layer(kind: str, dim: int, num_relations: int, num_node_types: int, heads: int, node_types=None,
              edge_types=None) -> torch.nn.Module | None:
    try:
        import torch_geometric.nn as pyg_nn
    except ImportError:
        return None
    if kind == "rgcn":
        return pyg_nn.RGCNConv(dim, dim, num_relations)
    if kind == "rgat":
        return pyg_nn.RGATConv(dim, dim // heads, num_relations, heads=heads)
    return pyg_nn.HGTConv(dim, dim, (node_types, edge_types), heads=heads)


def hetero_inputs(g: Any, x: torch.Tensor):
    """PyG's HGTConv takes dicts per node type / edge type: split a typed homogeneous graph accordingly."""
    node_types = [f"t{t}" for t in range(g.num_node_types)]
    local = torch.empty(g.num_nodes, dtype=torch.long)
    x_dict = {}
    for t in range(g.num_node_types):
        ids = (g.node_type == t).nonzero().flatten()
        local[ids] = torch.arange(ids.numel())
        x_dict[node_types[t]] = x[ids]
    src, dst = g.edge_index
    edge_types, ei_dict = [], {}
    for r in range(g.num_relations):
        mask = g.edge_type == r
        s, d = src[mask], dst[mask]
        st, dt = int(g.node_type[s[0]]), int(g.node_type[d[0]])
        et = (node_types[st], f"r{r}", node_types[dt])
        edge_types.append(et)
        ei_dict[et] = torch.stack([local[s], local[d]])
    return node_types, edge_types, x_dict, ei_dict


def cpu_peak_bytes(fn: Callable[[], Any]) -> int:
    """Peak of torch's CPU allocations while ``fn`` runs (allocator events from the profiler), above the start."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    mem = sorted((e["ts"], e["args"]["Bytes"]) for e in events
                 if e.get("name") == "[memory]" and e["args"].get("Device Type", 0) == 0)
    peak = cur = 0
    for _, b in mem:
        cur += b
        peak = max(peak, cur)
    return peak


def cuda_peak_bytes(fn: Callable[[], Any]) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def pyg_materialized_bytes(kind: str, stats: dict, dim: int, heads: int, src_type_nodes: int, itemsize: int = 4
                           ) -> int:
    """Float tensors PyG 2.8's layer writes in one inference forward (read off its source; index tensors and
    torch's internal temporaries not counted). ``src_type_nodes`` = sum over relations of the number of nodes of
    the relation's source type (HGT copies K/V per edge type)."""
    n, e, r = stats["num_nodes"], stats["num_edges"], stats["num_relations"]
    f = dim
    if kind == "rgcn":  # per relation: gathered messages, mean, h @ W_r, out + ...
        floats = e * f + r * n * (f + 2 * f) + 2 * n * f
    elif kind == "rgat":  # W[edge_type] (E x in x out!), x_i/x_j, outi/outj, q/k scores, softmax, messages
        h = heads
        floats = e * f * f + 2 * e * f + 2 * e * f + 8 * e * h + e * f + 2 * n * f
    else:  # kqv, per-edge-type K/V copies and their relation maps, per-edge q/k/v, scores, messages, output
        h = heads
        floats = 4 * n * f + 4 * src_type_nodes * f + 5 * e * f + 7 * e * h + 6 * n * f
    return floats * itemsize


def pyg_peak_bytes(kind: str, stats: dict, dim: int, heads: int, src_type_nodes: int, itemsize: int = 4) -> int:
    """Float tensors alive at once in PyG's inference forward. RGCN loops over relations and frees each
    relation's messages, so its peak is one relation's messages plus a few node-sized buffers; RGAT and HGT keep
    their per-edge tensors until the aggregation, so their peak is about everything they write."""
    n, f = stats["num_nodes"], dim
    if kind == "rgcn":
        return (stats["max_edges_per_relation"] * f + 4 * n * f) * itemsize
    return pyg_materialized_bytes(kind, stats, dim, heads, src_type_nodes, itemsize) - 2 * n * f * itemsize


def human(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(nbytes) < 1000 or unit == "TB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{int(nbytes)} B"
        nbytes /= 1000
    return str(nbytes)
