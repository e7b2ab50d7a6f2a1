"""A graph's whole batch of neighbour sampling in one call that runs without the GIL: a homogeneous graph's (typed
edges included), and a heterogeneous graph's, with a fan-out per edge type.

Torch operations called from Python hold the GIL from one to the next: a sampler making ~100 of them per batch in
a loader thread takes turns with the training thread at the interpreter's switch interval, and each slows the
other. The same operations as one TorchScript function run in C++ after a single release of the GIL (their host
round trips included), beside a training thread that keeps it. Where TorchScript cannot compile the function (a
torch without it), the same function runs as Python, with the same results.

The method (see ``_sample.py``): per hop a random key per in-edge of the frontier and one sort, new nodes numbered
in ascending id through the id map ``local``, on the device (:func:`number_new`).
"""

import logging

import torch
from torch import Tensor

from ._shared_cuda import script_once

log = logging.getLogger("pytorch_direct")


def sample_homogeneous(colptr: Tensor, row: Tensor, local: Tensor, seeds: Tensor, sentinel: Tensor,
                       fanouts: list[int], replace: bool, generator: torch.Generator | None,
                       edge_id: Tensor | None, edge_type: Tensor | None, node_type: Tensor | None
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None, Tensor | None, list[int],
                                  list[int]]:
    """(n_id, edge_index, e_id, CSC positions, edge_type, node_type, nodes per hop, edges per hop) around ``seeds``
    (in range, checked; a repeated seed is a seed per occurrence, see :func:`first_occurrence`). ``local``: the id
    map, one entry per node and a scratch entry at ``num_nodes`` (-1 everywhere, and again on return);
    ``sentinel``: [num_nodes] in the row's dtype; ``colptr`` has a slot per node.

    One host round trip per hop (its edge counts) and one at the end. A hop's new nodes are not counted on the
    host before the next hop: at most one per sampled edge, they lie in a buffer of the hop's edge count, in
    ascending id, followed by nodes past the last (no in-edges, so the next hop draws nothing from them); their
    count is read with the next hop's edge counts, or at the end."""
    device = seeds.device
    batch = seeds.numel()
    slots = colptr.numel() - 1
    first_occurrence(local, seeds)
    srcs: list[Tensor] = []
    dsts: list[Tensor] = []
    poss: list[Tensor] = []
    found: list[Tensor] = []  # per hop: its new nodes, then padding
    num_nodes: list[int] = [batch]
    num_edges: list[int] = []
    frontier = seeds
    frontier_start = 0  # local id of the frontier's first node
    # the last hop's (new-node ranks, sorted unseen sources), their last entries tell its new-node count
    last: list[Tensor] = []
    for hop, fanout in enumerate(fanouts):
        # the frontier is layer `hop` of the batch (the seeds, then each hop's new nodes), whose node count the
        # host learns in this hop's round trip
        if frontier.numel() == 0:  # the last hop sampled no edge, so found no node
            num_nodes.append(0)
            pos = torch.empty(0, dtype=torch.long, device=device)
            dst = pos
        else:
            begin = colptr[frontier]
            following = frontier + 1
            if hop > 0:  # past the last node: no in-edges
                following = following.clamp(max=slots)
            degree = colptr[following] - begin
            if fanout < 0:
                take = degree
            elif replace:
                take = (degree > 0).long() * fanout
            else:
                take = degree.clamp(max=fanout)
            cum_degree = degree.cumsum(0)
            cum_take = take.cumsum(0)
            # the hop's one host round trip: its edge counts (and the last hop's new-node count)
            sizes: list[int] = torch.cat([cum_degree[-1:], cum_take[-1:]] + last).tolist()
            in_edges, taken = sizes[0], sizes[1]
            if hop > 0:
                num_nodes.append(new_count(sizes[2], sizes[3], slots))
            owner = torch.repeat_interleave(take, output_size=taken)  # the frontier node of each sampled edge
            dst = owner + frontier_start
            if fanout < 0 or taken == 0 or (in_edges == taken and not replace):
                # every in-edge is taken, or none (a fan-out of 0): nothing to draw
                # (the j-th taken edge of a node is its j-th in-edge)
                pos = torch.arange(taken, device=device) + (begin - (cum_take - take))[owner]
            elif replace:
                u = torch.rand(taken, dtype=torch.float64, device=device, generator=generator)
                d = degree[owner]
                pos = begin[owner] + torch.minimum((u * d).long(), d - 1)
            else:
                # keys of node i lie in [i, i + 1): sorted, each node's in-edges stay together in a random order,
                # and their first min(degree, fanout) are a uniform sample without replacement
                key = torch.rand(in_edges, dtype=torch.float64, device=device, generator=generator)
                key += torch.repeat_interleave(degree, output_size=in_edges)
                order = torch.argsort(key)
                first_in = cum_degree - degree  # each node's first in-edge among the frontier's
                # the j-th taken edge of a node is the j-th of its in-edges in key order: order[first_in + j]
                pick = torch.arange(taken, device=device) + (first_in - (cum_take - take))[owner]
                pos = order[pick] + (begin - first_in)[owner]
        total = frontier_start + num_nodes[-1]  # the local id of this hop's first new node
        src = row[pos]
        new, last = number_new(local, src, sentinel, total, slots)
        srcs.append(local[src])
        dsts.append(dst)
        poss.append(pos)
        found.append(new)
        num_edges.append(pos.numel())
        frontier = new
        frontier_start = total
    if len(fanouts) > 0:  # the last hop's new-node count: one more host round trip
        if frontier.numel() == 0:
            num_nodes.append(0)
        else:
            ends: list[int] = torch.cat(last).long().tolist()
            num_nodes.append(new_count(ends[0], ends[1], slots))
    nodes: list[Tensor] = [seeds]
    for hop in range(len(found)):
        nodes.append(found[hop][: num_nodes[hop + 1]])
    n_id = torch.cat(nodes)  # (int64: the seeds are)
    local.index_fill_(0, n_id, -1)
    local[-1:].fill_(-1)  # the scratch entry
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


