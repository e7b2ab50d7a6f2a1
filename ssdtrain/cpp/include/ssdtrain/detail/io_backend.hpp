// The block-level interface every backend implements: submit one read or write of a contiguous range; a callback
// reports the bytes moved or -errno, on a thread the backend owns. Backends handle short transfers themselves.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace ssdtrain::detail {

struct io_request {
  int file = 0;  // index into the store's files (fixed-file index for io_uring)
  int fd = -1;
  std::uint64_t offset = 0;
  void* buffer = nullptr;
  std::size_t bytes = 0;
  bool write = false;
  int fixed_buffer = -1;  // index of a buffer registered with the backend, or -1
  int device = -1;        // GPU index when buffer is device memory (gds backend only), -1 for host
  std::size_t moved = 0;  // bytes already moved by earlier partial transfers (backend use)
  std::function<void(long result)> done;
};

class io_backend {
 public:
  virtual ~io_backend() = default;
  virtual void submit(io_request request) = 0;
  virtual std::string name() const = 0;
  virtual std::string detail() const = 0;
  virtual bool handles_device_memory() const { return false; }
};

// Each factory throws unavailable_error (with the reason) when the backend cannot run here.
std::unique_ptr<io_backend> make_io_uring_backend(const std::vector<int>& fds, unsigned queue_depth,
                                                  const std::vector<std::pair<void*, std::size_t>>& fixed_buffers);
std::unique_ptr<io_backend> make_threads_backend(unsigned threads);
// cuFile for device buffers, pread/pwrite threads for host buffers.
std::unique_ptr<io_backend> make_gds_backend(const std::vector<int>& fds, unsigned threads, const std::string& library);

}  // namespace ssdtrain::detail
