// Bindings for row gather/scatter and host memory owners. Pointers arrive as ints (tensor.data_ptr()) and the
// stream as torch.cuda.current_stream().cuda_stream; validation lives in the Python layer (pytorch_direct._ops).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/unique_ptr.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <variant>

#include "pytorch_direct/rows.hpp"
#include "shared_cuda/memory.hpp"
#include "shared_cuda/stream.hpp"

namespace nb = nanobind;

namespace pytorch_direct::bindings {
namespace {

rows_call make_call(std::uintptr_t table, std::int64_t rows, std::int64_t row_bytes, std::uintptr_t index,
                    int index_bytes, std::int64_t count, std::uintptr_t positions, std::uintptr_t dense) {
  rows_call c;
  c.table = reinterpret_cast<void*>(table);
  c.rows = rows;
  c.row_bytes = row_bytes;
  c.index = reinterpret_cast<const void*>(index);
  c.index_bytes = index_bytes;
  c.count = count;
  c.positions = reinterpret_cast<const std::int64_t*>(positions);
  c.dense = reinterpret_cast<void*>(dense);
  return c;
}

// Owner of a unified tensor's memory: a pinned or managed allocation, a page-aligned pageable one (CPU-only
// machines), or a registration of memory owned by `keep` (the tensor it came from, kept alive as long as this owner
// lives).
struct host_memory {
  host_memory() = default;
  host_memory(const host_memory&) = delete;
  host_memory& operator=(const host_memory&) = delete;
  ~host_memory() {
    if (kind != host_kind::none) untrack_host_range(data);
  }
  std::variant<shared_cuda::pinned_buffer, shared_cuda::host_managed_buffer, shared_cuda::aligned_host_buffer,
               shared_cuda::host_registration>
      owner;
  nb::object keep;
  void* data = nullptr;
  std::size_t bytes = 0;
  host_kind kind = host_kind::none;
};

// A host_memory owning `buffer` (any of host_memory::owner's kinds), tracked unless `kind` is none.
template <class Buffer>
std::unique_ptr<host_memory> own(Buffer buffer, host_kind kind) {
  auto h = std::make_unique<host_memory>();
  h->data = buffer.data();
  h->bytes = buffer.size();
  h->owner = std::move(buffer);
  h->kind = kind;
  if (kind != host_kind::none) track_host_range(h->data, h->bytes, kind);
  return h;
}

#define PD_ROWS_ARGS                                                                                                   \
  nb::arg("table"), nb::arg("rows"), nb::arg("row_bytes"), nb::arg("index"), nb::arg("index_bytes"), nb::arg("count"), \
      nb::arg("positions"), nb::arg("dense")

}  // namespace

void bind_rows(nb::module_& m) {
  m.def("kernels_compiled", &kernels_compiled);
  m.def("set_host_spin_us", &set_host_spin_us, nb::arg("microseconds"));
  m.def(
      "gather_cuda",
      [](std::uintptr_t t, std::int64_t rows, std::int64_t rb, std::uintptr_t i, int ib, std::int64_t n,
         std::uintptr_t pos, std::uintptr_t d, int kind, int max_sms, std::uintptr_t stream, std::uintptr_t dcount) {
        rows_call c = make_call(t, rows, rb, i, ib, n, pos, d);
        c.device_count = reinterpret_cast<const std::int64_t*>(dcount);
        gather_cuda(c, static_cast<kernel_kind>(kind), max_sms, shared_cuda::stream_view::from_address(stream));
      },
      PD_ROWS_ARGS, nb::arg("kind"), nb::arg("max_sms"), nb::arg("stream"), nb::arg("device_count") = 0);
  m.def(
      "gather_cached_cuda",
      [](std::uintptr_t t, std::int64_t rows, std::int64_t rb, std::uintptr_t i, int ib, std::int64_t n,
         std::uintptr_t pos, std::uintptr_t d, std::uintptr_t slot_of_row, std::uintptr_t cache, bool refresh,
         int max_sms, std::uintptr_t stream) {
        rows_call c = make_call(t, rows, rb, i, ib, n, pos, d);
        c.slot_of_row = reinterpret_cast<const std::int32_t*>(slot_of_row);
        c.cache = reinterpret_cast<void*>(cache);
        gather_cached_cuda(c, refresh, max_sms, shared_cuda::stream_view::from_address(stream));
      },
      PD_ROWS_ARGS, nb::arg("slot_of_row"), nb::arg("cache"), nb::arg("refresh"), nb::arg("max_sms"),
      nb::arg("stream"));
  m.def(
      "scatter_cuda",
      [](std::uintptr_t t, std::int64_t rows, std::int64_t rb, std::uintptr_t i, int ib, std::int64_t n,
         std::uintptr_t pos, std::uintptr_t d, int kind, int max_sms, std::uintptr_t stream) {
        scatter_cuda(make_call(t, rows, rb, i, ib, n, pos, d), static_cast<kernel_kind>(kind), max_sms,
                     shared_cuda::stream_view::from_address(stream));
      },
      PD_ROWS_ARGS, nb::arg("kind"), nb::arg("max_sms"), nb::arg("stream"));
  m.def(
      "gather_host",
      [](std::uintptr_t t, std::int64_t rows, std::int64_t rb, std::uintptr_t i, int ib, std::int64_t n,
         std::uintptr_t pos, std::uintptr_t d,
         int threads) { gather_host(make_call(t, rows, rb, i, ib, n, pos, d), threads); },
      PD_ROWS_ARGS, nb::arg("threads"), nb::call_guard<nb::gil_scoped_release>());
  m.def(
      "scatter_host",
      [](std::uintptr_t t, std::int64_t rows, std::int64_t rb, std::uintptr_t i, int ib, std::int64_t n,
         std::uintptr_t pos, std::uintptr_t d,
         int threads) { scatter_host(make_call(t, rows, rb, i, ib, n, pos, d), threads); },
      PD_ROWS_ARGS, nb::arg("threads"), nb::call_guard<nb::gil_scoped_release>());
  m.def(
      "gather_staged",
      [](std::uintptr_t t, std::int64_t rows, std::int64_t rb, std::uintptr_t i, int ib, std::int64_t n,
         std::uintptr_t d, int threads, std::uintptr_t stream, bool index_on_device) {
        gather_staged(make_call(t, rows, rb, i, ib, n, 0, d), threads, shared_cuda::stream_view::from_address(stream),
                      index_on_device);
      },
      nb::arg("table"), nb::arg("rows"), nb::arg("row_bytes"), nb::arg("index"), nb::arg("index_bytes"),
      nb::arg("count"), nb::arg("dense"), nb::arg("threads"), nb::arg("stream"), nb::arg("index_on_device") = false,
      nb::call_guard<nb::gil_scoped_release>());
  m.def(
      "scatter_staged",
      [](std::uintptr_t t, std::int64_t rows, std::int64_t rb, std::uintptr_t i, int ib, std::int64_t n,
         std::uintptr_t d, int threads, std::uintptr_t stream) {
        scatter_staged(make_call(t, rows, rb, i, ib, n, 0, d), threads, shared_cuda::stream_view::from_address(stream));
      },
      nb::arg("table"), nb::arg("rows"), nb::arg("row_bytes"), nb::arg("index"), nb::arg("index_bytes"),
      nb::arg("count"), nb::arg("dense"), nb::arg("threads"), nb::arg("stream"),
      nb::call_guard<nb::gil_scoped_release>());
  m.def(
      "check_host_indices",
      [](std::uintptr_t index, int index_bytes, std::int64_t count, std::int64_t rows, int threads) {
        check_host_indices(reinterpret_cast<const void*>(index), index_bytes, count, rows, threads);
      },
      nb::call_guard<nb::gil_scoped_release>());
  m.def(
      "index_bounds_cuda",
      [](std::uintptr_t index, int index_bytes, std::int64_t count, std::uintptr_t stream) {
        std::int64_t lo = 0;
        std::int64_t hi = 0;
        index_bounds_cuda(reinterpret_cast<const void*>(index), index_bytes, count,
                          shared_cuda::stream_view::from_address(stream), lo, hi);
        return std::make_pair(lo, hi);
      },
      nb::arg("index"), nb::arg("index_bytes"), nb::arg("count"), nb::arg("stream"),
      nb::call_guard<nb::gil_scoped_release>());
  m.def(
      "index_bounds_start",
      [](std::uintptr_t index, int index_bytes, std::int64_t count, std::uintptr_t stream) {
        index_bounds_start(reinterpret_cast<const void*>(index), index_bytes, count,
                           shared_cuda::stream_view::from_address(stream));
      },
      nb::arg("index"), nb::arg("index_bytes"), nb::arg("count"), nb::arg("stream"));
  m.def(
      "index_bounds_finish",
      []() {
        std::int64_t lo = 0;
        std::int64_t hi = 0;
        index_bounds_finish(lo, hi);
        return std::make_pair(lo, hi);
      },
      nb::call_guard<nb::gil_scoped_release>());
  m.def("take_device_error", []() -> std::optional<std::int64_t> {
    std::int64_t bad = 0;
    if (take_device_error(bad)) return bad;
    return std::nullopt;
  });
  m.def("tracked_host_kind", [](std::uintptr_t data, std::size_t bytes) {
    return static_cast<int>(tracked_host_kind(reinterpret_cast<const void*>(data), bytes));
  });
  m.def("is_device_accessible_host", [](std::uintptr_t data, std::size_t bytes) {
    return is_device_accessible_host(reinterpret_cast<const void*>(data), bytes);
  });

  nb::class_<host_memory>(m, "HostMemory")
      .def_ro("bytes", &host_memory::bytes)
      .def_prop_ro("kind", [](const host_memory& h) { return static_cast<int>(h.kind); })
      .def_prop_ro("address", [](const host_memory& h) { return reinterpret_cast<std::uintptr_t>(h.data); })
      // A flat uint8 tensor over the memory; it keeps this owner alive (DLPack deleter), and so do its views.
      .def("tensor", [](nb::handle self) {
        const auto& h = nb::cast<const host_memory&>(self);
        const std::size_t shape[1] = {h.bytes};
        return nb::ndarray<nb::pytorch, std::uint8_t, nb::ndim<1>>(h.data, 1, shape, self);
      });
  m.def("pinned_memory", [](std::size_t bytes) { return own(shared_cuda::pinned_buffer(bytes), host_kind::pinned); });
  m.def("managed_host_supported", &shared_cuda::host_managed_buffer::supported);
  m.def(
      "managed_memory",
      [](std::size_t bytes) { return own(shared_cuda::host_managed_buffer(bytes), host_kind::managed); },
      nb::call_guard<nb::gil_scoped_release>());  // touching many GiB takes seconds
  m.def("pageable_memory",
        [](std::size_t bytes) { return own(shared_cuda::aligned_host_buffer(bytes, 4096), host_kind::none); });
  m.def(
      "register_memory",
      [](std::uintptr_t data, std::size_t bytes, nb::object keep) {
        auto h = own(shared_cuda::host_registration(reinterpret_cast<void*>(data), bytes), host_kind::pinned);
        h->keep = std::move(keep);
        return h;
      },
      nb::arg("data"), nb::arg("bytes"), nb::arg("keep"));
  m.def("registered_bytes", &shared_cuda::host_registration::registered_bytes);
}

}  // namespace pytorch_direct::bindings
