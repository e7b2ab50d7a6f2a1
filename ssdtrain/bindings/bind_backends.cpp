#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

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
}
