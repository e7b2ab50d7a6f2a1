// ssdtrain._core: one NB_MODULE calling each area's bind function.
#include <nanobind/nanobind.h>

#include "shared_cuda_bindings.hpp"

void bind_backends(nanobind::module_& m);
void bind_engine(nanobind::module_& m);

NB_MODULE(_core, m) {
  m.doc() = "ssdtrain's compiled core (private; use the ssdtrain package)";
  shared_cuda::bindings::bind_shared(m);
  bind_backends(m);
  bind_engine(m);
}
