// pytorch_direct._core: one NB_MODULE calling each area's bind function.
#include <nanobind/nanobind.h>

#include "shared_cuda_bindings.hpp"

namespace pytorch_direct::bindings {
void bind_rows(nanobind::module_& m);
void bind_sample(nanobind::module_& m);
}  // namespace pytorch_direct::bindings

NB_MODULE(_core, m) {
  m.doc() = "pytorch_direct's compiled core (private; use the pytorch_direct package)";
  // bind_shared also switches nanobind's leak report off (tensors alive at exit hold HostMemory owners).
  shared_cuda::bindings::bind_shared(m);
  pytorch_direct::bindings::bind_rows(m);
  pytorch_direct::bindings::bind_sample(m);
}
