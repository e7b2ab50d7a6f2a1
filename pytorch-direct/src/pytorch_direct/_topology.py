"""What the loader takes apart: a PyG ``Data`` / ``HeteroData``, a PyG ``(FeatureStore, GraphStore)`` pair, or a
``(features, Topology)`` pair, into the sampler's CSC :class:`~pytorch_direct._sample.Topology` and the tables the
batch's attributes are gathered from. torch_geometric is imported only here and only when one of its types is given.
"""

from __future__ import annotations

import logging
import mmap
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ._create import is_unified, unified
from ._sample import Blocks, SampledSubgraph, Topology

log = logging.getLogger("pytorch_direct")


@dataclass
class Source:
    """The graph behind a loader. ``node_tables[(node type, name)]`` and ``edge_tables[(edge type, name)]`` are the
    per-node / per-edge attributes gathered at each batch's ``n_id`` / ``e_id`` (node type and edge type are
    ``None`` for a homogeneous graph); ``template`` is the user's ``Data`` / ``HeteroData`` whose other attributes
    batches carry as they are; ``feature_store`` the user's store for a ``(FeatureStore, GraphStore)`` pair."""

    topology: Topology
    blocks: Blocks | None
    node_types: list
    edge_types: list
    num_nodes: dict  # node type -> count
    node_tables: dict = field(default_factory=dict)
    edge_tables: dict = field(default_factory=dict)
    template: object | None = None
    feature_store: object | None = None

    @property
    def hetero(self) -> bool:
        return self.blocks is not None

    def node_offset(self, node_type) -> int:
        return self.blocks.node_offset[self.node_types.index(node_type)] if self.hetero else 0


# glibc serves an allocation of at least this size with a mapping of its own (its largest dynamic mmap threshold on
# 64-bit machines); a smaller one may share its first and last memory page with unrelated heap allocations.
OWN_PAGES_BYTES = 32 << 20


def owns_its_pages(t: Tensor) -> bool:
    """Whether registering ``t``'s memory with CUDA pins no page that another allocation uses: a large tensor (a
    mapping of its own), one whose memory starts and ends on page boundaries, or memory already page-locked."""
    nbytes = t.numel() * t.element_size()
    start = t.data_ptr()
    return (nbytes >= OWN_PAGES_BYTES or (start % mmap.PAGESIZE == 0 and (start + nbytes) % mmap.PAGESIZE == 0)
            or t.is_pinned())


def unify_table(t: Tensor, name: str, memory: str = "auto") -> Tensor:
    """A CPU table as a unified tensor the GPU reads zero-copy: registered in place when it owns its pages, else
    copied into memory of its own, of kind ``memory`` (see :func:`pytorch_direct.empty`). Registration pins whole
    pages: a CUDA copy of another tensor that starts in a page pinned with a small table and ends outside fails
    ("invalid argument"), depending on where the allocator put the two, so a small table (cheap to copy) that
    shares its pages is copied."""
    if is_unified(t):
        return t
    if t.is_contiguous() and owns_its_pages(t):
        # (detached, as the copy below: the loader reads feature tables, and its batches' rows carry no autograd)
        return unified(t.detach())
    log.info("pytorch-direct: %s (%d bytes) shares memory pages with other allocations (or is not contiguous): "
             "copied into memory of its own instead of registered in place", name, t.numel() * t.element_size())
    return unified(t.detach(), copy=True, memory=memory)


