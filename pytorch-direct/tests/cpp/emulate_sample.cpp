// The sampler's CUDA kernels (cpp/src/sample_kernels.cuh) run on the CPU: every thread of a grid, one after another,
// with stand-ins for the CUDA built-ins, as a shared library with the entry points of pytorch_direct._core's
// sample_*_cuda (pointers as integers, the stream ignored). tests/test_sample_kernels.py loads it with ctypes and
// runs the package's kernel sampler (pytorch_direct._sample_cuda) through it on CPU tensors, so both the kernels'
// index math and the host side's bookkeeping are checked on machines without a GPU; sample_batch_cuda's
// orchestration (cpp/src/sample_batch.hpp) runs here with CPU stand-ins for the sums and copies.
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

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
inline unsigned atomicMin(unsigned* address, unsigned value) {
  const unsigned old = *address;
  if (value < old) *address = value;
  return old;
}
inline int __popc(std::uint32_t x) { return __builtin_popcount(x); }
inline std::uint64_t __umul64hi(std::uint64_t a, std::uint64_t b) {
  return static_cast<std::uint64_t>((static_cast<unsigned __int128>(a) * b) >> 64);
}

#include "../../cpp/src/sample_batch.hpp"
#include "../../cpp/src/sample_kernels.cuh"

// (the library's definition lives in shared-cuda's compiled part, which this test library does not link)
std::string shared_cuda::detail::located(const char* file, int line, const std::string& message) {
  return std::string(file) + ":" + std::to_string(line) + ": " + message;
}

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

// sample_batch.hpp's Ops on the CPU: the kernels through run_grid, sums as loops, copies as memcpy.
struct cpu_ops {
  int launches = 0;

  static std::size_t scan_bytes(std::int64_t, std::int64_t) { return 0; }
  void take(const sample_graph& g, const std::int64_t* frontier, std::int64_t slots, const std::int64_t* valid,
            int fanout, const std::int64_t* fan_row, bool replace, std::int32_t* seed_local, std::int64_t* take,
            std::int64_t* error) {
    ++launches;
    run_grid(slots, [&] { take_kernel(g, frontier, slots, valid, fanout, fan_row, replace, seed_local, take, error); });
  }
  void edges(const sample_graph& g, const std::int64_t* frontier, std::int64_t slots, const std::int64_t* cum,
             int fanout, const std::int64_t* fan_row, bool replace, const std::int64_t* seed, int hop,
             const std::int32_t* local, std::uint32_t* unseen, std::int64_t first_local, std::int64_t* pos,
             std::int64_t* src, std::int64_t* dst, std::int64_t* error) {
    ++launches;
    run_grid(slots, [&] {
      edges_kernel(g, frontier, slots, cum, fanout, fan_row, replace, seed, hop, local, unseen, first_local, pos, src,
                   dst, error);
    });
  }
  void popcount(const std::uint32_t* unseen, std::int64_t words, std::int32_t* counts) {
    ++launches;
    run_grid(words, [&] { popcount_kernel(unseen, words, counts); });
  }
  void number(const std::int64_t* src, std::int64_t edges, const std::uint32_t* unseen, const std::int64_t* prefix,
              std::int32_t* local, std::int64_t first_new, std::int64_t* new_nodes, std::int64_t* src_local) {
    ++launches;
    run_grid(edges, [&] { number_kernel(src, edges, unseen, prefix, local, first_new, new_nodes, src_local); });
  }
  void forget(const std::int64_t* n_id, std::int64_t n, std::int32_t* local) {
    ++launches;
    run_grid(n, [&] { forget_kernel(n_id, n, local); });
  }
  void scan_take(void*, std::size_t, const std::int64_t* in, std::int64_t* out, std::int64_t n) {
    std::int64_t sum = 0;
    for (std::int64_t i = 0; i < n; ++i) out[i] = sum += in[i];
  }
  void scan_counts(void*, std::size_t, const std::int32_t* in, std::int64_t* out, std::int64_t n) {
    std::int64_t sum = 0;
    for (std::int64_t i = 0; i < n; ++i) out[i] = sum += in[i];
  }
  void copy(void* dst, const void* src, std::int64_t bytes) { std::memmove(dst, src, static_cast<std::size_t>(bytes)); }
  void zero(void* dst, std::int64_t bytes) { std::memset(dst, 0, static_cast<std::size_t>(bytes)); }
  void read(void* host, const void* device, std::int64_t bytes) { copy(host, device, bytes); }
  void wait() {}
};

