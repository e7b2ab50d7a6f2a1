"""Neighbour sampling for mini-batch GNN training, run where the topology is read from (the GPU for a graph in GPU
memory or in host memory as pytorch-direct unified tensors read zero-copy; the CPU otherwise), with the output of
PyG's ``NeighborLoader``.

PyG's own ``NeighborLoader`` needs pyg-lib or torch-sparse for sampling (not installable from every package index);
:func:`pyg_neighbor_loader_available` says whether it can be used, and :class:`PygSampler` adapts it.

For each hop, every frontier node draws ``min(in-degree, fanout)`` distinct in-edges uniformly (a random key per
in-edge of the frontier, one sort, the first ``fanout`` of each node; no per-node loop), as PyG does with
``replace=False``. Sampled sources not seen yet in the batch get the next local ids through a global -> local
id map of one int32 per node kept on the device (reset after each batch by touching only the batch's nodes), so
relabelling costs O(batch), not O(graph). New nodes of a hop are numbered in ascending global id, so feature rows are
read in address order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class SampledSubgraph:
    """One mini-batch, with the field names of PyG's ``NeighborLoader`` output (``Data``)."""

    n_id: Tensor  # [nodes] global ids; the first batch_size are the seeds, in the order given
    edge_index: Tensor  # [2, edges] local (source, destination): messages flow from sampled neighbours to the seeds
    edge_type: Tensor  # [edges] int64 relation ids
    e_id: Tensor  # [edges] positions of the edges in the graph's CSC arrays
    node_type: Tensor  # [nodes] int64
    batch_size: int
    num_sampled_nodes: list[int] = field(default_factory=list)  # per hop; the first entry is batch_size
    num_sampled_edges: list[int] = field(default_factory=list)  # per hop

    @property
    def num_nodes(self) -> int:
        return self.n_id.numel()

    @property
    def num_edges(self) -> int:
        return self.edge_index.size(1)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> SampledSubgraph:
        move = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        return SampledSubgraph(move(self.n_id), move(self.edge_index), move(self.edge_type), move(self.e_id),
                               move(self.node_type), self.batch_size, list(self.num_sampled_nodes),
                               list(self.num_sampled_edges))


