// Engine, operation and config bindings. Memory arrives as raw addresses (tensor.data_ptr()), with the device index
// and the CUDA stream address; the Python layer validates tensors and keeps them alive while transfers run.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include "ssdtrain/engine.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace {
shared_cuda::memory_view view(std::uintptr_t address, std::size_t bytes, int device) {
  return {reinterpret_cast<void*>(address), bytes, device};
}
}  // namespace

void bind_engine(nb::module_& m) {
  using ssdtrain::engine_config;
  nb::class_<ssdtrain::fault_spec>(m, "FaultSpec")
      .def(nb::init<>())
      .def_rw("op", &ssdtrain::fault_spec::op)
      .def_rw("error", &ssdtrain::fault_spec::error)
      .def_rw("after_bytes", &ssdtrain::fault_spec::after_bytes);

  nb::class_<engine_config>(m, "EngineConfig")
      .def(nb::init<>())
      .def_rw("directories", &engine_config::directories)
      .def_rw("capacity_per_directory", &engine_config::capacity_per_directory)
      .def_rw("preallocate_per_directory", &engine_config::preallocate_per_directory)
      .def_rw("grow_step", &engine_config::grow_step)
      .def_rw("backend", &engine_config::backend)
      .def_rw("queue_depth", &engine_config::queue_depth)
      .def_rw("block_size", &engine_config::block_size)
      .def_prop_rw(
          "direct",
          [](const engine_config& c) {
            return c.direct == ssdtrain::direct_mode::on    ? "on"
                   : c.direct == ssdtrain::direct_mode::off ? "off"
                                                            : "auto";
          },
          [](engine_config& c, const std::string& v) {
            c.direct = v == "on"    ? ssdtrain::direct_mode::on
                       : v == "off" ? ssdtrain::direct_mode::off
                                    : ssdtrain::direct_mode::automatic;
          })
      .def_rw("checksum", &engine_config::checksum)
      .def_rw("staging_buffers", &engine_config::staging_buffers)
      .def_rw("stage_host", &engine_config::stage_host)
      .def_rw("threads", &engine_config::threads)
      .def_rw("stripe_threshold", &engine_config::stripe_threshold)
      .def_rw("cufile_library", &engine_config::cufile_library)
      .def_rw("fault", &engine_config::fault);

  nb::class_<ssdtrain::operation>(m, "Operation")
      .def("done", &ssdtrain::operation::done)
      .def("staged", &ssdtrain::operation::staged)
      .def("wait", &ssdtrain::operation::wait, "timeout"_a = -1.0, nb::call_guard<nb::gil_scoped_release>())
      .def("get", &ssdtrain::operation::get, nb::call_guard<nb::gil_scoped_release>())
      .def("failed", [](const ssdtrain::operation& op) { return op.done() && op.error() != nullptr; })
      .def_prop_ro("bytes", &ssdtrain::operation::bytes)
      .def_prop_ro("is_write", &ssdtrain::operation::is_write)
      .def_prop_ro("seconds", &ssdtrain::operation::seconds);

  nb::class_<ssdtrain::engine>(m, "Engine")
      .def(nb::init<engine_config>(), nb::call_guard<nb::gil_scoped_release>())
      .def(
          "write",
          [](ssdtrain::engine& e, std::uintptr_t address, std::size_t bytes, int device, std::uintptr_t stream,
             int stage_host) { return e.write(view(address, bytes, device), stream, stage_host); },
          "address"_a, "bytes"_a, "device"_a, "stream"_a, "stage_host"_a = -1, nb::call_guard<nb::gil_scoped_release>())
      .def(
          "read",
          [](ssdtrain::engine& e, std::uint64_t handle, std::uintptr_t address, std::size_t bytes, int device,
             std::uintptr_t stream,
             int stage_host) { return e.read(handle, view(address, bytes, device), stream, stage_host); },
          "handle"_a, "address"_a, "bytes"_a, "device"_a, "stream"_a, "stage_host"_a = -1,
          nb::call_guard<nb::gil_scoped_release>())
      .def("free", &ssdtrain::engine::free)
      .def("handle_bytes", &ssdtrain::engine::handle_bytes)
      .def("live_handles", &ssdtrain::engine::live_handles)
      .def("backend", &ssdtrain::engine::backend)
      .def("backend_detail", &ssdtrain::engine::backend_detail)
      .def("drain", &ssdtrain::engine::drain, nb::call_guard<nb::gil_scoped_release>())
      .def("corrupt_for_test", &ssdtrain::engine::corrupt_for_test)
      .def("directories",
           [](const ssdtrain::engine& e) {
             nb::list out;
             for (const auto& d : e.directories()) {
               nb::dict x;
               x["path"] = d.path;
               x["tmpfile"] = d.tmpfile;
               x["direct"] = d.direct;
               x["file_bytes"] = d.file_bytes;
               x["bytes_in_use"] = d.bytes_in_use;
               x["capacity"] = d.capacity;
               x["fd"] = d.fd;
               out.append(x);
             }
             return out;
           })
      .def("stats", [](const ssdtrain::engine& e) {
        const auto t = e.stats();
        nb::dict d;
        d["bytes_written"] = t.bytes_written;
        d["bytes_read"] = t.bytes_read;
        d["write_ops"] = t.write_ops;
        d["read_ops"] = t.read_ops;
        d["write_blocks"] = t.write_blocks;
        d["read_blocks"] = t.read_blocks;
        d["write_active_ns"] = t.write_active_ns;
        d["read_active_ns"] = t.read_active_ns;
        d["disk_bytes_written"] = t.disk_bytes_written;
        d["errors"] = t.errors;
        d["checksum_failures"] = t.checksum_failures;
        d["inflight_blocks"] = t.inflight_blocks;
        d["peak_inflight_blocks"] = t.peak_inflight_blocks;
        d["queue_depth_in_use"] = t.queue_depth_in_use;
        d["peak_queue_depth"] = t.peak_queue_depth;
        d["wait_ns"] = t.wait_ns;
        d["staged_copies"] = t.staged_copies;
        d["bytes_in_use"] = t.bytes_in_use;
        d["file_bytes"] = t.file_bytes;
        d["staging_address"] = t.staging_address;
        d["staging_bytes"] = t.staging_bytes;
        return d;
      });

  m.def(
      "crc32c", [](nb::bytes data, std::uint32_t crc) { return ssdtrain::crc32c(data.c_str(), data.size(), crc); },
      "data"_a, "crc"_a = 0);
  m.def(
      "crc32c_address",
      [](std::uintptr_t address, std::size_t bytes, std::uint32_t crc) {
        return ssdtrain::crc32c(reinterpret_cast<const void*>(address), bytes, crc);
      },
      "address"_a, "bytes"_a, "crc"_a = 0, nb::call_guard<nb::gil_scoped_release>());
}
