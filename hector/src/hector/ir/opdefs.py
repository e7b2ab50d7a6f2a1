"""Every op's semantics in one place: its type rule, its derivative and its cost, one :class:`OpDef` per op.

The IR passes read these tables instead of branching on ops: the builder, the verifier and ``infer_types`` call
:func:`infer` (``OPS[op].infer``), automatic differentiation calls ``OPS[op].vjp`` (a vector-Jacobian product
written in IR ops, through a :class:`GradContext`), and the cost model calls ``OPS[op].cost``. What each backend
does for an op sits in that backend's own table, keyed by op (``hector.runtime.reference.REFERENCE`` for torch,
``hector.codegen.templates.ELEMENTWISE`` and the traversal emitter's rules for CUDA), the way a compiler's
renderers each keep their table. ``tests/test_opdefs.py`` checks that every op has an entry in every table.

Adding an elementwise op: an ``Op`` member (``ir/core.py``, with its kind and arity), an ``OpDef`` here, one torch
function in the reference table and one CUDA expression in ``ELEMENTWISE``; lowering fuses it by its kind.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ..errors import DSLTypeError
from .core import ACTIVATIONS, GATHER_VIA, GRAPH_CONSTS, INDEX_KINDS, ROW_DOMAINS, Domain, Node, Op, VType

# ------------------------------------------------------------------------------------------------- shared checks


def _fail(node: Node, msg: str) -> DSLTypeError:
    return DSLTypeError(f"{node.op.value} ({node.name}): {msg}")


def is_prefix(short: tuple[int, ...], long: tuple[int, ...]) -> bool:
    return len(short) <= len(long) and long[: len(short)] == short


def _row(node: Node, t: VType, what: str) -> None:
    if t.domain not in ROW_DOMAINS:
        raise _fail(node, f"{what} must be a node/edge/unique value, got {t}")


def _same_domain(node: Node, a: VType, b: VType) -> None:
    if a.domain != b.domain:
        hint = ""
        if {a.domain, b.domain} == {Domain.NODE, Domain.EDGE}:
            hint = " (move the node value onto edges with src(x)/dst(x), or aggregate the edge value to nodes)"
        elif Domain.PARAM in (a.domain, b.domain):
            hint = " (read a weight per row with select(param))"
        raise _fail(node, f"operands live on different domains: {a} and {b}{hint}")


def _check_by(node: Node, by: tuple[str, ...], domain: Domain) -> None:
    for kind in by:
        if kind not in INDEX_KINDS:
            raise _fail(node, f"unknown type index {kind!r}; known: {sorted(INDEX_KINDS)}")
        if domain not in INDEX_KINDS[kind]:
            raise _fail(node, f"type index {kind!r} is not defined on {domain.value} rows")


def broadcast(node: Node, a: VType, b: VType) -> tuple[int, ...]:
    if is_prefix(a.shape, b.shape):
        return b.shape
    if is_prefix(b.shape, a.shape):
        return a.shape
    raise _fail(node, f"feature shapes {a.shape} and {b.shape} do not broadcast (one must be a prefix of the other)")


def _einsum_shape(node: Node, eq: str, a: VType, b: VType) -> tuple[int, ...]:
    m = re.fullmatch(r"([a-z]+),([a-z]+)->([a-z]*)", eq)
    if not m:
        raise _fail(node, f"bad einsum equation {eq!r}")
    sizes: dict[str, int] = {}
    for letters, t in ((m.group(1), a), (m.group(2), b)):
        if len(letters) != len(t.shape):
            raise _fail(node, f"einsum {eq!r}: {letters!r} does not match shape {t.shape}")
        for ch, d in zip(letters, t.shape, strict=True):
            if sizes.setdefault(ch, d) != d:
                raise _fail(node, f"einsum {eq!r}: index {ch!r} has sizes {sizes[ch]} and {d}")
    return tuple(sizes[ch] for ch in m.group(3))


def _einsum_grad_eq(eq: str, which: int) -> str:
    m = re.fullmatch(r"([a-z]+),([a-z]+)->([a-z]*)", eq)
    assert m is not None
    a, b, c = m.groups()
    target, other = (a, b) if which == 0 else (b, a)
    missing = set(target) - set(c) - set(other)
    if missing:
        raise NotImplementedError(f"einsum {eq!r}: gradient needs a broadcast over {sorted(missing)}")
    return f"{c},{other}->{target}"


def _linear_core(node: Node, w: VType) -> tuple[int, ...]:
    core = w.shape[len(w.by) :]
    if len(core) not in (2, 3):
        raise _fail(node, f"weight must be [types..., Din, Dout] or [types..., H, Din, Dout], got {w}")
    return core


# ------------------------------------------------------------------------------------------------- the table


class GradContext(Protocol):
    """What a derivative rule may do (automatic differentiation implements it, :mod:`hector.passes.autodiff`)."""

    def emit(self, op: Op, args: list[str], hint: str, **attrs) -> str:
        """Add a node to the backward program; returns its name."""

    def saved(self, name: str) -> str:
        """A forward value, readable in the backward program."""

    def needs(self, name: str) -> bool:
        """Whether forward value ``name`` needs a gradient."""

    def give(self, i: int, grad: str) -> None:
        """Contribute ``grad`` to the gradient of argument ``i`` of the node being differentiated."""

    def type_of(self, name: str) -> VType:
        """The type of a forward value."""

    def reduce_to(self, grad: str, shape: tuple[int, ...]) -> str:
        """``grad`` summed over trailing dimensions down to ``shape`` (undoes prefix broadcasting)."""


InferRule = Callable[[Node, list[VType]], VType]
VjpRule = Callable[[GradContext, Node, str], None]
CostRule = Callable[[Node, Callable[[str], int], Callable[[str], VType]], tuple[int, int]]


def elementwise_cost(node: Node, rows: Callable[[str], int], type_of: Callable[[str], VType]) -> tuple[int, int]:
    """(flops, elements gathered): one operation per output element."""
    return rows(node.name) * node.type.numel, 0


@dataclass(frozen=True)
class OpDef:
    """One op's semantics. ``vjp`` None: the op is not differentiable (leaves, backward-only ops); ``cost`` gives
    (flops, elements read through an index) of one evaluation on a graph, from row counts."""

    op: Op
    infer: InferRule
    vjp: VjpRule | None = None
    cost: CostRule = elementwise_cost


OPS: dict[Op, OpDef] = {}


def define(op: Op, infer: InferRule, vjp: VjpRule | None = None, cost: CostRule = elementwise_cost) -> None:
    if op in OPS:
        raise ValueError(f"{op} is defined twice")
    OPS[op] = OpDef(op, infer, vjp, cost)


def infer(node: Node, args: list[VType]) -> VType:
    """The type of ``node`` given its argument types; raises DSLTypeError naming the problem."""
    rule = OPS.get(node.op)
    if rule is None:  # pragma: no cover - tests/test_opdefs.py checks every op has one
        raise _fail(node, "no type rule")
    return rule.infer(node, args)


def _none(node: Node, rows: Callable[[str], int], type_of: Callable[[str], VType]) -> tuple[int, int]:
    return 0, 0


# ------------------------------------------------------------------------------------------------- leaves

define(Op.INPUT, lambda node, args: VType(Domain(node.attr("domain")), tuple(node.attr("shape"))), cost=_none)


def _param(node: Node, args: list[VType]) -> VType:
    shape, by = tuple(node.attr("shape")), tuple(node.attr("by", ()))
    if len(shape) < len(by):
        raise _fail(node, f"param {node.attr('name')!r} of shape {shape} cannot have {len(by)} type dims {by}")
    return VType(Domain.PARAM, shape, by)


define(Op.PARAM, _param, cost=_none)
define(Op.SAVED, lambda node, args: VType(Domain(node.attr("domain")), tuple(node.attr("shape")),
                                          tuple(node.attr("by", ()))), cost=_none)


def _graph(node: Node, args: list[VType]) -> VType:
    if node.attr("kind") not in GRAPH_CONSTS:
        raise _fail(node, f"unknown graph constant {node.attr('kind')!r}; known: {sorted(GRAPH_CONSTS)}")
    return VType(GRAPH_CONSTS[node.attr("kind")], ())


define(Op.GRAPH, _graph, cost=_none)


def _dropout_mask(node: Node, args: list[VType]) -> VType:
    p = node.attr("p")
    if not 0.0 <= p < 1.0:
        raise _fail(node, f"dropout probability must be in [0, 1), got {p}")
    return VType(Domain(node.attr("domain")), tuple(node.attr("shape")))


define(Op.DROPOUT_MASK, _dropout_mask, cost=_none)

# ------------------------------------------------------------------------------------------------- data movement


def _move(node: Node, args: list[VType]) -> VType:
    via = node.attr("via")
    if via not in GATHER_VIA:
        raise _fail(node, f"unknown 'via' {via!r}; known: {sorted(GATHER_VIA)}")
    src, dst = GATHER_VIA[via]
    want, got = (src, dst) if node.op is Op.GATHER else (dst, src)
    if args[0].domain != want:
        raise _fail(node, f"via={via} reads {want.value} rows, got {args[0]}")
    return VType(got, args[0].shape)


def _gathered(node: Node, rows: Callable[[str], int], type_of: Callable[[str], VType]) -> tuple[int, int]:
    return 0, rows(node.name) * node.type.numel


define(Op.GATHER, _move, lambda ctx, node, g: ctx.give(0, ctx.emit(Op.SCATTER_ADD, [g], "g", via=node.attr("via"))),
       _gathered)
define(Op.SCATTER_ADD, _move, lambda ctx, node, g: ctx.give(0, ctx.emit(Op.GATHER, [g], "g", via=node.attr("via"))))

# ------------------------------------------------------------------------------------------------- linear maps


def _linear(node: Node, args: list[VType]) -> VType:
    x, w = args
    _row(node, x, "input")
    if w.domain is not Domain.PARAM:
        raise _fail(node, f"weight must be a param, got {w}")
    _check_by(node, w.by, x.domain)
    core = _linear_core(node, w)
    din, dout = (core[-1], core[-2]) if node.attr("transpose") else (core[-2], core[-1])
    want = (din,) if len(core) == 2 else (core[0], din)
    if x.shape != want:
        raise _fail(node, f"input rows of shape {x.shape} do not fit weight {w} (need {want})")
    return VType(x.domain, (dout,) if len(core) == 2 else (core[0], dout))


def _linear_vjp(ctx: GradContext, node: Node, g: str) -> None:
    x, wname = node.args
    w = ctx.type_of(wname)
    transpose = bool(node.attr("transpose"))
    if ctx.needs(x):
        ctx.give(0, ctx.emit(Op.LINEAR, [g, ctx.saved(wname)], "g", transpose=not transpose))
    if ctx.needs(wname):
        pair = [g, ctx.saved(x)] if transpose else [ctx.saved(x), g]
        ctx.give(1, ctx.emit(Op.OUTER_SUM, pair, "g", by=w.by, shape=w.shape))


def _linear_cost(node: Node, rows: Callable[[str], int], type_of: Callable[[str], VType]) -> tuple[int, int]:
    w = type_of(node.args[1])
    return 2 * rows(node.name) * math.prod(w.shape[len(w.by):]), 0


define(Op.LINEAR, _linear, _linear_vjp, _linear_cost)


def _outer_sum(node: Node, args: list[VType]) -> VType:
    x, dy = args
    _row(node, x, "input")
    _same_domain(node, x, dy)
    shape, by = tuple(node.attr("shape")), tuple(node.attr("by", ()))
    _check_by(node, by, x.domain)
    core = shape[len(by) :]
    want = (x.shape + dy.shape[-1:]) if len(core) == 3 else (x.shape[-1], dy.shape[-1])
    if len(core) == 3 and x.shape[:1] != dy.shape[:1]:
        raise _fail(node, f"head counts differ: {x.shape} vs {dy.shape}")
    if core != want:
        raise _fail(node, f"outer product of {x.shape} and {dy.shape} does not give {core}")
    return VType(Domain.PARAM, shape, by)


def _outer_sum_cost(node: Node, rows: Callable[[str], int], type_of: Callable[[str], VType]) -> tuple[int, int]:
    t = node.type
    return 2 * rows(node.args[0]) * math.prod(t.shape[len(t.by):]), 0


define(Op.OUTER_SUM, _outer_sum, cost=_outer_sum_cost)


def _select(node: Node, args: list[VType]) -> VType:
    (p,) = args
    if p.domain is not Domain.PARAM:
        raise _fail(node, f"select reads a param, got {p}")
    domain = Domain(node.attr("domain"))
    _check_by(node, p.by, domain)
    return VType(domain, p.shape[len(p.by) :])


def _select_vjp(ctx: GradContext, node: Node, g: str) -> None:
    p = ctx.type_of(node.args[0])
    ctx.give(0, ctx.emit(Op.SELECT_SUM, [g], "g", by=p.by, shape=p.shape))


define(Op.SELECT, _select, _select_vjp, _gathered)


def _select_sum(node: Node, args: list[VType]) -> VType:
    (dy,) = args
    _row(node, dy, "input")
    shape, by = tuple(node.attr("shape")), tuple(node.attr("by", ()))
    _check_by(node, by, dy.domain)
    if shape[len(by) :] != dy.shape:
        raise _fail(node, f"rows of shape {dy.shape} do not sum into {shape} by {by}")
    return VType(Domain.PARAM, shape, by)


define(Op.SELECT_SUM, _select_sum)


def _einsum(node: Node, args: list[VType]) -> VType:
    a, b = args
    if a.domain is not Domain.PARAM or b.domain is not Domain.PARAM:
        raise _fail(node, f"einsum composes params only, got {a} and {b}")
    shape = _einsum_shape(node, node.attr("equation"), a, b)
    by = tuple(node.attr("by", ()))
    if len(by) > len(shape):
        raise _fail(node, f"einsum result {shape} cannot have type dims {by}")
    return VType(Domain.PARAM, shape, by)


def _einsum_vjp(ctx: GradContext, node: Node, g: str) -> None:
    for i in (0, 1):
        if ctx.needs(node.args[i]):
            eq = _einsum_grad_eq(node.attr("equation"), i)
            ctx.give(i, ctx.emit(Op.EINSUM, [g, ctx.saved(node.args[1 - i])], "g", equation=eq,
                                 by=ctx.type_of(node.args[i]).by))


def _einsum_cost(node: Node, rows: Callable[[str], int], type_of: Callable[[str], VType]) -> tuple[int, int]:
    return 2 * node.type.numel * max(type_of(node.args[0]).shape[-1], 1), 0


define(Op.EINSUM, _einsum, _einsum_vjp, _einsum_cost)

# ------------------------------------------------------------------------------------------------- elementwise


def _binary(node: Node, args: list[VType]) -> VType:
    a, b = args
    _same_domain(node, a, b)
    if a.domain is Domain.PARAM and (a.shape != b.shape or a.by != b.by):
        raise _fail(node, f"param operands must match exactly, got {a} and {b}")
    return VType(a.domain, broadcast(node, a, b), a.by)


def _add_sub_vjp(ctx: GradContext, node: Node, g: str) -> None:
    a, b = node.args
    ctx.give(0, ctx.reduce_to(g, ctx.type_of(a).shape))
    if ctx.needs(b):
        gb = g if node.op is Op.ADD else ctx.emit(Op.NEG, [g], "g")
        ctx.give(1, ctx.reduce_to(gb, ctx.type_of(b).shape))


def _mul_vjp(ctx: GradContext, node: Node, g: str) -> None:
    for i in (0, 1):
        if ctx.needs(node.args[i]):
            prod = ctx.emit(Op.MUL, [g, ctx.saved(node.args[1 - i])], "g")
            ctx.give(i, ctx.reduce_to(prod, ctx.type_of(node.args[i]).shape))


define(Op.ADD, _binary, _add_sub_vjp)
define(Op.SUB, _binary, _add_sub_vjp)
define(Op.MUL, _binary, _mul_vjp)
define(Op.NEG, lambda node, args: args[0], lambda ctx, node, g: ctx.give(0, ctx.emit(Op.NEG, [g], "g")))
define(Op.SCALE, lambda node, args: args[0],
       lambda ctx, node, g: ctx.give(0, ctx.emit(Op.SCALE, [g], "g", c=node.attr("c"))))

# activations whose derivative is written in terms of their output (the others take their input)
ACT_USES_OUTPUT = ("exp", "sigmoid", "tanh")


def _act(node: Node, args: list[VType]) -> VType:
    if node.attr("fn") not in ACTIVATIONS:
        raise _fail(node, f"unknown activation {node.attr('fn')!r}; known: {ACTIVATIONS}")
    _row(node, args[0], "input")
    return args[0]


def _act_vjp(ctx: GradContext, node: Node, g: str) -> None:
    a = ctx.saved(node.name) if node.attr("fn") in ACT_USES_OUTPUT else ctx.saved(node.args[0])
    ctx.give(0, ctx.emit(Op.ACT_GRAD, [a, g], "g", fn=node.attr("fn"), slope=node.attr("slope", 0.0)))


define(Op.ACT, _act, _act_vjp)


def _act_grad(node: Node, args: list[VType]) -> VType:
    a, dy = args
    _same_domain(node, a, dy)
    if a.shape != dy.shape:
        raise _fail(node, f"shapes differ: {a.shape} vs {dy.shape}")
    return dy


define(Op.ACT_GRAD, _act_grad)

# ------------------------------------------------------------------------------------------------- feature dims


def _inner(node: Node, args: list[VType]) -> VType:
    a, b = args
    _row(node, a, "operand")
    _same_domain(node, a, b)
    if a.shape != b.shape or not a.shape:
        raise _fail(node, f"inner product needs equal non-scalar shapes, got {a.shape} and {b.shape}")
    return VType(a.domain, a.shape[:-1])


def _inner_vjp(ctx: GradContext, node: Node, g: str) -> None:
    for i in (0, 1):
        if ctx.needs(node.args[i]):
            ctx.give(i, ctx.emit(Op.MUL, [g, ctx.saved(node.args[1 - i])], "g"))


define(Op.INNER, _inner, _inner_vjp)


def _reduce_last(node: Node, args: list[VType]) -> VType:
    shape = tuple(node.attr("shape"))
    if not is_prefix(shape, args[0].shape):
        raise _fail(node, f"cannot sum {args[0].shape} down to {shape}")
    return VType(args[0].domain, shape)


def _expand(node: Node, args: list[VType]) -> VType:
    shape = tuple(node.attr("shape"))
    if not is_prefix(args[0].shape, shape):
        raise _fail(node, f"cannot broadcast {args[0].shape} up to {shape}")
    return VType(args[0].domain, shape)


define(Op.REDUCE_LAST, _reduce_last,
       lambda ctx, node, g: ctx.give(0, ctx.emit(Op.EXPAND, [g], "g", shape=ctx.type_of(node.args[0]).shape)))
define(Op.EXPAND, _expand,
       lambda ctx, node, g: ctx.give(0, ctx.emit(Op.REDUCE_LAST, [g], "g", shape=ctx.type_of(node.args[0]).shape)))


def _reshape(node: Node, args: list[VType]) -> VType:
    x = args[0]
    shape = tuple(node.attr("shape"))
    if VType(x.domain, shape).numel != x.numel:
        raise _fail(node, f"cannot reshape {x.shape} to {shape}")
    if x.domain is Domain.PARAM and shape[: len(x.by)] != x.shape[: len(x.by)]:
        raise _fail(node, f"reshaping param {x} must keep its type dims")
    return VType(x.domain, shape, x.by)


define(Op.RESHAPE, _reshape,
       lambda ctx, node, g: ctx.give(0, ctx.emit(Op.RESHAPE, [g], "g", shape=ctx.type_of(node.args[0]).shape)),
       _none)  # a view


def _concat(node: Node, args: list[VType]) -> VType:
    a, b = args
    _row(node, a, "operand")
    _same_domain(node, a, b)
    if not a.shape or len(a.shape) != len(b.shape) or a.shape[:-1] != b.shape[:-1]:
        raise _fail(node, f"cannot concatenate {a.shape} and {b.shape} along the last dimension")
    return VType(a.domain, a.shape[:-1] + (a.shape[-1] + b.shape[-1],))


def _concat_vjp(ctx: GradContext, node: Node, g: str) -> None:
    na, nb = ctx.type_of(node.args[0]).shape[-1], ctx.type_of(node.args[1]).shape[-1]
    ctx.give(0, ctx.emit(Op.SLICE, [g], "g", start=0, stop=na))
    ctx.give(1, ctx.emit(Op.SLICE, [g], "g", start=na, stop=na + nb))


define(Op.CONCAT, _concat, _concat_vjp)


def _slice(node: Node, args: list[VType]) -> VType:
    x = args[0]
    start, stop = node.attr("start"), node.attr("stop")
    if not x.shape or not 0 <= start < stop <= x.shape[-1]:
        raise _fail(node, f"slice [{start}:{stop}] out of range for {x.shape}")
    return VType(x.domain, x.shape[:-1] + (stop - start,))


define(Op.SLICE, _slice)

# ------------------------------------------------------------------------------------------------- graph reductions


def _edge_softmax(node: Node, args: list[VType]) -> VType:
    if args[0].domain is not Domain.EDGE:
        raise _fail(node, f"edge softmax normalises edge scores, got {args[0]}")
    return args[0]


def _edge_softmax_vjp(ctx: GradContext, node: Node, g: str) -> None:
    # y = softmax(s): ds = y * (dy - sum_{edges into dst} y * dy)
    y = ctx.saved(node.name)
    weighted = ctx.emit(Op.MUL, [y, g], "g")
    per_dst = ctx.emit(Op.SCATTER_ADD, [weighted], "g", via="dst")
    back = ctx.emit(Op.GATHER, [per_dst], "g", via="dst")
    ctx.give(0, ctx.emit(Op.MUL, [y, ctx.emit(Op.SUB, [g, back], "g")], "g"))


def _edge_softmax_cost(node: Node, rows: Callable[[str], int], type_of: Callable[[str], VType]) -> tuple[int, int]:
    return 4 * rows(node.name) * node.type.numel, 0  # max, exp, sum, divide


define(Op.EDGE_SOFTMAX, _edge_softmax, _edge_softmax_vjp, _edge_softmax_cost)


__all__ = ["ACT_USES_OUTPUT", "OPS", "GradContext", "OpDef", "broadcast", "define", "elementwise_cost", "infer",
           "is_prefix"]