class NeighborSampler:
    """Samples ``num_neighbors[h]`` in-edges per node at hop h (-1: all of them) around a batch of seed nodes.

    ``colptr`` ([N + 1], int64), ``row`` ([E], sources) and ``edge_type`` ([E]) describe the graph in CSC form
    (the in-edges of node v are positions ``colptr[v]:colptr[v+1]``); ``node_type`` ([N]) is optional. They may be
    plain tensors on ``device`` or pytorch-direct unified tensors in host memory (read zero-copy by the GPU with
    CUDA indices). Sampling runs on ``device``; the output lies there.
    """

    def __init__(self, colptr: Tensor, row: Tensor, edge_type: Tensor, num_neighbors: list[int], *,
                 node_type: Tensor | None = None, device: torch.device | str | None = None,
                 generator: torch.Generator | None = None) -> None:
        if colptr.dim() != 1 or colptr.numel() < 2:
            raise ValueError(f"colptr must be a 1-D tensor of N + 1 offsets, got shape {tuple(colptr.shape)}")
        if row.dim() != 1 or edge_type.shape != row.shape:
            raise ValueError(f"row and edge_type must be 1-D tensors of one entry per edge, got shapes "
                             f"{tuple(row.shape)} and {tuple(edge_type.shape)}")
        if not num_neighbors or any(int(k) < -1 or int(k) == 0 for k in num_neighbors):
            raise ValueError(f"num_neighbors must list a positive fan-out (or -1 for all) per hop, got {num_neighbors}")
        self.colptr, self.row, self.edge_type, self.node_type = colptr, row, edge_type, node_type
        self.num_neighbors = [int(k) for k in num_neighbors]
        self.device = torch.device(device) if device is not None else colptr.device
        self.num_nodes = colptr.numel() - 1
        self.generator = generator
        # global id -> local id in the current batch (-1: not in it); reset after each batch
        self._local = torch.full((self.num_nodes,), -1, dtype=torch.int32, device=self.device)

    def _read(self, t: Tensor, index: Tensor) -> Tensor:
        """``t[index]`` for a plain tensor on the sampling device or a unified tensor (zero-copy from host)."""
        return t[index]

    def sample(self, seeds: Tensor) -> SampledSubgraph:
        seeds = seeds.to(self.device, torch.long)
        if seeds.dim() != 1 or seeds.numel() == 0:
            raise ValueError(f"seeds must be a non-empty 1-D tensor of node ids, got shape {tuple(seeds.shape)}")
        ordered = torch.sort(seeds).values
        repeats = (ordered[1:] == ordered[:-1]).sum()
        low, high, repeated = torch.stack([ordered[0], ordered[-1], repeats]).tolist()  # one host round trip
        if low < 0 or high >= self.num_nodes:
            raise IndexError(f"seed ids must lie in [0, {self.num_nodes}), got [{low}, {high}]")
        if repeated:
            raise ValueError(f"seeds must be distinct node ids ({repeated} seed(s) appear more than once)")
        local = self._local
        batch = seeds.numel()
        local[seeds] = torch.arange(batch, dtype=torch.int32, device=self.device)
        nodes = [seeds]
        srcs, dsts, etypes, eids = [], [], [], []
        num_nodes_per_hop, num_edges_per_hop = [batch], []
        frontier, frontier_start, total = seeds, 0, batch
        try:
            for fanout in self.num_neighbors:
                pos, dst_local = self._sample_hop(frontier, frontier_start, fanout)
                src = self._read(self.row, pos).long()
                # the sources not in the batch yet, sorted (rows are read in address order); unseen ones keep their
                # id, the others become the sentinel num_nodes, which is added once more so it is always the last
                # value and can be dropped without asking the device whether it occurred
                sentinel = torch.full((1,), self.num_nodes, dtype=src.dtype, device=self.device)
                new = torch.unique(torch.cat([torch.where(local[src] < 0, src, sentinel), sentinel]))[:-1]
                local[new] = torch.arange(total, total + new.numel(), dtype=torch.int32, device=self.device)
                srcs.append(local[src].long())
                dsts.append(dst_local)
                etypes.append(self._read(self.edge_type, pos).long())
                eids.append(pos)
                nodes.append(new)
                num_nodes_per_hop.append(new.numel())
                num_edges_per_hop.append(pos.numel())
                frontier, frontier_start, total = new, total, total + new.numel()
            n_id = torch.cat(nodes)
        finally:
            for part in nodes:
                local.index_fill_(0, part, -1)  # (local[part] = -1 would copy the -1 from the host: a sync)
        node_type = self._read(self.node_type, n_id).long() if self.node_type is not None else \
            torch.zeros_like(n_id)
        edge_index = torch.stack([torch.cat(srcs), torch.cat(dsts)])
        return SampledSubgraph(n_id, edge_index, torch.cat(etypes), torch.cat(eids), node_type, batch,
                               num_nodes_per_hop, num_edges_per_hop)

    def _sample_hop(self, frontier: Tensor, frontier_start: int, fanout: int) -> tuple[Tensor, Tensor]:
        """(CSC positions of the sampled in-edges, local id of each edge's destination). One host round trip: the
        number of in-edges and of sampled edges, which size everything else."""
        n = frontier.numel()
        arange_n = torch.arange(n, device=self.device)
        begin = self._read(self.colptr, frontier).long()
        degree = self._read(self.colptr, frontier + 1).long() - begin
        dst_local = arange_n + frontier_start
        take = degree if fanout < 0 else degree.clamp(max=fanout)
        total, taken = torch.stack([degree.sum(), take.sum()]).tolist()
        # every in-edge of the frontier, grouped by its destination (owner), with its offset in that group
        owner = torch.repeat_interleave(arange_n, degree, output_size=total)
        start = torch.cumsum(degree, 0) - degree
        if fanout < 0:
            return begin[owner] + torch.arange(total, device=self.device) - start[owner], dst_local[owner]
        # A random key per edge; sorted, each group's edges stay together (keys of group i lie in [i, i + 1)) in a
        # random order, and their first min(degree, fanout) are a uniform sample without replacement. One sort of
        # the frontier's edges instead of a loop of fanout steps of small kernels: the sampler's time was launch
        # overhead on the host, not GPU work.
        key = owner.double() + torch.rand(total, dtype=torch.float64, device=self.device, generator=self.generator)
        order = torch.argsort(key)
        # the j-th sampled edge of a group sits at position start + j of the sorted order
        owner_taken = torch.repeat_interleave(arange_n, take, output_size=taken)
        j = torch.arange(taken, device=self.device) - (torch.cumsum(take, 0) - take)[owner_taken]
        edge = order[start[owner_taken] + j]  # index among the frontier's in-edges
        return begin[owner_taken] + edge - start[owner_taken], dst_local[owner_taken]


