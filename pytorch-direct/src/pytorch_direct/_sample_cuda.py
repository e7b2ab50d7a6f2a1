"""A batch of neighbour sampling on a GPU with the package's own kernels (``sample_cuda.cu``): per hop four kernels, two
sums and one host round trip, instead of the dozens of small tensor operations per hop of the TorchScript path
(``_sample_script.sample_homogeneous`` and ``sample_typed``, the reference, whose results this path matches in every
guarantee but the random draws themselves).

A hop: (1) each frontier node's take count, min(degree, fan-out) (all with -1, the fan-out with ``replace``), and a
sum over them; (2) the one host round trip: the hop's edge count, the last hop's new-node count and the kernels'
error pair; (3) per frontier node one thread draws its in-edges (distinct without replacement: Floyd's algorithm,
or reservoir sampling where that reads less) with a counter-based hash seeded once per batch from the torch
generator, writing each edge's CSC position, source and destination local id, and setting a bit per source not in
the batch yet; (4) a popcount per 32 nodes and its sum give every new source its rank in ascending id, which
numbers it through the id map ``local`` (no sort). A hop's new nodes are its next frontier, in a buffer of the
hop's edge count whose valid length the kernels read on the device, so the host learns it in the next round trip.
With a fan-out per edge type (a heterogeneous graph, each node's in-edges grouped by type), a node's thread counts and
draws per run of one edge type, with that type's fan-out.

A batch is one call into the compiled core (``sample_batch_cuda``), which runs every hop's launches, sums and host
reads without the Python interpreter lock, so a loader thread leaves the interpreter to the training thread while it
samples. Its buffers are sized by bounds known without a host round trip (a hop's edges: at most its frontier times
the fan-out, and at most the graph's edges); where a bound is unknown (fan-out -1) or larger than the sampler's edge
capacity, the capacity is used, and a batch that needs more stops before drawing past it and runs again, with the
same random seed, on a capacity grown to twice what it needed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _core

# element codes of the kernels' integer arrays (sample.hpp's int_code)
_INT_CODES = {torch.int64: 8, torch.int32: 4, torch.int16: 2, torch.int8: 1, torch.uint8: -1}
# sample.hpp's sample_error kinds
_NODE_OUT_OF_RANGE, _BAD_COLPTR, _ROW_OUT_OF_RANGE, _BAD_EDGE_TYPE = 1, 2, 3, 4
# sample.hpp's sample_batch_status
_DONE, _ERROR, _OVERFLOW = 0, 1, 2
# the edges (over all hops) a sampler's buffers hold at first where a batch's bound is larger or unknown: 1M edges
# (its workspace and a batch's outputs about 32 MB each); grown where a batch needs more
EDGE_CAPACITY = 1 << 20


def _gather(values: Tensor, index: Tensor) -> Tensor:
    """values[index] as int64 (one torch operation where values are int64 already)."""
    out = values[index]
    return out if out.dtype == torch.long else out.long()


def _native_batch(core, *args) -> list[int]:
    """The one call of a batch (its own function so that profiles tell its time, spent without the interpreter
    lock, from the Python around it)."""
    return core.sample_batch_cuda(*args)


def unsupported(topology, device: torch.device, blocks) -> str | None:
    """Why the kernels cannot sample this graph on ``device`` (None: they can)."""
    if device.type != "cuda":
        return f"sampling runs on {device}, and the kernels run on a CUDA device"
    if not _core.kernels_compiled():
        return "pytorch_direct was built without CUDA kernels (reinstall with nvcc available)"
    for name in ("colptr", "row") + (("edge_type",) if blocks is not None else ()):
        t = getattr(topology, name)
        if t.dtype not in _INT_CODES:
            return f"topology.{name} has dtype {t.dtype}; the kernels read int8/16/32/64 or uint8"
        if not t.is_contiguous():
            return f"topology.{name} is not contiguous"
    if topology.num_nodes >= 2**31:
        return f"the graph has {topology.num_nodes} nodes; local ids are int32 (at most 2^31 - 1 nodes)"
    return None


class KernelSampler:
    """The kernels' state for one sampler (one batch at a time, as the sampler's id map): the bitmap of new sources
    (one bit per node, zero between hops), its popcounts, and the kernels' error pair. Called with the arguments of
    ``_sample_script.sample_homogeneous`` (whose ``colptr`` and ``row`` must be this sampler's topology's), it
    returns the same tuple; with ``fanout_table`` ([hops, edge types] on the device: a heterogeneous graph's fan-outs
    per edge type, the topology's in-edges of a node grouped by ``edge_type``), those of
    ``_sample_script.sample_typed``."""

    def __init__(self, topology, device: torch.device, fanout_table: Tensor | None = None) -> None:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.device_index = device.index if device.type == "cuda" else -1
        self.colptr = topology.colptr
        self.row = topology.row
        self.num_nodes = int(topology.num_nodes)
        self.num_edges = int(topology.row.numel())
        self.fanout_table = fanout_table
        typed = fanout_table is not None
        self.num_types = int(fanout_table.size(1)) if typed else 0
        edge_type = topology.edge_type if typed else None
        # (a unified tensor's pointer is its host address, which the GPU reads under unified addressing)
        self.graph = (self.colptr.data_ptr(), _INT_CODES[self.colptr.dtype], self.row.data_ptr(),
                      _INT_CODES[self.row.dtype], self.num_nodes, self.num_edges,
                      edge_type.data_ptr() if typed else 0, _INT_CODES[edge_type.dtype] if typed else 8,
                      self.num_types)
        self.words = (self.num_nodes + 31) // 32
        self.unseen = torch.zeros(max(self.words, 1), dtype=torch.int32, device=device)
        self.counts = torch.empty(max(self.words, 1), dtype=torch.int32, device=device)
        self.error = torch.zeros(2, dtype=torch.long, device=device)
        # the kernels' entry points: the compiled module (tests put the kernels run on the CPU in its place)
        self.core = _core
        # a batch in one call (False: per hop from Python, the launches and sums one by one)
        self.one_call = True
        # the per-node draws of each hop at most (None: unbounded, a fan-out of -1), for the buffers' bounds
        rows = fanout_table.tolist() if typed else None
        self.typed_fanouts = [0] * len(rows) if typed else []  # (the per-hop fan-out argument: the table's instead)
        self.hop_bounds = None if rows is None else [None if min(row, default=0) < 0 else sum(row) for row in rows]
        self.edge_capacity = EDGE_CAPACITY
        self.bounds: dict[tuple, int] = {}  # (batch size, replace, fan-outs): _edge_bound's, as batches repeat them
        self.workspace = torch.empty(0, dtype=torch.uint8, device=device)
        self.workspace_caps = (-1, -1)  # (slots, edges) it was sized for
        self.workspace_bytes = 0
        self.last_stream: int | None = None  # the stream of the last batch (its reset of the id map may be pending)
        # the counts read per hop (pinned, so that the copies into it are asynchronous)
        self.host = torch.zeros(4, dtype=torch.long, pin_memory=device.type == "cuda")

    def __call__(self, colptr: Tensor, row: Tensor, *args):
        if colptr is not self.colptr or row is not self.row:
            raise ValueError("the kernel sampler was made for another topology: make a NeighborSampler per topology")
        try:
            if self.fanout_table is None:
                local, seeds, _, fanouts, replace, generator, edge_id, edge_type, node_type = args
                return self._sample(local, seeds, fanouts, replace, generator, edge_id, edge_type, node_type)
            # (sample_typed's arguments: the fan-out table is this sampler's)
            edge_type, local, seeds, _, _, replace, generator, edge_id = args
            n_id, edge_index, e_id, pos, types, _, num_nodes, num_edges = self._sample(
                local, seeds, self.typed_fanouts, replace, generator, edge_id, edge_type, None)
            return n_id, edge_index, e_id, pos, types, num_nodes, num_edges
        except BaseException:
            # (which id-map entries and bits the batch set is not known here)
            self.unseen.zero_()
            self.error.zero_()
            local.fill_(-1)
            raise

    def _check(self, kind: int, value: int) -> None:
        if kind == _NODE_OUT_OF_RANGE:
            raise IndexError(f"node id {value} is outside [0, {self.num_nodes}): a seed, or a source in "
                             f"topology.row, is out of range")
        if kind == _BAD_COLPTR:
            raise ValueError(f"topology.colptr is not a CSC offset array at node {value}: colptr[{value}] and "
                             f"colptr[{value} + 1] must satisfy 0 <= colptr[v] <= colptr[v + 1] <= "
                             f"{self.num_edges} (the number of edges)")
        if kind == _BAD_EDGE_TYPE:
            raise ValueError(f"topology.edge_type[{value}] is outside [0, {self.num_types}): every edge's type must "
                             f"index the fan-out table's edge types")
        if kind == _ROW_OUT_OF_RANGE:
            raise ValueError(f"topology.row[{value}] holds a node id outside [0, {self.num_nodes}): every source "
                             f"must be a node of the graph")
        if kind != 0:
            raise RuntimeError(f"the sampler kernels reported an unknown error {kind} ({value})")

    def _edge_bound(self, batch: int, fanouts: list[int], replace: bool) -> int:
        """The batch's edges over all hops at most (from its size and the fan-outs; no host round trip), capped by
        the sampler's edge capacity. For distinct seeds; repeated seeds (each occurrence draws its own in-edges)
        can need more, and such a batch stops and runs again on more (see ``_sample``)."""
        total = 0
        frontier = batch
        for hop, fanout in enumerate(fanouts):
            per_node = fanout if self.hop_bounds is None else self.hop_bounds[hop]
            if per_node is not None and per_node < 0:
                per_node = None
            # (a frontier of distinct nodes draws every edge at most once without replacement; past the seeds the
            # frontier always is one)
            edges = self.num_edges if per_node is None else frontier * per_node
            if not replace or per_node is None:
                edges = min(edges, self.num_edges)
            total += edges
            if total >= self.edge_capacity:
                return self.edge_capacity
            frontier = min(edges, self.num_nodes)
        return total

    def _sample(self, local: Tensor, seeds: Tensor, fanouts: list[int], replace: bool,
                generator: torch.Generator | None, edge_id: Tensor | None, edge_type: Tensor | None,
                node_type: Tensor | None):
        if not self.one_call:
            return self._sample_per_hop(local, seeds, fanouts, replace, generator, edge_id, edge_type, node_type)
        device = self.device
        # (torch's raw getter: the sampler's device has its index, made at the sampler's start)
        stream = torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else 0
        if stream != self.last_stream and self.last_stream is not None and device.type == "cuda":
            # (the last batch's id map reset may still run on its stream, and this batch's work would race it)
            torch.cuda.ExternalStream(self.last_stream, device=device).synchronize()
        self.last_stream = stream
        # the batch's random stream, from the torch generator (stays on the device: no host round trip)
        seed = torch.randint(0, 2**62, (1,), dtype=torch.long, device=device, generator=generator)
        seeds = seeds.contiguous()
        batch = seeds.numel()
        hops = len(fanouts)
        table = 0 if self.fanout_table is None else self.fanout_table.data_ptr()
        while True:
            key = (batch, replace, *fanouts)
            cap = self.bounds.get(key)
            if cap is None:
                cap = self.bounds[key] = self._edge_bound(batch, fanouts, replace)
            slots = max(batch, cap)
            if slots > self.workspace_caps[0] or cap > self.workspace_caps[1]:
                caps = (max(slots, self.workspace_caps[0]), max(cap, self.workspace_caps[1]))
                self.workspace = torch.empty(self.core.sample_batch_workspace_bytes(caps[0], caps[1], self.words),
                                             dtype=torch.uint8, device=device)
                self.workspace_caps = caps
                self.workspace_bytes = self.workspace.numel()
            node_cap = batch + cap
            out = torch.empty(node_cap + 3 * cap, dtype=torch.long, device=device)
            res = _native_batch(
                self.core, *self.graph, seeds.data_ptr(), batch, fanouts, table, replace, seed.data_ptr(),
                local.data_ptr(), self.unseen.data_ptr(), self.words, self.error.data_ptr(),
                self.workspace.data_ptr(), self.workspace_bytes, self.workspace_caps[0], cap,
                self.host.data_ptr(), out.data_ptr(), node_cap, self.device_index, stream)
            if res[0] != _OVERFLOW:
                break
            # (the call reset the id map; the run again draws the same edges, from the same seed)
            self.edge_capacity = max(self.edge_capacity, 2 * res[3])
            self.bounds.clear()
            # a bound from the sizes can be short where seeds repeat: this key gets at least twice what the stopped
            # run needed, or it would stop at the same place again
            self.bounds[key] = max(self._edge_bound(batch, fanouts, replace), 2 * res[3])
        if res[0] != _DONE:
            self._check(res[1], res[2])
            raise RuntimeError(f"the sampler's batch call ended with status {res[0]}")
        num_nodes = res[4: 5 + hops]
        num_edges = res[5 + hops:]
        nodes = sum(num_nodes)
        edges = sum(num_edges)
        # (views of the batch's own buffer: the next batch writes into a new one)
        n_id = out.narrow(0, 0, nodes)
        pos = out.narrow(0, node_cap, edges)
        edge_index = out.as_strided((2, edges), (edges, 1), node_cap + cap)
        return (n_id, edge_index, pos if edge_id is None else _gather(edge_id, pos), pos,
                None if edge_type is None else _gather(edge_type, pos),
                None if node_type is None else _gather(node_type, n_id), num_nodes, num_edges)

    def _sample_per_hop(self, local: Tensor, seeds: Tensor, fanouts: list[int], replace: bool,
                        generator: torch.Generator | None, edge_id: Tensor | None, edge_type: Tensor | None,
                        node_type: Tensor | None):
        device = self.device
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        core = self.core
        graph = self.graph
        table = self.fanout_table
        # the batch's random stream, from the torch generator (stays on the device: no host round trip)
        seed = torch.randint(0, 2**62, (1,), dtype=torch.long, device=device, generator=generator)
        seeds = seeds.contiguous()
        batch = seeds.numel()
        local_ptr = local.data_ptr()
        unseen_ptr = self.unseen.data_ptr()
        error_ptr = self.error.data_ptr()
        empty = torch.empty(0, dtype=torch.long, device=device)
        num_nodes = [batch]
        num_edges: list[int] = []
        found: list[Tensor] = []  # per hop: its new nodes, then unused slots
        srcs: list[Tensor] = []
        dsts: list[Tensor] = []
        poss: list[Tensor] = []
        frontier = seeds
        slots = batch  # the frontier buffer's length
        pending: Tensor | None = None  # the last hop's new-node count on the device (None: it drew no edge)
        start = 0  # the local id of the frontier's first node
        for hop, fanout in enumerate(fanouts):
            if hop > 0 and pending is None:  # the last hop drew no edge, so found no node
                num_nodes.append(0)
                num_edges.append(0)
                found.append(empty)
                srcs.append(empty)
                dsts.append(empty)
                poss.append(empty)
                continue
            take = torch.empty(slots, dtype=torch.long, device=device)
            valid = 0 if pending is None else pending.data_ptr()
            # typed: this hop's row of the fan-out table ([hops, edge types] int64, contiguous)
            fan_row = 0 if table is None else table.data_ptr() + hop * self.num_types * 8
            core.sample_take_cuda(*graph, frontier.data_ptr(), slots, valid, fanout, fan_row, replace,
                                   local_ptr if hop == 0 else 0, take.data_ptr(), error_ptr, stream)
            cum = torch.cumsum(take, 0)
            # the hop's one host round trip: its edge count, the kernels' errors, the last hop's new-node count
            parts = [cum[-1:], self.error] if pending is None else [cum[-1:], self.error, pending]
            sizes: list[int] = torch.cat(parts).tolist()
            self._check(sizes[1], sizes[2])
            taken = sizes[0]
            if hop > 0:
                num_nodes.append(sizes[3])
                start += num_nodes[-2]
            first_new = start + num_nodes[-1]  # the local id of this hop's first new node
            if taken == 0:
                pending = None
                num_edges.append(0)
                found.append(empty)
                srcs.append(empty)
                dsts.append(empty)
                poss.append(empty)
                continue
            pos = torch.empty(taken, dtype=torch.long, device=device)
            src = torch.empty(taken, dtype=torch.long, device=device)
            dst = torch.empty(taken, dtype=torch.long, device=device)
            core.sample_edges_cuda(*graph, frontier.data_ptr(), slots, cum.data_ptr(), fanout, fan_row, replace,
                                    seed.data_ptr(), hop, local_ptr, unseen_ptr, start, pos.data_ptr(),
                                    src.data_ptr(), dst.data_ptr(), error_ptr, stream)
            core.sample_popcount_cuda(unseen_ptr, self.words, self.counts.data_ptr(), stream)
            prefix = torch.cumsum(self.counts, 0, dtype=torch.long)
            new = torch.empty(taken, dtype=torch.long, device=device)
            src_local = torch.empty(taken, dtype=torch.long, device=device)
            core.sample_number_cuda(src.data_ptr(), taken, unseen_ptr, prefix.data_ptr(), local_ptr, first_new,
                                     new.data_ptr(), src_local.data_ptr(), stream)
            self.unseen.zero_()
            pending = prefix[-1:]
            num_edges.append(taken)
            found.append(new)
            srcs.append(src_local)
            dsts.append(dst)
            poss.append(pos)
            frontier = new
            slots = taken
        if fanouts:  # the last hop's new-node count (and the last kernels' errors): one more host round trip
            if pending is None:
                num_nodes.append(0)
            else:
                ends: list[int] = torch.cat([pending, self.error]).tolist()
                self._check(ends[1], ends[2])
                num_nodes.append(ends[0])
        nodes = [seeds] + [found[hop][: num_nodes[hop + 1]] for hop in range(len(found))]
        n_id = torch.cat(nodes)
        local.index_fill_(0, n_id, -1)
        pos = torch.cat(poss) if poss else empty
        edge_index = torch.stack([torch.cat(srcs), torch.cat(dsts)]) if srcs else empty.view(2, 0)
        e_id = pos if edge_id is None else edge_id[pos].long()
        types = None if edge_type is None else edge_type[pos].long()
        kinds = None if node_type is None else node_type[n_id].long()
        return n_id, edge_index, e_id, pos, types, kinds, num_nodes, num_edges
