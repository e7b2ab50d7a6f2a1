"""Reverse-mode automatic differentiation on the IR.

The backward program is generated from the forward one by per-op rules (vector-Jacobian products written in IR
ops), never hand-written per model. It reads forward values through ``saved`` leaves and the output gradients
through ``input`` leaves named ``grad:<output>``, and returns one gradient per requested input/param leaf. The
result is then optimised by the same passes as the forward program.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from ..ir.core import Domain, Op, Program
from .rewrite import Rewriter

_ACT_USES_OUTPUT = ("exp", "sigmoid", "tanh")


@dataclass(frozen=True)
class Backward:
    """A backward program and, for each of its outputs, the (op, name) of the forward leaf it is the gradient of."""

    program: Program
    grads_of: tuple[tuple[Op, str], ...]

    @property
    def saved(self) -> tuple[str, ...]:
        """Forward values the backward program reads (the forward pass must keep them)."""
        return tuple(n.attr("name") for n in self.program.nodes if n.op is Op.SAVED)

    @property
    def grad_inputs(self) -> tuple[str, ...]:
        return tuple(n.attr("name") for n in self.program.nodes if n.op is Op.INPUT)


def _einsum_grad_eq(eq: str, which: int) -> str:
    m = re.fullmatch(r"([a-z]+),([a-z]+)->([a-z]*)", eq)
    assert m is not None
    a, b, c = m.groups()
    target, other = (a, b) if which == 0 else (b, a)
    missing = set(target) - set(c) - set(other)
    if missing:
        raise NotImplementedError(f"einsum {eq!r}: gradient needs a broadcast over {sorted(missing)}")
    return f"{c},{other}->{target}"


def differentiate(fwd: Program, wrt: Iterable[tuple[Op, str]] | None = None) -> Backward:
    """Generate the backward program of ``fwd`` for the leaves ``wrt`` ((Op.INPUT|Op.PARAM, name) pairs;
    default: all inputs and params)."""
    leaves = {(n.op, n.attr("name")): n.name for n in fwd.nodes if n.op in (Op.INPUT, Op.PARAM)}
    want = set(leaves) if wrt is None else set(wrt)
    unknown = want - set(leaves)
    if unknown:
        raise ValueError(f"cannot differentiate with respect to {sorted(unknown)}: not leaves of {fwd.name}")

    needs: dict[str, bool] = {}
    for n in fwd.nodes:
        if n.op in (Op.INPUT, Op.PARAM):
            needs[n.name] = (n.op, n.attr("name")) in want
        else:
            needs[n.name] = any(needs[a] for a in n.args) and n.op not in (Op.GRAPH, Op.DROPOUT_MASK)

    rw = Rewriter(Program(fwd.name + "_backward", (), ()))
    rw._used |= {n.name for n in fwd.nodes}
    saved_names: dict[str, str] = {}

    def saved(name: str) -> str:
        """A forward value for the backward program. Gathers and per-row param reads are re-read from their
        (smaller) sources instead of being kept per edge."""
        if name not in saved_names:
            n = fwd.node(name)
            if n.op is Op.GATHER:
                saved_names[name] = rw.emit(Op.GATHER, [saved(n.args[0])], "s_" + name, via=n.attr("via"))
            elif n.op is Op.SELECT:
                saved_names[name] = rw.emit(Op.SELECT, [saved(n.args[0])], "s_" + name, domain=n.attr("domain"))
            elif n.op is Op.RESHAPE:
                saved_names[name] = rw.emit(Op.RESHAPE, [saved(n.args[0])], "s_" + name, shape=n.attr("shape"))
            else:
                t = fwd.type_of(name)
                saved_names[name] = rw.emit(Op.SAVED, [], "s_" + name, name=name, domain=t.domain.value,
                                            shape=t.shape, by=t.by)
        return saved_names[name]

    def shape(name: str) -> tuple[int, ...]:
        return fwd.type_of(name).shape

    def reduce_to(g: str, target: tuple[int, ...]) -> str:
        return g if rw.types[g].shape == target else rw.emit(Op.REDUCE_LAST, [g], "g", shape=target)

    grads: dict[str, list[str]] = defaultdict(list)
    for o in fwd.outputs:
        t = fwd.type_of(o)
        grads[o].append(rw.emit(Op.INPUT, [], "grad_" + o, name=f"grad:{o}", domain=t.domain.value,
                                shape=t.shape))

    def total(name: str) -> str:
        gs = grads[name]
        acc = gs[0]
        for g in gs[1:]:
            acc = rw.emit(Op.ADD, [acc, g], "g")
        return acc

    for node in reversed(fwd.nodes):
        if not needs[node.name] or not grads.get(node.name) or node.op in (Op.INPUT, Op.PARAM):
            continue
        g = total(node.name)
        op, at, args = node.op, node.attr, node.args

        def give(i: int, value: str, args: tuple[str, ...] = args) -> None:
            if needs[args[i]]:
                grads[args[i]].append(value)

        if op is Op.GATHER:
            give(0, rw.emit(Op.SCATTER_ADD, [g], "g", via=at("via")))
        elif op is Op.SCATTER_ADD:
            give(0, rw.emit(Op.GATHER, [g], "g", via=at("via")))
        elif op is Op.LINEAR:
            w = fwd.type_of(args[1])
            if not at("transpose"):
                if needs[args[0]]:
                    give(0, rw.emit(Op.LINEAR, [g, saved(args[1])], "g", transpose=True))
                if needs[args[1]]:
                    give(1, rw.emit(Op.OUTER_SUM, [saved(args[0]), g], "g", by=w.by, shape=w.shape))
            else:
                if needs[args[0]]:
                    give(0, rw.emit(Op.LINEAR, [g, saved(args[1])], "g", transpose=False))
                if needs[args[1]]:
                    give(1, rw.emit(Op.OUTER_SUM, [g, saved(args[0])], "g", by=w.by, shape=w.shape))
        elif op is Op.SELECT:
            p = fwd.type_of(args[0])
            give(0, rw.emit(Op.SELECT_SUM, [g], "g", by=p.by, shape=p.shape))
        elif op is Op.EINSUM:
            for i in (0, 1):
                if needs[args[i]]:
                    eq = _einsum_grad_eq(at("equation"), i)
                    give(i, rw.emit(Op.EINSUM, [g, saved(args[1 - i])], "g", equation=eq,
                                    by=fwd.type_of(args[i]).by))
        elif op in (Op.ADD, Op.SUB):
            give(0, reduce_to(g, shape(args[0])))
            if needs[args[1]]:
                gb = g if op is Op.ADD else rw.emit(Op.NEG, [g], "g")
                give(1, reduce_to(gb, shape(args[1])))
        elif op is Op.MUL:
            for i in (0, 1):
                if needs[args[i]]:
                    give(i, reduce_to(rw.emit(Op.MUL, [g, saved(args[1 - i])], "g"), shape(args[i])))
        elif op is Op.NEG:
            give(0, rw.emit(Op.NEG, [g], "g"))
        elif op is Op.SCALE:
            give(0, rw.emit(Op.SCALE, [g], "g", c=at("c")))
        elif op is Op.ACT:
            a = saved(node.name) if at("fn") in _ACT_USES_OUTPUT else saved(args[0])
            give(0, rw.emit(Op.ACT_GRAD, [a, g], "g", fn=at("fn"), slope=at("slope", 0.0)))
        elif op is Op.INNER:
            for i in (0, 1):
                if needs[args[i]]:
                    give(i, rw.emit(Op.MUL, [g, saved(args[1 - i])], "g"))
        elif op is Op.REDUCE_LAST:
            give(0, rw.emit(Op.EXPAND, [g], "g", shape=shape(args[0])))
        elif op is Op.EXPAND:
            give(0, rw.emit(Op.REDUCE_LAST, [g], "g", shape=shape(args[0])))
        elif op is Op.RESHAPE:
            give(0, rw.emit(Op.RESHAPE, [g], "g", shape=shape(args[0])))
        elif op is Op.CONCAT:
            na, nb = shape(args[0])[-1], shape(args[1])[-1]
            give(0, rw.emit(Op.SLICE, [g], "g", start=0, stop=na))
            give(1, rw.emit(Op.SLICE, [g], "g", start=na, stop=na + nb))
        elif op is Op.EDGE_SOFTMAX:
            # y = softmax(s): ds = y * (dy - sum_{edges into dst} y * dy)
            y = saved(node.name)
            weighted = rw.emit(Op.MUL, [y, g], "g")
            per_dst = rw.emit(Op.SCATTER_ADD, [weighted], "g", via="dst")
            back = rw.emit(Op.GATHER, [per_dst], "g", via="dst")
            give(0, rw.emit(Op.MUL, [y, rw.emit(Op.SUB, [g, back], "g")], "g"))
        else:
            raise NotImplementedError(f"no gradient rule for {op.value} (%{node.name}); higher-order "
                                      "derivatives of backward programs are not supported")

    outputs, grads_of = [], []
    for key in sorted(want, key=lambda k: (k[0].value, k[1])):
        name = leaves[key]
        if grads.get(name):
            outputs.append(total(name))
            grads_of.append(key)
    if not outputs:
        raise ValueError(f"no requested leaf of {fwd.name} influences its outputs")
    return Backward(rw.finish(tuple(outputs)), tuple(grads_of))


__all__ = ["Backward", "differentiate", "Domain"]
