"""The one fixed kernel of the CUDA backend: it writes a segment GEMM's tile schedule from per-type row counts.

Built with torch ops, a schedule took ~20 small operations per (domain, types, tile rows); a mini-batch layer needs
four schedules, each graph new, so that was ~80 launches of host time per training step (H200 GNN profile,
integration-tests RESULTS.md). This kernel is one launch. The per-type counts stay on the GPU, so nothing is read on
the host either.
"""

from .cuda import ModuleCode

KERNEL = "hector_tile_schedule"
SIGNATURE = "ptr, i64, i64, i64, ptr"  # counts, types, rows per tile, slots, table
BLOCK = 256

SOURCE = r"""// hector: tile schedule of a segment GEMM (runtime support, not generated)
typedef long long i64;

// table[s] = (type, first row in the type-sorted order, rows) for every tile of at most `rows` rows, types in
// order, then zeros up to `slots` (the caller's upper bound on the tile count; blocks of empty tiles return).
// One block: thread 0 walks the types (a few to a few thousand, tiles a few thousand), the others clear the rest.
extern "C" __global__ void hector_tile_schedule(const i64* __restrict__ counts, i64 types, i64 rows, i64 slots,
                                                int* __restrict__ table) {
  __shared__ i64 used;
  if (threadIdx.x == 0) {
    i64 slot = 0, begin = 0;
    for (i64 t = 0; t < types; ++t) {
      const i64 c = counts[t];
      for (i64 off = 0; off < c && slot < slots; off += rows, ++slot) {
        table[3 * slot] = (int)t;
        table[3 * slot + 1] = (int)(begin + off);
        table[3 * slot + 2] = (int)(c - off < rows ? c - off : rows);
      }
      begin += c;
    }
    used = slot;
  }
  __syncthreads();
  for (i64 s = used + threadIdx.x; s < slots; s += blockDim.x) {
    table[3 * s] = 0;
    table[3 * s + 1] = 0;
    table[3 * s + 2] = 0;
  }
}

#ifdef HECTOR_EMULATE  // entry point for the CPU emulator used by the tests
extern "C" void hector_emu_hector_tile_schedule(void** a) {
  hector_tile_schedule(*(const i64**)a[0], *(i64*)a[1], *(i64*)a[2], *(i64*)a[3], *(int**)a[4]);
}
#endif
"""

MODULE = ModuleCode(KERNEL, SOURCE, (), ())

__all__ = ["BLOCK", "KERNEL", "MODULE", "SIGNATURE", "SOURCE"]
