// The row-moving kernels, kept apart from their launchers so that a host emulator (tests/cpp/emulate_kernels.cpp)
// can compile them with stand-ins for the CUDA built-ins and run every thread of a grid serially: the kernels use no
// shared memory and no barriers, so serial execution computes what the GPU computes.
#pragma once

#include <cstddef>
#include <cstdint>

#include "pytorch_direct/rows.hpp"

// The emulator defines this to verify every vector access is aligned to its width (the GPU faults otherwise,
// while x86 would not notice); on the device it is nothing.
#ifndef PD_CHECK_ALIGNED
#define PD_CHECK_ALIGNED(pointer, bytes)
#endif

namespace pytorch_direct {
namespace kernels {

template <int V>
struct word;
template <>
struct word<16> {
  using type = uint4;
};
template <>
struct word<8> {
  using type = uint2;
};
template <>
struct word<4> {
  using type = unsigned int;
};
template <>
struct word<2> {
  using type = unsigned short;
};
template <>
struct word<1> {
  using type = unsigned char;
};

// Independent loads in flight per thread before the stores: PCIe latency is ~1-2 us, so bandwidth needs depth.
constexpr int kUnroll = 4;

__device__ __forceinline__ std::int64_t load_index(const void* index, int index_bytes, std::int64_t i) {
  return index_bytes == 8 ? static_cast<const std::int64_t*>(index)[i]
                          : static_cast<std::int64_t>(static_cast<const std::int32_t*>(index)[i]);
}

// How many indices a kernel moves: `count`, or fewer when the count lives in device memory (written by an earlier
// kernel on the same stream, so the host never waits for it).
__device__ __forceinline__ std::int64_t indices_to_move(std::int64_t count, const std::int64_t* device_count) {
  if (device_count == nullptr) return count;
  const std::int64_t n = *device_count;
  return n < count ? n : count;
}

// Records a bad index in the mapped error word (host memory); the row is skipped, never touched.
__device__ __forceinline__ void record_bad_index(std::int64_t* error, std::int64_t bad) {
  volatile std::int64_t* word = error;
  word[1] = bad;
  __threadfence_system();
  word[0] = 1;
}

// Gather (Scatter=false): dense[p] = table[index[i]]; scatter (Scatter=true): table[index[i]] = dense[p].
//
// A group of `1 << group_shift` lanes (1..32, a power of two dividing the warp) moves one row at a time in words
// of V bytes. Rows of at least 128 B start their walk at the 128-byte boundary at or before the row's start in
// host memory, so each warp-wide access covers whole 128-byte lines of the table (the link's transfer unit) and
// a row spills into at most one partial line at each end; lanes before the row start or past its end idle.
// At most 40 registers (3 resident blocks of 512 per SM): the 16-byte variant used 50 (2 blocks), half the rows
// in flight of the 32-register kernels; 32 would spill the loaded words and serialise the loads.
//
// ShortRows (the launch plan's `short_rows`, see plan_gather): every row fits one pass of its group, one word per
// lane, starting at the group's first lane (no head). The group then moves kUnroll rows per pass (their indices,
// their loads, their stores), so each thread keeps kUnroll loads in flight rather than one. Rows of 64 B (4 lanes
// of 16 B) and 128 B (8 lanes) otherwise had one load in flight per thread, behind the latency of its index load:
// on a 1 GiB table of 64 B rows, WholeGraph's host gather (a thread group per row, a grid as large as the rows) ran
// 1.14x faster than this kernel with one row per group per pass (H100). A separate instantiation, with its own
// registers: in the general loop's kernel the extra indices and words spilled.
template <int V, bool Scatter, bool ShortRows = false>
__global__ void __launch_bounds__(512, 3)
    move_rows(unsigned char* __restrict__ table, std::int64_t rows, std::int64_t row_words,
              const void* __restrict__ index, int index_bytes, std::int64_t count,
              const std::int64_t* __restrict__ device_count, const std::int64_t* __restrict__ positions,
              unsigned char* __restrict__ dense, std::int64_t* error, int group_shift) {
  using T = typename word<V>::type;
  const int lanes = 1 << group_shift;
  const int lane = threadIdx.x & (lanes - 1);
  const std::int64_t thread = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::int64_t groups = (static_cast<std::int64_t>(gridDim.x) * blockDim.x) >> group_shift;
  const std::int64_t n = indices_to_move(count, device_count);
  if constexpr (ShortRows) {
    const bool active = lane < row_words;
    for (std::int64_t i0 = thread >> group_shift; i0 < n; i0 += groups * kUnroll) {
      std::int64_t r[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const std::int64_t i = i0 + static_cast<std::int64_t>(k) * groups;
        r[k] = i < n ? load_index(index, index_bytes, i) : -1;
      }
      // Which of the rows are in range, as bits: the gather needs no row number after its load (fewer registers
      // held across the loads' latency; the kernel is capped at 40).
      unsigned valid = 0;
      T buf[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        if (r[k] >= 0 && r[k] < rows) {
          valid |= 1u << k;
          if (active) {
            const std::int64_t i = i0 + static_cast<std::int64_t>(k) * groups;
            const T* src =
                Scatter ? reinterpret_cast<const T*>(dense) + (positions != nullptr ? positions[i] : i) * row_words
                        : reinterpret_cast<const T*>(table) + r[k] * row_words;
            PD_CHECK_ALIGNED(src + lane, V);
            buf[k] = src[lane];
          }
        }
      }
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const std::int64_t i = i0 + static_cast<std::int64_t>(k) * groups;
        if (i >= n) break;
        if (!((valid >> k) & 1u)) {
          if (lane == 0) record_bad_index(error, load_index(index, index_bytes, i));
          continue;
        }
        if (active) {
          T* dst = Scatter ? reinterpret_cast<T*>(table) + r[k] * row_words
                           : reinterpret_cast<T*>(dense) + (positions != nullptr ? positions[i] : i) * row_words;
          PD_CHECK_ALIGNED(dst + lane, V);
          dst[lane] = buf[k];
        }
      }
    }
  } else {
    const bool align_window = static_cast<std::int64_t>(lanes) * V >= 128;
    for (std::int64_t i = thread >> group_shift; i < n; i += groups) {
      const std::int64_t r = load_index(index, index_bytes, i);
      if (r < 0 || r >= rows) {
        if (lane == 0) record_bad_index(error, r);
        continue;
      }
      const std::int64_t p = positions != nullptr ? positions[i] : i;
      T* host = reinterpret_cast<T*>(table) + r * row_words;
      T* dev = reinterpret_cast<T*>(dense) + p * row_words;
      PD_CHECK_ALIGNED(host, V);
      PD_CHECK_ALIGNED(dev, V);
      // Words between the row start and the 128-byte boundary before it (0 when the window is not aligned).
      const std::int64_t head =
          align_window ? static_cast<std::int64_t>((reinterpret_cast<std::uintptr_t>(host) & 127u) / V) : 0;
      for (std::int64_t u = lane - head; u < row_words; u += static_cast<std::int64_t>(lanes) * kUnroll) {
        T buf[kUnroll];
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) {
          const std::int64_t w = u + static_cast<std::int64_t>(k) * lanes;
          if (w >= 0 && w < row_words) buf[k] = Scatter ? dev[w] : host[w];
        }
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) {
          const std::int64_t w = u + static_cast<std::int64_t>(k) * lanes;
          if (w >= 0 && w < row_words) {
            if (Scatter) {
              host[w] = buf[k];
            } else {
              dev[w] = buf[k];
            }
          }
        }
      }
    }
  }
}

