"""Shape/dtype/domain inference: (re)types every node from its arguments, in order."""

from __future__ import annotations

from ..ir.core import Program
from ..ir.types import infer


def infer_types(program: Program) -> Program:
    """Fill in (or refresh) every node's type; raises DSLTypeError where a rewrite produced ill-typed IR."""
    types = {}
    nodes = []
    for node in program.nodes:
        t = infer(node, [types[a] for a in node.args])
        types[node.name] = t
        nodes.append(node if node.type == t else node.replace(type=t))
    return program.with_nodes(nodes)
