"""The front end: a small builder DSL in which a relational GNN layer is written once.

Example (an RGCN layer, mean over each relation's neighbours plus a root weight)::

    def program(b: Builder):
        x = b.node_input("x", (16,))
        w = b.param("weight", (R, 16, 32), by="etype")     # one matrix per relation
        msg = b.src(x).linear(w) * b.graph_const("inv_deg_dst_rel")
        return b.sum_to_dst(msg) + x.linear(b.param("root", (16, 32))) + b.param("bias", (32,))

Values know their domain (node, edge, unique pair, param) and per-row feature shape; every operation checks them
as it is written and raises :class:`~hector.errors.DSLTypeError` naming the problem and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import DSLTypeError
from .core import Domain, Node, Op, Program, VType, make_attrs
from .types import infer
from .verify import verify


class Value:
    """A handle on one value of a program being built. Arithmetic builds IR nodes."""

    __slots__ = ("_b", "name")

    def __init__(self, builder: Builder, name: str):
        self._b = builder
        self.name = name

    # introspection
    @property
    def type(self) -> VType:
        return self._b._types[self.name]

    @property
    def domain(self) -> Domain:
        return self.type.domain

    @property
    def shape(self) -> tuple[int, ...]:
        return self.type.shape

    def __repr__(self) -> str:
        return f"Value(%{self.name}: {self.type})"

    def __bool__(self) -> bool:
        raise DSLTypeError("a program value has no truth value at build time; use Python control flow on "
                           "layer settings, not on values")

    # arithmetic
    def _binary(self, op: Op, other: Any) -> Value:
        if isinstance(other, (int, float)):
            if op is Op.MUL:
                return self._b._add(Op.SCALE, [self], c=float(other))
            if op is Op.SUB:
                other = -other
            raise DSLTypeError(f"cannot {op.value} a constant {other!r} and {self!r}; only scaling by a constant "
                               "is supported (x * c, x / c)")
        if not isinstance(other, Value):
            raise DSLTypeError(f"cannot {op.value} {self!r} and {type(other).__name__} {other!r}")
        a, b = self._b._auto_select(self, other)
        return self._b._add(op, [a, b])

    def __add__(self, other: Any) -> Value:
        return self._binary(Op.ADD, other)

    def __radd__(self, other: Any) -> Value:
        return self._binary(Op.ADD, other)

    def __sub__(self, other: Any) -> Value:
        return self._binary(Op.SUB, other)

    def __mul__(self, other: Any) -> Value:
        return self._binary(Op.MUL, other)

    def __rmul__(self, other: Any) -> Value:
        return self._binary(Op.MUL, other)

    def __truediv__(self, other: Any) -> Value:
        if not isinstance(other, (int, float)):
            raise DSLTypeError(f"only division by a constant is supported, got {self!r} / {other!r}")
        return self._b._add(Op.SCALE, [self], c=1.0 / float(other))

    def __neg__(self) -> Value:
        return self._b._add(Op.NEG, [self])

    # linear algebra and feature-dimension ops
    def linear(self, weight: Value) -> Value:
        """Row i times ``weight[index(i)]`` (the weight's ``by`` names the index; untyped weights are shared)."""
        return self._b._add(Op.LINEAR, [self, weight], transpose=False)

    def dot(self, other: Value) -> Value:
        """Inner product over the last feature dimension: (H, D) . (H, D) -> (H,)."""
        return self._b._add(Op.INNER, [self, other])

    def heads(self, num_heads: int) -> Value:
        """Split a flat (F,) row into (num_heads, F / num_heads)."""
        (f,) = self._flat_shape("heads")
        if num_heads <= 0 or f % num_heads:
            raise DSLTypeError(f"cannot split {f} features into {num_heads} heads")
        return self._b._add(Op.RESHAPE, [self], shape=(num_heads, f // num_heads))

    def flat(self) -> Value:
        """Merge all feature dimensions into one."""
        return self._b._add(Op.RESHAPE, [self], shape=(self.type.numel,))

    def concat(self, other: Value) -> Value:
        return self._b._add(Op.CONCAT, [self, other])

    def _flat_shape(self, what: str) -> tuple[int]:
        if len(self.shape) != 1:
            raise DSLTypeError(f"{what} needs a flat (F,) value, got {self!r}")
        return self.shape  # type: ignore[return-value]

    def _act(self, fn: str, slope: float = 0.0) -> Value:
        return self._b._add(Op.ACT, [self], fn=fn, slope=float(slope))

    def exp(self) -> Value:
        return self._act("exp")

    def relu(self) -> Value:
        return self._act("relu")

    def leaky_relu(self, negative_slope: float = 0.01) -> Value:
        return self._act("leaky_relu", negative_slope)

    def sigmoid(self) -> Value:
        return self._act("sigmoid")

    def tanh(self) -> Value:
        return self._act("tanh")

    def gelu(self) -> Value:
        return self._act("gelu")


class Builder:
    """Builds one program. ``param_shapes`` lets ``param(name)`` take its shape from a module's parameters."""

    def __init__(self, name: str, param_shapes: Mapping[str, Sequence[int]] | None = None, training: bool = False):
        self.name = name
        self.training = training
        self._param_shapes = dict(param_shapes or {})
        self._nodes: list[Node] = []
        self._types: dict[str, VType] = {}
        self._leaves: dict[tuple[Op, Any], str] = {}
        self._counter = 0
        self._used: set[str] = set()

    # node creation
    def _fresh(self, hint: str) -> str:
        while True:  # never reuse a name a leaf (user-chosen) already took
            self._counter += 1
            name = f"{hint}{self._counter}"
            if name not in self._used:
                return name

    def _add(self, op: Op, args: list[Value], node_name: str | None = None, **attrs: Any) -> Value:
        for a in args:
            if not isinstance(a, Value) or a._b is not self:
                raise DSLTypeError(f"{op.value}: argument {a!r} is not a value of this program")
        if node_name is None or node_name in self._used:
            node_name = self._fresh("v")
        self._used.add(node_name)
        node = Node(node_name, op, tuple(a.name for a in args), make_attrs(**attrs))
        t = infer(node, [a.type for a in args])
        node = node.replace(type=t)
        self._nodes.append(node)
        self._types[node.name] = t
        return Value(self, node.name)

    def _leaf(self, op: Op, key: Any, node_name: str, **attrs: Any) -> Value:
        if (op, key) in self._leaves:
            return Value(self, self._leaves[(op, key)])
        v = self._add(op, [], node_name=node_name, **attrs)
        self._leaves[(op, key)] = v.name
        return v

    def _auto_select(self, a: Value, b: Value) -> tuple[Value, Value]:
        """A param combined with row values is read per row (its type index picks the row's entry)."""
        if a.domain is Domain.PARAM and b.domain is not Domain.PARAM:
            a = self.select(a, b.domain)
        elif b.domain is Domain.PARAM and a.domain is not Domain.PARAM:
            b = self.select(b, a.domain)
        return a, b

    # leaves
    def node_input(self, name: str, shape: int | Sequence[int]) -> Value:
        """A per-node input (e.g. the feature matrix ``x`` of shape [N, *shape])."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if any(d <= 0 for d in shape):
            raise DSLTypeError(f"input {name!r}: feature shape {shape} must be positive")
        if (Op.INPUT, name) in self._leaves:
            raise DSLTypeError(f"input {name!r} declared twice")
        if (Op.PARAM, name) in self._leaves:
            raise DSLTypeError(f"input {name!r} has the name of a param; inputs and params are bound by name")
        return self._leaf(Op.INPUT, name, name, name=name, domain=Domain.NODE.value, shape=shape)

    def param(self, name: str, shape: Sequence[int] | None = None, by: str | Sequence[str] = ()) -> Value:
        """A weight. ``by`` names the type index of its leading dims: "etype" (relation), "src_ntype", "dst_ntype",
        "ntype" (node type), or a sequence of them."""
        by = (by,) if isinstance(by, str) else tuple(by)
        if shape is None:
            if name not in self._param_shapes:
                raise DSLTypeError(f"param {name!r}: no shape given and the layer has no parameter of that name "
                                   f"(known: {sorted(self._param_shapes)})")
            shape = self._param_shapes[name]
        shape = tuple(int(d) for d in shape)
        if name in self._param_shapes and tuple(self._param_shapes[name]) != shape:
            raise DSLTypeError(f"param {name!r}: shape {shape} differs from the layer's parameter "
                               f"{tuple(self._param_shapes[name])}")
        if (Op.INPUT, name) in self._leaves:
            raise DSLTypeError(f"param {name!r} has the name of an input; inputs and params are bound by name")
        if (Op.PARAM, name) in self._leaves:
            v = Value(self, self._leaves[(Op.PARAM, name)])
            if v.type.shape != shape or v.type.by != by:
                raise DSLTypeError(f"param {name!r} redeclared as {shape} by {by}, first as {v.type}")
            return v
        return self._leaf(Op.PARAM, name, name, name=name, shape=shape, by=by)

    def graph_const(self, kind: str) -> Value:
        """A graph-derived constant per row: "inv_deg_dst_rel", "inv_deg_dst" (edge), "inv_in_degree" (node)."""
        return self._leaf(Op.GRAPH, kind, kind, kind=kind)

    # graph movement
    def src(self, x: Value) -> Value:
        """Each edge reads its source node's row."""
        return self._add(Op.GATHER, [x], via="src")

    def dst(self, x: Value) -> Value:
        """Each edge reads its destination node's row."""
        return self._add(Op.GATHER, [x], via="dst")

    def sum_to_dst(self, e: Value) -> Value:
        """Aggregation: each node sums the rows of its incoming edges (0 for isolated nodes)."""
        return self._add(Op.SCATTER_ADD, [e], via="dst")

    def edge_softmax(self, score: Value) -> Value:
        """Softmax of edge scores over each destination's incoming edges (max-subtracted, per head)."""
        return self._add(Op.EDGE_SOFTMAX, [score])

    def select(self, param: Value, domain: Domain | Value) -> Value:
        """Read a (typed) param per row of ``domain``: row i gets ``param[index(i)]``."""
        if isinstance(domain, Value):
            domain = domain.domain
        return self._add(Op.SELECT, [param], domain=domain.value)

    def einsum(self, equation: str, a: Value, b: Value, by: str | Sequence[str] = ()) -> Value:
        """Compose two params (e.g. basis decomposition ``"rb,bio->rio"``); ``by`` types the result's lead dims."""
        by = (by,) if isinstance(by, str) else tuple(by)
        return self._add(Op.EINSUM, [a, b], equation=equation, by=by)

    def dropout(self, v: Value, p: float) -> Value:
        """Dropout on a row value; a no-op when the program is built for inference or p == 0."""
        if not 0.0 <= p < 1.0:
            raise DSLTypeError(f"dropout probability must be in [0, 1), got {p}")
        if not self.training or p == 0.0:
            return v
        mask = self._add(Op.DROPOUT_MASK, [], p=float(p), domain=v.domain.value, shape=v.shape)
        return v * mask

    def build(self, *outputs: Value) -> Program:
        if not outputs:
            raise DSLTypeError(f"program {self.name!r} returns nothing; return at least one value")
        for o in outputs:
            if not isinstance(o, Value) or o._b is not self:
                raise DSLTypeError(f"program {self.name!r} returns {o!r}, which is not one of its values")
            if o.domain is not Domain.NODE:
                raise DSLTypeError(f"program {self.name!r} returns {o!r}; layer outputs must be node values "
                                   "(aggregate edge values with sum_to_dst)")
        return verify(Program(self.name, tuple(self._nodes), tuple(o.name for o in outputs)), "build")
