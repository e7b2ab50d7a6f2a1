"""Reverse-mode automatic differentiation on the IR.

The backward program is generated from the forward one by per-op rules (vector-Jacobian products written in IR
ops, ``OPS[op].vjp`` in :mod:`hector.ir.opdefs`), never hand-written per model. It reads forward values through
``saved`` leaves and the output gradients through ``input`` leaves named ``grad:<output>``, and returns one
gradient per requested input/param leaf. The result is then optimised by the same passes as the forward program.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from ..ir.core import Domain, Op, Program
from ..ir.opdefs import OPS
from .rewrite import Rewriter


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

    class Context:
        """The derivative rules' view of this pass (:class:`hector.ir.opdefs.GradContext`)."""

        def __init__(self) -> None:
            self.args: tuple[str, ...] = ()

        def emit(self, op: Op, args: list[str], hint: str, **attrs) -> str:
            return rw.emit(op, args, hint, **attrs)

        def saved(self, name: str) -> str:
            return saved(name)

        def needs(self, name: str) -> bool:
            return needs[name]

        def give(self, i: int, grad: str) -> None:
            if needs[self.args[i]]:
                grads[self.args[i]].append(grad)

        def type_of(self, name: str):
            return fwd.type_of(name)

        def reduce_to(self, grad: str, target: tuple[int, ...]) -> str:
            return reduce_to(grad, target)

    ctx = Context()
    for node in reversed(fwd.nodes):
        if not needs[node.name] or not grads.get(node.name) or node.op in (Op.INPUT, Op.PARAM):
            continue
        rule = OPS[node.op].vjp
        if rule is None:
            raise NotImplementedError(f"no gradient rule for {node.op.value} (%{node.name}); higher-order "
                                      "derivatives of backward programs are not supported")
        ctx.args = node.args
        rule(ctx, node, total(node.name))

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