def first_occurrence(local: Tensor, seeds: Tensor) -> None:
    """Gives each seed's entry of the id map ``local`` (-1 there) its place in ``seeds``, the first place where a
    seed repeats. Every occurrence stays a frontier node of the first hop and draws its own in-edges (as PyG's
    samplers do); edges from a repeated seed point at its first occurrence. (``local[seeds] = arange`` would leave
    the place a repeated seed gets to the order of the writes, which on a GPU is not defined.)"""
    places = torch.arange(seeds.numel(), dtype=torch.int32, device=seeds.device)
    local.scatter_reduce_(0, seeds, places, "amin", include_self=False)


def number_new(local: Tensor, src: Tensor, sentinel: Tensor, total: int, pad: int) -> tuple[Tensor, list[Tensor]]:
    """Gives the sources ``src`` of a hop's edges that are not in the batch yet (-1 in the id map ``local``) the next
    local ids, ``total``, ``total + 1``, ... in ascending global id, without a host round trip. Returns (a buffer of
    ``src.numel()`` entries: the new nodes in ascending id, then ``pad``, the sentinel's value; the tensors whose
    last entries give the new-node count, see :func:`new_count`).

    The unseen sources are sorted (the seen ones become the sentinel, larger than every node id); a value's rank is
    its 1-based place among the distinct values, the same for every repeat of a node, so that the writes of a
    node's repeats all write the same value. The sentinel, if present, comes last: it writes the id map's scratch
    entry (at the sentinel's value; reset after the batch) and the buffer's last real place, with ``pad``."""
    unseen = torch.sort(torch.where(local[src] < 0, src, sentinel)).values
    step = torch.ones(unseen.numel(), dtype=torch.int32, device=src.device)
    step[1:] = unseen[1:] != unseen[:-1]
    rank = torch.cumsum(step, 0, dtype=torch.int32)
    local[unseen] = rank + (total - 1)
    new = torch.full((unseen.numel() + 1,), pad, dtype=unseen.dtype, device=src.device)  # (place 0: scratch)
    new[rank] = unseen
    return new[1:], [rank[-1:], unseen[-1:]]


