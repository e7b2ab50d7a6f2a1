// CUDA kernels that move rows between a mapped host table and dense device buffers.
//
// One translation unit, few instantiations: kernels are templated on the access width in bytes (16, 8, 4, 2, 1),
// never on the dtype, and the index width (int32/int64) is a uniform run-time branch.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>
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

// Launches the kernel `p` names. Gather: table -> dense; scatter: dense -> table.
template <bool Scatter>
void launch(const rows_call& c, const launch_plan& p, int max_sms, cudaStream_t s) {
  auto* table = static_cast<unsigned char*>(c.table);
  auto* dense = static_cast<unsigned char*>(c.dense);
  std::int64_t* err = error_word();
  const launch_shape shape = shape_for(p, c.count, max_sms, multiprocessors());
  const char* problem = launch_shape_problem(shape);
  SHARED_CUDA_EXPECT(problem[0] == '\0', std::string("internal error, unlaunchable kernel shape: ") + problem);
  const unsigned grid = shape.grid_x;
  const unsigned block = shape.block;
  const std::size_t shared = shape.shared_bytes;
  if (p.kernel == launch_plan::unaligned) {
    gather_rows_unaligned<<<grid, block, shared, s>>>(table, c.rows, c.row_bytes, c.index, c.index_bytes, c.count,
                                                      c.positions, dense, err, p.group_shift);
  } else if (p.kernel == launch_plan::naive) {
    if constexpr (Scatter) {
      if (p.width == 4) {
        scatter_rows_naive<4><<<grid, block, shared, s>>>(table, c.rows, p.row_words, c.index, c.index_bytes, c.count,
                                                          c.positions, dense, err);
      } else {
        scatter_rows_naive<1><<<grid, block, shared, s>>>(table, c.rows, p.row_words, c.index, c.index_bytes, c.count,
                                                          c.positions, dense, err);
      }
    } else {
      if (p.width == 4) {
        gather_rows_naive<4><<<grid, block, shared, s>>>(table, c.rows, p.row_words, c.index, c.index_bytes, c.count,
                                                         c.positions, dense, err);
      } else {
        gather_rows_naive<1><<<grid, block, shared, s>>>(table, c.rows, p.row_words, c.index, c.index_bytes, c.count,
                                                         c.positions, dense, err);
      }
    }
  } else {
#define PD_LAUNCH(W)                                                                                             \
  move_rows<W, Scatter><<<grid, block, shared, s>>>(table, c.rows, p.row_words, c.index, c.index_bytes, c.count, \
                                                    c.positions, dense, err, p.group_shift)
    switch (p.width) {
      case 16:
        PD_LAUNCH(16);
        break;
      case 8:
        PD_LAUNCH(8);
        break;
      case 4:
        PD_LAUNCH(4);
        break;
      case 2:
        PD_LAUNCH(2);
        break;
      default:
        PD_LAUNCH(1);
        break;
    }
#undef PD_LAUNCH
  }
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
  launch<false>(c, plan_gather(c, kind), max_sms, static_cast<cudaStream_t>(stream.handle));
  SHARED_CUDA_TRY(cudaGetLastError());
}

void scatter_cuda(const rows_call& c, kernel_kind kind, int max_sms, shared_cuda::stream_view stream) {
  check_call(c);
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
