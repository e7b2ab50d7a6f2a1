"""Weight-only kernels (einsums composing params: reordering, basis decomposition), one thread per output element.

One thread per output is right where each output sums a few terms (composing ``W_r Q`` sums over one feature
dimension). Where an output sums many terms, the same kernel is a serial loop on a few threads: the gradient of a
weight shared by all relations through a reordered composition (``dQ = sum_r W_r^T d(W_r Q)``) has a few hundred
outputs, each a sum over relations x features (over a million terms at 10,000 relations), which took tens of
milliseconds per step on one GPU and grew with the relation count. Those einsums (more than
``SERIAL_TERMS`` terms per output) run as one ``torch.einsum`` in the accumulation dtype instead: a GEMM (cuBLAS
on a GPU) whose reduction is spread over the whole device (:mod:`hector.runtime.einsum`: no copy of an operand, and
the longest reductions split into a batch of GEMMs).
"""

from __future__ import annotations

import re

from ..ir.core import Op
from .common import KernelCode, Launch, Output, _Emitter
from .templates import act_expr

# Most terms one output of a generated param einsum sums on its own thread; longer reductions run as torch.einsum.
SERIAL_TERMS = 256


def summed_terms(equation: str, shape_a: tuple[int, ...], shape_b: tuple[int, ...]) -> int:
    """Terms each output of ``equation`` (``"ab,bc->ac"``) sums: the product of the summed extents."""
    m = re.fullmatch(r"([a-z]+),([a-z]+)->([a-z]*)", equation)
    la, lb, lo = m.groups()
    size = dict(zip(la, shape_a, strict=True)) | dict(zip(lb, shape_b, strict=True))
    terms = 1
    for ch in dict.fromkeys(la + lb):
        if ch not in lo:
            terms *= size[ch]
    return terms


class _ParamKernel(_Emitter):
    """Weight-only ops (composition of reordered weights, basis decomposition, sums of weight gradients): one
    thread per output element."""

    def generate(self) -> tuple[str, KernelCode]:
        g, p = self.g, self.p
        (name,) = self.members
        n = p.node(name)
        g.dtypes[name] = g.acc
        total = n.type.numel
        o_ptr = self.ptr(name, out=True)
        shape = n.type.shape
        if n.op is Op.EINSUM and summed_terms(n.attr("equation"), p.type_of(n.args[0]).shape,
                                              p.type_of(n.args[1]).shape) > SERIAL_TERMS:
            # a long reduction: torch.einsum in the runtime (see the module docstring), no CUDA source
            return "", KernelCode(self.k.name, self.k, (), Launch("torch", 0), (Output(name, g.acc, False),),
                                  torch_op="einsum")
        body = ["  const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;",
                f"  if (idx >= {total}) return;"]
        if n.op is Op.EINSUM:
            m = re.fullmatch(r"([a-z]+),([a-z]+)->([a-z]*)", n.attr("equation"))
            la, lb, lo = m.groups()
            sa, sb = p.type_of(n.args[0]).shape, p.type_of(n.args[1]).shape
            size = dict(zip(la, sa, strict=True)) | dict(zip(lb, sb, strict=True))
            rest = "idx"
            for ch, d in reversed(list(zip(lo, shape, strict=True))):
                body.append(f"  const i64 i_{ch} = {rest} % {d};")
                rest = f"({rest} / {d})"
            summed = [ch for ch in dict.fromkeys(la + lb) if ch not in lo]

            def offset(letters: str, dims: tuple[int, ...]) -> str:
                off, stride = [], 1
                for ch, d in reversed(list(zip(letters, dims, strict=True))):
                    off.append(f"i_{ch} * {stride}")
                    stride *= d
                return " + ".join(off) or "0"

            body.append("  acc_t t = 0;")
            indent = "  "
            for ch in summed:
                body.append(f"{indent}for (i64 i_{ch} = 0; i_{ch} < {size[ch]}; ++i_{ch})")
                indent += "  "
            body.append(f"{indent}t += ld({self.ptr(n.args[0])} + {offset(la, sa)}) * "
                        f"ld({self.ptr(n.args[1])} + {offset(lb, sb)});")
            body.append(f"  st({o_ptr} + idx, t);")
        else:
            args = [f"ld({self.ptr(a)} + idx)" for a in n.args]
            if n.op in (Op.ADD, Op.SUB, Op.MUL):
                e = f"{args[0]} {dict(add='+', sub='-', mul='*')[n.op.value]} {args[1]}"
            elif n.op is Op.NEG:
                e = f"-{args[0]}"
            elif n.op is Op.SCALE:
                e = f"{args[0]} * (acc_t){float(n.attr('c'))!r}"
            elif n.op is Op.RESHAPE:
                e = args[0]
            elif n.op is Op.ACT:
                e = act_expr(n.attr("fn"), args[0], n.attr("slope", 0.0))
            else:
                raise AssertionError(f"param kernel has no rule for {n.op}")  # pragma: no cover
            body.append(f"  st({o_ptr} + idx, {e});")
        params = ", ".join(f"{a.ctype} {a.cname}" for a in self.args.args)
        lines = ["// " + self.k.describe().replace("\n", "\n// "), self.g.comment(name),
                 f'extern "C" __global__ void {self.k.name}({params}) {{'] + body + ["}"]
        launch = Launch("elements", 256, (total,))
        return "\n".join(lines), KernelCode(self.k.name, self.k, tuple(self.args.args), launch,
                                            (Output(name, g.acc, False),))
