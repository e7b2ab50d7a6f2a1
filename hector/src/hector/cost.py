"""The cost model: materialised bytes and multiply-adds of a lowered program on a graph, from graph statistics
alone, and the choice of optimisations (compaction, reordering) that minimises the estimated time.

Estimated time = bytes moved / bandwidth + flops / throughput + atomic adds / atomic rate, with H100-class
defaults (fp32 CUDA cores, HBM3). Only the ratios of the constants matter for the choice. Bytes moved counts every
materialised value written once and read once by each kernel that reads it, plus the rows gathered into GEMMs and
traversals. Atomic adds are the elements a GEMM's scatter epilogue sums into destination rows: each a
read-modify-write in L2 (many rows into one destination, so they contend), which the compacted plan's
destination-centric traversal replaces by a sum in registers written once per destination. A traversal's atomic
sums by source or pair (spread over rows with little contention) are counted apart (``traversal_atomic_adds``) and
not charged when compaction and reordering are chosen: measured, the compacted HGT and RGAT plans that use them are
faster than the uncompacted ones.

Sorted scatter (``Options.sorted_scatter``, :func:`hector.lower.lower`) then removes the atomics the chosen plan
has: GEMM results are written row by row and summed by a traversal, and sums by source or pair run as walks over a
layout sorted by that index (each target row written once, the sum in registers). Its price is the GEMM rows
written and read once more and the sorted layout's indices (4 bytes per row and per target) read; its gain is every
atomic add. The rule (:func:`choose_options`): with the compaction and reordering already chosen, take the sorted
plan when its estimated time, with *all* atomic adds charged at ``ATOMIC_RATE`` (GEMM epilogues and traversals),
and each kernel's launch charged at ``LAUNCH_SECONDS``,
is lower than the atomic plan's. The traversal atomics are charged at the GEMM epilogue's measured rate, an upper
bound for them (less contention); the benchmark's sorted-vs-atomic rows measure the difference. The sorted layout
itself is built once per graph (one sort), not per step, so it is not charged.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from .ir.core import GATHER_VIA, Domain, Op, Program
from .ir.opdefs import OPS
from .lower.kernels import Lowered, row_count
from .passes import Options

BANDWIDTH = 3.0e12  # bytes/s
THROUGHPUT = 5.0e13  # flop/s (fp32, no tensor cores)
# fp32 atomic adds/s into scattered rows: an H100 scatter GEMM summed 365M of them per RGCN step on am at 164 GB/s
# of compulsory traffic, ~20x slower than its bytes alone at HBM speed
ATOMIC_RATE = 6.0e10
# host and GPU time of one more kernel launch in a step (the CUDA backend launches from Python: ~10 us on an H100
# host where a step of a small graph is bound by its launches)
LAUNCH_SECONDS = 1.0e-5


@dataclass(frozen=True)
class Estimate:
    materialized_bytes: int  # row values written by kernels (outputs, values kept for backward)
    moved_bytes: int  # materialised writes + all reads
    flops: int
    kernels: int
    atomic_adds: int = 0  # elements a GEMM's scatter epilogue sums into rows with atomics
    traversal_atomic_adds: int = 0  # elements traversals sum into rows by source or pair with atomics

    @property
    def seconds(self) -> float:
        return self.moved_bytes / BANDWIDTH + self.flops / THROUGHPUT + self.atomic_adds / ATOMIC_RATE

    @property
    def seconds_all_atomics(self) -> float:
        """:attr:`seconds` with the traversals' atomic adds and each kernel's launch charged too (the sorted-scatter
        choice, whose plans may have a kernel or two more)."""
        return self.seconds + self.traversal_atomic_adds / ATOMIC_RATE + self.kernels * LAUNCH_SECONDS


def _rows(p: Program, name: str, stats: Mapping[str, int]) -> int:
    t = p.type_of(name)
    return row_count(t.domain, stats) if t.domain is not Domain.PARAM else 1


def estimate(lowered: Lowered, stats: Mapping[str, int], itemsize: int = 4) -> Estimate:
    p = lowered.program
    written = moved = flops = atomics = traversal_atomics = 0

    def rows_of(name: str) -> int:
        return _rows(p, name, stats)

    for k in lowered.kernels:
        centric = dict(k.detail).get("centric")
        for o in k.outputs:
            t = p.type_of(o)
            if t.domain is not Domain.PARAM:
                written += _rows(p, o, stats) * t.numel * itemsize
        for name in k.nodes:
            n = p.by_name[name]
            f, gathered = OPS[n.op].cost(n, rows_of, p.type_of)  # each op's rule (hector.ir.opdefs)
            flops += f
            moved += gathered * itemsize
            if n.op is Op.SCATTER_ADD and k.kind == "gemm":
                atomics += rows_of(n.args[0]) * p.type_of(name).numel  # the scatter epilogue: one add per element
            elif n.op is Op.SCATTER_ADD and k.kind == "traversal" and n.attr("via") != centric and not (
                    k.space == "edge" and n.attr("via") == "dst"):
                traversal_atomics += rows_of(n.args[0]) * p.type_of(name).numel
        if centric is not None:  # the sorted layout's row order and offsets
            moved += 4 * (row_count(Domain(k.space), stats) + row_count(GATHER_VIA[centric][0], stats) + 1)
        for i in k.inputs:
            t = p.type_of(i)
            if t.domain is not Domain.PARAM:
                moved += _rows(p, i, stats) * t.numel * itemsize
    moved += written
    return Estimate(written, moved, flops, len(lowered.kernels), atomics, traversal_atomics)


def rows_for(stats: Mapping[str, int]) -> dict[Any, float]:
    """Row and type counts the reordering pass weighs."""
    return {Domain.NODE: float(stats["num_nodes"]), Domain.EDGE: float(stats["num_edges"]),
            Domain.UNIQUE: float(stats["num_unique"]), "etype": float(stats["num_relations"]),
            "src_ntype": float(stats["num_node_types"]), "dst_ntype": float(stats["num_node_types"]),
            "ntype": float(stats["num_node_types"])}


def training_estimate(compiled: Any, stats: Mapping[str, int], itemsize: int = 4) -> Estimate:
    """Forward plus the full generated backward."""
    fwd = estimate(compiled.forward_lowered, stats, itemsize)
    bwd = estimate(compiled.full_backward_lowered, stats, itemsize)
    return Estimate(fwd.materialized_bytes + bwd.materialized_bytes, fwd.moved_bytes + bwd.moved_bytes,
                    fwd.flops + bwd.flops, fwd.kernels + bwd.kernels, fwd.atomic_adds + bwd.atomic_adds,
                    fwd.traversal_atomic_adds + bwd.traversal_atomic_adds)


def size_class(stats: Mapping[str, int]) -> tuple[int, ...]:
    """Graphs of one size class (row counts within a factor of ~1.4, the same type counts) get the same choice:
    mini-batches of one sampler then share one decision and one compiled program instead of one per batch."""
    rows = (stats["num_nodes"], stats["num_edges"], stats["num_unique"])
    return tuple([round(2 * math.log2(max(v, 1))) for v in rows]) + (stats["num_relations"],
                                                                      stats["num_node_types"])


def choose_options(layer: Any, graph: Any, objective: str = "time") -> Options:
    """Try {compaction on/off} x {reordering on/off} and keep the cheapest, then sorted scatter on/off for that
    choice (the rule in the module docstring; ``HECTOR_SORTED_SCATTER`` can force it); cached per layer mode,
    graph size class (:func:`size_class`) and that setting, on the layer.

    ``objective``: "time" (estimated seconds) or "memory" (peak bytes of the kernel plan, time breaking ties).
    """
    from . import config

    if objective not in ("time", "memory"):
        raise ValueError(f"objective must be 'time' or 'memory', got {objective!r}")
    stats = graph.size_stats()
    mode = config.sorted_scatter()
    key = (layer.training, objective, size_class(stats), mode)

    def scored(opts: Options) -> tuple[Estimate, float]:
        compiled = layer.compiled(None, options=opts)
        plan = compiled.forward_lowered if layer.training else compiled.inference_lowered
        est = training_estimate(compiled, stats) if layer.training else estimate(plan, stats)
        return est, float(peak_bytes(plan, stats))

    def compute() -> Options:
        rows = rows_for(stats)
        best: tuple[tuple[float, float], Options] | None = None
        for compact in (False, True):
            for reorder in (False, True):
                opts = Options(compact=compact, reorder=reorder, rows=rows)
                est, peak = scored(opts)
                score = (peak, est.seconds) if objective == "memory" else (est.seconds, 0.0)
                # strict improvement needed: ties keep the simpler program
                if best is None or score < (best[0][0] * (1 - 1e-9), best[0][1] * (1 - 1e-9)):
                    best = (score, opts)
        assert best is not None
        chosen = best[1]
        if mode == "off":
            return chosen
        sorted_opts = replace(chosen, sorted_scatter=True)
        if mode == "on":
            return sorted_opts
        (a_est, a_peak), (s_est, s_peak) = scored(chosen), scored(sorted_opts)
        a_score, s_score = (a_est.seconds_all_atomics, 0.0), (s_est.seconds_all_atomics, 0.0)
        if objective == "memory":
            a_score, s_score = (a_peak, a_score[0]), (s_peak, s_score[0])
        return sorted_opts if s_score < (a_score[0] * (1 - 1e-9), a_score[1] * (1 - 1e-9)) else chosen

    if key not in layer._choices:
        layer._choices[key] = compute()
    return layer._choices[key]


def peak_bytes(lowered: Lowered, stats: Mapping[str, int], itemsize: int = 4,
               live_in: tuple[str, ...] = ()) -> int:
    """Peak of the materialised row values alive at once when the kernels run in order (a value is freed after
    its last reader unless it is an output or kept). Leaves (inputs, params) and graph data are not counted."""
    p = lowered.program
    last_use: dict[str, int] = {}
    for i, k in enumerate(lowered.kernels):
        for name in k.inputs:
            last_use[name] = i
    pinned = set(p.outputs) | set(live_in)
    live: dict[str, int] = {}
    peak = 0
    for i, k in enumerate(lowered.kernels):
        for o in k.outputs:
            t = p.type_of(o)
            if t.domain is not Domain.PARAM:
                live[o] = _rows(p, o, stats) * t.numel * itemsize
        peak = max(peak, sum(live.values()))
        for name in list(live):
            if name not in pinned and last_use.get(name, i) <= i:  # no later kernel reads it
                del live[name]
    return peak
