"""Canonicalisation: local rewrites to a normal form that later passes (CSE, compaction, fusion) match on.

Rules (applied in one forward sweep, repeated until nothing changes):
* commutative operands in name order (so CSE sees ``a*b`` and ``b*a`` as one value);
* ``scale(scale(x, a), b) -> scale(x, a*b)``, ``scale(x, 1) -> x``, ``neg(neg(x)) -> x``,
  ``add(x, neg(y)) -> sub(x, y)``, ``sub(x, neg(y)) -> add(x, y)``;
* ``reshape(reshape(x)) -> reshape(x)``, reshape to the same shape -> x, ``reduce_last(expand(x)) -> x`` when
  shapes round-trip;
* node-wise work is hoisted above gathers: ``f(gather(x))`` -> ``gather(f(x))`` for unary elementwise ops,
  reshapes and *untyped* linear maps, so it runs once per node instead of once per edge.
"""

from __future__ import annotations

from ..ir.core import COMMUTATIVE, Domain, Op, Program
from .rewrite import Rewriter

_HOISTABLE_VIA = ("src", "dst", "unique_src")
_UNARY = (Op.NEG, Op.SCALE, Op.ACT, Op.RESHAPE)


def _sweep(program: Program) -> tuple[Program, bool]:
    rw = Rewriter(program)
    defs = {}  # new name -> new node
    changed = False

    def node_of(name):
        return defs.get(rw.arg(name))

    for node in program.nodes:
        args = [rw.arg(a) for a in node.args]
        op, at = node.op, node.attr
        a0 = node_of(args[0]) if args else None

        def alias(to, node=node):
            nonlocal changed
            rw.replace_with(node.name, to)
            changed = True

        if op is Op.SCALE and at("c") == 1.0:
            alias(args[0])
            continue
        if op is Op.SCALE and a0 is not None and a0.op is Op.SCALE:
            new = rw.emit(Op.SCALE, [a0.args[0]], node.name, c=a0.attr("c") * at("c"))
            alias(new)
            defs[new] = rw.nodes[-1]
            continue
        if op is Op.NEG and a0 is not None and a0.op is Op.NEG:
            alias(a0.args[0])
            continue
        if op in (Op.ADD, Op.SUB):
            a1 = node_of(args[1])
            if a1 is not None and a1.op is Op.NEG and rw.type(args[0]).shape == rw.type(args[1]).shape:
                new = rw.emit(Op.SUB if op is Op.ADD else Op.ADD, [args[0], a1.args[0]], node.name)
                alias(new)
                defs[new] = rw.nodes[-1]
                continue
        if op is Op.RESHAPE and tuple(at("shape")) == rw.type(args[0]).shape:
            alias(args[0])
            continue
        if op is Op.RESHAPE and a0 is not None and a0.op is Op.RESHAPE:
            new = rw.emit(Op.RESHAPE, [a0.args[0]], node.name, shape=tuple(at("shape")))
            alias(new)
            defs[new] = rw.nodes[-1]
            continue
        if op is Op.REDUCE_LAST and a0 is not None and a0.op is Op.EXPAND \
                and rw.type(a0.args[0]).shape == tuple(at("shape")):
            alias(a0.args[0])
            continue
        # Hoist node-wise work above a gather (only when the gather is the sole consumer's input; the hoisted
        # value is computed per node, the gathered copy is shared through CSE).
        if a0 is not None and a0.op is Op.GATHER and a0.attr("via") in _HOISTABLE_VIA \
                and rw.type(a0.args[0]).domain is Domain.NODE:
            hoist = op in _UNARY or (op is Op.LINEAR and not rw.type(args[1]).by)
            if hoist:
                inner = rw.emit(op, [a0.args[0]] + args[1:], node.name, **node.attr_dict)
                defs[inner] = rw.nodes[-1]
                new = rw.emit(Op.GATHER, [inner], node.name, via=a0.attr("via"))
                defs[new] = rw.nodes[-1]
                alias(new)
                continue
        if op in COMMUTATIVE and args != sorted(args):
            new = rw.emit(op, sorted(args), node.name, **node.attr_dict)
            defs[new] = rw.nodes[-1]
            alias(new)
            continue
        new = rw.keep(node)
        defs[new] = rw.nodes[-1]
    return rw.finish(), changed


def canonicalize(program: Program, max_sweeps: int = 16) -> Program:
    for _ in range(max_sweeps):
        program, changed = _sweep(program)
        if not changed:
            break
    return program
