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

A heterogeneous graph is sampled as one graph: node ids are offset per node type, and each node's in-edges are
grouped by edge type in one CSC array; a hop draws per run of one (node, edge type) with that type's fan-out, so it
is one set of kernels over the frontier's in-edges whatever the number of edge types (a node is never looked at
for an edge type it has no in-edges of).
"""

from __future__ import annotations

import functools
import logging
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from . import _sample_cuda, _sample_script
from ._config import settings
from ._create import is_unified

log = logging.getLogger("pytorch_direct")
_noted: set[str] = set()


def _note_once(message: str, loud: bool) -> None:
    """Logs a message once per process (a sampler is made per loader, often many times): a warning when ``loud``,
    else at info level."""
    if message not in _noted:
        _noted.add(message)
        log.log(logging.WARNING if loud else logging.INFO, message)


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
    """How a heterogeneous graph maps onto one graph (see the module docstring): node type t holds global ids
    ``node_offset[t]:node_offset[t + 1]``; edge type k joins node type ``src_type[k]`` to ``dst_type[k]``. The
    topology is a CSC over the global ids whose in-edges of a node are grouped by edge type, with each edge's type
    index in ``Topology.edge_type``."""

    node_offset: tuple[int, ...]  # [T + 1]
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
    """Samples ``num_neighbors[h]`` in-edges per frontier node at hop ``h`` (-1, or any negative fan-out: all of
    them) around seed nodes.

    ``topology``: a :class:`Topology`. ``num_neighbors``: a list of fan-outs, one per hop (or, with ``blocks``, a
    ``[hops][edge types]`` nested list). As in PyG, a fan-out of 0 draws no edge (a homogeneous graph's hop then
    adds no node, and the hops after it draw none either), and ``[]`` (no hops) makes a batch of the seeds alone.
    ``replace=False`` draws distinct edges (PyG's default); ``replace=True`` draws ``fanout`` edges with replacement
    from every node that has in-edges. ``device``: where sampling runs and its output lies (default: see
    :func:`default_device`); a plain CPU topology sampled on a GPU must be moved there first (``Topology.placed``).
    ``generator``: random numbers on ``device``.

    One ``sample`` at a time per sampler: its id map is shared between calls (not thread-safe), and a call made on
    another CUDA stream than the previous one must be ordered after it (the loader does this).

    On a GPU, a graph is sampled by the package's own CUDA kernels: per hop a few launches and one host round trip
    (``kernels=True``, the default there, set by ``PYTORCH_DIRECT_SAMPLER``). Otherwise (``kernels=False``, or on
    the CPU) a graph held in GPU or CPU memory is
    sampled by one TorchScript function per batch, which runs without holding the GIL (a loader thread then leaves
    the interpreter to the training thread); unified tensors are sampled by the same operations called from Python
    (their reads dispatch through Python; so is everything with ``script=False``, for comparison). The two paths
    give the same guarantees (distinct draws, counts, ``n_id`` order, ``e_id``), not the same random draws.
    """

    def __init__(self, topology: Topology, num_neighbors: list[int] | dict[Any, list[int]], *, replace: bool = False,
                 device: torch.device | str | None = None, generator: torch.Generator | None = None,
                 blocks: Blocks | None = None, script: bool = True, kernels: bool | None = None) -> None:
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
        if topology.num_nodes != topology.num_slots:
            raise ValueError(f"the sampler's topology has one destination slot per node: colptr has "
                             f"{topology.num_slots + 1} entries for {topology.num_nodes} nodes (num_nodes + 1 needed)")
        self.fanouts = _fanout_table(num_neighbors, blocks, replace, topology.num_edges)
        self._hop_fanouts = [f[0] for f in self.fanouts]  # (the homogeneous sampler's argument, made once)
        self.num_hops = len(self.fanouts)
        self.replace = bool(replace)
        self.num_nodes = int(topology.num_nodes)
        self.generator = generator
        # one entry per node, and a scratch entry (at num_nodes, the sentinel) that repeated and seen sources write
        # instead of a node's (see _sample_script.number_new)
        self._local = torch.full((self.num_nodes + 1,), -1, dtype=torch.int32, device=self.device)
        self._sentinel = torch.full((1,), self.num_nodes, dtype=topology.row.dtype, device=self.device)
        if blocks is not None:
            if topology.edge_type is None:
                raise ValueError("a topology with edge-type blocks needs each edge's type (Topology.edge_type)")
            self._node_offset = torch.tensor(blocks.node_offset, dtype=torch.long, device=self.device)
            # [hops, K] (.view: with no hops, torch.tensor([]) would be 1-D)
            self._fanout_table = torch.tensor(self.fanouts, dtype=torch.long, device=self.device).view(
                self.num_hops, blocks.num_edge_types)
        # TorchScript for plain tensors, Python for unified ones (their reads dispatch through Python)
        self._kernel_run: _sample_cuda.KernelSampler | None = None
        self._use_kernels = False
        self._topology_checked = False  # (see check_topology; the kernels check the entries they read)
        self.script = script
        if kernels is None:
            kernels = settings.sampler == "kernels"
            reason = _sample_cuda.unsupported(topology, self.device, blocks) if kernels else None
            if reason is not None:
                kernels = False
                # (on the CPU the torch path is the only one; the default setting is a preference, not a request)
                if self.device.type == "cuda":
                    _note_once(f"PYTORCH_DIRECT_SAMPLER=kernels: {reason}; this sampler uses the torch path",
                               loud=settings.source("sampler") != "default")
        self.kernels = kernels

    def sample(self, seeds: Tensor, *, check: bool = True) -> SampledSubgraph:
        """The sampled subgraph around ``seeds`` (global node ids, 1-D; for a heterogeneous graph, global ids of one
        node type). ``check=False`` skips the range check (one host round trip): for seeds already checked, as the
        loader does once per loader.

        A repeated seed is sampled as PyG's samplers (pyg-lib, torch-sparse) sample it: each occurrence is a seed of
        its own, in ``n_id[:batch_size]`` at its place, and draws its own in-edges; an edge whose source is a
        repeated seed points at its first occurrence."""
        if not isinstance(seeds, Tensor) or seeds.dtype.is_floating_point or seeds.dtype.is_complex \
                or seeds.dtype == torch.bool:
            got = seeds.dtype if isinstance(seeds, Tensor) else type(seeds).__name__
            raise TypeError(f"seeds must be a tensor of integer node ids, got {got} (converting would truncate "
                            f"floats and read a mask as ids 0 and 1: for a boolean mask pass mask.nonzero().flatten())")
        seeds = seeds.to(self.device, torch.long)
        if seeds.dim() != 1 or seeds.numel() == 0:
            raise ValueError(f"seeds must be a non-empty 1-D tensor of node ids, got shape {tuple(seeds.shape)}")
        if check:
            check_seeds(seeds, self.num_nodes)
        if self.num_hops == 0:
            return self._seeds_alone(seeds)
        if self.blocks is None:
            return self._sample_homogeneous(seeds)
        return self._sample_typed(seeds)

    @property
    def script(self) -> bool:
        """Whether the torch path runs a batch as one TorchScript function without the GIL (see the class
        docstring); False where the topology is unified or TorchScript is not available."""
        fn = _sample_script.sample_homogeneous if self.blocks is None else _sample_script.sample_typed
        return self._torch_run is not fn

    @script.setter
    def script(self, value: bool) -> None:
        """``False``: the same operations called from Python, holding the GIL for each (for comparison)."""
        fn = _sample_script.sample_homogeneous if self.blocks is None else _sample_script.sample_typed
        plain = not any(is_unified(t) for t in self.topology.tensors().values())
        compiled = _sample_script.scripted(fn) if value and plain else None
        self._torch_run = compiled or fn
        self._run = self._kernel_run if self._use_kernels else self._torch_run

    @property
    def kernels(self) -> bool:
        """Whether batches are sampled by the package's CUDA kernels (see the class docstring)."""
        return self._use_kernels

    @kernels.setter
    def kernels(self, value: bool) -> None:
        """``True``: the CUDA kernels (raises ``ValueError`` saying why where they cannot sample this graph);
        ``False``: the torch path (which checks the whole topology first, once: :func:`check_topology`)."""
        if not value and not self._topology_checked:
            check_topology(self.topology)
            self._topology_checked = True
        if value:
            reason = _sample_cuda.unsupported(self.topology, self.device, self.blocks)
            if reason is not None:
                raise ValueError(f"the sampler's CUDA kernels cannot be used: {reason} (pass kernels=False, or "
                                 f"set PYTORCH_DIRECT_SAMPLER=torch)")
            if self._kernel_run is None:
                table = self._fanout_table if self.blocks is not None else None
                self._kernel_run = _sample_cuda.KernelSampler(self.topology, self.device, table)
        self._use_kernels = bool(value)
        self._run = self._kernel_run if self._use_kernels else self._torch_run

    def _seeds_alone(self, seeds: Tensor) -> SampledSubgraph:
        """The batch of no hops (``num_neighbors=[]``): the seeds as given, no edges. Made here for every path (the
        torch path's and the kernels' hop loops assume at least one hop)."""
        topo = self.topology
        no_edges = torch.empty(0, dtype=torch.long, device=self.device)
        edge_type = None if topo.edge_type is None else no_edges
        if self.blocks is not None:
            node_type = torch.searchsorted(self._node_offset, seeds, right=True) - 1
        else:
            node_type = None if topo.node_type is None else topo.node_type[seeds].long()
        # (n_id a copy, as the other paths make it: not the caller's seeds tensor)
        return SampledSubgraph(seeds.clone(), no_edges.view(2, 0), no_edges, seeds.numel(), edge_type, node_type,
                               [seeds.numel()], [], no_edges)

    def _sample_homogeneous(self, seeds: Tensor) -> SampledSubgraph:
        topo = self.topology
        try:
            run = self._run if self._use_kernels else functools.partial(_sample_script.run, self._run)
            n_id, edge_index, e_id, pos, edge_type, node_type, num_nodes, num_edges = run(
                topo.colptr, topo.row, self._local, seeds, self._sentinel,
                self._hop_fanouts, self.replace, self.generator, topo.edge_id, topo.edge_type,
                topo.node_type)
        except BaseException:
            self._local.fill_(-1)  # (which entries the batch set is not known here)
            raise
        return SampledSubgraph(n_id, edge_index, e_id, seeds.numel(), edge_type, node_type, num_nodes, num_edges,
                               pos)

    def _sample_typed(self, seeds: Tensor) -> SampledSubgraph:
        """With edge-type blocks (see ``_sample_script.sample_typed``)."""
        topo = self.topology
        try:
            run = self._run if self._use_kernels else functools.partial(_sample_script.run, self._run)
            n_id, edge_index, e_id, pos, edge_type, num_nodes, num_edges = run(
                topo.colptr, topo.row, topo.edge_type, self._local, seeds, self._sentinel,
                self._fanout_table, self.replace, self.generator, topo.edge_id)
        except BaseException:
            self._local.fill_(-1)  # (which entries the batch set is not known here)
            raise
        node_type = torch.searchsorted(self._node_offset, n_id, right=True) - 1
        return SampledSubgraph(n_id, edge_index, e_id, seeds.numel(), edge_type, node_type, num_nodes, num_edges,
                               pos)


def check_topology(topology: Topology) -> None:
    """Raises ``ValueError`` / ``IndexError`` unless ``topology`` is a CSC the torch path can sample: ``colptr``
    starts at 0, never decreases and ends at the number of edges, and every source in ``row`` is a node. That path
    indexes with these numbers unchecked: a source past the id map reads its scratch entry (edges to a node that
    does not exist, silently), and a decreasing ``colptr`` (a negative in-degree) corrupted the process's heap and
    aborted it. (The CUDA kernels check each entry they read.) A few reductions and host reads, once per sampler
    that takes the torch path, when it is made."""
    with torch._C.DisableTorchFunctionSubclass():  # (unified tensors: their reads as plain tensors')
        colptr, row, n = topology.colptr, topology.row, topology.num_nodes
        edges = row.numel()
        first, last = int(colptr[0]), int(colptr[-1])
        if first != 0 or last != edges:
            raise ValueError(f"topology.colptr must start at 0 and end at the number of edges ({edges}, the length "
                             f"of row); got colptr[0] = {first}, colptr[-1] = {last}")
        down = (colptr[1:] < colptr[:-1]).nonzero()
        if down.numel():
            s = int(down[0, 0])
            raise ValueError(f"topology.colptr decreases at destination {s} (colptr[{s}] = {int(colptr[s])} > "
                             f"colptr[{s + 1}] = {int(colptr[s + 1])}): it must be non-decreasing offsets, the "
                             f"in-edges of destination s being row[colptr[s]:colptr[s + 1]]")
        if edges:
            low, high = (int(v) for v in torch.aminmax(row))
            if low < 0 or high >= n:
                raise IndexError(f"topology.row holds source ids outside [0, {n}) (got [{low}, {high}]): every "
                                 f"source must be a node of the graph")


def check_seeds(seeds: Tensor, num_nodes: int, what: str = "seed") -> None:
    """Range of node ids (one host round trip); raises ``IndexError``. Repeated ids are allowed: as in PyG, each
    occurrence is a seed of its own (see :meth:`NeighborSampler.sample`)."""
    if seeds.numel() == 0:
        return
    low, high = torch.stack(torch.aminmax(seeds)).tolist()
    if low < 0 or high >= num_nodes:
        raise IndexError(f"{what} ids must lie in [0, {num_nodes}), got [{low}, {high}]")


def _fanout_table(num_neighbors, blocks: Blocks | None, replace: bool = False,
                  num_edges: int | None = None) -> list[list[int]]:
    """``[hops][edge types]`` fan-outs (one column without blocks), checked and normalised. As in PyG (pyg-lib), a
    fan-out of 0 draws no edge in its hop, and no hops (``[]``) makes a batch of the seeds alone; any negative
    fan-out takes every in-edge (pyg-lib: ``count < 0``) and becomes -1 here, the one value every path below (the
    torch path, the kernels' ``int`` fan-outs and fan-out table) is given for it. Fan-outs are integers, as
    pyg-lib's ``int[]`` takes them (a float was truncated: 2.5 drew 2). One past the kernels' C ``int``: without
    replacement, at least ``num_edges`` (every in-degree) it takes every in-edge, so it is -1 too; with
    replacement, it would draw 2^31 edges per node, refused."""
    if not isinstance(num_neighbors, (list, tuple)):
        raise ValueError(f"num_neighbors must list a fan-out per hop (e.g. [15, 10]; -1 for all, 0 for none; [] "
                         f"for the seeds alone), got {num_neighbors!r}")
    kinds = 1 if blocks is None else blocks.num_edge_types
    table = []
    for hop, entry in enumerate(num_neighbors):
        row = [entry] * kinds if not isinstance(entry, (list, tuple)) else list(entry)
        if len(row) != kinds:
            raise ValueError(f"num_neighbors[{hop}] has {len(row)} entries for {kinds} edge types")
        table.append([_fanout(k, hop, replace, num_edges) for k in row])
    return table


_INT_MAX = 2**31 - 1  # (the kernels' homogeneous fan-outs are C ints)


def _fanout(value, hop: int, replace: bool, num_edges: int | None) -> int:
    """One fan-out, checked and normalised (see :func:`_fanout_table`)."""
    try:
        if isinstance(value, bool):
            raise TypeError
        k = operator.index(value)
    except TypeError:
        raise TypeError(f"fan-outs are integers (-1 or any negative: every neighbour; 0: none), got {value!r} at "
                        f"hop {hop}") from None
    if k < 0:
        return -1
    if k > _INT_MAX:
        if not replace and num_edges is not None and k >= num_edges:
            return -1
        raise ValueError(f"fan-out {k} at hop {hop} is past what the sampler draws per node (at most {_INT_MAX}"
                         f"{' with replace=True' if replace else ''}; -1 takes every neighbour)")
    return k
