// Stand-ins for the sampler kernels (sample_cuda.cu) in builds without CUDA: each raises unavailable_error.
#include "pytorch_direct/sample.hpp"

#if !SHARED_CUDA_HAS_CUDA
#include "shared_cuda/error.hpp"

namespace pytorch_direct {
namespace {
[[noreturn]] void unavailable() {
  throw shared_cuda::unavailable_error("pytorch_direct was built without CUDA: reinstall with nvcc on PATH");
}
}  // namespace

void sample_take_cuda(const sample_graph&, const std::int64_t*, std::int64_t, const std::int64_t*, int,
                      const std::int64_t*, bool, std::int32_t*, std::int64_t*, std::int64_t*,
                      shared_cuda::stream_view) {
  unavailable();
}
void sample_edges_cuda(const sample_graph&, const std::int64_t*, std::int64_t, const std::int64_t*, int,
                       const std::int64_t*, bool, const std::int64_t*, int, const std::int32_t*, std::uint32_t*,
                       std::int64_t, std::int64_t*, std::int64_t*, std::int64_t*, std::int64_t*,
                       shared_cuda::stream_view) {
  unavailable();
}
void sample_popcount_cuda(const std::uint32_t*, std::int64_t, std::int32_t*, shared_cuda::stream_view) {
  unavailable();
}
void sample_number_cuda(const std::int64_t*, std::int64_t, const std::uint32_t*, const std::int64_t*, std::int32_t*,
                        std::int64_t, std::int64_t*, std::int64_t*, shared_cuda::stream_view) {
  unavailable();
}
std::size_t sample_batch_workspace_bytes(std::int64_t, std::int64_t, std::int64_t) { unavailable(); }
sample_batch_result sample_batch_cuda(const sample_graph&, const sample_batch_args&, shared_cuda::stream_view) {
  unavailable();
}
}  // namespace pytorch_direct
#endif
