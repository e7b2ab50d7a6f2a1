"""HGT (Hu et al.) on a typed homogeneous graph: ``HGTConv(in, out, T, R, heads)(x, edge_index, edge_type, node_type)``.

Per node type tau: ``K = x Wk[tau] + bk[tau]``, likewise Q and V ([in, out], split into heads of size D). For an edge
j -> i of relation r:

    k_ij = K_j M_k[r]  (per head, [D, D]),   v_ij = V_j M_v[r]
    alpha_ij = softmax over edges into i of (q_i . k_ij) * p[r] / sqrt(D), then dropout
    a_i = gelu(sum_j alpha_ij v_ij) W_out[tau_i] + b_out[tau_i]
    out_i = s a_i + (1 - s) x_i with s = sigmoid(skip[tau_i])   (only when in == out; otherwise a_i)

This is PyG's ``HGTConv`` formula; the layer also takes PyG's form (``metadata``, ``x_dict``,
``edge_index_dict``) and loads PyG's state_dict. ``k_ij`` and ``v_ij`` depend only on (source, relation):
compacted. Reordering can fuse ``K W_att`` into one map typed by (source node type, relation) when the cost model
says it pays.
"""

from __future__ import annotations

import math
import weakref
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..errors import GraphInputError
from ..ir.builder import Builder, Value
from ..runtime.graph import Graph, _check_int_tensor, tensor_key
from .base import RelationalLayer, glorot_, positive_int

Metadata = tuple[Sequence[str], Sequence[tuple[str, str, str]]]


