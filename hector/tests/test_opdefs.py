"""Every op has an entry in every per-op table: its semantics (type rule, cost, derivative where it has one) in
hector.ir.opdefs, its torch meaning in the reference backend, and its CUDA expression where it is elementwise.
Adding an op without one of them fails here, naming the table."""

from hector.codegen.templates import ELEMENTWISE
from hector.ir.core import ARITY, Op, OpKind
from hector.ir.opdefs import OPS
from hector.runtime.reference import REFERENCE

# ops only backward programs contain (the derivative rules emit them); they need no derivative of their own
BACKWARD_ONLY = {Op.OUTER_SUM, Op.SELECT_SUM, Op.ACT_GRAD, Op.SLICE, Op.SAVED}


def test_every_op_has_semantics_and_a_reference():
    assert set(OPS) == set(Op), f"no OpDef (hector.ir.opdefs) for {set(Op) - set(OPS)}"
    assert set(REFERENCE) == set(Op), f"no reference rule (runtime/reference.py) for {set(Op) - set(REFERENCE)}"
    assert set(ARITY) == set(Op)


def test_every_differentiable_op_has_a_derivative():
    leaves = {op for op in Op if op.kind is OpKind.LEAF}
    missing = {op for op in Op if OPS[op].vjp is None} - leaves - BACKWARD_ONLY
    assert not missing, f"no derivative rule for {missing}"


def test_every_elementwise_op_has_a_cuda_expression():
    missing = {op for op in Op if op.kind is OpKind.ELEMENTWISE} - set(ELEMENTWISE)
    assert not missing, f"no CUDA expression (codegen/templates.py ELEMENTWISE) for {missing}"
