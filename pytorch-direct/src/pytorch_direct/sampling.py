"""Neighbour sampling and a PyG-compatible mini-batch loader for GNN training on graphs whose topology and features
live in host memory (unified tensors, read zero-copy by the GPU), in GPU memory, or, without a GPU, on the CPU.

    from pytorch_direct.sampling import NeighborLoader

    loader = NeighborLoader(data, num_neighbors=[15, 10], input_nodes=data.train_mask, batch_size=1024,
                            shuffle=True)
    for batch in loader:                 # torch_geometric Data / HeteroData, on the GPU when there is one
        out = model(batch.x, batch.edge_index)[: batch.batch_size]

- :class:`NeighborLoader`: ``torch_geometric.loader.NeighborLoader``'s batches (``n_id``, ``e_id``, ``input_id``,
  ``batch_size``, ``num_sampled_nodes``, ``num_sampled_edges``, the gathered attributes) from a ``Data``, a
  ``HeteroData``, a PyG ``(FeatureStore, GraphStore)`` pair or a ``(features, Topology)`` pair, without pyg-lib or
  torch-sparse; the next batches are made ahead by a background thread on their own CUDA stream.
- :class:`NeighborSampler` and :class:`Topology`: the sampler alone, over a graph in CSC form.
- ``pytorch_direct.pyg.NodeSampler``: the same sampler as a PyG ``BaseSampler``, for PyG's own ``NodeLoader``.

torch_geometric is needed for the loader's batches only (``pip install torch_geometric``); the sampler works
without it.
"""

from ._loader import LoaderStats, NeighborLoader
from ._sample import NeighborSampler, SampledSubgraph, Topology

__all__ = ["LoaderStats", "NeighborLoader", "NeighborSampler", "SampledSubgraph", "Topology"]
