"""The inter-operator IR: value types, the op enum, immutable nodes and programs.

A program is a tuple of nodes in SSA form (each defines one named value, arguments refer to earlier names). Every
value has a *domain* that says what its rows are:

* ``NODE``   one row per node,
* ``EDGE``   one row per edge,
* ``UNIQUE`` one row per unique (source node, relation) pair (introduced by compact materialisation),
* ``PARAM``  graph-independent tensors: weights and values computed from weights only.

Row values have a per-row feature ``shape`` (``(F,)`` flat, ``(H, D)`` multi-head, ``()`` scalar). PARAM values
carry their full tensor shape, and ``by`` names the type indices of their leading dimensions: a relation-typed
weight ``W_r`` has ``by=("etype",)`` and shape ``(R, Din, Dout)``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any


class Domain(enum.Enum):
    """What the rows of a value are: nodes, edges, unique (source, relation) pairs, or none (PARAM)."""

    NODE = "node"
    EDGE = "edge"
    UNIQUE = "unique"
    PARAM = "param"

    # members compare by identity, so they hash by it: Enum's own __hash__ is a Python call, and the runtime's
    # caches per graph are keyed by domains (dozens of lookups for every new mini-batch)
    __hash__ = object.__hash__


ROW_DOMAINS = (Domain.NODE, Domain.EDGE, Domain.UNIQUE)

# Type-index kinds, and the row domains where each is defined. A row of the UNIQUE domain is a (source, relation)
# pair, so it knows its relation and its source's node type but not a destination.
INDEX_KINDS: dict[str, tuple[Domain, ...]] = {
    "etype": (Domain.EDGE, Domain.UNIQUE),
    "src_ntype": (Domain.EDGE, Domain.UNIQUE),
    "dst_ntype": (Domain.EDGE,),
    "ntype": (Domain.NODE,),
}

# Gathers read rows of one domain at indices given by another: via -> (from, to).
GATHER_VIA: dict[str, tuple[Domain, Domain]] = {
    "src": (Domain.NODE, Domain.EDGE),
    "dst": (Domain.NODE, Domain.EDGE),
    "unique_src": (Domain.NODE, Domain.UNIQUE),
    "unique": (Domain.UNIQUE, Domain.EDGE),
}

# Graph-derived per-row constants.
GRAPH_CONSTS: dict[str, Domain] = {
    "inv_deg_dst_rel": Domain.EDGE,  # 1 / |{edges of this relation into this destination}| (RGCN mean)
    "inv_deg_dst": Domain.EDGE,  # 1 / in-degree of the destination
    "inv_in_degree": Domain.NODE,  # 1 / in-degree (0 for isolated nodes)
}

ACTIVATIONS = ("exp", "relu", "leaky_relu", "sigmoid", "tanh", "gelu")


class OpKind(enum.Enum):
    """The families ops are grouped in (leaves, data movement, linear maps, elementwise, feature, reductions)."""

    LEAF = "leaf"
    MOVE = "move"
    LINEAR = "linear"
    ELEMENTWISE = "elementwise"
    FEATURE = "feature"
    REDUCE = "reduce"


class Op(enum.Enum):
    """Ops grouped by kind. ``value`` is the mnemonic the printer uses."""

    __hash__ = object.__hash__  # as Domain's: members compare by identity

    # leaves
    INPUT = "input"  # attrs: name, domain, shape
    PARAM = "param"  # attrs: name, shape, by
    GRAPH = "graph"  # attrs: kind (GRAPH_CONSTS)
    DROPOUT_MASK = "dropout_mask"  # attrs: p, domain, shape  (keep-mask already scaled by 1/(1-p))
    SAVED = "saved"  # backward programs only: a forward value; attrs: name, domain, shape, by
    # data movement between domains
    GATHER = "gather"  # (x) attrs: via
    SCATTER_ADD = "scatter_add"  # (x) attrs: via  (transpose of gather: sum rows into the source domain)
    # linear maps
    LINEAR = "linear"  # (x, W) attrs: transpose; row i uses W[index(i)] for W.by
    OUTER_SUM = "outer_sum"  # (x, dy) attrs: by, shape; sum_i x_i^T dy_i into W[index(i)] (weight gradient)
    SELECT = "select"  # (P) attrs: domain; row i reads P[index(i)] for P.by (broadcast when P.by == ())
    SELECT_SUM = "select_sum"  # (dy) attrs: by, shape; transpose of SELECT
    EINSUM = "einsum"  # (A, B) attrs: equation; PARAM-domain only (weight composition, basis decomposition)
    # elementwise (prefix broadcasting: a value of shape (H,) combines with one of shape (H, D))
    ADD = "add"
    SUB = "sub"
    MUL = "mul"
    NEG = "neg"
    SCALE = "scale"  # (x) attrs: c
    ACT = "act"  # (x) attrs: fn, slope
    ACT_GRAD = "act_grad"  # (x_or_y, dy) attrs: fn, slope  (exp/sigmoid/tanh take y, others take x)
    # feature-dimension ops
    INNER = "inner"  # (a, b): sum over the last dimension of a*b
    REDUCE_LAST = "reduce_last"  # (x) attrs: shape; sum trailing dimensions down to `shape`
    EXPAND = "expand"  # (x) attrs: shape; prefix-broadcast up to `shape`
    RESHAPE = "reshape"  # (x) attrs: shape
    CONCAT = "concat"  # (a, b): along the last dimension
    SLICE = "slice"  # (x) attrs: start, stop; along the last dimension
    # graph reductions
    EDGE_SOFTMAX = "edge_softmax"  # (score) softmax over the incoming edges of each destination, max-subtracted

    @property
    def kind(self) -> OpKind:
        return _KIND[self]


_KIND = {
    **{op: OpKind.LEAF for op in (Op.INPUT, Op.PARAM, Op.GRAPH, Op.DROPOUT_MASK, Op.SAVED)},
    **{op: OpKind.MOVE for op in (Op.GATHER, Op.SCATTER_ADD)},
    **{op: OpKind.LINEAR for op in (Op.LINEAR, Op.OUTER_SUM, Op.SELECT, Op.SELECT_SUM, Op.EINSUM)},
    **{op: OpKind.ELEMENTWISE for op in (Op.ADD, Op.SUB, Op.MUL, Op.NEG, Op.SCALE, Op.ACT, Op.ACT_GRAD)},
    **{op: OpKind.FEATURE for op in (Op.INNER, Op.REDUCE_LAST, Op.EXPAND, Op.RESHAPE, Op.CONCAT, Op.SLICE)},
    Op.EDGE_SOFTMAX: OpKind.REDUCE,
}

ARITY = {
    Op.INPUT: 0, Op.PARAM: 0, Op.GRAPH: 0, Op.DROPOUT_MASK: 0, Op.SAVED: 0,
    Op.GATHER: 1, Op.SCATTER_ADD: 1, Op.LINEAR: 2, Op.OUTER_SUM: 2, Op.SELECT: 1, Op.SELECT_SUM: 1, Op.EINSUM: 2,
    Op.ADD: 2, Op.SUB: 2, Op.MUL: 2, Op.NEG: 1, Op.SCALE: 1, Op.ACT: 1, Op.ACT_GRAD: 2,
    Op.INNER: 2, Op.REDUCE_LAST: 1, Op.EXPAND: 1, Op.RESHAPE: 1, Op.CONCAT: 2, Op.SLICE: 1, Op.EDGE_SOFTMAX: 1,
}  # fmt: skip

COMMUTATIVE = (Op.ADD, Op.MUL, Op.INNER)


@dataclass(frozen=True)
class VType:
    """Domain, per-row feature shape (full shape for PARAM) and the type indices of a PARAM's leading dims."""

    domain: Domain
    shape: tuple[int, ...]
    by: tuple[str, ...] = ()
    dtype: str = "float"

    def __str__(self) -> str:
        dims = ",".join(str(d) for d in self.shape)
        by = f" by {'x'.join(self.by)}" if self.by else ""
        return f"{self.domain.value}[{dims}]{by}"

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Node:
    """One immutable IR node: ``name = op(args) {attrs} : type``."""

    name: str
    op: Op
    args: tuple[str, ...] = ()
    attrs: tuple[tuple[str, Any], ...] = ()
    type: VType | None = None

    def attr(self, key: str, default: Any = None) -> Any:
        for k, v in self.attrs:
            if k == key:
                return v
        return default

    @property
    def attr_dict(self) -> dict[str, Any]:
        return dict(self.attrs)

    def replace(self, **changes: Any) -> Node:
        fields = {"name": self.name, "op": self.op, "args": self.args, "attrs": self.attrs, "type": self.type}
        fields.update(changes)
        if isinstance(fields["attrs"], dict):
            fields["attrs"] = make_attrs(**fields["attrs"])
        return Node(**fields)