class HGTConv(RelationalLayer):
    r"""Heterogeneous graph transformer (HGT): PyG's ``HGTConv`` formula, in two calling forms.

    Per node type :math:`\tau`: :math:`K = x W_k[\tau] + b_k[\tau]`, likewise :math:`Q, V` ([in, out], split into
    ``heads`` heads of :math:`D = out / heads`). For an edge :math:`j \to i` of relation :math:`r`:

    .. math::
        \alpha_{ij} = \mathrm{softmax}_{j \in N(i)}\big((q_i \cdot K_j M_k[r])\, p[r] / \sqrt{D}\big), \quad
        a_i = \mathrm{gelu}\big(\textstyle\sum_j \alpha_{ij} V_j M_v[r]\big) W_{out}[\tau_i] + b_{out}[\tau_i]

    and :math:`out_i = s\, a_i + (1 - s)\, x_i` with :math:`s = \mathrm{sigmoid}(skip[\tau_i])` when ``in == out``
    (otherwise :math:`a_i`). Dropout applies to :math:`\alpha` in training.

    **hector's form** (a typed homogeneous graph): ``HGTConv(in, out, num_node_types, num_relations, heads=H)``,
    called as ``conv(x, edge_index, edge_type, node_type)`` with ``x`` [N, in], ``edge_index`` [2, E],
    ``edge_type`` [E] in [0, R), ``node_type`` [N] in [0, T) -> [N, out]. ``node_type`` may be left out only when
    there is one node type.

    **PyG's form**: ``HGTConv(in, out, metadata, heads=H)`` (or ``metadata=`` by keyword), ``metadata`` =
    ``(node_types, edge_types)`` as :meth:`torch_geometric.data.HeteroData.metadata` gives it, called as
    ``conv(x_dict, edge_index_dict)`` -> ``{node_type: [N_type, out]}`` for the node types that are the
    destination of an edge type (PyG leaves the others out). Node type ``t`` is ``node_types[t]``, relation ``r``
    is ``edge_types[r]``; the dicts are joined into one typed graph, cached per ``edge_index_dict`` tensors, so a
    full-graph loop prepares the graph once. ``in_channels`` may be a dict with one width for every node type.
    A PyG ``HGTConv`` state_dict loads strictly into a layer built from the same metadata.

    Args:
        in_channels: input width (an int, or PyG's dict of equal widths per node type).
        out_channels: output width, divisible by ``heads``.
        num_node_types: ``T`` (hector's form), or PyG's ``metadata`` tuple.
        num_relations: ``R`` (hector's form; None with metadata).
        heads: ``H``.
        dropout: on the attention weights, in training.
        optimize: see :class:`~hector.nn.RelationalLayer`.
        metadata: PyG's ``(node_types, edge_types)`` (keyword only), instead of ``num_node_types``.
    """

    def __init__(self, in_channels: int | Mapping[str, int], out_channels: int,
                 num_node_types: int | Metadata | None = None, num_relations: int | None = None, heads: int = 1,
                 dropout: float = 0.0, optimize: Any = "auto", *, metadata: Metadata | None = None):
        if isinstance(num_node_types, (tuple, list)):
            if metadata is not None:
                raise ValueError("HGTConv: metadata given twice (third argument and metadata=)")
            metadata, num_node_types = num_node_types, None
        self.node_types: list[str] | None = None
        self.edge_types: list[tuple[str, str, str]] | None = None
        if metadata is not None:
            if num_relations is not None or num_node_types is not None:
                raise ValueError("HGTConv(in, out, metadata, ...): pass heads by keyword (heads=H); with metadata "
                                 "the node-type and relation counts come from it (num_node_types and num_relations "
                                 "are hector's form)")
            node_types, edge_types = _check_metadata(metadata)
            num_node_types, num_relations = len(node_types), len(edge_types)
        elif num_node_types is None or num_relations is None:
            raise ValueError("HGTConv needs num_node_types and num_relations, or PyG's metadata "
                             "(node_types, edge_types)")
        if isinstance(in_channels, Mapping):
            widths = set(in_channels.values())
            if len(widths) != 1 or -1 in widths:
                raise NotImplementedError(f"HGTConv: in_channels per node type {dict(in_channels)} must be one "
                                          "width for all types (project the features to one width first); lazy "
                                          "(-1) widths are not supported")
            in_channels = widths.pop()
        super().__init__(num_relations, num_node_types=num_node_types, optimize=optimize)
        if metadata is not None:
            self.node_types, self.edge_types = node_types, edge_types
        in_channels = positive_int("HGTConv", "in_channels", in_channels)
        out_channels = positive_int("HGTConv", "out_channels", out_channels)
        heads = positive_int("HGTConv", "heads", heads)
        if out_channels % heads:
            raise ValueError(f"out_channels ({out_channels}) must be divisible by heads ({heads})")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.in_channels, self.out_channels, self.heads = in_channels, out_channels, heads
        self.dropout = float(dropout)
        t, f, h, d = self.num_node_types, out_channels, heads, out_channels // heads
        for name in ("k", "q", "v"):
            self.register_parameter(f"{name}_weight", nn.Parameter(torch.empty(t, in_channels, f)))
            self.register_parameter(f"{name}_bias", nn.Parameter(torch.empty(t, f)))
        self.k_rel = nn.Parameter(torch.empty(num_relations, h, d, d))
        self.v_rel = nn.Parameter(torch.empty(num_relations, h, d, d))
        self.p_rel = nn.Parameter(torch.empty(num_relations, h))
        self.out_weight = nn.Parameter(torch.empty(t, f, f))
        self.out_bias = nn.Parameter(torch.empty(t, f))
        self.skip = nn.Parameter(torch.empty(t))
        self.register_load_state_dict_pre_hook(_from_pyg_state)
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

    def forward(self, x: Any, edge_index: Any = None, edge_type: torch.Tensor | None = None,
                node_type: torch.Tensor | None = None) -> Any:
        """hector's form ``(x, edge_index, edge_type, node_type)`` -> [N, out], or PyG's ``(x_dict,
        edge_index_dict)`` -> ``{node_type: [N_type, out]}`` (see the class docstring)."""
        if not isinstance(x, Mapping):
            return super().forward(x, edge_index, edge_type, node_type)
        if self.node_types is None:
            raise GraphInputError("HGTConv got x_dict/edge_index_dict but was built without metadata: build it as "
                                  "HGTConv(in, out, metadata, heads=H), or call it with (x, edge_index, edge_type, "
                                  "node_type)")
        if not isinstance(edge_index, Mapping) or edge_type is not None or node_type is not None:
            raise GraphInputError("HGTConv(x_dict, edge_index_dict): the second argument must be the dict of "
                                  "[2, E] edge indices per edge type, and nothing follows it")
        xs, joined = _join(self.node_types, self.edge_types, x, edge_index, self.in_channels)
        if torch.compiler.is_compiling():
            graph_args: tuple = (joined.edge_index, joined.edge_type, joined.node_type)
        else:
            graph_args = (joined.graph(self.num_relations, self.num_node_types), None, None)
        out = super().forward(torch.cat(xs) if len(xs) > 1 else xs[0], *graph_args)
        parts = out.split(joined.counts)
        dst_types = {e[2] for e in self.edge_types}
        return {nt: part for nt, part in zip(joined.present, parts, strict=True) if nt in dst_types}

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.in_channels}, {self.out_channels}, heads={self.heads}, "
                f"node_types={self.num_node_types}, relations={self.num_relations})")


