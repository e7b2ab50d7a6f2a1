// pytorch_direct._core: one NB_MODULE calling each area's bind function.
#include <nanobind/nanobind.h>

#include "shared_cuda_bindings.hpp"

namespace pytorch_direct::bindings {
void bind_rows(nanobind::module_& m);
}

NB_MODULE(_core, m) {
  m.doc() = "pytorch_direct's compiled core (private; use the pytorch_direct package)";
  // Tensors still alive at interpreter exit (module globals) hold HostMemory owners through DLPack; torch does not
  // free them at shutdown, so nanobind's leak report would be noise.
  nanobind::set_leak_warnings(false);
  shared_cuda::bindings::bind_shared(m);
  pytorch_direct::bindings::bind_rows(m);
}
