"""Graphs with relation (and node) types, their validation and their cached preprocessing.

Everything derived from the structure (relation-sorted orders, CSR/CSC, unique (source, relation) pairs and the
edge -> pair inverse index, degree normalisers) is computed on first use and cached on the :class:`Graph`.
:func:`graph_for` keeps recently seen ``(edge_index, edge_type)`` tensors mapped to their Graph, while the tensors
live, so that a layer called repeatedly on the same tensors (full-graph training) preprocesses once, while each new
mini-batch subgraph (e.g. PyG ``NeighborLoader`` output) gets its own Graph, freed with its tensors.
"""

from __future__ import annotations

import contextlib
import math
import operator
import sys
import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

import torch

from ..errors import GraphInputError
from ..ir.core import GATHER_VIA, INDEX_KINDS, Domain
from . import prep
from .prep import sort_keys, unique_pairs  # noqa: F401 - unique_pairs: part of this module's interface

_VERSION = operator.attrgetter("_version")
_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)


def _normal_tensors() -> contextlib.AbstractContextManager:
    """Where a graph's data is made: outside inference mode even when the call that made it ran inside. A graph
    outlives the call (cached per tensor pair, or held by the caller), and a tensor made under
    ``torch.inference_mode`` can never be saved for backward: a training step on a graph first seen in an
    inference-mode evaluation (Lightning's validation sanity check) would fail on its degree normaliser."""
    if torch.is_inference_mode_enabled():
        return torch.inference_mode(False)
    return contextlib.nullcontext()


