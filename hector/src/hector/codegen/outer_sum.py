"""Weight-gradient kernels (``outer_sum``): per tile ``C[type] += A^T B`` in registers, flushed with atomics. See
:mod:`hector.codegen.cuda`."""

from __future__ import annotations

from ..ir.core import Op
from .common import BLOCK, KernelCode, Launch, Output, _Emitter


class _OuterSum(_Emitter):
    """Weight gradient ``C[type] += sum_r A[r]^T B[r]`` per tile of rows, accumulated in registers and added to C
    with one atomic per cell and tile. Tiles are sized at run time (``rows`` 0): with few types and millions of rows,
    fixed 256-row tiles sent every tile's atomics to the same few thousand cells (H100, mag, 4 relations: 117 of a
    176 ms RGAT training step in this kernel). A narrow gradient (an attention vector's: 64 x 4 cells per type)
    splits the block's rows between groups of threads that each hold every cell; their partial sums are added in
    shared memory before the one atomic per cell (adding each group's with atomics of its own sent 16 atomics to
    every cell per tile: on fb15k, 474 relations, 1.78 of an RGAT training step's 5.97 ms in this kernel)."""

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
        # accumulating into another buffer of the call (the lowering's ``accumulate``): the kernel writes the sum
        # node that follows it, whose buffer is that one, not a zero-filled one of its own
        into = dict(self.k.detail).get("accumulate")
        target = self.k.nodes[-1] if into else node.name
        g.dtypes[node.name] = g.dtypes[target] = g.acc
        out = Output(target, g.acc, not into, into or "")
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
        o_ptr = self.ptr(target, out=True)
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
                ] + (self._flush_splits(o_ptr, P) if splits > 1 else [
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
                "  }"])
        if splits > 1:
            body.insert(3, f"  __shared__ acc_t Red[{BLOCK}];")
        params = ", ".join(f"{a.ctype} {a.cname}" for a in self.args.args)
        lines.append(f'extern "C" __global__ void __launch_bounds__({BLOCK}) {self.k.name}({params}) {{')
        lines += body
        lines.append("}")
        launch = Launch("tiles", BLOCK, ("tiles", domain.value, by, ROWS))
        return "\n".join(lines), KernelCode(self.k.name, self.k, tuple(self.args.args), launch, (out,))

    @staticmethod
    def _flush_splits(o_ptr: str, cells_per_type: int) -> list[str]:
        """The epilogue when the block's threads split the rows (Q is 1: every cell has SPLITS threads, the cell's
        thread of split s at ``cell + s * CELLS``): per register of the cell, the splits' sums added in shared
        memory, then one atomic per cell and tile. Every thread takes part in the barriers (those of no split add
        zeros)."""
        return [
            "  const int cell = threadIdx.x % CELLS;",
            "  const int h = cell / ((DIN / RK) * (DOUT / RN)), rem = cell % ((DIN / RK) * (DOUT / RN));",
            "  const int i_ = (rem / (DOUT / RN)) * RK, o_ = (rem % (DOUT / RN)) * RN;",
            "  #pragma unroll",
            "  for (int x = 0; x < RK; ++x)",
            "    #pragma unroll",
            "    for (int y = 0; y < RN; ++y) {",
            "      Red[threadIdx.x] = split >= 0 ? acc[0][x][y] : (acc_t)0;",
            "      __syncthreads();",
            "      if (split == 0) {",
            "        acc_t sum = 0;",
            "        #pragma unroll",
            "        for (int s = 0; s < SPLITS; ++s) sum += Red[cell + s * CELLS];",
            f"        atomicAdd({o_ptr} + (i64)type * {cells_per_type} + h * (DIN * DOUT) + (i_ + x) * DOUT + o_ + y, "
            "sum);",
            "      }",
            "      __syncthreads();",
            "    }",
        ]