def _check_metadata(metadata: Any) -> tuple[list[str], list[tuple[str, str, str]]]:
    try:
        node_types, edge_types = metadata
        node_types = [str(n) for n in node_types]
        edge_types = [tuple(str(p) for p in e) for e in edge_types]
    except (TypeError, ValueError) as e:
        raise ValueError("metadata must be (node_types, edge_types): a list of node-type names and a list of "
                         "(source type, relation, destination type) triples, as HeteroData.metadata() gives") from e
    if not node_types or not edge_types:
        raise ValueError(f"metadata needs at least one node type and one edge type, got {metadata!r}")
    for e in edge_types:
        if len(e) != 3 or e[0] not in node_types or e[2] not in node_types:
            raise ValueError(f"edge type {e!r} must be (source type, relation, destination type) with both types in "
                             f"the node types {node_types}")
    if len(set(node_types)) != len(node_types) or len(set(edge_types)) != len(edge_types):
        raise ValueError(f"metadata lists a node or edge type twice: {metadata!r}")
    return node_types, edge_types


class _Joined:
    """PyG's per-type dicts as one typed graph: the present node types in metadata order, node type
    ``present[i]`` taking ``counts[i]`` consecutive rows. The graph part is shared by calls on the same
    ``edge_index_dict`` tensors."""

    def __init__(self, present: list[str], counts: list[int], edge_index: torch.Tensor, edge_type: torch.Tensor,
                 node_type: torch.Tensor, edge_types: list[tuple[str, str, str]]):
        self.present, self.counts = present, counts
        self.edge_index, self.edge_type, self.node_type = edge_index, edge_type, node_type
        self.edge_types = edge_types
        self._graph: Graph | None = None

    def graph(self, num_relations: int, num_node_types: int) -> Graph:
        if self._graph is None:
            try:
                self._graph = Graph(self.edge_index, self.edge_type, sum(self.counts), num_relations,
                                    self.node_type, num_node_types)
            except GraphInputError:
                self._name_bad_id()
                raise
        return self._graph

    def _name_bad_id(self) -> None:
        """Raises the error that names the edge type and node type of an id outside its node type's rows (joined
        as the row past the last, see :func:`_join`), if there is one (read on the host: only on the error path)."""
        total = sum(self.counts)
        bad = (self.edge_index == total).nonzero()
        if not bad.numel():
            return
        row, edge = bad[0].tolist()
        e = self.edge_types[int(self.edge_type[edge])]
        nt = e[0] if row == 0 else e[2]
        count = self.counts[self.present.index(nt)]
        raise GraphInputError(f"edge_index_dict[{e!r}] row {row} ({'source' if row == 0 else 'destination'} ids "
                              f"of node type {nt!r}) holds an id outside [0, {count}); ids index the rows of "
                              f"x_dict[{nt!r}] ({count} nodes)")


