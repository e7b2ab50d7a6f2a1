// CUDA kernels that move rows between a mapped host table and dense device buffers.
//
// One translation unit, few instantiations: kernels are templated on the access width in bytes (16, 8, 4, 2, 1),
// never on the dtype, and the index width (int32/int64) is a uniform run-time branch.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <vector>

#include "pytorch_direct/rows.hpp"
#include "shared_cuda/error.hpp"

namespace pytorch_direct {
namespace {

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
template <int V, bool Scatter>
__global__ void __launch_bounds__(512) move_rows(unsigned char* __restrict__ table, std::int64_t rows,
                                                 std::int64_t row_words, const void* __restrict__ index,
                                                 int index_bytes, std::int64_t count,
                                                 const std::int64_t* __restrict__ positions,
                                                 unsigned char* __restrict__ dense, std::int64_t* error,
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
      if (lane == 0) record_bad_index(error, r);
      continue;
    }
    const std::int64_t p = positions != nullptr ? positions[i] : i;
    T* host = reinterpret_cast<T*>(table) + r * row_words;
    T* dev = reinterpret_cast<T*>(dense) + p * row_words;
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

// Gather for rows whose width or address is not 4-byte aligned (e.g. 47 B): each lane loads aligned 16-byte
// words covering the row and stores the row's bytes one by one. An aligned 16-byte word never crosses a page,
// and registration and pinned allocation are page-granular, so the bytes outside the row are mapped memory.
__global__ void __launch_bounds__(512) gather_rows_unaligned(const unsigned char* __restrict__ table,
                                                             std::int64_t rows, std::int64_t row_bytes,
                                                             const void* __restrict__ index, int index_bytes,
                                                             std::int64_t count,
                                                             const std::int64_t* __restrict__ positions,
                                                             unsigned char* __restrict__ dense, std::int64_t* error,
                                                             int group_shift) {
  const int lanes = 1 << group_shift;
  const int lane = threadIdx.x & (lanes - 1);
  const std::int64_t thread = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::int64_t groups = (static_cast<std::int64_t>(gridDim.x) * blockDim.x) >> group_shift;
  for (std::int64_t i = thread >> group_shift; i < count; i += groups) {
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
__global__ void __launch_bounds__(512) gather_rows_naive(const unsigned char* __restrict__ table, std::int64_t rows,
                                                         std::int64_t row_words, const void* __restrict__ index,
                                                         int index_bytes, std::int64_t count,
                                                         const std::int64_t* __restrict__ positions,
                                                         unsigned char* __restrict__ dense, std::int64_t* error) {
  using T = typename word<V>::type;
  const int lane = threadIdx.x & 31;
  const std::int64_t warp = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const std::int64_t warps = (static_cast<std::int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (std::int64_t i = warp; i < count; i += warps) {
    const std::int64_t r = load_index(index, index_bytes, i);
    if (r < 0 || r >= rows) {
      if (lane == 0) record_bad_index(error, r);
      continue;
    }
    const std::int64_t p = positions != nullptr ? positions[i] : i;
    const T* src = reinterpret_cast<const T*>(table) + r * row_words;
    T* dst = reinterpret_cast<T*>(dense) + p * row_words;
    for (std::int64_t w = lane; w < row_words; w += 32) dst[w] = src[w];
  }
}

template <int V>
__global__ void __launch_bounds__(512) scatter_rows_naive(unsigned char* __restrict__ table, std::int64_t rows,
                                                          std::int64_t row_words, const void* __restrict__ index,
                                                          int index_bytes, std::int64_t count,
                                                          const std::int64_t* __restrict__ positions,
                                                          const unsigned char* __restrict__ dense,
                                                          std::int64_t* error) {
  using T = typename word<V>::type;
  const int lane = threadIdx.x & 31;
  const std::int64_t warp = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const std::int64_t warps = (static_cast<std::int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (std::int64_t i = warp; i < count; i += warps) {
    const std::int64_t r = load_index(index, index_bytes, i);
    if (r < 0 || r >= rows) {
      if (lane == 0) record_bad_index(error, r);
      continue;
    }
    const std::int64_t p = positions != nullptr ? positions[i] : i;
    T* dst = reinterpret_cast<T*>(table) + r * row_words;
    const T* src = reinterpret_cast<const T*>(dense) + p * row_words;
    for (std::int64_t w = lane; w < row_words; w += 32) dst[w] = src[w];
  }
}

// Widest power of two <= limit dividing the row width and both base addresses.
int access_width(const rows_call& c, int limit) {
  int v = limit;
  const auto t = reinterpret_cast<std::uintptr_t>(c.table);
  const auto d = reinterpret_cast<std::uintptr_t>(c.dense);
  while (v > 1 && (c.row_bytes % v != 0 || t % v != 0 || d % v != 0)) v /= 2;
  return v;
}

// Smallest power-of-two lane group (<= 32) with one word per lane per row, so a warp's access stays contiguous
// per row (small rows: several rows per warp, each read by neighbouring lanes in whole sectors).
int group_shift_for(std::int64_t row_words) {
  int shift = 0;
  while (shift < 5 && (static_cast<std::int64_t>(1) << shift) < row_words) ++shift;
  return shift;
}

int multiprocessors() {
  static std::mutex mutex;
  static std::vector<int> cache;
  int device = 0;
  SHARED_CUDA_TRY(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  if (static_cast<int>(cache.size()) <= device) cache.resize(device + 1, 0);
  if (cache[device] == 0) SHARED_CUDA_TRY(cudaDeviceGetAttribute(&cache[device], cudaDevAttrMultiProcessorCount, device));
  return cache[device];
}

constexpr int kBlock = 512;

// Enough blocks for every row group, at most 4 resident blocks per SM (grid-stride beyond), or `max_sms` blocks
// when capped: one block per SM is how the block scheduler spreads a grid that small.
unsigned grid_for(std::int64_t count, int group_shift, int max_sms) {
  const std::int64_t groups_per_block = kBlock >> group_shift;
  std::int64_t blocks = (count + groups_per_block - 1) / groups_per_block;
  const std::int64_t limit = max_sms > 0 ? max_sms : static_cast<std::int64_t>(multiprocessors()) * 4;
  blocks = std::max<std::int64_t>(1, std::min(blocks, limit));
  return static_cast<unsigned>(blocks);
}

template <bool Scatter>
void launch_vector(const rows_call& c, int v, int max_sms, cudaStream_t s) {
  auto* table = static_cast<unsigned char*>(c.table);
  auto* dense = static_cast<unsigned char*>(c.dense);
  const std::int64_t words = c.row_bytes / v;
  const int shift = group_shift_for(words);
  const unsigned grid = grid_for(c.count, shift, max_sms);
  std::int64_t* err = error_word();
#define PD_LAUNCH(W)                                                                                           \
  move_rows<W, Scatter><<<grid, kBlock, 0, s>>>(table, c.rows, words, c.index, c.index_bytes, c.count,         \
                                                c.positions, dense, err, shift)
  switch (v) {
    case 16: PD_LAUNCH(16); break;
    case 8: PD_LAUNCH(8); break;
    case 4: PD_LAUNCH(4); break;
    case 2: PD_LAUNCH(2); break;
    default: PD_LAUNCH(1); break;
  }
#undef PD_LAUNCH
}

void check_call(const rows_call& c) {
  SHARED_CUDA_EXPECT(c.index_bytes == 4 || c.index_bytes == 8, "index must be int32 or int64");
  SHARED_CUDA_EXPECT(c.row_bytes > 0 && c.rows >= 0 && c.count >= 0, "rows, row_bytes and count must be >= 0");
  SHARED_CUDA_EXPECT(c.count == 0 || (c.table != nullptr && c.index != nullptr && c.dense != nullptr),
                     "null table, index or dense pointer");
}

}  // namespace

bool kernels_compiled() noexcept { return true; }

std::int64_t* error_word() {
  // Mapped pinned memory: kernels write it over PCIe, the host reads it without any CUDA call.
  static std::once_flag once;
  static std::int64_t* word = nullptr;
  std::call_once(once, [] {
    void* p = nullptr;
    SHARED_CUDA_TRY(cudaHostAlloc(&p, 2 * sizeof(std::int64_t), cudaHostAllocPortable | cudaHostAllocMapped));
    word = static_cast<std::int64_t*>(p);
    word[0] = 0;
    word[1] = 0;
  });
  return word;
}

bool take_device_error(std::int64_t& bad) {
  std::int64_t* w = error_word();
  volatile std::int64_t* v = w;
  if (v[0] == 0) return false;
  bad = v[1];
  v[0] = 0;
  return true;
}

void gather_cuda(const rows_call& c, kernel_kind kind, int max_sms, shared_cuda::stream_view stream) {
  check_call(c);
  if (c.count == 0) return;
  auto s = static_cast<cudaStream_t>(stream.handle);
  auto* table = static_cast<const unsigned char*>(c.table);
  auto* dense = static_cast<unsigned char*>(c.dense);
  if (kind == kernel_kind::naive) {
    const int v = access_width(c, 4);
    const unsigned grid = grid_for(c.count, 5, max_sms);
    if (v == 4) {
      gather_rows_naive<4><<<grid, kBlock, 0, s>>>(table, c.rows, c.row_bytes / 4, c.index, c.index_bytes, c.count,
                                                   c.positions, dense, error_word());
    } else {
      gather_rows_naive<1><<<grid, kBlock, 0, s>>>(table, c.rows, c.row_bytes, c.index, c.index_bytes, c.count,
                                                   c.positions, dense, error_word());
    }
  } else {
    const int v = access_width(c, 16);
    if (v < 4 && c.row_bytes >= 16) {
      const int shift = group_shift_for((c.row_bytes + 31) / 16);
      const unsigned grid = grid_for(c.count, shift, max_sms);
      gather_rows_unaligned<<<grid, kBlock, 0, s>>>(table, c.rows, c.row_bytes, c.index, c.index_bytes, c.count,
                                                    c.positions, dense, error_word(), shift);
    } else {
      launch_vector<false>(c, v, max_sms, s);
    }
  }
  SHARED_CUDA_TRY(cudaGetLastError());
}

void scatter_cuda(const rows_call& c, kernel_kind kind, int max_sms, shared_cuda::stream_view stream) {
  check_call(c);
  if (c.count == 0) return;
  auto s = static_cast<cudaStream_t>(stream.handle);
  if (kind == kernel_kind::naive) {
    const int v = access_width(c, 4);
    const unsigned grid = grid_for(c.count, 5, max_sms);
    auto* table = static_cast<unsigned char*>(c.table);
    auto* dense = static_cast<const unsigned char*>(c.dense);
    if (v == 4) {
      scatter_rows_naive<4><<<grid, kBlock, 0, s>>>(table, c.rows, c.row_bytes / 4, c.index, c.index_bytes,
                                                    c.count, c.positions, dense, error_word());
    } else {
      scatter_rows_naive<1><<<grid, kBlock, 0, s>>>(table, c.rows, c.row_bytes, c.index, c.index_bytes, c.count,
                                                    c.positions, dense, error_word());
    }
  } else {
    // Odd widths store bytes: a wider read-modify-write would race with the neighbouring row's writer.
    launch_vector<true>(c, access_width(c, 16), max_sms, s);
  }
  SHARED_CUDA_TRY(cudaGetLastError());
}

bool is_device_accessible_host(const void* data, std::size_t bytes) {
  if (bytes == 0) return true;
  const unsigned char* ends[2] = {static_cast<const unsigned char*>(data),
                                  static_cast<const unsigned char*>(data) + bytes - 1};
  for (const unsigned char* p : ends) {
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
      cudaGetLastError();  // clear the sticky-free error state of the runtime call
      return false;
    }
    if (a.type != cudaMemoryTypeHost) return false;
  }
  return true;
}

}  // namespace pytorch_direct