def new_count(last_rank: int, last_value: int, sentinel: int) -> int:
    """A hop's new nodes: the distinct values of its sorted unseen sources (``last_rank``, the last one's rank),
    less the sentinel if it is among them (then it is the last value)."""
    return last_rank - 1 if last_value == sentinel else last_rank


def sample_typed(colptr: Tensor, row: Tensor, edge_type: Tensor, local: Tensor, seeds: Tensor, sentinel: Tensor,
                 fanouts: Tensor, replace: bool, generator: torch.Generator | None, edge_id: Tensor | None
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, list[int], list[int]]:
    """A heterogeneous graph's batch: (n_id, edge_index, e_id, CSC positions, edge types, nodes per hop, edges per
    hop). The topology is one CSC over every node (``colptr`` has a slot per node, the padding included past the
    last), each node's in-edges grouped by edge type, ``edge_type`` giving each edge's; ``fanouts``: [hops, edge
    types] (-1: all); ``local`` and ``sentinel`` as for :func:`sample_homogeneous`.

    Per hop, the frontier's in-edges fall into runs of one (node, edge type); a random key per in-edge, one sort,
    and the first min(run length, fan-out of its type) of each run are a uniform sample without replacement. The
    work is that of the frontier's in-edges, whatever the number of edge types (none is looked at for a node
    without such in-edges). Two host round trips per hop (the in-edge count, with the last hop's new-node count;
    the sampled count), three with ``replace``, and one at the end."""
    device = seeds.device
    batch = seeds.numel()
    slots = colptr.numel() - 1
    first_occurrence(local, seeds)
    srcs: list[Tensor] = []
    dsts: list[Tensor] = []
    poss: list[Tensor] = []
    kinds: list[Tensor] = []
    found: list[Tensor] = []
    num_nodes: list[int] = [batch]
    num_edges: list[int] = []
    frontier = seeds
    frontier_start = 0
    last: list[Tensor] = []
    for hop in range(fanouts.size(0)):
        empty = torch.empty(0, dtype=torch.long, device=device)
        pos, dst, kind = empty, empty, empty
        if frontier.numel() == 0:
            num_nodes.append(0)
        else:
            begin = colptr[frontier]
            following = frontier + 1
            if hop > 0:  # past the last node: no in-edges
                following = following.clamp(max=slots)
            degree = colptr[following] - begin
            cum_degree = degree.cumsum(0)
            sizes: list[int] = torch.cat([cum_degree[-1:]] + last).tolist()  # a host round trip
            in_edges = sizes[0]
            if hop > 0:
                num_nodes.append(new_count(sizes[1], sizes[2], slots))
            if in_edges > 0:
                owner = torch.repeat_interleave(degree, output_size=in_edges)  # the frontier node of each in-edge
                every = torch.arange(in_edges, device=device)
                at = every + (begin - (cum_degree - degree))[owner]  # its CSC position
                types = edge_type[at].long()
                fan = fanouts[hop][types]
                # runs of one (node, edge type): a node's in-edges are grouped by type
                starts = torch.ones(in_edges, dtype=torch.bool, device=device)
                starts[1:] = (owner[1:] != owner[:-1]) | (types[1:] != types[:-1])
                # A hop that draws from no run (fan-outs of 0, or -1, or every run taken whole) draws no random
                # numbers, as the homogeneous path: the random stream of the batches after it does not depend on it.
                if replace:
                    first = starts.nonzero().squeeze(1)  # a host round trip (its size)
                    length = torch.cat([first[1:], torch.full((1,), in_edges, dtype=torch.long,
                                                              device=device)]) - first
                    run_fan = fan[first]
                    take = torch.where(run_fan < 0, length, run_fan)
                    cum_take = take.cumsum(0)
                    # a host round trip: the edges taken, and those drawn (not from runs taken whole)
                    taken: list[int] = torch.cat([cum_take[-1:], (take * (run_fan >= 0)).sum().view(1)]).tolist()
                    run = torch.repeat_interleave(take, output_size=taken[0])
                    j = torch.arange(taken[0], device=device) - (cum_take - take)[run]
                    if taken[1] == 0:
                        picked = first[run] + j
                    else:
                        u = torch.rand(taken[0], dtype=torch.float64, device=device, generator=generator)
                        size = length[run]
                        drawn = torch.minimum((u * size).long(), size - 1)
                        picked = first[run] + torch.where(run_fan[run] < 0, j, drawn)
                else:
                    # (a run occupies the same positions before and after the sort below)
                    run_first = torch.where(starts, every, 0).cummax(0).values
                    keep = ((every - run_first) < fan) | (fan < 0)
                    kept = keep.nonzero().squeeze(1)  # a host round trip (its size)
                    if kept.numel() == 0 or kept.numel() == in_edges:  # none taken, or every run whole
                        picked = kept
                    else:
                        # keys of run r lie in [r, r + 1): sorted, each run's in-edges stay together in a random
                        # order, and the first min(run length, fan-out) of each are a uniform sample
                        run_id = torch.cumsum(starts, 0) - 1
                        key = torch.rand(in_edges, dtype=torch.float64, device=device, generator=generator)
                        key += run_id
                        order = torch.argsort(key)
                        picked = order[kept]
                pos = at[picked]
                dst = owner[picked] + frontier_start
                kind = types[picked]
        total = frontier_start + num_nodes[-1]  # the local id of this hop's first new node
        src = row[pos]
        new, last = number_new(local, src, sentinel, total, slots)
        srcs.append(local[src])
        dsts.append(dst)
        poss.append(pos)
        kinds.append(kind)
        found.append(new)
        num_edges.append(pos.numel())
        frontier = new
        frontier_start = total
    if fanouts.size(0) > 0:  # the last hop's new-node count: one more host round trip
        if frontier.numel() == 0:
            num_nodes.append(0)
        else:
            ends: list[int] = torch.cat(last).long().tolist()
            num_nodes.append(new_count(ends[0], ends[1], slots))
    nodes: list[Tensor] = [seeds]
    for hop in range(len(found)):
        nodes.append(found[hop][: num_nodes[hop + 1]])
    n_id = torch.cat(nodes)
    local.index_fill_(0, n_id, -1)
    local[-1:].fill_(-1)  # the scratch entry
    pos = torch.cat(poss)
    edge_index = torch.stack([torch.cat(srcs).long(), torch.cat(dsts)])
    e_id = pos
    if edge_id is not None:
        e_id = edge_id[pos].long()
    return n_id, edge_index, e_id, pos, torch.cat(kinds), num_nodes, num_edges


_compiled: dict = {}  # function name -> its TorchScript function, or None where it did not compile


def scripted(fn=None):
    """``fn`` (default :func:`sample_homogeneous`) compiled by TorchScript (once per process), or None where it
    cannot be."""
    fn = sample_homogeneous if fn is None else fn
    return script_once(fn, _compiled, None, log, "pytorch-direct's sampler")


def run(fn, *args):
    """``fn(*args)`` with TorchScript's plain interpreter (no profiling or fusion: batches differ in every size,
    and optimising for one would be wasted on the next)."""
    # (torch.jit.optimized_execution(False), without its context manager's Python calls on every batch)
    optimize = torch._C._get_graph_executor_optimize()
    if not optimize:
        return fn(*args)
    torch._C._set_graph_executor_optimize(False)
    try:
        return fn(*args)
    finally:
        torch._C._set_graph_executor_optimize(True)
