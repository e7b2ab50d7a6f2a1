"""The verifier: checks IR invariants. The pass pipeline runs it between stages in debug mode."""

from __future__ import annotations

from ..errors import DSLTypeError, IRVerificationError
from .core import ARITY, Node, Op, Program
from .types import infer

_REQUIRED_ATTRS = {
    Op.INPUT: ("name", "domain", "shape"),
    Op.PARAM: ("name", "shape"),
    Op.SAVED: ("name", "domain", "shape"),
    Op.GRAPH: ("kind",),
    Op.DROPOUT_MASK: ("p", "domain", "shape"),
    Op.GATHER: ("via",),
    Op.SCATTER_ADD: ("via",),
    Op.OUTER_SUM: ("shape",),
    Op.SELECT: ("domain",),
    Op.SELECT_SUM: ("shape",),
    Op.EINSUM: ("equation",),
    Op.SCALE: ("c",),
    Op.ACT: ("fn",),
    Op.ACT_GRAD: ("fn",),
    Op.REDUCE_LAST: ("shape",),
    Op.EXPAND: ("shape",),
    Op.RESHAPE: ("shape",),
    Op.SLICE: ("start", "stop"),
}


def verify(program: Program, stage: str = "") -> Program:
    """Raise IRVerificationError for the first broken invariant; return the program unchanged otherwise.

    Invariants: names are defined once and before use; each op has its arity and required attributes; every
    node has a type, equal to what the type rules infer from its arguments; input/param names are unique; the
    outputs exist.
    """
    where = f" after {stage}" if stage else ""

    def fail(node: Node | None, msg: str) -> IRVerificationError:
        at = f" at %{node.name} ({node.op.value})" if node is not None else ""
        return IRVerificationError(f"invalid IR in program {program.name!r}{where}{at}: {msg}")

    defined: dict[str, Node] = {}
    leaf_names: set[tuple[Op, str]] = set()
    for node in program.nodes:
        if not isinstance(node, Node) or not isinstance(node.op, Op):
            raise fail(None, f"{node!r} is not an IR node")
        if node.name in defined:
            raise fail(node, f"%{node.name} is defined twice (SSA: one definition per name)")
        if len(node.args) != ARITY[node.op]:
            raise fail(node, f"takes {ARITY[node.op]} argument(s), got {len(node.args)}")
        for a in node.args:
            if a not in defined:
                raise fail(node, f"uses %{a} before it is defined")
        for key in _REQUIRED_ATTRS.get(node.op, ()):
            if node.attr(key) is None:
                raise fail(node, f"missing attribute {key!r}")
        if node.op in (Op.INPUT, Op.PARAM, Op.SAVED):
            key = (node.op, node.attr("name"))
            if key in leaf_names:
                raise fail(node, f"two {node.op.value} leaves named {node.attr('name')!r}")
            leaf_names.add(key)
        if node.type is None:
            raise fail(node, "has no type (run infer_types)")
        try:
            want = infer(node, [defined[a].type for a in node.args])  # type: ignore[misc]
        except DSLTypeError as e:
            raise fail(node, f"type error: {e}") from None
        if want != node.type:
            raise fail(node, f"stored type {node.type} differs from inferred {want}")
        defined[node.name] = node
    if not program.outputs:
        raise fail(None, "returns nothing")
    for o in program.outputs:
        if o not in defined:
            raise fail(None, f"returns %{o}, which is not defined")
    return program
