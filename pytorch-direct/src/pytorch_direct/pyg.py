"""PyG integration: a ``FeatureStore`` whose tensors are unified tensors, so loaders such as ``NeighborLoader``
(given ``(feature_store, graph_store)``) fetch node features straight from host memory into GPU memory, gathered
by the GPU (no CPU gather, no staging copy).

    fs = UnifiedFeatureStore(device="cuda")
    fs.put_tensor(x, group_name=None, attr_name="x", index=None)     # registered/copied once
    gs = make_graph_store(edge_index, num_nodes=x.size(0))
    loader = NeighborLoader((fs, gs), num_neighbors=[10, 10], batch_size=1024)

Inside DataLoader worker processes (``num_workers > 0``) no CUDA call is allowed, so features are gathered on the
CPU there and moved by the loader as usual; in the main process (``num_workers=0``) they are gathered on ``device``.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    from torch_geometric.data import EdgeAttr, FeatureStore, GraphStore, TensorAttr
except ImportError as e:  # pragma: no cover - only without torch_geometric
    raise ImportError("pytorch_direct.pyg needs torch_geometric: pip install torch_geometric") from e

from ._create import unified
from ._tensor import UnifiedTensor


def _key(attr: TensorAttr) -> tuple:
    return (attr.group_name, attr.attr_name)


class UnifiedFeatureStore(FeatureStore):
    """Node (or edge) feature tensors held as unified tensors; ``get_tensor`` with an index gathers on ``device``.

    ``device``: where gathered rows go ("cuda", "cuda:1", or "cpu"). ``copy``: put_tensor copies into a new
    allocation of kind ``memory`` (True) or registers the given tensor in place (False, the default; the tensor
    must be contiguous). ``memory`` (see :func:`pytorch_direct.empty`): "auto" puts copies of 256 MiB and more in
    managed memory, whose random rows the GPU reads fastest, but which forked DataLoader workers cannot read: with
    ``num_workers > 0`` (fork), pass memory="pinned" or copy=False."""

    def __init__(self, device: str | torch.device = "cuda", *, copy: bool = False, memory: str = "auto") -> None:
        super().__init__()
        self.device = torch.device(device)
        self.copy = copy
        self.memory = memory
        self._tensors: dict[tuple, UnifiedTensor] = {}

    def _put_tensor(self, tensor: Tensor, attr: TensorAttr) -> bool:
        if attr.is_set("index") and attr.index is not None:
            existing = self._tensors.get(_key(attr))
            if existing is None:
                raise KeyError(f"no tensor {_key(attr)} to update rows of; put the whole tensor first")
            existing[attr.index.to(self.device) if self.device.type == "cuda" else attr.index] = tensor.to(
                self.device)
            return True
        if self.copy or not tensor.is_contiguous():
            self._tensors[_key(attr)] = unified(tensor.detach().cpu(), copy=True, memory=self.memory)
        else:
            self._tensors[_key(attr)] = unified(tensor.detach().cpu())
        return True

    def _target_device(self) -> torch.device:
        # No CUDA in forked DataLoader workers: gather on the CPU there.
        if self.device.type == "cuda" and torch.utils.data.get_worker_info() is None:
            return self.device
        return torch.device("cpu")

    def _get_tensor(self, attr: TensorAttr) -> Tensor | None:
        table = self._tensors.get(_key(attr))
        if table is None:
            return None
        index = attr.index if attr.is_set("index") else None
        if index is None:
            return table
        if isinstance(index, slice):
            return table[index]
        index = torch.as_tensor(index)
        if index.dtype not in (torch.int32, torch.int64):
            index = index.long()
        return table[index.to(self._target_device(), non_blocking=True)]

    def _remove_tensor(self, attr: TensorAttr) -> bool:
        return self._tensors.pop(_key(attr), None) is not None

    def _get_tensor_size(self, attr: TensorAttr) -> tuple[int, ...] | None:
        table = self._tensors.get(_key(attr))
        return tuple(table.shape) if table is not None else None

    def get_all_tensor_attrs(self) -> list[TensorAttr]:
        return [TensorAttr(group_name=g, attr_name=a) for (g, a) in self._tensors]


class EdgeIndexGraphStore(GraphStore):
    """A minimal in-memory ``GraphStore`` (edge indices in any layout PyG supports), to pair with the feature store."""

    def __init__(self) -> None:
        super().__init__()
        self._store: dict[tuple, object] = {}

    @staticmethod
    def _k(attr: EdgeAttr) -> tuple:
        return (attr.edge_type, attr.layout.value, attr.is_sorted, attr.size)

    def _put_edge_index(self, edge_index, edge_attr: EdgeAttr) -> bool:
        self._store[self._k(edge_attr)] = edge_index
        return True

    def _get_edge_index(self, edge_attr: EdgeAttr):
        return self._store.get(self._k(edge_attr))

    def _remove_edge_index(self, edge_attr: EdgeAttr) -> bool:
        return self._store.pop(self._k(edge_attr), None) is not None

    def get_all_edge_attrs(self) -> list[EdgeAttr]:
        return [EdgeAttr(*k) for k in self._store]


def make_graph_store(edge_index: Tensor, num_nodes: int, edge_type=None) -> EdgeIndexGraphStore:
    """A graph store holding one COO edge index (homogeneous when edge_type is None)."""
    gs = EdgeIndexGraphStore()
    gs.put_edge_index((edge_index[0], edge_index[1]), edge_type=edge_type, layout="coo", size=(num_nodes, num_nodes))
    return gs
