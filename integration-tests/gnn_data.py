"""A large synthetic heterogeneous graph with learnable node labels, built with vectorised torch on any device
(on a GPU: tens of millions of nodes and hundreds of millions of edges in seconds).

The graph:
- node types with power-law sizes (contiguous id ranges); every node has a latent class, its label;
- relations with a fixed (source type, destination type) and power-law edge counts (``relation_skew``: the k-th
  relation into a type gets edges in proportion to k ** -relation_skew, 0 for equal counts); each destination type
  receives in-edges in proportion to its size, so the mean in-degree is the same for every type;
- destinations drawn with power-law popularity (in-degree skew), sources with power-law popularity within the
  candidates (out-degree skew, so a source often appears several times per relation: what hector's compact
  materialisation exploits);
- relation r is homophilous with probability ``homophily[r]`` (its source is drawn from the destination's class),
  otherwise its source is any node of the source type: some relations carry the label, others are noise, and a
  relational model learns which;
- node features are ``signal * centroid[class] + noise``: weak on their own, strong when a GNN averages the
  features of homophilous neighbours. So the held-out accuracy rises well above chance (1 / classes) only when the
  model uses the graph.

The topology is stored the way neighbour sampling reads it, as CSC: the in-edges of node v are the positions
``colptr[v]:colptr[v+1]`` of ``row`` (their sources) and ``edge_type``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

# A prime larger than any type's size: k -> (k * _SPREAD + offset) mod n is a bijection of [0, n), which scatters
# the popular (small k) nodes over the type's id range instead of putting them first.
_SPREAD = 1_000_000_007


@dataclass(frozen=True)
class GraphSpec:
    num_nodes: int
    avg_degree: float  # in-edges per node
    num_node_types: int
    num_relations: int
    num_classes: int
    feature_dim: int
    num_train: int
    num_val: int
    signal: float = 1.0  # class-centroid scale relative to unit noise, over the whole feature vector
    homophily: tuple[float, float] = (0.0, 0.9)  # range of the relations' homophily
    degree_skew: float = 2.0  # k = floor(u ** skew * n): 1 is uniform, larger is more skewed
    relation_skew: float = 1.1  # the relations into a node type get edges in proportion to rank ** -relation_skew
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_relations < self.num_node_types:
            raise ValueError(f"num_relations ({self.num_relations}) must be >= num_node_types "
                             f"({self.num_node_types}): every node type receives edges of at least one relation")
        if self.num_nodes < 4 * self.num_node_types * self.num_classes:
            raise ValueError(f"num_nodes ({self.num_nodes}) is too small for {self.num_node_types} node types x "
                             f"{self.num_classes} classes")
        if self.relation_skew < 0:
            raise ValueError(f"relation_skew must be >= 0 (0: every relation gets as many edges), got "
                             f"{self.relation_skew}")
        if self.num_nodes >= 2**31:
            raise ValueError("num_nodes must be below 2**31 (node ids are stored as int32)")

    @property
    def num_edges(self) -> int:
        return int(round(self.num_nodes * self.avg_degree))

    @property
    def feature_bytes(self) -> int:
        return self.num_nodes * self.feature_dim * 4


@dataclass
class HeteroGraph:
    colptr: Tensor  # [N + 1] int64
    row: Tensor  # [E] int32: source of each in-edge
    edge_type: Tensor  # [E] int32
    node_type: Tensor  # [N] int64
    labels: Tensor  # [N] int64
    train_idx: Tensor  # [num_train] int64, nodes of type 0
    val_idx: Tensor  # [num_val] int64, nodes of type 0, disjoint from train_idx
    homophily: Tensor  # [R] float64, per relation
    spec: GraphSpec

    @property
    def num_nodes(self) -> int:
        return self.colptr.numel() - 1

    @property
    def num_edges(self) -> int:
        return self.row.numel()

    @property
    def device(self) -> torch.device:
        return self.colptr.device

    def topology_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.colptr, self.row, self.edge_type, self.node_type))

    def checksum(self) -> list[float]:
        """A few numbers that differ when two processes built different graphs."""
        return [float(self.row.double().sum()), float(self.edge_type.double().sum()),
                float(self.labels.double().sum()), float(self.train_idx.double().sum())]

    def stats(self) -> dict:
        deg = (self.colptr[1:] - self.colptr[:-1]).double()
        return {
            "nodes": self.num_nodes, "edges": self.num_edges, "node_types": self.spec.num_node_types,
            "relations": self.spec.num_relations, "classes": self.spec.num_classes,
            "feature_dim": self.spec.feature_dim, "feature_bytes": self.spec.feature_bytes,
            "topology_bytes": self.topology_bytes(), "train": self.train_idx.numel(), "val": self.val_idx.numel(),
            "in_degree_max": int(deg.max()), "in_degree_zero_fraction": float((deg == 0).double().mean()),
        }


def _split(total: int, weights: Tensor) -> Tensor:
    """Non-negative integer counts summing to ``total``, proportional to ``weights`` (largest remainder)."""
    share = weights.double() / weights.double().sum() * total
    counts = share.floor().long()
    short = total - int(counts.sum())
    if short:
        counts[torch.argsort(share - counts, descending=True)[:short]] += 1
    return counts


def _power_pick(u: Tensor, n: Tensor, skew: float) -> Tensor:
    """floor(u ** skew * n), clamped to n - 1: small values are the popular ones."""
    k = (u.pow(skew) * n.double()).long()
    return torch.minimum(k, (n - 1).clamp(min=0))


def _spread(k: Tensor, n: Tensor, offset: Tensor) -> Tensor:
    return (k * _SPREAD + offset) % n


def generate(spec: GraphSpec, device: torch.device | str = "cpu") -> HeteroGraph:
    """Build the graph on ``device`` (deterministic for a given spec and device kind)."""
    device = torch.device(device)
    gen = torch.Generator(device).manual_seed(spec.seed)
    cpu_gen = torch.Generator().manual_seed(spec.seed)
    n, t_count, r_count, c_count = spec.num_nodes, spec.num_node_types, spec.num_relations, spec.num_classes

    # Node types: power-law sizes, at least 2 * classes nodes each; contiguous id ranges.
    base = 2 * c_count
    sizes = _split(n - base * t_count, torch.arange(1, t_count + 1, dtype=torch.float64).reciprocal()) + base
    starts = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)[:-1]])
    node_type = torch.repeat_interleave(torch.arange(t_count, device=device), sizes.to(device))
    labels = torch.randint(c_count, (n,), generator=gen, device=device)

    # Relations: destination type r % T (every type receives edges), source type drawn in proportion to type size;
    # each destination type's in-edges (proportional to its size) split over its relations by a power law.
    dst_type = torch.arange(r_count) % t_count
    src_type = torch.multinomial(sizes.double(), r_count, replacement=True, generator=cpu_gen)
    rel_edges = torch.zeros(r_count, dtype=torch.long)
    per_type = _split(spec.num_edges, sizes.double())
    for t in range(t_count):
        rels = (dst_type == t).nonzero().flatten()
        weights = torch.arange(1, rels.numel() + 1, dtype=torch.float64).pow(-spec.relation_skew)
        rel_edges[rels] = _split(int(per_type[t]), weights[torch.randperm(rels.numel(), generator=cpu_gen)])
    low, high = spec.homophily
    homophily = low + (high - low) * torch.rand(r_count, generator=cpu_gen, dtype=torch.float64)
    offsets = torch.randint(0, 2**20, (t_count,), generator=cpu_gen)

    rel = torch.repeat_interleave(torch.arange(r_count, device=device, dtype=torch.int32), rel_edges.to(device))
    rel_long = rel.long()
    e = rel.numel()
    # Destinations: power-law popularity within the destination type.
    d_type = dst_type.to(device)[rel_long]
    d_size, d_start = sizes.to(device)[d_type], starts.to(device)[d_type]
    u = torch.rand(e, generator=gen, device=device, dtype=torch.float64)
    dst = d_start + _spread(_power_pick(u, d_size, spec.degree_skew), d_size, offsets.to(device)[d_type])
    del d_size, d_start, d_type
    # Sources: from the destination's class (homophilous edge) or from the whole source type, power-law popular.
    s_type = src_type.to(device)[rel_long]
    same = torch.rand(e, generator=gen, device=device, dtype=torch.float64) < homophily.to(device)[rel_long]
    del rel_long
    u = torch.rand(e, generator=gen, device=device, dtype=torch.float64)
    group_key = node_type * c_count + labels  # nodes grouped by (type, class)
    by_group = torch.argsort(group_key)
    group_count = torch.bincount(group_key, minlength=t_count * c_count)
    group_start = torch.cumsum(group_count, 0) - group_count
    del group_key
    group = s_type * c_count + labels[dst]
    same_src = by_group[group_start[group] + _power_pick(u, group_count[group], spec.degree_skew)]
    s_size, s_start = sizes.to(device)[s_type], starts.to(device)[s_type]
    any_src = s_start + _spread(_power_pick(u, s_size, spec.degree_skew), s_size, offsets.to(device)[s_type])
    src = torch.where(same & (group_count[group] > 0), same_src, any_src)
    del same_src, any_src, s_size, s_start, s_type, group, same, u, by_group

    # CSC: in-edges grouped by destination.
    dst, order = torch.sort(dst)
    row = src[order].to(torch.int32)
    edge_type = rel[order]
    del src, rel, order
    colptr = torch.zeros(n + 1, dtype=torch.long, device=device)
    colptr[1:] = torch.cumsum(torch.bincount(dst, minlength=n), 0)
    del dst

    # Labelled nodes: distinct nodes of type 0 (the "papers" of a citation graph), split into train and validation.
    if spec.num_train + spec.num_val > int(sizes[0]):
        raise ValueError(f"num_train + num_val ({spec.num_train + spec.num_val}) exceeds the {int(sizes[0])} nodes "
                         f"of the labelled type: use more nodes or fewer labelled ones")
    pick = _distinct_sample(int(sizes[0]), spec.num_train + spec.num_val, gen, device) + int(starts[0])
    return HeteroGraph(colptr, row, edge_type, node_type, labels, pick[: spec.num_train], pick[spec.num_train:],
                       homophily, spec)


def _distinct_sample(n: int, k: int, gen: torch.Generator, device: torch.device) -> Tensor:
    """k distinct integers from [0, n) in random order, without materialising a permutation of n when k << n."""
    if 4 * k >= n:
        return torch.randperm(n, generator=gen, device=device)[:k]
    candidates = torch.randint(n, (2 * k + 64,), generator=gen, device=device)
    while True:
        unique, first = _first_occurrence(candidates)
        if unique.numel() >= k:
            return candidates[first.sort().values[:k]]
        candidates = torch.cat([candidates, torch.randint(n, (2 * k,), generator=gen, device=device)])


def _first_occurrence(x: Tensor) -> tuple[Tensor, Tensor]:
    """(unique values, position of each one's first occurrence in x)."""
    unique, inverse = torch.unique(x, return_inverse=True)
    first = torch.full((unique.numel(),), x.numel(), dtype=torch.long, device=x.device)
    first.scatter_reduce_(0, inverse, torch.arange(x.numel(), device=x.device), reduce="amin")
    return unique, first


def centroids(spec: GraphSpec, device: torch.device) -> Tensor:
    """[classes, dim] class centroids with norm ``signal`` (unit noise per feature)."""
    gen = torch.Generator(device).manual_seed(spec.seed + 1)
    c = torch.randn(spec.num_classes, spec.feature_dim, generator=gen, device=device)
    return c / c.norm(dim=1, keepdim=True) * spec.signal * math.sqrt(2.0)


def fill_features(table: Tensor, graph: HeteroGraph, *, rows_per_chunk: int = 1 << 22, on_chunk=None) -> None:
    """Write node features ``signal * centroid[label] + noise`` into ``table`` ([N, dim], host memory), chunk by
    chunk, generating each chunk on the graph's device. ``on_chunk(rows_done)`` reports progress."""
    spec, device = graph.spec, graph.device
    gen = torch.Generator(device).manual_seed(spec.seed + 2)
    cents = centroids(spec, device)
    n = graph.num_nodes
    if tuple(table.shape) != (n, spec.feature_dim):
        raise ValueError(f"feature table has shape {tuple(table.shape)}, the graph needs {(n, spec.feature_dim)}")
    for lo in range(0, n, rows_per_chunk):
        hi = min(n, lo + rows_per_chunk)
        chunk = torch.randn(hi - lo, spec.feature_dim, generator=gen, device=device)
        chunk += cents[graph.labels[lo:hi]]
        table[lo:hi].copy_(chunk.to(table.dtype))
        if on_chunk is not None:
            on_chunk(hi)
