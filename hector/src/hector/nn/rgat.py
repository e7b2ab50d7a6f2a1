"""RGAT (Busbridge et al.) in two flavours, PyG-compatible: ``RGATConv(in, out, R, heads)(x, edge_index, edge_type)``.

For an edge j -> i of relation r, with ``h = x W_r`` (``W_r``: [in, heads*out]):

    score_ij = leaky_relu(h_i Q + h_j K)                (one score per head)
    alpha_ij = softmax over all edges into i (max-subtracted), then dropout
    out_i    = concat_heads(sum_j alpha_ij * (x_j W_r)) + bias      (or the mean over heads, concat=False)

``attention="shared"`` is PyG's ``RGATConv`` (additive self-attention, across-relation, ``mod=None``): one pair
Q, K ([heads*out, heads]) shared by all relations; parameters ``weight``/``basis``+``att``, ``q``, ``k``, ``bias``
match PyG's names and shapes. ``attention="per_relation"`` is Hector's RGAT: every relation has its own Q_r, K_r
([R, heads*out, heads]), which PyG cannot express. Both compile to the same passes: the destination term
``(x_i W_r) Q_r`` is reordered to ``x_i (W_r Q_r)`` (the per-edge [heads*out] product is never built), and the
source terms are computed once per unique (source, relation) pair.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ir.builder import Builder, Value
from .base import RelationalLayer, glorot_


class RGATConv(RelationalLayer):
    def __init__(self, in_channels: int, out_channels: int, num_relations: int, heads: int = 1,
                 concat: bool = True, negative_slope: float = 0.2, dropout: float = 0.0, bias: bool = True,
                 num_bases: int | None = None, attention: str = "per_relation", root_weight: bool = False,
                 optimize="auto"):
        super().__init__(num_relations, optimize=optimize)
        if attention not in ("shared", "per_relation"):
            raise ValueError(f"attention must be 'shared' (PyG) or 'per_relation' (Hector), got {attention!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.in_channels, self.out_channels, self.heads = int(in_channels), int(out_channels), int(heads)
        self.concat, self.negative_slope, self.dropout = concat, float(negative_slope), float(dropout)
        self.attention, self.num_bases = attention, num_bases
        hc = heads * out_channels
        if num_bases is not None:
            self.basis = nn.Parameter(torch.empty(num_bases, in_channels, hc))
            self.att = nn.Parameter(torch.empty(num_relations, num_bases))
            self.register_parameter("weight", None)
        else:
            self.weight = nn.Parameter(torch.empty(num_relations, in_channels, hc))
        lead = (num_relations,) if attention == "per_relation" else ()
        self.q = nn.Parameter(torch.empty(*lead, hc, heads))
        self.k = nn.Parameter(torch.empty(*lead, hc, heads))
        self.root = nn.Parameter(torch.empty(in_channels, hc if concat else out_channels)) if root_weight else None
        self.bias = nn.Parameter(torch.empty(hc if concat else out_channels)) if bias else None
        if not concat:
            # mean over heads as a fixed linear map [heads*out, out] (not trained)
            self.register_buffer("head_mean", torch.eye(out_channels).repeat(heads, 1) / heads)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        hc = self.heads * self.out_channels
        if self.num_bases is not None:
            glorot_(self.basis, self.in_channels, hc)
            glorot_(self.att, self.num_relations, self.num_bases)
        else:
            glorot_(self.weight, self.in_channels, hc)
        glorot_(self.q, hc, self.heads)
        glorot_(self.k, hc, self.heads)
        if self.root is not None:
            glorot_(self.root, self.in_channels, self.root.size(1))
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def program(self, b: Builder) -> Value:
        x = b.node_input("x", self.in_channels)
        if self.num_bases is not None:
            w = b.einsum("rb,bio->rio", b.param("att"), b.param("basis"), by="etype")
        else:
            w = b.param("weight", by="etype")
        by = "etype" if self.attention == "per_relation" else ()
        q, k = b.param("q", by=by), b.param("k", by=by)
        h_src = b.src(x).linear(w)
        h_dst = b.dst(x).linear(w)
        score = (h_dst.linear(q) + h_src.linear(k)).leaky_relu(self.negative_slope)
        alpha = b.dropout(b.edge_softmax(score), self.dropout)
        out = b.sum_to_dst(h_src.heads(self.heads) * alpha).flat()
        if not self.concat:
            out = out.linear(b.param("head_mean"))
        if self.root is not None:
            out = out + x.linear(b.param("root"))
        if self.bias is not None:
            out = out + b.param("bias")
        return out

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.in_channels}, {self.out_channels}, heads={self.heads}, "
                f"attention={self.attention!r})")
