"""CUDA C++ emitters: a lowered program (:mod:`hector.lower`) becomes one CUDA module with one kernel per spec.

Every kernel is ``extern "C"``, named after its spec (``k4_traversal``), reads and writes the values the spec names
(pointer parameters ``p_<ir name>``) and carries a comment with the IR line of every op it evaluates. Nothing here
needs torch or a GPU: :func:`generate` returns the source text and, per kernel, the parameter list with what the
runtime binds to each parameter, the launch shape, and the outputs it allocates.

Kernel families (the lowering's, see :mod:`hector.lower.kernels`):

* **traversal** over edges: one *group* of ``G`` threads per destination node (heaviest destinations first), walking
  the destination's in-edges (edges are kept sorted by destination, so they are one contiguous range). Element ``j``
  of a per-row value lives in lane ``j % G``, register slot ``j / G``. Edge softmax and sums into the destination
  are register reductions over the walk; a value needed after such a reduction is recomputed in a later walk over
  the same edges (no per-edge temporary is written unless the plan materialises it). Reductions by another key
  (source, unique pair, type) are atomics; sums into small params are pre-reduced in shared memory per block.
* **traversal** over nodes / unique pairs: one group per row.
* **gemm** ``linear``: a segment GEMM over a device-side tile schedule (tiles never cross a type boundary, so a tile
  has one weight), A rows read through the gather index, an optional row-scale and an atomic scatter epilogue.
* **gemm** ``outer_sum`` (weight gradient): per tile ``C[type] += A^T B`` in registers, flushed with atomics.
* **param**: weight-only einsums, one thread per output element.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..ir.core import Domain, Op, Program
from ..ir.printer import format_node
from ..lower.kernels import Kernel, Lowered
from .prelude import PRELUDE, WMMA, WMMA_CUDA, WMMA_EMULATED

CTYPE = {"f32": "float", "f64": "double", "bf16": "bf16_t", "f16": "f16_t"}
DTYPES = tuple(CTYPE)
BLOCK = 256  # threads per block of traversal and GEMM kernels


def acc_dtype(dtype: str) -> str:
    """Compute/accumulation type of a storage type: float64 stays float64, everything else computes in float32."""
    return "f64" if dtype == "f64" else "f32"


@dataclass(frozen=True)
class Arg:
    """One kernel parameter: its C declaration, its shared-cuda signature code and what the runtime binds to it.

    Bindings: ``("value", name)`` a value or leaf of the program; ``("out", name)`` an output buffer;
    ``("gather", via)`` an int32 gather index; ``("index", domain, by)`` int32 (combined) type ids of rows;
    ``("csc_ptr",)`` int32 in-edge offsets per node; ``("dst_order",)`` int32 nodes, heaviest first;
    ``("perm", domain, by)`` int32 rows sorted by type; ``("tiles", domain, by, rows)`` int32 ``[T, 3]`` tile
    schedule (type, first position in perm, row count); ``("rows", domain)`` / ``("ntiles", domain, by, rows)``
    counts (i64).
    """

    cname: str
    ctype: str
    sig: str
    bind: tuple


@dataclass(frozen=True)
class Launch:
    """How to launch: ``groups`` (grid-stride over work items: rows, or destinations for edge kernels),
    ``tiles`` (one block per tile of a schedule), ``elements`` (one thread per output element)."""

    kind: str
    block: int
    # groups: ("rows", domain) / ("dst",); tiles: ("tiles", domain, by, rows), rows 0 = sized by the runtime to the
    # graph and GPU (DeviceGraph.tile_rows); elements: (n,)
    work: tuple = ()
    group: int = 1  # threads per group (groups)
    grid_y: int = 1
    smem: int = 0  # dynamic shared memory bytes


@dataclass(frozen=True)
class Output:
    name: str
    dtype: str
    zero: bool  # written with atomics: the runtime zero-fills it first


@dataclass(frozen=True)
class KernelCode:
    name: str
    spec: Kernel
    args: tuple[Arg, ...]
    launch: Launch
    outputs: tuple[Output, ...]
    torch_op: str = ""  # "rng": run by the runtime with torch (counter-based RNG), no CUDA source

    @property
    def signature(self) -> str:
        return ", ".join(a.sig for a in self.args)


@dataclass(frozen=True)
class ModuleCode:
    name: str
    source: str
    kernels: tuple[KernelCode, ...]
    dtypes: tuple[tuple[str, str], ...]  # value name -> storage dtype, for every value the module reads or writes

    def dtype_of(self, name: str) -> str:
        return dict(self.dtypes)[name]


@dataclass(frozen=True)
class CodegenOptions:
    """``tf32``: fp32 GEMMs on tensor cores in TF32 (else exact fp32 on CUDA cores)."""

    tf32: bool = False
    tensor_cores: bool = True  # bf16/f16 GEMMs on tensor cores (sm_80+)
    arch: int = 80


def cname(name: str) -> str:
    """A C identifier for an IR name."""
    return re.sub(r"\W", "_", name)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (max(1, n) - 1).bit_length())


_LEAVES = (Op.INPUT, Op.PARAM, Op.SAVED, Op.GRAPH, Op.DROPOUT_MASK)


class _Args:
    """Kernel parameters, deduplicated by binding."""

    def __init__(self) -> None:
        self.args: list[Arg] = []
        self._by_bind: dict[tuple, str] = {}

    def get(self, bind: tuple, cname_: str, ctype: str, sig: str = "ptr") -> str:
        if bind not in self._by_bind:
            self._by_bind[bind] = cname_
            self.args.append(Arg(cname_, ctype, sig, bind))
        return self._by_bind[bind]

    def gather(self, via: str) -> str:
        return self.get(("gather", via), f"g_{via}", "const int* __restrict__")

    def index(self, domain: Domain, by: tuple[str, ...]) -> str:
        return self.get(("index", domain.value, tuple(by)), f"t_{domain.value}_{'_'.join(by)}",
                        "const int* __restrict__")

    def rows(self, domain: Domain) -> str:
        return self.get(("rows", domain.value), f"n_{domain.value}", "i64", "i64")


@dataclass
class _Ref:
    """Where the rows of a value come from: a materialised buffer (``row``) read at a row expression, or a param
    read at a type-index expression (``param``)."""

    kind: str  # "row" | "param" | "local"
    base: str  # IR name of the buffer (or the in-kernel value for "local")
    expr: str  # row / type expression ("0" for an untyped param)
    varies: bool  # depends on the current edge (edge kernels)


class _Gen:
    """Shared state of one module: the program, the dtype of every value, options."""

    def __init__(self, lowered: Lowered, dtypes: Mapping[str, str], model_dtype: str, options: CodegenOptions):
        self.lowered = lowered
        self.p: Program = lowered.program
        self.dtypes: dict[str, str] = dict(dtypes)
        self.model = model_dtype
        self.acc = acc_dtype(model_dtype)
        self.options = options
        self.materialized = set(lowered.materialized)
        self.tc_kinds: set[str] = set()  # tensor-core input types used by GEMM kernels
        self.virtual = {n.name for n in self.p.nodes if n.op in (Op.GATHER, Op.SELECT)
                        or (n.op is Op.RESHAPE and n.type.domain is not Domain.PARAM)} - self.materialized

    def numel(self, name: str) -> int:
        return self.p.type_of(name).numel

    def ctype_of(self, name: str) -> str:
        return CTYPE[self.dtypes[name]]

    def is_buffer(self, name: str) -> bool:
        """Read from memory: a leaf or a value some kernel materialises."""
        return self.p.node(name).op in _LEAVES or name in self.materialized

    def comment(self, name: str) -> str:
        return "// " + format_node(self.p.node(name))


# ------------------------------------------------------------------------------------------------- traversal


class _Emitter:
    """Common parts of the kernel emitters: parameters, reading rows through gathers/views/selects."""

    def __init__(self, gen: _Gen, spec: Kernel):
        self.g, self.p, self.k = gen, gen.p, spec
        self.args = _Args()
        self.members: list[str] = [m for m in spec.nodes if m not in gen.virtual]
        self.member_set = set(self.members)
        self.edge = False
        self.tmp = 0

    def fresh(self, hint: str) -> str:
        self.tmp += 1
        return f"{hint}{self.tmp}"

    def ptr(self, name: str, out: bool = False) -> str:
        ct = self.g.ctype_of(name)
        if out:
            return self.args.get(("out", name), f"o_{cname(name)}", f"{ct}* __restrict__")
        return self.args.get(("value", name), f"p_{cname(name)}", f"const {ct}* __restrict__")

    def ref(self, name: str, expr: str, varies: bool) -> _Ref:
        """Resolve virtual reads (gathers, views, per-row param reads) of ``name`` at row ``expr``."""
        n = self.p.node(name)
        if name in self.member_set:
            return _Ref("local", name, expr, varies)
        if name not in self.g.virtual:
            if n.type.domain is Domain.PARAM:
                return _Ref("param", name, "0", False)
            return _Ref("row", name, expr, varies)
        if n.op is Op.RESHAPE:
            return self.ref(n.args[0], expr, varies)
        if n.op is Op.GATHER:
            via = n.attr("via")
            if self.edge and via == "dst" and expr == "e":
                return self.ref(n.args[0], "d", False)  # the walk's own destination
            return self.ref(n.args[0], f"{self.args.gather(via)}[{expr}]", varies)
        if n.op is Op.SELECT:
            pt = self.p.type_of(n.args[0])
            if not pt.by:
                return _Ref("param", n.args[0], "0", False)
            return _Ref("param", n.args[0], f"{self.args.index(n.type.domain, pt.by)}[{expr}]", varies)
        raise AssertionError(f"cannot read {name} ({n.op}) inside {self.k.name}")  # pragma: no cover

    def element(self, name: str, row: str, j: str) -> str:
        """C expression: element ``j`` of value ``name`` (a buffer or a view of one) at row ``row``."""
        r = self.ref(name, row, False)
        assert r.kind != "local"
        t = self.p.type_of(r.base)
        stride = math.prod(t.shape[len(t.by):]) if r.kind == "param" else t.numel
        return f"ld({self.ptr(r.base)} + (i64)({r.expr}) * {stride} + ({j}))"


class _Traversal(_Emitter):
    """Emits one traversal kernel (see the module docstring for the execution model)."""

    def __init__(self, gen: _Gen, spec: Kernel):
        super().__init__(gen, spec)
        self.edge = spec.space == "edge"
        self.row = "e" if self.edge else "r"
        self.space_domain = {"edge": Domain.EDGE, "node": Domain.NODE, "unique": Domain.UNIQUE}[spec.space]
        widths = [self.p.type_of(n).numel for n in spec.nodes if self.p.type_of(n).domain is not Domain.PARAM]
        widths += [self.p.type_of(n).numel for n in spec.inputs if self.p.type_of(n).domain is not Domain.PARAM]
        self.maxw = max(widths + [1])
        self.G = min(32, _pow2_at_least(self.maxw))
        self.body: list[str] = []  # where emitted lines go
        self.memo: dict[str, str] = {}  # registers valid in the current walk / row
        self.inv_memo: dict[str, str] = {}  # edge-invariant registers (per destination, kept across walks)
        self.sections: list[list[str]] = []  # code before walk i (and after the last walk)
        self.loops: list[list[str]] = []  # body of walk i
        self.smem_params: dict[str, int] = {}  # select_sum pre-reduced in shared memory: node -> elements
        self.outputs: list[Output] = []
        self._phase: dict[str, int] = {}
        self._inv: dict[str, bool] = {}
        self.current_loop = -1

    def slots(self, name_or_n: Any) -> int:
        n = name_or_n if isinstance(name_or_n, int) else self.g.numel(name_or_n)
        return max(1, -(-n // self.G))

    def emit(self, line: str) -> None:
        self.body.append(line)

    # -- analysis --------------------------------------------------------------------------------------------
    def is_dst_reduce(self, name: str) -> bool:
        n = self.p.node(name)
        return self.edge and n.op is Op.SCATTER_ADD and n.attr("via") == "dst"

    def is_atomic(self, name: str) -> bool:
        n = self.p.node(name)
        return n.op is Op.SELECT_SUM or (n.op is Op.SCATTER_ADD and not self.is_dst_reduce(name))

    def natural_row(self, name: str) -> tuple[str, bool]:
        if self.edge and self.p.type_of(name).domain is Domain.NODE:
            return "d", False
        return self.row, self.edge

    def phase(self, name: str) -> int:
        """Walk after which a value is available: reductions over the in-edges (edge softmax, sums into the
        destination) complete at the end of a walk, so what reads them runs in a later walk."""
        if name not in self.member_set:  # a view/gather of an in-kernel value is available when that value is
            n = self.p.node(name)
            return max([self.phase(a) for a in n.args] + [0]) if name in self.g.virtual else 0
        if name not in self._phase:
            n = self.p.node(name)
            base = max([self.phase(a) for a in n.args] + [0])
            self._phase[name] = base + 1 if (n.op is Op.EDGE_SOFTMAX or self.is_dst_reduce(name)) else base
        return self._phase[name]

    def invariant(self, name: str) -> bool:
        """Same for every in-edge of the destination (edge kernels): computed once per destination."""
        if not self.edge:
            return False
        if name not in self._inv:
            n = self.p.node(name)
            if name in self.member_set:
                if n.op is Op.EDGE_SOFTMAX or self.is_atomic(name):
                    inv = False
                elif self.is_dst_reduce(name) or n.type.domain is Domain.NODE:
                    inv = True
                else:
                    inv = all(self.invariant(a) for a in n.args)
            elif n.type.domain is Domain.PARAM:
                inv = True
            else:
                row, varies = self.natural_row(name)
                inv = not self.ref(name, row, varies).varies
            self._inv[name] = inv
        return self._inv[name]

    # -- values in registers ---------------------------------------------------------------------------------
    def value(self, name: str) -> str:
        """Register array holding ``name`` at the current row, emitting its computation on first use."""
        if name in self.inv_memo:
            return self.inv_memo[name]
        if name in self.memo:
            return self.memo[name]
        inv = self.invariant(name)
        saved = self.body
        if inv and self.current_loop >= 0:
            self.body = self.sections[self.current_loop]  # hoisted before the walk
        try:
            if name in self.member_set:
                reg = self.compute(self.p.node(name))
            else:
                row, varies = self.natural_row(name)
                reg = self.load(name, self.ref(name, row, varies))
        finally:
            self.body = saved
        (self.inv_memo if inv else self.memo)[name] = reg
        return reg

    def load(self, name: str, r: _Ref) -> str:
        if r.kind == "local":  # a view of a value this kernel computes: the same registers
            reg = self.value(r.base)
            self.emit(f"  {self.g.comment(name)}  (same registers as %{r.base})")
            return reg
        N = self.g.numel(name)
        S = self.slots(N)
        reg = self.fresh(f"r_{cname(name)}_")
        t = self.p.type_of(r.base)
        stride = math.prod(t.shape[len(t.by):]) if r.kind == "param" else t.numel
        rv = self.fresh("row")
        self.emit(f"  {self.g.comment(name)}")
        chain = self.p.node(name)
        while chain.name in self.g.virtual and chain.args and chain.args[0] in self.g.virtual:  # views read through
            chain = self.p.node(chain.args[0])
            self.emit(f"  //   reading {self.g.comment(chain.name)[3:]}")
        self.emit(f"  const i64 {rv} = (i64)({r.expr}) * {stride};")
        self.emit(f"  acc_t {reg}[{S}];")
        self.emit(f"  #pragma unroll\n  for (int s = 0; s < {S}; ++s) {{ const int j = s * G + lane; "
                  f"{reg}[s] = j < {N} ? ld({self.ptr(r.base)} + {rv} + j) : (acc_t)0; }}")
        return reg

    def new_reg(self, name: str) -> str:
        reg = self.fresh(f"r_{cname(name)}_")
        self.emit(f"  acc_t {reg}[{self.slots(name)}];")
        return reg

    def loop(self, S: int, stmt: str) -> None:
        self.emit(f"  #pragma unroll\n  for (int s = 0; s < {S}; ++s) {{ const int j = s * G + lane; (void)j; "
                  f"{stmt} }}")

    def publish(self, reg: str, n: int, offset: int) -> None:
        """Write a distributed value into the group's shared scratch, so every lane may read any element."""
        self.emit("  __syncwarp(gmask);")
        self.loop(self.slots(n), f"if (j < {n}) scr[{offset} + j] = {reg}[s];")
        self.emit("  __syncwarp(gmask);")

    def broadcast(self, reg: str, n_from: int, n_to: int) -> str:
        """``reg`` (``n_from`` elements) prefix-broadcast to ``n_to`` elements: element j reads j / ratio."""
        if n_from == n_to:
            return reg
        ratio = n_to // n_from
        S = self.slots(n_to)
        out = self.fresh("bc")
        self.emit(f"  acc_t {out}[{S}];")
        if self.G == 1:
            self.emit(f"  #pragma unroll\n  for (int s = 0; s < {S}; ++s) {out}[s] = {reg}[s / {ratio}];")
        elif n_from <= self.G:
            self.emit(f"  #pragma unroll\n  for (int s = 0; s < {S}; ++s) {out}[s] = __shfl_sync(gmask, {reg}[0], "
                      f"min((s * G + lane) / {ratio}, {n_from - 1}), G);")
        else:
            self.publish(reg, n_from, 0)
            self.emit(f"  #pragma unroll\n  for (int s = 0; s < {S}; ++s) "
                      f"{out}[s] = scr[min((s * G + lane) / {ratio}, {n_from - 1})];")
            self.emit("  __syncwarp(gmask);")
        return out

    def compute(self, n) -> str:
        """Emit member ``n`` (its arguments first) and return its register array."""
        op, at = n.op, n.attr
        if self.is_dst_reduce(n.name):
            return f"acc_{cname(n.name)}"  # summed by the walk; complete once that walk is over
        if op is Op.EDGE_SOFTMAX:
            score = self.value(n.args[0])
            self.emit(f"  {self.g.comment(n.name)}")
            reg = self.new_reg(n.name)
            sm = f"sm_{cname(n.name)}"
            self.emit(f"  #pragma unroll\n  for (int s = 0; s < {self.slots(n.name)}; ++s) "
                      f"{reg}[s] = hexp({score}[s] - {sm}_m[s]) / {sm}_z[s];")
            return reg
        args = [self.value(a) for a in n.args]
        N = n.type.numel
        S = self.slots(N)
        line = self.g.comment(n.name)
        if op in (Op.ADD, Op.SUB, Op.MUL):
            a = self.broadcast(args[0], self.g.numel(n.args[0]), N)
            b = self.broadcast(args[1], self.g.numel(n.args[1]), N)
            sym = {Op.ADD: "+", Op.SUB: "-", Op.MUL: "*"}[op]
            self.emit(f"  {line}")
            reg = self.new_reg(n.name)
            self.emit(f"  #pragma unroll\n  for (int s = 0; s < {S}; ++s) {reg}[s] = {a}[s] {sym} {b}[s];")
            return reg
        if op in (Op.NEG, Op.SCALE, Op.ACT, Op.ACT_GRAD):
            self.emit(f"  {line}")
            reg = self.new_reg(n.name)
            x = f"{args[0]}[s]"
            if op is Op.NEG:
                e = f"-{x}"
            elif op is Op.SCALE:
                e = f"{x} * (acc_t){float(at('c'))!r}"
            elif op is Op.ACT:
                e = _act(at("fn"), x, at("slope", 0.0))
            else:
                e = _act_grad(at("fn"), x, f"{args[1]}[s]", at("slope", 0.0))
            self.emit(f"  #pragma unroll\n  for (int s = 0; s < {S}; ++s) {reg}[s] = {e};")
            return reg
        if op is Op.RESHAPE:  # same elements, same lanes: an alias
            self.emit(f"  {line}")
            reg = self.fresh(f"r_{cname(n.name)}_")
            self.emit(f"  acc_t (&{reg})[{S}] = {args[0]};")
            return reg
        if op is Op.EXPAND:
            self.emit(f"  {line}")
            return self.broadcast(args[0], self.g.numel(n.args[0]), N)
        if op in (Op.INNER, Op.REDUCE_LAST):
            src = args[0]
            n_in = self.g.numel(n.args[0])
            self.emit(f"  {line}")
            if op is Op.INNER:
                src = self.fresh("prod")
                self.emit(f"  acc_t {src}[{self.slots(n_in)}];")
                self.emit(f"  #pragma unroll\n  for (int s = 0; s < {self.slots(n_in)}; ++s) "
                          f"{src}[s] = {args[0]}[s] * {args[1]}[s];")
            ratio = n_in // max(N, 1)
            reg = self.new_reg(n.name)
            if self.G == 1:
                self.loop(S, f"acc_t t = 0; for (int q = 0; q < {ratio}; ++q) t += {src}[s * {ratio} + q]; "
                             f"{reg}[s] = t;")
            else:
                self.publish(src, n_in, 0)
                self.loop(S, f"acc_t t = 0; if (j < {N}) for (int q = 0; q < {ratio}; ++q) t += scr[j * {ratio} + q];"
                             f" {reg}[s] = t;")
                self.emit("  __syncwarp(gmask);")
            return reg
        if op in (Op.CONCAT, Op.SLICE):
            self.emit(f"  {line}")
            lo = n.type.shape[-1]
            if op is Op.CONCAT:
                na, nb = self.g.numel(n.args[0]), self.g.numel(n.args[1])
                la, lb = self.p.type_of(n.args[0]).shape[-1], self.p.type_of(n.args[1]).shape[-1]
                if self.G == 1:
                    a_e, b_e = f"{args[0]}[row * {la} + col]", f"{args[1]}[row * {lb} + col - {la}]"
                else:
                    self.publish(args[0], na, 0)
                    self.publish(args[1], nb, na)
                    a_e, b_e = f"scr[row * {la} + col]", f"scr[{na} + row * {lb} + col - {la}]"
                e = f"col < {la} ? {a_e} : {b_e}"
            else:
                lx, start = self.p.type_of(n.args[0]).shape[-1], at("start")
                if self.G == 1:
                    e = f"{args[0]}[row * {lx} + {start} + col]"
                else:
                    self.publish(args[0], self.g.numel(n.args[0]), 0)
                    e = f"scr[row * {lx} + {start} + col]"
            reg = self.new_reg(n.name)
            self.loop(S, f"const int row = j / {lo}, col = j % {lo}; {reg}[s] = j < {N} ? ({e}) : (acc_t)0;")
            if self.G != 1:
                self.emit("  __syncwarp(gmask);")
            return reg
        raise AssertionError(f"traversal emitter has no rule for {op}")  # pragma: no cover

    # -- per-row effects -------------------------------------------------------------------------------------
    def effects(self) -> list[tuple[int, str, str]]:
        """(walk, kind, node): writes of row outputs, online softmax statistics, sums into the destination,
        atomics, in program order."""
        out = []
        for name in self.members:
            n = self.p.node(name)
            if n.op is Op.EDGE_SOFTMAX:
                out.append((self.phase(n.args[0]), "softmax", name))
            elif self.is_dst_reduce(name):
                out.append((self.phase(n.args[0]), "reduce", name))
            elif self.is_atomic(name):
                out.append((self.phase(n.args[0]), "atomic", name))
            if name in self.k.outputs and n.type.domain is self.space_domain and not self.is_atomic(name):
                out.append((self.phase(name), "write", name))
        return out

    def do_effect(self, kind: str, name: str) -> None:
        n = self.p.node(name)
        if kind == "write":
            reg = self.value(name)
            N = n.type.numel
            self.loop(self.slots(N), f"if (j < {N}) st({self.ptr(name, out=True)} + (i64)({self.row}) * {N} + j, "
                                     f"{reg}[s]);")
            return
        src = self.value(n.args[0])
        N = self.g.numel(n.args[0])
        S = self.slots(N)
        sm = f"sm_{cname(name)}"
        if kind == "softmax":
            self.emit(f"  // online max and sum of exponentials for %{name}")
            self.emit(f"  #pragma unroll\n  for (int s = 0; s < {S}; ++s) {{ const acc_t v = {src}[s]; "
                      f"const acc_t mx = hmax({sm}_m[s], v); {sm}_z[s] = {sm}_z[s] * hexp({sm}_m[s] - mx) + "
                      f"hexp(v - mx); {sm}_m[s] = mx; }}")
            return
        if kind == "reduce":
            self.emit(f"  // sum into the destination: {self.g.comment(name)[3:]}")
            self.emit(f"  #pragma unroll\n  for (int s = 0; s < {S}; ++s) acc_{cname(name)}[s] += {src}[s];")
            return
        self.emit(f"  {self.g.comment(name)}")
        if n.op is Op.SCATTER_ADD:
            target = f"{self.args.gather(n.attr('via'))}[{self.row}]"
            self.loop(S, f"if (j < {N}) atomicAdd({self.ptr(name, out=True)} + (i64)({target}) * {N} + j, {src}[s]);")
            return
        by = tuple(n.attr("by", ()))
        t = f"{self.args.index(self.p.type_of(n.args[0]).domain, by)}[{self.row}]" if by else "0"
        dest = f"ss_{cname(name)}" if name in self.smem_params else self.ptr(name, out=True)
        self.loop(S, f"if (j < {N}) atomicAdd({dest} + (i64)({t}) * {N} + j, {src}[s]);")

    # -- the kernel ------------------------------------------------------------------------------------------
    def generate(self) -> tuple[str, KernelCode]:
        g = self.g
        for name in self.k.outputs:
            atomic = self.is_atomic(name)
            g.dtypes[name] = g.acc if atomic else g.model
            self.outputs.append(Output(name, g.dtypes[name], atomic))
        for name in self.members:  # sums into small params: pre-reduced in shared memory, one flush per block
            n = self.p.node(name)
            if n.op is Op.SELECT_SUM and math.prod(n.attr("shape")) * 8 <= 16384:
                self.smem_params[name] = math.prod(n.attr("shape"))
        effects = self.effects()
        nloops = 1 + max([e[0] for e in effects] + [0])
        self.sections = [[] for _ in range(nloops + 1)]
        self.loops = [[] for _ in range(nloops)]
        if self.edge:
            for loop, kind, name in effects:  # reduction state lives in the section before its walk
                S = self.slots(self.p.node(name).args[0])
                sec = self.sections[loop]
                if kind == "softmax":
                    sm = f"sm_{cname(name)}"
                    sec.append(f"  acc_t {sm}_m[{S}], {sm}_z[{S}];  // statistics of %{name}")
                    sec.append(f"  #pragma unroll\n  for (int s = 0; s < {S}; ++s) {{ {sm}_m[s] = HECTOR_NEG_INF; "
                               f"{sm}_z[s] = 0; }}")
                elif kind == "reduce":
                    sec.append(f"  acc_t acc_{cname(name)}[{S}];  // %{name}, summed over the in-edges")
                    sec.append(f"  #pragma unroll\n  for (int s = 0; s < {S}; ++s) acc_{cname(name)}[s] = 0;")
        for loop in range(nloops):
            self.current_loop = loop if self.edge else -1
            self.memo = {}
            self.body = self.loops[loop]
            for eloop, kind, name in effects:
                if eloop == loop:
                    self.do_effect(kind, name)
        if self.edge:  # node-wise work after the walks; node outputs
            self.current_loop = -1
            self.memo = {}
            self.body = self.sections[nloops]
            for name in self.members:
                n = self.p.node(name)
                if name in self.k.outputs and n.type.domain is Domain.NODE and not self.is_atomic(name):
                    reg = self.value(name)
                    N = n.type.numel
                    self.loop(self.slots(N), f"if (j < {N}) st({self.ptr(name, out=True)} + (i64)d * {N} + j, "
                                             f"{reg}[s]);")
        return self.assemble(nloops)

    def assemble(self, nloops: int) -> tuple[str, KernelCode]:
        G = self.G
        groups_per_block = BLOCK // G
        scratch = 2 * self.maxw if G > 1 else 1
        body = [f"  constexpr int G = {G};  // threads per row group",
                "  const int lane = threadIdx.x % G;",
                "  const unsigned gmask = G == 32 ? 0xffffffffu : ((1u << G) - 1u) << ((threadIdx.x & 31) / G * G);",
                "  (void)gmask;",
                f"  __shared__ acc_t scratch[{groups_per_block}][{scratch}];",
                "  acc_t* scr = scratch[threadIdx.x / G];",
                "  (void)scr;"]
        for name, total in self.smem_params.items():
            body.append(f"  __shared__ acc_t ss_{cname(name)}[{total}];  // block-local part of %{name}")
            body.append(f"  for (int i = threadIdx.x; i < {total}; i += blockDim.x) ss_{cname(name)}[i] = 0;")
        if self.smem_params:
            body.append("  __syncthreads();")
        order = self.args.get(("dst_order",), "dst_order", "const int* __restrict__") if self.edge else ""
        ptr = self.args.get(("csc_ptr",), "csc_ptr", "const int* __restrict__") if self.edge else ""
        n_work = self.args.get(("rows", Domain.NODE.value if self.edge else self.space_domain.value),
                               "n_work", "i64", "i64")
        body.append(f"  const i64 groups = (i64)gridDim.x * {groups_per_block};")
        body.append(f"  for (i64 w = (i64)blockIdx.x * {groups_per_block} + threadIdx.x / G; w < {n_work}; "
                    "w += groups) {")
        if self.edge:
            body.append(f"  const int d = {order}[w];  // destination node (heaviest first)")
            body.append(f"  const int e_begin = {ptr}[d], e_end = {ptr}[d + 1];")
            for loop in range(nloops):
                body += self.sections[loop]
                body.append(f"  // walk {loop + 1} of {nloops} over the in-edges of d")
                body.append("  for (int e = e_begin; e < e_end; ++e) {")
                body += ["  " + sub for ln in self.loops[loop] for sub in ln.split("\n")]
                body.append("  }")
            body += self.sections[nloops]
        else:
            body.append(f"  const i64 r = w;  // {self.k.space} row")
            body += self.loops[0]
        body.append("  }")
        for name, total in self.smem_params.items():
            body.append("  __syncthreads();")
            body.append(f"  for (int i = threadIdx.x; i < {total}; i += blockDim.x) "
                        f"if (ss_{cname(name)}[i] != (acc_t)0) atomicAdd({self.ptr(name, out=True)} + i, "
                        f"ss_{cname(name)}[i]);")
        params = ", ".join(f"{a.ctype} {a.cname}" for a in self.args.args)
        lines = ["// " + self.k.describe().replace("\n", "\n// "),
                 f'extern "C" __global__ void __launch_bounds__({BLOCK}) {self.k.name}({params}) {{']
        lines += body
        lines.append("}")
        launch = Launch("groups", BLOCK, ("dst",) if self.edge else ("rows", self.space_domain.value), G)
        return "\n".join(lines), KernelCode(self.k.name, self.k, tuple(self.args.args), launch, tuple(self.outputs))


