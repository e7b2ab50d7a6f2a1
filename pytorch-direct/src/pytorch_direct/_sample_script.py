"""A homogeneous graph's whole batch of neighbour sampling in one call that runs without the GIL.

Torch operations called from Python hold the GIL from one to the next: a sampler making ~100 of them per batch in
a loader thread takes turns with the training thread at the interpreter's switch interval, and each slows the
other. The same operations as one TorchScript function run in C++ after a single release of the GIL (their host
round trips included), beside a training thread that keeps it. Where TorchScript cannot compile the function (a
torch without it), the same function runs as Python, with the same results.

The function is the sampler's homogeneous path (see ``_sample.py`` for the method): per hop a random key per
in-edge of the frontier and one sort, new nodes numbered in ascending id through the id map ``local``.
"""

import logging
import threading
import warnings

import torch
from torch import Tensor

log = logging.getLogger("pytorch_direct")


def sample_homogeneous(colptr: Tensor, row: Tensor, local: Tensor, seeds: Tensor, sentinel: Tensor,
                       fanouts: list[int], replace: bool, generator: torch.Generator | None,
                       edge_id: Tensor | None, edge_type: Tensor | None, node_type: Tensor | None
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None, Tensor | None, list[int],
                                  list[int]]:
    """(n_id, edge_index, e_id, CSC positions, edge_type, node_type, nodes per hop, edges per hop) around ``seeds``
    (distinct, checked). ``local``: the id map (-1 everywhere, and again on return); ``sentinel``: [num_nodes] in
    the row's dtype. Two host round trips per hop: the hop's edge counts and its new nodes (unique)."""
    device = seeds.device
    batch = seeds.numel()
    local[seeds] = torch.arange(batch, dtype=torch.int32, device=device)
    nodes: list[Tensor] = [seeds]
    srcs: list[Tensor] = []
    dsts: list[Tensor] = []
    poss: list[Tensor] = []
    num_nodes: list[int] = [batch]
    num_edges: list[int] = []
    frontier = seeds
    frontier_start = 0
    total = batch
    for fanout in fanouts:
        if frontier.numel() == 0:
            pos = torch.empty(0, dtype=torch.long, device=device)
            dst = pos
        else:
            begin = colptr[frontier]
            degree = colptr[frontier + 1] - begin
            if fanout < 0:
                take = degree
            elif replace:
                take = (degree > 0).long() * fanout
            else:
                take = degree.clamp(max=fanout)
            cum_degree = degree.cumsum(0)
            cum_take = take.cumsum(0)
            sizes: list[int] = torch.stack([cum_degree[-1], cum_take[-1]]).tolist()  # a host round trip
            in_edges, taken = sizes[0], sizes[1]
            owner = torch.repeat_interleave(take, output_size=taken)  # the frontier node of each sampled edge
            dst = owner + frontier_start
            begin_taken = begin[owner]
            j = torch.arange(taken, device=device) - (cum_take - take)[owner]  # its rank among that node's
            if fanout < 0 or (in_edges == taken and not replace):  # every in-edge is taken: nothing to draw
                pos = begin_taken + j
            elif replace:
                u = torch.rand(taken, dtype=torch.float64, device=device, generator=generator)
                d = degree[owner]
                pos = begin_taken + torch.minimum((u * d).long(), d - 1)
            else:
                # keys of node i lie in [i, i + 1): sorted, each node's in-edges stay together in a random order,
                # and their first min(degree, fanout) are a uniform sample without replacement
                key = torch.rand(in_edges, dtype=torch.float64, device=device, generator=generator)
                key += torch.repeat_interleave(degree, output_size=in_edges)
                order = torch.argsort(key)
                start = (cum_degree - degree)[owner]
                pos = begin_taken + order[start + j] - start
        src = row[pos]
        seen = local[src]
        # the sources not in the batch yet, sorted; the seen ones become the sentinel num_nodes, added once more so
        # that it is always the last value and is dropped without asking whether it occurred
        new = torch.unique(torch.cat([torch.where(seen < 0, src, sentinel), sentinel]))[:-1]  # a host round trip
        count = new.numel()
        if count > 0:
            local[new] = torch.arange(total, total + count, dtype=torch.int32, device=device)
            seen = local[src]
        srcs.append(seen)
        dsts.append(dst)
        poss.append(pos)
        nodes.append(new)
        num_nodes.append(count)
        num_edges.append(pos.numel())
        frontier = new
        frontier_start = total
        total += count
    n_id = torch.cat(nodes)  # (int64: the seeds are)
    local.index_fill_(0, n_id, -1)
    pos = torch.cat(poss)
    edge_index = torch.stack([torch.cat(srcs).long(), torch.cat(dsts)])
    e_id = pos
    if edge_id is not None:
        e_id = edge_id[pos].long()
    types: Tensor | None = None
    if edge_type is not None:
        types = edge_type[pos].long()
    kinds: Tensor | None = None
    if node_type is not None:
        kinds = node_type[n_id].long()
    return n_id, edge_index, e_id, pos, types, kinds, num_nodes, num_edges


_lock = threading.Lock()
_compiled: list = []  # [the TorchScript function, or None where it did not compile]


def scripted():
    """:func:`sample_homogeneous` compiled by TorchScript (once per process), or None where it cannot be."""
    with _lock:
        if not _compiled:
            try:
                with warnings.catch_warnings():
                    # TorchScript is deprecated for models; for a function of plain torch ops it is the one way
                    # to run them after a single release of the GIL
                    warnings.simplefilter("ignore", DeprecationWarning)
                    _compiled.append(torch.jit.script(sample_homogeneous))
            except Exception as exc:  # a torch without TorchScript, or one that no longer compiles this
                log.warning("pytorch-direct: the sampler's TorchScript function did not compile (%s: %s); it runs "
                            "as Python, holding the GIL for each operation", type(exc).__name__, exc)
                _compiled.append(None)
        return _compiled[0]


def run(fn, *args):
    """``fn(*args)`` with TorchScript's plain interpreter (no profiling or fusion: batches differ in every size,
    and optimising for one would be wasted on the next)."""
    with torch.jit.optimized_execution(False):
        return fn(*args)
