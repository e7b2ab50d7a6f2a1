// The sampler's CUDA kernels (cpp/src/sample_kernels.cuh) run on the CPU: every thread of a grid, one after another,
// with stand-ins for the CUDA built-ins, as a shared library with the entry points of pytorch_direct._core's
// sample_*_cuda (pointers as integers, the stream ignored). tests/test_sample_kernels.py loads it with ctypes and
// runs the package's kernel sampler (pytorch_direct._sample_cuda) through it on CPU tensors, so both the kernels'
// index math and the host side's bookkeeping are checked on machines without a GPU.
#include <cstdint>

struct dim3_emulated {
  unsigned x = 1, y = 1, z = 1;
};
static dim3_emulated threadIdx, blockIdx, blockDim, gridDim;
#define __global__
#define __device__
#define __forceinline__ inline

inline unsigned long long atomicCAS(unsigned long long* address, unsigned long long compare, unsigned long long value) {
  const unsigned long long old = *address;
  if (old == compare) *address = value;
  return old;
}
inline unsigned atomicOr(std::uint32_t* address, unsigned value) {
  const unsigned old = *address;
  *address = old | value;
  return old;
}
inline int __popc(std::uint32_t x) { return __builtin_popcount(x); }
inline std::uint64_t __umul64hi(std::uint64_t a, std::uint64_t b) {
  return static_cast<std::uint64_t>((static_cast<unsigned __int128>(a) * b) >> 64);
}

#include "../../cpp/src/sample_kernels.cuh"

using namespace pytorch_direct;
using namespace pytorch_direct::sample_kernels;

namespace {

// A small block, so that grids of several blocks (and partial last blocks) are exercised.
constexpr unsigned kBlock = 7;

template <typename F>
void run_grid(std::int64_t threads, F&& kernel) {
  const auto grid = static_cast<unsigned>((threads + kBlock - 1) / kBlock);
  gridDim.x = grid;
  blockDim.x = kBlock;
  for (unsigned b = 0; b < grid; ++b) {
    blockIdx.x = b;
    for (unsigned t = 0; t < kBlock; ++t) {
      threadIdx.x = t;
      kernel();
    }
  }
}

template <class T>
T* ptr(std::uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

sample_graph graph(std::uintptr_t colptr, int colptr_code, std::uintptr_t row, int row_code, std::int64_t num_nodes,
                   std::int64_t num_edges, std::uintptr_t edge_type, int edge_type_code, std::int64_t num_types) {
  sample_graph g;
  g.colptr = ptr<const void>(colptr);
  g.colptr_code = colptr_code;
  g.row = ptr<const void>(row);
  g.row_code = row_code;
  g.num_nodes = num_nodes;
  g.num_edges = num_edges;
  g.edge_type = ptr<const void>(edge_type);
  g.edge_type_code = edge_type_code;
  g.num_types = num_types;
  return g;
}

}  // namespace

extern "C" {

void emulated_take(std::uintptr_t colptr, int colptr_code, std::uintptr_t row, int row_code, std::int64_t num_nodes,
                   std::int64_t num_edges, std::uintptr_t edge_type, int edge_type_code, std::int64_t num_types,
                   std::uintptr_t frontier, std::int64_t slots, std::uintptr_t valid, int fanout,
                   std::uintptr_t fan_row, bool replace, std::uintptr_t seed_local, std::uintptr_t take,
                   std::uintptr_t error) {
  const sample_graph g =
      graph(colptr, colptr_code, row, row_code, num_nodes, num_edges, edge_type, edge_type_code, num_types);
  run_grid(slots, [&] {
    take_kernel(g, ptr<const std::int64_t>(frontier), slots, ptr<const std::int64_t>(valid), fanout,
                ptr<const std::int64_t>(fan_row), replace, ptr<std::int32_t>(seed_local), ptr<std::int64_t>(take),
                ptr<std::int64_t>(error));
  });
}

void emulated_edges(std::uintptr_t colptr, int colptr_code, std::uintptr_t row, int row_code, std::int64_t num_nodes,
                    std::int64_t num_edges, std::uintptr_t edge_type, int edge_type_code, std::int64_t num_types,
                    std::uintptr_t frontier, std::int64_t slots, std::uintptr_t cum, int fanout, std::uintptr_t fan_row,
                    bool replace, std::uintptr_t seed, int hop, std::uintptr_t local, std::uintptr_t unseen,
                    std::int64_t first_local, std::uintptr_t pos, std::uintptr_t src, std::uintptr_t dst,
                    std::uintptr_t error) {
  const sample_graph g =
      graph(colptr, colptr_code, row, row_code, num_nodes, num_edges, edge_type, edge_type_code, num_types);
  run_grid(slots, [&] {
    edges_kernel(g, ptr<const std::int64_t>(frontier), slots, ptr<const std::int64_t>(cum), fanout,
                 ptr<const std::int64_t>(fan_row), replace, ptr<const std::int64_t>(seed), hop,
                 ptr<const std::int32_t>(local), ptr<std::uint32_t>(unseen), first_local, ptr<std::int64_t>(pos),
                 ptr<std::int64_t>(src), ptr<std::int64_t>(dst), ptr<std::int64_t>(error));
  });
}

void emulated_popcount(std::uintptr_t unseen, std::int64_t words, std::uintptr_t counts) {
  run_grid(words, [&] { popcount_kernel(ptr<const std::uint32_t>(unseen), words, ptr<std::int32_t>(counts)); });
}

void emulated_number(std::uintptr_t src, std::int64_t edges, std::uintptr_t unseen, std::uintptr_t prefix,
                     std::uintptr_t local, std::int64_t first_new, std::uintptr_t new_nodes, std::uintptr_t src_local) {
  run_grid(edges, [&] {
    number_kernel(ptr<const std::int64_t>(src), edges, ptr<const std::uint32_t>(unseen),
                  ptr<const std::int64_t>(prefix), ptr<std::int32_t>(local), first_new, ptr<std::int64_t>(new_nodes),
                  ptr<std::int64_t>(src_local));
  });
}

}  // extern "C"