std::string last_error;

}  // namespace

extern "C" {

void emulated_take(std::uintptr_t colptr, int colptr_code, std::uintptr_t row, int row_code, std::int64_t num_nodes,
                   std::int64_t num_edges, std::uintptr_t edge_type, int edge_type_code, std::int64_t num_types,
                   std::uintptr_t frontier, std::int64_t slots, std::uintptr_t valid, int fanout,
                   std::uintptr_t fan_row, bool replace, std::uintptr_t seed_local, std::uintptr_t take,
                   std::uintptr_t error) {
  const sample_graph g = sample_graph::from_addresses(colptr, colptr_code, row, row_code, num_nodes, num_edges,
                                                      edge_type, edge_type_code, num_types);
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
  const sample_graph g = sample_graph::from_addresses(colptr, colptr_code, row, row_code, num_nodes, num_edges,
                                                      edge_type, edge_type_code, num_types);
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

std::int64_t emulated_batch_workspace_bytes(std::int64_t slot_cap, std::int64_t edge_cap, std::int64_t words) {
  return static_cast<std::int64_t>(sample_batch::workspace_bytes<cpu_ops>(slot_cap, edge_cap, words));
}

// sample_batch_cuda's arguments flattened (fanouts: `hops` ints); the result as the binding returns it (status,
// error kind and value, needed edges, num_nodes, num_edges) into `result` (4 + 2 * hops + 1 entries). Returns the
// kernel launches, or -1 for an argument error (its message from emulated_last_error).
int emulated_batch(std::uintptr_t colptr, int colptr_code, std::uintptr_t row, int row_code, std::int64_t num_nodes,
                   std::int64_t num_edges, std::uintptr_t edge_type, int edge_type_code, std::int64_t num_types,
                   std::uintptr_t seeds, std::int64_t batch, std::uintptr_t fanouts, int hops, std::uintptr_t fan_table,
                   bool replace, std::uintptr_t seed, std::uintptr_t local, std::uintptr_t unseen, std::int64_t words,
                   std::uintptr_t error, std::uintptr_t workspace, std::int64_t workspace_bytes, std::int64_t slot_cap,
                   std::int64_t edge_cap, std::uintptr_t host, std::uintptr_t out, std::int64_t node_cap,
                   std::uintptr_t result) {
  try {
    const sample_graph g = sample_graph::from_addresses(colptr, colptr_code, row, row_code, num_nodes, num_edges,
                                                        edge_type, edge_type_code, num_types);
    sample_batch_args a;
    a.seeds = ptr<const std::int64_t>(seeds);
    a.batch = batch;
    a.fanouts.assign(ptr<const int>(fanouts), ptr<const int>(fanouts) + hops);
    a.fan_table = ptr<const std::int64_t>(fan_table);
    a.replace = replace;
    a.seed = ptr<const std::int64_t>(seed);
    a.local = ptr<std::int32_t>(local);
    a.unseen = ptr<std::uint32_t>(unseen);
    a.words = words;
    a.error = ptr<std::int64_t>(error);
    a.workspace = ptr<void>(workspace);
    a.workspace_bytes = static_cast<std::size_t>(workspace_bytes);
    a.slot_cap = slot_cap;
    a.edge_cap = edge_cap;
    a.host = ptr<std::int64_t>(host);
    a.out = ptr<std::int64_t>(out);
    a.node_cap = node_cap;
    cpu_ops ops;
    const sample_batch_result r = sample_batch::run(ops, g, a);
    auto* res = ptr<std::int64_t>(result);
    res[0] = static_cast<std::int64_t>(r.status);
    res[1] = r.error_kind;
    res[2] = r.error_value;
    res[3] = r.needed_edges;
    for (int i = 4; i < 4 + 2 * hops + 1; ++i) res[i] = 0;
    for (std::size_t i = 0; i < r.num_nodes.size(); ++i) res[4 + i] = r.num_nodes[i];
    for (std::size_t i = 0; i < r.num_edges.size(); ++i) res[4 + hops + 1 + i] = r.num_edges[i];
    return ops.launches;
  } catch (const std::exception& e) {
    last_error = e.what();
    return -1;
  }
}

const char* emulated_last_error() { return last_error.c_str(); }

}  // extern "C"