// Gather for rows whose width or address is not 4-byte aligned (e.g. 47 B): each lane loads aligned 16-byte
// words covering the row and stores the row's bytes one by one. An aligned 16-byte word never crosses a page,
// and registration and pinned allocation are page-granular, so the bytes outside the row are mapped memory.
__global__ void __launch_bounds__(512)
    gather_rows_unaligned(const unsigned char* __restrict__ table, std::int64_t rows, std::int64_t row_bytes,
                          const void* __restrict__ index, int index_bytes, std::int64_t count,
                          const std::int64_t* __restrict__ device_count, const std::int64_t* __restrict__ positions,
                          unsigned char* __restrict__ dense, std::int64_t* error, int group_shift) {
  const int lanes = 1 << group_shift;
  const int lane = threadIdx.x & (lanes - 1);
  const std::int64_t thread = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::int64_t groups = (static_cast<std::int64_t>(gridDim.x) * blockDim.x) >> group_shift;
  const std::int64_t n = indices_to_move(count, device_count);
  for (std::int64_t i = thread >> group_shift; i < n; i += groups) {
    const std::int64_t r = load_index(index, index_bytes, i);
    if (r < 0 || r >= rows) {
      if (lane == 0) record_bad_index(error, r);
      continue;
    }
    const std::int64_t p = positions != nullptr ? positions[i] : i;
    const std::uintptr_t begin = reinterpret_cast<std::uintptr_t>(table) + static_cast<std::uintptr_t>(r * row_bytes);
    const std::uintptr_t end = begin + static_cast<std::uintptr_t>(row_bytes);
    const std::uintptr_t first = begin & ~static_cast<std::uintptr_t>(15);
    const std::int64_t words = static_cast<std::int64_t>((end - first + 15) / 16);
    unsigned char* out = dense + p * row_bytes;
    for (std::int64_t w = lane; w < words; w += lanes) {
      PD_CHECK_ALIGNED(first + static_cast<std::uintptr_t>(w) * 16, 16);
      const uint4 v = *reinterpret_cast<const uint4*>(first + static_cast<std::uintptr_t>(w) * 16);
      const unsigned char* bytes = reinterpret_cast<const unsigned char*>(&v);
      const std::uintptr_t at = first + static_cast<std::uintptr_t>(w) * 16;
#pragma unroll
      for (int k = 0; k < 16; ++k) {
        const std::uintptr_t a = at + k;
        if (a >= begin && a < end) out[a - begin] = bytes[k];
      }
    }
  }
}

