// The I/O engine: moves tensor bytes between memory (host or GPU) and per-process files on one or more directories.
//
//   engine e(config);
//   auto [handle, op] = e.write(src_view, stream);   // asynchronous; op->wait() or op->done()
//   auto op2 = e.read(handle, dst_view, stream);     // ordered after the write; verifies the checksum if enabled
//   e.free(handle);                                  // space returns to the extent allocator
//
// The caller keeps the memory of a transfer alive and unchanged until the operation is done (the Python layer
// holds the tensor for it). Every failure reaches the waiter of the operation as an exception (io_error with errno,
// invalid_argument, ...): nothing is only logged. Device memory (view.device >= 0) moves through a pool of pinned
// staging buffers (or directly with cuFile under the gds backend); host memory moves directly when it is aligned
// for O_DIRECT and through the staging pool otherwise.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "shared_cuda/memory.hpp"

namespace ssdtrain {

enum class direct_mode { automatic, on, off };

// Test hook: make block I/O of one direction fail with `error` once that many bytes of it were submitted.
struct fault_spec {
  std::string op;  // "", "write", "read", or "direct" (the file system refuses O_DIRECT)
  int error = 0;   // errno reported for each failing block
  std::uint64_t after_bytes = 0;
};

struct engine_config {
  std::vector<std::string> directories;
  std::uint64_t capacity_per_directory = 0;     // hard cap on each directory's file size (bytes), > 0
  std::uint64_t preallocate_per_directory = 0;  // bytes reserved with fallocate when the engine starts
  std::uint64_t grow_step = 256ull << 20;       // files grow (fallocate) by at least this much when full
  std::string backend = "auto";                 // auto, io_uring, gds, threads
  unsigned queue_depth = 32;                    // blocks in flight (io_uring ring size; threads backend workers cap)
  std::size_t block_size = 1u << 20;            // bytes per I/O request; a multiple of 4096
  direct_mode direct = direct_mode::automatic;
  bool checksum = false;          // crc32c per block, verified on read
  unsigned staging_buffers = 48;  // pinned staging buffers of block_size bytes each (queue depth + copies)
  // Host tensors copied through the staging pool (physically contiguous, registered with the ring) instead of
  // being moved from their own pages.
  bool stage_host = false;
  unsigned threads = 4;                // threads backend / cuFile workers / operation drivers
  std::uint64_t stripe_threshold = 0;  // tensors at least this large are split over all directories; 0 = 4 blocks
  std::string cufile_library;          // path for dlopen; empty = default names
  fault_spec fault;
};

struct telemetry {
  std::uint64_t bytes_written = 0, bytes_read = 0;        // tensor bytes completed
  std::uint64_t write_ops = 0, read_ops = 0;              // tensors completed (successfully or not)
  std::uint64_t write_blocks = 0, read_blocks = 0;        // block requests completed
  std::uint64_t write_active_ns = 0, read_active_ns = 0;  // wall time with at least one op of that kind in flight
  std::uint64_t disk_bytes_written = 0;  // bytes the device was asked to write, padding included (SSD endurance)
  std::uint64_t errors = 0, checksum_failures = 0;
  std::uint64_t inflight_blocks = 0, peak_inflight_blocks = 0;  // submitted, not completed (queued or in flight)
  std::uint64_t queue_depth_in_use = 0, peak_queue_depth = 0;   // inside the ring / being moved by workers
  std::uint64_t wait_ns = 0;                                    // time callers spent blocked in operation::wait
  std::uint64_t staged_copies = 0;                              // blocks that went through a staging buffer
  std::uint64_t bytes_in_use = 0;                               // allocated extents
  std::uint64_t file_bytes = 0;                                 // sum of file sizes
  std::uint64_t staging_address = 0, staging_bytes = 0;         // the staging pool's memory
};

class engine_impl;

// One asynchronous transfer. Shared by the engine (until it completes) and the caller.
class operation;
using operation_ptr = std::shared_ptr<operation>;

class operation {
 public:
  bool done() const noexcept { return done_.load(std::memory_order_acquire); }
  // True once the source memory of a write is no longer read (device copies finished); a read sets it at done.
  bool staged() const noexcept { return staged_.load(std::memory_order_acquire); }
  // Blocks until done or the timeout (seconds; negative = forever). Returns done().
  bool wait(double timeout_seconds = -1.0);
  // Waits, then rethrows the failure, if any.
  void get();
  std::exception_ptr error() const;
  std::uint64_t bytes() const noexcept { return bytes_; }
  bool is_write() const noexcept { return write_; }
  double seconds() const noexcept;  // from submission to completion (0 while running)

  // Engine internals (public for the engine's translation units only).
  operation(bool write, std::uint64_t bytes, engine_impl* owner,
            std::shared_ptr<std::atomic<std::uint64_t>> wait_counter);
  void fail(std::exception_ptr e);
  void set_staged();
  void finish();
  std::atomic<long> pending{1};  // blocks in flight + 1 while the driver is still submitting

 private:
  bool write_;
  std::uint64_t bytes_;
  engine_impl* owner_;  // cleared at finish: the engine waits for its operations before it goes away
  std::shared_ptr<std::atomic<std::uint64_t>> wait_counter_;
  std::chrono::steady_clock::time_point start_, end_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::exception_ptr error_;
  std::atomic<bool> done_{false};
  std::atomic<bool> staged_{false};
};

struct directory_info {
  std::string path;
  bool tmpfile = false;  // created with O_TMPFILE (else created and unlinked at once)
  bool direct = false;   // opened with O_DIRECT
  std::uint64_t file_bytes = 0, bytes_in_use = 0, capacity = 0;
  int fd = -1;  // the open file (benchmarks point fio at /proc/<pid>/fd/<fd> to read the same blocks)
};

class engine {
 public:
  explicit engine(engine_config config);
  ~engine();  // waits for every operation in flight
  engine(const engine&) = delete;
  engine& operator=(const engine&) = delete;

  // Starts writing src (host when device < 0). `stream` is the CUDA stream whose work produces src (device only).
  // stage_host: host memory through the staging buffers (1), from its own pages (0), or as configured (-1).
  std::pair<std::uint64_t, operation_ptr> write(shared_cuda::memory_view src, std::uintptr_t stream = 0,
                                                int stage_host = -1);
  // Starts reading a handle into dst (exactly the handle's size). Ordered after the handle's write.
  operation_ptr read(std::uint64_t handle, shared_cuda::memory_view dst, std::uintptr_t stream = 0,
                     int stage_host = -1);
  // Releases a handle's space (after operations using it finish). Unknown or freed handles throw.
  void free(std::uint64_t handle);
  std::uint64_t handle_bytes(std::uint64_t handle) const;
  std::size_t live_handles() const;

  std::string backend() const;         // io_uring, gds or threads
  std::string backend_detail() const;  // e.g. "fixed buffers: registered", "cuFile compat mode"
  std::vector<directory_info> directories() const;
  telemetry stats() const;
  const engine_config& config() const;
  // Waits for all operations in flight.
  void drain();

  // Test hook: overwrite `bytes` bytes of a handle's stored data at `offset` with garbage, bypassing the engine.
  void corrupt_for_test(std::uint64_t handle, std::uint64_t offset, std::size_t bytes);

 private:
  std::shared_ptr<engine_impl> impl_;
};

// crc32c (Castagnoli) of a byte range, continuing from `crc` (0 to start). Hardware instructions where present.
std::uint32_t crc32c(const void* data, std::size_t bytes, std::uint32_t crc = 0) noexcept;

}  // namespace ssdtrain
