"""``torch.einsum`` of two operands without copying an operand for the contraction.

``torch.einsum`` arranges each operand as [kept dims, summed dims] and flattens the summed dims into one GEMM
dimension, taking the summed dims in the alphabetical order of their labels, not in the order they lie in memory.
When the two differ the flattening cannot be a view and the operand is copied, transposed: for the gradient of a
weight shared by all relations through a reordered composition (``"rio,rim->mo"``, summed over relation and
feature), that is a strided copy of the whole per-relation weight ([R, in, out]: hundreds of MB at 10,000
relations) on every training step, slower than the GEMM itself. Relabelling the letters so that their alphabetical
order is the larger operand's memory order (then the smaller one's) keeps both operands views where their summed
dims lie in the same order, which is what the IR's weight einsums have.
"""

from __future__ import annotations

import functools
import string

import torch


@functools.lru_cache(maxsize=256)
def memory_order_equation(equation: str, larger_first: bool = True) -> str:
    """``equation`` (``"ab,bc->ac"``, two operands, lower-case labels) with its labels renamed ``a``, ``b``, ...
    in the order they first appear in the operands (the second operand first when ``larger_first`` is False).
    The renamed equation computes the same contraction."""
    inputs, _, output = equation.partition("->")
    first, second = inputs.split(",")
    order = first + second if larger_first else second + first
    rename: dict[str, str] = {}
    for ch in order + output:
        if ch not in rename:
            if ch not in string.ascii_lowercase:
                raise ValueError(f"einsum equation {equation!r}: labels must be lower-case letters, got {ch!r}")
            rename[ch] = string.ascii_lowercase[len(rename)]
    return "".join(rename.get(ch, ch) for ch in equation)


def einsum(equation: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.einsum(equation, a, b)``, with the labels ordered as the larger operand lies in memory (see the
    module docstring): no operand copy where both operands' summed dims lie in the same order."""
    return torch.einsum(memory_order_equation(equation, a.numel() >= b.numel()), a, b)


__all__ = ["einsum", "memory_order_equation"]
