"""Text form of a program, one node per line: ``%name = op(args) {attrs} : type``."""

from __future__ import annotations

from .core import Node, Op, Program

_LEAF_NAME_ATTR = (Op.INPUT, Op.PARAM, Op.SAVED)


def format_node(node: Node) -> str:
    args = ", ".join(f"%{a}" for a in node.args)
    attrs = dict(node.attrs)
    if node.op in _LEAF_NAME_ATTR:
        # shape/domain are already in the type; keep the line short.
        attrs = {k: v for k, v in attrs.items() if k not in ("shape", "domain", "by")}
    attr_text = ", ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in attrs.items())
    text = f"%{node.name} = {node.op.value}"
    if args:
        text += f"({args})"
    if attr_text:
        text += f" {{{attr_text}}}"
    return text + f" : {node.type if node.type is not None else '?'}"


def format_program(program: Program) -> str:
    lines = [f"program {program.name} {{"]
    lines += ["  " + format_node(n) for n in program.nodes]
    lines.append("  return " + ", ".join(f"%{o}" for o in program.outputs))
    lines.append("}")
    return "\n".join(lines)
