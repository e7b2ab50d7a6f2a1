"""Linear-operator reordering: ``(x A) B -> x (A B)`` where the composed weight ``A B`` is computed once per
forward from the params, instead of pushing every row through two maps.

The pattern is ``linear(y, B)`` with ``y`` one of

* ``linear(x, A)``                                     e.g. RGAT's ``(h W_r) a_r -> h (W_r a_r)``
* ``reshape(linear(x, A))``                            flat map, split into heads, then a per-head map
* ``[reshape](add(linear(x, A), select(bias)))``       affine maps: ``(x A + b) B = x (A B) + b B``
* ``gather([reshape](...linear(x, A)...))``            the inner map runs on nodes, the outer on edges:
  HGT's ``K W_att``: ``(x W_k[node type]) W_att[relation]`` becomes one edge/pair-level map by
  ``(source node type, relation)``.

Types compose: ``A`` typed by node type and ``B`` by relation give ``C = A B`` typed by (source node type,
relation). A rewrite happens when it lowers the multiply-adds for the given row counts (``force=True`` applies
every match, for tests).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from ..ir.core import Domain, Op, Program
from .dce import dce
from .rewrite import Rewriter

DEFAULT_ROWS = {Domain.NODE: 1_000.0, Domain.EDGE: 10_000.0, Domain.UNIQUE: 5_000.0}
_LETTER = {"etype": "r", "src_ntype": "s", "dst_ntype": "t", "ntype": "n"}
_RELABEL = {"src": "src_ntype", "unique_src": "src_ntype", "dst": "dst_ntype"}


@dataclass
class Match:
    outer: str
    x: str
    a: str
    b: str
    via: str | None
    reshape: tuple[int, ...] | None
    bias: str | None
    single_use: bool


def _match(p: Program, outer: str) -> Match | None:
    node = p.node(outer)
    users = p.users
    chain = []
    cur = p.node(node.args[0])
    via = reshape = bias = None
    if cur.op is Op.GATHER and cur.attr("via") in _RELABEL:
        via = cur.attr("via")
        chain.append(cur)
        cur = p.node(cur.args[0])
    if cur.op is Op.RESHAPE:
        reshape = tuple(cur.attr("shape"))
        chain.append(cur)
        cur = p.node(cur.args[0])
    if cur.op is Op.ADD:
        sel = [a for a in cur.args if p.node(a).op is Op.SELECT]
        if len(sel) != 1:
            return None
        other = cur.args[1] if cur.args[0] == sel[0] else cur.args[0]
        bias = p.node(sel[0]).args[0]
        chain += [cur, p.node(sel[0])]
        cur = p.node(other)
    if cur.op is not Op.LINEAR or cur.attr("transpose"):
        return None
    chain.append(cur)
    single = all(len(users[n.name]) == 1 for n in chain)
    return Match(outer, cur.args[0], cur.args[1], node.args[1], via, reshape, bias, single)


def _macs(p: Program, w: str) -> int:
    t = p.type_of(w)
    return math.prod(t.shape[len(t.by):])


def _plan(p: Program, m: Match) -> dict | None:
    """Einsum equations and shapes for the composed weight (and bias), or None if the shapes don't compose."""
    ta, tb = p.type_of(m.a), p.type_of(m.b)
    ca, cb = ta.shape[len(ta.by):], tb.shape[len(tb.by):]
    a_by = tuple(_RELABEL[m.via] if (m.via and k == "ntype") else k for k in ta.by)
    if m.via is None and any(k == "ntype" for k in ta.by) and p.type_of(m.x).domain is not Domain.NODE:
        return None
    c_by = a_by + tuple(k for k in tb.by if k not in a_by)
    la, lb, lc = ("".join(_LETTER[k] for k in by) for by in (a_by, tb.by, c_by))
    if len(ca) == 2 and len(cb) == 2 and m.reshape is None:  # flat . flat
        if ca[1] != cb[0]:
            return None
        return dict(kind="flat", a_shape=None, eq=f"{la}im,{lb}mo->{lc}io", c_by=c_by, out=None,
                    bias_shape=None, bias_eq="{bb}m," + lb + "mo->{bc}o", c_flat=None)
    if len(ca) == 2 and len(cb) == 3 and m.reshape is not None and len(m.reshape) == 2:  # flat . split . heads
        h, d = m.reshape
        if cb[:2] != (h, d):
            return None
        dout = cb[2]
        lead = ta.shape[:len(ta.by)]
        return dict(kind="split", a_shape=lead + (ca[0], h, d), eq=f"{la}ihm,{lb}hmo->{lc}iho", c_by=c_by,
                    out=(h, dout), bias_split=(h, d), bias_eq="{bb}hm," + lb + "hmo->{bc}ho", c_flat=h * dout)
    if len(ca) == 3 and len(cb) == 3 and m.reshape is None:  # heads . heads
        if ca[0] != cb[0] or ca[2] != cb[1]:
            return None
        return dict(kind="heads", a_shape=None, eq=f"{la}him,{lb}hmo->{lc}hio", c_by=c_by, out=None,
                    bias_shape=None, bias_eq="{bb}hm," + lb + "hmo->{bc}ho", c_flat=None)
    return None