def _check_int_tensor(name: str, t: Any, ndim: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise GraphInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        # PyG's layers also take a sparse adjacency adj_t [destination, source] whose values are the edge types
        form = ("[2, num_edges] (row 0 source, row 1 destination), with edge_type in the same order; from a "
                "sparse adj_t [destination, source] holding edge types: edge_index = adj_t.coalesce().indices()"
                ".flip(0), edge_type = adj_t.coalesce().values()" if name.startswith("edge_index") else
                "a dense tensor (.to_dense())")
        raise GraphInputError(f"{name} is a sparse tensor ({t.layout}); hector takes {name} as {form}")
    if t.dtype not in _INT_DTYPES:
        raise GraphInputError(f"{name} must hold integer ids (torch.long), got dtype {t.dtype}; "
                              f"convert with {name}.long()")
    if t.dim() != ndim:
        raise GraphInputError(f"{name} must have {ndim} dimension(s), got shape {tuple(t.shape)}")
    return t.long()


def _check_bounds(checks: list[tuple[str, torch.Tensor, int, str]], bounds: list[int]) -> None:
    """(name, ids, upper, what): every id in [0, upper), from the (smallest, largest) id of each tensor in the
    first entries of ``bounds`` (those of :func:`~hector.runtime.prep.check_and_pair`, read on the host in one
    transfer)."""
    for (name, _, upper, what), lo, hi in zip(checks, bounds[0::2], bounds[1::2], strict=False):
        if lo < 0 or hi >= upper:
            bad = lo if lo < 0 else hi
            raise GraphInputError(f"{name} holds {what} id {bad}, outside [0, {upper}); "
                                  f"check {what} ids against the declared count ({upper})")


def _check_ranges_on_device(checks: list[tuple[str, torch.Tensor, int, str]]) -> None:
    """The same check as :func:`_check_ranges` without reading the device: a device-side assertion per tensor,
    queued on the current stream. A bad id then stops the program at the next synchronisation with a CUDA
    device-side assertion (which ends the CUDA context) instead of a clear error now."""
    for name, t, upper, what in checks:
        if not t.numel():
            continue
        lo, hi = torch.aminmax(t)
        torch._assert_async((lo >= 0) & (hi < upper),
                            f"hector: {name} holds a {what} id outside [0, {upper}); check {what} ids against the "
                            f"declared count, or call hector.prepare_graph for an error that names the id")


# Unique (source, relation) pairs per edge, by graph size class, from the graphs whose pair count is known: the
# estimate a graph gets before its own count has come back from the device (see Graph.size_stats).
_PAIR_RATIOS: dict[tuple[int, ...], float] = {}
# Graphs whose pair count is on its way to the host: looked at (without waiting) whenever a graph needs an
# estimate, so that a loop giving each graph one call (a mini-batch loop) still learns its size classes' ratios.
_PENDING: deque[weakref.ref] = deque(maxlen=64)


def _harvest_pending() -> None:
    for _ in range(len(_PENDING)):
        try:
            g = _PENDING.popleft()()
        except IndexError:  # emptied by another thread (a loader preparing graphs)
            return
        if g is not None and g.known_unique_count() is None and "unique_count_pending" in g._cache:
            _PENDING.append(weakref.ref(g))  # not arrived yet


def _ratio_class(num_nodes: int, num_edges: int, num_relations: int, num_node_types: int) -> tuple[int, ...]:
    return (round(2 * math.log2(max(num_nodes, 1))), round(2 * math.log2(max(num_edges, 1))), num_relations,
            num_node_types)


class Graph:
    """A directed multigraph with relation-typed edges and (optionally) typed nodes.

    Args:
        edge_index: [2, E] integer tensor, row 0 = source, row 1 = destination (PyG convention).
        edge_type: [E] integer relation ids in [0, num_relations).
        num_nodes: number of nodes N (> 0); node ids must lie in [0, N).
        num_relations: R.
        node_type: optional [N] node-type ids in [0, num_node_types).
        sync_free: build without waiting for the device. The id ranges are then checked by device-side
            assertions (a bad id ends the CUDA context at the next synchronisation), and the count of unique
            (source, relation) pairs, which sizes
            the compacted rows, is not read: the CUDA backend sizes those rows by the edge count and stops its
            kernels at the count on the device, and the cost model estimates the count from graphs of the same
            size class until this graph's own count has arrived (copied to the host without waiting). False
            (default): the ids are checked on the host now (a clear :class:`~hector.errors.GraphInputError`
            naming the bad id), the unique pairs computed on the device and their count read in the same
            transfer: one wait for the GPU per graph. Layers given new tensors use False: on an H100 the padded
            rows cost more GPU time than the waits save (a new ``edge_index`` per call, when a checked graph
            still waited twice: 7 of 9 graph/model cells slower with True, e.g. am RGCN 18.1 ms against 16.7 ms),
            and a small graph's step stays bound by its launches either way.
        sorted_by_destination: whether the edges are already in destination order (CSC order, as neighbour
            samplers emit them); the CUDA backend then skips its sort by destination. None (default): found out
            with the id check's read on the host (no wait of its own; unknown, so sorted again, on a
            ``sync_free`` graph, on the CPU too, so that its layout is the one a GPU builds). True: a promise,
            checked like the ids (an error now, or a device-side assertion on a ``sync_free`` graph). False: not
            looked at. The answer is kept as ``dst_sorted``.
    """

    def __init__(self, edge_index: torch.Tensor, edge_type: torch.Tensor, num_nodes: int, num_relations: int,
                 node_type: torch.Tensor | None = None, num_node_types: int | None = None, *,
                 sync_free: bool = False, sorted_by_destination: bool | None = None):
        with _normal_tensors():
            self._build(edge_index, edge_type, num_nodes, num_relations, node_type, num_node_types, sync_free,
                        sorted_by_destination)

    def _build(self, edge_index: torch.Tensor, edge_type: torch.Tensor, num_nodes: int, num_relations: int,
               node_type: torch.Tensor | None, num_node_types: int | None, sync_free: bool,
               sorted_by_destination: bool | None) -> None:
        edge_index = _check_int_tensor("edge_index", edge_index, 2)
        if edge_index.size(0) != 2:
            raise GraphInputError(f"edge_index must have shape [2, num_edges], got {tuple(edge_index.shape)}"
                                  + ("; transpose it with edge_index.t()" if edge_index.size(-1) == 2 else ""))
        edge_type = _check_int_tensor("edge_type", edge_type, 1)
        if edge_type.numel() != edge_index.size(1):
            raise GraphInputError(f"edge_type has {edge_type.numel()} entries but edge_index has "
                                  f"{edge_index.size(1)} edges; give one relation id per edge")
        if int(num_nodes) <= 0:
            raise GraphInputError(f"the graph is empty (num_nodes={num_nodes}); a layer needs at least one node")
        if int(num_relations) <= 0:
            raise GraphInputError(f"num_relations must be positive, got {num_relations}")
        if edge_type.device != edge_index.device:
            raise GraphInputError(f"edge_type is on {edge_type.device} but edge_index on {edge_index.device}")
        self.num_nodes = int(num_nodes)
        self.num_relations = int(num_relations)
        checks = [("edge_index", edge_index, self.num_nodes, "node"),
                  ("edge_type", edge_type, self.num_relations, "relation")]
        if node_type is None:
            if num_node_types is not None and int(num_node_types) > 1:
                raise GraphInputError(f"num_node_types={num_node_types} but node_type is None: give node_type, one "
                                      "node-type id per node (a [num_nodes] integer tensor)")
            self.num_node_types = 1
        else:
            node_type = _check_int_tensor("node_type", node_type, 1)
            if node_type.numel() != self.num_nodes:
                raise GraphInputError(f"node_type has {node_type.numel()} entries for {self.num_nodes} nodes")
            if num_node_types is None:
                num_node_types = int(node_type.max()) + 1
            self.num_node_types = int(num_node_types)
            node_type = node_type.to(edge_index.device)
            checks.append(("node_type", node_type, self.num_node_types, "node type"))
        self.sync_free = bool(sync_free)
        # edges in (destination, relation) order: set on the CUDA backend's layout where it sorted them so
        self.dst_etype_sorted = False
        dst = edge_index[1]
        if self.sync_free and edge_index.is_cuda:
            _check_ranges_on_device(checks)
            if sorted_by_destination and dst.numel() > 1:
                torch._assert_async((dst[1:] >= dst[:-1]).all(),
                                    "hector: sorted_by_destination=True but edge_index's destinations (row 1) are "
                                    "not in non-decreasing order; sort the edges or leave the hint out")
            self.dst_sorted = bool(sorted_by_destination)
            pairs = None
        else:
            # the unique (source, relation) pairs, which size the compacted rows, computed on the device now so
            # that their count comes to the host in the same read as the ids' ranges and the order (unless the
            # caller said it is unsorted): one wait per graph (a sync-free graph on the CPU, where reading costs no
            # wait, checks its ids the same way but keeps the pairs to its backend, as on a GPU). All of it one
            # TorchScript call: the loader thread that prepares a mini-batch holds the GIL for none of it
            # a sync-free graph learns the order only from a promise, as on a GPU (where finding it out would
            # read the device): the CUDA backend's layout of it then is the same on either device
            order = bool(sorted_by_destination) if self.sync_free else sorted_by_destination is not False
            want_pairs = not self.sync_free
            bounds, psrc, petype, pinverse = prep.run(prep.check_and_pair, edge_index, edge_type, node_type,
                                                      self.num_nodes, self.num_relations, order, want_pairs)
            bounds = bounds.tolist()
            checked = [c for c in checks if c[1].numel()]
            _check_bounds(checked, bounds)
            steps = bounds[2 * len(checked):]
            self.dst_sorted = order and (dst.numel() <= 1 or steps[0] >= 0)
            if sorted_by_destination and not self.dst_sorted:
                raise GraphInputError("sorted_by_destination=True but edge_index's destinations (row 1) are not in "
                                      "non-decreasing order; sort the edges by destination or leave the hint out")
            count = int(steps[-1]) if want_pairs else None
            pairs = (psrc, petype, pinverse) if want_pairs else None
        # detached: the same memory without a reference to the caller's tensor objects (a view keeps its base's
        # Python object alive), so that graph_for's cache sees the caller drop them and lets this graph go
        self.src = edge_index[0].contiguous().detach()
        self.dst = edge_index[1].contiguous().detach()
        self.etype = edge_type.contiguous().detach()
        self._ntype = None if node_type is None else node_type.contiguous().detach()
        # made with node types (`ntype` fills in zeros on first use where not: a layer typed by several node types
        # must not take such a graph for one of them)
        self.has_node_type = node_type is not None
        self.device = edge_index.device
        self._cache: dict[Any, Any] = {}
        if pairs is not None:
            self._cache["unique"] = (pairs[0][:count], pairs[1][:count], pairs[2])
            self._record_unique_count(count)
        self._built_versions = self._ids_versions()

    @classmethod
    def _derived(cls, src: torch.Tensor, dst: torch.Tensor, etype: torch.Tensor, like: Graph,
                 dst_sorted: bool = False) -> Graph:
        """A graph over the same nodes as the checked graph ``like`` whose edges are a permutation of its edges:
        nothing to validate again (validation reads the ids on the host, a synchronisation)."""
        g = cls.__new__(cls)
        g.num_nodes, g.num_relations, g.num_node_types = like.num_nodes, like.num_relations, like.num_node_types
        g.src, g.dst, g.etype, g._ntype = src.contiguous(), dst.contiguous(), etype.contiguous(), like._ntype
        g.has_node_type = like.has_node_type
        g.device = like.device
        g.sync_free = like.sync_free
        g.dst_sorted = dst_sorted
        g.dst_etype_sorted = False
        g._cache = {}
        g._built_versions = g._ids_versions()
        return g

    def _ids_versions(self) -> tuple[int, ...]:
        # read by every forward and backward on the graph: the versions read by a C loop, no Python per tensor
        ids = (self.src, self.dst, self.etype, self._ntype) if self.has_node_type else (self.src, self.dst, self.etype)
        return tuple(map(_VERSION, ids))

    def check_ids_unchanged(self) -> None:
        """Raises :class:`GraphInputError` where the caller's ``edge_index``, ``edge_type`` or ``node_type``, whose
        memory the graph shares (long ids), were edited in place after the graph was built from them: its prepared
        data (unique pairs, orders, the backend's layout) would mix the old ids with the new ones, and so would the
        backward of a forward that ran on it. Checked by every forward and backward that runs on the graph."""
        if self._ids_versions() != self._built_versions:
            raise GraphInputError(
                "edge_index, edge_type or node_type was modified in place after hector built its graph from them "
                "(a layer's forward ran on them, or hector.Graph / prepare_graph was given them; an in-place edit "
                "of a tensor they are views of counts too): that graph's prepared data, and the backward of a "
                "forward on it, would mix the old ids with the new. Run backward before editing the ids, or edit "
                "a clone (edge_index = edge_index.clone()) and pass the new tensors for a new graph")

    @property
    def ntype(self) -> torch.Tensor:
        """The node-type id of every node; for a graph made without node types all zeros, made on first use (a
        launch per new graph that a layer without node types never reads)."""
        if self._ntype is None:
            with _normal_tensors():
                self._ntype = torch.zeros(self.num_nodes, dtype=torch.long, device=self.device)
        return self._ntype

    @property
    def num_edges(self) -> int:
        return self.src.numel()

    def cached(self, key: Any, compute: Callable[[], Any]) -> Any:
        """Compute once per graph; every derived structure goes through here."""
        if key not in self._cache:
            with _normal_tensors():
                self._cache[key] = compute()
        return self._cache[key]

    # unique (source, relation) pairs: the rows of compact materialisation
    def _unique(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        def compute():
            # relation-major (by relation, then source): the segmented GEMMs' relation order, so their row order
            # over UNIQUE rows needs no sort (see type_order); the CUDA backend's device-side pairs use it too
            key = self.etype * self.num_nodes + self.src
            uniq, inverse = torch.unique(key, sorted=True, return_inverse=True)  # sizes its output: a host read
            self._record_unique_count(uniq.numel())
            return uniq % self.num_nodes, uniq // self.num_nodes, inverse

        return self.cached("unique", compute)

    def _record_unique_count(self, count: int) -> None:
        self._cache["unique_count"] = count
        self._cache.pop("size_stats", None)  # an estimate gives way to the count
        if self.num_edges:
            key = _ratio_class(self.num_nodes, self.num_edges, self.num_relations, self.num_node_types)
            _PAIR_RATIOS[key] = self.num_edges / max(count, 1)

    def expect_unique_count(self, count: torch.Tensor) -> None:
        """Starts copying the pair count ``count`` (a one-element tensor on the graph's device, computed by a
        backend without a host read) to the host without waiting; :meth:`known_unique_count` picks it up once
        the copy has finished."""
        if "unique_count" in self._cache or "unique_count_pending" in self._cache:
            return
        if count.is_cuda and torch.cuda.is_current_stream_capturing():
            return  # no event or pinned buffer inside a CUDA graph capture: the count stays unknown here
        if not count.is_cuda:  # nothing to wait for; picked up at the next look, as on a GPU
            self._cache["unique_count_pending"] = (None, count.reshape(1).clone())
            _PENDING.append(weakref.ref(self))
            return
        host = torch.empty(1, dtype=count.dtype, pin_memory=True)
        host.copy_(count.reshape(1), non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._cache["unique_count_pending"] = (done, host)
        _PENDING.append(weakref.ref(self))

    def known_unique_count(self) -> int | None:
        """The number of unique (source, relation) pairs if the host has it, without waiting for the device."""
        if "unique_count" in self._cache:
            return self._cache["unique_count"]
        pending = self._cache.get("unique_count_pending")
        if pending is not None and pending[0] is not None and torch.cuda.is_current_stream_capturing():
            return None  # querying an event is not allowed while a CUDA graph is captured
        if pending is not None and (pending[0] is None or pending[0].query()):
            del self._cache["unique_count_pending"]
            self._record_unique_count(int(pending[1][0]))
            return self._cache["unique_count"]
        return None

    def estimated_unique_count(self) -> int:
        """The pair count if known (:meth:`known_unique_count`), else the edge count over the pairs-per-edge
        ratio of the last graph of the same size class whose count is known (counts still on their way from
        earlier graphs are picked up first, without waiting), else the edge count (no pair shared: compaction
        is not assumed to pay for its pairs before a graph of this class has shown that it does)."""
        known = self.known_unique_count()
        if known is not None:
            return known
        _harvest_pending()
        ratio = _PAIR_RATIOS.get(_ratio_class(self.num_nodes, self.num_edges, self.num_relations,
                                              self.num_node_types), 1.0)
        return max(1, min(self.num_edges, round(self.num_edges / ratio))) if self.num_edges else 0

    @property
    def num_unique(self) -> int:
        return self._unique()[0].numel()

    @property
    def unique_src(self) -> torch.Tensor:
        return self._unique()[0]

    @property
    def unique_etype(self) -> torch.Tensor:
        return self._unique()[1]

    @property
    def edge_to_unique(self) -> torch.Tensor:
        """Inverse index: edge e's (source, relation) pair is row ``edge_to_unique[e]`` of the UNIQUE domain."""
        return self._unique()[2]

    # rows, indices, orders
    def num_rows(self, domain: Domain) -> int:
        if domain is Domain.NODE:
            return self.num_nodes
        if domain is Domain.EDGE:
            return self.num_edges
        if domain is Domain.UNIQUE:
            return self.num_unique
        raise KeyError(domain)

    def num_types(self, kind: str) -> int:
        return self.num_relations if kind == "etype" else self.num_node_types

    def index(self, domain: Domain, kind: str) -> torch.Tensor:
        """Type id of every row of ``domain`` for index ``kind`` (e.g. each edge's relation)."""
        if domain not in INDEX_KINDS.get(kind, ()):
            raise ValueError(f"type index {kind!r} is not defined on {domain.value} rows")

        def compute():
            if domain is Domain.NODE:
                return self.ntype
            src = self.src if domain is Domain.EDGE else self.unique_src
            if kind == "etype":
                return self.etype if domain is Domain.EDGE else self.unique_etype
            if kind == "src_ntype":
                return self.ntype[src]
            return self.ntype[self.dst]  # dst_ntype, EDGE only

        return self.cached(("index", domain, kind), compute)

    def combined_index(self, domain: Domain, by: tuple[str, ...]) -> torch.Tensor:
        """Row-major combination of several type indices (a param typed ``by=("src_ntype", "etype")``)."""

        def compute():
            if not by:
                return torch.zeros(self.num_rows(domain), dtype=torch.long, device=self.device)
            # the first index as it is (one type: no op at all; each op is a launch per new graph)
            idx = self.index(domain, by[0])
            for kind in by[1:]:
                idx = idx * self.num_types(kind) + self.index(domain, kind)
            return idx

        return self.cached(("combined", domain, by), compute)

    def num_combined_types(self, by: tuple[str, ...]) -> int:
        total = 1
        for kind in by:
            total *= self.num_types(kind)
        return total

    def _type_sort(self, domain: Domain, by: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the rows' (combined) types in order, rows sorted by type, stably): one sort shared by
        :meth:`type_order` and :meth:`type_counts`."""
        def compute():
            if by == () or (domain is Domain.UNIQUE and by == ("etype",)):
                # one type, or the pairs' own relation-major order: already sorted
                return self.combined_index(domain, by), torch.arange(self.num_rows(domain), device=self.device)
            return sort_keys(self.combined_index(domain, by), self.num_combined_types(by))

        return self.cached(("type_sort", domain, by), compute)

    def type_order(self, domain: Domain, by: tuple[str, ...]) -> torch.Tensor:
        """Rows sorted by their (combined) type, stably: the segmented-GEMM row order. No host synchronisation."""
        return self._type_sort(domain, by)[1]

    def type_counts(self, domain: Domain, by: tuple[str, ...]) -> torch.Tensor:
        """Rows of each (combined) type, a tensor on the graph's device, from the sorted types (see
        :func:`~hector.runtime.prep.sorted_counts`: no atomics, and no host synchronisation, unlike ``bincount``
        on a GPU, which reads the largest id on the host to size its output)."""
        return self.cached(("type_counts", domain, by), lambda: prep.sorted_counts(
            self._type_sort(domain, by)[0], self.num_combined_types(by)))

    def segments(self, domain: Domain, by: tuple[str, ...]) -> tuple[torch.Tensor, list[int]]:
        """Rows sorted by their (combined) type, and the row count of each type as a host list (one
        synchronisation): the segmented-GEMM layout of the reference backend."""
        return self.cached(("segments", domain, by),
                           lambda: (self.type_order(domain, by), self.type_counts(domain, by).tolist()))

    def segment_chunks(self, domain: Domain, by: tuple[str, ...], dense_rows: int) -> list[tuple[Any, Any]]:
        """The rows of ``domain`` in chunks that each take one matmul: ``(rows, t)`` with ``t`` an int (a type with
        at least ``dense_rows`` rows: one dense matmul with its weight) or a tensor of per-row types (all rows of
        the smaller types, in one batched matmul with per-row weights). The chunk count is bounded by the row
        count over ``dense_rows`` plus one, whatever the number of types: a mini-batch that sees a few of
        thousands of relations costs what its rows cost (one host synchronisation per graph, cached)."""

        def compute():
            rows = self.num_rows(domain)
            if not by:
                return [(torch.arange(rows, device=self.device), 0)] if rows else []
            counts = self.type_counts(domain, by)
            big = (counts >= dense_rows).nonzero().flatten()
            perm = self.type_order(domain, by)
            starts = torch.cumsum(counts, 0) - counts
            big_host = torch.stack([big, starts[big], counts[big]]).tolist() if big.numel() else [[], [], []]
            out: list[tuple[Any, Any]] = [(perm[s:s + c], t) for t, s, c in zip(*big_host, strict=True)]
            types = self.combined_index(domain, by)
            small = ((counts[types] < dense_rows) & (counts[types] > 0)).nonzero().flatten()
            if small.numel():
                out.append((small, types.index_select(0, small)))
            return out

        return self.cached(("segment_chunks", domain, by, dense_rows), compute)

    def gather_index(self, via: str) -> torch.Tensor:
        if via not in GATHER_VIA:
            raise ValueError(f"unknown via {via!r}")
        return {"src": self.src, "dst": self.dst, "unique_src": self.unique_src,
                "unique": self.edge_to_unique}[via]

    def csc(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Edges sorted by destination: (permutation, indptr of length N+1). Node-parallel aggregation layout."""
        return self.cached("csc", lambda: self._compressed(self.dst))

    def csr(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Edges sorted by source: (permutation, indptr of length N+1)."""
        return self.cached("csr", lambda: self._compressed(self.src))

    def _compressed(self, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if key is self.dst and self.dst_sorted:  # already in destination order
            ordered, perm = key, torch.arange(self.num_edges, device=self.device)
        else:
            ordered, perm = sort_keys(key, self.num_nodes)
        # each node's first position in the sorted keys: the offsets without a count of their own
        bounds = torch.arange(self.num_nodes + 1, dtype=ordered.dtype, device=self.device)
        return perm, torch.searchsorted(ordered, bounds)

    def relation_ptr(self) -> torch.Tensor:
        """indptr over relations of the relation-sorted edge order (``segments(EDGE, ("etype",))``)."""

        def compute():
            _, counts = self.segments(Domain.EDGE, ("etype",))
            ptr = torch.zeros(self.num_relations + 1, dtype=torch.long)
            ptr[1:] = torch.cumsum(torch.tensor(counts, dtype=torch.long), 0)
            return ptr

        return self.cached("relation_ptr", compute)

    def in_degree(self) -> torch.Tensor:
        """In-edges per node. No host synchronisation (``bincount`` would read the largest id on a GPU); by
        binary search where the edges are in destination order (the CUDA backend's layout: no atomics, which a
        GPU serialises on the popular destinations)."""

        def compute():
            if self.dst_sorted:
                return prep.sorted_counts(self.dst, self.num_nodes)
            deg = torch.zeros(self.num_nodes, dtype=torch.long, device=self.device)
            return deg.index_add_(0, self.dst, torch.ones_like(self.dst))

        return self.cached("in_degree", compute)

    def graph_const(self, kind: str, dtype: torch.dtype) -> torch.Tensor:
        # reciprocals of integer counts: computed in float32 or float64 directly (the same correctly rounded
        # values as through float64 for counts below 2**24, one cast fewer per new graph), others via float64
        work = dtype if dtype in (torch.float32, torch.float64) else torch.float64

        def compute():
            if kind == "inv_deg_dst_rel":
                # edges sharing (destination, relation), by binary search in the sorted keys: no host read (unique
                # would size its output on the host, a synchronisation per new graph)
                bound = self.num_nodes * self.num_relations
                key = self.etype.add(self.dst, alpha=self.num_relations)
                if bound <= 2**31 - 1:
                    key = key.to(torch.int32)  # once, for the sort and both searches
                # edges already in (destination, relation) order (the CUDA backend's layout): the keys are sorted,
                # and each search walks the same path as its neighbours' (no sort, coalesced reads)
                ordered = key if self.dst_etype_sorted else sort_keys(key, bound)[0]
                counts = torch.searchsorted(ordered, key, right=True) - torch.searchsorted(ordered, key)
                return counts.to(work).reciprocal_()
            deg = self.in_degree().to(work)
            if kind == "inv_deg_dst":
                return deg[self.dst].reciprocal_()
            if kind == "inv_in_degree":
                return torch.where(deg > 0, 1.0 / deg.clamp(min=1), torch.zeros_like(deg))
            raise ValueError(f"unknown graph constant {kind!r}")

        return self.cached(("const", kind, dtype), lambda: compute().to(dtype))

    def size_stats(self) -> dict[str, int]:
        """The row and type counts the cost model is sized by. ``num_unique`` reads the device (the unique
        (source, relation) pairs, computed once per graph), except on a ``sync_free`` graph, where it is
        :meth:`estimated_unique_count` until the graph's own count has arrived."""
        if self.sync_free:
            self.known_unique_count()  # a count that has arrived replaces the estimate
        return self.cached("size_stats", lambda: {
            "num_nodes": self.num_nodes,
            "num_edges": self.num_edges,
            "num_unique": self.estimated_unique_count() if self.sync_free else self.num_unique,
            "num_relations": self.num_relations,
            "num_node_types": self.num_node_types,
        })

    def stats(self) -> dict[str, Any]:
        """:meth:`size_stats` and the largest relation's edge count (one more host synchronisation)."""

        def compute():
            per_rel = self.type_counts(Domain.EDGE, ("etype",))
            return {**self.size_stats(),
                    "max_edges_per_relation": int(per_rel.max()) if self.num_edges else 0}

        return self.cached("stats", compute)

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """:meth:`torch.Tensor.record_stream` for every tensor of the graph and of its cached preprocessing (the
        CUDA backend's layout included). Call it when the graph was made (e.g. by :func:`hector.prepare_graph`) on
        one CUDA stream and the layers run on another: the caching allocator then does not hand its memory to the
        first stream's next allocations while the second may still read it."""
        record_stream_of((self.src, self.dst, self.etype, self._ntype, self._cache), stream)

    def __repr__(self) -> str:
        return (f"Graph(num_nodes={self.num_nodes}, num_edges={self.num_edges}, num_relations={self.num_relations}, "
                f"num_node_types={self.num_node_types})")


def record_stream_of(value: Any, stream: torch.cuda.Stream) -> None:
    """``record_stream(stream)`` on every CUDA tensor in ``value``: tensors, tuples, lists and dicts of them, and
    objects with their own ``record_stream`` (cached layouts)."""
    if isinstance(value, torch.Tensor):
        if value.is_cuda:
            value.record_stream(stream)
    elif isinstance(value, (tuple, list)):
        for v in value:
            record_stream_of(v, stream)
    elif isinstance(value, dict):
        for v in value.values():
            record_stream_of(v, stream)
    elif hasattr(value, "record_stream"):
        value.record_stream(stream)


# key -> (the caller's id tensors, their graph). The cache holds the tensors themselves, not weak references to them:
# torch.utils.swap_tensors (which a module's conversions use) refuses a tensor with a weak reference; the graph
# itself holds none of the caller's tensor objects (aliases of their memory and version counters), so a swapped
# tensor's new content never reaches a graph built from its old one.
_GRAPHS: OrderedDict[tuple, tuple[tuple[torch.Tensor, ...], Graph]] = OrderedDict()
_MAX_GRAPHS = 16
_GRAPHS_LOCK = threading.Lock()  # a loader thread may prepare graphs (hector.prepare_graph) while layers run
# what sys.getrefcount reads, through the same map as _forget_dead, of an object only a cache entry's tuple holds
_ALONE = next(map(sys.getrefcount, (object(),)))


def _forget_dead() -> None:
    """Drops the cache entries one of whose tensors only the cache still holds (called with ``_GRAPHS_LOCK`` held,
    at every lookup): such a graph can never be looked up again (a lookup passes the tensors). Its entry, and with
    it the graph's layout on the device (as large as the edges several times over), goes at the next lookup, so
    that a mini-batch loop holds the graphs of the batches still in use, not the last sixteen: the caching
    allocator then hands each batch the memory of the batch before it instead of growing (a device allocation per
    new graph)."""
    dead = [key for key, (tensors, _) in _GRAPHS.items() if _ALONE in map(sys.getrefcount, tensors)]
    for key in dead:
        del _GRAPHS[key]


def cached_graphs() -> int:
    """How many graphs :func:`graph_for` holds (entries of freed tensors dropped first)."""
    with _GRAPHS_LOCK:
        _forget_dead()
        return len(_GRAPHS)


def tensor_key(t: torch.Tensor) -> tuple:
    """What a graph cache keys one id tensor on: the object, its version counter (an in-place edit bumps it) and
    where its data lies and how (``t.data = other`` gives the same object other ids without bumping the counter)."""
    if t.layout != torch.strided:  # a sparse tensor has neither: Graph refuses it, naming the fix
        return id(t), t._version
    return id(t), t._version, t.data_ptr(), tuple(t.shape), t.stride()


def graph_for(edge_index: torch.Tensor, edge_type: torch.Tensor, num_nodes: int, num_relations: int,
              node_type: torch.Tensor | None = None, num_node_types: int | None = None,
              sync_free: bool = False, sorted_by_destination: bool | None = None) -> Graph:
    """The cached Graph for these exact tensors (same objects, unmodified), or a new one: ``sync_free`` and
    ``sorted_by_destination`` as for :class:`Graph` (default False: checked and counted exactly; None: order
    found out); a cached graph is returned as it was built.

    Keyed on tensor identity, version counter and data pointer (:func:`tensor_key`), so an in-place edit of
    ``edge_index`` or new data assigned to it (``edge_index.data = ...``, ``torch.utils.swap_tensors``) invalidates
    the entry.
    """
    if isinstance(edge_index, Graph):
        return edge_index
    tensors = [t for t in (edge_index, edge_type, node_type) if isinstance(t, torch.Tensor)]
    key = (tuple(map(tensor_key, tensors)), int(num_nodes), int(num_relations), num_node_types,
           node_type is None)
    with _GRAPHS_LOCK:
        _forget_dead()  # before a new graph's allocations: the freed batches' memory is theirs to reuse
        hit = _GRAPHS.get(key)
        if hit is not None and all(map(operator.is_, hit[0], tensors)):
            _GRAPHS.move_to_end(key)
            return hit[1]
    g = Graph(edge_index, edge_type, num_nodes, num_relations, node_type, num_node_types, sync_free=sync_free,
              sorted_by_destination=sorted_by_destination)
    with _GRAPHS_LOCK:
        _GRAPHS[key] = (tuple(tensors), g)
        while len(_GRAPHS) > _MAX_GRAPHS:
            _GRAPHS.popitem(last=False)
    return g