def pyg_neighbor_loader_available() -> bool:
    """True where PyG's NeighborLoader can sample (pyg-lib or torch-sparse installed)."""
    try:
        import torch_geometric.typing as pyg_typing
    except ImportError:
        return False
    return bool(pyg_typing.WITH_PYG_LIB or pyg_typing.WITH_TORCH_SPARSE)


class PygSampler:
    """PyG's ``NeighborLoader`` sampling (on the CPU, through pyg-lib or torch-sparse) behind the same ``sample``
    call as :class:`NeighborSampler`. Only the topology is handed to PyG: features are gathered by the training
    script, as with :class:`NeighborSampler`, so both feature paths can be compared on PyG's sampling too."""

    def __init__(self, colptr: Tensor, row: Tensor, edge_type: Tensor, num_neighbors: list[int], *,
                 node_type: Tensor | None = None, device: torch.device | str = "cpu", seed: int = 0) -> None:
        if not pyg_neighbor_loader_available():
            raise RuntimeError("PyG's NeighborLoader needs pyg-lib or torch-sparse: pip install pyg-lib "
                               "(see https://pyg.org), or use the built-in sampler (--sampler ours)")
        from torch_geometric.data import Data
        from torch_geometric.sampler import NeighborSampler as PygNeighborSampler

        colptr, row = colptr.cpu().long(), row.cpu().long()
        num_nodes = colptr.numel() - 1
        dst = torch.repeat_interleave(torch.arange(num_nodes), colptr[1:] - colptr[:-1])
        data = Data(edge_index=torch.stack([row, dst]), edge_type=edge_type.cpu().long(), num_nodes=num_nodes)
        self._edge_type = data.edge_type
        self._node_type = node_type.cpu().long() if node_type is not None else None
        self._sampler = PygNeighborSampler(data, num_neighbors=list(num_neighbors), replace=False)
        self.device = torch.device(device)
        self.num_nodes = num_nodes
        torch.manual_seed(seed)  # pyg-lib draws from torch's global generator

    def sample(self, seeds: Tensor) -> SampledSubgraph:
        from torch_geometric.sampler import NodeSamplerInput

        seeds = seeds.cpu().long()
        out = self._sampler.sample_from_nodes(NodeSamplerInput(input_id=None, node=seeds))
        # PyG's sampler output is (row, col) = (source, destination) local ids, as in NeighborLoader's batches.
        edge_index = torch.stack([out.row, out.col])
        node_type = self._node_type[out.node] if self._node_type is not None else torch.zeros_like(out.node)
        sub = SampledSubgraph(out.node, edge_index, self._edge_type[out.edge], out.edge, node_type, seeds.numel(),
                              list(out.num_sampled_nodes or []), list(out.num_sampled_edges or []))
        return sub.to(self.device)
