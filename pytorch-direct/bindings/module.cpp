// pytorch_direct._core: one NB_MODULE calling each area's bind function.
#include <nanobind/nanobind.h>

#include "shared_cuda_bindings.hpp"

NB_MODULE(_core, m) {
  m.doc() = "pytorch_direct's compiled core (private; use the pytorch_direct package)";
  shared_cuda::bindings::bind_shared(m);
}