// The baseline of the PyTorch-Direct paper: one warp per row, 4-byte words from the row's own start.
template <int V>
__global__ void __launch_bounds__(512)
    gather_rows_naive(const unsigned char* __restrict__ table, std::int64_t rows, std::int64_t row_words,
                      const void* __restrict__ index, int index_bytes, std::int64_t count,
                      const std::int64_t* __restrict__ device_count, const std::int64_t* __restrict__ positions,
                      unsigned char* __restrict__ dense, std::int64_t* error) {
  using T = typename word<V>::type;
  const int lane = threadIdx.x & 31;
  const std::int64_t warp = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const std::int64_t warps = (static_cast<std::int64_t>(gridDim.x) * blockDim.x) >> 5;
  const std::int64_t n = indices_to_move(count, device_count);
  for (std::int64_t i = warp; i < n; i += warps) {
    const std::int64_t r = load_index(index, index_bytes, i);
    if (r < 0 || r >= rows) {
      if (lane == 0) record_bad_index(error, r);
      continue;
    }
    const std::int64_t p = positions != nullptr ? positions[i] : i;
    const T* src = reinterpret_cast<const T*>(table) + r * row_words;
    T* dst = reinterpret_cast<T*>(dense) + p * row_words;
    PD_CHECK_ALIGNED(src, V);
    PD_CHECK_ALIGNED(dst, V);
    for (std::int64_t w = lane; w < row_words; w += 32) dst[w] = src[w];
  }
}

template <int V>
__global__ void __launch_bounds__(512)
    scatter_rows_naive(unsigned char* __restrict__ table, std::int64_t rows, std::int64_t row_words,
                       const void* __restrict__ index, int index_bytes, std::int64_t count,
                       const std::int64_t* __restrict__ device_count, const std::int64_t* __restrict__ positions,
                       const unsigned char* __restrict__ dense, std::int64_t* error) {
  using T = typename word<V>::type;
  const int lane = threadIdx.x & 31;
  const std::int64_t warp = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const std::int64_t warps = (static_cast<std::int64_t>(gridDim.x) * blockDim.x) >> 5;
  const std::int64_t n = indices_to_move(count, device_count);
  for (std::int64_t i = warp; i < n; i += warps) {
    const std::int64_t r = load_index(index, index_bytes, i);
    if (r < 0 || r >= rows) {
      if (lane == 0) record_bad_index(error, r);
      continue;
    }
    const std::int64_t p = positions != nullptr ? positions[i] : i;
    T* dst = reinterpret_cast<T*>(table) + r * row_words;
    const T* src = reinterpret_cast<const T*>(dense) + p * row_words;
    PD_CHECK_ALIGNED(src, V);
    PD_CHECK_ALIGNED(dst, V);
    for (std::int64_t w = lane; w < row_words; w += 32) dst[w] = src[w];
  }
}

