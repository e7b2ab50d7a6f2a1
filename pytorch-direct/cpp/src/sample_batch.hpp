// A whole batch of sampling (sample.hpp's sample_batch_cuda) over an Ops type that launches the kernels, sums and
// copies: the CUDA one (sample_cuda.cu) and the CPU emulation of the tests (tests/cpp/emulate_sample.cpp), so that
// the orchestration itself is checked on machines without a GPU.
//
// Ops: take / edges / popcount / number / forget (the kernels, sample_kernels.cuh, with their arguments), scan_take
// (inclusive sum of int64 [n]) and scan_counts (inclusive sum of int32 [n] into int64), both given scratch of
// scan_bytes(slot_cap, words) bytes; copy (device to device), zero (device), read (device to host, in order with
// the launches) and wait (until all of them are done).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "pytorch_direct/sample.hpp"
#include "shared_cuda/error.hpp"

namespace pytorch_direct::sample_batch {

// Offsets of the workspace's parts (each aligned to 256 bytes).
struct layout {
  std::size_t take = 0, cum = 0, src = 0, dst = 0, counts = 0, prefix = 0, scan = 0, total = 0;

  layout(std::int64_t slot_cap, std::int64_t edge_cap, std::int64_t words, std::size_t scan_bytes) {
    std::size_t at = 0;
    auto part = [&at](std::size_t bytes) {
      const std::size_t here = at;
      at += (bytes + 255) / 256 * 256;
      return here;
    };
    const auto slots = static_cast<std::size_t>(std::max<std::int64_t>(slot_cap, 1));
    const auto edges = static_cast<std::size_t>(std::max<std::int64_t>(edge_cap, 1));
    const auto w = static_cast<std::size_t>(std::max<std::int64_t>(words, 1));
    take = part(slots * 8);
    cum = part(slots * 8);
    src = part(edges * 8);
    dst = part(edges * 8);
    counts = part(w * 4);
    prefix = part(w * 8);
    scan = part(std::max<std::size_t>(scan_bytes, 1));
    total = at;
  }
};

template <class T>
T* at(void* base, std::size_t offset) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + offset);
}

template <class Ops>
std::size_t workspace_bytes(std::int64_t slot_cap, std::int64_t edge_cap, std::int64_t words) {
  return layout(slot_cap, edge_cap, words, Ops::scan_bytes(slot_cap, words)).total;
}

