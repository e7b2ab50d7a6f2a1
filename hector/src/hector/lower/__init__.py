"""Lowering of optimised programs to kernel specifications (the contract with the CUDA code generator)."""

from .kernels import Kernel, Lowered, lower, materialized_bytes

__all__ = ["Kernel", "Lowered", "lower", "materialized_bytes"]