def _act(fn: str, x: str, slope: float) -> str:
    if fn == "exp":
        return f"hexp({x})"
    if fn == "relu":
        return f"({x} > (acc_t)0 ? {x} : (acc_t)0)"
    if fn == "leaky_relu":
        return f"({x} > (acc_t)0 ? {x} : {x} * (acc_t){float(slope)!r})"
    if fn == "sigmoid":
        return f"((acc_t)1 / ((acc_t)1 + hexp(-{x})))"
    if fn == "tanh":
        return f"htanh({x})"
    return f"((acc_t)0.5 * {x} * ((acc_t)1 + herf({x} * (acc_t)0.70710678118654752440)))"


def _act_grad(fn: str, a: str, dy: str, slope: float) -> str:
    if fn == "exp":
        return f"{dy} * {a}"
    if fn == "sigmoid":
        return f"{dy} * {a} * ((acc_t)1 - {a})"
    if fn == "tanh":
        return f"{dy} * ((acc_t)1 - {a} * {a})"
    if fn == "relu":
        return f"({a} > (acc_t)0 ? {dy} : (acc_t)0)"
    if fn == "leaky_relu":
        return f"({a} > (acc_t)0 ? {dy} : {dy} * (acc_t){float(slope)!r})"
    return (f"{dy} * ((acc_t)0.5 * ((acc_t)1 + herf({a} * (acc_t)0.70710678118654752440)) + {a} * "
            f"hexp((acc_t)-0.5 * {a} * {a}) * (acc_t)0.39894228040143267794)")