// Gather through a GPU cache of hot rows (Refresh=false): dense[p] = the cached copy of row r = index[i] where
// slot_of_row[r] >= 0 (device memory), else row r of the host table read zero-copy. Refresh=true, after writes to
// the table: the cached copy of each cached row r = index[i] is read again from the table (p unused; rows that are
// not cached are skipped, and so are bad indices: the write that preceded recorded them already).
// The walk is move_rows's (lane groups, 128-byte windows aligned on the source: the host row on a miss, the cache
// row on a hit; V divides the row width and every base address).
template <int V, bool Refresh>
__global__ void __launch_bounds__(512, 3)
    move_rows_cached(const unsigned char* __restrict__ table, std::int64_t rows, std::int64_t row_words,
                     const void* __restrict__ index, int index_bytes, std::int64_t count,
                     const std::int64_t* __restrict__ positions, const std::int32_t* __restrict__ slot_of_row,
                     unsigned char* __restrict__ cache, unsigned char* __restrict__ dense, std::int64_t* error,
                     int group_shift) {
  using T = typename word<V>::type;
  const int lanes = 1 << group_shift;
  const int lane = threadIdx.x & (lanes - 1);
  const std::int64_t thread = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::int64_t groups = (static_cast<std::int64_t>(gridDim.x) * blockDim.x) >> group_shift;
  const bool align_window = static_cast<std::int64_t>(lanes) * V >= 128;
  for (std::int64_t i = thread >> group_shift; i < count; i += groups) {
    const std::int64_t r = load_index(index, index_bytes, i);
    if (r < 0 || r >= rows) {
      if (!Refresh && lane == 0) record_bad_index(error, r);
      continue;
    }
    const std::int32_t slot = slot_of_row[r];
    if (Refresh && slot < 0) continue;
    const T* src;
    T* dst;
    if (Refresh) {
      src = reinterpret_cast<const T*>(table) + r * row_words;
      dst = reinterpret_cast<T*>(cache) + static_cast<std::int64_t>(slot) * row_words;
    } else {
      const std::int64_t p = positions != nullptr ? positions[i] : i;
      src = slot >= 0 ? reinterpret_cast<const T*>(cache) + static_cast<std::int64_t>(slot) * row_words
                      : reinterpret_cast<const T*>(table) + r * row_words;
      dst = reinterpret_cast<T*>(dense) + p * row_words;
    }
    PD_CHECK_ALIGNED(src, V);
    PD_CHECK_ALIGNED(dst, V);
    const std::int64_t head =
        align_window ? static_cast<std::int64_t>((reinterpret_cast<std::uintptr_t>(src) & 127u) / V) : 0;
    for (std::int64_t u = lane - head; u < row_words; u += static_cast<std::int64_t>(lanes) * kUnroll) {
      T buf[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const std::int64_t w = u + static_cast<std::int64_t>(k) * lanes;
        if (w >= 0 && w < row_words) buf[k] = src[w];
      }
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const std::int64_t w = u + static_cast<std::int64_t>(k) * lanes;
        if (w >= 0 && w < row_words) dst[w] = buf[k];
      }
    }
  }
}

// move_rows_cached for rows whose width or address is not 4-byte aligned: aligned 16-byte loads covering the
// source row, byte stores (as gather_rows_unaligned). The cache buffer has 16 bytes of slack after its last row, so
// the last load of a cached row stays inside it.
template <bool Refresh>
__global__ void __launch_bounds__(512)
    move_rows_cached_unaligned(const unsigned char* __restrict__ table, std::int64_t rows, std::int64_t row_bytes,
                               const void* __restrict__ index, int index_bytes, std::int64_t count,
                               const std::int64_t* __restrict__ positions, const std::int32_t* __restrict__ slot_of_row,
                               unsigned char* __restrict__ cache, unsigned char* __restrict__ dense,
                               std::int64_t* error, int group_shift) {
  const int lanes = 1 << group_shift;
  const int lane = threadIdx.x & (lanes - 1);
  const std::int64_t thread = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::int64_t groups = (static_cast<std::int64_t>(gridDim.x) * blockDim.x) >> group_shift;
  for (std::int64_t i = thread >> group_shift; i < count; i += groups) {
    const std::int64_t r = load_index(index, index_bytes, i);
    if (r < 0 || r >= rows) {
      if (!Refresh && lane == 0) record_bad_index(error, r);
      continue;
    }
    const std::int32_t slot = slot_of_row[r];
    if (Refresh && slot < 0) continue;
    std::uintptr_t begin;
    unsigned char* out;
    if (Refresh) {
      begin = reinterpret_cast<std::uintptr_t>(table) + static_cast<std::uintptr_t>(r * row_bytes);
      out = cache + static_cast<std::int64_t>(slot) * row_bytes;
    } else {
      const std::int64_t p = positions != nullptr ? positions[i] : i;
      begin = slot >= 0 ? reinterpret_cast<std::uintptr_t>(cache) +
                              static_cast<std::uintptr_t>(static_cast<std::int64_t>(slot) * row_bytes)
                        : reinterpret_cast<std::uintptr_t>(table) + static_cast<std::uintptr_t>(r * row_bytes);
      out = dense + p * row_bytes;
    }
    const std::uintptr_t end = begin + static_cast<std::uintptr_t>(row_bytes);
    const std::uintptr_t first = begin & ~static_cast<std::uintptr_t>(15);
    const std::int64_t words = static_cast<std::int64_t>((end - first + 15) / 16);
    for (std::int64_t w = lane; w < words; w += lanes) {
      const std::uintptr_t at = first + static_cast<std::uintptr_t>(w) * 16;
      PD_CHECK_ALIGNED(at, 16);
      const uint4 v = *reinterpret_cast<const uint4*>(at);
      const unsigned char* bytes = reinterpret_cast<const unsigned char*>(&v);
#pragma unroll
      for (int k = 0; k < 16; ++k) {
        const std::uintptr_t a = at + k;
        if (a >= begin && a < end) out[a - begin] = bytes[k];
      }
    }
  }
}

