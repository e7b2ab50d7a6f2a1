"""Segment GEMM kernels (``linear``): a device-side tile schedule, A rows read through a gather index, CUDA-core or
tensor-core (wmma) tiles, row-scale and atomic scatter epilogues. See :mod:`hector.codegen.cuda`."""

from __future__ import annotations

import math

from ..ir.core import Op
from .common import BLOCK, CTYPE, KernelCode, Launch, Output, _Emitter
from .templates import weight_offset


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
        cond, off = weight_offset(core, transpose, "k", "c")
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
        cond, off = weight_offset(core, transpose, "k", "n0 + c")
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
