"""``NeighborLoader``: PyG's mini-batch neighbour loader, sampled by pytorch-direct's sampler on the GPU (or the
CPU), features gathered zero-copy from unified tables, the next batches made ahead on a side CUDA stream by a
background thread so that sampling and gathering overlap the training step.
"""

from __future__ import annotations

import copy
import logging
import operator
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from . import _ops, _topology
from ._create import is_unified
from ._epoch import Epoch
from ._memory import cuda_usable
from ._sample import NeighborSampler, SampledSubgraph, Topology, check_seeds

log = logging.getLogger("pytorch_direct")

# Plain CPU tables below this size are copied to GPU memory (a gather there is fastest and costs little memory);
# larger ones are registered in place as unified tensors and read zero-copy.
SMALL_TABLE_BYTES = 16 << 20
# The topology goes to GPU memory when it takes at most this share of the free memory ("auto"), else it stays in
# host memory as unified tensors, read zero-copy.
TOPOLOGY_GPU_SHARE = 0.25

# PyG's (and torch's DataLoader's) arguments this loader does not take: per argument, the value that asks for
# nothing (PyG's default, which code written for PyG's loader passes: accepted, and means what it means there) and
# why any other value is refused.
_NOT_SUPPORTED = {
    "num_workers": (0, "batches are made by a background thread on a CUDA stream (prefetch=, thread=), not by "
                       "worker processes"),
    "time_attr": (None, "temporal sampling is not supported"),
    "weight_attr": (None, "weighted sampling is not supported"),
    "input_time": (None, "temporal sampling is not supported"),
    "transform_sampler_output": (None, "not supported; use transform= on the assembled batch"),
    "directed": (True, "only directional subgraphs (the sampled edges) are made"),
    "neighbor_sampler": (None, "batches are sampled by pytorch-direct's sampler"),
    "persistent_workers": (False, "there are no worker processes"),
    "collate_fn": (None, "batches are assembled by the loader"),
    "timeout": (0, "there are no worker processes to wait for"),
    "prefetch_factor": (None, "there are no worker processes (batches made ahead: prefetch=)"),
    "multiprocessing_context": (None, "there are no worker processes"),
    "dataset": (None, "seeds come from input_nodes (PyG's NodeLoader drops its dataset= too)"),
}
# torch's DataLoader arguments that PyG's loaders pass on and that it ignores without worker processes (and without
# pin_memory), and PyG's filter_per_worker (where features are gathered: in the worker or the main process, the same
# batches either way): taken with any value, and ignored here too
_IGNORED = ("worker_init_fn", "in_order", "pin_memory_device", "filter_per_worker")


@dataclass
class LoaderStats:
    """Per epoch: ``batches`` handed to training; ``wait_s``: how long training waited for them (on a GPU, the
    time the training stream stalled for a batch, CUDA events; on the CPU, wall time); ``host_wait_s``: wall time
    the training thread spent in ``next()``; ``sample_s`` / ``gather_s``: host time spent sampling the batches and
    then gathering their features and preparing them (in the loader's threads when it has them), and
    ``sample_cpu_s`` / ``gather_cpu_s`` the CPU time of the threads doing it (what that work asks of the host, where
    the wall times also hold waits); ``ahead_batches`` / ``ahead_s``: batches that ``prepare_when_ahead`` ran on,
    and its host time."""

    batches: int = 0
    wait_s: float = 0.0
    host_wait_s: float = 0.0
    sample_s: float = 0.0
    gather_s: float = 0.0
    sample_cpu_s: float = 0.0
    gather_cpu_s: float = 0.0
    ahead_batches: int = 0
    ahead_s: float = 0.0


