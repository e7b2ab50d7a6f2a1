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
import math
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


# torch.einsum's own op: the Python function torch.einsum calls it for two operands after a few checks (a
# layer's backward calls this on the host time a small step is bound by)
_EINSUM = torch._C._VariableFunctions.einsum

# A contraction summing more terms per output than this (a weight gradient summed over every relation's rows) runs
# as a batch of GEMMs over parts of SPLIT_ROWS rows, whose results are then summed: a single GEMM with a reduction
# that long and a small result (a few hundred outputs) keeps only a few thread blocks busy; the parts spread the
# reduction over the whole GPU, in a fixed order (deterministic).
SPLIT_TERMS = 1 << 16
SPLIT_ROWS = 2048


@functools.lru_cache(maxsize=256)
def _matmul_form(equation: str) -> tuple[int, bool] | None:
    """For ``equation`` = ``"<s><p>,<s><q>->..."`` (the same summed labels ``s`` leading both operands, no label
    kept from both, the output ``p q`` or ``q p``): (len(s), whether the output is ``q p``). None otherwise."""
    inputs, _, output = equation.partition("->")
    la, lb = inputs.split(",")
    summed = [ch for ch in dict.fromkeys(la + lb) if ch not in output]
    n = len(summed)
    if not n or la[:n] != lb[:n] or set(la[:n]) != set(summed) or len(set(la + lb)) != len(la) + len(lb) - n:
        return None
    p, q = la[n:], lb[n:]
    if output == p + q:
        return n, False
    if output == q + p:
        return n, True
    return None


def _split_reduction(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a.T @ b`` for ``a`` [K, P] and ``b`` [K, Q] with a long K: a batch of GEMMs over parts of K, summed."""
    k = a.size(0)
    parts = max(1, k // SPLIT_ROWS)
    rows = k // parts
    head = parts * rows
    out = torch.bmm(a[:head].reshape(parts, rows, -1).transpose(1, 2), b[:head].reshape(parts, rows, -1)).sum(0)
    if head < k:
        out += a[head:].t() @ b[head:]
    return out


def einsum(equation: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.einsum(equation, a, b)``, with the labels ordered as the larger operand lies in memory (see the
    module docstring): no operand copy where both operands' summed dims lie in the same order. A long reduction to a
    small result runs split (see ``SPLIT_TERMS``)."""
    eq = memory_order_equation(equation, a.numel() >= b.numel())
    form = _matmul_form(eq)
    if form is not None and a.shape[: form[0]] == b.shape[: form[0]]:
        n, swapped = form
        k = math.prod(a.shape[:n])
        if k >= SPLIT_TERMS and a.dim() > n and b.dim() > n:
            out = _split_reduction(a.reshape(k, -1), b.reshape(k, -1))
            shape = a.shape[n:] + b.shape[n:]
            if swapped:
                out, shape = out.t(), b.shape[n:] + a.shape[n:]
            return out.reshape(shape)
    return _EINSUM(eq, (a, b))


__all__ = ["SPLIT_ROWS", "SPLIT_TERMS", "einsum", "memory_order_equation"]