// Widest power of two <= limit dividing the row width and both base addresses.
inline int access_width(const rows_call& c, int limit) {
  int v = limit;
  const auto t = reinterpret_cast<std::uintptr_t>(c.table);
  const auto d = reinterpret_cast<std::uintptr_t>(c.dense);
  while (v > 1 && (c.row_bytes % v != 0 || t % v != 0 || d % v != 0)) v /= 2;
  return v;
}

// Lanes per row (a power of two <= 32, as log2). Without unrolling: one word per lane per row. Unrolled (the
// vector kernel, kUnroll words per lane per pass): the fewest lanes whose pass still covers the row, but never an
// access narrower than one 128-byte line per row once the row has that many words. Fewer lanes per row means more
// rows in flight per warp: at low density every row is a separate page walk and PCIe round trip, and rows in
// flight, not bytes in flight, bounded 512 B - 1 KB rows on the H200 (the naive kernel, with twice the resident
// warps, beat one-row-per-warp vector loads there).
inline int group_shift_for(std::int64_t row_words, int width = 16, bool unrolled = false) {
  int shift = 0;
  for (; shift < 5; ++shift) {
    const std::int64_t lanes = static_cast<std::int64_t>(1) << shift;
    if (lanes >= row_words) break;
    if (!unrolled) continue;
    const bool covers = lanes * kUnroll >= row_words;
    const bool whole_lines = lanes * width >= 128;
    if (covers && whole_lines) break;
  }
  return shift;
}

// Which kernel moves a call's rows, at what access width and lane-group size. Shared by the launchers and the
// emulator, so the emulated tests exercise the exact choices the GPU path makes.
struct launch_plan {
  enum kernel_t { vector, unaligned, naive } kernel = vector;
  int width = 1;               // bytes per access (vector, naive)
  int group_shift = 0;         // log2 lanes per row (vector, unaligned); naive always uses 32 lanes
  std::int64_t row_words = 0;  // row_bytes / width (vector, naive)
  bool short_rows = false;     // vector: move_rows<..., ShortRows=true> (each row one word per lane, no head)
};

// Whether the vector plan `p` of call `c` moves each row with one word per lane from the group's first lane: the
// row fits the group, and no row starts inside a 128-byte window the group aligns to (table and row width
// multiples of 128 B where the window is aligned at all).
inline bool short_rows_for(const rows_call& c, const launch_plan& p) {
  const std::int64_t lanes = static_cast<std::int64_t>(1) << p.group_shift;
  if (p.row_words > lanes) return false;
  if (lanes * p.width < 128) return true;
  return ((reinterpret_cast<std::uintptr_t>(c.table) | static_cast<std::uintptr_t>(c.row_bytes)) & 127u) == 0;
}

inline launch_plan plan_gather(const rows_call& c, kernel_kind kind) {
  launch_plan p;
  if (kind == kernel_kind::naive) {
    p.kernel = launch_plan::naive;
    p.width = access_width(c, 4) == 4 ? 4 : 1;
    p.group_shift = 5;
  } else {
    p.width = access_width(c, 16);
    if (p.width < 4 && c.row_bytes >= 16) {
      // Narrow accesses would multiply the link's requests: load aligned 16-byte words, store bytes.
      p.kernel = launch_plan::unaligned;
      p.group_shift = group_shift_for((c.row_bytes + 31) / 16);
      return p;
    }
    p.kernel = launch_plan::vector;
    p.group_shift = group_shift_for(c.row_bytes / p.width, p.width, true);
  }
  p.row_words = c.row_bytes / p.width;
  p.short_rows = p.kernel == launch_plan::vector && short_rows_for(c, p);
  return p;
}

