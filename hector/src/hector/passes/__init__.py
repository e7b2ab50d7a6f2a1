"""Optimisation passes and the pipeline that runs them.

Each pass is a module with one entry function ``Program -> Program``. The pipeline is one readable list of named
stages; with ``debug=True`` (or ``HECTOR_DEBUG=1``) the verifier runs after every stage.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..ir.core import Program
from ..ir.verify import verify
from .autodiff import Backward, differentiate
from .canonicalize import canonicalize
from .compact import compact, pair_determined
from .cse import cse
from .dce import dce
from .infer import infer_types
from .reorder import reorder


@dataclass(frozen=True)
class Options:
    """Which optimisations run. ``rows`` (domain/type-index -> count) feeds the reordering cost test."""

    compact: bool = True
    reorder: bool = True
    force_reorder: bool = False
    fuse: bool = True  # kernel fusion in the lowering (off only for ablations)
    # sums into rows by a non-destination index (source, pair) run target-centric over a sorted layout, and GEMM
    # scatter epilogues are not fused: no atomics (see :func:`hector.lower.lower`); the cost model picks it per graph
    sorted_scatter: bool = False
    rows: Mapping[Any, float] | None = field(default=None, hash=False, compare=False)
    debug: bool = False

    @property
    def debugging(self) -> bool:
        from .. import config

        return self.debug or config.debug()


Stage = tuple[str, Callable[[Program], Program]]


def forward_pipeline(opts: Options) -> list[Stage]:
    stages: list[Stage] = [("infer_types", infer_types), ("canonicalize", canonicalize), ("cse", cse)]
    if opts.reorder:
        stages.append(("reorder", lambda p: reorder(p, opts.rows, opts.force_reorder)))
    if opts.compact:
        stages.append(("compact", compact))
    stages += [("canonicalize", canonicalize), ("cse", cse), ("dce", dce)]
    return stages


def backward_pipeline(opts: Options) -> list[Stage]:
    return [("infer_types", infer_types), ("canonicalize", canonicalize), ("cse", cse), ("dce", dce)]


def run_pipeline(program: Program, stages: list[Stage], debug: bool = False) -> Program:
    if debug:
        verify(program, "input")
    for name, fn in stages:
        program = fn(program)
        if debug:
            verify(program, name)
    return verify(program, "pipeline")


def optimize(program: Program, opts: Options = Options()) -> Program:
    return run_pipeline(program, forward_pipeline(opts), opts.debugging)


def optimize_backward(program: Program, opts: Options = Options()) -> Program:
    return run_pipeline(program, backward_pipeline(opts), opts.debugging)


__all__ = ["Backward", "Options", "backward_pipeline", "canonicalize", "compact", "cse", "dce", "differentiate",
           "forward_pipeline", "infer_types", "optimize", "optimize_backward", "pair_determined", "reorder",
           "run_pipeline"]
