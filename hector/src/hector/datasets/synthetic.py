"""Synthetic twins of the graphs in Hector's evaluation.

Each twin matches its original's node, edge, relation and node-type counts exactly, draws per-relation edge counts
from a power law (a few relations hold most edges), gives each relation a fixed (source type, destination type),
and controls the ratio ``edges / unique (source, relation) pairs`` -- the quantity compact materialisation
exploits -- per relation by construction. Sources within a relation have power-law out-degrees; destinations are
drawn with power-law popularity (in-degree skew). Everything is deterministic given ``seed``.

Node, edge and relation counts are those of ../shared/DESIGN.md. Node-type counts follow the public datasets
(DGL's RDF graphs, OGB). The default pair ratios are estimates, not measurements of the originals (which are not
available offline here): pass ``pair_ratio=`` to study the sensitivity of compaction to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..runtime.graph import Graph


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    num_nodes: int
    num_edges: int
    num_relations: int
    num_node_types: int
    pair_ratio: float  # edges / unique (source, relation) pairs (estimate)


SPECS: dict[str, DatasetSpec] = {s.name: s for s in (
    DatasetSpec("aifb", 7_262, 48_810, 104, 7, 2.5),
    DatasetSpec("mutag", 27_163, 148_100, 50, 5, 2.0),
    DatasetSpec("bgs", 94_806, 672_884, 122, 27, 2.5),
    DatasetSpec("am", 881_680, 5_668_682, 108, 7, 2.5),
    DatasetSpec("mag", 1_939_743, 21_111_007, 4, 4, 3.0),
    DatasetSpec("wikikg2", 2_500_604, 16_109_182, 535, 1, 1.3),
    DatasetSpec("fb15k", 14_541, 620_232, 474, 1, 2.0),
    DatasetSpec("biokg", 93_773, 4_762_678, 51, 5, 3.0),
)}


@dataclass(frozen=True)
class SyntheticGraph:
    name: str
    edge_index: torch.Tensor  # [2, E]
    edge_type: torch.Tensor  # [E]
    node_type: torch.Tensor  # [N]
    num_nodes: int
    num_relations: int
    num_node_types: int
    target_pair_ratio: float

    @property
    def num_edges(self) -> int:
        return self.edge_index.size(1)

    def graph(self) -> Graph:
        return Graph(self.edge_index, self.edge_type, self.num_nodes, self.num_relations, self.node_type,
                     self.num_node_types)

    def features(self, dim: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(self.num_nodes, dim, generator=g, dtype=dtype)

    def stats(self) -> dict[str, float]:
        key = self.edge_index[0] * self.num_relations + self.edge_type
        unique = int(torch.unique(key).numel())
        per_rel = torch.bincount(self.edge_type, minlength=self.num_relations).double()
        indeg = torch.bincount(self.edge_index[1], minlength=self.num_nodes).double()
        return {
            "num_nodes": self.num_nodes, "num_edges": self.num_edges, "num_relations": self.num_relations,
            "num_node_types": self.num_node_types, "num_unique": unique, "pair_ratio": self.num_edges / unique,
            "relation_edges_max_over_median": float(per_rel.max() / per_rel.median().clamp(min=1)),
            "in_degree_max_over_mean": float(indeg.max() / indeg.mean()),
        }


def _power_weights(n: int, exponent: float, gen: torch.Generator) -> torch.Tensor:
    w = torch.arange(1, n + 1, dtype=torch.float64).pow(-exponent)
    return w[torch.randperm(n, generator=gen)]


def _split(total: int, weights: torch.Tensor, minimum: int = 1) -> torch.Tensor:
    """Integer counts >= minimum summing to total, proportional to weights (largest-remainder rounding)."""
    n = weights.numel()
    rest = total - minimum * n
    if rest < 0:
        raise ValueError(f"cannot split {total} into {n} parts of at least {minimum}")
    share = weights / weights.sum() * rest
    counts = share.floor().long()
    short = rest - int(counts.sum())
    if short:
        counts[torch.argsort(share - counts, descending=True)[:short]] += 1
    return counts + minimum


def _unique_counts(edges: torch.Tensor, pools: torch.Tensor, ratio: float) -> torch.Tensor:
    """Unique sources per relation: total = E / ratio, proportional to each relation's edges, within
    [1, min(edges, source pool)]; what a capped relation cannot take goes to the others (water filling)."""
    cap = torch.minimum(edges, pools).double()
    want = max(float(edges.numel()), min(float(cap.sum()), float(edges.sum()) / ratio))
    u = torch.clamp(edges.double() / ratio, min=1.0)
    u = torch.minimum(u, cap)
    for _ in range(64):
        deficit = want - float(u.sum())
        slack = (u < cap) & (deficit > 0) | (u > 1) & (deficit < 0)
        if abs(deficit) < 0.5 or not bool(slack.any()):
            break
        share = edges.double() * slack
        u = torch.clamp(u + deficit * share / share.sum(), min=1.0)
        u = torch.minimum(u, cap)
    return u.round().long().clamp(min=1)


def generate(spec: DatasetSpec, seed: int = 0, pair_ratio: float | None = None,
             relation_skew: float = 1.1, degree_skew: float = 1.5) -> SyntheticGraph:
    """A graph with exactly ``spec``'s counts (see module docs for the distributions)."""
    ratio = spec.pair_ratio if pair_ratio is None else float(pair_ratio)
    if ratio < 1.0:
        raise ValueError(f"pair_ratio is edges per unique (source, relation) pair and must be >= 1, got {ratio}")
    if spec.num_edges < spec.num_relations:
        raise ValueError(f"{spec.name}: {spec.num_edges} edges cannot cover {spec.num_relations} relations")
    gen = torch.Generator().manual_seed(seed)
    n, t, r = spec.num_nodes, spec.num_node_types, spec.num_relations
    # node types: power-law sizes, contiguous id ranges
    type_sizes = _split(n, _power_weights(t, 1.0, gen))
    type_start = torch.cat([torch.zeros(1, dtype=torch.long), type_sizes.cumsum(0)[:-1]])
    node_type = torch.repeat_interleave(torch.arange(t), type_sizes)
    popularity = [torch.randperm(int(s), generator=gen) + int(o) for s, o in zip(type_sizes, type_start, strict=True)]
    # relations: endpoint types and power-law edge counts
    rel_edges = _split(spec.num_edges, _power_weights(r, relation_skew, gen))
    # endpoint types drawn in proportion to type size; the largest relations get the largest source types
    # (otherwise a big relation on a small type could not reach the requested pair ratio)
    rel_src = torch.multinomial(type_sizes.double(), r, replacement=True, generator=gen)
    by_size = rel_src[torch.argsort(type_sizes[rel_src], descending=True, stable=True)]
    rel_src = torch.empty_like(rel_src)
    rel_src[torch.argsort(rel_edges, descending=True, stable=True)] = by_size
    rel_dst = torch.multinomial(type_sizes.double(), r, replacement=True, generator=gen)

    pools = torch.tensor([popularity[int(s)].numel() for s in rel_src], dtype=torch.long)
    rel_unique = _unique_counts(rel_edges, pools, ratio)
    srcs, dsts = [], []
    for rel in range(r):
        e, u = int(rel_edges[rel]), int(rel_unique[rel])
        s_pool, d_pool = popularity[int(rel_src[rel])], popularity[int(rel_dst[rel])]
        # u distinct sources (a random window of the type's shuffled nodes), power-law edges per source
        start = int(torch.randint(0, s_pool.numel(), (1,), generator=gen))
        sources = s_pool[(start + torch.arange(u)) % s_pool.numel()]
        per_source = _split(e, torch.arange(1, u + 1, dtype=torch.float64).pow(-degree_skew / 2), 1) \
            if e > u else torch.ones(u, dtype=torch.long)
        srcs.append(torch.repeat_interleave(sources, per_source))
        # destinations: popular nodes of the destination type receive most edges
        pick = (torch.rand(e, generator=gen, dtype=torch.float64).pow(degree_skew) * d_pool.numel()).long()
        dsts.append(d_pool[pick.clamp(max=d_pool.numel() - 1)])
    src, dst = torch.cat(srcs), torch.cat(dsts)
    etype = torch.repeat_interleave(torch.arange(r), rel_edges)
    order = torch.randperm(src.numel(), generator=gen)  # no accidental sortedness for the layers to rely on
    return SyntheticGraph(spec.name, torch.stack([src[order], dst[order]]), etype[order], node_type, n, r, t, ratio)


def load(name: str, scale: float = 1.0, seed: int = 0, pair_ratio: float | None = None) -> SyntheticGraph:
    """The synthetic twin of ``name`` (one of :data:`SPECS`), optionally scaled down (nodes and edges times
    ``scale``; relation and node-type counts kept) for tests."""
    if name not in SPECS:
        raise ValueError(f"unknown dataset {name!r}; known: {sorted(SPECS)}")
    if not 0.0 < scale <= 1.0:
        raise ValueError(f"scale must be in (0, 1], got {scale}")
    spec = SPECS[name]
    if scale < 1.0:
        edges = max(spec.num_relations, round(spec.num_edges * scale))
        nodes = max(spec.num_node_types, round(spec.num_nodes * scale))
        spec = DatasetSpec(spec.name, nodes, edges, spec.num_relations, spec.num_node_types, spec.pair_ratio)
    return generate(spec, seed, pair_ratio)
