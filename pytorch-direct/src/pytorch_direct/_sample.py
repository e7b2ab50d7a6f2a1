"""Neighbour sampling (PyG's ``NeighborLoader`` semantics) where the topology is read from: by the GPU for a graph in
GPU memory or in host memory as unified tensors (read zero-copy), by the CPU otherwise.

Per hop, every frontier node draws ``min(in-degree, fanout)`` distinct in-edges uniformly (``replace=False``): a
random key per in-edge of the frontier, one sort, the first ``fanout`` of each node. There is no per-node loop:
the sampler's time on a GPU is launch overhead and host round trips, not GPU work, so each hop is a fixed, small
number of kernels and, for a homogeneous graph, one host round trip (the hop's edge counts; a hop's new nodes, at
most one per sampled edge, are counted on the device and read with the next hop's counts), plus one at the end.
Sources not in the batch yet get the next local ids through a global -> local id map of one int32 per node (and one
scratch entry) kept on the sampling device and reset after each batch by touching only the batch's nodes, so
relabelling costs O(batch), not O(graph). New nodes of a hop are numbered in ascending global id, so feature rows
are read in address order.

A heterogeneous graph is sampled as one graph: node ids are offset per node type, and each edge type has its own
block of destination slots in one CSC array, so a hop over every edge type is still one set of kernels.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from . import _sample_script
from ._create import is_unified


@dataclass
class Topology:
    """A graph in CSC form, as the sampler reads it.

    The in-edges of destination slot ``s`` are positions ``colptr[s]:colptr[s + 1]`` of ``row`` (their sources,
    global node ids). For a homogeneous graph the slots are the nodes. ``edge_type`` ([E]) gives each edge's relation
    (typed edges, e.g. for RGCN/RGAT), ``node_type`` ([N]) each node's type, ``edge_id`` ([E]) each edge's id in the
    user's edge list (``None``: its CSC position). The tensors may live in GPU memory, in host memory as
    pytorch-direct unified tensors (read zero-copy by the GPU), or in plain CPU memory (sampled by the CPU).
    """

    colptr: Tensor
    row: Tensor
    edge_type: Tensor | None = None
    node_type: Tensor | None = None
    edge_id: Tensor | None = None
    num_nodes: int | None = None  # default: the number of slots (homogeneous)

    def __post_init__(self) -> None:
        if self.colptr.dim() != 1 or self.colptr.numel() < 1:
            raise ValueError(f"colptr must be a 1-D tensor of (destinations + 1) offsets, got shape "
                             f"{tuple(self.colptr.shape)}")
        if self.row.dim() != 1:
            raise ValueError(f"row must be a 1-D tensor of one source per edge, got shape {tuple(self.row.shape)}")
        for name in ("edge_type", "edge_id"):
            t = getattr(self, name)
            if t is not None and t.shape != self.row.shape:
                raise ValueError(f"{name} must have one entry per edge ({self.row.numel()}), got shape "
                                 f"{tuple(t.shape)}")
        for name in ("colptr", "row", "edge_type", "node_type", "edge_id"):
            t = getattr(self, name)
            if t is not None and (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool):
                raise TypeError(f"{name} must hold integers, got {t.dtype}")
        if self.num_nodes is None:
            self.num_nodes = self.colptr.numel() - 1
        if self.node_type is not None and self.node_type.shape != (self.num_nodes,):
            raise ValueError(f"node_type must have one entry per node ({self.num_nodes}), got shape "
                             f"{tuple(self.node_type.shape)}")

    @property
    def num_slots(self) -> int:
        return self.colptr.numel() - 1

    @property
    def num_edges(self) -> int:
        return self.row.numel()

    def tensors(self) -> dict[str, Tensor]:
        return {k: getattr(self, k) for k in ("colptr", "row", "edge_type", "node_type", "edge_id")
                if getattr(self, k) is not None}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def placed(self, where: str, device: torch.device) -> Topology:
        """The same topology with its tensors in ``device`` memory ("device"), in host memory as unified tensors
        ("host"), or as they are ("as_is")."""
        if where == "as_is":
            return self
        moved = {}
        for name, t in self.tensors().items():
            if where == "device":
                moved[name] = t if t.device == device and not is_unified(t) else t.to(device)
            elif where == "host":
                from ._create import unified

                moved[name] = t if is_unified(t) else unified(t.cpu().contiguous(), copy=True)
            else:
                raise ValueError(f"topology placement must be 'device', 'host' or 'as_is', got {where!r}")
        return Topology(**moved, num_nodes=self.num_nodes)


@dataclass(frozen=True)
class Blocks:
    """How edge types map onto one CSC (see the module docstring): for edge type k, its destinations (of node type
    ``dst_type[k]``, local id ``v``) are slots ``slot_offset[k] + v`` and its edges CSC positions
    ``edge_offset[k]:edge_offset[k + 1]``; node type t holds global ids ``node_offset[t]:node_offset[t + 1]``."""

    node_offset: tuple[int, ...]  # [T + 1]
    slot_offset: tuple[int, ...]  # [K + 1]
    edge_offset: tuple[int, ...]  # [K + 1]
    src_type: tuple[int, ...]  # [K]
    dst_type: tuple[int, ...]  # [K]

    @property
    def num_node_types(self) -> int:
        return len(self.node_offset) - 1

    @property
    def num_edge_types(self) -> int:
        return len(self.src_type)


@dataclass
class SampledSubgraph:
    """One sampled mini-batch, with the fields of PyG's ``NeighborLoader`` output (``Data``).

    ``n_id``: global ids, the first ``batch_size`` are the seeds in the order given, then each hop's new nodes in
    ascending id. ``edge_index``: local (source, destination), messages flow from sampled neighbours to the nodes
    that sampled them; edges are grouped by hop, then by destination. ``e_id``: each edge's id (see
    :class:`Topology`). ``edge_type`` / ``node_type``: read from the topology (``None`` where it has none; for a
    heterogeneous graph, the edge type and node type indices). ``num_sampled_nodes``: per hop, the seeds first;
    ``num_sampled_edges``: per hop.
    """

    n_id: Tensor
    edge_index: Tensor
    e_id: Tensor
    batch_size: int
    edge_type: Tensor | None = None
    node_type: Tensor | None = None
    num_sampled_nodes: list[int] = field(default_factory=list)
    num_sampled_edges: list[int] = field(default_factory=list)
    pos: Tensor | None = None  # the edges' CSC positions

    @property
    def num_nodes(self) -> int:
        return self.n_id.numel()

    @property
    def num_edges(self) -> int:
        return self.edge_index.size(1)

    def tensors(self) -> list[Tensor]:
        return [t for t in (self.n_id, self.edge_index, self.e_id, self.edge_type, self.node_type, self.pos)
                if t is not None]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> SampledSubgraph:
        def move(t):
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return SampledSubgraph(move(self.n_id), move(self.edge_index), move(self.e_id), self.batch_size,
                               move(self.edge_type), move(self.node_type), list(self.num_sampled_nodes),
                               list(self.num_sampled_edges), move(self.pos))


def _read(t: Tensor, index: Tensor) -> Tensor:
    """``t[index]``: a plain tensor on the index's device, or a unified tensor (read zero-copy by the GPU for CUDA
    indices)."""
    return t[index]


def default_device(topology: Topology) -> torch.device:
    """Where a topology is sampled by default: on its GPU; on the GPU for unified tensors when one is usable; else
    on the CPU."""
    colptr = topology.colptr
    if colptr.device.type == "cuda":
        return colptr.device
    if is_unified(colptr):
        from ._memory import cuda_usable

        if cuda_usable():
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class NeighborSampler:
    """Samples ``num_neighbors[h]`` in-edges per frontier node at hop ``h`` (-1: all of them) around seed nodes.

    ``topology``: a :class:`Topology`. ``num_neighbors``: a list of fan-outs, one per hop (or, with ``blocks``, a
    ``[hops][edge types]`` nested list). ``replace=False`` draws distinct edges (PyG's default); ``replace=True``
    draws ``fanout`` edges with replacement from every node that has in-edges. ``device``: where sampling runs and
    its output lies (default: see :func:`default_device`); a plain CPU topology sampled on a GPU must be moved
    there first (``Topology.placed``). ``generator``: random numbers on ``device``.

    One ``sample`` at a time per sampler: its id map is shared between calls (not thread-safe), and a call made on
    another CUDA stream than the previous one must be ordered after it (the loader does this).

    A homogeneous graph held in GPU or CPU memory is sampled by one TorchScript function per batch, which runs
    without holding the GIL (a loader thread then leaves the interpreter to the training thread); unified
    tensors and edge-type blocks are sampled by the same operations called from Python (so is everything with
    ``script=False``, for comparison).
    """

    def __init__(self, topology: Topology, num_neighbors: list[int] | dict[Any, list[int]], *, replace: bool = False,
                 device: torch.device | str | None = None, generator: torch.Generator | None = None,
                 blocks: Blocks | None = None, script: bool = True) -> None:
        self.topology = topology
        self.blocks = blocks
        self.device = torch.device(device) if device is not None else default_device(topology)
        for name, t in topology.tensors().items():
            if is_unified(t):
                continue
            if t.device.type != self.device.type:
                raise ValueError(f"topology.{name} is on {t.device} but sampling runs on {self.device}: move it "
                                 f"there (Topology.placed('device', device)), or hold it as unified tensors "
                                 f"(Topology.placed('host', device)) to be read zero-copy by the GPU")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if blocks is None and topology.num_nodes != topology.num_slots:
            raise ValueError(f"a homogeneous topology has one destination slot per node: colptr has "
                             f"{topology.num_slots + 1} entries for {topology.num_nodes} nodes (num_nodes + 1 needed)")
        self.fanouts = _fanout_table(num_neighbors, blocks)
        self.num_hops = len(self.fanouts)
        self.replace = bool(replace)
        self.num_nodes = int(topology.num_nodes)
        self.generator = generator
        # one entry per node, and a scratch entry (at num_nodes, the sentinel) that the homogeneous path's
        # repeated sources write instead of a node's
        self._local = torch.full((self.num_nodes + 1,), -1, dtype=torch.int32, device=self.device)
        self._sentinel = torch.full((1,), self.num_nodes, dtype=topology.row.dtype, device=self.device)
        # the homogeneous path: TorchScript for plain tensors, Python for unified ones (their reads dispatch
        # through Python)
        self.script = script
        if blocks is not None:
            dev = self.device
            self._node_offset = torch.tensor(blocks.node_offset, dtype=torch.long, device=dev)
            self._slot_offset = torch.tensor(blocks.slot_offset[:-1], dtype=torch.long, device=dev)
            # the edge types into each node type, grouped by that type (CSR over node types)
            by_dst = sorted(range(blocks.num_edge_types), key=lambda k: blocks.dst_type[k])
            counts = [sum(1 for k in by_dst if blocks.dst_type[k] == t) for t in range(blocks.num_node_types)]
            self._types_in = torch.tensor(by_dst, dtype=torch.long, device=dev)
            # (and none into the type past the last: that of the padding after a hop's new nodes)
            self._types_in_count = torch.tensor(counts + [0], dtype=torch.long, device=dev)
            self._types_in_start = torch.cumsum(self._types_in_count, 0) - self._types_in_count
            self._fanout_table = torch.tensor(self.fanouts, dtype=torch.long, device=dev)  # [hops, K]

    def sample(self, seeds: Tensor, *, check: bool = True) -> SampledSubgraph:
        """The sampled subgraph around ``seeds`` (distinct global node ids, 1-D; for a heterogeneous graph, global
        ids of one node type). ``check=False`` skips the range and distinctness check (one host round trip): for
        seeds already checked, as the loader does once per loader."""
        seeds = seeds.to(self.device, torch.long)
        if seeds.dim() != 1 or seeds.numel() == 0:
            raise ValueError(f"seeds must be a non-empty 1-D tensor of node ids, got shape {tuple(seeds.shape)}")
        if check:
            check_seeds(seeds, self.num_nodes)
        if self._homogeneous is not None:
            return self._sample_homogeneous(seeds)
        local = self._local
        batch = seeds.numel()
        local[seeds] = torch.arange(batch, dtype=torch.int32, device=self.device)
        found, srcs, dsts, poss, etypes = [], [], [], [], []
        num_nodes_per_hop, num_edges_per_hop = [batch], []
        frontier, frontier_start, last = seeds, 0, []
        pad = self.num_nodes  # (the sentinel's value: a node of no type, into which no edge type leads)
        # (with edge-type blocks; the homogeneous path is one TorchScript function, see _sample_homogeneous). A hop's
        # new nodes are numbered on the device and counted on the host with the next hop's slot count (see
        # _sample_script.number_new): two host round trips per hop, and one at the end.
        try:
            for hop in range(self.num_hops):
                pos, dst_local, block, layer = self._sample_hop(hop, frontier, frontier_start, last)
                if hop > 0:
                    num_nodes_per_hop.append(layer)
                total = frontier_start + num_nodes_per_hop[-1]  # the local id of the hop's first new node
                src = _read(self.topology.row, pos)
                new, last = _sample_script.number_new(local, src, self._sentinel, total, pad)
                srcs.append(local[src])
                dsts.append(dst_local)
                poss.append(pos)
                etypes.append(block)
                found.append(new)
                num_edges_per_hop.append(pos.numel())
                frontier, frontier_start = new, total
            num_nodes_per_hop.append(_count_of(last, pad))
            # (the new nodes are in the row's dtype: the concatenation makes them int64)
            n_id = torch.cat([seeds] + [f[:n] for f, n in zip(found, num_nodes_per_hop[1:], strict=True)])
        except BaseException:
            local.fill_(-1)  # (which entries this batch set is not known here)
            raise
        local[-1:].fill_(-1)  # the scratch entry
        local.index_fill_(0, n_id, -1)  # (local[n_id] = -1 would copy the -1 from the host: a sync)
        pos = torch.cat(poss)
        topo = self.topology
        e_id = _read(topo.edge_id, pos).long() if topo.edge_id is not None else pos
        edge_type = torch.cat(etypes)
        node_type = torch.searchsorted(self._node_offset, n_id, right=True) - 1
        edge_index = torch.stack([torch.cat(srcs).long(), torch.cat(dsts)])
        return SampledSubgraph(n_id, edge_index, e_id, batch, edge_type, node_type, num_nodes_per_hop,
                               num_edges_per_hop, pos)

    @property
    def script(self) -> bool:
        """Whether a homogeneous batch runs as one TorchScript function without the GIL (see the class docstring);
        False where the topology is unified, has edge-type blocks, or TorchScript is not available."""
        return self._homogeneous is not None and self._homogeneous is not _sample_script.sample_homogeneous

    @script.setter
    def script(self, value: bool) -> None:
        """``False``: the same operations called from Python, holding the GIL for each (for comparison)."""
        self._homogeneous = None
        if self.blocks is None:
            plain = not any(is_unified(t) for t in self.topology.tensors().values())
            compiled = _sample_script.scripted() if value and plain else None
            self._homogeneous = compiled or _sample_script.sample_homogeneous

    def _sample_homogeneous(self, seeds: Tensor) -> SampledSubgraph:
        topo = self.topology
        try:
            n_id, edge_index, e_id, pos, edge_type, node_type, num_nodes, num_edges = _sample_script.run(
                self._homogeneous, topo.colptr, topo.row, self._local, seeds, self._sentinel,
                [f[0] for f in self.fanouts], self.replace, self.generator, topo.edge_id, topo.edge_type,
                topo.node_type)
        except BaseException:
            self._local.fill_(-1)  # (which entries the batch set is not known here)
            raise
        return SampledSubgraph(n_id, edge_index, e_id, seeds.numel(), edge_type, node_type, num_nodes, num_edges,
                               pos)

    def _frontier_slots(self, hop: int, frontier: Tensor, frontier_start: int, last: list[Tensor]):
        """With edge-type blocks: (destination slots, local id of each slot's node, fan-out per slot, edge type per
        slot, the frontier's node count). The frontier is the last hop's buffer (see
        ``_sample_script.number_new``): its padding has the type past the last, into which no edge type leads, so
        it gets no slot; its node count is read with the slot count (one host round trip)."""
        frontier = frontier.long()
        arange = torch.arange(frontier.numel(), device=self.device)
        # one slot per (frontier node, edge type into its node type)
        ftype = torch.searchsorted(self._node_offset, frontier, right=True) - 1
        count = self._types_in_count[ftype]
        cum = torch.cumsum(count, 0)
        read = torch.cat([cum[-1:]] + last).tolist() if count.numel() else [0]  # a host round trip
        pairs = read[0]
        layer = _sample_script.new_count(read[1], read[2], self.num_nodes) if len(read) == 3 else frontier.numel()
        owner = torch.repeat_interleave(arange, count, output_size=pairs)
        first = cum - count
        k = self._types_in[self._types_in_start[ftype[owner]] + torch.arange(pairs, device=self.device) - first[owner]]
        slots = self._slot_offset[k] + frontier[owner] - self._node_offset[ftype[owner]]
        return slots, owner + frontier_start, self._fanout_table[hop][k], k, layer

    def _sample_hop(self, hop: int, frontier: Tensor, frontier_start: int, last: list[Tensor]):
        """With edge-type blocks: (CSC positions of the sampled in-edges, local id of each edge's destination, edge
        type of each edge, the frontier's node count). One host round trip besides the slot expansion: the number
        of in-edges and of sampled edges. (The homogeneous path is ``_sample_script.sample_homogeneous``: the same
        draw, one fan-out.)"""
        slots, dst_local, fanout, kind, layer = self._frontier_slots(hop, frontier, frontier_start, last)
        if slots.numel() == 0:
            empty = torch.empty(0, dtype=torch.long, device=self.device)
            return empty, empty, empty, layer
        colptr = self.topology.colptr
        begin = _read(colptr, slots)
        degree = _read(colptr, slots + 1) - begin
        every = fanout < 0  # per slot: all its in-edges
        bounded = torch.where(degree > 0, fanout, 0) if self.replace else torch.minimum(degree, fanout)
        take = torch.where(every, degree, bounded)
        cum_degree, cum_take = degree.cumsum(0), take.cumsum(0)
        total, taken = torch.stack([cum_degree[-1], cum_take[-1]]).tolist()  # one host round trip
        # (repeat_interleave of counts alone repeats 0..n-1: the slot of each sampled edge)
        owner_taken = torch.repeat_interleave(take, output_size=taken)
        dst_out = dst_local[owner_taken]
        kind_out = kind[owner_taken]
        # the j-th sampled edge of its slot
        j = torch.arange(taken, device=self.device) - (cum_take - take)[owner_taken]
        if total == taken and not self.replace:  # every in-edge is taken: nothing to draw
            return begin[owner_taken] + j, dst_out, kind_out, layer
        begin_taken = begin[owner_taken]
        if self.replace:  # fan-out draws of one of degree edges each; slots with fan-out -1 take all, in order
            u = torch.rand(taken, dtype=torch.float64, device=self.device, generator=self.generator)
            d = degree[owner_taken]
            drawn = (u * d).long().clamp(max=d - 1)
            return begin_taken + torch.where(every[owner_taken], j, drawn), dst_out, kind_out, layer
        # A random key per in-edge of the frontier; sorted, each slot's edges stay together (keys of slot i lie in
        # [i, i + 1)) in a random order, and their first min(degree, fanout) are a uniform sample without
        # replacement. One sort instead of a loop of fanout steps of small kernels.
        key = torch.rand(total, dtype=torch.float64, device=self.device, generator=self.generator)
        key += torch.repeat_interleave(degree, output_size=total)
        order = torch.argsort(key)
        start_taken = (cum_degree - degree)[owner_taken]
        # order[start + j] is the index among the frontier's in-edges; minus start, among its slot's
        return begin_taken + order[start_taken + j] - start_taken, dst_out, kind_out, layer


def _count_of(last: list[Tensor], sentinel: int) -> int:
    """The new-node count of a hop from the tensors :func:`_sample_script.number_new` returned (a host round trip
    where it found any)."""
    if not last or last[0].numel() == 0:
        return 0
    rank, value = torch.cat(last).tolist()
    return _sample_script.new_count(rank, value, sentinel)


def check_seeds(seeds: Tensor, num_nodes: int, what: str = "seed") -> None:
    """Range and distinctness of node ids (one host round trip); raises ``IndexError`` / ``ValueError``."""
    if seeds.numel() == 0:
        return
    ordered = torch.sort(seeds).values
    repeats = (ordered[1:] == ordered[:-1]).sum()
    low, high, repeated = torch.stack([ordered[0], ordered[-1], repeats]).tolist()
    if low < 0 or high >= num_nodes:
        raise IndexError(f"{what} ids must lie in [0, {num_nodes}), got [{low}, {high}]")
    if repeated:
        raise ValueError(f"{what}s must be distinct node ids ({repeated} appear more than once)")


def _fanout_table(num_neighbors, blocks: Blocks | None) -> list[list[int]]:
    """``[hops][edge types]`` fan-outs (one column without blocks), checked."""
    if isinstance(num_neighbors, (int,)) or not isinstance(num_neighbors, (list, tuple)) or not num_neighbors:
        raise ValueError(f"num_neighbors must list a fan-out per hop (e.g. [15, 10]; -1 for all), got "
                         f"{num_neighbors!r}")
    kinds = 1 if blocks is None else blocks.num_edge_types
    table = []
    for hop, entry in enumerate(num_neighbors):
        row = [int(entry)] * kinds if not isinstance(entry, (list, tuple)) else [int(k) for k in entry]
        if len(row) != kinds:
            raise ValueError(f"num_neighbors[{hop}] has {len(row)} entries for {kinds} edge types")
        if any(k < -1 for k in row):
            raise ValueError(f"fan-outs must be >= 0, or -1 for all neighbours; got {row} at hop {hop}")
        if blocks is None and row[0] == 0:
            raise ValueError(f"num_neighbors must list a positive fan-out (or -1 for all) per hop, got "
                             f"{list(num_neighbors)}")
        table.append(row)
    return table
