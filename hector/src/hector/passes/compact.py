"""Compact materialisation: an edge value that depends only on (source node, relation) is computed once per
unique (source, relation) pair, then read by each edge through the pair inverse index.

An EDGE value is *pair-determined* when it is built from source-node gathers, params typed by ``etype`` or
``src_ntype`` (selects, typed linear maps) and elementwise/feature ops of pair-determined values. Where such a
value that does real work (a linear map, an activation, ...) is consumed by something that is not
pair-determined, the pass rebuilds it on the UNIQUE domain (``gather(x, via=unique_src)``, the same typed weights)
and replaces the use with ``gather(value, via=unique)``. On a graph with E edges and U unique pairs, the
materialised rows of that value drop from E to U. Whether that pays is the cost model's call.
"""

from __future__ import annotations

from ..ir.core import Domain, Op, OpKind, Program
from .rewrite import Rewriter

_PAIR_KINDS = {"etype", "src_ntype"}
_ROWWISE = (OpKind.ELEMENTWISE, OpKind.FEATURE)


def pair_determined(program: Program) -> dict[str, bool]:
    """For every node: is it an EDGE value that depends on (source, relation) only?"""
    pd: dict[str, bool] = {}
    for n in program.nodes:
        t = n.type
        ok = False
        if t is not None and t.domain is Domain.EDGE:
            if n.op is Op.GATHER:
                ok = n.attr("via") == "src"
            elif n.op is Op.SELECT:
                ok = set(program.type_of(n.args[0]).by) <= _PAIR_KINDS
            elif n.op is Op.LINEAR:
                ok = pd.get(n.args[0], False) and set(program.type_of(n.args[1]).by) <= _PAIR_KINDS
            elif n.op.kind in _ROWWISE and n.op is not Op.ACT_GRAD:
                ok = all(pd.get(a, False) or program.type_of(a).domain is Domain.PARAM for a in n.args)
        pd[n.name] = ok
    return pd


def compact(program: Program) -> Program:
    pd = pair_determined(program)
    work: dict[str, bool] = {}
    for n in program.nodes:
        work[n.name] = pd[n.name] and (n.op not in (Op.GATHER, Op.SELECT) or any(work.get(a, False) for a in n.args))

    rw = Rewriter(program)
    unique_of: dict[str, str] = {}
    expanded: dict[str, str] = {}

    def to_unique(name: str) -> str:
        if name in unique_of:
            return unique_of[name]
        n = program.node(name)
        if program.type_of(name).domain is Domain.PARAM:
            return rw.arg(name)
        if n.op is Op.GATHER:  # via src
            new = rw.emit(Op.GATHER, [n.args[0]], name, via="unique_src")
        elif n.op is Op.SELECT:
            new = rw.emit(Op.SELECT, [n.args[0]], name, domain=Domain.UNIQUE.value)
        else:
            new = rw.emit(n.op, [to_unique(a) for a in n.args], name, **n.attr_dict)
        unique_of[name] = new
        return new

    def expand(name: str) -> str:
        if name not in expanded:
            expanded[name] = rw.emit(Op.GATHER, [to_unique(name)], name, via="unique")
        return expanded[name]

    for n in program.nodes:
        if pd[n.name]:
            rw.keep(n)  # the per-edge version stays for pair-determined users; DCE drops it if none remain
            continue
        new_args = [expand(a) if work.get(a, False) else rw.arg(a) for a in n.args]
        rw.keep(n.replace(args=tuple(new_args)))
    outs = tuple(expand(o) if work.get(o, False) else o for o in program.outputs)
    return rw.finish(outs)
