// The sampler's kernels (sample.hpp, launched by sample_cuda.cu), in a header so that tests/cpp/emulate_sample.cpp
// runs them on the CPU, thread after thread, with stand-ins for the CUDA built-ins: no shared memory, no barriers,
// and the only cross-thread effects are atomics whose result does not depend on their order.
//
// One thread per frontier node for the draws: fan-outs are small (tens), so a thread's work is its fan-out, and the
// launch count, not the GPU work, is what a hop costs. New sources are found with one bit per node (set with
// atomicOr by every edge whose source is not in the batch yet): a node's rank among the set bits, from an inclusive
// sum of per-word popcounts, is its place in ascending id order, so no sort is needed and repeats of a node all
// compute the same rank.
#pragma once

#include <cstdint>

#include "pytorch_direct/sample.hpp"

namespace pytorch_direct::sample_kernels {

__device__ __forceinline__ std::int64_t load_int(const void* p, int_code code, std::int64_t i) {
  switch (code) {
    case 8:
      return static_cast<const std::int64_t*>(p)[i];
    case 4:
      return static_cast<const std::int32_t*>(p)[i];
    case 2:
      return static_cast<const std::int16_t*>(p)[i];
    case 1:
      return static_cast<const std::int8_t*>(p)[i];
    default:  // -1: uint8
      return static_cast<const std::uint8_t*>(p)[i];
  }
}

// Records the first error (kind, value) in the pair; later ones are dropped.
__device__ __forceinline__ void record(std::int64_t* error, sample_error kind, std::int64_t value) {
  auto* word = reinterpret_cast<unsigned long long*>(error);
  if (atomicCAS(word, 0ull, static_cast<unsigned long long>(kind)) == 0ull) error[1] = value;
}

// splitmix64's finaliser: a counter-based generator (a distinct key per draw gives independent-looking bits).
__device__ __forceinline__ std::uint64_t mix(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// A uniform integer in [0, n) for draw `k` of `stream` (n > 0; the bias of the multiply-shift is below n / 2^64).
__device__ __forceinline__ std::int64_t below(std::uint64_t stream, std::uint64_t k, std::int64_t n) {
  const std::uint64_t bits = mix(stream ^ mix(k));
  return static_cast<std::int64_t>(__umul64hi(bits, static_cast<std::uint64_t>(n)));
}

// The node's in-edge range [begin, end); false (and the error recorded) when the node or its range is invalid.
__device__ __forceinline__ bool in_edges(const sample_graph& g, std::int64_t v, std::int64_t* error,
                                         std::int64_t& begin, std::int64_t& end) {
  if (v < 0 || v >= g.num_nodes) {
    record(error, sample_error::node_out_of_range, v);
    return false;
  }
  begin = load_int(g.colptr, g.colptr_code, v);
  end = load_int(g.colptr, g.colptr_code, v + 1);
  if (begin < 0 || end < begin || end > g.num_edges) {
    record(error, sample_error::bad_colptr, v);
    return false;
  }
  return true;
}

__device__ __forceinline__ std::int64_t take_of(std::int64_t degree, std::int64_t fanout, bool replace) {
  if (fanout < 0) return degree;
  if (replace) return degree > 0 ? fanout : 0;
  return degree < fanout ? degree : fanout;
}

// The end of the run of one edge type that starts at p (< end); its type in `type`, false (and the error recorded)
// for a type outside [0, num_types).
__device__ __forceinline__ bool type_run(const sample_graph& g, std::int64_t p, std::int64_t end, std::int64_t* error,
                                         std::int64_t& type, std::int64_t& stop) {
  type = load_int(g.edge_type, g.edge_type_code, p);
  if (type < 0 || type >= g.num_types) {
    record(error, sample_error::bad_edge_type, p);
    return false;
  }
  stop = p + 1;
  while (stop < end && load_int(g.edge_type, g.edge_type_code, stop) == type) ++stop;
  return true;
}

// The draws of k in-edges among `degree` (k = take_of(degree, fanout, replace)) as positions in [0, degree), written
// to out[0, k): all in order (fan-out -1, or no more in-edges than the fan-out), with replacement, or distinct.
__device__ __forceinline__ void draw(std::int64_t* out, std::int64_t k, std::int64_t degree, std::int64_t fanout,
                                     bool replace, std::uint64_t stream) {
  if (fanout < 0 || (!replace && degree <= fanout)) {
    for (std::int64_t j = 0; j < k; ++j) out[j] = j;
  } else if (replace) {
    for (std::int64_t j = 0; j < k; ++j) out[j] = below(stream, j, degree);
  } else if (k * k <= 2 * degree) {
    // Floyd's algorithm: k distinct draws in k steps, each checked against the draws so far (k * k / 2 reads)
    for (std::int64_t m = 0; m < k; ++m) {
      const std::int64_t j = degree - k + m;
      const std::int64_t t = below(stream, m, j + 1);
      bool seen = false;
      for (std::int64_t q = 0; q < m; ++q) seen |= out[q] == t;
      out[m] = seen ? j : t;
    }
  } else {
    // reservoir sampling: one draw per in-edge past the first k (cheaper than Floyd's when k * k > 2 * degree)
    for (std::int64_t j = 0; j < k; ++j) out[j] = j;
    for (std::int64_t j = k; j < degree; ++j) {
      const std::int64_t t = below(stream, j, j + 1);
      if (t < k) out[t] = j;
    }
  }
}

// With typed fan-outs (fan_row: this hop's fan-out per edge type), a node's in-edges fall into runs of one edge type,
// each drawn from with its type's fan-out; else the node's in-edges are one run with `fanout`.
__global__ void take_kernel(sample_graph g, const std::int64_t* frontier, std::int64_t slots, const std::int64_t* valid,
                            int fanout, const std::int64_t* fan_row, bool replace, std::int32_t* seed_local,
                            std::int64_t* take, std::int64_t* error) {
  const std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (i >= slots) return;
  std::int64_t n = 0;
  if (valid == nullptr || i < *valid) {
    const std::int64_t v = frontier[i];
    std::int64_t begin = 0;
    std::int64_t end = 0;
    if (in_edges(g, v, error, begin, end)) {
      if (fan_row == nullptr) {
        n = take_of(end - begin, fanout, replace);
      } else {
        for (std::int64_t p = begin; p < end;) {
          std::int64_t type = 0;
          std::int64_t stop = 0;
          if (!type_run(g, p, end, error, type, stop)) {
            n = 0;
            break;
          }
          n += take_of(stop - p, fan_row[type], replace);
          p = stop;
        }
      }
      // a repeated seed's entry gets its first slot: the smallest i, whatever order the threads write in (the
      // entry starts at -1, the largest value as unsigned)
      if (seed_local != nullptr) atomicMin(reinterpret_cast<unsigned*>(seed_local + v), static_cast<unsigned>(i));
    }
  }
  take[i] = n;
}

__global__ void edges_kernel(sample_graph g, const std::int64_t* frontier, std::int64_t slots, const std::int64_t* cum,
                             int fanout, const std::int64_t* fan_row, bool replace, const std::int64_t* seed, int hop,
                             const std::int32_t* local, std::uint32_t* unseen, std::int64_t first_local,
                             std::int64_t* pos, std::int64_t* src, std::int64_t* dst, std::int64_t* error) {
  const std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (i >= slots) return;
  const std::int64_t stop = cum[i];
  const std::int64_t off = i > 0 ? cum[i - 1] : 0;
  const std::int64_t k = stop - off;
  if (k <= 0) return;  // (slots with no node, or a node whose range was invalid, take nothing)
  const std::int64_t v = frontier[i];
  const std::int64_t begin = load_int(g.colptr, g.colptr_code, v);
  const std::int64_t end = load_int(g.colptr, g.colptr_code, v + 1);
  // this node's draws: a stream of its own per (batch seed, hop, slot)
  const std::uint64_t stream = mix(static_cast<std::uint64_t>(*seed) ^
                                   mix((static_cast<std::uint64_t>(hop) << 48) ^ static_cast<std::uint64_t>(i)));
  std::int64_t* out = pos + off;  // positions relative to begin first, made absolute below
  if (fan_row == nullptr) {
    draw(out, k, end - begin, fanout, replace, stream);
  } else {
    std::int64_t m = 0;  // draws written
    std::uint64_t run = 0;
    for (std::int64_t p = begin; p < end && m < k; ++run) {
      std::int64_t type = 0;
      std::int64_t run_end = 0;
      if (!type_run(g, p, end, error, type, run_end)) return;  // (the take kernel saw it too: k is 0 then)
      const std::int64_t length = run_end - p;
      std::int64_t kr = take_of(length, fan_row[type], replace);
      if (kr > k - m) kr = k - m;  // (never: the take kernel counted the same runs)
      draw(out + m, kr, length, fan_row[type], replace, mix(stream ^ mix(run)));
      for (std::int64_t j = m; j < m + kr; ++j) out[j] += p - begin;
      m += kr;
      p = run_end;
    }
  }
  for (std::int64_t j = 0; j < k; ++j) {
    const std::int64_t p = begin + out[j];
    out[j] = p;
    const std::int64_t s = load_int(g.row, g.row_code, p);
    dst[off + j] = first_local + i;
    if (s < 0 || s >= g.num_nodes) {
      record(error, sample_error::row_out_of_range, p);
      src[off + j] = -1;
      continue;
    }
    src[off + j] = s;
    if (local[s] < 0) atomicOr(unseen + (s >> 5), 1u << (s & 31));
  }
}

__global__ void popcount_kernel(const std::uint32_t* unseen, std::int64_t words, std::int32_t* counts) {
  const std::int64_t w = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (w < words) counts[w] = __popc(unseen[w]);
}

__global__ void number_kernel(const std::int64_t* src, std::int64_t edges, const std::uint32_t* unseen,
                              const std::int64_t* prefix, std::int32_t* local, std::int64_t first_new,
                              std::int64_t* new_nodes, std::int64_t* src_local) {
  const std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (e >= edges) return;
  const std::int64_t s = src[e];
  if (s < 0) {  // out of range (recorded by the draws)
    src_local[e] = -1;
    return;
  }
  const std::uint32_t word = unseen[s >> 5];
  const std::uint32_t bit = 1u << (s & 31);
  if (word & bit) {
    // set bits before this word, then those below s in it
    const std::int64_t rank = prefix[s >> 5] - __popc(word) + __popc(word & (bit - 1u));
    const std::int64_t id = first_new + rank;
    local[s] = static_cast<std::int32_t>(id);  // (every repeat of s writes the same value)
    new_nodes[rank] = s;
    src_local[e] = id;
  } else {
    src_local[e] = local[s];  // in the batch before this hop: not written by this kernel
  }
}

// The id map's reset after a batch: local[n_id[i]] = -1 for its n nodes.
__global__ void forget_kernel(const std::int64_t* n_id, std::int64_t n, std::int32_t* local) {
  const std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) local[n_id[i]] = -1;
}

}  // namespace pytorch_direct::sample_kernels
