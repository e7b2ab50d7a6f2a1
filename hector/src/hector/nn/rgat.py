"""RGAT (Busbridge et al.) in two flavours, PyG-compatible: ``RGATConv(in, out, R, heads=H)(x, edge_index, edge_type)``.

For an edge j -> i of relation r, with ``h = x W_r`` (``W_r``: [in, heads*out]):

    score_ij = leaky_relu(h_i Q + h_j K)                (one score per head; "additive-self-attention")
    score_ij = (h_i Q) * (h_j K)                        ("multiplicative-self-attention")
    alpha_ij = softmax over all edges into i (max-subtracted), then dropout
    out_i    = concat_heads(sum_j alpha_ij * (x_j W_r)) + bias      (or the mean over heads, concat=False)

``attention="shared"`` is PyG's ``RGATConv`` (across-relation attention, ``mod=None``): one pair Q, K
([heads*out, heads]) shared by all relations; parameters ``weight``/``basis``+``att``, ``q``, ``k``, ``bias``
match PyG's names and shapes. ``attention="per_relation"`` is Hector's RGAT: every relation has its own Q_r, K_r
([R, heads*out, heads]), which PyG cannot express. Both compile to the same passes: the destination term
``(x_i W_r) Q_r`` is reordered to ``x_i (W_r Q_r)`` (the per-edge [heads*out] product is never built), and the
source terms are computed once per unique (source, relation) pair.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..ir.builder import Builder, Value
from .base import RelationalLayer, glorot_, positive_int

# Parameters PyG's RGATConv always allocates but uses only in its ``mod`` variants (which hector does not implement):
# a PyG state_dict carries them, and loading it into hector drops them (with mod=None PyG never reads them either).
PYG_UNUSED = ("w", "l1", "b1", "l2", "b2")


class RGATConv(RelationalLayer):
    r"""Relational graph attention (RGAT): PyG's ``RGATConv`` call and argument names, plus Hector's per-relation
    attention.

    For an edge :math:`j \to i` of relation :math:`r`, with :math:`h_j = x_j W_r` split into ``heads`` heads of
    ``out_channels``:

    .. math::
        s_{ij} = \mathrm{leaky\_relu}(x_i W_r Q + x_j W_r K), \quad
        \alpha_{ij} = \mathrm{softmax}_{j \in N(i)}(s_{ij}), \quad
        out_i = \Vert_{heads} \sum_j \alpha_{ij}\, x_j W_r + b

    (``Q, K`` per relation with ``attention="per_relation"``; :math:`s_{ij} = (x_i W_r Q)(x_j W_r K)` with
    ``attention_mode="multiplicative-self-attention"``; the mean over heads with ``concat=False``; plus
    :math:`x_i \Theta_{root}` with ``root_weight=True``). The softmax runs over all in-edges of ``i``
    (PyG's "across-relation"), max-subtracted.

    Args:
        in_channels: input width ``F_in``.
        out_channels: width per head ``C``.
        num_relations: ``R``; edge types lie in [0, R).
        num_bases: basis decomposition ``W_r = sum_b att[r, b] basis[b]`` (PyG's names) instead of one ``weight``
            per relation.
        num_blocks, mod, dim, edge_dim: PyG options hector does not implement; only their defaults (None, None, 1,
            None) are accepted, anything else raises ``NotImplementedError`` naming the option.
        attention_mechanism: ``"across-relation"`` (PyG's default, the only one implemented).
        attention_mode: ``"additive-self-attention"`` (default) or ``"multiplicative-self-attention"``.
        heads: ``H``.
        concat: concatenate the heads (output ``H*C``) or average them (output ``C``).
        negative_slope: of the leaky ReLU.
        dropout: on the attention weights, in training.
        bias: add a learned bias.
        attention: ``"per_relation"`` (default, Hector's RGAT: ``q``, ``k`` are [R, H*C, H]) or ``"shared"``
            (PyG's formula: ``q``, ``k`` are [H*C, H]; load PyG's ``state_dict`` into this one). Keyword only.
        root_weight: add ``x_i @ root`` (not in PyG's RGATConv). Keyword only.
        optimize: see :class:`~hector.nn.RelationalLayer`. Keyword only.

    Shapes:
        ``x`` [N, F_in], ``edge_index`` [2, E], ``edge_type`` [E] -> [N, H*C] (``concat``) or [N, C].

    PyG's state_dict loads strictly (``load_state_dict(pyg_conv.state_dict())``) into a layer built with
    ``attention="shared"`` and the same sizes; PyG's ``w``, ``l1``, ``b1``, ``l2``, ``b2`` (used by its ``mod``
    variants only) are dropped.
    """

    def __init__(self, in_channels: int, out_channels: int, num_relations: int, num_bases: int | None = None,
                 num_blocks: int | None = None, mod: str | None = None,
                 attention_mechanism: str = "across-relation", attention_mode: str = "additive-self-attention",
                 heads: int = 1, dim: int = 1, concat: bool = True, negative_slope: float = 0.2,
                 dropout: float = 0.0, edge_dim: int | None = None, bias: bool = True, *,
                 attention: str = "per_relation", root_weight: bool = False, optimize: Any = "auto"):
        super().__init__(num_relations, optimize=optimize)
        in_channels = positive_int("RGATConv", "in_channels", in_channels)
        out_channels = positive_int("RGATConv", "out_channels", out_channels)
        heads = positive_int("RGATConv", "heads", heads)
        if num_bases is not None:
            num_bases = positive_int("RGATConv", "num_bases", num_bases)
        if attention not in ("shared", "per_relation"):
            raise ValueError(f"attention must be 'shared' (PyG) or 'per_relation' (Hector), got {attention!r}")
        for name, value, default in (("num_blocks", num_blocks, None), ("mod", mod, None), ("dim", dim, 1),
                                     ("edge_dim", edge_dim, None)):
            if value != default:
                raise NotImplementedError(f"RGATConv: {name}={value!r} (a PyG option) is not implemented by hector; "
                                          f"only {name}={default!r} is (see the README's table of PyG arguments)")
        if attention_mechanism != "across-relation":
            raise NotImplementedError(f"RGATConv: attention_mechanism={attention_mechanism!r} is not implemented; "
                                      "hector's softmax runs over all in-edges ('across-relation')")
        if attention_mode not in ("additive-self-attention", "multiplicative-self-attention"):
            raise ValueError("attention_mode must be 'additive-self-attention' or 'multiplicative-self-attention', "
                             f"got {attention_mode!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.in_channels, self.out_channels, self.heads = in_channels, out_channels, heads
        self.concat, self.negative_slope, self.dropout = concat, float(negative_slope), float(dropout)
        self.attention, self.attention_mode, self.num_bases = attention, attention_mode, num_bases
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
            # mean over heads as a fixed linear map [heads*out, out] (not trained, not saved: it is a constant)
            self.register_buffer("head_mean", _head_mean(heads, out_channels, torch.get_default_dtype(), None),
                                 persistent=False)
        self.register_load_state_dict_pre_hook(_from_pyg_state)
        self.reset_parameters()

    def _apply(self, fn: Any, recurse: bool = True) -> RGATConv:
        super()._apply(fn, recurse)
        mean = self._buffers.get("head_mean")
        if mean is not None:
            # made again in its new dtype: a cast of the float32 1/heads (layer.double()) would keep float32's error
            self._buffers["head_mean"] = _head_mean(self.heads, self.out_channels, mean.dtype, mean.device)
        return self

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
        if self.attention_mode == "multiplicative-self-attention":
            score = h_dst.linear(q) * h_src.linear(k)
        else:
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


def _head_mean(heads: int, out_channels: int, dtype: torch.dtype, device: Any) -> torch.Tensor:
    """The mean over heads as a linear map [heads*out, out], rounded once from float64 to ``dtype``."""
    eye = torch.eye(out_channels, dtype=torch.float64, device=device)
    return (eye.repeat(heads, 1) / heads).to(dtype)


def _from_pyg_state(module: RGATConv, state_dict: dict, prefix: str, local_metadata: Any, strict: bool,
                    missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
    """load_state_dict pre-hook: a PyG RGATConv state_dict loads strictly. Drops PyG's parameters of its ``mod``
    variants and the head-mean constant older hector checkpoints saved, and names a per-relation/shared mismatch."""
    for name in PYG_UNUSED + ("head_mean",):
        state_dict.pop(prefix + name, None)
    q = state_dict.get(prefix + "q")
    if q is not None and q.dim() != module.q.dim():
        have = "PyG's shared attention (q of [heads*out, heads])" if q.dim() == 2 else \
            "per-relation attention (q of [R, heads*out, heads])"
        want = "shared" if q.dim() == 2 else "per_relation"
        error_msgs.append(f"the state_dict holds {have}, this layer has attention={module.attention!r}: build it "
                          f"with RGATConv(..., attention={want!r})")
        state_dict.pop(prefix + "q")
        state_dict.pop(prefix + "k", None)