def _weight_offset(core: tuple[int, ...], transpose: bool, k: str, c: str) -> tuple[str, str]:
    """(condition, offset) of element [k][c] of the effective dense matrix of a weight core: 2-D ``[Din, Dout]``
    (or its transpose), or per-head ``[H, Din, Dout]`` as a block-diagonal matrix (zero off the diagonal)."""
    if len(core) == 2:
        din, dout = core
        return "true", (f"({c}) * {dout} + ({k})" if transpose else f"({k}) * {dout} + ({c})")
    h, din, dout = core
    kin, cout = (dout, din) if transpose else (din, dout)
    cond = f"({k}) / {kin} == ({c}) / {cout}"
    hh, kk, cc = f"(({k}) / {kin})", f"(({k}) % {kin})", f"(({c}) % {cout})"
    off = f"{hh} * {din * dout} + " + (f"{cc} * {dout} + {kk}" if transpose else f"{kk} * {dout} + {cc}")
    return cond, off


class _Gemm(_Emitter):
    """Segment GEMM ``C[r] = A[r] W[type(r)]`` over a tile schedule, with the fused epilogue (see module doc)."""

    BK = 16

    def generate(self) -> tuple[str, KernelCode]:
        g, p = self.g, self.p
        lin = next(self.p.node(m) for m in self.members if self.p.node(m).op is Op.LINEAR)
        scale = next((self.p.node(m) for m in self.members if self.p.node(m).op is Op.MUL), None)
        scatter = next((self.p.node(m) for m in self.members if self.p.node(m).op is Op.SCATTER_ADD), None)
        out_name = self.k.outputs[0] if self.k.outputs else self.members[-1]
        domain = lin.type.domain
        wname = lin.args[1]
        wt = p.type_of(wname)
        core = wt.shape[len(wt.by):]
        transpose = bool(lin.attr("transpose"))
        K, N = p.type_of(lin.args[0]).numel, lin.type.numel
        atomic = scatter is not None
        g.dtypes[out_name] = g.acc if atomic else g.model
        out = Output(out_name, g.dtypes[out_name], atomic)
        tc = self.tensor_core_kind(K, N)
        if tc is not None:
            return self.generate_tc(tc, lin, scale, scatter, out, domain, wt, core, transpose, K, N)
        BN = min(N, 128)
        RN = 4 if BN % 4 == 0 else (2 if BN % 2 == 0 else 1)
        TX = BN // RN
        TY = max(1, BLOCK // TX)
        RM = max(1, 64 // TY)
        BM, NT, BK = TY * RM, TX * TY, self.BK
        grid_y = -(-N // BN)
        by = tuple(wt.by)
        self.args.get(("tiles", domain.value, by, BM), "tiles", "const int* __restrict__")
        perm = self.args.get(("perm", domain.value, by), "perm", "const int* __restrict__") if by else None
        a_ref = self.ref(lin.args[0], "r", False)
        assert a_ref.kind == "row", f"{self.k.name}: A operand must be rows"
        a_ptr = self.ptr(a_ref.base)
        w_ptr = self.ptr(wname)
        o_ptr = self.ptr(out_name, out=True)
        cond, off = _weight_offset(core, transpose, "k", "c")
        wcore = math.prod(core)
        lines = ["// " + self.k.describe().replace("\n", "\n// ")]
        for m in self.k.nodes:
            lines.append(self.g.comment(m))
        body = [f"  constexpr int K = {K}, N = {N}, BM = {BM}, BN = {BN}, BK = {BK}, RM = {RM}, RN = {RN}, "
                f"TX = {TX}, TY = {TY};",
                "  __shared__ acc_t As[BK][BM];  // A tile, k-major",
                "  __shared__ acc_t Ws[BK][BN];  // weight tile of this tile's type",
                "  __shared__ i64 a_off[BM];",
                "  __shared__ int c_row[BM];",
                "  const int tile = blockIdx.x;",
                "  const int type = tiles[3 * tile], begin = tiles[3 * tile + 1], count = tiles[3 * tile + 2];",
                "  if (count == 0) return;  // a spare slot of the schedule (DeviceGraph.tiles)",
                "  const int n0 = blockIdx.y * BN;",
                "  for (int i = threadIdx.x; i < BM; i += blockDim.x) {",
                "    if (i < count) {",
                f"      const int r = {perm + '[begin + i]' if perm else 'begin + i'};",
                "      c_row[i] = r;",
                f"      a_off[i] = (i64)({a_ref.expr}) * K;  // A row read through the gather index",
                "    }",
                "  }",
                "  __syncthreads();",
                "  const int tx = threadIdx.x % TX, ty = threadIdx.x / TX;",
                "  acc_t acc[RM][RN];",
                "  #pragma unroll",
                "  for (int q = 0; q < RM; ++q)",
                "    #pragma unroll",
                "    for (int u = 0; u < RN; ++u) acc[q][u] = 0;",
                "  for (int k0 = 0; k0 < K; k0 += BK) {",
                "    for (int idx = threadIdx.x; idx < BM * BK; idx += blockDim.x) {",
                "      const int i = idx / BK, kk = idx % BK;",
                f"      As[kk][i] = (i < count && k0 + kk < K) ? ld({a_ptr} + a_off[i] + k0 + kk) : (acc_t)0;",
                "    }",
                "    for (int idx = threadIdx.x; idx < BK * BN; idx += blockDim.x) {",
                "      const int kk = idx / BN, cc = idx % BN, k = k0 + kk, c = n0 + cc;",
                f"      Ws[kk][cc] = (k < K && c < N && {cond}) ? ld({w_ptr} + (i64)type * {wcore} + {off})"
                f" : (acc_t)0;",
                "    }",
                "    __syncthreads();",
                "    #pragma unroll",
                "    for (int kk = 0; kk < BK; ++kk) {",
                "      acc_t a[RM], b[RN];",
                "      #pragma unroll",
                "      for (int q = 0; q < RM; ++q) a[q] = As[kk][ty + q * TY];",
                "      #pragma unroll",
                "      for (int u = 0; u < RN; ++u) b[u] = Ws[kk][tx * RN + u];",
                "      #pragma unroll",
                "      for (int q = 0; q < RM; ++q)",
                "        #pragma unroll",
                "        for (int u = 0; u < RN; ++u) acc[q][u] += a[q] * b[u];",
                "    }",
                "    __syncthreads();",
                "  }",
                "  #pragma unroll",
                "  for (int q = 0; q < RM; ++q) {",
                "    const int i = ty + q * TY;",
                "    if (i >= count) continue;",
                "    const int r = c_row[i];",
                "    #pragma unroll",
                "    for (int u = 0; u < RN; ++u) {",
                "      const int c = n0 + tx * RN + u;",
                "      if (c >= N) continue;",
                "      acc_t v = acc[q][u];"]
        if scale is not None:
            other = scale.args[1] if scale.args[0] == lin.name else scale.args[0]
            n_other = max(1, p.type_of(other).numel)
            ratio = N // n_other
            body.append(f"      v *= {self.element(other, 'r', f'c / {ratio}')};  // row scale %{other}")
        if scatter is not None:
            target = f"{self.args.gather(scatter.attr('via'))}[r]"
            body.append(f"      atomicAdd({o_ptr} + (i64)({target}) * N + c, v);  // sum into %{out_name}")
        else:
            body.append(f"      st({o_ptr} + (i64)r * N + c, v);")
        body += ["    }", "  }"]
        params = ", ".join(f"{a.ctype} {a.cname}" for a in self.args.args)
        lines.append(f'extern "C" __global__ void __launch_bounds__({NT}) {self.k.name}({params}) {{')
        lines += body
        lines.append("}")
        launch = Launch("tiles", NT, ("tiles", domain.value, by, BM), grid_y=grid_y)
        return "\n".join(lines), KernelCode(self.k.name, self.k, tuple(self.args.args), launch, (out,))


    def tensor_core_kind(self, K: int, N: int) -> str | None:
        """Tensor cores for bf16/f16 programs, and for f32 ones when TF32 is allowed (sm_80+, K and N >= 16)."""
        o = self.g.options
        if not o.tensor_cores or o.arch < 80 or K < 16 or N < 16:
            return None
        if self.g.model in ("bf16", "f16"):
            return self.g.model
        if self.g.model == "f32" and o.tf32:
            return "tf32"
        return None

    TC_BM = 64  # rows per sub-tile (4 warps x 16)
    TC_ROWS = 256  # rows per scheduled tile: the weight tile is staged once for 4 sub-tiles

    def generate_tc(self, tc, lin, scale, scatter, out, domain, wt, core, transpose, K, N):
        """Segment GEMM on tensor cores: per tile, the type's weight is converted into shared memory once; each
        64-row sub-tile is gathered into shared memory (rows read through the gather index), multiplied with
        wmma (fp32 accumulation), staged back to shared memory and written by the epilogue (scale, scatter)."""
        p, g = self.p, self.g
        g.tc_kinds.add(tc)
        es = 4 if tc == "tf32" else 2
        kstep = 8 if tc == "tf32" else 16
        elem = "float" if tc == "tf32" else CTYPE[tc]
        pad = 16 // es
        KP = -(-K // kstep) * kstep
        BNP = -(-min(N, 128) // 16) * 16
        LDA, LDW, LDC = KP + pad, BNP + pad, BNP + 4
        BM, ROWS = self.TC_BM, self.TC_ROWS
        NF = BNP // 16

        def align(n: int) -> int:
            return -(-n // 128) * 128

        a_bytes, w_bytes, c_bytes = align(BM * LDA * es), align(KP * LDW * es), align(BM * LDC * 4)
        smem = a_bytes + w_bytes + c_bytes
        grid_y = -(-N // BNP)
        by = tuple(wt.by)
        self.args.get(("tiles", domain.value, by, ROWS), "tiles", "const int* __restrict__")
        perm = self.args.get(("perm", domain.value, by), "perm", "const int* __restrict__") if by else None
        a_ref = self.ref(lin.args[0], "r", False)
        assert a_ref.kind == "row", f"{self.k.name}: A operand must be rows"
        a_ptr, w_ptr, o_ptr = self.ptr(a_ref.base), self.ptr(lin.args[1]), self.ptr(out.name, out=True)
        cond, off = _weight_offset(core, transpose, "k", "n0 + c")
        wcore = math.prod(core)
        def put(dst: str, v: str) -> str:  # store into shared memory in the tensor-core input type
            return f"{dst} = hector_tf32((float)({v}));" if tc == "tf32" else f"st(&{dst}, {v});"

        lines = ["// " + self.k.describe().replace("\n", "\n// ") + f"\n// tensor cores: wmma {tc}, fp32 accumulation"]
        for m in self.k.nodes:
            lines.append(self.g.comment(m))
        body = [f"  constexpr int K = {K}, N = {N}, KP = {KP}, BNP = {BNP}, BM = {BM}, NF = {NF};",
                f"  constexpr int LDA = {LDA}, LDW = {LDW}, LDC = {LDC};",
                "  HECTOR_DYNAMIC_SMEM_DECL(smem);",
                f"  {elem}* As = ({elem}*)smem;  // [BM][LDA] gathered A rows",
                f"  {elem}* Ws = ({elem}*)(smem + {a_bytes});  // [KP][LDW] this tile's weight",
                f"  float* Cs = (float*)(smem + {a_bytes + w_bytes});  // [BM][LDC] results before the epilogue",
                "  __shared__ i64 a_off[BM];",
                "  __shared__ int c_row[BM];",
                "  const int tile = blockIdx.x;",
                "  const int type = tiles[3 * tile], begin = tiles[3 * tile + 1], count = tiles[3 * tile + 2];",
                "  if (count == 0) return;  // a spare slot of the schedule (DeviceGraph.tiles)",
                "  const int n0 = blockIdx.y * BNP;",
                "  const int warp = threadIdx.x / 32;",
                "  for (int idx = threadIdx.x; idx < KP * BNP; idx += blockDim.x) {",
                "    const int k = idx / BNP, c = idx % BNP;",
                f"    const acc_t v = (k < K && n0 + c < N && {cond}) ? ld({w_ptr} + (i64)type * {wcore} + {off}) "
                ": (acc_t)0;",
                "    " + put("Ws[k * LDW + c]", "v"),
                "  }",
                "  for (int sub = 0; sub < count; sub += BM) {",
                "    const int rows = min(BM, count - sub);",
                "    __syncthreads();  // the previous sub-tile's epilogue is done with c_row and Cs",
                "    for (int i = threadIdx.x; i < BM; i += blockDim.x) {",
                "      if (i < rows) {",
                f"        const int r = {perm + '[begin + sub + i]' if perm else 'begin + sub + i'};",
                "        c_row[i] = r;",
                f"        a_off[i] = (i64)({a_ref.expr}) * K;  // A row read through the gather index",
                "      }",
                "    }",
                "    __syncthreads();",
                "    for (int idx = threadIdx.x; idx < BM * KP; idx += blockDim.x) {",
                "      const int i = idx / KP, k = idx % KP;",
                f"      const acc_t v = (i < rows && k < K) ? ld({a_ptr} + a_off[i] + k) : (acc_t)0;",
                "      " + put("As[i * LDA + k]", "v"),
                "    }",
                "    __syncthreads();",
                "    float acc[NF][8];",
                "    #pragma unroll",
                "    for (int f = 0; f < NF; ++f)",
                "      #pragma unroll",
                "      for (int q = 0; q < 8; ++q) acc[f][q] = 0.f;",
                f"    for (int k0 = 0; k0 < KP; k0 += {kstep}) {{",
                "      unsigned a[8], b[8];",
                "      hw_load_a(a, As + warp * 16 * LDA + k0, LDA);",
                "      #pragma unroll",
                "      for (int f = 0; f < NF; ++f) {",
                "        hw_load_b(b, Ws + k0 * LDW + f * 16, LDW);",
                "        hw_mma(acc[f], a, b);",
                "      }",
                "    }",
                "    #pragma unroll",
                "    for (int f = 0; f < NF; ++f) hw_store(Cs + warp * 16 * LDC + f * 16, acc[f], LDC);",
                "    __syncthreads();",
                "    for (int idx = threadIdx.x; idx < BM * BNP; idx += blockDim.x) {",
                "      const int i = idx / BNP, cc = idx % BNP, c = n0 + cc;",
                "      if (i >= rows || c >= N) continue;",
                "      const int r = c_row[i];",
                "      acc_t v = (acc_t)Cs[i * LDC + cc];"]
        if scale is not None:
            other = scale.args[1] if scale.args[0] == lin.name else scale.args[0]
            ratio = N // max(1, p.type_of(other).numel)
            body.append(f"      v *= {self.element(other, 'r', f'c / {ratio}')};  // row scale %{other}")
        if scatter is not None:
            target = f"{self.args.gather(scatter.attr('via'))}[r]"
            body.append(f"      atomicAdd({o_ptr} + (i64)({target}) * N + c, v);  // sum into %{out.name}")
        else:
            body.append(f"      st({o_ptr} + (i64)r * N + c, v);")
        body += ["    }", "  }"]
        params = ", ".join(f"{a.ctype} {a.cname}" for a in self.args.args)
        lines.append(f'extern "C" __global__ void __launch_bounds__(128) {self.k.name}({params}) {{')
        lines += body
        lines.append("}")
        launch = Launch("tiles", 128, ("tiles", domain.value, by, ROWS), grid_y=grid_y, smem=smem)
        return "\n".join(lines), KernelCode(self.k.name, self.k, tuple(self.args.args), launch, (out,))


class _OuterSum(_Emitter):
    """Weight gradient ``C[type] += sum_r A[r]^T B[r]`` per tile of rows, accumulated in registers and added to C
    with one atomic per cell and tile. Tiles are sized at run time (``rows`` 0): with few types and millions of rows,
    fixed 256-row tiles sent every tile's atomics to the same few thousand cells (H100, mag, 4 relations: 117 of a
    176 ms RGAT training step in this kernel)."""

    CHUNK = 32
    ROWS = 0

    def generate(self) -> tuple[str, KernelCode]:
        g, p = self.g, self.p
        node = next(self.p.node(m) for m in self.members if self.p.node(m).op is Op.OUTER_SUM)
        by = tuple(node.attr("by", ()))
        shape = tuple(node.attr("shape"))
        core = shape[len(by):]
        H, din, dout = (1,) + core if len(core) == 2 else core
        domain = p.type_of(node.args[0]).domain
        Ka, Nb = p.type_of(node.args[0]).numel, p.type_of(node.args[1]).numel
        g.dtypes[node.name] = g.acc
        out = Output(node.name, g.acc, True)
        RK = 4 if din % 4 == 0 else 1
        RN = 4 if dout % 4 == 0 else 1
        cells = H * (din // RK) * (dout // RN)
        splits = max(1, BLOCK // cells)
        Q = -(-cells // BLOCK)
        CH, ROWS = self.CHUNK, self.ROWS
        self.args.get(("tiles", domain.value, by, ROWS), "tiles", "const int* __restrict__")
        perm = self.args.get(("perm", domain.value, by), "perm", "const int* __restrict__") if by else None
        a_ref, b_ref = self.ref(node.args[0], "r", False), self.ref(node.args[1], "r", False)
        a_ptr, b_ptr = self.ptr(a_ref.base), self.ptr(b_ref.base)
        o_ptr = self.ptr(node.name, out=True)
        P = H * din * dout
        lines = ["// " + self.k.describe().replace("\n", "\n// ")]
        for m in self.k.nodes:
            lines.append(self.g.comment(m))
        body = [f"  constexpr int KA = {Ka}, NB = {Nb}, CH = {CH}, DIN = {din}, DOUT = {dout}, RK = {RK}, RN = {RN};",
                f"  constexpr int CELLS = {cells}, SPLITS = {splits}, Q = {Q};",
                "  __shared__ acc_t As[CH][KA];",
                "  __shared__ acc_t Bs[CH][NB];",
                "  const int tile = blockIdx.x;",
                "  const int type = tiles[3 * tile], begin = tiles[3 * tile + 1], count = tiles[3 * tile + 2];",
                "  if (count == 0) return;  // a spare slot of the schedule (DeviceGraph.tiles)",
                "  const int split = threadIdx.x / CELLS < SPLITS ? threadIdx.x / CELLS : -1;",
                "  acc_t acc[Q][RK][RN];",
                "  #pragma unroll",
                "  for (int q = 0; q < Q; ++q)",
                "    #pragma unroll",
                "    for (int a = 0; a < RK; ++a)",
                "      #pragma unroll",
                "      for (int b = 0; b < RN; ++b) acc[q][a][b] = 0;",
                "  for (int i0 = 0; i0 < count; i0 += CH) {",
                "    for (int idx = threadIdx.x; idx < CH * KA; idx += blockDim.x) {",
                "      const int i = idx / KA, k = idx % KA;",
                "      acc_t v = 0;",
                "      if (i0 + i < count) {",
                f"        const int r = {perm + '[begin + i0 + i]' if perm else 'begin + i0 + i'};",
                f"        v = ld({a_ptr} + (i64)({a_ref.expr}) * KA + k);",
                "      }",
                "      As[i][k] = v;",
                "    }",
                "    for (int idx = threadIdx.x; idx < CH * NB; idx += blockDim.x) {",
                "      const int i = idx / NB, k = idx % NB;",
                "      acc_t v = 0;",
                "      if (i0 + i < count) {",
                f"        const int r = {perm + '[begin + i0 + i]' if perm else 'begin + i0 + i'};",
                f"        v = ld({b_ptr} + (i64)({b_ref.expr}) * NB + k);",
                "      }",
                "      Bs[i][k] = v;",
                "    }",
                "    __syncthreads();",
                "    if (split >= 0) {",
                "      #pragma unroll",
                "      for (int q = 0; q < Q; ++q) {",
                f"        const int cell = (SPLITS > 1 ? threadIdx.x % CELLS : threadIdx.x) + q * {BLOCK};",
                "        if (cell >= CELLS) continue;",
                "        const int h = cell / ((DIN / RK) * (DOUT / RN)), rem = cell % ((DIN / RK) * (DOUT / RN));",
                "        const int ka = h * DIN + (rem / (DOUT / RN)) * RK, nb = h * DOUT + (rem % (DOUT / RN)) * RN;",
                "        for (int i = split; i < CH; i += SPLITS) {",
                "          acc_t a[RK], b[RN];",
                "          #pragma unroll",
                "          for (int x = 0; x < RK; ++x) a[x] = As[i][ka + x];",
                "          #pragma unroll",
                "          for (int y = 0; y < RN; ++y) b[y] = Bs[i][nb + y];",
                "          #pragma unroll",
                "          for (int x = 0; x < RK; ++x)",
                "            #pragma unroll",
                "            for (int y = 0; y < RN; ++y) acc[q][x][y] += a[x] * b[y];",
                "        }",
                "      }",
                "    }",
                "    __syncthreads();",
                "  }",
                "  if (split < 0) return;",
                "  #pragma unroll",
                "  for (int q = 0; q < Q; ++q) {",
                f"    const int cell = (SPLITS > 1 ? threadIdx.x % CELLS : threadIdx.x) + q * {BLOCK};",
                "    if (cell >= CELLS) continue;",
                "    const int h = cell / ((DIN / RK) * (DOUT / RN)), rem = cell % ((DIN / RK) * (DOUT / RN));",
                "    const int i_ = (rem / (DOUT / RN)) * RK, o_ = (rem % (DOUT / RN)) * RN;",
                "    #pragma unroll",
                "    for (int x = 0; x < RK; ++x)",
                "      #pragma unroll",
                "      for (int y = 0; y < RN; ++y)",
                f"        atomicAdd({o_ptr} + (i64)type * {P} + h * (DIN * DOUT) + (i_ + x) * DOUT + o_ + y, "
                "acc[q][x][y]);",
                "  }"]
        params = ", ".join(f"{a.ctype} {a.cname}" for a in self.args.args)
        lines.append(f'extern "C" __global__ void __launch_bounds__({BLOCK}) {self.k.name}({params}) {{')
        lines += body
        lines.append("}")
        launch = Launch("tiles", BLOCK, ("tiles", domain.value, by, ROWS))
        return "\n".join(lines), KernelCode(self.k.name, self.k, tuple(self.args.args), launch, (out,))


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
                e = _act(n.attr("fn"), args[0], n.attr("slope", 0.0))
            else:
                raise AssertionError(f"param kernel has no rule for {n.op}")  # pragma: no cover
            body.append(f"  st({o_ptr} + idx, {e});")
        params = ", ".join(f"{a.ctype} {a.cname}" for a in self.args.args)
        lines = ["// " + self.k.describe().replace("\n", "\n// "), self.g.comment(name),
                 f'extern "C" __global__ void {self.k.name}({params}) {{'] + body + ["}"]
        launch = Launch("elements", 256, (total,))
        return "\n".join(lines), KernelCode(self.k.name, self.k, tuple(self.args.args), launch,
                                            (Output(name, g.acc, False),))


def generate(lowered: Lowered, dtypes: Mapping[str, str], model_dtype: str,
             options: CodegenOptions = CodegenOptions()) -> ModuleCode:
    """CUDA source for every kernel of ``lowered``. ``dtypes`` gives the storage type ("f32", "f64", "bf16",
    "f16") of every leaf the program reads; values the kernels write get ``model_dtype``, or its accumulation type
    where they are summed with atomics (scatters, weight gradients)."""
    if model_dtype not in CTYPE:
        raise ValueError(f"unsupported dtype {model_dtype!r}; the CUDA backend supports {list(CTYPE)}")
    gen = _Gen(lowered, dtypes, model_dtype, options)
    p = lowered.program
    for n in p.nodes:
        if n.op in _LEAVES and n.op is not Op.DROPOUT_MASK and n.name not in gen.dtypes:
            raise ValueError(f"no dtype given for leaf {n.name}")
    pieces, kernels = [], []
    for spec in lowered.kernels:
        if spec.kind == "rng":
            (name,) = spec.outputs or spec.nodes
            gen.dtypes[name] = model_dtype
            kernels.append(KernelCode(spec.name, spec, (), Launch("torch", 0), (Output(name, model_dtype, False),),
                                      torch_op="rng"))
            continue
        if spec.kind == "traversal":
            emitter: _Emitter = _Traversal(gen, spec)
        elif spec.kind == "param":
            emitter = _ParamKernel(gen, spec)
        elif any(p.node(m).op is Op.OUTER_SUM for m in spec.nodes):
            emitter = _OuterSum(gen, spec)
        else:
            emitter = _Gemm(gen, spec)
        text, code = emitter.generate()
        pieces.append(text)
        kernels.append(code)
    used = {a.bind[1] for k in kernels for a in k.args if a.bind[0] in ("value", "out")}
    header = [f"// hector: generated CUDA for program {p.name} ({len(kernels)} kernels, storage {model_dtype}, "
              f"accumulation {gen.acc})",
              f"typedef {CTYPE[gen.acc]} acc_t;",
              PRELUDE]
    assert len(gen.tc_kinds) <= 1
    for tc in gen.tc_kinds:
        header += [WMMA, WMMA_CUDA[tc], f"#define HW_ELEM {'float' if tc == 'tf32' else CTYPE[tc]}",
                   f"#define HW_KSTEP {8 if tc == 'tf32' else 16}", WMMA_EMULATED]
    stubs = ["#ifdef HECTOR_EMULATE  // entry points for the CPU emulator used by the tests"]
    for k in kernels:
        if k.torch_op:
            continue
        unpack = ", ".join(f"*({a.ctype.replace('__restrict__', '').strip()}*)a[{i}]"
                           for i, a in enumerate(k.args))
        stubs.append(f'extern "C" void hector_emu_{k.name}(void** a) {{ {k.name}({unpack}); }}')
    stubs.append("#endif")
    source = "\n".join(header + pieces + stubs) + "\n"
    return ModuleCode(p.name, source, tuple(kernels),
                      tuple(sorted((n, d) for n, d in gen.dtypes.items() if n in used)))


def leaf_dtypes(program: Program, model_dtype: str, saved: Mapping[str, str] | None = None) -> dict[str, str]:
    """Storage dtypes of a program's leaves as the CUDA backend binds them: inputs and params in the model dtype,
    graph constants in the accumulation dtype, saved forward values as the forward module stored them."""
    out = {}
    for n in program.nodes:
        if n.op in (Op.INPUT, Op.PARAM):
            out[n.name] = model_dtype
        elif n.op is Op.GRAPH:
            out[n.name] = acc_dtype(model_dtype)
        elif n.op is Op.SAVED:
            out[n.name] = (saved or {}).get(n.attr("name"), model_dtype)
    return out


def layer_modules(compiled: Any, model_dtype: str = "f32",
                  options: CodegenOptions = CodegenOptions()) -> dict[str, ModuleCode]:
    """The CUDA modules of a compiled layer (:class:`hector.runtime.compiled.CompiledLayer`): ``forward``
    (training: keeps what the backward reads), ``inference`` and ``backward`` (all gradients)."""
    from ..lower import lower

    fwd = generate(compiled.forward_lowered, leaf_dtypes(compiled.forward, model_dtype), model_dtype, options)
    inf = generate(compiled.inference_lowered, leaf_dtypes(compiled.forward, model_dtype), model_dtype, options)
    bw = compiled.full_backward.program
    stored = dict(fwd.dtypes)
    saved = {name: stored.get(name, model_dtype) for name in compiled.saved}
    back = generate(lower(bw), leaf_dtypes(bw, model_dtype, saved), model_dtype, options)
    return {"forward": fwd, "inference": inf, "backward": back}


def compile_module(module: ModuleCode, arch: int) -> bytes:
    """Compile a module with NVRTC for ``sm_<arch>`` (no GPU needed); raises ``hector.CompileError`` quoting the
    failing generated lines. Cached on disk like every JIT compile."""
    from .. import _core, _shared_cuda

    return _shared_cuda.compile_kernel_source(_core, module.source, f"{module.name}.cu", arch=arch)
