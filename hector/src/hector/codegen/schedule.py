"""The one fixed kernel of the CUDA backend: it writes a segment GEMM's tile schedule from per-type row counts.

Built with torch ops, a schedule took ~20 small operations per (domain, types, tile rows); a mini-batch layer needs
four schedules, each graph new, so that was ~80 launches of host time per training step. This kernel is one
launch. The per-type counts stay on the GPU, so nothing is read on the host either. Its threads take one type each
(a block-wide scan places their tiles): a model with thousands of relations does not make one thread walk them all;
and they write the tiles one slot each: a relation of millions of edges does not make one thread write its
thousands of tiles (a 16M-edge graph's schedule took ~0.5 ms on an H100 while each thread wrote its own type's).
"""

from .common import ModuleCode

KERNEL = "hector_tile_schedule"
SIGNATURE = "ptr, i64, i64, i64, ptr"  # counts, types, rows per tile, slots, table
BLOCK = 256  # a multiple of 32 (warp scans), at most 1024

# the block size sizes the kernel's shared arrays of one entry per thread
SOURCE = f"#define HECTOR_SCHEDULE_BLOCK {BLOCK}\n" + r"""
// hector: tile schedule of a segment GEMM (runtime support, not generated)
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
// tile and row counts gives the type its first slot and first row, and then the block writes the chunk's tiles
// together, one slot per thread (its type found by binary search in the chunk's first slots, in shared memory):
// a type of millions of rows is many tiles, which one thread writing its own type's would walk alone while the
// block waited. blockDim.x must be a multiple of 32, at most HECTOR_SCHEDULE_BLOCK.
extern "C" __global__ void hector_tile_schedule(const i64* __restrict__ counts, i64 types, i64 rows, i64 slots,
                                                int* __restrict__ table) {
  __shared__ i64 warp_tiles[32], warp_rows[32];
  __shared__ i64 first_tile_of[HECTOR_SCHEDULE_BLOCK], first_row_of[HECTOR_SCHEDULE_BLOCK],
      count_of[HECTOR_SCHEDULE_BLOCK];
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
    first_tile_of[threadIdx.x] = first_tile;
    first_row_of[threadIdx.x] = first_row;
    count_of[threadIdx.x] = c;
    __syncthreads();  // every thread has read base_* and warp_* of this chunk, and written its type's entry
    const unsigned last = blockDim.x - 1;
    const i64 end = first_tile_of[last] + (count_of[last] + rows - 1) / rows;  // past the chunk's last tile
    for (i64 s = first_tile_of[0] + threadIdx.x; s < end && s < slots; s += blockDim.x) {
      // the chunk's last type whose first slot is at or before s: the type of tile s (empty types share their
      // first slot with the next type, so the last of equal first slots is the one with tiles)
      unsigned lo = 0, hi = last;
      while (lo < hi) {
        const unsigned mid = (lo + hi + 1) >> 1;
        if (first_tile_of[mid] <= s)
          lo = mid;
        else
          hi = mid - 1;
      }
      const i64 off = (s - first_tile_of[lo]) * rows, left = count_of[lo] - off;
      table[3 * s] = (int)(start + lo);
      table[3 * s + 1] = (int)(first_row_of[lo] + off);
      table[3 * s + 2] = (int)(left < rows ? left : rows);
    }
    if (threadIdx.x == last) {
      base_tile = end;
      base_row = first_row + c;
    }
    __syncthreads();  // base_* written, and the chunk's entries read, before the next chunk's
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