// The cached gather (and refresh): the vector kernel's choices with the cache buffer's address in the width, or the
// unaligned kernel where that width is below 4 bytes.
inline launch_plan plan_cached(const rows_call& c) {
  launch_plan p;
  int v = access_width(c, 16);
  while (v > 1 && reinterpret_cast<std::uintptr_t>(c.cache) % v != 0) v /= 2;
  p.width = v;
  if (v < 4 && c.row_bytes >= 16) {
    p.kernel = launch_plan::unaligned;
    p.group_shift = group_shift_for((c.row_bytes + 31) / 16);
    return p;
  }
  p.kernel = launch_plan::vector;
  p.group_shift = group_shift_for(c.row_bytes / p.width, p.width, true);
  p.row_words = c.row_bytes / p.width;
  return p;
}

// Scatter never uses the unaligned kernel: a wider read-modify-write of host memory would race with the writer of
// the neighbouring row, so odd widths store bytes.
inline launch_plan plan_scatter(const rows_call& c, kernel_kind kind) {
  launch_plan p;
  if (kind == kernel_kind::naive) {
    p.kernel = launch_plan::naive;
    p.width = access_width(c, 4) == 4 ? 4 : 1;
    p.group_shift = 5;
  } else {
    p.kernel = launch_plan::vector;
    p.width = access_width(c, 16);
    p.group_shift = group_shift_for(c.row_bytes / p.width, p.width, true);
  }
  p.row_words = c.row_bytes / p.width;
  p.short_rows = p.kernel == launch_plan::vector && short_rows_for(c, p);
  return p;
}

// The launch configuration of a plan: 1-D grid, kBlockThreads threads per block (the kernels'
// __launch_bounds__), no dynamic shared memory. Enough blocks for every row group, at most the blocks one SM holds
// at once (`blocks_per_sm`, from the occupancy calculator; grid-stride beyond), or `max_sms` blocks when capped: one
// block per SM is how the block scheduler spreads a grid that small. Shared with the emulator, which checks every shape
// against the hardware limits below.
constexpr int kBlockThreads = 512;

struct launch_shape {
  unsigned grid_x = 1, grid_y = 1, grid_z = 1;
  unsigned block = kBlockThreads;
  std::size_t shared_bytes = 0;
};

inline launch_shape shape_for(const launch_plan& p, std::int64_t count, int max_sms, int multiprocessors,
                              int blocks_per_sm) {
  launch_shape s;
  const int shift = p.kernel == launch_plan::naive ? 5 : p.group_shift;
  const std::int64_t groups_per_block = kBlockThreads >> shift;
  std::int64_t blocks = (count + groups_per_block - 1) / groups_per_block;
  // One wave of resident blocks: a grid of more blocks than fit would run its last ones on a mostly idle GPU.
  const std::int64_t limit =
      max_sms > 0 ? max_sms : static_cast<std::int64_t>(multiprocessors) * (blocks_per_sm > 0 ? blocks_per_sm : 1);
  blocks = blocks < limit ? blocks : limit;
  blocks = blocks < 1 ? 1 : blocks;
  blocks = blocks < 0x7fffffff ? blocks : 0x7fffffff;
  s.grid_x = static_cast<unsigned>(blocks);
  return s;
}

// Empty when the shape is launchable without opt-ins (cudaLaunchKernel would fail with "invalid argument"
// otherwise); else what is wrong.
inline const char* launch_shape_problem(const launch_shape& s) {
  if (s.grid_x < 1 || s.grid_x > 0x7fffffffu) return "grid.x outside 1..2^31-1";
  if (s.grid_y < 1 || s.grid_y > 65535 || s.grid_z < 1 || s.grid_z > 65535) return "grid.y/z outside 1..65535";
  if (s.block < 1 || s.block > 1024 || s.block % 32 != 0) return "block not a multiple of 32 in 32..1024";
  if (s.block > static_cast<unsigned>(kBlockThreads)) return "block above the kernels' __launch_bounds__";
  if (s.shared_bytes > 48 * 1024) return "dynamic shared memory above 48 KiB without an opt-in";
  return "";
}

}  // namespace kernels
}  // namespace pytorch_direct
