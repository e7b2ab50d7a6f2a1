"""Dead-code elimination: drop every node the outputs do not depend on."""

from __future__ import annotations

from ..ir.core import Program


def dce(program: Program) -> Program:
    live = set(program.outputs)
    for node in reversed(program.nodes):
        if node.name in live:
            live.update(node.args)
    return program.with_nodes([n for n in program.nodes if n.name in live])