template <class Ops>
sample_batch_result run(Ops& ops, const sample_graph& g, const sample_batch_args& a) {
  SHARED_CUDA_EXPECT(a.batch >= 0 && a.slot_cap >= a.batch && a.slot_cap >= a.edge_cap && a.edge_cap >= 0,
                     "the sampler's workspace needs a slot per seed and per edge (slot_cap >= batch, edge_cap)");
  SHARED_CUDA_EXPECT(a.node_cap >= a.batch + a.edge_cap, "the batch's n_id needs node_cap >= batch + edge_cap");
  SHARED_CUDA_EXPECT(a.workspace != nullptr && a.out != nullptr && a.host != nullptr && a.local != nullptr &&
                         a.unseen != nullptr && a.error != nullptr && a.seed != nullptr && a.words >= 1,
                     "null sampler buffer (workspace, outputs, host counts, id map, bitmap, error pair or seed)");
  SHARED_CUDA_EXPECT(a.fan_table != nullptr || g.edge_type == nullptr,
                     "a graph with edge types is sampled with a fan-out table");
  const std::size_t scan_bytes = Ops::scan_bytes(a.slot_cap, a.words);
  const layout parts(a.slot_cap, a.edge_cap, a.words, scan_bytes);
  SHARED_CUDA_EXPECT(a.workspace_bytes >= parts.total,
                     "the sampler's workspace is smaller than sample_batch_workspace_bytes");
  auto* take = at<std::int64_t>(a.workspace, parts.take);
  auto* cum = at<std::int64_t>(a.workspace, parts.cum);
  auto* src = at<std::int64_t>(a.workspace, parts.src);
  auto* dst = at<std::int64_t>(a.workspace, parts.dst);
  auto* counts = at<std::int32_t>(a.workspace, parts.counts);
  auto* prefix = at<std::int64_t>(a.workspace, parts.prefix);
  void* scratch = at<char>(a.workspace, parts.scan);
  std::int64_t* n_id = a.out;
  std::int64_t* pos = a.out + a.node_cap;
  std::int64_t* edge_index = pos + a.edge_cap;
  const std::int64_t* last_prefix = prefix + a.words - 1;
  const int hops = static_cast<int>(a.fanouts.size());

  sample_batch_result r;
  r.num_nodes.push_back(a.batch);
  if (a.batch > 0) ops.copy(n_id, a.seeds, a.batch * 8);
  const std::int64_t* frontier = n_id;
  std::int64_t slots = a.batch;  // the frontier's length (its valid part: *valid where set)
  const std::int64_t* valid = nullptr;
  bool pending = false;          // the last hop's new-node count is at last_prefix (it drew edges)
  std::int64_t start = 0;        // the local id of the frontier's first node
  std::int64_t nodes = a.batch;  // nodes in the batch so far
  std::int64_t edges = 0;        // edges so far
  auto failed = [&r](const std::int64_t* pair) {
    if (pair[0] == 0) return false;
    r.status = sample_batch_status::error;
    r.error_kind = pair[0];
    r.error_value = pair[1];
    return true;
  };
  for (int hop = 0; hop < hops; ++hop) {
    if (hop > 0 && !pending) {  // the last hop drew no edge, so found no node
      r.num_nodes.push_back(0);
      r.num_edges.push_back(0);
      continue;
    }
    const int fanout = a.fanouts[static_cast<std::size_t>(hop)];
    const std::int64_t* fan_row = a.fan_table == nullptr ? nullptr : a.fan_table + hop * g.num_types;
    std::int64_t taken = 0;
    if (slots > 0) {
      ops.take(g, frontier, slots, valid, fanout, fan_row, a.replace, hop == 0 ? a.local : nullptr, take, a.error);
      ops.scan_take(scratch, scan_bytes, take, cum, slots);
      ops.read(a.host, cum + slots - 1, 8);
    } else {
      a.host[0] = 0;
    }
    // the hop's one wait: its edge count, the kernels' errors, the last hop's new-node count
    ops.read(a.host + 1, a.error, 16);
    if (pending) ops.read(a.host + 3, last_prefix, 8);
    ops.wait();
    if (failed(a.host + 1)) return r;
    taken = a.host[0];
    if (hop > 0) {
      r.num_nodes.push_back(a.host[3]);
      nodes += a.host[3];
    }
    const std::int64_t first_new = nodes;  // the local id of this hop's first new node
    if (taken == 0) {
      pending = false;
      r.num_edges.push_back(0);
      continue;
    }
    if (edges + taken > a.edge_cap || first_new + taken > a.node_cap) {
      r.status = sample_batch_status::overflow;
      r.needed_edges = edges + taken;
      ops.forget(n_id, nodes, a.local);
      ops.wait();
      return r;
    }
    ops.edges(g, frontier, slots, cum, fanout, fan_row, a.replace, a.seed, hop, a.local, a.unseen, start, pos + edges,
              src, dst + edges, a.error);
    ops.popcount(a.unseen, a.words, counts);
    ops.scan_counts(scratch, scan_bytes, counts, prefix, a.words);
    ops.number(src, taken, a.unseen, prefix, a.local, first_new, n_id + first_new, edge_index + edges);
    ops.zero(a.unseen, a.words * 4);
    pending = true;
    r.num_edges.push_back(taken);
    edges += taken;
    frontier = n_id + first_new;
    slots = taken;
    valid = last_prefix;
    start = first_new;
  }
  if (hops > 0) {  // the last hop's new-node count (and the last kernels' errors)
    if (pending) {
      ops.read(a.host + 1, a.error, 16);
      ops.read(a.host + 3, last_prefix, 8);
      ops.wait();
      if (failed(a.host + 1)) return r;
      r.num_nodes.push_back(a.host[3]);
      nodes += a.host[3];
    } else {
      r.num_nodes.push_back(0);
    }
  }
  // edge_index's second row right after the first; the id map back to -1 for the next batch
  if (edges > 0) ops.copy(edge_index + edges, dst, edges * 8);
  if (nodes > 0) ops.forget(n_id, nodes, a.local);
  return r;
}

}  // namespace pytorch_direct::sample_batch