class NeighborLoader:
    """Mini-batches of neighbour-sampled subgraphs as PyG ``Data`` / ``HeteroData``, like
    ``torch_geometric.loader.NeighborLoader``, without pyg-lib or torch-sparse.

    ``data``: a ``Data``, a ``HeteroData``, a PyG ``(FeatureStore, GraphStore)`` pair, or a ``(features,
    Topology)`` pair (``features``: attribute name -> per-node table; a graph already in CSC form).
    ``num_neighbors``: fan-outs per hop (-1, or any negative: all, 0: none; ``[]``: no hops, a batch of the seeds
    alone); for a heterogeneous graph also a dict edge type -> list.
    ``input_nodes``: seed nodes: ids (a tensor of shape [k] or [k, 1] on any device, a list, tuple, range or
    array) or a boolean mask (its True entries, whatever its length, as in PyG); for a heterogeneous graph a node
    type or ``(node type, ids or mask or None)``; ``None``: every node (of a homogeneous graph). ``batch_size``,
    ``shuffle``, ``drop_last``, ``replace``, ``transform`` (called on each assembled batch, where it is made) and
    ``is_sorted`` (``edge_index`` already sorted by destination) mean what they mean in PyG, and so do PyG's
    ``input_id`` (labels of the input nodes), ``custom_cls`` (the class of a store pair's batches), ``pin_memory``
    (batches made on the CPU are pinned where there is a GPU), ``filter_per_worker`` and ``temporal_strategy``
    (which change nothing without worker processes and without ``time_attr``), and torch DataLoader's ``sampler``
    (positions into the input nodes, drawn each epoch, batched by ``batch_size``) and ``batch_sampler`` (the
    batches of positions). ``prepare``: called on
    each :class:`SampledSubgraph` where the batch is made, after its feature gathers are queued but while they may
    still run (on a GPU they run on a stream of their own, so a host round trip in ``prepare`` waits for the
    sampling only, not for the gathers); the attributes it returns (a dict) are set on the batch. The place for
    per-batch preprocessing that reads sizes on the host, such as ``hector.prepare_graph``.
    ``prepare_when_ahead``: optional work on each made batch that training could also do itself (e.g. building a
    model's per-batch launch plans, ``layer.prepare(graph)``): a loader thread calls it on a batch only while the
    batch before it still waits in the queue, i.e. while the loader is ahead of training and would otherwise wait;
    when training is waiting for batches it is skipped, so the loader never becomes the slower side because of it.
    Without a loader thread it is never called. ``stats()`` counts the batches it ran on.

    ``device``: where sampling runs and batches arrive (default: the GPU when one is usable). ``topology``: where
    the sampler reads the graph on a GPU: "device" (GPU memory), "host" (unified tensors, zero-copy: graphs larger
    than the GPU), "auto" (GPU memory if it takes at most a quarter of the free memory; tensors already on the
    GPU or unified stay where they are). ``unify``: plain CPU attribute tables are made readable by the GPU (small
    ones copied to it, large ones registered in place as unified tensors); ``False`` gathers them on the CPU into
    pinned memory and copies the rows (PyG's way).

    ``prefetch``: batches made ahead of training (default 1 on a GPU, 0 on the CPU: made when asked for);
    ``thread``: made by a background thread (default when prefetching) or by the training thread itself before
    it hands over the previous batch. On a GPU they are made on the loader's own CUDA stream and handed over with an
    event (the training thread never waits for the GPU); feature gathers run on a second stream of the loader, so
    that the next batch's sampling does not wait for them. ``high_priority``: the loader's streams run at CUDA's
    high priority (default), so that its short sampling kernels, which its host round trips wait for, do not queue
    behind the training step's kernels. ``seed``: the sampler's and shuffle's random numbers
    (default: drawn from torch's global generator, so ``torch.manual_seed`` fixes the batches, or from
    ``generator``, PyG's and torch DataLoader's way to fix the shuffle, where one is given). The same seed gives
    the same batches whatever ``prefetch``, ``thread`` and ``pipeline`` are. ``pipeline``: with a loader thread,
    split its work between two threads (default): one samples batch ``k + 1`` while the other gathers batch ``k``'s
    features and runs ``prepare`` on it, each on its own CUDA stream, so that a batch takes the longer of the two
    phases instead of their sum; ``False``: one thread does both in turn.
    """

    def __init__(self, data: Any, num_neighbors: list[int] | dict[Any, list[int]], *, input_nodes: Any = None,
                 batch_size: int = 1, shuffle: bool = False,
                 drop_last: bool = False, replace: bool = False, device: torch.device | str | None = None,
                 topology: str = "auto", unify: bool = True, prefetch: int | None = None,
                 thread: bool | None = None, transform: Callable[[Any], Any] | None = None, seed: int | None = None,
                 is_sorted: bool = False, prepare: Callable[[SampledSubgraph], dict[str, Any]] | None = None,
                 prepare_when_ahead: Callable[[Any], None] | None = None, high_priority: bool = True,
                 pipeline: bool = True, generator: torch.Generator | None = None,
                 subgraph_type: str = "directional", disjoint: bool = False, input_id: Any = None,
                 custom_cls: type | None = None, temporal_strategy: str = "uniform", pin_memory: bool = False,
                 sampler: Any = None, batch_sampler: Any = None, **kwargs: Any) -> None:
        for key, value in kwargs.items():
            if key in _IGNORED:
                continue
            if key not in _NOT_SUPPORTED:
                raise TypeError(f"NeighborLoader got an unexpected argument {key!r}")
            nothing, reason = _NOT_SUPPORTED[key]
            if value is nothing or (isinstance(value, (bool, int, float, str)) and value == nothing):
                continue
            raise NotImplementedError(f"NeighborLoader({key}=...): {reason}")
        subgraph_type = str(getattr(subgraph_type, "value", subgraph_type))
        if subgraph_type not in ("directional", "bidirectional", "induced"):
            raise ValueError(f"subgraph_type must be 'directional', 'bidirectional' or 'induced' (as in PyG), got "
                             f"{subgraph_type!r}")
        if subgraph_type != "directional":
            raise NotImplementedError(f"subgraph_type={subgraph_type!r}: only 'directional' subgraphs are made")
        if disjoint:
            raise NotImplementedError("disjoint=True: per-seed disjoint subgraphs are not supported")
        if temporal_strategy not in ("uniform", "last"):
            raise ValueError(f"temporal_strategy must be 'uniform' or 'last' (as in PyG), got {temporal_strategy!r}")
        # (either strategy samples uniformly without time_attr, as in PyG; time_attr itself is refused above)
        self.batch_size = _batch_size(batch_size)
        self.shuffle, self.drop_last = bool(shuffle), bool(drop_last)
        # torch's DataLoader (under PyG's loaders) draws the positions into input_nodes from sampler= (batched by
        # batch_size) or their batches from batch_sampler=, each epoch, and refuses these combinations
        if sampler is not None and self.shuffle:
            raise ValueError("sampler= is mutually exclusive with shuffle=True (as in torch's DataLoader): the "
                             "sampler orders the input nodes")
        if batch_sampler is not None and (self.batch_size != 1 or self.shuffle or sampler is not None
                                          or self.drop_last):
            raise ValueError("batch_sampler= is mutually exclusive with batch_size, shuffle, sampler and drop_last "
                             "(as in torch's DataLoader): it makes the batches")
        self.position_sampler, self.batch_sampler = sampler, batch_sampler
        self.transform = transform
        self.prepare = prepare
        self.prepare_when_ahead = prepare_when_ahead
        self.pipeline = bool(pipeline)
        self.device = _choose_device(device, data)
        cuda = self.device.type == "cuda"
        self.prefetch = (1 if cuda else 0) if prefetch is None else int(prefetch)
        if self.prefetch < 0:
            raise ValueError(f"prefetch must be >= 0 batches, got {prefetch}")
        self.thread = self.prefetch > 0 if thread is None else bool(thread)
        if self.thread and not self.prefetch:
            raise ValueError("thread=True needs prefetch >= 1: a loader thread makes batches ahead of training")
        if prepare_when_ahead is not None and not self.thread:
            warnings.warn("NeighborLoader(prepare_when_ahead=...) is never called without a loader thread: use "
                          "thread=True (and prefetch >= 1), or do that work in the training step", stacklevel=2)
        if not cuda and self.prefetch and not self.thread:
            warnings.warn("NeighborLoader(prefetch>0, thread=False) on the CPU: batches made ahead by the training "
                          "thread overlap nothing without CUDA streams (use thread=True, or prefetch=0)", stacklevel=2)
        if not cuda and topology != "auto":
            warnings.warn(f"NeighborLoader(topology={topology!r}) has no effect on the CPU: the topology is read "
                          f"where it is", stacklevel=2)
        self.source = _topology.source_of(data, is_sorted)
        # (input nodes that select none, e.g. an empty split or mask, make a loader of no batches, as PyG's)
        self.input_type, self._input_nodes, self._input_id = self._resolve_input_nodes(input_nodes)
        if input_id is not None:
            self._input_id = self._given_input_id(input_id, input_nodes)
        self.custom_cls = self._batch_class(custom_cls)
        # (PyG's DataLoader pins batches made on the CPU where there is a GPU to copy them to; without one, torch
        # ignores pin_memory; batches made on a GPU are in its memory already)
        self.pin_memory = bool(pin_memory) and self.device.type == "cpu" and cuda_usable()
        self.source.topology = self.source.topology.placed(self._placement(topology), self.device)
        self.unify = bool(unify)
        self._prepare_tables()
        if seed is None and generator is not None:
            seed = torch.randint(2**62, (), dtype=torch.long, device=generator.device, generator=generator)
        base = int(torch.randint(2**62, (), dtype=torch.long)) if seed is None else int(seed)
        self._seed = base
        self._epoch = 0
        gen = torch.Generator(self.device).manual_seed(base)
        self.sampler = NeighborSampler(self.source.topology, _topology.fanouts(self.source, num_neighbors),
                                       replace=replace, device=self.device, generator=gen,
                                       blocks=self.source.blocks)
        check_seeds(self._input_nodes, self.source.num_nodes[self.input_type], "input node")
        offset = self.source.node_offset(self.input_type)
        self._seeds_global = (self._input_nodes + offset).to(self.device)
        self._input_id_dev = self._input_id.to(self.device) if self._input_id is not None else None
        # The unified attribute tables whose rows a batch reads at indices known to lie in them, with their row
        # layout: a node table holding a row per node of its type is read at sampled node ids, which the sampler
        # keeps below the node count. Checked here once, not at each gather (where a bounds check costs a reduction
        # and a host wait).
        self._in_range = {}
        for key, t in self.source.node_tables.items():
            if is_unified(t) and t.dim() > 0 and t.size(0) >= self.source.num_nodes[key[0]] and t.is_contiguous():
                _ops.check_table(t)
                self._in_range[key] = _ops.row_layout(t)
        priority = -1 if cuda and high_priority else 0  # (lower is higher; 0 is CUDA's default)
        self._stream = torch.cuda.Stream(self.device, priority=priority) if cuda and self.prefetch else None
        self._gather_stream = torch.cuda.Stream(self.device, priority=priority) if self._stream is not None else None
        # where a pipelined loader thread assembles the batches sampled on _stream
        self._assemble_stream = (torch.cuda.Stream(self.device, priority=priority)
                                 if self._stream is not None and self.thread and self.pipeline else None)
        self._gathering: torch.cuda.Stream | None = None  # the gather stream while a batch is assembled
        self._active: weakref.ref | None = None
        self._stats = LoaderStats()

    # ---- set-up ----------------------------------------------------------------------------------------------

    def _resolve_input_nodes(self, input_nodes):
        """(node type or None, seed ids [S] int64 on the CPU, input_id source or None), as PyG's
        ``get_input_nodes`` resolves them (a boolean mask's input_id are the node ids, an index's its positions)."""
        src = self.source
        node_type = None
        if src.hetero:
            if input_nodes is None:
                raise ValueError(f"a heterogeneous graph needs the seeds' node type: input_nodes='type' or "
                                 f"('type', ids), with a type from {src.node_types}")
            if isinstance(input_nodes, str):
                node_type, input_nodes = input_nodes, None
            elif isinstance(input_nodes, (tuple, list)) and len(input_nodes) == 2 and isinstance(input_nodes[0], str):
                node_type, input_nodes = input_nodes
            else:
                raise ValueError("input_nodes of a heterogeneous graph must be 'type' or ('type', ids or mask)")
            if node_type not in src.num_nodes:
                raise ValueError(f"input node type {node_type!r} is not in the graph ({src.node_types})")
        elif isinstance(input_nodes, str) or (isinstance(input_nodes, tuple) and len(input_nodes) == 2
                                              and isinstance(input_nodes[0], str)):
            raise ValueError("input_nodes names a node type but the graph is homogeneous: pass ids or a mask")
        n = src.num_nodes[node_type]
        if input_nodes is None:
            return node_type, torch.arange(n), None
        nodes, input_id = _input_ids(input_nodes, n)
        return node_type, nodes, input_id

    def _given_input_id(self, input_id, input_nodes) -> Tensor:
        """``input_id=`` (PyG's NodeLoader's argument): the input id of each input node, handed out per batch in
        place of its position (or, for a mask, its node id)."""
        if input_nodes is None or isinstance(input_nodes, str) or (
                isinstance(input_nodes, (tuple, list)) and len(input_nodes) == 2 and isinstance(input_nodes[0], str)
                and input_nodes[1] is None):
            raise ValueError("input_id= labels the input nodes given as ids or a mask; PyG ignores it where "
                             "input_nodes selects every node (None or a node type alone): pass the nodes as ids, "
                             "e.g. input_nodes=torch.arange(num_nodes), or leave input_id out")
        input_id = torch.as_tensor(input_id).cpu()
        if input_id.shape != self._input_nodes.shape:
            raise ValueError(f"input_id= must hold one id per input node ({self._input_nodes.numel()}), got shape "
                             f"{tuple(input_id.shape)}")
        return input_id

    def _batch_class(self, custom_cls):
        """The class of the batches of a store pair or a topology pair (PyG's ``custom_cls``), or None."""
        if custom_cls is None:
            return None
        if self.source.template is not None:
            raise ValueError("custom_cls= sets the class of the batches of a (FeatureStore, GraphStore) pair; the "
                             "batches of a Data or HeteroData are copies of it, of its own class (PyG ignores "
                             "custom_cls there): leave it out")
        from torch_geometric.data import Data, HeteroData

        base = HeteroData if self.source.hetero else Data
        if not (isinstance(custom_cls, type) and issubclass(custom_cls, base)):
            raise TypeError(f"custom_cls= must be a subclass of {base.__name__} for this graph, got {custom_cls!r}")
        return custom_cls

    def _placement(self, topology: str) -> str:
        if topology not in ("auto", "device", "host"):
            raise ValueError(f"topology must be 'auto', 'device' or 'host', got {topology!r}")
        topo = self.source.topology
        if self.device.type != "cuda":
            if any(t.device.type == "cuda" for t in topo.tensors().values()):
                return "device"  # (to the CPU)
            return "as_is"
        if topology != "auto":
            return topology
        tensors = topo.tensors().values()
        if all(is_unified(t) or t.device == self.device for t in tensors):
            return "as_is"
        free, _ = torch.cuda.mem_get_info(self.device)
        where = "device" if topo.nbytes() <= TOPOLOGY_GPU_SHARE * free else "host"
        log.info("NeighborLoader: topology (%.2f GiB) in %s memory", topo.nbytes() / 2**30,
                 "GPU" if where == "device" else "host (unified, read zero-copy)")
        return where

    def _prepare_tables(self) -> None:
        """Attribute tables where this loader reads them from (see ``unify``)."""
        if self.device.type != "cuda" or not self.unify:
            return
        for tables in (self.source.node_tables, self.source.edge_tables):
            for key, t in tables.items():
                if is_unified(t) or t.device.type == "cuda" or t.dim() == 0:
                    continue
                nbytes = t.numel() * t.element_size()
                if nbytes < SMALL_TABLE_BYTES:
                    tables[key] = t.to(self.device)
                else:
                    tables[key] = _topology.unify_table(t, str(key[1]))
                    log.info("NeighborLoader: %s (%.2f GiB) is read zero-copy from host memory", key[1],
                             nbytes / 2**30)

    # ---- iteration -------------------------------------------------------------------------------------------

    def __len__(self) -> int:
        if self.batch_sampler is not None:
            return len(self.batch_sampler)
        n = self._input_nodes.numel() if self.position_sampler is None else len(self.position_sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self):
        if self._active is not None and self._active() is not None:
            self._active().close()  # one epoch at a time: the sampler is not shared between threads
        self._stats = LoaderStats()
        it = Epoch(self, self._epoch_order())
        self._epoch += 1
        self._active = weakref.ref(it)
        return it

    def stats(self) -> dict:
        """The current (or last) epoch's :class:`LoaderStats` as a dict (reads its CUDA events: synchronises)."""
        it = self._active() if self._active is not None else None
        if it is not None:
            it.read_events()
        return dict(vars(self._stats))

    def _epoch_order(self) -> list[Tensor]:
        """This epoch's batches as CPU positions into the input nodes."""
        n = self._input_nodes.numel()
        if self.batch_sampler is not None:
            return [_positions(batch, n, "batch_sampler") for batch in self.batch_sampler]
        if self.position_sampler is not None:
            order = _positions(list(self.position_sampler), n, "sampler")
            n = order.numel()
        elif self.shuffle:
            gen = torch.Generator().manual_seed(self._seed + 1 + self._epoch)
            order = torch.randperm(n, generator=gen)
        else:
            order = torch.arange(n)
        if self.drop_last:
            order = order[: n // self.batch_size * self.batch_size]
        if not order.numel():  # (drop_last with fewer inputs than batch_size; split would give one empty batch)
            return []
        return list(order.split(self.batch_size))

    def make(self, positions: Tensor) -> Any:
        """One batch: the seeds at ``positions`` (on the loader's device) of the input nodes, made on the current
        stream and thread."""
        return self.finish(*self.sample(positions))

    def sample(self, positions: Tensor) -> tuple[SampledSubgraph, Tensor]:
        """The sampled subgraph around the seeds at ``positions``, and their input ids (current stream)."""
        input_id = self._input_id_dev[positions] if self._input_id_dev is not None else positions
        return self.sample_seeds(self._seeds_global[positions], input_id)

    def epoch_seeds(self, order: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
        """Per batch of ``order`` (CPU positions into the input nodes, see :meth:`_epoch_order`), its seeds (global
        node ids) and input ids on the loader's device (current stream): two gathers for the epoch rather than two
        per batch."""
        sizes = [len(p) for p in order]
        positions = torch.cat(order).to(self.device)
        ids = self._input_id_dev[positions] if self._input_id_dev is not None else positions
        return list(self._seeds_global[positions].split(sizes)), list(ids.split(sizes))

    def sample_seeds(self, seeds: Tensor, input_id: Tensor) -> tuple[SampledSubgraph, Tensor]:
        """The sampled subgraph around ``seeds`` (global ids of input nodes, on the loader's device), and their
        ``input_id`` (current stream)."""
        start, start_cpu = time.perf_counter(), time.thread_time()
        sub = self.sampler.sample(seeds, check=False)
        self._stats.sample_s += time.perf_counter() - start
        self._stats.sample_cpu_s += time.thread_time() - start_cpu
        return sub, input_id

    def finish(self, sub: SampledSubgraph, input_id: Tensor, made_on: torch.cuda.Stream | None = None) -> Any:
        """The batch of a sampled subgraph: its features gathered (on the gather stream when the current stream is
        one of the loader's), ``prepare`` and ``transform`` run, on the current stream and thread. ``made_on``: the
        loader's stream that is current, where the caller knows it (not looked up again)."""
        start, start_cpu = time.perf_counter(), time.thread_time()
        if made_on is not None:
            current, on_stream = made_on, self._gather_stream is not None
        else:
            current = torch.cuda.current_stream(self.device) if self._gather_stream is not None else None
            on_stream = current is not None and current in (self._stream, self._assemble_stream)
        self._gathering = self._gather_stream if on_stream else None
        try:
            batch = self._assemble(sub, input_id)
        finally:
            self._gathering = None
        if self.prepare is not None:
            extra = self.prepare(sub)
            if not isinstance(extra, dict):
                raise TypeError(f"NeighborLoader(prepare=...) must return a dict of attributes to set on the batch, "
                                f"got {type(extra).__name__}")
            for key, value in extra.items():
                batch[key] = value
        if self.transform is not None:
            if on_stream:  # a transform may read the gathered features
                current.wait_stream(self._gather_stream)
            batch = self.transform(batch)
        if self.pin_memory:
            batch = batch.pin_memory()
        self._stats.gather_s += time.perf_counter() - start
        self._stats.gather_cpu_s += time.thread_time() - start_cpu
        return batch

    def _ready_events(self, made_on: torch.cuda.Stream) -> list:
        """Events marking the batch just made on the loader's streams (``made_on``, and the gathers')."""
        events = []
        for stream in (made_on, self._gather_stream):
            event = torch.cuda.Event()
            event.record(stream)
            events.append(event)
        return events

    # ---- batch assembly --------------------------------------------------------------------------------------

    def _gather_rows(self, jobs: list) -> list[Tensor]:
        """The rows of each ``(table key, table, index)`` of ``jobs``, on the gather stream while a batch is made on
        the loader's stream (else where called): the gather stream first waits for the sampling that made the
        indices, and the indices are marked as used by it (their memory is not reused by the sampling stream before
        the gathers have read them). One switch of streams for all of a batch's gathers."""
        if not jobs:
            return []
        known = self._in_range
        gs = self._gathering
        if gs is None:
            return [self._gather_now(table, index, known.get(key)) for key, table, index in jobs]
        gs.wait_stream(torch.cuda.current_stream(self.device))
        marked = set()
        for _, _, index in jobs:
            if id(index) not in marked and index.is_cuda:
                index.record_stream(gs)
                marked.add(id(index))
        with torch.cuda.stream(gs):
            return [self._gather_now(table, index, known.get(key)) for key, table, index in jobs]

    def _gather_now(self, table: Tensor, index: Tensor, in_range: tuple[int, int] | None = None) -> Tensor:
        """``table``'s rows at ``index`` on the loader's device; ``in_range``: the row layout of a unified table
        checked once, whose rows ``index`` is known to lie in (then read without a bounds check)."""
        if is_unified(table):
            return _ops.gather_in_range(table, index, in_range) if in_range is not None else table[index]
        if table.device == index.device:
            rows = table.index_select(0, index)
        elif table.device.type == "cpu" and index.device.type == "cuda":  # CPU gather, pinned, copy
            idx = index.cpu()
            staged = torch.empty((idx.numel(), *table.shape[1:]), dtype=table.dtype, pin_memory=True)
            return torch.index_select(table, 0, idx, out=staged).to(index.device, non_blocking=True)
        else:
            rows = table.index_select(0, index.to(table.device))
        return rows.to(self.device, non_blocking=True)

    def _store_features(self, group, index: Tensor) -> dict:
        """The feature store's tensors of ``group`` at ``index`` (PyG's ``multi_get_tensor``), on the loader's
        stream (where the index was made), not the gather stream: a store's ``multi_get_tensor`` runs host code of
        its own and may read the index on the host. A :class:`~pytorch_direct.pyg.UnifiedFeatureStore` gathering
        on this loader's device gets the index where it is; any other store gets it on the CPU (copied before it is
        read). The tensors come back on the loader's device."""
        from .pyg import UnifiedFeatureStore

        fs = self.source.feature_store
        attrs = [a for a in fs.get_all_tensor_attrs() if a.group_name == group]
        if not attrs:
            return {}
        here = isinstance(fs, UnifiedFeatureStore) and fs.device == self.device
        where = index if here else index.cpu()
        for a in attrs:
            a.index = where
        tensors = fs.multi_get_tensor(attrs)
        out = {}
        for a, t in zip(attrs, tensors, strict=True):
            if not isinstance(t, Tensor):
                raise TypeError(f"the feature store returned a {type(t).__name__} for {a.group_name}/{a.attr_name}, "
                                f"not a tensor: NeighborLoader gathers tensors only")
            if t.size(0) != index.numel():
                raise ValueError(f"the feature store returned {t.size(0)} rows of {a.group_name}/{a.attr_name} for "
                                 f"{index.numel()} nodes: its multi_get_tensor must return the rows at the index")
            # (a pinned CPU tensor copies asynchronously on this stream; a pageable one at once)
            out[a.attr_name] = t.to(self.device, non_blocking=t.device.type == "cpu" and t.is_pinned())
        return out

    def _assemble(self, sub: SampledSubgraph, input_id: Tensor):
        if self.source.hetero:
            return self._assemble_hetero(sub, input_id)
        from torch_geometric.data import Data

        src = self.source
        jobs = [(key, table, sub.n_id) for key, table in src.node_tables.items()]
        jobs += [(key, table, sub.e_id) for key, table in src.edge_tables.items()]
        fields = {"edge_index": sub.edge_index}
        fields.update(zip((key for (_, key), _, _ in jobs), self._gather_rows(jobs), strict=True))
        if src.feature_store is not None:
            fields.update(self._store_features(None, sub.n_id))
        if src.template is None:
            fields["num_nodes"] = sub.num_nodes
            if sub.edge_type is not None:
                fields["edge_type"] = sub.edge_type
            if sub.node_type is not None:
                fields["node_type"] = sub.node_type
        elif "num_nodes" in src.template:
            fields["num_nodes"] = sub.num_nodes
        fields.update(n_id=sub.n_id, e_id=sub.e_id, input_id=input_id, batch_size=sub.batch_size,
                      num_sampled_nodes=sub.num_sampled_nodes, num_sampled_edges=sub.num_sampled_edges)
        if src.template is not None:
            out = copy.copy(src.template)
            for key, value in fields.items():
                out[key] = value
            return out
        return _new_data(self.custom_cls or Data, fields)

    def _assemble_hetero(self, sub: SampledSubgraph, input_id: Tensor):
        from torch_geometric.data import HeteroData

        src, blocks = self.source, self.source.blocks
        parts = _topology.split_hetero(sub, blocks)
        out = copy.copy(src.template) if src.template is not None else (self.custom_cls or HeteroData)()
        node_ids = dict(zip(src.node_types, parts.n_id, strict=True))
        edge_ids = dict(zip(src.edge_types, parts.e_id, strict=True))
        jobs = [(key, table, node_ids[key[0]]) for key, table in src.node_tables.items()]
        jobs += [(key, table, edge_ids[key[0]]) for key, table in src.edge_tables.items()]
        for ((group, key), _, _), rows in zip(jobs, self._gather_rows(jobs), strict=True):
            out[group][key] = rows
        for node_type, ids in node_ids.items():
            store = out[node_type]
            store.n_id = ids
            if src.feature_store is not None:
                for key, value in self._store_features(node_type, ids).items():
                    store[key] = value
            if src.template is None or "num_nodes" in src.template[node_type]:
                store.num_nodes = ids.numel()
        for k, edge_type in enumerate(src.edge_types):
            store = out[edge_type]
            store.edge_index = parts.edge_index[k]
            store.e_id = parts.e_id[k]
        out.set_value_dict("num_sampled_nodes", dict(zip(src.node_types, parts.num_sampled_nodes, strict=True)))
        out.set_value_dict("num_sampled_edges", dict(zip(src.edge_types, parts.num_sampled_edges, strict=True)))
        out[self.input_type].input_id = input_id
        out[self.input_type].batch_size = sub.batch_size
        return out


def _new_data(cls, fields: dict):
    """``cls(**fields)`` (a PyG ``Data``) without its per-attribute ``__setattr__`` path (several Python calls per
    attribute, each made with the interpreter lock held, in a loader thread beside the training thread): a new
    ``Data`` has no cached attribute information to invalidate, so its store's mapping takes the fields as they are.
    Falls back to ``setattr`` where the store is not laid out so (another PyG version)."""
    out = cls()
    mapping = getattr(getattr(out, "_store", None), "_mapping", None)
    if type(mapping) is dict and not mapping:
        mapping.update(fields)
        return out
    for key, value in fields.items():
        setattr(out, key, value)
    return out


def _input_ids(input_nodes, num_nodes: int) -> tuple[Tensor, Tensor | None]:
    """(seed ids [S] int64 on the CPU, their input ids or None) of ``input_nodes`` given as ids or a boolean mask
    for a node type of ``num_nodes`` nodes, as PyG's ``get_input_nodes`` reads them: a mask's seeds (and input ids)
    are the positions of its True entries, whatever its length (entries past its end are False); ids come as a
    tensor, a list, a tuple or an array, CPU or CUDA. Ids of shape [k, 1] are the k ids (PyG keeps that shape and
    its sampler reads the k ids)."""
    if not isinstance(input_nodes, Tensor):
        nodes = torch.as_tensor(input_nodes)
        if nodes.dtype == torch.bool:
            # (PyG converts a non-tensor with torch.tensor(..., dtype=torch.long): True and False become ids 1 and 0)
            raise ValueError(f"input_nodes is a {type(input_nodes).__name__} of booleans, which PyG's NeighborLoader "
                             f"reads as node ids 1 and 0, not as a mask: pass a boolean torch.Tensor for a mask "
                             f"(torch.as_tensor(mask)), or integer ids")
        if nodes.numel() == 0:
            nodes = nodes.long()  # (an empty list is float to torch, an empty set of ids to PyG)
    else:
        nodes = input_nodes
    nodes = nodes.cpu()
    if nodes.dtype == torch.bool:
        if nodes.dim() != 1:
            raise ValueError(f"an input_nodes mask must be 1-D (an entry per node), got shape {tuple(nodes.shape)}: "
                             f"pass mask.view(-1)")
        ids = nodes.nonzero().view(-1)
        if nodes.numel() > num_nodes and ids.numel() and int(ids[-1]) >= num_nodes:
            raise ValueError(f"the input_nodes mask has {nodes.numel()} entries and selects node {int(ids[-1])}, "
                             f"past the {num_nodes} nodes: its entries from {num_nodes} on must be False")
        return ids, ids
    if nodes.dim() == 2 and nodes.size(1) == 1:
        nodes = nodes.view(-1)
    if nodes.dim() != 1:
        raise ValueError(f"input_nodes must be node ids of shape [k] (or [k, 1]) or a 1-D boolean mask, got shape "
                         f"{tuple(nodes.shape)}")
    if nodes.dtype.is_floating_point or nodes.dtype.is_complex:
        raise ValueError(f"input_nodes must be integer node ids or a boolean mask, got {nodes.dtype}: pass "
                         f"ids.long()")
    return nodes.long(), None


def _positions(values, n: int, what: str) -> Tensor:
    """Positions into the ``n`` input nodes drawn from a ``sampler=`` or ``batch_sampler=``, as a CPU int64 tensor;
    a position outside them is named (PyG's loader fails on it with an IndexError from torch)."""
    positions = torch.as_tensor(list(values), dtype=torch.long)
    if positions.dim() != 1:
        raise ValueError(f"{what}= must yield positions into input_nodes (integers), got shape "
                         f"{tuple(positions.shape)}")
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= n):
        raise IndexError(f"{what}= yielded positions in [{int(positions.min())}, {int(positions.max())}], but there "
                         f"are {n} input nodes: it must draw from range({n}) (e.g. DistributedSampler(range({n})))")
    return positions


def _batch_size(value) -> int:
    """``batch_size`` as torch's DataLoader (under PyG's loaders) takes it: a positive integer; a float or a bool is
    refused there (int() read 2.5 as 2 and True as 1)."""
    try:
        size = 0 if isinstance(value, bool) else operator.index(value)
    except TypeError:
        size = 0
    if size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {value!r}")
    return size


def _choose_device(device, data) -> torch.device:
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda" and not cuda_usable():
            raise RuntimeError(f"device={device}: no usable CUDA GPU here (or pytorch-direct was built without "
                               f"CUDA); use device='cpu'")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device
    topo = data[1] if isinstance(data, tuple) and len(data) == 2 else None
    if isinstance(topo, Topology) and topo.colptr.device.type == "cuda":
        return topo.colptr.device
    if cuda_usable():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
