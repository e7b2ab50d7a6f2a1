// hector._core: the shared layer (device query, JIT loader that runs the generated kernels, exceptions).
#include <nanobind/nanobind.h>

#include "shared_cuda_bindings.hpp"

NB_MODULE(_core, m) {
  m.doc() = "hector's compiled core (private; use the hector package)";
  shared_cuda::bindings::bind_shared(m);
}
