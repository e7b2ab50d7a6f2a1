"""Common-subexpression elimination: nodes with the same op, arguments and attributes are computed once."""

from __future__ import annotations

from ..ir.core import COMMUTATIVE, Op, Program
from .rewrite import Rewriter

# Each dropout mask is a fresh random draw: two masks with equal attributes are still different values.
_NOT_PURE = (Op.DROPOUT_MASK,)


def cse(program: Program) -> Program:
    rw = Rewriter(program)
    seen: dict[tuple, str] = {}
    for node in program.nodes:
        args = tuple(rw.arg(a) for a in node.args)
        if node.op in COMMUTATIVE:
            args = tuple(sorted(args))
        key = (node.op, args, node.attrs)
        if node.op not in _NOT_PURE and key in seen:
            rw.replace_with(node.name, seen[key])
            continue
        seen[key] = rw.keep(node)
    return rw.finish()
