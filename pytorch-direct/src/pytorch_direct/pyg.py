"""PyG integration: a ``FeatureStore`` whose tensors are unified tensors, so node features are fetched straight from
host memory into GPU memory, gathered by the GPU (no CPU gather, no staging copy); a ``GraphStore`` helper; and
pytorch-direct's neighbour sampler as a PyG ``BaseSampler``.

    fs = UnifiedFeatureStore()                                      # rows arrive on the GPU (the CPU without one)
    fs.put_tensor(x, group_name=None, attr_name="x", index=None)     # registered in place (or copied) once
    gs = make_graph_store(edge_index, num_nodes=x.size(0))           # PyG's LocalGraphStore
    loader = pytorch_direct.sampling.NeighborLoader((fs, gs), num_neighbors=[10, 10], batch_size=1024)

PyG's own ``NeighborLoader`` takes the same pair but needs pyg-lib or torch-sparse to sample, and ``input_nodes``
for a store pair; its ``NodeLoader`` runs with :class:`NodeSampler` instead, without either.

Inside DataLoader worker processes (``num_workers > 0``) no CUDA call is allowed, so features are gathered on the
CPU there and moved by the loader as usual; in the main process they are gathered on ``device``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from torch import Tensor

try:
    from torch_geometric.data import FeatureStore, GraphStore, TensorAttr
    from torch_geometric.data.feature_store import _FieldStatus
    from torch_geometric.sampler import BaseSampler, HeteroSamplerOutput, NodeSamplerInput, SamplerOutput
except ImportError as e:  # pragma: no cover - only without torch_geometric
    raise ImportError("pytorch_direct.pyg needs torch_geometric: pip install torch_geometric") from e

if TYPE_CHECKING:
    from torch_geometric.data import Data, HeteroData

from . import _topology
from ._create import unified
from ._memory import MEMORY_KINDS, cuda_usable
from ._sample import NeighborSampler
from ._tensor import UnifiedTensor


def _key(attr: TensorAttr) -> tuple:
    return (attr.group_name, attr.attr_name)


@dataclass
class WholeTensorAttr(TensorAttr):
    """A ``TensorAttr`` whose ``index`` is ``None`` (the whole tensor) unless given, as the attributes of PyG's own
    ``LocalFeatureStore`` are: ``get_tensor(group_name=..., attr_name=...)``, ``store[group, name]`` and
    ``remove_tensor(group_name=..., attr_name=...)`` then name a whole tensor (with PyG's ``TensorAttr`` they
    raised "not fully specified" or a TypeError from torch)."""

    def __init__(self, group_name=_FieldStatus.UNSET, attr_name=_FieldStatus.UNSET, index=None) -> None:
        super().__init__(group_name, attr_name, index)


class UnifiedFeatureStore(FeatureStore):
    """Node (or edge) feature tensors held as unified tensors; ``get_tensor`` with an index gathers on ``device``.

    ``device``: where gathered rows go: by default the GPU when one is usable (the unified table's GPU gather),
    else the CPU; "cuda", "cuda:1" or "cpu" to choose. ``copy``: put_tensor copies into a new allocation of kind
    ``memory`` (True) or registers the given tensor in place (False, the default; a non-contiguous tensor is
    copied, and so is a small one, under 32 MiB, that shares its memory pages with other allocations:
    registration pins whole pages, and a CUDA copy of another tensor that straddles them fails). ``memory`` (see
    :func:`pytorch_direct.empty`): the kind of the copies the store makes. With copy=True "auto" puts copies of
    256 MiB and more in managed memory, whose random rows the GPU reads fastest, but which forked DataLoader
    workers cannot read: with ``num_workers > 0`` (fork), pass memory="pinned" or copy=False. With copy=False
    "auto" makes the copies of the tensors it cannot register pinned, the kind registration gives, so that forked
    workers read every tensor of the store."""

    def __init__(self, device: str | torch.device | None = None, *, copy: bool = False,
                 memory: str = "auto") -> None:
        super().__init__(tensor_attr_cls=WholeTensorAttr)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if cuda_usable() else torch.device("cpu")
        self.device = torch.device(device)
        if self.device.type == "cuda" and not cuda_usable():
            raise RuntimeError(f"UnifiedFeatureStore(device={str(device)!r}): no usable CUDA GPU here (or "
                               f"pytorch-direct was built without CUDA); leave device unset or pass device='cpu'")
        if self.device.type not in ("cuda", "cpu"):
            raise ValueError(f"UnifiedFeatureStore gathers to 'cuda' or 'cpu', got device={str(device)!r}")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if memory not in MEMORY_KINDS:
            raise ValueError(f"UnifiedFeatureStore(memory={memory!r}): memory must be one of {MEMORY_KINDS}")
        self.copy = copy
        self.memory = memory
        self._tensors: dict[tuple, UnifiedTensor] = {}

    def _put_tensor(self, tensor: Tensor, attr: TensorAttr) -> bool:
        if not isinstance(tensor, Tensor):
            raise TypeError(f"put_tensor takes a torch.Tensor, got {type(tensor).__name__}")
        if attr.is_set("index") and attr.index is not None:
            existing = self._tensors.get(_key(attr))
            if existing is None:
                raise KeyError(f"no tensor {_key(attr)} to update rows of: put the whole tensor first "
                               f"(put_tensor(x, group_name=..., attr_name=..., index=None))")
            index = self._index(attr.index, existing)
            existing[index] = tensor.to(index.device)
            return True
        tensor = tensor.detach().cpu()
        if self.copy:
            self._tensors[_key(attr)] = unified(tensor, copy=True, memory=self.memory)
        else:
            # (a tensor that cannot be registered is copied: in the memory asked for, else in pinned memory, as
            # registration gives, which forked workers can read)
            memory = "pinned" if self.memory == "auto" else self.memory
            self._tensors[_key(attr)] = _topology.unify_table(tensor, f"{attr.group_name}/{attr.attr_name}", memory)
        return True

    def _target_device(self) -> torch.device:
        # No CUDA in forked DataLoader workers: gather on the CPU there.
        if self.device.type == "cuda" and torch.utils.data.get_worker_info() is None:
            return self.device
        return torch.device("cpu")

    def _index(self, index, table: Tensor) -> Tensor:
        index = torch.as_tensor(index)
        if index.dtype == torch.bool:
            if index.shape != table.shape[:1]:
                raise IndexError(f"a boolean index must have one entry per row ({table.size(0)}), got shape "
                                 f"{tuple(index.shape)}")
            index = index.nonzero().flatten()
        elif index.dtype not in (torch.int32, torch.int64):
            if index.dtype.is_floating_point or index.dtype.is_complex:
                raise IndexError(f"feature rows are selected by integer ids or a boolean mask, got {index.dtype}")
            index = index.long()
        target = self._target_device()
        # (an index read on the host must be there before it is read: a non-blocking copy from the GPU is not)
        return index.to(target, non_blocking=target.type == "cuda")

    def _get_tensor(self, attr: TensorAttr) -> Tensor | None:
        table = self._tensors.get(_key(attr))
        if table is None:
            known = ", ".join(f"{g!r}/{a!r}" for g, a in self._tensors) or "none"
            raise KeyError(f"no tensor group_name={attr.group_name!r}, attr_name={attr.attr_name!r} in this "
                           f"store (it holds: {known}); put it first with put_tensor")
        index = attr.index if attr.is_set("index") else None
        if index is None:
            return table
        if isinstance(index, slice):
            return table[index]
        return table[self._index(index, table)]

    def _remove_tensor(self, attr: TensorAttr) -> bool:
        return self._tensors.pop(_key(attr), None) is not None

    def _get_tensor_size(self, attr: TensorAttr) -> tuple[int, ...] | None:
        table = self._tensors.get(_key(attr))
        return tuple(table.shape) if table is not None else None

    def get_all_tensor_attrs(self) -> list[TensorAttr]:
        return [TensorAttr(group_name=g, attr_name=a) for (g, a) in self._tensors]


def make_graph_store(edge_index: Tensor, num_nodes: int, edge_type: tuple[str, str, str] | None = None) -> GraphStore:
    """PyG's ``LocalGraphStore`` holding one COO edge index ([2, E], sources first) of a graph with ``num_nodes``
    nodes: homogeneous when ``edge_type`` is None, else the one edge type ``(src, rel, dst)`` (both endpoint types
    with ``num_nodes`` nodes). Edge ids are the edges' positions in ``edge_index``. For several edge types use
    ``LocalGraphStore.from_hetero_data`` directly."""
    from torch_geometric.distributed import LocalGraphStore

    edge_id = torch.arange(edge_index.size(1))
    if edge_type is None:
        return LocalGraphStore.from_data(edge_id, edge_index, num_nodes)
    src, _, dst = edge_type
    return LocalGraphStore.from_hetero_data({edge_type: edge_id}, {edge_type: edge_index},
                                            {src: num_nodes, dst: num_nodes})


class NodeSampler(BaseSampler):
    """pytorch-direct's neighbour sampler as a PyG ``BaseSampler``, so PyG's own ``NodeLoader`` (worker processes,
    its transforms) runs without pyg-lib or torch-sparse::

        sampler = NodeSampler(data, num_neighbors=[10, 10])
        loader = torch_geometric.loader.NodeLoader(data, node_sampler=sampler, input_nodes=..., batch_size=...)

    ``data``: what :class:`pytorch_direct.sampling.NeighborLoader` takes; ``device`` where sampling runs (default:
    the CPU, as PyG's loaders gather features on the CPU; "cuda" samples on the GPU and returns CPU ids).
    ``seed`` fixes the random numbers. One thread at a time (use ``num_workers=0`` or ``fork`` workers, each with
    its own copy)."""

    def __init__(self, data: Data | HeteroData | tuple[FeatureStore, GraphStore],
                 num_neighbors: list[int] | dict[tuple[str, str, str], list[int]], *,
                 replace: bool = False, device: torch.device | str = "cpu",
                 seed: int | None = None, is_sorted: bool = False) -> None:
        self.source = _topology.source_of(data, is_sorted)
        self.device = torch.device(device)
        topology = self.source.topology.placed("device" if self.device.type == "cuda" else "as_is", self.device)
        self.source.topology = topology
        gen = torch.Generator(self.device)
        gen.manual_seed(int(torch.randint(2**62, ())) if seed is None else int(seed))
        self.sampler = NeighborSampler(topology, _topology.fanouts(self.source, num_neighbors),
                                       replace=replace, device=self.device, generator=gen,
                                       blocks=self.source.blocks)

    def sample_from_nodes(self, index: NodeSamplerInput, **kwargs: Any) -> SamplerOutput | HeteroSamplerOutput:
        if index.time is not None:
            raise NotImplementedError("NodeSampler samples without time (no temporal sampling): leave the loader's "
                                      "input_time out")
        src = self.source
        offset = src.node_offset(index.input_type)
        node = index.node
        if node.dim() == 2 and node.size(1) == 1:  # (PyG keeps input_nodes of shape [k, 1]; pyg-lib reads the k ids)
            node = node.view(-1)
        sub = self.sampler.sample(node.to(self.device) + offset)
        input_id = index.input_id
        metadata = (input_id if input_id is not None else torch.arange(sub.batch_size), None)
        if not src.hetero:
            (row, col), node, edge = sub.edge_index.cpu(), sub.n_id.cpu(), sub.e_id.cpu()
            return SamplerOutput(node, row, col, edge, None, sub.num_sampled_nodes, sub.num_sampled_edges,
                                 metadata=metadata)
        parts = _topology.split_hetero(sub, src.blocks)
        return HeteroSamplerOutput(
            node={t: ids.cpu() for t, ids in zip(src.node_types, parts.n_id, strict=True)},
            row={et: ei[0].cpu() for et, ei in zip(src.edge_types, parts.edge_index, strict=True)},
            col={et: ei[1].cpu() for et, ei in zip(src.edge_types, parts.edge_index, strict=True)},
            edge={et: e.cpu() for et, e in zip(src.edge_types, parts.e_id, strict=True)},
            batch=None,
            num_sampled_nodes=dict(zip(src.node_types, parts.num_sampled_nodes, strict=True)),
            num_sampled_edges=dict(zip(src.edge_types, parts.num_sampled_edges, strict=True)),
            metadata=metadata)

    def sample_from_edges(self, index: Any, neg_sampling: Any = None) -> NoReturn:
        raise NotImplementedError("NodeSampler samples around seed nodes only (no link prediction loaders)")


__all__ = ["NodeSampler", "UnifiedFeatureStore", "make_graph_store"]