# joined graphs of recently seen edge_index_dicts (tensor identity and version, node counts): a full-graph loop
# joins and prepares its graph once, each new mini-batch once
_JOINED: OrderedDict[tuple, tuple[list[weakref.ref], _Joined]] = OrderedDict()
_MAX_JOINED = 16


def _join(node_types: list[str], edge_types: list[tuple[str, str, str]], x_dict: Mapping[str, torch.Tensor],
          edge_index_dict: Mapping[Any, torch.Tensor], in_channels: int) -> tuple[list[torch.Tensor], _Joined]:
    unknown = [k for k in x_dict if k not in node_types]
    if unknown:
        raise GraphInputError(f"x_dict has node types {unknown} that are not in the layer's metadata {node_types}")
    present = [nt for nt in node_types if nt in x_dict]
    xs = [x_dict[nt] for nt in present]
    for nt, x in zip(present, xs, strict=True):
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise GraphInputError(f"x_dict[{nt!r}] must be a [num_nodes, in_channels] tensor, got "
                                  f"{type(x).__name__} {tuple(x.shape) if isinstance(x, torch.Tensor) else ''}")
        # checked per type here: joined by torch.cat, other widths would fail inside it and other dtypes be promoted
        if not x.is_floating_point():
            raise GraphInputError(f"x_dict[{nt!r}] must be floating point, got {x.dtype}; convert with .float()")
        if x.size(1) != in_channels:
            raise GraphInputError(f"x_dict[{nt!r}] has {x.size(1)} features, the layer expects "
                                  f"in_channels={in_channels}")
        if x.dtype != xs[0].dtype or x.device != xs[0].device:
            raise GraphInputError(f"x_dict[{nt!r}] is {x.dtype} on {x.device} but x_dict[{present[0]!r}] "
                                  f"{xs[0].dtype} on {xs[0].device}; give every node type's features one dtype "
                                  "and device")
    if not xs:
        raise GraphInputError(f"x_dict holds none of the layer's node types {node_types}")
    counts = [int(x.size(0)) for x in xs]
    offset = dict(zip(present, [sum(counts[:i]) for i in range(len(counts))], strict=True))
    rel_of = {e: r for r, e in enumerate(edge_types)}
    items = []
    for key, ei in edge_index_dict.items():
        e = tuple(key) if isinstance(key, (tuple, list)) else key
        if e not in rel_of:
            raise GraphInputError(f"edge type {key!r} is not in the layer's metadata edge types {edge_types}")
        if e[0] not in offset or e[2] not in offset:
            missing = e[0] if e[0] not in offset else e[2]
            raise GraphInputError(f"edge type {key!r} connects node type {missing!r}, which x_dict lacks")
        if not isinstance(ei, torch.Tensor) or ei.dim() != 2 or ei.size(0) != 2:
            raise GraphInputError(f"edge_index_dict[{key!r}] must be a [2, E] integer tensor (sparse adjacency "
                                  f"types are not supported), got {type(ei).__name__} "
                                  f"{tuple(ei.shape) if isinstance(ei, torch.Tensor) else ''}")
        _check_int_tensor(f"edge_index_dict[{key!r}]", ei, 2)
        items.append((rel_of[e], e, ei))
    device = xs[0].device
    compiling = torch.compiler.is_compiling()
    # the layer's edge-type list is part of the key: it numbers the relations (edge_type), so a layer whose
    # metadata lists them in another order, or lists more, must not take the graph another layer joined
    key = None
    if not compiling:  # (under torch.compile the dicts are joined on every call: fake tensors have no data)
        key = (tuple(node_types), tuple(edge_types), tuple(present), tuple(counts),
               tuple((e, *tensor_key(ei)) for _, e, ei in items), str(device))
        hit = _JOINED.get(key)
        if hit is not None and all(r() is ei for r, (_, _, ei) in zip(hit[0], items, strict=True)):
            _JOINED.move_to_end(key)
            return xs, hit[1]
    type_id = {nt: t for t, nt in enumerate(node_types)}
    node_type = torch.cat([torch.full((c,), type_id[nt], dtype=torch.long, device=device)
                           for nt, c in zip(present, counts, strict=True)])
    if items:
        # each type's ids are checked against its own node count: an id past it would otherwise land on a node of
        # the next type in the joined graph (silently wrong), so it is joined as the row past the last, which the
        # graph's check rejects (and _Joined names); no host read for valid ids
        total = sum(counts)
        count_of = dict(zip(present, counts, strict=True))

        def joined_ids(e: tuple[str, str, str], ei: torch.Tensor) -> torch.Tensor:
            ei = ei.to(device=device, dtype=torch.long)
            # (one host-to-device copy per edge type: each type's node count and offset, for sources and
            # destinations)
            bounds = torch.tensor([[count_of[e[0]], offset[e[0]]], [count_of[e[2]], offset[e[2]]]], device=device)
            upper, shift = bounds[:, :1], bounds[:, 1:]
            return torch.where((ei >= 0) & (ei < upper), ei + shift, total)

        edge_index = torch.cat([joined_ids(e, ei) for _, e, ei in items], dim=1)
        edge_type = torch.cat([torch.full((ei.size(1),), r, dtype=torch.long, device=device) for r, _, ei in items])
    else:
        edge_index = torch.empty(2, 0, dtype=torch.long, device=device)
        edge_type = torch.empty(0, dtype=torch.long, device=device)
    joined = _Joined(present, counts, edge_index, edge_type, node_type, edge_types)
    if not compiling:
        _JOINED[key] = ([weakref.ref(ei) for _, _, ei in items], joined)
        while len(_JOINED) > _MAX_JOINED:
            _JOINED.popitem(last=False)
    return xs, joined


