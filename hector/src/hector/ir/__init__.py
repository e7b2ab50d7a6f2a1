"""The inter-operator IR: types, nodes, programs, the builder DSL, the printer and the verifier."""

from .builder import Builder, Value
from .core import Domain, Node, Op, OpKind, Program, VType, make_attrs
from .printer import format_program
from .types import infer
from .verify import verify

Program.__str__ = format_program  # the text form (defined here so that core and printer import one way only)

__all__ = ["Builder", "Domain", "Node", "Op", "OpKind", "Program", "VType", "Value", "format_program", "infer",
           "make_attrs", "verify"]