def make_attrs(**attrs: Any) -> tuple[tuple[str, Any], ...]:
    """Attributes in a canonical (sorted, hashable) order."""
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in attrs.items()))


@dataclass(frozen=True)
class Program:
    """An SSA program: nodes in definition order and the names it returns."""

    name: str
    nodes: tuple[Node, ...]
    outputs: tuple[str, ...]
    meta: tuple[tuple[str, Any], ...] = field(default=())

    @cached_property
    def by_name(self) -> dict[str, Node]:
        return {n.name: n for n in self.nodes}

    def node(self, name: str) -> Node:
        return self.by_name[name]

    def type_of(self, name: str) -> VType:
        t = self.by_name[name].type
        assert t is not None, f"{name} has no type yet (run infer_types)"
        return t

    @cached_property
    def users(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {n.name: [] for n in self.nodes}
        for n in self.nodes:
            for a in n.args:
                if a in out:
                    out[a].append(n.name)
        for o in self.outputs:
            if o in out:
                out[o].append("<output>")
        return out

    def leaves(self, op: Op) -> list[Node]:
        return [n for n in self.nodes if n.op is op]

    def count(self, op: Op, **attrs: Any) -> int:
        return sum(1 for n in self.nodes if n.op is op and all(n.attr(k) == v for k, v in attrs.items()))

    def with_nodes(self, nodes: list[Node] | tuple[Node, ...], outputs: tuple[str, ...] | None = None) -> Program:
        return Program(self.name, tuple(nodes), self.outputs if outputs is None else tuple(outputs), self.meta)

    # str(program) is the printer's text form; hector.ir (imported before any of its modules) sets __str__ to
    # hector.ir.printer.format_program, so core does not import the printer that imports core
