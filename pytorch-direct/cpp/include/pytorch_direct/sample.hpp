// Neighbour sampling kernels: one hop of a graph's sampling in a few launches (see sample_cuda.cu).
//
// Pointers are device-readable addresses: GPU memory, or host memory mapped into the GPU (a unified tensor's
// pointer, under UVA). Integer arrays of the topology come with their element code (int_code below) so that one
// kernel reads any of torch's integer dtypes. No CUDA types here, so CPU-only builds include this header; there
// the entry points throw unavailable_error.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "shared_cuda/stream.hpp"

namespace pytorch_direct {

// An integer array's element type: its size in bytes (1, 2, 4, 8: int8, int16, int32, int64), or -1 for uint8.
using int_code = int;

struct sample_graph {
  const void* colptr = nullptr;  // [num_nodes + 1] offsets into row
  int_code colptr_code = 8;
  const void* row = nullptr;  // [num_edges] source node of each in-edge
  int_code row_code = 8;
  std::int64_t num_nodes = 0;
  std::int64_t num_edges = 0;
  // Typed fan-outs only (a heterogeneous graph): each in-edge's type in [0, num_types); a node's in-edges are
  // grouped by type.
  const void* edge_type = nullptr;
  int_code edge_type_code = 8;
  std::int64_t num_types = 0;

