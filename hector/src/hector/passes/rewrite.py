"""A small helper every pass uses to build a new program from an old one (nodes are immutable)."""

from __future__ import annotations

from typing import Any

from ..ir.core import Node, Op, Program, VType, make_attrs
from ..ir.types import infer


class Rewriter:
    """Emits nodes into a fresh program, renaming arguments as old values are replaced by new ones."""

    def __init__(self, program: Program):
        self.program = program
        self.nodes: list[Node] = []
        self.types: dict[str, VType] = {}
        self.rename: dict[str, str] = {}
        self._used = {n.name for n in program.nodes}
        self._counter = 0

    def fresh(self, hint: str) -> str:
        base = hint.rstrip("0123456789_") or "v"
        while True:
            self._counter += 1
            name = f"{base}_{self._counter}"
            if name not in self._used:
                self._used.add(name)
                return name

    def arg(self, name: str) -> str:
        while name in self.rename:
            name = self.rename[name]
        return name

    def type(self, name: str) -> VType:
        return self.types[self.arg(name)]

    def keep(self, node: Node) -> str:
        """Copy an old node, with its arguments renamed and its type re-inferred."""
        new = node.replace(args=tuple(self.arg(a) for a in node.args))
        new = new.replace(type=infer(new, [self.types[a] for a in new.args]))
        self.nodes.append(new)
        self.types[new.name] = new.type  # type: ignore[assignment]
        return new.name

    def emit(self, op: Op, args: list[str] | tuple[str, ...], hint: str = "v", **attrs: Any) -> str:
        args = tuple(self.arg(a) for a in args)
        node = Node(self.fresh(hint), op, args, make_attrs(**attrs))
        node = node.replace(type=infer(node, [self.types[a] for a in args]))
        self.nodes.append(node)
        self.types[node.name] = node.type  # type: ignore[assignment]
        return node.name

    def replace_with(self, old: str, new: str) -> None:
        if old != new:
            self.rename[old] = new

    def finish(self, outputs: tuple[str, ...] | None = None) -> Program:
        outs = tuple(self.arg(o) for o in (self.program.outputs if outputs is None else outputs))
        return self.program.with_nodes(self.nodes, outs)
