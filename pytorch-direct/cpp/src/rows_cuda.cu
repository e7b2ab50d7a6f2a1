// CUDA kernels that move rows between a mapped host table and dense device buffers.
//
// One translation unit, few instantiations: kernels are templated on the access width in bytes (16, 8, 4, 2, 1),
// never on the dtype, and the index width (int32/int64) is a uniform run-time branch.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "pytorch_direct/rows.hpp"
#include "rows_kernels.cuh"
#include "shared_cuda/error.hpp"

namespace pytorch_direct {
namespace {

using namespace kernels;

int multiprocessors() {
  static std::mutex mutex;
  static std::vector<int> cache;
  int device = 0;
  SHARED_CUDA_TRY(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  if (static_cast<int>(cache.size()) <= device) cache.resize(device + 1, 0);
  if (cache[device] == 0)
    SHARED_CUDA_TRY(cudaDeviceGetAttribute(&cache[device], cudaDevAttrMultiProcessorCount, device));
  return cache[device];
}

// Blocks of `kernel` that one SM holds at once (its registers decide), per device; cached.
int resident_blocks(const void* kernel) {
  static std::mutex mutex;
  static std::map<std::pair<int, const void*>, int> cache;
  int device = 0;
  SHARED_CUDA_TRY(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  int& blocks = cache[{device, kernel}];
  if (blocks == 0) {
    SHARED_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kBlockThreads, 0));
    blocks = std::max(blocks, 1);
  }
  return blocks;
}

// Launches `kernel` with the shape of plan `p` for `count` rows.
template <typename... Params, typename... Args>
void go(void (*kernel)(Params...), const launch_plan& p, std::int64_t count, int max_sms, cudaStream_t s,
        Args... args) {
  const launch_shape shape =
      shape_for(p, count, max_sms, multiprocessors(), resident_blocks(reinterpret_cast<const void*>(kernel)));
  const char* problem = launch_shape_problem(shape);
  SHARED_CUDA_EXPECT(problem[0] == '\0', std::string("internal error, unlaunchable kernel shape: ") + problem);
  const dim3 grid(shape.grid_x, shape.grid_y, shape.grid_z);
  kernel<<<grid, shape.block, shape.shared_bytes, s>>>(args...);
}

// Launches the kernel `p` names. Gather: table -> dense; scatter: dense -> table.
template <bool Scatter>
void launch(const rows_call& c, const launch_plan& p, int max_sms, cudaStream_t s) {
  auto* table = static_cast<unsigned char*>(c.table);
  auto* dense = static_cast<unsigned char*>(c.dense);
  std::int64_t* err = error_word();
  const std::int64_t n = c.count;
  if (p.kernel == launch_plan::unaligned) {
    go(gather_rows_unaligned, p, n, max_sms, s, table, c.rows, c.row_bytes, c.index, c.index_bytes, n, c.device_count,
       c.positions, dense, err, p.group_shift);
  } else if (p.kernel == launch_plan::naive) {
    if constexpr (Scatter) {
      auto kernel = p.width == 4 ? scatter_rows_naive<4> : scatter_rows_naive<1>;
      go(kernel, p, n, max_sms, s, table, c.rows, p.row_words, c.index, c.index_bytes, n, c.device_count, c.positions,
         dense, err);
    } else {
      auto kernel = p.width == 4 ? gather_rows_naive<4> : gather_rows_naive<1>;
      go(kernel, p, n, max_sms, s, table, c.rows, p.row_words, c.index, c.index_bytes, n, c.device_count, c.positions,
         dense, err);
    }
  } else {
    const bool sr = p.short_rows;
    auto kernel = sr ? move_rows<1, Scatter, true> : move_rows<1, Scatter>;
    switch (p.width) {
      case 16:
        kernel = sr ? move_rows<16, Scatter, true> : move_rows<16, Scatter>;
        break;
      case 8:
        kernel = sr ? move_rows<8, Scatter, true> : move_rows<8, Scatter>;
        break;
      case 4:
        kernel = sr ? move_rows<4, Scatter, true> : move_rows<4, Scatter>;
        break;
      case 2:
        kernel = sr ? move_rows<2, Scatter, true> : move_rows<2, Scatter>;
        break;
      default:
        break;
    }
    go(kernel, p, n, max_sms, s, table, c.rows, p.row_words, c.index, c.index_bytes, n, c.device_count, c.positions,
       dense, err, p.group_shift);
  }
}

// Launches the cached gather (or refresh) plan `p` names.
template <bool Refresh>
void launch_cached(const rows_call& c, const launch_plan& p, int max_sms, cudaStream_t s) {
  const auto* table = static_cast<const unsigned char*>(c.table);
  auto* cache = static_cast<unsigned char*>(c.cache);
  auto* dense = static_cast<unsigned char*>(c.dense);
  std::int64_t* err = error_word();
  const std::int64_t n = c.count;
  if (p.kernel == launch_plan::unaligned) {
    go(move_rows_cached_unaligned<Refresh>, p, n, max_sms, s, table, c.rows, c.row_bytes, c.index, c.index_bytes, n,
       c.positions, c.slot_of_row, cache, dense, err, p.group_shift);
    return;
  }
  auto kernel = move_rows_cached<1, Refresh>;
  switch (p.width) {
    case 16:
      kernel = move_rows_cached<16, Refresh>;
      break;
    case 8:
      kernel = move_rows_cached<8, Refresh>;
      break;
    case 4:
      kernel = move_rows_cached<4, Refresh>;
      break;
    case 2:
      kernel = move_rows_cached<2, Refresh>;
      break;
    default:
      break;
  }
  go(kernel, p, n, max_sms, s, table, c.rows, p.row_words, c.index, c.index_bytes, n, c.positions, c.slot_of_row, cache,
     dense, err, p.group_shift);
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

namespace {

constexpr int kBoundsThreads = 256;
constexpr int kBoundsMaxBlocks = 2 * kBoundsThreads;  // the last block reduces the partials with 2 per thread
constexpr std::int64_t kBoundsPerThread = 4;          // indices per thread at least: fewer blocks for small counts

// The block's smallest and largest of each thread's (lo, hi), valid in thread 0; every thread must call it.
__device__ void block_min_max(long long& lo, long long& hi) {
  for (int offset = 16; offset > 0; offset /= 2) {
    const long long l = __shfl_down_sync(0xffffffffu, lo, offset);
    const long long h = __shfl_down_sync(0xffffffffu, hi, offset);
    lo = l < lo ? l : lo;
    hi = h > hi ? h : hi;
  }
  __shared__ long long warp_lo[kBoundsThreads / 32];
  __shared__ long long warp_hi[kBoundsThreads / 32];
  __syncthreads();  // (a previous call's readers are done with the arrays)
  if (threadIdx.x % 32 == 0) {
    warp_lo[threadIdx.x / 32] = lo;
    warp_hi[threadIdx.x / 32] = hi;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kBoundsThreads / 32; ++w) {
      lo = warp_lo[w] < lo ? warp_lo[w] : lo;
      hi = warp_hi[w] > hi ? warp_hi[w] : hi;
    }
  }
}

// Block b writes its (min, max) to partial[2b..2b+1]; the last block to finish (the `done` counter) reduces them into
// result (mapped pinned memory) and zeroes the counter for the next launch.
template <typename Index>
__global__ void __launch_bounds__(kBoundsThreads)
    index_bounds_kernel(const Index* __restrict__ index, std::int64_t count, long long* partial, unsigned* done,
                        long long* result) {
  long long lo = LLONG_MAX;
  long long hi = LLONG_MIN;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    const long long v = static_cast<long long>(index[i]);
    lo = v < lo ? v : lo;
    hi = v > hi ? v : hi;
  }
  block_min_max(lo, hi);
  __shared__ bool last;
  if (threadIdx.x == 0) {
    partial[2 * blockIdx.x] = lo;
    partial[2 * blockIdx.x + 1] = hi;
    __threadfence();  // the partials are visible before the counter says so
    last = atomicAdd(done, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  const volatile long long* all = partial;
  lo = LLONG_MAX;
  hi = LLONG_MIN;
  for (unsigned b = threadIdx.x; b < gridDim.x; b += blockDim.x) {
    lo = all[2 * b] < lo ? all[2 * b] : lo;
    hi = all[2 * b + 1] > hi ? all[2 * b + 1] : hi;
  }
  block_min_max(lo, hi);
  if (threadIdx.x == 0) {
    result[0] = lo;
    result[1] = hi;
    *done = 0;
    __threadfence_system();
  }
}

// One calling thread's buffers on one device: the partials and the counter (device), the result (mapped pinned).
struct bounds_scratch {
  long long* partial = nullptr;  // 2 * kBoundsMaxBlocks partials, then the counter
  long long* result = nullptr;
  cudaEvent_t finished = nullptr;  // recorded after the kernel (index_bounds_start)
  bounds_scratch() = default;
  bounds_scratch(const bounds_scratch&) = delete;
  bounds_scratch& operator=(const bounds_scratch&) = delete;
  ~bounds_scratch() {  // at thread exit; errors ignored (CUDA may already be shutting down at process exit)
    if (partial != nullptr) (void)cudaFree(partial);
    if (result != nullptr) (void)cudaFreeHost(result);
    if (finished != nullptr) (void)cudaEventDestroy(finished);
  }
  unsigned* done() { return reinterpret_cast<unsigned*>(partial + 2 * kBoundsMaxBlocks); }
};

bounds_scratch& bounds_scratch_for(int device) {
  thread_local std::map<int, bounds_scratch> per_device;
  bounds_scratch& s = per_device[device];
  if (s.partial == nullptr) {
    void* p = nullptr;
    SHARED_CUDA_TRY(cudaMalloc(&p, 2 * kBoundsMaxBlocks * sizeof(long long) + sizeof(long long)));
    s.partial = static_cast<long long*>(p);
    SHARED_CUDA_TRY(cudaMemset(s.done(), 0, sizeof(unsigned)));
  }
  if (s.result == nullptr) {
    void* p = nullptr;
    SHARED_CUDA_TRY(cudaHostAlloc(&p, 2 * sizeof(long long), cudaHostAllocMapped));
    s.result = static_cast<long long*>(p);
  }
  if (s.finished == nullptr) SHARED_CUDA_TRY(cudaEventCreateWithFlags(&s.finished, cudaEventDisableTiming));
  return s;
}

// The scratch of this thread's started check (index_bounds_start), until its finish.
thread_local bounds_scratch* started_bounds = nullptr;

}  // namespace

void index_bounds_cuda(const void* index, int index_bytes, std::int64_t count, shared_cuda::stream_view stream,
                       std::int64_t& lo, std::int64_t& hi) {
  index_bounds_start(index, index_bytes, count, stream);
  index_bounds_finish(lo, hi);
}

void index_bounds_start(const void* index, int index_bytes, std::int64_t count, shared_cuda::stream_view stream) {
  SHARED_CUDA_EXPECT(started_bounds == nullptr, "index_bounds_start called twice without index_bounds_finish");
  SHARED_CUDA_EXPECT(index_bytes == 4 || index_bytes == 8, "index must be int32 or int64");
  SHARED_CUDA_EXPECT(count > 0 && index != nullptr, "the bounds of an empty or null index are undefined");
  int device = 0;
  SHARED_CUDA_TRY(cudaGetDevice(&device));
  bounds_scratch& s = bounds_scratch_for(device);
  volatile long long* result = s.result;
  result[0] = 1;  // lo > hi: what the host reads if the kernel never wrote the result
  result[1] = 0;
  const std::int64_t wanted = (count + kBoundsThreads * kBoundsPerThread - 1) / (kBoundsThreads * kBoundsPerThread);
  const unsigned blocks = static_cast<unsigned>(std::min<std::int64_t>(wanted, kBoundsMaxBlocks));
  auto st = static_cast<cudaStream_t>(stream.handle);
  if (index_bytes == 8) {
    index_bounds_kernel<<<blocks, kBoundsThreads, 0, st>>>(static_cast<const std::int64_t*>(index), count, s.partial,
                                                           s.done(), s.result);
  } else {
    index_bounds_kernel<<<blocks, kBoundsThreads, 0, st>>>(static_cast<const std::int32_t*>(index), count, s.partial,
                                                           s.done(), s.result);
  }
  SHARED_CUDA_TRY(cudaGetLastError());
  SHARED_CUDA_TRY(cudaEventRecord(s.finished, st));
  started_bounds = &s;
}

void index_bounds_finish(std::int64_t& lo, std::int64_t& hi) {
  SHARED_CUDA_EXPECT(started_bounds != nullptr, "index_bounds_finish without index_bounds_start");
  bounds_scratch& s = *std::exchange(started_bounds, nullptr);
  SHARED_CUDA_TRY(cudaEventSynchronize(s.finished));
  volatile long long* result = s.result;
  lo = result[0];
  hi = result[1];
  if (lo > hi) {  // cannot happen for count > 0 unless the counter was left non-zero: reset it for the next call
    SHARED_CUDA_TRY(cudaMemset(s.done(), 0, sizeof(unsigned)));
    throw std::runtime_error("internal error: the index bounds kernel did not finish its reduction");
  }
}

void gather_cuda(const rows_call& c, kernel_kind kind, int max_sms, shared_cuda::stream_view stream) {
  check_call(c);
  if (c.count == 0) return;
  launch<false>(c, plan_gather(c, kind), max_sms, static_cast<cudaStream_t>(stream.handle));
  SHARED_CUDA_TRY(cudaGetLastError());
}

void gather_cached_cuda(const rows_call& c, bool refresh, int max_sms, shared_cuda::stream_view stream) {
  SHARED_CUDA_EXPECT(c.index_bytes == 4 || c.index_bytes == 8, "index must be int32 or int64");
  SHARED_CUDA_EXPECT(c.row_bytes > 0 && c.rows >= 0 && c.count >= 0, "rows, row_bytes and count must be >= 0");
  SHARED_CUDA_EXPECT(c.device_count == nullptr, "a device-side count is not supported by the cached gather");
  if (c.count == 0) return;
  SHARED_CUDA_EXPECT(c.table != nullptr && c.index != nullptr && c.slot_of_row != nullptr && c.cache != nullptr,
                     "null table, index, slot map or cache pointer");
  SHARED_CUDA_EXPECT(refresh || c.dense != nullptr, "null output pointer");
  const launch_plan p = plan_cached(c);
  const auto s = static_cast<cudaStream_t>(stream.handle);
  if (refresh) {
    launch_cached<true>(c, p, max_sms, s);
  } else {
    launch_cached<false>(c, p, max_sms, s);
  }
  SHARED_CUDA_TRY(cudaGetLastError());
}

void scatter_cuda(const rows_call& c, kernel_kind kind, int max_sms, shared_cuda::stream_view stream) {
  check_call(c);
  SHARED_CUDA_EXPECT(c.device_count == nullptr, "a device-side count is for gathers only");
  if (c.count == 0) return;
  launch<true>(c, plan_scatter(c, kind), max_sms, static_cast<cudaStream_t>(stream.handle));
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