def _pays(p: Program, m: Match, plan: dict, rows: Mapping[Domain, float]) -> bool:
    outer_rows = rows[p.type_of(m.outer).domain]
    inner_rows = rows[p.type_of(m.x).domain]
    before = outer_rows * _macs(p, m.b) + (inner_rows * _macs(p, m.a) if m.single_use else 0.0)
    ta, tb = p.type_of(m.a), p.type_of(m.b)
    ca, cb = ta.shape[len(ta.by):], tb.shape[len(tb.by):]
    if plan["kind"] == "flat":
        c_core_macs = ca[0] * cb[1]
    elif plan["kind"] == "split":
        c_core_macs = ca[0] * plan["out"][0] * plan["out"][1]
    else:
        c_core_macs = ca[0] * ca[1] * cb[2]
    types = 1.0
    for k in plan["c_by"]:
        types *= rows.get(k, 1.0)  # type counts default to 1 when unknown
    precompute = types * math.prod(ca) * cb[-1]
    after = outer_rows * c_core_macs + precompute
    return after < before


def reorder(program: Program, rows: Mapping | None = None, force: bool = False) -> Program:
    """Rewrite matching linear chains; ``rows`` maps domains (and type-index kinds) to counts for the cost test."""
    rows = {**DEFAULT_ROWS, **(rows or {})}
    rw = Rewriter(program)
    for n in program.nodes:
        if n.op is Op.LINEAR and not n.attr("transpose"):
            m = _match(program, n.name)
            plan = _plan(program, m) if m else None
            if plan is not None and (force or _pays(program, m, plan, rows)):
                rw.replace_with(n.name, _rewrite(rw, program, m, plan))
                continue
        rw.keep(n)
    return dce(rw.finish())


def _rewrite(rw: Rewriter, p: Program, m: Match, plan: dict) -> str:
    a = m.a
    if plan["a_shape"] is not None:
        a = rw.emit(Op.RESHAPE, [a], "w", shape=plan["a_shape"])
    c = rw.emit(Op.EINSUM, [a, m.b], "w", equation=plan["eq"], by=plan["c_by"])
    if plan["c_flat"] is not None:
        t = rw.types[c]
        c = rw.emit(Op.RESHAPE, [c], "w", shape=t.shape[:len(t.by)] + (t.shape[len(t.by)], plan["c_flat"]))
    x = m.x
    if m.via is not None:
        x = rw.emit(Op.GATHER, [x], "x", via=m.via)
    out = rw.emit(Op.LINEAR, [x, c], m.outer, transpose=False)
    if m.bias is not None:
        tbias = p.type_of(m.bias)
        bias = m.bias
        bb_by = tuple(_RELABEL[m.via] if (m.via and k == "ntype") else k for k in tbias.by)
        if plan["kind"] == "split":
            bias = rw.emit(Op.RESHAPE, [bias], "b", shape=tbias.shape[:len(tbias.by)] + plan["bias_split"])
        tb = p.type_of(m.b)
        bc_by = bb_by + tuple(k for k in tb.by if k not in bb_by)
        eq = plan["bias_eq"].format(bb="".join(_LETTER[k] for k in bb_by), bc="".join(_LETTER[k] for k in bc_by))
        cb = rw.emit(Op.EINSUM, [bias, m.b], "b", equation=eq, by=bc_by)
        if plan["c_flat"] is not None:
            t = rw.types[cb]
            cb = rw.emit(Op.RESHAPE, [cb], "b", shape=t.shape[:len(t.by)] + (plan["c_flat"],))
        sel = rw.emit(Op.SELECT, [cb], "b", domain=rw.types[out].domain.value)
        out = rw.emit(Op.ADD, [out, sel], m.outer)
    if plan["out"] is not None:
        out = rw.emit(Op.RESHAPE, [out], m.outer, shape=plan["out"])
    return out
