"""Traversal kernels: edge-parallel (one group of threads per destination, register reductions for edge softmax and
sums by destination), node- and pair-parallel (one group per row). See :mod:`hector.codegen.cuda`."""

from __future__ import annotations

import math
from typing import Any

from ..ir.core import GATHER_VIA, Domain, Op
from ..lower.kernels import Kernel
from .common import BLOCK, KernelCode, Launch, Output, _Emitter, _Gen, _pow2_at_least, _Ref, cname
from .templates import BROADCASTING, ELEMENTWISE

EDGE_UNROLL = 4  # row walks (a destination's in-edges, a target's sorted rows) unrolled this many times
# static shared memory a splitting destination walk may use in all (the partial states, the groups' scratch, the
# pre-reduced param sums): under the 48 KiB a kernel may declare statically, with room for the compiler's own
SPLIT_SMEM_BYTES = 40 << 10


class _Traversal(_Emitter):
    """Emits one traversal kernel (see the module docstring for the execution model)."""

    def __init__(self, gen: _Gen, spec: Kernel):
        super().__init__(gen, spec)
        # target-centric (lowering detail "centric"): one group per target row of that index walks its rows in a
        # sorted order and sums them in registers; no destination walk, so the rows are read like a row kernel's
        self.centric: str | None = dict(spec.detail).get("centric")
        self.edge = spec.space == "edge" and self.centric is None
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
        self.split = 0  # in-degree above which a destination is split over the block (0: never)
        self.split_slots = 0  # partial-state slots per thread a split walk combines (the largest walk's)
        self.effects_list: list[tuple[int, str, str]] = []

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
        return n.op is Op.SELECT_SUM or (n.op is Op.SCATTER_ADD and not self.is_dst_reduce(name)
                                         and not self.is_segment_sum(name))

    def is_segment_sum(self, name: str) -> bool:
        """Summed by the target-centric walk: in registers, written once per target row."""
        n = self.p.node(name)
        return self.centric is not None and n.op is Op.SCATTER_ADD and n.attr("via") == self.centric

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
        if op in ELEMENTWISE:  # one expression per element, from the table
            if op in BROADCASTING:
                args = [self.broadcast(r, self.g.numel(a), N) for r, a in zip(args, n.args, strict=True)]
            self.emit(f"  {line}")
            reg = self.new_reg(n.name)
            e = ELEMENTWISE[op](n, [f"{r}[s]" for r in args])
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
            elif self.is_segment_sum(name):
                out.append((self.phase(n.args[0]), "segment", name))
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
        if kind == "segment":
            self.emit(f"  // sum into the walk's target row: {self.g.comment(name)[3:]}")
            self.emit(f"  #pragma unroll\n  for (int s = 0; s < {S}; ++s) acc_{cname(name)}[s] += {src}[s];")
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
        self.split = self.split_degree(effects, nloops)
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
                    lead = " && lead" if self.split else ""  # a split destination: one group stores its row
                    self.loop(self.slots(N), f"if (j < {N}{lead}) st({self.ptr(name, out=True)} + (i64)d * {N} + j, "
                                             f"{reg}[s]);")
        return self.assemble(nloops)

    # -- heavy destinations split over a block ---------------------------------------------------------------
    def walk_states(self, loop: int) -> list[tuple[str, list[str], int]]:
        """What walk ``loop`` reduces over the in-edges, in the order a split walk combines it: (kind, register
        arrays, slots) with kind "reduce" (a sum: ``acc_*``) or "softmax" (its running maximum and sum of
        exponentials: ``sm_*_m``, ``sm_*_z``)."""
        out = []
        for eloop, kind, name in self.effects_list:
            if eloop != loop or kind not in ("softmax", "reduce"):
                continue
            S = self.slots(self.p.node(name).args[0])
            arrays = [f"sm_{cname(name)}_m", f"sm_{cname(name)}_z"] if kind == "softmax" else [f"acc_{cname(name)}"]
            out.append((kind, arrays, S))
        return out

    def split_degree(self, effects: list[tuple[int, str, str]], nloops: int) -> int:
        """The in-degree above which this kernel splits a destination over its block (0: never). Splitting needs
        a shared buffer holding every group's partial state of one walk; where that does not fit beside the
        scratch, the kernel keeps one group per destination."""
        degree = self.g.options.split_degree
        if not self.edge or degree <= 0:
            return 0
        self.effects_list = effects
        slots = max(sum(len(a) * S for _, a, S in self.walk_states(loop)) for loop in range(nloops))
        itemsize = 8 if self.g.acc == "f64" else 4
        scratch = (BLOCK // self.G) * (2 * self.maxw if self.G > 1 else 1)
        total = (BLOCK * slots + scratch + sum(self.smem_params.values())) * itemsize
        if total > SPLIT_SMEM_BYTES:
            return 0
        self.split_slots = slots
        return degree

    def combine(self, loop: int) -> list[str]:
        """After walk ``loop`` of a split destination: every group's partial state through shared memory, and
        every group left holding the whole destination's (partial sums added, softmax statistics merged by their
        maxima). All groups read the parts in one order, so they hold the same values bit for bit."""
        states = self.walk_states(loop)
        if not states:
            return []
        lines = ["  __syncthreads();  // the previous combine's reads are done",
                 f"  // walk {loop + 1}: each group's partial state into the block's buffer"]
        offset = 0
        for _, arrays, S in states:
            for arr in arrays:
                lines.append(f"  #pragma unroll\n  for (int s = 0; s < {S}; ++s) "
                             f"split_buf[({offset} + s) * {BLOCK} + threadIdx.x] = {arr}[s];")
                offset += S
        lines.append("  __syncthreads();")
        parts = BLOCK // self.G

        def part(off: int) -> str:  # element s of group p's array at offset ``off``
            return f"split_buf[({off} + s) * {BLOCK} + p * G + lane]"

        offset = 0
        for kind, arrays, S in states:
            if kind == "softmax":
                m, z = arrays
                lines.append(
                    f"  #pragma unroll\n  for (int s = 0; s < {S}; ++s) {{ acc_t mx = HECTOR_NEG_INF, z = 0;\n"
                    f"    for (int p = 0; p < {parts}; ++p) mx = hmax(mx, {part(offset)});\n"
                    f"    for (int p = 0; p < {parts}; ++p) {{ const acc_t m = {part(offset)}; "
                    f"if (m != HECTOR_NEG_INF) z += {part(offset + S)} * hexp(m - mx); }}\n"
                    f"    {m}[s] = mx; {z}[s] = z; }}")
            else:
                lines.append(f"  #pragma unroll\n  for (int s = 0; s < {S}; ++s) {{ acc_t t = 0; "
                             f"for (int p = 0; p < {parts}; ++p) t += {part(offset)}; {arrays[0]}[s] = t; }}")
            offset += len(arrays) * S
        return lines

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
        if self.centric is not None:
            body += self.centric_walk()
            return self.finish(body, ("rows", GATHER_VIA[self.centric][0].value))
        order = self.args.get(("dst_order",), "dst_order", "const int* __restrict__") if self.edge else ""
        ptr = self.args.get(("csc_ptr",), "csc_ptr", "const int* __restrict__") if self.edge else ""
        if not self.edge and self.space_domain is Domain.UNIQUE:
            # the unique (source, relation) pair count lives on the device: the runtime need not read it to launch
            # (rows past it are padding of a buffer sized by the edge count)
            count = self.args.get(("count", Domain.UNIQUE.value), "n_unique", "const int* __restrict__")
            body.append(f"  const i64 n_work = {count}[0];  // unique (source, relation) pairs")
            n_work = "n_work"
        else:
            n_work = self.args.get(("rows", Domain.NODE.value if self.edge else self.space_domain.value),
                                   "n_work", "i64", "i64")
        body.append(f"  const i64 groups = (i64)gridDim.x * {groups_per_block};")
        body.append(f"  for (i64 w = (i64)blockIdx.x * {groups_per_block} + threadIdx.x / G; w < {n_work}; "
                    "w += groups) {")
        if self.edge:
            if self.split:
                body = body[:-1] + self.split_phase(order, ptr, n_work, nloops)
                # the grid-stride loop from chunk c on, past the destinations the block walked together
                body.append(f"  for (i64 w = c * {groups_per_block} + part + (part < walked ? groups : 0); "
                            f"w < {n_work}; w += groups) {{")
                body.append("  const bool lead = true;")
                body.append("  (void)lead;")
            body.append(f"  const int d = {order}[w];  // destination node (heaviest first)")
            body.append(f"  const int e_begin = {ptr}[d], e_end = {ptr}[d + 1];")
            body += self.destination_walks(nloops, split=False)
        else:
            body.append(f"  const i64 r = w;  // {self.k.space} row")
            body += self.loops[0]
        body.append("  }")
        return self.finish(body, ("dst",) if self.edge else ("rows", self.space_domain.value))

    def destination_walks(self, nloops: int, split: bool) -> list[str]:
        """The walks over the in-edges of destination ``d`` (``e_begin .. e_end``) and the node-wise work after
        them: by this group alone, or (``split``) by every group of the block, each taking every ``parts``-th
        in-edge, with the walk's reductions combined before the next walk reads them."""
        body = []
        for loop in range(nloops):
            body += self.sections[loop]
            body.append(f"  // walk {loop + 1} of {nloops} over the in-edges of d"
                        + (", every group of the block on its share" if split else ""))
            # unrolled: the loads of several in-edges in flight at once
            first, step = ("e_begin + part", "e += parts") if split else ("e_begin", "++e")
            body.append(f"  #pragma unroll {EDGE_UNROLL}\n  for (int e = {first}; e < e_end; {step}) {{")
            body += ["  " + sub for ln in self.loops[loop] for sub in ln.split("\n")]
            body.append("  }")
            if split:
                body += self.combine(loop)
        body += self.sections[nloops]
        return body

    def split_phase(self, order: str, ptr: str, n_work: str, nloops: int) -> list[str]:
        """The start of a splitting destination walk. A walk is serial per destination, so a destination with a
        thousand in-edges bounds the kernel with a thousand dependent steps while the other groups idle. Blocks
        take chunks of consecutive destinations in the heaviest-first order; while a chunk starts with a heavy
        destination (more in-edges than the split degree), the whole block walks each of its heavy destinations
        together. At the first light one the block goes on as usual (one group per destination, grid-stride),
        skipping the chunk's destinations it already walked. The decision reads the same memory in every thread,
        so it is the same in the whole block (its barriers stay uniform); the order only makes it fast, not
        correct."""
        per_block = BLOCK // self.G
        body = [f"  constexpr int parts = {per_block};  // groups that share a split destination",
                "  const int part = threadIdx.x / G;  // this group's share"]
        if self.split_slots:  # a walk without reductions has nothing to combine
            body.append(f"  __shared__ acc_t split_buf[{self.split_slots * BLOCK}];  // every group's partial state")
        body += ["  i64 c = blockIdx.x;  // chunk: destinations c * parts .. c * parts + parts - 1 of the order",
                 "  int walked = 0;  // destinations of chunk c already walked by the whole block",
                 f"  while (c * parts < {n_work}) {{",
                 "  const i64 w0 = c * parts;",
                 f"  for (walked = 0; walked < parts && w0 + walked < {n_work}; ++walked) {{",
                 f"  const int d = {order}[w0 + walked];  // destination node (heaviest first)",
                 f"  const int e_begin = {ptr}[d], e_end = {ptr}[d + 1];",
                 f"  if (e_end - e_begin <= {self.split}) break;  // light: one group walks it",
                 "  const bool lead = part == 0;  // the group that writes the destination's node-wise outputs",
                 "  (void)lead;"]
        body += ["  " + sub for ln in self.destination_walks(nloops, split=True) for sub in ln.split("\n")]
        body += ["  }",
                 f"  if (walked < parts && w0 + walked < {n_work}) break;  // the rest of the order: one group each",
                 "  c += gridDim.x;",
                 "  walked = 0;",
                 "  }"]
        return body

    def centric_walk(self) -> list[str]:
        """The grid-stride loop of a target-centric kernel: per target row t, its rows in the sorted layout
        (``seg_ptr[t] .. seg_ptr[t + 1]`` of ``seg_rows``), the sums in registers, one store per target row."""
        via = self.centric
        target = GATHER_VIA[via][0]
        key = (self.space_domain.value, via)
        ptr = self.args.get(("seg_ptr",) + key, "seg_ptr", "const int* __restrict__")
        rows = self.args.get(("seg_rows",) + key, "seg_rows", "const int* __restrict__")
        if target is Domain.UNIQUE:  # the pair count lives on the device (see the row kernels)
            count = self.args.get(("count", Domain.UNIQUE.value), "n_unique", "const int* __restrict__")
            body = [f"  const i64 n_work = {count}[0];  // unique (source, relation) pairs"]
        else:
            n = self.args.get(("rows", target.value), "n_targets", "i64", "i64")
            body = [f"  const i64 n_work = {n};  // {target.value} rows"]
        per_block = BLOCK // self.G
        sums = [m for m in self.members if self.is_segment_sum(m)]
        body.append(f"  const i64 groups = (i64)gridDim.x * {per_block};")
        body.append(f"  for (i64 w = (i64)blockIdx.x * {per_block} + threadIdx.x / G; w < n_work; w += groups) {{")
        body.append(f"  const i64 t = w;  // {target.value} row: the target of the sums by {via}")
        for m in sums:
            S = self.slots(self.p.node(m).args[0])
            body.append(f"  acc_t acc_{cname(m)}[{S}];  // %{m}, summed over the rows of t")
            body.append(f"  #pragma unroll\n  for (int s = 0; s < {S}; ++s) acc_{cname(m)}[s] = 0;")
        body.append(f"  const int k_begin = {ptr}[t], k_end = {ptr}[t + 1];")
        body.append(f"  #pragma unroll {EDGE_UNROLL}\n  for (int k = k_begin; k < k_end; ++k) {{")
        body.append(f"  const i64 r = {rows}[k];  // {self.k.space} row, sorted by {via}")
        body += ["  " + sub for ln in self.loops[0] for sub in ln.split("\n")]
        body.append("  }")
        for m in sums:
            N = self.g.numel(m)
            body.append(f"  #pragma unroll\n  for (int s = 0; s < {self.slots(N)}; ++s) {{ const int j = s * G + lane; "
                        f"if (j < {N}) st({self.ptr(m, out=True)} + t * {N} + j, acc_{cname(m)}[s]); }}")
        body.append("  }")
        return body

    def finish(self, body: list[str], work: tuple) -> tuple[str, KernelCode]:
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
        launch = Launch("groups", BLOCK, work, self.G)
        return "\n".join(lines), KernelCode(self.k.name, self.k, tuple(self.args.args), launch, tuple(self.outputs))