  // The graph from integer addresses, as the bindings and the CPU emulator of the kernels receive them.
  static sample_graph from_addresses(std::uintptr_t colptr, int_code colptr_code, std::uintptr_t row, int_code row_code,
                                     std::int64_t num_nodes, std::int64_t num_edges, std::uintptr_t edge_type,
                                     int_code edge_type_code, std::int64_t num_types) {
    return {reinterpret_cast<const void*>(colptr),
            colptr_code,
            reinterpret_cast<const void*>(row),
            row_code,
            num_nodes,
            num_edges,
            reinterpret_cast<const void*>(edge_type),
            edge_type_code,
            num_types};
  }
};

// The first and second words of the error pair (int64 [2], device memory, zero when clean) say what a kernel found
// wrong: kind (below) and the offending node or CSC position. The first error wins; later ones are dropped.
enum class sample_error : std::int64_t {
  none = 0,
  node_out_of_range = 1,  // a frontier node outside [0, num_nodes) (the value)
  bad_colptr = 2,         // colptr[v] > colptr[v + 1], or outside [0, num_edges] (the node v)
  row_out_of_range = 3,   // row[p] outside [0, num_nodes) (the position p)
  bad_edge_type = 4,      // edge_type[p] outside [0, num_types) (the position p)
};

// Per frontier slot i < slots: take[i] = the in-edges it draws (0 for slots at or past *valid when valid is set,
// which hold no node). fanout < 0: all; replace: fanout from each node with in-edges; else min(degree, fanout).
// With fan_row set (typed fan-outs: this hop's fan-out per edge type, g.num_types of them), the same per run of one
// edge type among a node's in-edges, with its type's fan-out. With seed_local set (the seeds' hop, its entries -1),
// also local[frontier[i]] = i, the smallest such i where a seed repeats (each occurrence is a slot of its own).
void sample_take_cuda(const sample_graph& g, const std::int64_t* frontier, std::int64_t slots,
                      const std::int64_t* valid, int fanout, const std::int64_t* fan_row, bool replace,
                      std::int32_t* seed_local, std::int64_t* take, std::int64_t* error,
                      shared_cuda::stream_view stream);

// Draws the edges: slot i writes its take[i] edges at [cum[i] - take[i], cum[i]) (cum: the inclusive sum of take):
// CSC position, source node id and destination local id (first_local + i). Without replacement a node's draws are
// distinct (uniform among its in-edges); random numbers are a counter-based hash of (*seed, hop, slot, draw). Each
// source whose local[src] < 0 (not in the batch yet) sets its bit in `unseen` ([ceil(num_nodes / 32)] words).
void sample_edges_cuda(const sample_graph& g, const std::int64_t* frontier, std::int64_t slots, const std::int64_t* cum,
                       int fanout, const std::int64_t* fan_row, bool replace, const std::int64_t* seed, int hop,
                       const std::int32_t* local, std::uint32_t* unseen, std::int64_t first_local, std::int64_t* pos,
                       std::int64_t* src, std::int64_t* dst, std::int64_t* error, shared_cuda::stream_view stream);

// counts[w] = popcount(unseen[w]) for the `words` words.
void sample_popcount_cuda(const std::uint32_t* unseen, std::int64_t words, std::int32_t* counts,
                          shared_cuda::stream_view stream);

// Numbers the new sources in ascending id: a source s with its bit set in `unseen` gets local id first_new + rank
// (rank: the set bits below s, from `prefix`, the inclusive sum of counts) in local[s], new_nodes[rank] = s; every
// edge's src_local[e] is its source's local id (-1 for a source out of range). `edges` edges.
void sample_number_cuda(const std::int64_t* src, std::int64_t edges, const std::uint32_t* unseen,
                        const std::int64_t* prefix, std::int32_t* local, std::int64_t first_new,
                        std::int64_t* new_nodes, std::int64_t* src_local, shared_cuda::stream_view stream);

// A whole batch (all hops) in one call: the per-hop kernels above, the two sums per hop, and one host read per hop
// of the counts (into pinned memory, then a wait on the stream), so the caller does no per-hop work. Buffers come
// from the caller, sized by upper bounds known without a host round trip; a batch that needs more edges than
// edge_cap stops before drawing past it (status overflow, the id map reset) so that the caller can grow the
// buffers and run it again with the same random seed.
struct sample_batch_args {
  const std::int64_t* seeds = nullptr;  // [batch] device
  std::int64_t batch = 0;
  std::vector<int> fanouts;                 // per hop (ignored where fan_table is set)
  const std::int64_t* fan_table = nullptr;  // typed fan-outs: [hops, g.num_types] device, int64
  bool replace = false;
  const std::int64_t* seed = nullptr;  // the batch's random seed (device, one int64)
  std::int32_t* local = nullptr;       // the id map: [num_nodes] -1 between batches
  std::uint32_t* unseen = nullptr;     // [words] bitmap, zero between batches
  std::int64_t words = 0;
  std::int64_t* error = nullptr;  // the error pair, zero between batches
  void* workspace = nullptr;      // sample_batch_workspace_bytes(slot_cap, edge_cap, words) bytes, device
  std::size_t workspace_bytes = 0;
  std::int64_t slot_cap = 0;     // >= max(batch, edge_cap)
  std::int64_t edge_cap = 0;     // the batch's edges over all hops, at most
  std::int64_t* host = nullptr;  // pinned host memory, 4 int64
  // The outputs (device, int64, node_cap + 3 * edge_cap): n_id at [0, node_cap) (node_cap >= batch + edge_cap),
  // the CSC positions at [node_cap, node_cap + edge_cap), then edge_index's rows, [2, E], from node_cap + edge_cap.
  std::int64_t* out = nullptr;
  std::int64_t node_cap = 0;
  int device = -1;  // the CUDA device the buffers and the stream are on (made current for the call; -1: current)
};

enum class sample_batch_status : std::int64_t { done = 0, error = 1, overflow = 2 };

struct sample_batch_result {
  sample_batch_status status = sample_batch_status::done;
  std::int64_t error_kind = 0;  // status error: a sample_error and its value
  std::int64_t error_value = 0;
  std::int64_t needed_edges = 0;        // status overflow: the edges through the hop that did not fit, at least
  std::vector<std::int64_t> num_nodes;  // hops + 1: the seeds, then each hop's new nodes
  std::vector<std::int64_t> num_edges;  // hops
};

// The workspace a batch needs (take counts and their sum per frontier slot, the sources and destinations of the
// edges, popcounts and their sum, the device sums' scratch).
std::size_t sample_batch_workspace_bytes(std::int64_t slot_cap, std::int64_t edge_cap, std::int64_t words);

// Samples the batch on `stream`, which it waits on once per hop; the outputs are ready on the stream when it returns.
// On status error the id map, bitmap and error pair hold the batch's partial state (the caller resets them).
sample_batch_result sample_batch_cuda(const sample_graph& g, const sample_batch_args& a,
                                      shared_cuda::stream_view stream);

}  // namespace pytorch_direct
