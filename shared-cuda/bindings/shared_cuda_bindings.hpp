// nanobind bindings for shared-cuda, compiled into each package's _core module: exception translation, device
// query and the JIT loader. Kept apart from the core library, which includes no Python headers.
#pragma once

#include <nanobind/nanobind.h>

namespace shared_cuda::bindings {

// Registers CudaError, CompileError and UnavailableError on `m`, the C++ -> Python exception mapping, and the
// functions and classes of the shared layer (see shared-cuda/python/_shared_cuda.py for their Python face).
void bind_shared(nanobind::module_& m);

}  // namespace shared_cuda::bindings
