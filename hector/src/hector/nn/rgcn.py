"""RGCN (Schlichtkrull et al.), PyG-compatible: ``RGCNConv(in, out, num_relations)(x, edge_index, edge_type)``.

    out_i = x_i Theta_root + sum_r sum_{j in N_r(i)} c_{i,r} x_j W_r + bias,   c_{i,r} = 1/|N_r(i)| ("mean")

Same formula and parameter names as ``torch_geometric.nn.RGCNConv`` (``weight``, ``comp`` with ``num_bases``,
``root``, ``bias``), so ``load_state_dict`` works both ways. Basis decomposition ``W_r = sum_b comp[r, b] B_b`` is
an einsum over params in the program (computed once per call). Per-edge messages ``x_j W_r`` depend only on
(source, relation): compact materialisation computes them once per unique pair.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from ..ir.builder import Builder, Value
from .base import RelationalLayer, glorot_, positive_int


class RGCNConv(RelationalLayer):
    r"""Relational graph convolution (RGCN), PyG's ``RGCNConv`` formula, names and call.

    .. math::
        out_i = x_i \Theta_{root} + \sum_{r} \sum_{j \in N_r(i)} c_{i,r}\, x_j W_r + b, \qquad
        c_{i,r} = 1 / |N_r(i)| \ (\text{aggr="mean"}) \text{ or } 1 \ (\text{"add"})

    with basis decomposition :math:`W_r = \sum_b comp[r, b]\, weight[b]` when ``num_bases`` is given.

    Args:
        in_channels: input width ``F_in``, one int (not PyG's bipartite tuple: x is one node set).
        out_channels: output width ``F_out``.
        num_relations: ``R``; edge types lie in [0, R).
        num_bases: number of bases (None: one ``weight`` [R, F_in, F_out] per relation).
        num_blocks: PyG's block-diagonal decomposition: not implemented (only None).
        aggr: ``"mean"`` (per relation and destination) or ``"add"`` (``"sum"``).
        root_weight: add ``x_i @ root``.
        is_sorted: PyG's hint that edges are sorted by relation; no effect here (a warning says so).
        bias: add a learned bias.
        optimize: see :class:`~hector.nn.RelationalLayer`.

    Shapes:
        ``x`` [N, F_in], ``edge_index`` [2, E], ``edge_type`` [E] -> [N, F_out].

    Parameters ``weight``, ``comp``, ``root``, ``bias`` have PyG's names and shapes: ``load_state_dict`` works
    both ways, strictly.
    """

    def __init__(self, in_channels: int, out_channels: int, num_relations: int, num_bases: int | None = None,
                 num_blocks: int | None = None, aggr: str = "mean", root_weight: bool = True, is_sorted: bool = False,
                 bias: bool = True, optimize: Any = "auto"):
        super().__init__(num_relations, optimize=optimize)
        in_channels = positive_int("RGCNConv", "in_channels", in_channels)
        out_channels = positive_int("RGCNConv", "out_channels", out_channels)
        if num_bases is not None:
            num_bases = positive_int("RGCNConv", "num_bases", num_bases)
        if num_blocks is not None:
            raise NotImplementedError(f"RGCNConv: num_blocks={num_blocks} (PyG's block-diagonal decomposition) is not "
                                      "implemented by hector; use num_bases or full weights")
        if is_sorted:
            warnings.warn("RGCNConv(is_sorted=True) has no effect in hector: it orders edges itself, once per graph",
                          stacklevel=2)
        if aggr not in ("mean", "add", "sum"):
            raise ValueError(f"aggr must be 'mean' or 'add', got {aggr!r}")
        self.in_channels, self.out_channels = in_channels, out_channels
        self.num_bases, self.aggr = num_bases, aggr
        if num_bases is not None:
            self.weight = nn.Parameter(torch.empty(num_bases, in_channels, out_channels))
            self.comp = nn.Parameter(torch.empty(num_relations, num_bases))
        else:
            self.weight = nn.Parameter(torch.empty(num_relations, in_channels, out_channels))
            self.register_parameter("comp", None)
        self.root = nn.Parameter(torch.empty(in_channels, out_channels)) if root_weight else None
        self.bias = nn.Parameter(torch.empty(out_channels)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        glorot_(self.weight, self.in_channels, self.out_channels)
        if self.comp is not None:
            glorot_(self.comp, self.num_relations, self.num_bases)
        if self.root is not None:
            glorot_(self.root, self.in_channels, self.out_channels)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def program(self, b: Builder) -> Value:
        x = b.node_input("x", self.in_channels)
        if self.num_bases is not None:
            w = b.einsum("rb,bio->rio", b.param("comp"), b.param("weight"), by="etype")
        else:
            w = b.param("weight", by="etype")
        msg = b.src(x).linear(w)
        if self.aggr == "mean":
            msg = msg * b.graph_const("inv_deg_dst_rel")
        out = b.sum_to_dst(msg)
        if self.root is not None:
            out = out + x.linear(b.param("root"))
        if self.bias is not None:
            out = out + b.param("bias")
        return out

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.in_channels}, {self.out_channels}, "
                f"num_relations={self.num_relations})")
