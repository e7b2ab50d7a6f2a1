// Neighbour sampling kernels (sample.hpp): per hop, take counts, edge draws, and the new sources numbered in
// ascending id through a bitmap over node ids, instead of a chain of dozens of small tensor operations. The kernels are
// in sample_kernels.cuh; this file checks arguments and launches them.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cub/device/device_scan.cuh>

#include "pytorch_direct/sample.hpp"
#include "sample_batch.hpp"
#include "sample_kernels.cuh"
#include "shared_cuda/error.hpp"

namespace pytorch_direct {
namespace {

using namespace sample_kernels;

constexpr int kThreads = 256;

unsigned blocks_for(std::int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

cudaStream_t native(shared_cuda::stream_view s) { return static_cast<cudaStream_t>(s.handle); }

void check_graph(const sample_graph& g) {
  for (int_code code : {g.colptr_code, g.row_code})
    SHARED_CUDA_EXPECT(code == 8 || code == 4 || code == 2 || code == 1 || code == -1,
                       "sampler kernels read int8/16/32/64 or uint8 topology arrays");
  SHARED_CUDA_EXPECT(g.edge_type == nullptr || g.edge_type_code == 8 || g.edge_type_code == 4 ||
                         g.edge_type_code == 2 || g.edge_type_code == 1 || g.edge_type_code == -1,
                     "sampler kernels read int8/16/32/64 or uint8 edge types");
  SHARED_CUDA_EXPECT(g.colptr != nullptr && (g.row != nullptr || g.num_edges == 0), "null topology array");
  SHARED_CUDA_EXPECT(g.num_nodes >= 0 && g.num_nodes < (std::int64_t{1} << 31),
                     "sampler kernels number nodes with int32 local ids: at most 2^31 - 1 nodes");
}

void check_launch() { SHARED_CUDA_TRY(cudaGetLastError()); }

}  // namespace

void sample_take_cuda(const sample_graph& g, const std::int64_t* frontier, std::int64_t slots,
                      const std::int64_t* valid, int fanout, const std::int64_t* fan_row, bool replace,
                      std::int32_t* seed_local, std::int64_t* take, std::int64_t* error,
                      shared_cuda::stream_view stream) {
  check_graph(g);
  if (slots <= 0) return;
  take_kernel<<<blocks_for(slots), kThreads, 0, native(stream)>>>(g, frontier, slots, valid, fanout, fan_row, replace,
                                                                  seed_local, take, error);
  check_launch();
}

void sample_edges_cuda(const sample_graph& g, const std::int64_t* frontier, std::int64_t slots, const std::int64_t* cum,
                       int fanout, const std::int64_t* fan_row, bool replace, const std::int64_t* seed, int hop,
                       const std::int32_t* local, std::uint32_t* unseen, std::int64_t first_local, std::int64_t* pos,
                       std::int64_t* src, std::int64_t* dst, std::int64_t* error, shared_cuda::stream_view stream) {
  check_graph(g);
  if (slots <= 0) return;
  edges_kernel<<<blocks_for(slots), kThreads, 0, native(stream)>>>(
      g, frontier, slots, cum, fanout, fan_row, replace, seed, hop, local, unseen, first_local, pos, src, dst, error);
  check_launch();
}

void sample_popcount_cuda(const std::uint32_t* unseen, std::int64_t words, std::int32_t* counts,
                          shared_cuda::stream_view stream) {
  if (words <= 0) return;
  popcount_kernel<<<blocks_for(words), kThreads, 0, native(stream)>>>(unseen, words, counts);
  check_launch();
}

void sample_number_cuda(const std::int64_t* src, std::int64_t edges, const std::uint32_t* unseen,
                        const std::int64_t* prefix, std::int32_t* local, std::int64_t first_new,
                        std::int64_t* new_nodes, std::int64_t* src_local, shared_cuda::stream_view stream) {
  if (edges <= 0) return;
  number_kernel<<<blocks_for(edges), kThreads, 0, native(stream)>>>(src, edges, unseen, prefix, local, first_new,
                                                                    new_nodes, src_local);
  check_launch();
}

namespace {

// sample_batch.hpp's Ops on a CUDA stream: the launches above, CUB's device sums, async copies.
struct cuda_ops {
  cudaStream_t stream;
  shared_cuda::stream_view view;

