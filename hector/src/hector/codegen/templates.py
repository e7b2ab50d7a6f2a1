"""CUDA expression templates shared by the kernel families: activations, their gradients, weight offsets."""

from __future__ import annotations

from collections.abc import Callable

from ..ir.core import Node, Op


def act_expr(fn: str, x: str, slope: float) -> str:
    if fn == "exp":
        return f"hexp({x})"
    if fn == "relu":
        return f"({x} > (acc_t)0 ? {x} : (acc_t)0)"
    if fn == "leaky_relu":
        return f"({x} > (acc_t)0 ? {x} : {x} * (acc_t){float(slope)!r})"
    if fn == "sigmoid":
        return f"((acc_t)1 / ((acc_t)1 + hexp(-{x})))"
    if fn == "tanh":
        return f"htanh({x})"
    return f"((acc_t)0.5 * {x} * ((acc_t)1 + herf({x} * (acc_t)0.70710678118654752440)))"


def act_grad_expr(fn: str, a: str, dy: str, slope: float) -> str:
    if fn == "exp":
        return f"{dy} * {a}"
    if fn == "sigmoid":
        return f"{dy} * {a} * ((acc_t)1 - {a})"
    if fn == "tanh":
        return f"{dy} * ((acc_t)1 - {a} * {a})"
    if fn == "relu":
        return f"({a} > (acc_t)0 ? {dy} : (acc_t)0)"
    if fn == "leaky_relu":
        return f"({a} > (acc_t)0 ? {dy} : {dy} * (acc_t){float(slope)!r})"
    return (f"{dy} * ((acc_t)0.5 * ((acc_t)1 + herf({a} * (acc_t)0.70710678118654752440)) + {a} * "
            f"hexp((acc_t)-0.5 * {a} * {a}) * (acc_t)0.39894228040143267794)")


def weight_offset(core: tuple[int, ...], transpose: bool, k: str, c: str) -> tuple[str, str]:
    """(condition, offset) of element [k][c] of the effective dense matrix of a weight core: 2-D ``[Din, Dout]``
    (or its transpose), or per-head ``[H, Din, Dout]`` as a block-diagonal matrix (zero off the diagonal)."""
    if len(core) == 2:
        din, dout = core
        return "true", (f"({c}) * {dout} + ({k})" if transpose else f"({k}) * {dout} + ({c})")
    h, din, dout = core
    kin, cout = (dout, din) if transpose else (din, dout)
    cond = f"({k}) / {kin} == ({c}) / {cout}"
    hh, kk, cc = f"(({k}) / {kin})", f"(({k}) % {kin})", f"(({c}) % {cout})"
    off = f"{hh} * {din * dout} + " + (f"{cc} * {dout} + {kk}" if transpose else f"{kk} * {dout} + {cc}")
    return cond, off


# CUDA expression of one element of an elementwise op, from its operands' element expressions (already broadcast to
# the output's shape): the traversal emitter's table for these ops. A new elementwise op is one entry here.
ELEMENTWISE: dict[Op, Callable[[Node, list[str]], str]] = {
    Op.ADD: lambda node, x: f"{x[0]} + {x[1]}",
    Op.SUB: lambda node, x: f"{x[0]} - {x[1]}",
    Op.MUL: lambda node, x: f"{x[0]} * {x[1]}",
    Op.NEG: lambda node, x: f"-{x[0]}",
    Op.SCALE: lambda node, x: f"{x[0]} * (acc_t){float(node.attr('c'))!r}",
    Op.ACT: lambda node, x: act_expr(node.attr("fn"), x[0], node.attr("slope", 0.0)),
    Op.ACT_GRAD: lambda node, x: act_grad_expr(node.attr("fn"), x[0], x[1], node.attr("slope", 0.0)),
}

# elementwise ops whose operands broadcast (prefix broadcasting: (H,) with (H, D)); the others keep one shape
BROADCASTING = (Op.ADD, Op.SUB, Op.MUL)
