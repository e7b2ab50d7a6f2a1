#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstdint>

#include "ssdtrain/backends.hpp"

namespace nb = nanobind;

namespace {
nb::dict to_dict(const ssdtrain::backend_status& s) {
  nb::dict d;
  d["compiled"] = s.compiled;
  d["usable"] = s.usable;
  d["detail"] = s.detail;
  return d;
}
}  // namespace

void bind_backends(nb::module_& m) {
  m.def("io_uring_status", [] { return to_dict(ssdtrain::io_uring_status()); });
  m.def(
      "cufile_status", [](const std::string& library) { return to_dict(ssdtrain::cufile_status(library)); },
      nb::arg("library") = "");
  // The disk's raw rate for benchmarks (see backends.hpp): address is a host pointer (e.g. tensor.data_ptr()).
  m.def(
      "raw_transfer",
      [](int fd, std::uintptr_t address, std::uint64_t bytes, std::size_t block, unsigned depth, bool write) {
        return ssdtrain::raw_transfer(fd, reinterpret_cast<void*>(address), bytes, block, depth, write);
      },
      nb::arg("fd"), nb::arg("address"), nb::arg("bytes"), nb::arg("block"), nb::arg("depth"), nb::arg("write"),
      nb::call_guard<nb::gil_scoped_release>());
}