def csc_from_coo(edge_index: Tensor, num_dst: int, is_sorted: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
    """(colptr [num_dst + 1], row [E], perm [E] or None): the in-edges of each destination together; ``perm`` gives
    each CSC position's index in ``edge_index`` (None when already sorted by destination)."""
    if edge_index.dim() != 2 or edge_index.size(0) != 2:
        raise ValueError(f"edge_index must have shape [2, edges], got {tuple(edge_index.shape)}")
    src, dst = edge_index[0], edge_index[1]
    perm = None
    if not is_sorted:
        dst, perm = torch.sort(dst, stable=True)
        src = src[perm]
    # (sources too: the sampler would give a source past the last node the id of its id map's scratch entry)
    for ids, what in ((dst, "destinations"), (src, "sources")):
        if ids.numel():
            low, high = (int(v) for v in torch.aminmax(ids))
            if low < 0 or high >= num_dst:
                raise IndexError(f"edge_index has {what} outside [0, {num_dst}) (got [{low}, {high}]): every edge "
                                 f"must join two nodes of the graph (set num_nodes to count them all)")
    colptr = torch.zeros(num_dst + 1, dtype=torch.long, device=dst.device)
    colptr[1:] = torch.cumsum(torch.bincount(dst, minlength=num_dst), 0)
    if is_sorted and dst.numel() > 1 and bool((dst[1:] < dst[:-1]).any()):
        raise ValueError("is_sorted=True but edge_index is not sorted by destination (its second row)")
    return colptr, src, perm


def _small_ids(t: Tensor, bound: int) -> Tensor:
    """int32 where the ids fit (half the memory to read per sampled edge), else int64."""
    return t.to(torch.int32) if bound < 2**31 else t.to(torch.long)


def _attribute_table(value, name: str) -> Tensor:
    """A node or edge attribute (one row per node / edge, as PyG's ``is_node_attr`` / ``is_edge_attr`` say) as the
    table a batch's rows are gathered from. As PyG's loaders: a numpy array is gathered too (its rows arrive as a
    tensor); a list or tuple cannot be (PyG raises too): say so rather than hand every batch the whole list."""
    if isinstance(value, Tensor):
        return value
    import numpy as np  # (here only: torch_geometric, whose Data this is, needs numpy; this package does not)

    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    raise TypeError(f"attribute {name!r} is a {type(value).__name__} with one entry per node or edge: "
                    f"NeighborLoader gathers tensors and numpy arrays only; make it a tensor, or remove it")


def from_data(data, is_sorted: bool = False) -> Source:
    """A homogeneous PyG ``Data``: CSC from ``edge_index``; node and edge attributes become tables."""
    n = int(data.num_nodes)
    if data.edge_index is None:
        raise ValueError("the Data object has no edge_index to sample from")
    colptr, row, perm = csc_from_coo(data.edge_index.cpu(), n, is_sorted)
    topology = Topology(colptr, _small_ids(row, n), edge_id=perm, num_nodes=n)
    source = Source(topology, None, [None], [None], {None: n}, template=data)
    for key, value in data.items():
        if key == "edge_index":
            continue
        if data.is_node_attr(key):
            source.node_tables[(None, key)] = _attribute_table(value, key)
        elif data.is_edge_attr(key):
            source.edge_tables[(None, key)] = _attribute_table(value, key)
    return source


def from_hetero_data(data, is_sorted: bool = False) -> Source:
    """A PyG ``HeteroData``: one CSC with a block of destination slots per edge type (see ``Blocks``)."""
    node_types, edge_types = data.metadata()
    if not edge_types:
        raise ValueError("the HeteroData object has no edge types to sample from")
    num_nodes = {}
    for t in node_types:
        n = data[t].num_nodes
        if n is None:  # (a node type with no attributes: nothing to count its nodes from)
            raise ValueError(f"node type {t!r} has no node count: set data[{t!r}].num_nodes (it has no attributes "
                             f"to infer it from)")
        num_nodes[t] = int(n)
    coo = {et: data[et].edge_index for et in edge_types}
    source = _hetero_source(node_types, edge_types, num_nodes, coo, is_sorted)
    source.template = data
    for t in node_types:
        for key, value in data[t].items():
            if data[t].is_node_attr(key):
                source.node_tables[(t, key)] = _attribute_table(value, f"{t}.{key}")
    for et in edge_types:
        for key, value in data[et].items():
            if key != "edge_index" and data[et].is_edge_attr(key):
                source.edge_tables[(et, key)] = _attribute_table(value, f"{et}.{key}")
    return source


def _hetero_source(node_types, edge_types, num_nodes, coo, is_sorted, edge_ids=None) -> Source:
    """One CSC over every node (global ids: node types one after the other), each node's in-edges grouped by edge
    type (in the order of ``edge_types``; within a type, in the order given), each edge's type index in
    ``Topology.edge_type`` and its id within its type in ``edge_id`` (``is_sorted`` is not needed: one sort orders
    every type)."""
    for et in edge_types:
        if et[0] not in num_nodes or et[2] not in num_nodes:
            raise ValueError(f"edge type {et} joins node types not in the graph ({sorted(num_nodes)})")
    node_offset = [0]
    for t in node_types:
        node_offset.append(node_offset[-1] + num_nodes[t])
    total = node_offset[-1]
    kinds = len(edge_types)
    srcs, dsts, ids, types = [], [], [], []
    for k, et in enumerate(edge_types):
        edge_index = coo[et].cpu()
        if edge_index.dim() != 2 or edge_index.size(0) != 2:
            raise ValueError(f"edge type {et}: edge_index must have shape [2, edges], got {tuple(edge_index.shape)}")
        row, col = edge_index[0].long(), edge_index[1].long()
        for ids_, n, what in ((row, num_nodes[et[0]], "sources"), (col, num_nodes[et[2]], "destinations")):
            if ids_.numel() and (int(ids_.min()) < 0 or int(ids_.max()) >= n):
                raise IndexError(f"edge type {et} has {what} outside [0, {n})")
        own = torch.arange(row.numel())
        if edge_ids is not None and edge_ids.get(et) is not None:
            own = edge_ids[et].cpu().long()
        srcs.append(row + node_offset[node_types.index(et[0])])
        dsts.append(col + node_offset[node_types.index(et[2])])
        ids.append(own)
        types.append(torch.full((row.numel(),), k, dtype=torch.long))
    dst, kind = torch.cat(dsts), torch.cat(types)
    order = torch.sort(dst * kinds + kind, stable=True).indices  # by destination, then edge type, then as given
    colptr = torch.zeros(total + 1, dtype=torch.long)
    colptr[1:] = torch.cumsum(torch.bincount(dst, minlength=total), 0)
    topology = Topology(colptr, _small_ids(torch.cat(srcs)[order], total), edge_type=_small_ids(kind[order], kinds),
                        edge_id=torch.cat(ids)[order], num_nodes=total)
    blocks = Blocks(tuple(node_offset), tuple(node_types.index(et[0]) for et in edge_types),
                    tuple(node_types.index(et[2]) for et in edge_types))
    return Source(topology, blocks, list(node_types), list(edge_types), dict(num_nodes))


def from_stores(feature_store, graph_store) -> Source:
    """A PyG ``(FeatureStore, GraphStore)`` pair: the topology through ``graph_store.csc()`` (PyG's own conversion),
    edge ids through ``get_edge_id`` where the store has them (``LocalGraphStore``), features fetched per batch from
    the feature store (``multi_get_tensor``: a :class:`~pytorch_direct.pyg.UnifiedFeatureStore` gathers them on its
    device)."""
    from torch_geometric.data import remote_backend_utils

    attrs = graph_store.get_all_edge_attrs()
    if not attrs:
        raise ValueError("the graph store holds no edge index: put one first (graph_store.put_edge_index(...))")
    hetero = any(a.edge_type is not None for a in attrs)
    if hasattr(graph_store, "meta") and isinstance(graph_store.meta, dict):
        hetero = graph_store.meta.get("is_hetero", hetero)
    get_ids = getattr(graph_store, "get_edge_id", None)
    if not hetero:
        attr = attrs[0]
        if attr.size is None:
            raise ValueError("the graph store's edge index has no size: put it with size=(num_nodes, num_nodes)")
        n = max(attr.size)
        row, colptr, perm = graph_store.csc()
        colptr, row = colptr.cpu().long(), row.cpu()
        if colptr.numel() < n + 1:  # fewer destinations than nodes: pad (no in-edges)
            colptr = torch.cat([colptr, colptr[-1:].expand(n + 1 - colptr.numel())])
        ids = get_ids(edge_type=None, layout="coo") if get_ids is not None else None
        edge_id = perm
        if ids is not None:
            edge_id = ids.cpu() if perm is None else ids.cpu()[perm]
        topology = Topology(colptr, _small_ids(row, n), edge_id=edge_id, num_nodes=n)
        return Source(topology, None, [None], [None], {None: n}, feature_store=feature_store)
    edge_types = sorted({a.edge_type for a in attrs})
    node_types = sorted({t for et in edge_types for t in (et[0], et[2])} |
                        {a.group_name for a in feature_store.get_all_tensor_attrs() if isinstance(a.group_name, str)})
    num_nodes = {}
    for a in attrs:
        if a.size is not None:
            num_nodes.setdefault(a.edge_type[0], a.size[0])
            num_nodes.setdefault(a.edge_type[2], a.size[1])
    for t in node_types:
        if t not in num_nodes:
            num_nodes[t] = int(remote_backend_utils.num_nodes(feature_store, graph_store, t))
    coo, edge_ids = {}, {}
    rows, cols, _ = graph_store.coo(edge_types)
    for et in edge_types:
        coo[et] = torch.stack([rows[et].cpu().long(), cols[et].cpu().long()])
        edge_ids[et] = get_ids(edge_type=et, layout="coo") if get_ids is not None else None
    source = _hetero_source(node_types, edge_types, num_nodes, coo, False, edge_ids)
    source.feature_store = feature_store
    return source


def from_topology(features, topology: Topology) -> Source:
    """A ``(features, Topology)`` pair: ``features`` maps attribute names to per-node tables (global node id ->
    row); the topology's ``edge_type`` and ``node_type`` reach batches as ``edge_type`` / ``node_type``."""
    if not isinstance(topology, Topology):
        raise TypeError(f"expected (features, pytorch_direct.sampling.Topology), got a {type(topology).__name__}")
    features = dict(features or {})
    n = int(topology.num_nodes)
    source = Source(topology, None, [None], [None], {None: n})
    for key, value in features.items():
        if not isinstance(value, Tensor) or value.dim() == 0 or value.size(0) != n:
            raise ValueError(f"features[{key!r}] must be a tensor with one row per node ({n}), got "
                             f"{tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__}")
        source.node_tables[(None, key)] = value
    return source


def describe(data) -> str:
    return type(data).__name__ if not isinstance(data, tuple) else \
        "(" + ", ".join(type(d).__name__ for d in data) + ")"


def fanouts(src: Source, num_neighbors) -> list:
    """Fan-outs per hop as the sampler takes them (per edge type for a heterogeneous graph; the sampler checks the
    values). Takes what PyG's loaders take: a list, a dict keyed by edge type (a tuple or its ``"src__rel__dst"``
    name), or PyG's ``NumNeighbors`` (its values for this graph's edge types, its default included)."""
    if not isinstance(num_neighbors, (list, tuple, dict)) and callable(getattr(num_neighbors, "get_values", None)):
        num_neighbors = num_neighbors.get_values(src.edge_types if src.hetero else None)  # (PyG's NumNeighbors)
    if src.hetero and isinstance(num_neighbors, dict):
        by_name = {"__".join(et): et for et in src.edge_types}
        num_neighbors = {by_name.get(k, k) if isinstance(k, str) else k: v for k, v in num_neighbors.items()}
    if not src.hetero:
        if isinstance(num_neighbors, dict):
            raise ValueError("num_neighbors as a dict is for heterogeneous graphs; pass a list per hop")
        return list(num_neighbors)
    if isinstance(num_neighbors, dict):
        unknown = set(num_neighbors) - set(src.edge_types)
        if unknown:
            raise ValueError(f"num_neighbors names edge types not in the graph: {sorted(unknown)}")
        missing = [et for et in src.edge_types if et not in num_neighbors]
        if missing:
            raise ValueError(f"num_neighbors has no fan-outs for edge types {missing}: give every edge type "
                             f"a list (0 to sample none)")
        hops = {len(v) for v in num_neighbors.values()}
        if len(hops) != 1:
            raise ValueError("every edge type needs the same number of hops in num_neighbors")
        (h,) = hops
        return [[num_neighbors[et][i] for et in src.edge_types] for i in range(h)]
    return [[k] * len(src.edge_types) for k in num_neighbors]


@dataclass
class HeteroParts:
    """A heterogeneous sample split per type: per node type its ids (local to the type, the seeds first) and
    per-hop counts, per edge type its ``edge_index`` (local ids of its source and destination types), ``e_id``
    and per-hop counts."""

    n_id: list
    edge_index: list
    e_id: list
    num_sampled_nodes: list
    num_sampled_edges: list


def _counts(index: Tensor, size: int) -> Tensor:
    """How often each value in [0, size) occurs in ``index``, without a host round trip (``bincount`` on a GPU reads
    the largest value on the host to size its output)."""
    return torch.zeros(size, dtype=torch.long, device=index.device).index_add_(
        0, index, torch.ones_like(index, dtype=torch.long))


def split_hetero(sub: SampledSubgraph, blocks) -> HeteroParts:
    """Per-type ids and edges of a sample of the one-graph form: a fixed number of operations whatever the number
    of types (the per-type parts are views) and one host round trip for all the counts."""
    dev = sub.n_id.device
    num_t, num_k, hops = blocks.num_node_types, blocks.num_edge_types, len(sub.num_sampled_edges)
    ntype, etype = sub.node_type, sub.edge_type
    node_offset = torch.tensor(blocks.node_offset[:-1], dtype=torch.long, device=dev)
    # the rank of each batch node among the batch's nodes of its type (batch order)
    order = torch.sort(ntype, stable=True).indices
    type_count = _counts(ntype, num_t)
    type_start = torch.cumsum(type_count, 0) - type_count
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=dev) - type_start[ntype[order]]
    edge_order = torch.sort(etype, stable=True).indices
    edge_count = _counts(etype, num_k)
    hop_of_node = torch.repeat_interleave(torch.arange(hops + 1, device=dev),
                                          torch.tensor(sub.num_sampled_nodes, device=dev),
                                          output_size=sub.num_nodes)
    # (dtype given: with no hops the counts are [], which torch.tensor would make a float tensor)
    hop_of_edge = torch.repeat_interleave(torch.arange(hops, device=dev),
                                          torch.tensor(sub.num_sampled_edges, dtype=torch.long, device=dev),
                                          output_size=sub.num_edges)
    per_hop_nodes = _counts(hop_of_node * num_t + ntype, (hops + 1) * num_t)
    per_hop_edges = _counts(hop_of_edge * num_k + etype, max(hops, 1) * num_k)
    counts = torch.cat([type_count, edge_count, per_hop_nodes, per_hop_edges]).tolist()  # one host round trip
    type_counts, edge_counts = counts[:num_t], counts[num_t:num_t + num_k]
    nodes_hop = counts[num_t + num_k:num_t + num_k + (hops + 1) * num_t]
    edges_hop = counts[num_t + num_k + (hops + 1) * num_t:]
    local = sub.n_id - node_offset[ntype]
    n_id = list(local[order].split(type_counts))
    # each edge type's [2, E_k] edge_index, contiguous, a view of one buffer: its rows then its columns
    row, col = rank[sub.edge_index[:, edge_order]]
    kind = etype[edge_order]
    first = torch.cumsum(edge_count, 0) - edge_count  # each type's first edge in type order
    at = torch.arange(kind.numel(), device=dev) + first[kind]  # 2 * first + j: the row's place, then the column's
    flat = torch.empty(2 * kind.numel(), dtype=row.dtype, device=dev)
    flat[at] = row
    flat[at + edge_count[kind]] = col
    edge_index = [block.view(2, -1) for block in flat.split([2 * c for c in edge_counts])]
    e_id = sub.e_id[edge_order]
    return HeteroParts(
        n_id, edge_index, list(e_id.split(edge_counts)),
        [[nodes_hop[h * num_t + t] for h in range(hops + 1)] for t in range(num_t)],
        [[edges_hop[h * num_k + k] for h in range(hops)] for k in range(num_k)])


def source_of(data, is_sorted: bool = False) -> Source:
    """The :class:`Source` behind any ``data`` the loader takes."""
    try:
        from torch_geometric.data import Data, FeatureStore, GraphStore, HeteroData
    except ImportError as e:
        raise ImportError("NeighborLoader makes torch_geometric Data / HeteroData batches: pip install "
                          "torch_geometric (NeighborSampler alone works without it)") from e
    if isinstance(data, tuple) and len(data) == 2 and isinstance(data[1], Topology):
        return from_topology(data[0], data[1])
    if isinstance(data, HeteroData):
        return from_hetero_data(data, is_sorted)
    if isinstance(data, Data):
        return from_data(data, is_sorted)
    if isinstance(data, (tuple, list)) and len(data) == 2 and isinstance(data[0], FeatureStore) \
            and isinstance(data[1], GraphStore):
        return from_stores(*data)
    raise TypeError(f"NeighborLoader takes a Data, a HeteroData, a (FeatureStore, GraphStore) pair or a (features, "
                    f"Topology) pair; got {describe(data)}")