def _pyg_to_hector(state: Mapping[str, torch.Tensor], prefix: str, node_types: list[str],
                   edge_types: list[tuple[str, str, str]], out_channels: int, heads: int,
                   used: set[str] | None = None) -> dict[str, torch.Tensor]:
    """hector's HGTConv tensors (names without prefix) from the entries of a PyG HGTConv state_dict (the keys
    read are added to ``used``). A missing entry raises KeyError, weights of another edge-type count ValueError."""
    f, h = out_channels, heads
    num_rel = len(edge_types)

    def get(name: str) -> torch.Tensor:
        key = prefix + name
        if key not in state:
            raise KeyError(f"PyG HGTConv state_dict lacks {key!r} (metadata differs from the layer's?)")
        if used is not None:
            used.add(key)
        return state[key]

    out: dict[str, torch.Tensor] = {}
    kqv = [get(f"kqv_lin.lins.{nt}.weight").t() for nt in node_types]  # [in, 3F]: k | q | v
    kqv_b = [get(f"kqv_lin.lins.{nt}.bias") for nt in node_types]
    for i, name in enumerate(("k", "q", "v")):
        out[f"{name}_weight"] = torch.stack([w[:, i * f:(i + 1) * f] for w in kqv])
        out[f"{name}_bias"] = torch.stack([b[i * f:(i + 1) * f] for b in kqv_b])
    out["out_weight"] = torch.stack([get(f"out_lin.lins.{nt}.weight").t() for nt in node_types])
    out["out_bias"] = torch.stack([get(f"out_lin.lins.{nt}.bias") for nt in node_types])
    out["skip"] = torch.cat([get(f"skip.{nt}").reshape(1) for nt in node_types])
    out["p_rel"] = torch.stack([get(f"p_rel.{'__'.join(e)}").reshape(h) for e in edge_types])
    # PyG's k_rel/v_rel rows follow its metadata's edge-type order, which its state_dict shows only as the order
    # of its p_rel entries: entries in another order than the layer's (and not merely sorted by a checkpoint
    # format) mean a PyG layer made from reordered metadata, whose rows would land on the wrong relations
    listed = [k[len(prefix) + len("p_rel."):] for k in state if k.startswith(prefix + "p_rel.")]
    names = ["__".join(e) for e in edge_types]
    if sorted(listed) == sorted(names) and listed not in (names, sorted(names)):
        raise ValueError(f"the PyG HGTConv state_dict lists its edge types in another order ({listed}) than this "
                         f"layer's metadata ({names}); PyG's k_rel/v_rel weights follow that order: build the layer "
                         "with the PyG layer's metadata in its order")
    for name in ("k_rel", "v_rel"):  # PyG's HeteroLinear type id is head * num_edge_types + relation
        w = get(f"{name}.weight")
        if w.size(0) != h * num_rel:
            raise ValueError(f"PyG HGTConv's {prefix}{name}.weight holds {w.size(0)} = heads x edge types weights, "
                             f"this layer {h} x {num_rel}: build it from the PyG layer's metadata and heads")
        d = w.size(-1)
        out[name] = w.reshape(h, num_rel, d, d).transpose(0, 1).contiguous()
    return out


