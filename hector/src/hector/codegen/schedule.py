"""The one fixed kernel of the CUDA backend: it writes a segment GEMM's tile schedule from per-type row counts.

Built with torch ops, a schedule took ~20 small operations per (domain, types, tile rows); a mini-batch layer needs
four schedules, each graph new, so that was ~80 launches of host time per training step. This kernel is one
launch. The per-type counts stay on the GPU, so nothing is read on the host either. Its threads take one type each
(a block-wide scan places their tiles): a model with thousands of relations does not make one thread walk them all.
"""

from .common import ModuleCode

KERNEL = "hector_tile_schedule"
SIGNATURE = "ptr, i64, i64, i64, ptr"  # counts, types, rows per tile, slots, table
BLOCK = 256  # a multiple of 32 (warp scans), at most 1024

SOURCE = r"""// hector: tile schedule of a segment GEMM (runtime support, not generated)
typedef long long i64;

// Inclusive sum over the lanes of a warp (shuffles only: no block barrier).
__device__ __forceinline__ i64 hector_warp_scan(i64 v, unsigned lane) {
  for (unsigned off = 1; off < 32; off <<= 1) {
    const i64 other = __shfl_sync(0xffffffffu, v, (int)(lane >= off ? lane - off : lane));
    if (lane >= off) v += other;
  }
  return v;
}

// table[s] = (type, first row in the type-sorted order, rows) for every tile of at most `rows` rows, types in
// order, then zeros up to `slots` (the caller's upper bound on the tile count; blocks of empty tiles return).
// One block walks the types blockDim.x at a time: each thread takes one type, a block-wide exclusive scan of the
// tile and row counts gives the type its first slot and first row, and the thread writes the type's tiles. The
// work per type is a few instructions on its own thread, so thousands of types (relations, or node type x
// relation pairs) cost a few chunks of scans, not a serial walk. blockDim.x must be a multiple of 32, <= 1024.
extern "C" __global__ void hector_tile_schedule(const i64* __restrict__ counts, i64 types, i64 rows, i64 slots,
                                                int* __restrict__ table) {
  __shared__ i64 warp_tiles[32], warp_rows[32];
  __shared__ i64 base_tile, base_row;
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  if (threadIdx.x == 0) {
    base_tile = 0;
    base_row = 0;
  }
  __syncthreads();
  for (i64 start = 0; start < types; start += blockDim.x) {
    const i64 t = start + threadIdx.x;
    const i64 c = t < types ? counts[t] : 0;
    const i64 n = (c + rows - 1) / rows;
    i64 tiles_incl = hector_warp_scan(n, lane);
    i64 rows_incl = hector_warp_scan(c, lane);
    if (lane == 31) {
      warp_tiles[warp] = tiles_incl;
      warp_rows[warp] = rows_incl;
    }
    __syncthreads();
    if (warp == 0) {  // scan of the warp totals
      const i64 wt = lane < warps ? warp_tiles[lane] : 0;
      const i64 wr = lane < warps ? warp_rows[lane] : 0;
      const i64 st = hector_warp_scan(wt, lane), sr = hector_warp_scan(wr, lane);
      if (lane < warps) {
        warp_tiles[lane] = st - wt;  // exclusive
        warp_rows[lane] = sr - wr;
      }
    }
    __syncthreads();
    const i64 first_tile = base_tile + warp_tiles[warp] + tiles_incl - n;
    const i64 first_row = base_row + warp_rows[warp] + rows_incl - c;
    for (i64 k = 0; k < n && first_tile + k < slots; ++k) {
      const i64 slot = first_tile + k, off = k * rows;
      table[3 * slot] = (int)t;
      table[3 * slot + 1] = (int)(first_row + off);
      table[3 * slot + 2] = (int)(c - off < rows ? c - off : rows);
    }
    __syncthreads();  // every thread has read base_* and warp_* of this chunk
    if (threadIdx.x == blockDim.x - 1) {
      base_tile = first_tile + n;
      base_row = first_row + c;
    }
    __syncthreads();
  }
  const i64 used = base_tile < slots ? base_tile : slots;
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
