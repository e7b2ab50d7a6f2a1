// The block-level interface every backend implements: submit one read or write of a contiguous range; a callback
// reports the bytes moved or -errno, on a thread the backend owns. Backends handle short transfers themselves.
#pragma once

#include <atomic>
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
  // Requests inside the kernel/device right now (io_uring: in the ring; threads: being transferred), and the peak.
  std::uint64_t depth() const noexcept { return depth_.load(std::memory_order_relaxed); }
  std::uint64_t peak_depth() const noexcept { return peak_depth_.load(std::memory_order_relaxed); }

 protected:
  void depth_changed(long delta) noexcept {
    const std::uint64_t now = depth_.fetch_add(delta, std::memory_order_relaxed) + delta;
    std::uint64_t seen = peak_depth_.load(std::memory_order_relaxed);
    while (seen < now && !peak_depth_.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
    }
  }

 private:
  std::atomic<std::uint64_t> depth_{0}, peak_depth_{0};
};

// Each factory throws unavailable_error (with the reason) when the backend cannot run here.
std::unique_ptr<io_backend> make_io_uring_backend(const std::vector<int>& fds, unsigned queue_depth,
                                                  const std::vector<std::pair<void*, std::size_t>>& fixed_buffers);
std::unique_ptr<io_backend> make_threads_backend(unsigned threads);
// cuFile for device buffers, pread/pwrite threads for host buffers.
std::unique_ptr<io_backend> make_gds_backend(const std::vector<int>& fds, unsigned threads, const std::string& library);

}  // namespace ssdtrain::detail
