"""Shape/dtype/domain rules: one function per op computing a node's type from its arguments' types.

The builder calls these as a program is written (so a type error points at the offending line), the verifier calls
them to check stored types, and the ``infer_types`` pass uses them to type nodes created by rewrites.
"""

from __future__ import annotations

import re

from ..errors import DSLTypeError
from .core import ACTIVATIONS, GATHER_VIA, GRAPH_CONSTS, INDEX_KINDS, ROW_DOMAINS, Domain, Node, Op, VType


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


def _linear_core(node: Node, w: VType) -> tuple[int, ...]:
    core = w.shape[len(w.by) :]
    if len(core) not in (2, 3):
        raise _fail(node, f"weight must be [types..., Din, Dout] or [types..., H, Din, Dout], got {w}")
    return core


def infer(node: Node, args: list[VType]) -> VType:
    """The type of ``node`` given its argument types; raises DSLTypeError naming the problem."""
    op, at = node.op, node.attr
    if op is Op.INPUT:
        return VType(Domain(at("domain")), tuple(at("shape")))
    if op is Op.PARAM:
        shape, by = tuple(at("shape")), tuple(at("by", ()))
        if len(shape) < len(by):
            raise _fail(node, f"param {at('name')!r} of shape {shape} cannot have {len(by)} type dims {by}")
        return VType(Domain.PARAM, shape, by)
    if op is Op.SAVED:
        return VType(Domain(at("domain")), tuple(at("shape")), tuple(at("by", ())))
    if op is Op.GRAPH:
        if at("kind") not in GRAPH_CONSTS:
            raise _fail(node, f"unknown graph constant {at('kind')!r}; known: {sorted(GRAPH_CONSTS)}")
        return VType(GRAPH_CONSTS[at("kind")], ())
    if op is Op.DROPOUT_MASK:
        p = at("p")
        if not 0.0 <= p < 1.0:
            raise _fail(node, f"dropout probability must be in [0, 1), got {p}")
        return VType(Domain(at("domain")), tuple(at("shape")))

    if op in (Op.GATHER, Op.SCATTER_ADD):
        via = at("via")
        if via not in GATHER_VIA:
            raise _fail(node, f"unknown 'via' {via!r}; known: {sorted(GATHER_VIA)}")
        src, dst = GATHER_VIA[via]
        want, got = (src, dst) if op is Op.GATHER else (dst, src)
        if args[0].domain != want:
            raise _fail(node, f"via={via} reads {want.value} rows, got {args[0]}")
        return VType(got, args[0].shape)

    if op is Op.LINEAR:
        x, w = args
        _row(node, x, "input")
        if w.domain is not Domain.PARAM:
            raise _fail(node, f"weight must be a param, got {w}")
        _check_by(node, w.by, x.domain)
        core = _linear_core(node, w)
        din, dout = (core[-1], core[-2]) if at("transpose") else (core[-2], core[-1])
        want = (din,) if len(core) == 2 else (core[0], din)
        if x.shape != want:
            raise _fail(node, f"input rows of shape {x.shape} do not fit weight {w} (need {want})")
        return VType(x.domain, (dout,) if len(core) == 2 else (core[0], dout))
    if op is Op.OUTER_SUM:
        x, dy = args
        _row(node, x, "input")
        _same_domain(node, x, dy)
        shape, by = tuple(at("shape")), tuple(at("by", ()))
        _check_by(node, by, x.domain)
        core = shape[len(by) :]
        want = (x.shape + dy.shape[-1:]) if len(core) == 3 else (x.shape[-1], dy.shape[-1])
        if len(core) == 3 and x.shape[:1] != dy.shape[:1]:
            raise _fail(node, f"head counts differ: {x.shape} vs {dy.shape}")
        if core != want:
            raise _fail(node, f"outer product of {x.shape} and {dy.shape} does not give {core}")
        return VType(Domain.PARAM, shape, by)
    if op is Op.SELECT:
        (p,) = args
        if p.domain is not Domain.PARAM:
            raise _fail(node, f"select reads a param, got {p}")
        domain = Domain(at("domain"))
        _check_by(node, p.by, domain)
        return VType(domain, p.shape[len(p.by) :])
    if op is Op.SELECT_SUM:
        (dy,) = args
        _row(node, dy, "input")
        shape, by = tuple(at("shape")), tuple(at("by", ()))
        _check_by(node, by, dy.domain)
        if shape[len(by) :] != dy.shape:
            raise _fail(node, f"rows of shape {dy.shape} do not sum into {shape} by {by}")
        return VType(Domain.PARAM, shape, by)
    if op is Op.EINSUM:
        a, b = args
        if a.domain is not Domain.PARAM or b.domain is not Domain.PARAM:
            raise _fail(node, f"einsum composes params only, got {a} and {b}")
        shape = _einsum_shape(node, at("equation"), a, b)
        by = tuple(at("by", ()))
        if len(by) > len(shape):
            raise _fail(node, f"einsum result {shape} cannot have type dims {by}")
        return VType(Domain.PARAM, shape, by)

    if op in (Op.ADD, Op.SUB, Op.MUL):
        a, b = args
        _same_domain(node, a, b)
        if a.domain is Domain.PARAM and (a.shape != b.shape or a.by != b.by):
            raise _fail(node, f"param operands must match exactly, got {a} and {b}")
        return VType(a.domain, broadcast(node, a, b), a.by)
    if op in (Op.NEG, Op.SCALE):
        return args[0]
    if op is Op.ACT:
        if at("fn") not in ACTIVATIONS:
            raise _fail(node, f"unknown activation {at('fn')!r}; known: {ACTIVATIONS}")
        _row(node, args[0], "input")
        return args[0]
    if op is Op.ACT_GRAD:
        a, dy = args
        _same_domain(node, a, dy)
        if a.shape != dy.shape:
            raise _fail(node, f"shapes differ: {a.shape} vs {dy.shape}")
        return dy

    if op is Op.INNER:
        a, b = args
        _row(node, a, "operand")
        _same_domain(node, a, b)
        if a.shape != b.shape or not a.shape:
            raise _fail(node, f"inner product needs equal non-scalar shapes, got {a.shape} and {b.shape}")
        return VType(a.domain, a.shape[:-1])
    if op is Op.REDUCE_LAST:
        shape = tuple(at("shape"))
        if not is_prefix(shape, args[0].shape):
            raise _fail(node, f"cannot sum {args[0].shape} down to {shape}")
        return VType(args[0].domain, shape)
    if op is Op.EXPAND:
        shape = tuple(at("shape"))
        if not is_prefix(args[0].shape, shape):
            raise _fail(node, f"cannot broadcast {args[0].shape} up to {shape}")
        return VType(args[0].domain, shape)
    if op is Op.RESHAPE:
        x = args[0]
        shape = tuple(at("shape"))
        if VType(x.domain, shape).numel != x.numel:
            raise _fail(node, f"cannot reshape {x.shape} to {shape}")
        if x.domain is Domain.PARAM and shape[: len(x.by)] != x.shape[: len(x.by)]:
            raise _fail(node, f"reshaping param {x} must keep its type dims")
        return VType(x.domain, shape, x.by)
    if op is Op.CONCAT:
        a, b = args
        _row(node, a, "operand")
        _same_domain(node, a, b)
        if not a.shape or len(a.shape) != len(b.shape) or a.shape[:-1] != b.shape[:-1]:
            raise _fail(node, f"cannot concatenate {a.shape} and {b.shape} along the last dimension")
        return VType(a.domain, a.shape[:-1] + (a.shape[-1] + b.shape[-1],))
    if op is Op.SLICE:
        x = args[0]
        start, stop = at("start"), at("stop")
        if not x.shape or not 0 <= start < stop <= x.shape[-1]:
            raise _fail(node, f"slice [{start}:{stop}] out of range for {x.shape}")
        return VType(x.domain, x.shape[:-1] + (stop - start,))
    if op is Op.EDGE_SOFTMAX:
        if args[0].domain is not Domain.EDGE:
            raise _fail(node, f"edge softmax normalises edge scores, got {args[0]}")
        return args[0]
    raise _fail(node, "no type rule")  # pragma: no cover
