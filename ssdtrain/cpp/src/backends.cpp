#include "ssdtrain/backends.hpp"

#include <dlfcn.h>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <vector>

#include "shared_cuda/device.hpp"
#include "shared_cuda/error.hpp"

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

double raw_transfer(int fd, void* buffer, std::uint64_t bytes, std::size_t block, unsigned depth, bool write) {
  SHARED_CUDA_EXPECT(block >= 4096 && block % 4096 == 0, "ssdtrain: raw_transfer block must be a multiple of 4096");
  SHARED_CUDA_EXPECT(depth >= 1 && depth <= 4096, "ssdtrain: raw_transfer depth must be in [1, 4096]");
  SHARED_CUDA_EXPECT(bytes > 0 && buffer != nullptr, "ssdtrain: raw_transfer needs a buffer and a size");
#if SSDTRAIN_HAS_URING
  io_uring ring{};
  int ret = io_uring_queue_init(depth, &ring, 0);
  if (ret < 0)
    throw shared_cuda::unavailable_error(std::string("ssdtrain: the kernel refused an io_uring: ") +
                                         std::strerror(-ret));
  struct ring_guard {
    io_uring* r;
    ~ring_guard() { io_uring_queue_exit(r); }
  } guard{&ring};
  char* base = static_cast<char*>(buffer);
  std::uint64_t next = 0;  // first byte not yet submitted
  unsigned inflight = 0;
  int error = 0;
  const auto t0 = std::chrono::steady_clock::now();
  while (next < bytes || inflight > 0) {
    while (next < bytes && inflight < depth && error == 0) {
      io_uring_sqe* sqe = io_uring_get_sqe(&ring);
      if (sqe == nullptr) break;
      const auto n = static_cast<unsigned>(std::min<std::uint64_t>(block, bytes - next));
      if (write)
        io_uring_prep_write(sqe, fd, base + next, n, next);
      else
        io_uring_prep_read(sqe, fd, base + next, n, next);
      io_uring_sqe_set_data64(sqe, (static_cast<std::uint64_t>(n) << 40) | next);
      next += n;
      ++inflight;
    }
    if (error != 0 && inflight == 0) break;
    ret = io_uring_submit_and_wait(&ring, 1);
    if (ret < 0 && ret != -EINTR) throw shared_cuda::io_error(-ret, "ssdtrain: io_uring_submit_and_wait failed");
    io_uring_cqe* cqe = nullptr;
    unsigned head = 0, seen = 0;
    io_uring_for_each_cqe(&ring, head, cqe) {
      const std::uint64_t tag = io_uring_cqe_get_data64(cqe);
      const long asked = static_cast<long>(tag >> 40);
      // A benchmark wants every byte moved by the device in full requests: a short one is an error here.
      if (cqe->res != asked && error == 0) error = cqe->res < 0 ? -cqe->res : EIO;
      ++seen;
    }
    io_uring_cq_advance(&ring, seen);
    inflight -= seen;
    if (error != 0 && next < bytes) next = bytes;  // stop submitting; collect what is in flight
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (error != 0)
    throw shared_cuda::io_error(error, std::string("ssdtrain: raw ") + (write ? "write" : "read") + " of " +
                                           std::to_string(bytes) + " bytes failed");
  return seconds;
#else
  (void)fd, (void)write;
  throw shared_cuda::unavailable_error("ssdtrain: raw_transfer needs io_uring (liburing-dev at build time)");
#endif
}

}  // namespace ssdtrain
