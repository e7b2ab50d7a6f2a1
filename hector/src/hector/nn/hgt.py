"""HGT (Hu et al.) on a typed homogeneous graph: ``HGTConv(in, out, T, R, heads)(x, edge_index, edge_type, node_type)``.

Per node type tau: ``K = x Wk[tau] + bk[tau]``, likewise Q and V ([in, out], split into heads of size D). For an edge
j -> i of relation r:

    k_ij = K_j M_k[r]  (per head, [D, D]),   v_ij = V_j M_v[r]
    alpha_ij = softmax over edges into i of (q_i . k_ij) * p[r] / sqrt(D), then dropout
    a_i = gelu(sum_j alpha_ij v_ij) W_out[tau_i] + b_out[tau_i]
    out_i = s a_i + (1 - s) x_i with s = sigmoid(skip[tau_i])   (only when in == out; otherwise a_i)

This is PyG's ``HGTConv`` formula (PyG takes dicts per node/edge type; :func:`hector.nn.hgt.from_pyg_hgt`
copies its weights). ``k_ij`` and ``v_ij`` depend only on (source, relation): compacted. Reordering can fuse
``K W_att`` into one map typed by (source node type, relation) when the cost model says it pays.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..ir.builder import Builder, Value
from .base import RelationalLayer, glorot_


class HGTConv(RelationalLayer):
    def __init__(self, in_channels: int, out_channels: int, num_node_types: int, num_relations: int,
                 heads: int = 1, dropout: float = 0.0, optimize="auto"):
        super().__init__(num_relations, num_node_types=num_node_types, optimize=optimize)
        if out_channels % heads:
            raise ValueError(f"out_channels ({out_channels}) must be divisible by heads ({heads})")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.in_channels, self.out_channels, self.heads = int(in_channels), int(out_channels), int(heads)
        self.dropout = float(dropout)
        t, f, h, d = num_node_types, out_channels, heads, out_channels // heads
        for name in ("k", "q", "v"):
            self.register_parameter(f"{name}_weight", nn.Parameter(torch.empty(t, in_channels, f)))
            self.register_parameter(f"{name}_bias", nn.Parameter(torch.empty(t, f)))
        self.k_rel = nn.Parameter(torch.empty(num_relations, h, d, d))
        self.v_rel = nn.Parameter(torch.empty(num_relations, h, d, d))
        self.p_rel = nn.Parameter(torch.empty(num_relations, h))
        self.out_weight = nn.Parameter(torch.empty(t, f, f))
        self.out_bias = nn.Parameter(torch.empty(t, f))
        self.skip = nn.Parameter(torch.empty(t))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        d = self.out_channels // self.heads
        for name in ("k", "q", "v"):
            glorot_(getattr(self, f"{name}_weight"), self.in_channels, self.out_channels)
            nn.init.zeros_(getattr(self, f"{name}_bias"))
        glorot_(self.k_rel, d, d)
        glorot_(self.v_rel, d, d)
        glorot_(self.out_weight, self.out_channels, self.out_channels)
        nn.init.zeros_(self.out_bias)
        nn.init.ones_(self.p_rel)
        nn.init.ones_(self.skip)

    def program(self, b: Builder) -> Value:
        h, d = self.heads, self.out_channels // self.heads
        x = b.node_input("x", self.in_channels)

        def typed_linear(name: str) -> Value:
            return x.linear(b.param(f"{name}_weight", by="ntype")) + b.param(f"{name}_bias", by="ntype")

        k, q, v = (typed_linear(n).heads(h) for n in ("k", "q", "v"))
        k_e = b.src(k).linear(b.param("k_rel", by="etype"))
        v_e = b.src(v).linear(b.param("v_rel", by="etype"))
        score = b.dst(q).dot(k_e) * b.select(b.param("p_rel", by="etype"), k_e) / math.sqrt(d)
        alpha = b.dropout(b.edge_softmax(score), self.dropout)
        agg = b.sum_to_dst(v_e * alpha).flat()
        a = agg.gelu().linear(b.param("out_weight", by="ntype")) + b.param("out_bias", by="ntype")
        if self.in_channels != self.out_channels:
            return a
        s = b.select(b.param("skip", by="ntype"), x).sigmoid()
        return x + s * (a - x)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.in_channels}, {self.out_channels}, heads={self.heads}, "
                f"node_types={self.num_node_types}, relations={self.num_relations})")


def load_pyg_hgt(layer: HGTConv, pyg_conv, node_types: list[str], edge_types: list[tuple[str, str, str]]) -> None:
    """Copy the weights of a ``torch_geometric.nn.HGTConv`` into ``layer``.

    Node type id ``t`` of ``layer`` is ``node_types[t]`` and relation ``r`` is ``edge_types[r]``, in the order of
    PyG's ``metadata`` (``pyg_conv.node_types`` / ``pyg_conv.edge_types``).
    """
    f, h = layer.out_channels, layer.heads
    d = f // h
    rels = list(pyg_conv.edge_types)
    if list(edge_types) != rels or len(edge_types) != layer.num_relations:
        raise ValueError("edge_types must list the PyG layer's edge types in its metadata order")
    with torch.no_grad():
        for t, nt in enumerate(node_types):
            lin = pyg_conv.kqv_lin.lins[nt]
            w, bias = lin.weight.t(), lin.bias  # [in, 3F]: k | q | v
            for i, name in enumerate(("k", "q", "v")):
                getattr(layer, f"{name}_weight")[t].copy_(w[:, i * f:(i + 1) * f])
                getattr(layer, f"{name}_bias")[t].copy_(bias[i * f:(i + 1) * f])
            out = pyg_conv.out_lin.lins[nt]
            layer.out_weight[t].copy_(out.weight.t())
            layer.out_bias[t].copy_(out.bias)
            layer.skip[t].copy_(pyg_conv.skip[nt].reshape(()))
        num_rel = len(rels)
        for r, et in enumerate(rels):
            layer.p_rel[r].copy_(pyg_conv.p_rel["__".join(et)].reshape(h))
            for head in range(h):  # PyG's HeteroLinear type id is head * num_edge_types + relation
                layer.k_rel[r, head].copy_(pyg_conv.k_rel.weight[head * num_rel + r].reshape(d, d))
                layer.v_rel[r, head].copy_(pyg_conv.v_rel.weight[head * num_rel + r].reshape(d, d))
