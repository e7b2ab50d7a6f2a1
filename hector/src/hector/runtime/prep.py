"""A new graph's tensor work (the id checks, the unique (source, relation) pairs, the CUDA backend's
destination-sorted layout) as TorchScript functions that run without the GIL.

Torch operations called from Python hold the interpreter lock from one to the next. A mini-batch's graph is prepared
in a loader thread beside the training thread, and the training thread's step is itself bound by its host time: each
millisecond of Python and dispatch the loader holds comes off the step. The same operations in one TorchScript call
run in C++ after a single release of the lock. Where TorchScript cannot compile them (a torch without it), the same
functions run as Python, with the same results.

Each function is one pass over a graph's tensors with nothing read on the host: :func:`check_and_pair` gives the
values the host checks (the ids' ranges, whether the destinations are in order) and the pair count in one small
tensor, so that a checked graph waits for the device once; :func:`destination_layout` the CUDA backend's layout.
"""

import logging
from typing import Any

import torch
from torch import Tensor

from .._shared_cuda import script_once

log = logging.getLogger("hector")

def sort_keys(key: Tensor, bound: int) -> tuple[Tensor, Tensor]:
    """(sorted keys, stable order) of non-negative integer keys below ``bound``, the keys in the narrowest type
    they fit: a GPU radix sort makes one pass per key byte, so int32 keys take half the passes of int64, and types
    or relations (below 2**15, or 2**7) sort as int16 (int8) in a half (quarter) of int32's. The narrower types
    only from 2**16 keys on, where the passes outweigh the cast they add to an int32 index; below, int32 as given.
    The sorted keys come in that type."""
    if bound <= 2**7 - 1 and key.numel() >= 2**16:
        width = torch.int8
    elif bound <= 2**15 - 1 and key.numel() >= 2**16:
        width = torch.int16
    elif bound <= 2**31 - 1:
        width = torch.int32
    else:
        width = key.dtype
    if key.dtype != width:
        key = key.to(width)
    values, order = torch.sort(key, stable=True)
    return values, order


def sorted_counts(sorted_index: Tensor, types: int) -> Tensor:
    """Rows of each type in [0, ``types``) (int64) of a type index in non-decreasing order (values from ``types``
    on, such as padding rows typed past the last type, are not counted): one binary search per type boundary.
    Not ``index_add_`` of ones: millions of rows counted into a few hundred types put their atomics on a few
    addresses, which a GPU serialises (3.5 ms for 16M edges' pairs into 535 relations on an H100); not
    ``bincount``, which reads the largest id on the host."""
    bounds = torch.arange(types + 1, dtype=sorted_index.dtype, device=sorted_index.device)
    ends = torch.searchsorted(sorted_index, bounds)
    return ends[1:] - ends[:-1]