_PYG_HEADS = ("kqv_lin.", "out_lin.", "k_rel.weight", "v_rel.weight", "skip.", "p_rel.")


def _from_pyg_state(module: HGTConv, state_dict: dict, prefix: str, local_metadata: Any, strict: bool,
                    missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
    """load_state_dict pre-hook: a PyG HGTConv state_dict (recognised by its ``kqv_lin.`` entries) is converted to
    hector's tensors, using the layer's metadata for the node- and edge-type order."""
    pyg_keys = [k for k in state_dict if k.startswith(prefix) and k[len(prefix):].startswith(_PYG_HEADS)]
    if not any(k[len(prefix):].startswith("kqv_lin.") for k in pyg_keys):
        return
    if module.node_types is None:
        error_msgs.append("this is a PyG HGTConv state_dict: build the layer from the same metadata, "
                          "HGTConv(in, out, metadata, heads=H), to load it (or use hector.nn.load_pyg_hgt)")
        return
    used: set[str] = set()
    try:
        converted = _pyg_to_hector(state_dict, prefix, module.node_types, module.edge_types, module.out_channels,
                                   module.heads, used)
    except (KeyError, ValueError) as e:
        error_msgs.append(str(e.args[0]))
        return
    # only the entries converted: those of node or edge types the layer lacks stay, and a strict load reports them
    # as unexpected instead of dropping them
    for k in used:
        del state_dict[k]
    for name, value in converted.items():
        state_dict[prefix + name] = value


def load_pyg_hgt(layer: HGTConv, pyg_conv: Any, node_types: Sequence[str] | None = None,
                 edge_types: Sequence[tuple[str, str, str]] | None = None) -> None:
    """Copy the weights of a ``torch_geometric.nn.HGTConv`` into ``layer`` (either form).

    Node type id ``t`` of ``layer`` is ``node_types[t]`` and relation ``r`` is ``edge_types[r]``; both default to
    the layer's metadata, or PyG's (``pyg_conv.node_types`` / ``pyg_conv.edge_types``) when the layer has none.
    A layer built from PyG's metadata can also take ``layer.load_state_dict(pyg_conv.state_dict())``.
    """
    node_types = list(node_types if node_types is not None else layer.node_types or pyg_conv.node_types)
    edge_types = [tuple(e) for e in (edge_types if edge_types is not None else layer.edge_types
                                     or pyg_conv.edge_types)]
    if edge_types != [tuple(e) for e in pyg_conv.edge_types] or len(edge_types) != layer.num_relations:
        raise ValueError("edge_types must list the PyG layer's edge types in its metadata order")
    if len(node_types) != layer.num_node_types:
        raise ValueError(f"{len(node_types)} node types for a layer with {layer.num_node_types}")
    converted = _pyg_to_hector(pyg_conv.state_dict(), "", node_types, edge_types, layer.out_channels, layer.heads)
    with torch.no_grad():
        for name, value in converted.items():
            getattr(layer, name).copy_(value)
