"""The pieces every kernel family's emitter shares: storage types, the kernel/module descriptions the runtime
binds and launches (:class:`KernelCode`, :class:`ModuleCode`), parameter lists, and the emitter base class that
resolves an IR value to a pointer or a register expression."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from ..ir.core import Domain, Op, Program
from ..ir.printer import format_node
from ..lower.kernels import Kernel, Lowered

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
    schedule (type, first position in perm, row count); ``("seg_ptr", domain, via)`` / ``("seg_rows", domain,
    via)`` int32 offsets per target row and the domain's rows sorted by ``via``'s target (target-centric
    kernels); ``("rows", domain)`` / ``("ntiles", domain, by, rows)``
    counts (i64); ``("count", domain)`` the domain's row count as a one-element int32 tensor on the device (the
    unique-pair rows, whose count the host need not know).
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
    # written with atomics into the buffer of this earlier value (which it then is), instead of a zero-filled one
    init: str = ""


@dataclass(frozen=True)
class KernelCode:
    name: str
    spec: Kernel
    args: tuple[Arg, ...]
    launch: Launch
    outputs: tuple[Output, ...]
    # run by the runtime with torch, no CUDA source: "rng" (counter-based RNG), "einsum" (a weight-only einsum with a
    # long reduction, in the accumulation dtype)
    torch_op: str = ""

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
    """``tf32``: fp32 GEMMs on tensor cores in TF32 (else exact fp32 on CUDA cores). ``split_degree``: destination
    walks give a destination with more in-edges than this to every group of the block, which walk its in-edges in
    parallel and combine their sums and softmax statistics in shared memory (0: one group per destination always)."""

    tf32: bool = False
    tensor_cores: bool = True  # bf16/f16 GEMMs on tensor cores (sm_80+)
    arch: int = 80
    split_degree: int = 32


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