def unique_pairs(src: Tensor, etype: Tensor, num_nodes: int,
                 num_relations: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The unique (source, relation) pairs without a host read: (source, relation) of each pair in its first
    rows, relation-major (by relation, then source: already the segmented GEMMs' relation order, so that order
    needs no sort of its own), padded to the edge count with (0, 0); each edge's pair row; and the pair count, a
    one-element device tensor. By :func:`pairs_by_marks` where every (source, relation) key fits a table of a
    few times the edges (:func:`marks_pairs`), else by :func:`pairs_by_sort`: the same tensors either way."""
    if src.numel() == 0:
        empty = torch.zeros(0, dtype=torch.long, device=src.device)
        return empty, empty, empty, torch.zeros(1, dtype=torch.long, device=src.device)
    key = src.add(etype, alpha=num_nodes)  # relation-major: etype * num_nodes + src
    if marks_pairs(num_nodes, num_relations, src.numel()):
        pairs, inverse, count = pairs_by_marks(key, num_nodes * num_relations)
    else:
        pairs, inverse, count = pairs_by_sort(key, num_nodes * num_relations)
    return pairs % num_nodes, pairs // num_nodes, inverse, count


def marks_pairs(num_nodes: int, num_relations: int, edges: int) -> bool:
    """Whether :func:`unique_pairs` takes :func:`pairs_by_marks`: where the table of every (source, relation)
    key holds at most four entries per edge (12 bytes each: a graph's edges take 16 each), or at most 2**16
    entries (a few microseconds of passes on a GPU, for a small graph's fewer launches: 12 against the sort's 15)."""
    return num_nodes * num_relations <= max(4 * edges, 2**16)


def pairs_by_marks(key: Tensor, table: int) -> tuple[Tensor, Tensor, Tensor]:
    """(each pair's key in its row, padded to the edge count with 0; each edge's pair row; the pair count) of
    non-negative keys below ``table`` with no sort: a mark per key present in a table of every key, the marks'
    running sum (a key's pair row is the pairs at or before it, less one), and each pair's key by binary search
    in that sum: a pass over the edges or the table each, and the marks the one scatter (of a constant)."""
    edges = key.numel()
    # clamped: an unchecked graph's pairs are made before the host reads its ids' range (check_and_pair), and an
    # id out of range must then give a clear error there, not a device-side assertion here (valid keys: no change)
    key = key.clamp(0, table - 1)
    marks = torch.zeros(table, dtype=torch.int32, device=key.device).index_fill_(0, key, 1)
    rank = torch.cumsum(marks, 0)  # pairs at or before each key (int64)
    inverse = rank.index_select(0, key) - 1
    # pair r's key: the first key with r + 1 pairs at or before it; past the last pair the search ends at
    # `table`, which the remainder makes the padding's 0
    rows = torch.arange(1, edges + 1, dtype=torch.long, device=key.device)
    pairs = torch.searchsorted(rank, rows).remainder_(table)
    return pairs, inverse, rank[-1:]


def pairs_by_sort(key: Tensor, table: int) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`pairs_by_marks`' tensors by one sort of the keys: the sorted keys' distinct values counted along
    them (each sorted key's pair row, put back in edge order), and each pair's key scattered to its row. (A binary
    search per pair row for its first sorted key, instead of the scatter, measured slower on an H100: wikikg2's
    pairs 3.37 against 2.71 ms, am's 1.30 against 0.96.)"""
    edges = key.numel()
    values, order = sort_keys(key, table)
    row = torch.zeros(edges, dtype=torch.long, device=key.device)  # pair row of each edge in key order
    torch.cumsum(values[1:] != values[:-1], 0, dtype=torch.long, out=row[1:])
    inverse = torch.empty(edges, dtype=torch.long, device=key.device).index_copy_(0, order, row)
    pairs = torch.zeros(edges, dtype=torch.long, device=key.device).scatter_(0, row, values.long())
    return pairs, inverse, row[-1:] + 1


def check_and_pair(edge_index: Tensor, edge_type: Tensor, node_type: Tensor | None, num_nodes: int,
                   num_relations: int, order: bool,
                   pairs: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A new graph's checks and pairs in one pass: ``(bounds, pair sources, pair relations, edge -> pair row)``.
    ``bounds`` is one int64 tensor: the smallest and largest id of each non-empty id tensor (``edge_index``,
    ``edge_type``, ``node_type`` if given), then, if ``order`` and there are two edges or more, the smallest step
    between consecutive destinations (negative where an edge goes back), then, if ``pairs``, the pair count. The
    pairs are :func:`unique_pairs`' (padded to the edge count), or empty tensors without ``pairs``. Reading
    ``bounds`` on the host is the one wait for the device."""
    values: list[Tensor] = []
    for t in [edge_index, edge_type] if node_type is None else [edge_index, edge_type, node_type]:
        if t.numel():
            lo, hi = torch.aminmax(t)
            values += [lo, hi]
    dst = edge_index[1]
    if order and dst.numel() > 1:
        values.append((dst[1:] - dst[:-1]).amin())
    if pairs:
        src, etype, inverse, count = unique_pairs(edge_index[0], edge_type, num_nodes, num_relations)
        values.append(count.reshape(()))
        return torch.stack(values), src, etype, inverse
    empty = torch.zeros(0, dtype=torch.long, device=edge_index.device)
    return torch.stack(values) if len(values) else empty, empty, empty, empty


def destination_layout(src: Tensor, dst: Tensor, etype: Tensor, inverse: Tensor | None,
                       unique_src: Tensor | None, unique_etype: Tensor | None, num_nodes: int,
                       num_relations: int, dst_sorted: bool) -> list[Tensor | None]:
    """The CUDA backend's layout of a checked graph (see :class:`~hector.runtime.device_graph.DeviceGraph`), as
    the list ``[order, src, dst, etype, inverse, src32, dst32, etype32, inverse32, unique_src32, csc_ptr,
    pair sources, pair relations, pair count, pair count as int32, valid, pairs per relation]``.

    ``order``: sorted position -> original edge (None where ``dst_sorted``); ``src``, ``dst``, ``etype``: the
    edges' int64 columns in destination order (and by relation within a destination, stably, where
    :func:`by_relation` says so and the edges were not in destination order already); ``inverse``: each sorted
    edge's pair row; the ``*32`` tensors: the same as int32 (the kernels' gather indices), and the pairs' sources;
    ``csc_ptr``: the int32 offsets of each destination's in-edges. The pairs: the graph's own
    where it has them (``inverse``, ``unique_src``, ``unique_etype``: exact; None is returned for the pairs, their
    int64 count and ``valid``), else computed here (padded to the edge count with ``valid`` marking the real
    rows); the pair count is a one-element tensor (int64 where computed here, and int32 either way). The pairs
    per relation (int64, real pairs only) size every relational model's segment GEMMs over pairs."""
    device = src.device
    edges = src.numel()
    order: Tensor | None = None
    # the columns (and each edge's pair row, where known) gathered in one op, not one per column
    both = torch.stack([src, dst, etype] if inverse is None else [src, dst, etype, inverse])
    if not dst_sorted:
        # by (destination, relation) where that key sorts as int32 (as many radix passes as the destination
        # alone): the edges are then also grouped by relation within each destination, and the relational mean's
        # normaliser counts those groups without a sort of its own (Graph.graph_const)
        if by_relation(num_nodes, num_relations):
            o = sort_keys(etype.add(dst, alpha=num_relations), num_nodes * num_relations)[1]
        else:
            o = sort_keys(dst, num_nodes)[1]
        order = o
        both = both.index_select(1, o)
    columns = both[:3]
    inv: Tensor | None = None if inverse is None else both[3]
    out_src: Tensor | None = None
    out_etype: Tensor | None = None
    valid: Tensor | None = None
    if inv is None or unique_src is None or unique_etype is None:
        p_src, p_etype, p_inv, count = unique_pairs(columns[0], columns[2], num_nodes, num_relations)
        inv = p_inv
        out_src, out_etype = p_src, p_etype
        valid = torch.arange(edges, device=device) < count
        pair_type = torch.where(valid, p_etype, num_relations)  # padding rows: the type past the last
        count32 = count.to(torch.int32)
        out_count: Tensor | None = count
        pair_src = p_src
        narrow = torch.cat([columns, inv.unsqueeze(0)]).to(torch.int32)
    else:
        out_count = None
        count32 = torch.full((1,), unique_src.numel(), dtype=torch.int32, device=device)
        pair_type = unique_etype
        pair_src = unique_src
        narrow = both.to(torch.int32)
    nodes = torch.arange(num_nodes + 1, dtype=columns.dtype, device=device)
    csc_ptr = torch.searchsorted(columns[1], nodes, out_int32=True)
    pair_counts = sorted_counts(pair_type, num_relations)  # pairs are relation-major, padding typed last
    # the rows one by one (their views made here, not by the caller's Python)
    return [order, columns[0], columns[1], columns[2], inv, narrow[0], narrow[1], narrow[2], narrow[3],
            pair_src.to(torch.int32), csc_ptr, out_src, out_etype, out_count, count32, valid, pair_counts]


def by_relation(num_nodes: int, num_relations: int) -> bool:
    """Whether :func:`destination_layout` sorts unsorted edges by (destination, relation), not by destination
    alone: where the combined key fits int32, so that it sorts in as many radix passes."""
    return num_nodes * num_relations <= 2**31 - 1


def heaviest_first(csc_ptr: Tensor) -> Tensor:
    """The destinations by in-degree, heaviest first (stable; int32), from their CSC offsets: the order of the
    node-centric traversals, made only for a program that has one."""
    deg = csc_ptr[1:] - csc_ptr[:-1]
    return torch.sort(deg, descending=True, stable=True)[1].to(torch.int32)


def type_layout(index: Tensor, types: int) -> tuple[Tensor, Tensor]:
    """(rows of each type (int64), the rows sorted by type, stably (int32)) of rows typed ``index`` (each in
    [0, types), or past the last type for rows to leave uncounted: sorted last): a segment GEMM's layout, in
    one call. The counts come from the sorted types (:func:`sorted_counts`), not from a count of their own."""
    values, order = sort_keys(index, types + 1)
    return sorted_counts(values, types), order.to(torch.int32)


_compiled: dict[str, Any] = {}  # function name -> its TorchScript function, or the function where none compiled


def scripted(fn: Any) -> Any:
    """``fn`` compiled by TorchScript (once per process), or ``fn`` itself where it cannot be (same results)."""
    return script_once(fn, _compiled, fn, log, f"hector's graph preparation ({fn.__name__})")


# the switch behind torch.jit.optimized_execution, read and set directly: a context manager is a dozen Python
# calls, and a new graph makes two or three of these calls
_get_optimize = getattr(torch._C, "_get_graph_executor_optimize", None)
_set_optimize = getattr(torch._C, "_set_graph_executor_optimize", None)


def run(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` through its TorchScript function, with TorchScript's plain interpreter (no profiling or
    fusion: graphs differ in every size, and optimising for one would be wasted on the next)."""
    script = _compiled.get(fn.__name__)
    if script is None:
        script = scripted(fn)
    if _get_optimize is None or _set_optimize is None:
        with torch.jit.optimized_execution(False):
            return script(*args)
    previous = _get_optimize()
    _set_optimize(False)
    try:
        return script(*args)
    finally:
        _set_optimize(previous)


__all__ = ["by_relation", "check_and_pair", "destination_layout", "heaviest_first", "marks_pairs", "pairs_by_marks",
           "pairs_by_sort", "run", "scripted", "sort_keys", "sorted_counts", "type_layout", "unique_pairs"]
