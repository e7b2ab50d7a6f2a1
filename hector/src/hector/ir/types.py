"""Type rules: :func:`infer` computes a node's type (domain, per-row shape, type indices) from its arguments'.

The rules live with each op's other semantics in :mod:`hector.ir.opdefs` (``OPS[op].infer``). The builder calls
them as a program is written (so a type error points at the offending line), the verifier calls them to check
stored types, and the ``infer_types`` pass uses them to type nodes created by rewrites.
"""

from .opdefs import broadcast, infer, is_prefix

__all__ = ["broadcast", "infer", "is_prefix"]
