#include "ssdtrain/backends.hpp"

#include <dlfcn.h>

#include <cstring>

#include "shared_cuda/device.hpp"

#if SSDTRAIN_HAS_URING
#include <liburing.h>
#endif

namespace ssdtrain {

backend_status io_uring_status() {
  backend_status status;
#if SSDTRAIN_HAS_URING
  status.compiled = true;
  io_uring ring{};
  const int ret = io_uring_queue_init(8, &ring, 0);
  if (ret < 0) {
    status.detail = std::string("the kernel refused a ring: ") + std::strerror(-ret);
    return status;
  }
  io_uring_queue_exit(&ring);
  status.usable = true;
  status.detail = "liburing " SSDTRAIN_URING_VERSION;  // from pkg-config: liburing 2.3 has no version macros
#else
  status.detail = "not built (liburing-dev was not found at build time)";
#endif
  return status;
}

backend_status cufile_status() {
  backend_status status;
  status.compiled = shared_cuda::compiled_with_cuda();
  if (!status.compiled) {
    status.detail = "not built (no CUDA at build time)";
    return status;
  }
  for (const char* name : {"libcufile.so.0", "libcufile.so", "/usr/local/cuda/lib64/libcufile.so.0"}) {
    if (void* handle = dlopen(name, RTLD_NOW | RTLD_LOCAL)) {
      dlclose(handle);
      status.usable = shared_cuda::cuda_available();
      status.detail = std::string(name) + (status.usable ? "" : " found, but no GPU is usable");
      return status;
    }
  }
  status.detail = "libcufile not found";
  return status;
}

}  // namespace ssdtrain
