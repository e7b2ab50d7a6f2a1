"""The CUDA backend's layout of a graph (:class:`DeviceGraph`): destination-sorted edges (as they came, where they
were sorted already), int32 indices, the destinations heaviest first, per-type orders and counts and the segment
GEMMs' tile schedules, cached per graph and built without host synchronisation (see :mod:`hector.runtime.cuda`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..ir.core import GATHER_VIA, Domain
from . import prep
from .graph import Graph, record_stream_of, unique_pairs


class DeviceGraph:
    """A graph prepared for the generated kernels: destination-sorted edges and int32 indices, cached.

    Built without host synchronisation: the caller's graph was validated once (on the host, or by device-side
    assertions on a ``sync_free`` graph), and the unique (source, relation) pairs are either those computed on it
    (their count read once: the UNIQUE rows sized exactly) or computed here on the device (*padded*: UNIQUE buffers
    sized by the edge count, the pairs in their first rows, kernels stopped at the count on the device, types and
    tile schedules counting only real pairs). A padded layout *settles* to the exact one, by slicing, once the
    pair count has reached the host without waiting (:func:`device_graph`). A mini-batch's layers then only launch
    kernels, and the host runs ahead of the GPU."""

    def __init__(self, graph: Graph):
        if graph.num_edges >= 2**31 or graph.num_nodes >= 2**31:
            raise ValueError(f"the CUDA backend indexes rows with int32: {graph} is too large")
        exact = "unique" in graph._cache
        # the whole layout in one TorchScript call (see hector.runtime.prep): a loader thread preparing a
        # mini-batch holds the GIL for none of its operations
        (order, src, dst, etype, inverse, src32, dst32, etype32, inverse32, unique_src, self.csc_ptr,
         p_src, p_etype, count, self.unique_count, valid, pair_counts) = prep.run(
            prep.destination_layout, graph.src, graph.dst, graph.etype, graph.edge_to_unique if exact else None,
            graph.unique_src if exact else None, graph.unique_etype if exact else None, graph.num_nodes,
            graph.num_relations, graph.dst_sorted)
        self.order = order  # sorted position -> original edge id; None where the edges came in that order
        g = self.graph = Graph._derived(src, dst, etype, like=graph, dst_sorted=True)
        g.dst_etype_sorted = graph.dst_etype_sorted or (
            not graph.dst_sorted and prep.by_relation(graph.num_nodes, graph.num_relations))
        self.device = g.device
        self.num_nodes, self.num_edges = g.num_nodes, g.num_edges
        self.padded = not exact
        self._unique_rows = g.num_edges if self.padded else graph.num_unique  # what g.num_unique says, kept
        self._cache: dict[Any, Any] = {
            ("gather", "src"): src32, ("gather", "dst"): dst32, ("gather", "unique"): inverse32,
            ("gather", "unique_src"): unique_src, ("index", Domain.EDGE, ("etype",)): etype32}
        if self.padded:
            # the (source, relation) pairs computed on the device, padded; their count is on its way to the host
            g._cache["unique"] = (p_src, p_etype, inverse)
            self._valid = valid
            self._cache[("type_counts", Domain.UNIQUE, ("etype",))] = pair_counts
            self._cache[("type_counts", Domain.UNIQUE, ())] = count
            graph.expect_unique_count(count)
        else:
            # the same (source, relation) pairs in the same order; each edge keeps its pair
            g._cache["unique"] = (graph.unique_src, graph.unique_etype, inverse)
            g._cache[("type_counts", Domain.UNIQUE, ("etype",))] = pair_counts
        self._bound: dict[int, dict[tuple, Any]] = {}
        self._values: dict[int, dict[tuple, int]] = {}  # the same as numbers (see bound_values)
        # the CUDA backend's call records on this graph (see CudaBackend.run): a plain dict keyed without a
        # Domain (whose hash is a Python call), emptied with the rest when a padded layout settles
        self.calls: dict[tuple, Any] = {}

    def settle(self, count: int) -> None:
        """The pair count has reached the host: UNIQUE rows from now on sized exactly (the first ``count`` rows
        of the padded layout, which hold the same pairs in the same order; rows of buffers made before stay
        valid). Everything cached about UNIQUE rows is rebuilt on next use."""
        if not self.padded:
            return
        g = self.graph
        src, etype, inverse = g._cache["unique"]
        # the padded layout's tensors stay alive: a CUDA graph captured with them may still be replayed
        self._retired = [g._cache, self._cache, self._bound, self._valid]
        g._cache = {k: v for k, v in g._cache.items() if not _mentions_unique(k)}
        g._cache["unique"] = (src[:count], etype[:count], inverse)
        self._cache = {k: v for k, v in self._cache.items() if not _mentions_unique(k)}
        self._bound = {}
        self._values = {}
        self.calls = {}
        self.padded = False
        self._unique_rows = count
        del self._valid

    @property
    def num_unique(self) -> int:
        """UNIQUE rows of the buffers: the pair count, or the edge count while padded."""
        return self._unique_rows

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """See :meth:`Graph.record_stream`."""
        self.graph.record_stream(stream)
        record_stream_of((self.order, self.csc_ptr, self.unique_count, self._cache, self._bound), stream)

    @property
    def dst_order(self) -> torch.Tensor:
        """The destinations by in-degree, heaviest first (int32): made on first use (a sort over the nodes, which
        only the node-centric traversals read)."""
        return self._cached("dst_order", lambda: prep.run(prep.heaviest_first, self.csc_ptr))

    def bound(self, multiprocessors: int) -> dict[tuple, Any]:
        """The kernel arguments and grids that depend on this graph (and the GPU's multiprocessor count) only, by
        binding or launch (the CUDA backend's keys): filled as launch plans are made, shared by every program
        run on the graph, so each is computed once per graph (emptied when a padded layout settles)."""
        table = self._bound.get(multiprocessors)
        if table is None:
            table = self._bound[multiprocessors] = {}
        return table

    def bound_values(self, multiprocessors: int) -> dict[tuple, int]:
        """:meth:`bound`'s arguments and grids as the numbers a launch takes (a tensor's address, a grid's x), by
        the same keys: what a new graph's call record writes into the layout its program made once."""
        table = self._values.get(multiprocessors)
        if table is None:
            table = self._values[multiprocessors] = {}
        return table

    def rows(self, domain: Domain) -> int:
        # by identity, not a dictionary: a Domain's hash is a Python call, and launch plans ask this often
        if domain is Domain.EDGE:
            return self.num_edges
        if domain is Domain.NODE:
            return self.num_nodes
        if domain is Domain.UNIQUE:
            return self._unique_rows
        return self.graph.num_rows(domain)  # its error

    def _cached(self, key, compute):
        value = self._cache.get(key)  # one lookup on a hit: the keys hold a Domain, whose hash is a Python call
        if value is None:
            value = self._cache[key] = compute()
        return value

    def gather(self, via: str) -> torch.Tensor:
        return self._cached(("gather", via), lambda: self.graph.gather_index(via).to(torch.int32).contiguous())

    def index(self, domain: Domain, by: tuple[str, ...]) -> torch.Tensor:
        return self._cached(("index", domain, by),
                            lambda: self.graph.combined_index(domain, by).to(torch.int32).contiguous())

    def count(self, domain: Domain) -> torch.Tensor:
        """The row count of ``domain`` as a one-element int32 device tensor (``("count", domain)`` bindings)."""
        if domain is Domain.UNIQUE:
            return self.unique_count
        return self._cached(("count", domain), lambda: torch.full((1,), self.rows(domain), dtype=torch.int32,
                                                                   device=self.device))

    def segments(self, domain: Domain, via: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of ``domain`` grouped by their row in ``via``'s target domain, for target-centric kernels:
        (int32 offsets ``[targets + 1]``, int32 rows sorted by target, stable). Built once per graph on the device
        (one sort, one binary search; no host read); padding rows of a padded UNIQUE layout are left out."""

        def compute():
            target = GATHER_VIA[via][0]
            count = self.rows(target)
            key = self.gather(via)  # int32 already: it sorts in half the radix passes of int64
            if domain is Domain.UNIQUE and self.padded:
                key = torch.where(self._valid, key, count)  # after every real target: in no segment
            keys, order = torch.sort(key, stable=True)
            bounds = self._cached(("arange", max(self.num_nodes, self.num_edges) + 1), lambda: torch.arange(
                max(self.num_nodes, self.num_edges) + 1, dtype=torch.int32, device=self.device))[:count + 1]
            return (torch.searchsorted(keys, bounds, out_int32=True), order.to(torch.int32))

        return self._cached(("segments", domain, via), compute)

    def _padded_types(self, by: tuple[str, ...]) -> tuple[torch.Tensor, int]:
        """(type of every padded UNIQUE row, type count): padding rows get the type past the last, so sorting
        puts them last and counting leaves them out."""
        types = self.graph.num_combined_types(by)
        index = self.graph.combined_index(Domain.UNIQUE, by) if by else \
            torch.zeros(self.graph.num_edges, dtype=torch.long, device=self.device)
        return torch.where(self._valid, index, types), types

    def _padded_type_layout(self, by: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """(real rows of each type, rows sorted by type as int32, padding last) of padded UNIQUE rows: both from
        one sort (:func:`~hector.runtime.prep.type_layout`), on first use of either."""
        def compute():
            index, types = self._padded_types(by)
            return prep.run(prep.type_layout, index, types)

        return self._cached(("padded_type_layout", Domain.UNIQUE, by), compute)

    def type_counts(self, domain: Domain, by: tuple[str, ...]) -> torch.Tensor:
        """Rows of each (combined) type on the device (real rows only)."""
        if domain is Domain.UNIQUE and self.padded:
            return self._padded_type_layout(by)[0]
        if by:
            if domain is not Domain.UNIQUE:
                return self._type_layout(domain, by)[0]
            return self.graph.type_counts(domain, by)
        return self._cached(("type_counts", domain, by),
                            lambda: torch.full((1,), self.rows(domain), dtype=torch.long, device=self.device))

    def perm(self, domain: Domain, by: tuple[str, ...]) -> torch.Tensor:
        def compute():
            if (domain is Domain.UNIQUE and by == ("etype",)) or by == ():
                # pairs are relation-major (padded ones with the padding last): already in this order
                return torch.arange(self.rows(domain), dtype=torch.int32, device=self.device)
            if domain is Domain.UNIQUE and self.padded:
                return self._padded_type_layout(by)[1]
            if domain is not Domain.UNIQUE:
                return self._type_layout(domain, by)[1]
            return self.graph.type_order(domain, by).to(torch.int32).contiguous()

        return self._cached(("perm", domain, by), compute)

    def _type_layout(self, domain: Domain, by: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows of each type, rows sorted by type as int32) of node or edge rows typed by ``by``: both in one
        TorchScript call (no GIL held for their operations), on first use of either."""
        # typed by the int32 index the kernels read too (one cast shared, and a sort in half the radix passes)
        return self._cached(("type_layout", domain, by), lambda: prep.run(
            prep.type_layout, self.index(domain, by), self.graph.num_combined_types(by)))

    def tile_rows(self, domain: Domain, rows: int, multiprocessors: int) -> int:
        """Rows per tile of a schedule: ``rows``, or for 0 the power of two in [256, 4096] nearest below ~8 tiles
        per multiprocessor (fewer, longer tiles where the graph is large: one atomic flush per tile)."""
        if rows:
            return rows
        want = -(-self.rows(domain) // (8 * multiprocessors))
        size = 256
        while size * 2 <= min(want, 4096):
            size *= 2
        return size

    def tiles(self, domain: Domain, by: tuple[str, ...], rows: int,
              build: Callable[[torch.Tensor, int, int], torch.Tensor]) -> tuple[torch.Tensor, int]:
        """Tile schedule of a segment GEMM: (type, first position in the type-sorted rows, count) per tile of at
        most ``rows`` rows; a tile never spans two types, so it needs one weight. Built once per graph by
        ``build(counts, rows, slots)`` (the backend's schedule kernel) from the per-type counts, which stay on the
        device. The schedule has ``slots`` entries, the most tiles the row count allows (each type adds at most one
        partial tile: at most min(types, rows) of them, so the count does not grow with a model's relations beyond
        those a graph can hold); the entries past the last tile have count 0 and their blocks return at once."""

        def compute():
            total = self.rows(domain)
            if total == 0:
                return torch.zeros(1, 3, dtype=torch.int32, device=self.device), 0
            counts = self.type_counts(domain, by)
            slots = -(-total // rows) + min(counts.numel(), total) - 1  # >= sum(ceil(count / rows))
            return build(counts, rows, slots), slots

        return self._cached(("tiles", domain, by, rows), compute)


def device_graph(graph: Graph) -> DeviceGraph:
    """The graph's CUDA layout (made on first use), settled to exact UNIQUE rows once the host knows the pair
    count (looked for without waiting by :meth:`Graph.known_unique_count`, at each layer call's start)."""
    dg = graph._cache.get("cuda_backend_graph")  # every layer call and backward asks: no closure on a hit
    if dg is None:
        dg = graph.cached("cuda_backend_graph", lambda: DeviceGraph(graph))
    if dg.padded and "unique_count" in graph._cache:
        dg.settle(graph._cache["unique_count"])
    return dg


def _mentions_unique(key: Any) -> bool:
    """A cache key of something derived from the UNIQUE rows (their pairs, types, orders, schedules)."""
    parts = key if isinstance(key, tuple) else (key,)
    return any(p is Domain.UNIQUE or p in ("unique", "unique_src", "size_stats") for p in parts)


__all__ = ["DeviceGraph", "device_graph", "unique_pairs"]
