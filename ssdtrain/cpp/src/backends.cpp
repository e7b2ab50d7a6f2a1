#include "ssdtrain/backends.hpp"

#include <dlfcn.h>

#include <unistd.h>

#include <cstring>
#include <vector>

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

backend_status cufile_status(const std::string& library) {
  backend_status status;
  status.compiled = shared_cuda::compiled_with_cuda();
  if (!status.compiled) {
    status.detail = "not built (no CUDA at build time)";
    return status;
  }
  std::vector<std::string> names;
  if (!library.empty()) names.push_back(library);
  for (const char* n : {"libcufile.so.0", "libcufile.so", "/usr/local/cuda/lib64/libcufile.so.0"}) names.push_back(n);
  for (const auto& name : names) {
    if (void* handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL)) {
      dlclose(handle);
      status.usable = shared_cuda::cuda_available();
      // Without the nvidia-fs module cuFile runs in compatibility mode (POSIX I/O through its own bounce buffers).
      const bool nvfs = ::access("/proc/driver/nvidia-fs/stats", F_OK) == 0;
      status.detail = name + (status.usable ? (nvfs ? ": GPUDirect Storage (nvidia-fs loaded)"
                                                    : ": compatibility mode (no nvidia-fs); auto prefers io_uring")
                                            : " found, but no GPU is usable");
      return status;
    }
  }
  status.detail = "libcufile not found";
  return status;
}

}  // namespace ssdtrain
