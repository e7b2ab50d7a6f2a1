// Bindings for the sampler kernels (sample.hpp). Pointers arrive as ints (tensor.data_ptr(), 0 for none) and the
// stream as torch.cuda.current_stream().cuda_stream; sizes and dtypes are checked by the Python layer
// (pytorch_direct._sample_cuda). Each releases the GIL while it launches (a loader thread's launches then leave the
// interpreter to the training thread); sample_batch_cuda, a whole batch, also while it waits on the stream.
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "pytorch_direct/sample.hpp"
#include "shared_cuda/stream.hpp"

namespace nb = nanobind;

namespace pytorch_direct::bindings {
namespace {

template <class T>
T* ptr(std::uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

}  // namespace

void bind_sample(nb::module_& m) {
  m.def(
      "sample_take_cuda",
      [](std::uintptr_t colptr, int colptr_code, std::uintptr_t row, int row_code, std::int64_t num_nodes,
         std::int64_t num_edges, std::uintptr_t edge_type, int edge_type_code, std::int64_t num_types,
         std::uintptr_t frontier, std::int64_t slots, std::uintptr_t valid, int fanout, std::uintptr_t fan_row,
         bool replace, std::uintptr_t seed_local, std::uintptr_t take, std::uintptr_t error, std::uintptr_t stream) {
        sample_take_cuda(sample_graph::from_addresses(colptr, colptr_code, row, row_code, num_nodes, num_edges,
                                                      edge_type, edge_type_code, num_types),
                         ptr<const std::int64_t>(frontier), slots, ptr<const std::int64_t>(valid), fanout,
                         ptr<const std::int64_t>(fan_row), replace, ptr<std::int32_t>(seed_local),
                         ptr<std::int64_t>(take), ptr<std::int64_t>(error),
                         shared_cuda::stream_view::from_address(stream));
      },
      nb::call_guard<nb::gil_scoped_release>());
  m.def(
      "sample_edges_cuda",
      [](std::uintptr_t colptr, int colptr_code, std::uintptr_t row, int row_code, std::int64_t num_nodes,
         std::int64_t num_edges, std::uintptr_t edge_type, int edge_type_code, std::int64_t num_types,
         std::uintptr_t frontier, std::int64_t slots, std::uintptr_t cum, int fanout, std::uintptr_t fan_row,
         bool replace, std::uintptr_t seed, int hop, std::uintptr_t local, std::uintptr_t unseen,
         std::int64_t first_local, std::uintptr_t pos, std::uintptr_t src, std::uintptr_t dst, std::uintptr_t error,
         std::uintptr_t stream) {
        sample_edges_cuda(sample_graph::from_addresses(colptr, colptr_code, row, row_code, num_nodes, num_edges,
                                                       edge_type, edge_type_code, num_types),
                          ptr<const std::int64_t>(frontier), slots, ptr<const std::int64_t>(cum), fanout,
                          ptr<const std::int64_t>(fan_row), replace, ptr<const std::int64_t>(seed), hop,
                          ptr<const std::int32_t>(local), ptr<std::uint32_t>(unseen), first_local,
                          ptr<std::int64_t>(pos), ptr<std::int64_t>(src), ptr<std::int64_t>(dst),
                          ptr<std::int64_t>(error), shared_cuda::stream_view::from_address(stream));
      },
      nb::call_guard<nb::gil_scoped_release>());
  m.def(
      "sample_popcount_cuda",
      [](std::uintptr_t unseen, std::int64_t words, std::uintptr_t counts, std::uintptr_t stream) {
        sample_popcount_cuda(ptr<const std::uint32_t>(unseen), words, ptr<std::int32_t>(counts),
                             shared_cuda::stream_view::from_address(stream));
      },
      nb::call_guard<nb::gil_scoped_release>());
  m.def(
      "sample_number_cuda",
      [](std::uintptr_t src, std::int64_t edges, std::uintptr_t unseen, std::uintptr_t prefix, std::uintptr_t local,
         std::int64_t first_new, std::uintptr_t new_nodes, std::uintptr_t src_local, std::uintptr_t stream) {
        sample_number_cuda(ptr<const std::int64_t>(src), edges, ptr<const std::uint32_t>(unseen),
                           ptr<const std::int64_t>(prefix), ptr<std::int32_t>(local), first_new,
                           ptr<std::int64_t>(new_nodes), ptr<std::int64_t>(src_local),
                           shared_cuda::stream_view::from_address(stream));
      },
      nb::call_guard<nb::gil_scoped_release>());
  m.def("sample_batch_workspace_bytes", &sample_batch_workspace_bytes);
  m.def(
      "sample_batch_cuda",
      [](std::uintptr_t colptr, int colptr_code, std::uintptr_t row, int row_code, std::int64_t num_nodes,
         std::int64_t num_edges, std::uintptr_t edge_type, int edge_type_code, std::int64_t num_types,
         std::uintptr_t seeds, std::int64_t batch, std::vector<int> fanouts, std::uintptr_t fan_table, bool replace,
         std::uintptr_t seed, std::uintptr_t local, std::uintptr_t unseen, std::int64_t words, std::uintptr_t error,
         std::uintptr_t workspace, std::size_t workspace_bytes, std::int64_t slot_cap, std::int64_t edge_cap,
         std::uintptr_t host, std::uintptr_t out, std::int64_t node_cap, int device, std::uintptr_t stream) {
        sample_batch_args a;
        a.seeds = ptr<const std::int64_t>(seeds);
        a.batch = batch;
        a.fanouts = std::move(fanouts);
        a.fan_table = ptr<const std::int64_t>(fan_table);
        a.replace = replace;
        a.seed = ptr<const std::int64_t>(seed);
        a.local = ptr<std::int32_t>(local);
        a.unseen = ptr<std::uint32_t>(unseen);
        a.words = words;
        a.error = ptr<std::int64_t>(error);
        a.workspace = ptr<void>(workspace);
        a.workspace_bytes = workspace_bytes;
        a.slot_cap = slot_cap;
        a.edge_cap = edge_cap;
        a.host = ptr<std::int64_t>(host);
        a.out = ptr<std::int64_t>(out);
        a.node_cap = node_cap;
        a.device = device;
        const std::size_t hops = a.fanouts.size();
        const sample_batch_result r =
            sample_batch_cuda(sample_graph::from_addresses(colptr, colptr_code, row, row_code, num_nodes, num_edges,
                                                           edge_type, edge_type_code, num_types),
                              a, shared_cuda::stream_view::from_address(stream));
        // flat, as the tests' CPU emulation returns it: status, error kind and value, needed edges, the node
        // counts (hops + 1), the edge counts (hops); counts past where an error stopped the batch are 0
        std::vector<std::int64_t> flat{static_cast<std::int64_t>(r.status), r.error_kind, r.error_value,
                                       r.needed_edges};
        flat.resize(4 + 2 * hops + 1, 0);
        for (std::size_t i = 0; i < r.num_nodes.size(); ++i) flat[4 + i] = r.num_nodes[i];
        for (std::size_t i = 0; i < r.num_edges.size(); ++i) flat[4 + hops + 1 + i] = r.num_edges[i];
        return flat;
      },
      nb::call_guard<nb::gil_scoped_release>());
}

}  // namespace pytorch_direct::bindings