  static std::size_t scan_bytes(std::int64_t slot_cap, std::int64_t words) {
    std::size_t take_bytes = 0;
    std::size_t count_bytes = 0;
    SHARED_CUDA_TRY(cub::DeviceScan::InclusiveSum(nullptr, take_bytes, static_cast<const std::int64_t*>(nullptr),
                                                  static_cast<std::int64_t*>(nullptr), slot_cap > 0 ? slot_cap : 1));
    SHARED_CUDA_TRY(cub::DeviceScan::InclusiveSum(nullptr, count_bytes, static_cast<const std::int32_t*>(nullptr),
                                                  static_cast<std::int64_t*>(nullptr), words > 0 ? words : 1));
    return take_bytes > count_bytes ? take_bytes : count_bytes;
  }
  void take(const sample_graph& g, const std::int64_t* frontier, std::int64_t slots, const std::int64_t* valid,
            int fanout, const std::int64_t* fan_row, bool replace, std::int32_t* seed_local, std::int64_t* take,
            std::int64_t* error) {
    sample_take_cuda(g, frontier, slots, valid, fanout, fan_row, replace, seed_local, take, error, view);
  }
  void edges(const sample_graph& g, const std::int64_t* frontier, std::int64_t slots, const std::int64_t* cum,
             int fanout, const std::int64_t* fan_row, bool replace, const std::int64_t* seed, int hop,
             const std::int32_t* local, std::uint32_t* unseen, std::int64_t first_local, std::int64_t* pos,
             std::int64_t* src, std::int64_t* dst, std::int64_t* error) {
    sample_edges_cuda(g, frontier, slots, cum, fanout, fan_row, replace, seed, hop, local, unseen, first_local, pos,
                      src, dst, error, view);
  }
  void popcount(const std::uint32_t* unseen, std::int64_t words, std::int32_t* counts) {
    sample_popcount_cuda(unseen, words, counts, view);
  }
  void number(const std::int64_t* src, std::int64_t edges, const std::uint32_t* unseen, const std::int64_t* prefix,
              std::int32_t* local, std::int64_t first_new, std::int64_t* new_nodes, std::int64_t* src_local) {
    sample_number_cuda(src, edges, unseen, prefix, local, first_new, new_nodes, src_local, view);
  }
  void forget(const std::int64_t* n_id, std::int64_t n, std::int32_t* local) {
    forget_kernel<<<blocks_for(n), kThreads, 0, stream>>>(n_id, n, local);
    check_launch();
  }
  void scan_take(void* scratch, std::size_t bytes, const std::int64_t* in, std::int64_t* out, std::int64_t n) {
    SHARED_CUDA_TRY(cub::DeviceScan::InclusiveSum(scratch, bytes, in, out, n, stream));
  }
  void scan_counts(void* scratch, std::size_t bytes, const std::int32_t* in, std::int64_t* out, std::int64_t n) {
    SHARED_CUDA_TRY(cub::DeviceScan::InclusiveSum(scratch, bytes, in, out, n, stream));
  }
  void copy(void* dst, const void* src, std::int64_t bytes) {
    SHARED_CUDA_TRY(cudaMemcpyAsync(dst, src, static_cast<std::size_t>(bytes), cudaMemcpyDeviceToDevice, stream));
  }
  void zero(void* dst, std::int64_t bytes) {
    SHARED_CUDA_TRY(cudaMemsetAsync(dst, 0, static_cast<std::size_t>(bytes), stream));
  }
  void read(void* host, const void* device, std::int64_t bytes) {
    SHARED_CUDA_TRY(cudaMemcpyAsync(host, device, static_cast<std::size_t>(bytes), cudaMemcpyDeviceToHost, stream));
  }
  void wait() { SHARED_CUDA_TRY(cudaStreamSynchronize(stream)); }
};

}  // namespace

std::size_t sample_batch_workspace_bytes(std::int64_t slot_cap, std::int64_t edge_cap, std::int64_t words) {
  return sample_batch::workspace_bytes<cuda_ops>(slot_cap, edge_cap, words);
}

namespace {

// Makes `device` current for a scope (nothing when it is already, or for -1), and restores the previous one.
class device_scope {
 public:
  explicit device_scope(int device) {
    if (device < 0) return;
    SHARED_CUDA_TRY(cudaGetDevice(&previous_));
    if (previous_ == device) return;
    SHARED_CUDA_TRY(cudaSetDevice(device));
    switched_ = true;
  }
  ~device_scope() {
    if (switched_) cudaSetDevice(previous_);  // (a destructor does not throw: a failure here leaves it current)
  }
  device_scope(const device_scope&) = delete;
  device_scope& operator=(const device_scope&) = delete;

 private:
  int previous_ = -1;
  bool switched_ = false;
};

}  // namespace

sample_batch_result sample_batch_cuda(const sample_graph& g, const sample_batch_args& a,
                                      shared_cuda::stream_view stream) {
  check_graph(g);
  const device_scope scope(a.device);
  cuda_ops ops{native(stream), stream};
  return sample_batch::run(ops, g, a);
}

}  // namespace pytorch_direct
