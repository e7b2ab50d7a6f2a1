"""The cost model: materialised bytes and multiply-adds of a lowered program on a graph, from graph statistics
alone, and the choice of optimisations (compaction, reordering) that minimises the estimated time.

Estimated time = bytes moved / bandwidth + flops / throughput + atomic adds / atomic rate, with H100-class
defaults (fp32 CUDA cores, HBM3). Only the ratios of the constants matter for the choice. Bytes moved counts every
materialised value written once and read once by each kernel that reads it, plus the rows gathered into GEMMs and
traversals. Atomic adds are the elements a GEMM's scatter epilogue sums into destination rows: each a
read-modify-write in L2 (many rows into one destination, so they contend), which the compacted plan's
destination-centric traversal replaces by a sum in registers written once per destination. (A traversal's atomic
sums by source or pair, spread over rows with little contention, are not charged: measured, the compacted HGT
and RGAT plans that use them are faster.)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .ir.core import Domain, Op, Program
from .ir.opdefs import OPS
from .lower.kernels import Lowered, row_count
from .passes import Options

BANDWIDTH = 3.0e12  # bytes/s
THROUGHPUT = 5.0e13  # flop/s (fp32, no tensor cores)
# fp32 atomic adds/s into scattered rows: an H100 scatter GEMM summed 365M of them per RGCN step on am at 164 GB/s
# of compulsory traffic, ~20x slower than its bytes alone at HBM speed
ATOMIC_RATE = 6.0e10


@dataclass(frozen=True)
class Estimate:
    materialized_bytes: int  # row values written by kernels (outputs, values kept for backward)
    moved_bytes: int  # materialised writes + all reads
    flops: int
    kernels: int
    atomic_adds: int = 0  # elements a GEMM's scatter epilogue sums into rows with atomics

    @property
    def seconds(self) -> float:
        return self.moved_bytes / BANDWIDTH + self.flops / THROUGHPUT + self.atomic_adds / ATOMIC_RATE


def _rows(p: Program, name: str, stats: Mapping[str, int]) -> int:
    t = p.type_of(name)
    return row_count(t.domain, stats) if t.domain is not Domain.PARAM else 1


def estimate(lowered: Lowered, stats: Mapping[str, int], itemsize: int = 4) -> Estimate:
    p = lowered.program
    written = moved = flops = atomics = 0

    def rows_of(name: str) -> int:
        return _rows(p, name, stats)

    for k in lowered.kernels:
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
        for i in k.inputs:
            t = p.type_of(i)
            if t.domain is not Domain.PARAM:
                moved += _rows(p, i, stats) * t.numel * itemsize
    moved += written
    return Estimate(written, moved, flops, len(lowered.kernels), atomics)


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
                    fwd.flops + bwd.flops, fwd.kernels + bwd.kernels, fwd.atomic_adds + bwd.atomic_adds)


def size_class(stats: Mapping[str, int]) -> tuple[int, ...]:
    """Graphs of one size class (row counts within a factor of ~1.4, the same type counts) get the same choice:
    mini-batches of one sampler then share one decision and one compiled program instead of one per batch."""
    rows = (stats["num_nodes"], stats["num_edges"], stats["num_unique"])
    return tuple(round(2 * math.log2(max(v, 1))) for v in rows) + (stats["num_relations"], stats["num_node_types"])


def choose_options(layer: Any, graph: Any, objective: str = "time") -> Options:
    """Try {compaction on/off} x {reordering on/off} and keep the cheapest; cached per layer mode and graph size
    class (:func:`size_class`), on the layer.

    ``objective``: "time" (estimated seconds) or "memory" (peak bytes of the kernel plan, time breaking ties).
    """
    if objective not in ("time", "memory"):
        raise ValueError(f"objective must be 'time' or 'memory', got {objective!r}")
    stats = graph.size_stats()
    key = (layer.training, objective, size_class(stats))

    def compute() -> Options:
        rows = rows_for(stats)
        best: tuple[tuple[float, float], Options] | None = None
        for compact in (False, True):
            for reorder in (False, True):
                opts = Options(compact=compact, reorder=reorder, rows=rows)
                compiled = layer.compiled(None, options=opts)
                plan = compiled.forward_lowered if layer.training else compiled.inference_lowered
                est = training_estimate(compiled, stats) if layer.training else estimate(plan, stats)
                score = (float(peak_bytes(plan, stats)), est.seconds) if objective == "memory" else \
                    (est.seconds, 0.0)
                # strict improvement needed: ties keep the simpler program
                if best is None or score < (best[0][0] * (1 - 1e-9), best[0][1] * (1 - 1e-9)):
                    best = (score, opts)
        assert best is not None
        return best[1]

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
