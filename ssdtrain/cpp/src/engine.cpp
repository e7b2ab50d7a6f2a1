#include "ssdtrain/engine.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <iterator>
#include <map>
#include <utility>

#include "shared_cuda/device.hpp"
#include "shared_cuda/error.hpp"
#include "shared_cuda/thread_pool.hpp"
#include "ssdtrain/backends.hpp"
#include "ssdtrain/detail/io_backend.hpp"
#include "ssdtrain/detail/store.hpp"

#if SHARED_CUDA_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

namespace ssdtrain {

using detail::extent;
using detail::io_request;
using shared_cuda::io_error;
using shared_cuda::memory_view;
using clock_type = std::chrono::steady_clock;

namespace {

std::uint64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(clock_type::now().time_since_epoch()).count();
}

void atomic_max(std::atomic<std::uint64_t>& target, std::uint64_t value) {
  std::uint64_t seen = target.load(std::memory_order_relaxed);
  while (seen < value && !target.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}

#if SHARED_CUDA_HAS_CUDA
void cuda_check(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw shared_cuda::cuda_error(std::string("ssdtrain: ") + what + ": " + cudaGetErrorString(status),
                                  static_cast<int>(status));
}
#endif

// An event recorded on the caller's stream when a device transfer is submitted, so the engine's copies start
// after the work the caller queued before (producing the source, or still reading the destination).
struct stream_mark {
  void* event = nullptr;
  int device = -1;
  stream_mark() = default;
  stream_mark(int dev, std::uintptr_t stream) : device(dev) {
#if SHARED_CUDA_HAS_CUDA
    int previous = 0;
    cuda_check(cudaGetDevice(&previous), "cudaGetDevice");
    cuda_check(cudaSetDevice(dev), "cudaSetDevice");
    cudaEvent_t e = nullptr;
    cuda_check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
    event = e;
    const cudaError_t rec = cudaEventRecord(e, reinterpret_cast<cudaStream_t>(stream));
    cudaSetDevice(previous);
    cuda_check(rec, "cudaEventRecord on the caller's stream");
#else
    (void)stream;
    throw shared_cuda::unavailable_error("ssdtrain: device memory given to a build without CUDA");
#endif
  }
  stream_mark(const stream_mark&) = delete;
  stream_mark& operator=(const stream_mark&) = delete;
  ~stream_mark() {
#if SHARED_CUDA_HAS_CUDA
    if (event) cudaEventDestroy(static_cast<cudaEvent_t>(event));
#endif
  }
};

// How many staging copies one transfer keeps queued on its stream ahead of the disk (device -> staging for writes,
// staging -> device for reads). Each is one block (1 MiB by default, ~40 us over PCIe): a few queued back to back keep
// the copy engine busy while the driver thread hands finished blocks to the disk, instead of one round trip
// (copy, then a host wait) per block.
constexpr unsigned copy_lookahead = 8;

// A non-blocking CUDA stream with the events its transfer marks copies with; reused across device transfers.
struct pooled_stream {
  int device = -1;
  void* stream = nullptr;
  std::vector<void*> events;  // created on first use, at most copy_lookahead
};

void destroy_stream([[maybe_unused]] pooled_stream& s) {
#if SHARED_CUDA_HAS_CUDA
  for (void* e : s.events) cudaEventDestroy(static_cast<cudaEvent_t>(e));
  if (s.stream) cudaStreamDestroy(static_cast<cudaStream_t>(s.stream));  // returns at once; CUDA frees it later
#endif
  s.events.clear();
  s.stream = nullptr;
}

// Non-blocking CUDA streams reused across device transfers. Creating and destroying a stream per transfer took
// the CUDA context's lock twice per operation, on up to 16 driver threads at once: for random 1 MiB reads into GPU
// memory that cost more than the device copy itself (io_uring random reads into GPU memory ran at 0.79x the host path).
// A stream goes back idle or with only waits on already recorded events queued (every copy is synchronized before).
class stream_pool {
 public:
  stream_pool() = default;
  stream_pool(const stream_pool&) = delete;
  stream_pool& operator=(const stream_pool&) = delete;
  ~stream_pool() {
    for (auto& entry : idle_) destroy_stream(entry);
  }
  // A stream of `device` (the calling thread's current device is set to it).
  pooled_stream acquire([[maybe_unused]] int device) {
    pooled_stream out;
    out.device = device;
#if SHARED_CUDA_HAS_CUDA
    cuda_check(cudaSetDevice(device), "cudaSetDevice");
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto it = idle_.rbegin(); it != idle_.rend(); ++it) {
        if (it->device == device) {
          out = std::move(*it);
          idle_.erase(std::next(it).base());
          return out;
        }
      }
    }
    cudaStream_t s = nullptr;
    cuda_check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    out.stream = s;
#endif
    return out;
  }
  void release(pooled_stream s) {
    if (!s.stream) return;
    std::lock_guard<std::mutex> lock(mutex_);
    idle_.push_back(std::move(s));
  }

 private:
  std::mutex mutex_;
  std::vector<pooled_stream> idle_;
};

// The stream of one device transfer, taken from the engine's pool on the driver thread (on the transfer's device)
// and given back when the transfer no longer uses it. A stream that still has a wait on the caller's event queued
// (the transfer failed before its first copy) or copies not known to be finished is destroyed instead: a later
// transfer must not inherit that dependency on someone else's stream.
//
// Copies are queued with copy_async(), each marked by one of the stream's events (`mark`, in a ring of
// copy_lookahead); finished(mark) polls it and wait_for(mark) blocks the driver until that copy is done.
struct op_stream {
  pooled_stream entry;
  stream_pool* pool = nullptr;
  bool waiting = false;    // a cudaStreamWaitEvent queued and no synchronization since
  unsigned unsettled = 0;  // copies queued and not yet seen finished
  unsigned next_mark = 0;
  op_stream(stream_pool& streams, int dev) : pool(&streams) { entry = streams.acquire(dev); }
  op_stream(const op_stream&) = delete;
  op_stream& operator=(const op_stream&) = delete;
  ~op_stream() {
    if (unsettled > 0) {
#if SHARED_CUDA_HAS_CUDA
      // Only after an error: the staging buffers were already handed back after a synchronize (see settle()).
      if (cudaStreamSynchronize(static_cast<cudaStream_t>(entry.stream)) != cudaSuccess) waiting = true;
#endif
    }
    if (waiting) {
      destroy_stream(entry);
      return;
    }
    pool->release(std::move(entry));
  }
  void wait([[maybe_unused]] const stream_mark& mark) {
#if SHARED_CUDA_HAS_CUDA
    if (mark.event) {
      cuda_check(cudaStreamWaitEvent(static_cast<cudaStream_t>(entry.stream), static_cast<cudaEvent_t>(mark.event), 0),
                 "cudaStreamWaitEvent");
      waiting = true;
    }
#endif
  }
  // Queues a copy and returns the mark that says when it is done. At most copy_lookahead copies may be unsettled.
  unsigned copy_async([[maybe_unused]] void* dst, [[maybe_unused]] const void* src,
                      [[maybe_unused]] std::size_t bytes) {
    const unsigned m = next_mark;
    next_mark = (next_mark + 1) % copy_lookahead;
#if SHARED_CUDA_HAS_CUDA
    auto s = static_cast<cudaStream_t>(entry.stream);
    while (entry.events.size() <= m) {
      cudaEvent_t e = nullptr;
      cuda_check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
      entry.events.push_back(e);
    }
    cuda_check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s), "cudaMemcpyAsync");
    ++unsettled;
    cuda_check(cudaEventRecord(static_cast<cudaEvent_t>(entry.events[m]), s), "cudaEventRecord");
#endif
    return m;
  }
  // True once the copy marked `m` finished (never blocks). Copies finish in the order they were queued.
  bool finished([[maybe_unused]] unsigned m) {
#if SHARED_CUDA_HAS_CUDA
    const cudaError_t status = cudaEventQuery(static_cast<cudaEvent_t>(entry.events[m]));
    if (status == cudaErrorNotReady) return false;
    cuda_check(status, "cudaEventQuery (a staging copy)");
    settle();
#endif
    return true;
  }
  // Blocks until the copy marked `m` finished.
  void wait_for([[maybe_unused]] unsigned m) {
#if SHARED_CUDA_HAS_CUDA
    cuda_check(cudaEventSynchronize(static_cast<cudaEvent_t>(entry.events[m])),
               "cudaEventSynchronize (a staging copy)");
    settle();
#endif
  }
  void synchronize() {
#if SHARED_CUDA_HAS_CUDA
    cuda_check(cudaStreamSynchronize(static_cast<cudaStream_t>(entry.stream)), "cudaStreamSynchronize");
    waiting = false;
    unsettled = 0;
#endif
  }

 private:
  void settle() {
    waiting = false;  // the caller's event was waited for before this copy ran
    if (unsettled > 0) --unsettled;
  }
};

}  // namespace

// ---------------------------------------------------------------------------------------------- engine_impl

// What a handle owns. Its extents return to the store once it is freed and no transfer uses it any more, so
// freeing during a transfer is safe; the release happens before that transfer reports completion, so space is
// back by the time a waiter wakes.
struct record {
  std::uint64_t id = 0;
  std::uint64_t bytes = 0;
  std::vector<extent> extents;
  std::vector<std::uint64_t> extent_start;  // logical offset where each extent begins
  std::vector<std::uint32_t> crcs;          // per block_size chunk, when checksums are on
  operation_ptr write_op;
  detail::store* owner = nullptr;
  std::mutex mutex;
  int users = 0;  // transfers in flight
  bool freed = false;
  bool released = false;

  void use() {
    std::lock_guard<std::mutex> lock(mutex);
    ++users;
  }
  void unuse() {
    std::lock_guard<std::mutex> lock(mutex);
    if (--users == 0 && freed) release_locked();
  }
  void free() {
    std::lock_guard<std::mutex> lock(mutex);
    freed = true;
    if (users == 0) release_locked();
  }
  void release_locked() {
    if (!released && owner) owner->release(extents);
    released = true;
  }
  ~record() { release_locked(); }
};
using record_ptr = std::shared_ptr<record>;

struct piece {
  std::uint64_t logical = 0;   // offset in the tensor
  std::size_t bytes = 0;       // bytes of tensor data
  std::size_t disk_bytes = 0;  // bytes on disk (padded to 4096 when staged)
  int file = 0;
  std::uint64_t file_offset = 0;
  bool staged = false;
};

// Anonymous memory on 2 MiB boundaries with transparent huge pages requested: physically contiguous blocks reach
// the device as one segment each, where 4 KiB pages would make a 1 MiB request of 256 segments, more than many
// queues take (virtio-blk: 254), so the block layer would split it.
class huge_region {
 public:
  explicit huge_region(std::size_t bytes) {
    constexpr std::size_t huge = 2u << 20;
    size_ = (bytes + huge - 1) / huge * huge;
    void* p = ::mmap(nullptr, size_ + huge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    const auto start = reinterpret_cast<std::uintptr_t>(p);
    const auto aligned = (start + huge - 1) / huge * huge;
    if (aligned > start) ::munmap(p, aligned - start);
    const std::size_t tail = start + size_ + huge - (aligned + size_);
    if (tail > 0) ::munmap(reinterpret_cast<void*>(aligned + size_), tail);
    data_ = reinterpret_cast<void*>(aligned);
    huge_pages_ = ::madvise(data_, size_, MADV_HUGEPAGE) == 0;
    std::memset(data_, 0, size_);  // fault in now (as huge pages where the kernel has them)
  }
  ~huge_region() {
    if (data_) ::munmap(data_, size_);
  }
  huge_region(const huge_region&) = delete;
  huge_region& operator=(const huge_region&) = delete;
  void* data() const { return data_; }
  std::size_t size() const { return size_; }
  bool huge_pages_requested() const { return huge_pages_; }

 private:
  void* data_ = nullptr;
  std::size_t size_ = 0;
  bool huge_pages_ = false;
};

class staging_pool {
 public:
  staging_pool(unsigned count, std::size_t bytes) : bytes_(bytes), count_(count), memory_(std::size_t(count) * bytes) {
    if (shared_cuda::cuda_available()) {
      try {
        registration_ = shared_cuda::host_registration(memory_.data(), std::size_t(count) * bytes);
        pinned_ = true;
      } catch (const std::exception& e) {
        pin_error_ = e.what();
      }
    }
    for (unsigned i = 0; i < count; ++i) free_.push_back(static_cast<int>(i));
  }
  int acquire() {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return !free_.empty(); });
    return take();
  }
  int try_acquire() {
    std::lock_guard<std::mutex> lock(mutex_);
    return free_.empty() ? -1 : take();
  }
  void release(int slot) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      free_.push_back(slot);
    }
    cv_.notify_one();
  }
  char* data(int slot) const { return static_cast<char*>(memory_.data()) + std::size_t(slot) * bytes_; }
  std::vector<std::pair<void*, std::size_t>> slots() const {
    std::vector<std::pair<void*, std::size_t>> out;
    for (unsigned i = 0; i < count_; ++i) out.emplace_back(data(static_cast<int>(i)), bytes_);
    return out;
  }
  bool pinned() const { return pinned_; }
  bool huge_pages_requested() const { return memory_.huge_pages_requested(); }
  std::uintptr_t address() const { return reinterpret_cast<std::uintptr_t>(memory_.data()); }
  std::size_t bytes() const { return std::size_t(count_) * bytes_; }
  const std::string& pin_error() const { return pin_error_; }

 private:
  int take() {
    const int s = free_.back();
    free_.pop_back();
    return s;
  }
  std::size_t bytes_;
  unsigned count_;
  huge_region memory_;
  shared_cuda::host_registration registration_;
  bool pinned_ = false;
  std::string pin_error_;
  std::vector<int> free_;
  std::mutex mutex_;
  std::condition_variable cv_;
};

class engine_impl {
 public:
  explicit engine_impl(engine_config config);
  ~engine_impl();

  std::pair<std::uint64_t, operation_ptr> write(memory_view src, std::uintptr_t stream, int stage_host);
  operation_ptr read(std::uint64_t handle, memory_view dst, std::uintptr_t stream, int stage_host);
  void free(std::uint64_t handle);
  record_ptr find(std::uint64_t handle, const char* action) const;
  std::size_t live_count() const {
    std::lock_guard<std::mutex> lock(handles_mutex_);
    return handles_.size();
  }

  void op_started(bool write);
  void op_finished(const operation& op);
  telemetry stats() const;
  void drain();
  void corrupt(std::uint64_t handle, std::uint64_t offset, std::size_t bytes);

  engine_config config_;
  std::unique_ptr<detail::store> store_;
  std::unique_ptr<staging_pool> staging_;
  std::unique_ptr<detail::io_backend> backend_;
  std::string backend_note_;

 private:
  std::vector<piece> plan(const record& rec, memory_view view, bool stage_host) const;
  void submit(const piece& p, void* buffer, int fixed_buffer, int device, bool write, std::function<void(long)> done);
  void run_write(operation_ptr op, record_ptr rec, memory_view src, std::shared_ptr<stream_mark> mark, bool stage);
  void run_read(operation_ptr op, record_ptr rec, memory_view dst, std::shared_ptr<stream_mark> mark, bool stage);
  bool stage_host(int requested) const { return requested < 0 ? config_.stage_host : requested > 0; }
  bool device_direct(memory_view v) const {
    return v.device >= 0 && backend_->handles_device_memory() && !config_.checksum;
  }
  std::exception_ptr block_error(const operation& op, std::uint64_t id, const piece& p, long result) const;

  mutable std::mutex handles_mutex_;
  std::map<std::uint64_t, record_ptr> handles_;
  std::uint64_t next_handle_ = 1;

  std::atomic<std::uint64_t> fault_bytes_{0};
  // Telemetry.
  std::atomic<std::uint64_t> bytes_written_{0}, bytes_read_{0}, write_ops_{0}, read_ops_{0}, write_blocks_{0},
      read_blocks_{0}, disk_bytes_written_{0}, errors_{0}, checksum_failures_{0}, inflight_{0}, peak_inflight_{0},
      staged_copies_{0};
  std::shared_ptr<std::atomic<std::uint64_t>> wait_ns_ = std::make_shared<std::atomic<std::uint64_t>>(0);
  mutable std::mutex activity_mutex_;
  std::condition_variable idle_;
  unsigned active_[2] = {0, 0};
  std::uint64_t active_since_[2] = {0, 0};
  std::uint64_t active_ns_[2] = {0, 0};

  stream_pool streams_;  // device copy streams, reused across transfers

  // Last: destroyed first, so drivers finish while everything they use still exists.
  std::unique_ptr<shared_cuda::thread_pool> drivers_;
};

engine_impl::engine_impl(engine_config config) : config_(std::move(config)) {
  SHARED_CUDA_EXPECT(config_.block_size >= 4096 && config_.block_size % 4096 == 0,
                     "ssdtrain: block_size must be a positive multiple of 4096");
  SHARED_CUDA_EXPECT(config_.queue_depth >= 1 && config_.queue_depth <= 4096,
                     "ssdtrain: queue_depth must be in [1, 4096]");
  SHARED_CUDA_EXPECT(config_.staging_buffers >= 1, "ssdtrain: staging_buffers must be at least 1");
  SHARED_CUDA_EXPECT(config_.threads >= 1, "ssdtrain: threads must be at least 1");
  const std::string& b = config_.backend;
  SHARED_CUDA_EXPECT(b == "auto" || b == "io_uring" || b == "gds" || b == "threads",
                     "ssdtrain: unknown backend '" + b + "': use auto, io_uring, gds or threads");
  store_ = std::make_unique<detail::store>(config_);
  staging_ = std::make_unique<staging_pool>(config_.staging_buffers, config_.block_size);

  std::string choice = b;
  if (choice == "auto") {
    // cuFile only helps with real GPUDirect Storage; in compatibility mode our own staged io_uring path is as fast.
    const bool gds_real = shared_cuda::cuda_available() && ::access("/proc/driver/nvidia-fs/stats", F_OK) == 0;
    if (gds_real) {
      choice = "gds";
    } else if (io_uring_status().usable) {
      choice = "io_uring";
    } else {
      choice = "threads";
      backend_note_ = "auto chose threads: io_uring " + io_uring_status().detail;
    }
  }
  if (choice == "io_uring") {
    backend_ = detail::make_io_uring_backend(store_->fds(), config_.queue_depth, staging_->slots());
  } else if (choice == "gds") {
    // As many workers as the threads backend: each cuFile call is synchronous, one block at a time.
    backend_ = detail::make_gds_backend(store_->fds(), std::min(config_.queue_depth, std::max(config_.threads, 1u) * 4),
                                        config_.cufile_library);
  } else {
    backend_ = detail::make_threads_backend(std::min(config_.queue_depth, std::max(config_.threads, 1u) * 4));
  }
  // Drivers mostly wait (for staging buffers, device copies, a handle's write), so there are more of them than
  // cores: each staged read holds one until it completes, so a queue depth's worth of staged (GPU) reads needs as
  // many drivers as the queue depth, plus one to submit the next (capped: each is a thread).
  drivers_ = std::make_unique<shared_cuda::thread_pool>(
      std::max({config_.threads, 16u, std::min(config_.queue_depth + 1, 64u)}));
}

engine_impl::~engine_impl() {
  drain();
  drivers_.reset();  // joins drivers (none running after drain)
  backend_.reset();  // completes nothing new; joins its threads
  {
    std::lock_guard<std::mutex> lock(handles_mutex_);
    handles_.clear();  // records release extents into the store, still alive here
  }
}

record_ptr engine_impl::find(std::uint64_t handle, const char* action) const {
  std::lock_guard<std::mutex> lock(handles_mutex_);
  auto it = handles_.find(handle);
  if (it != handles_.end()) return it->second;
  const bool issued = handle > 0 && handle < next_handle_;
  throw shared_cuda::invalid_argument(std::string("ssdtrain: cannot ") + action + " handle " + std::to_string(handle) +
                                      ": " + (issued ? "it was already freed" : "no write returned this handle"));
}

std::vector<piece> engine_impl::plan(const record& rec, memory_view view, bool stage_host) const {
  const std::size_t block = config_.block_size;
  const bool host = view.device < 0;
  const bool direct_files = store_->any_direct();
  std::vector<piece> out;
  for (std::uint64_t at = 0; at < rec.bytes; at += block) {
    const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(block, rec.bytes - at));
    // Chunks never straddle extents: extents hold whole blocks except the last.
    std::size_t k =
        std::upper_bound(rec.extent_start.begin(), rec.extent_start.end(), at) - rec.extent_start.begin() - 1;
    const extent& e = rec.extents[k];
    piece p{at, n, n, e.file, e.offset + (at - rec.extent_start[k]), false};
    if (!host && !device_direct(view)) {
      p.staged = true;
    } else if (!host) {
      // cuFile gets whole pages only (its compatibility mode does plain O_DIRECT I/O); a partial last page is staged.
      if (n % 4096 != 0) {
        const std::size_t body = n / 4096 * 4096;
        if (body > 0) out.push_back({at, body, body, p.file, p.file_offset, false});
        p.logical += body;
        p.file_offset += body;
        p.bytes = n - body;
        p.staged = true;
      }
    } else if (stage_host && direct_files) {
      p.staged = true;  // without O_DIRECT the page cache copies anyway: a second copy would buy nothing
    } else if (direct_files) {
      const auto addr = reinterpret_cast<std::uintptr_t>(view.data) + at;
      if (addr % 4096 != 0) {
        p.staged = true;
      } else if (n % 4096 != 0) {
        // Aligned body from the caller's memory, the last partial page through a staging buffer.
        const std::size_t body = n / 4096 * 4096;
        if (body > 0) out.push_back({at, body, body, p.file, p.file_offset, false});
        p.logical += body;
        p.file_offset += body;
        p.bytes = n - body;
        p.staged = true;
      }
    }
    if (p.staged) p.disk_bytes = (p.bytes + 4095) / 4096 * 4096;
    out.push_back(p);
  }
  return out;
}

void engine_impl::submit(const piece& p, void* buffer, int fixed_buffer, int device, bool write,
                         std::function<void(long)> done) {
  const auto cur = inflight_.fetch_add(1) + 1;
  atomic_max(peak_inflight_, cur);
  auto wrapped = [this, done = std::move(done), write, bytes = p.disk_bytes](long result) {
    inflight_.fetch_sub(1);
    (write ? write_blocks_ : read_blocks_).fetch_add(1);
    if (write && result > 0) disk_bytes_written_ += bytes;
    done(result);
  };
  const auto& fault = config_.fault;
  if (!fault.op.empty() && fault.op == (write ? "write" : "read")) {
    const std::uint64_t before = fault_bytes_.fetch_add(p.disk_bytes);
    if (before + p.disk_bytes > fault.after_bytes) {
      wrapped(-fault.error);
      return;
    }
  }
  io_request r;
  r.file = p.file;
  r.fd = store_->fd(p.file);
  r.offset = p.file_offset;
  r.buffer = buffer;
  r.bytes = p.disk_bytes;
  r.write = write;
  r.fixed_buffer = fixed_buffer;
  r.device = device;
  r.done = std::move(wrapped);
  backend_->submit(std::move(r));
}

std::exception_ptr engine_impl::block_error(const operation& op, std::uint64_t id, const piece& p, long result) const {
  const int err = result < 0 ? static_cast<int>(-result) : EIO;
  const auto dirs = store_->info();
  return std::make_exception_ptr(io_error(err, std::string("ssdtrain: ") + (op.is_write() ? "write" : "read") +
                                                   " of handle " + std::to_string(id) + " failed at byte " +
                                                   std::to_string(p.logical) + " (file in '" + dirs[p.file].path +
                                                   "', offset " + std::to_string(p.file_offset) + ")"));
}

std::pair<std::uint64_t, operation_ptr> engine_impl::write(memory_view src, std::uintptr_t stream, int stage_host) {
  SHARED_CUDA_EXPECT(src.bytes > 0, "ssdtrain: cannot write an empty tensor");
  SHARED_CUDA_EXPECT(src.data != nullptr, "ssdtrain: write source is a null pointer");
  auto rec = std::make_shared<record>();
  rec->bytes = src.bytes;
  rec->extents = store_->allocate(src.bytes, config_.block_size);  // ENOSPC surfaces here, before any I/O
  rec->owner = store_.get();
  std::uint64_t start = 0;
  for (std::size_t i = 0; i < rec->extents.size(); ++i) {
    rec->extent_start.push_back(start);
    // Striped extents hold `per` logical bytes each (a multiple of the block size); the last holds the rest.
    start += i + 1 < rec->extents.size() ? rec->extents[i].bytes : 0;
  }
  std::shared_ptr<stream_mark> mark;
  if (src.device >= 0) mark = std::make_shared<stream_mark>(src.device, stream);
  auto op = std::make_shared<operation>(true, src.bytes, this, wait_ns_);
  rec->write_op = op;
  rec->use();
  {
    std::lock_guard<std::mutex> lock(handles_mutex_);
    rec->id = next_handle_++;
    handles_[rec->id] = rec;
  }
  op_started(true);
  drivers_->submit(
      [this, op, rec, src, mark, stage = this->stage_host(stage_host)] { run_write(op, rec, src, mark, stage); });
  return {rec->id, op};
}

operation_ptr engine_impl::read(std::uint64_t handle, memory_view dst, std::uintptr_t stream, int stage_host) {
  record_ptr rec = find(handle, "read");
  SHARED_CUDA_EXPECT(dst.data != nullptr, "ssdtrain: read destination is a null pointer");
  SHARED_CUDA_EXPECT(dst.bytes == rec->bytes, "ssdtrain: handle " + std::to_string(handle) + " holds " +
                                                  std::to_string(rec->bytes) + " bytes but the destination has " +
                                                  std::to_string(dst.bytes) + "; pass a tensor of the same size");
  std::shared_ptr<stream_mark> mark;
  if (dst.device >= 0) mark = std::make_shared<stream_mark>(dst.device, stream);
  auto op = std::make_shared<operation>(false, dst.bytes, this, wait_ns_);
  rec->use();
  op_started(false);
  drivers_->submit(
      [this, op, rec, dst, mark, stage = this->stage_host(stage_host)] { run_read(op, rec, dst, mark, stage); });
  return op;
}

void engine_impl::free(std::uint64_t handle) {
  record_ptr rec = find(handle, "free");
  {
    std::lock_guard<std::mutex> lock(handles_mutex_);
    handles_.erase(handle);
  }
  rec->free();  // now, or when the last transfer using it finishes
}

void engine_impl::run_write(operation_ptr op, record_ptr rec, memory_view src, std::shared_ptr<stream_mark> mark,
                            bool stage) {
  try {
    const std::size_t block = config_.block_size;
    if (config_.checksum) rec->crcs.assign((rec->bytes + block - 1) / block, 0);
    // Host data is checksummed in place, before any block leaves, so every path stores the same per-block values.
    if (config_.checksum && src.device < 0) {
      for (std::size_t i = 0; i < rec->crcs.size(); ++i) {
        const std::uint64_t at = i * block;
        rec->crcs[i] = crc32c(static_cast<char*>(src.data) + at, std::min<std::uint64_t>(block, rec->bytes - at));
      }
    }
    const auto pieces = plan(*rec, src, stage);
    std::unique_ptr<op_stream> stream;
    if (src.device >= 0) {
      stream = std::make_unique<op_stream>(streams_, src.device);
      stream->wait(*mark);
      if (device_direct(src)) stream->synchronize();  // cuFile reads the memory itself: the producer must be done
    }
    auto on_done = [this, op, rec](const piece& p, int slot) {
      return [this, op, rec, p, slot](long result) {
        if (slot >= 0) staging_->release(slot);
        if (result != static_cast<long>(p.disk_bytes)) op->fail(block_error(*op, rec->id, p, result));
        if (--op->pending == 0) {
          rec->unuse();
          op->finish();
        }
      };
    };
    // A staged block whose bytes are in its buffer goes to the disk (zero padding to whole pages first).
    auto send = [&](const piece& p, int slot) {
      char* buf = staging_->data(slot);
      if (config_.checksum && src.device >= 0) rec->crcs[p.logical / block] = crc32c(buf, p.bytes);
      if (p.disk_bytes > p.bytes) std::memset(buf + p.bytes, 0, p.disk_bytes - p.bytes);
      staged_copies_.fetch_add(1, std::memory_order_relaxed);
      ++op->pending;
      submit(p, buf, slot, -1, true, on_done(p, slot));
    };
    // Device blocks: device -> staging copies queued on the stream up to copy_lookahead ahead; each block goes to
    // the disk as soon as its copy is seen finished, so the copy engine and the disk work at the same time and the
    // driver never waits for a copy while an earlier one could already be on its way to the disk.
    struct queued {
      const piece* p;
      int slot;
      unsigned mark;
    };
    std::deque<queued> copies;
    auto retire = [&](bool block_on_oldest) {
      while (!copies.empty()) {
        const queued q = copies.front();
        if (block_on_oldest) {
          stream->wait_for(q.mark);
          block_on_oldest = false;
        } else if (!stream->finished(q.mark)) {
          return;
        }
        copies.pop_front();
        if (op->error())
          staging_->release(q.slot);  // a block already failed: the rest is not sent
        else
          send(*q.p, q.slot);
      }
    };
    try {
      for (const piece& p : pieces) {
        if (op->error()) break;  // a block already failed: stop sending more
        char* from = static_cast<char*>(src.data) + p.logical;
        if (!p.staged) {
          ++op->pending;
          submit(p, from, -1, src.device >= 0 ? src.device : -1, true, on_done(p, -1));
          continue;
        }
        if (src.device < 0) {
          const int slot = staging_->acquire();
          std::memcpy(staging_->data(slot), from, p.bytes);
          send(p, slot);
          continue;
        }
        retire(false);
        int slot = -1;
        for (;;) {
          // Block for a buffer only while holding none: the buffers of queued copies come back through retire().
          if (copies.size() < copy_lookahead) slot = copies.empty() ? staging_->acquire() : staging_->try_acquire();
          if (slot >= 0) break;
          retire(true);
        }
        copies.push_back({&p, slot, 0});
        copies.back().mark = stream->copy_async(staging_->data(slot), from, p.bytes);
      }
      while (!copies.empty()) retire(true);
    } catch (...) {
      // A copy or its wait failed: its buffer may still be written by the device until the stream is idle.
      if (!copies.empty()) {
        try {
          stream->synchronize();
        } catch (...) {
        }
        for (const queued& q : copies) staging_->release(q.slot);
      }
      throw;
    }
    // Device data has left the GPU once every staging copy finished (direct cuFile writes: at completion).
    if (src.device >= 0 && !device_direct(src)) op->set_staged();
  } catch (...) {
    op->fail(std::current_exception());
  }
  if (--op->pending == 0) {
    rec->unuse();
    op->finish();
  }
}

void engine_impl::run_read(operation_ptr op, record_ptr rec, memory_view dst, std::shared_ptr<stream_mark> mark,
                           bool stage) {
  try {
    // Ordered after the handle's write; a failed write means there is nothing valid to read.
    rec->write_op->wait();
    if (auto e = rec->write_op->error()) {
      int err = EIO;
      std::string why;
      try {
        std::rethrow_exception(e);
      } catch (const std::system_error& se) {
        err = se.code().value();
        why = se.what();
      } catch (const std::exception& ex) {
        why = ex.what();
      }
      throw io_error(
          err, "ssdtrain: handle " + std::to_string(rec->id) + " holds no data because its write failed (" + why + ")");
    }
    const std::size_t block = config_.block_size;
    const auto pieces = plan(*rec, dst, stage);
    std::unique_ptr<op_stream> stream;
    if (dst.device >= 0) {
      stream = std::make_unique<op_stream>(streams_, dst.device);
      stream->wait(*mark);
      if (device_direct(dst)) stream->synchronize();  // earlier work on the destination must finish first
    }
    const bool all_direct = std::none_of(pieces.begin(), pieces.end(), [](const piece& p) { return p.staged; });
    if (all_direct && !config_.checksum) {
      // Nothing to copy or verify afterwards: completions finish the read and this driver moves on, so many
      // small reads stay in flight at once (random 1 MiB reads at depth 16 need this).
      for (const piece& p : pieces) {
        ++op->pending;
        submit(p, static_cast<char*>(dst.data) + p.logical, -1, dst.device, false, [this, op, rec, p](long result) {
          if (result != static_cast<long>(p.disk_bytes)) op->fail(block_error(*op, rec->id, p, result));
          if (--op->pending == 0) {
            rec->unuse();
            op->finish();
          }
        });
      }
      if (--op->pending == 0) {
        rec->unuse();
        op->finish();
      }
      return;
    }
    struct arrival {
      std::size_t index;
      int slot;
      long result;
    };
    // Shared with the completion callbacks, which may still be returning after this function has moved on.
    struct mailbox {
      std::mutex m;
      std::condition_variable cv;
      std::deque<arrival> arrived;
    };
    auto box = std::make_shared<mailbox>();
    std::size_t next = 0, finished = 0, held = 0;
    std::exception_ptr first_error;
    // Staging -> device copies queued on the stream (up to copy_lookahead), oldest first: a buffer goes back to the
    // pool once its copy is seen finished, while the driver goes on handing blocks that arrive to the copy engine
    // and buffers that come back to the disk.
    struct queued {
      int slot;
      unsigned mark;
    };
    std::deque<queued> copies;
    auto abandon_copies = [&] {  // after a CUDA failure: the device may write the buffers until the stream is idle
      try {
        stream->synchronize();
      } catch (...) {
      }
      for (const queued& q : copies) staging_->release(q.slot);
      held -= copies.size();
      copies.clear();
    };
    auto retire = [&](bool block_on_oldest) {
      while (!copies.empty()) {
        const queued q = copies.front();
        try {
          if (block_on_oldest) {
            block_on_oldest = false;
            stream->wait_for(q.mark);
          } else if (!stream->finished(q.mark)) {
            return;
          }
        } catch (...) {
          if (!first_error) first_error = std::current_exception();
          abandon_copies();
          return;
        }
        copies.pop_front();
        staging_->release(q.slot);
        --held;
      }
    };
    while (finished < next || (next < pieces.size() && !first_error) || !copies.empty()) {
      retire(false);
      // Keep as many pieces in flight as buffers allow; block for a buffer only while holding none, so a read
      // never waits on buffers that only it can give back.
      while (next < pieces.size() && !first_error) {
        const piece& p = pieces[next];
        int slot = -1;
        if (p.staged) {
          slot = held == 0 ? staging_->acquire() : staging_->try_acquire();
          if (slot < 0) break;
          ++held;
        }
        void* target = p.staged ? static_cast<void*>(staging_->data(slot)) : static_cast<char*>(dst.data) + p.logical;
        const std::size_t index = next++;
        submit(p, target, slot, p.staged ? -1 : dst.device, false, [box, index, slot](long result) {
          std::lock_guard<std::mutex> lock(box->m);
          box->arrived.push_back({index, slot, result});
          box->cv.notify_one();
        });
      }
      if (finished == next) {
        if (!copies.empty()) retire(true);  // nothing on the disk for this read: its buffers are in copies
        continue;
      }
      arrival a{};
      {
        std::unique_lock<std::mutex> lock(box->m);
        const auto ready = [&] { return !box->arrived.empty(); };
        if (copies.empty()) {
          box->cv.wait(lock, ready);
        } else if (!box->cv.wait_for(lock, std::chrono::microseconds(50), ready)) {
          continue;  // look at the queued copies again (a copy of one block takes tens of microseconds)
        }
        a = box->arrived.front();
        box->arrived.pop_front();
      }
      ++finished;
      const piece& p = pieces[a.index];
      try {
        if (a.result != static_cast<long>(p.disk_bytes)) std::rethrow_exception(block_error(*op, rec->id, p, a.result));
        if (a.slot >= 0 && !first_error) {
          const char* buf = staging_->data(a.slot);
          if (config_.checksum && dst.device >= 0) {
            const std::uint32_t crc = crc32c(buf, p.bytes);
            if (crc != rec->crcs[p.logical / block]) {
              checksum_failures_.fetch_add(1);
              throw io_error(EBADMSG, "ssdtrain: checksum mismatch reading handle " + std::to_string(rec->id) +
                                          " at byte " + std::to_string(p.logical) +
                                          ": the stored data is corrupt (disk or file system fault)");
            }
          }
          if (dst.device >= 0) {
            if (copies.size() >= copy_lookahead) retire(true);
            if (first_error) std::rethrow_exception(first_error);  // that copy failed: this block is not copied
            copies.push_back({a.slot, 0});
            a.slot = -1;  // given back by retire() once its copy is done
            copies.back().mark = stream->copy_async(static_cast<char*>(dst.data) + p.logical, buf, p.bytes);
          } else {
            std::memcpy(static_cast<char*>(dst.data) + p.logical, buf, p.bytes);
          }
          staged_copies_.fetch_add(1, std::memory_order_relaxed);
        }
      } catch (...) {
        if (!first_error) first_error = std::current_exception();
        if (!copies.empty()) abandon_copies();
      }
      if (a.slot >= 0) {
        staging_->release(a.slot);
        --held;
      }
    }
    if (first_error) std::rethrow_exception(first_error);
    if (config_.checksum && dst.device < 0) {
      for (std::size_t i = 0; i < rec->crcs.size(); ++i) {
        const std::uint64_t at = i * block;
        if (crc32c(static_cast<char*>(dst.data) + at, std::min<std::uint64_t>(block, rec->bytes - at)) !=
            rec->crcs[i]) {
          checksum_failures_.fetch_add(1);
          throw io_error(EBADMSG, "ssdtrain: checksum mismatch reading handle " + std::to_string(rec->id) +
                                      " at byte " + std::to_string(at) +
                                      ": the stored data is corrupt (disk or file system fault)");
        }
      }
    }
  } catch (...) {
    op->fail(std::current_exception());
  }
  if (--op->pending == 0) {
    rec->unuse();
    op->finish();
  }
}

void engine_impl::op_started(bool write) {
  std::lock_guard<std::mutex> lock(activity_mutex_);
  const int k = write ? 0 : 1;
  if (active_[k]++ == 0) active_since_[k] = now_ns();
}

void engine_impl::op_finished(const operation& op) {
  if (op.error()) errors_.fetch_add(1);
  if (op.is_write()) {
    write_ops_.fetch_add(1);
    if (!op.error()) bytes_written_ += op.bytes();
  } else {
    read_ops_.fetch_add(1);
    if (!op.error()) bytes_read_ += op.bytes();
  }
  std::lock_guard<std::mutex> lock(activity_mutex_);
  const int k = op.is_write() ? 0 : 1;
  if (--active_[k] == 0) active_ns_[k] += now_ns() - active_since_[k];
  if (active_[0] == 0 && active_[1] == 0) idle_.notify_all();
}

void engine_impl::drain() {
  std::unique_lock<std::mutex> lock(activity_mutex_);
  idle_.wait(lock, [&] { return active_[0] == 0 && active_[1] == 0; });
}

telemetry engine_impl::stats() const {
  telemetry t;
  t.bytes_written = bytes_written_;
  t.bytes_read = bytes_read_;
  t.write_ops = write_ops_;
  t.read_ops = read_ops_;
  t.write_blocks = write_blocks_;
  t.read_blocks = read_blocks_;
  t.disk_bytes_written = disk_bytes_written_;
  t.errors = errors_;
  t.checksum_failures = checksum_failures_;
  t.inflight_blocks = inflight_;
  t.peak_inflight_blocks = peak_inflight_;
  t.queue_depth_in_use = backend_->depth();
  t.peak_queue_depth = backend_->peak_depth();
  t.wait_ns = *wait_ns_;
  t.staged_copies = staged_copies_;
  t.bytes_in_use = store_->bytes_in_use();
  t.file_bytes = store_->file_bytes();
  t.staging_address = staging_->address();
  t.staging_bytes = staging_->bytes();
  std::lock_guard<std::mutex> lock(activity_mutex_);
  const std::uint64_t now = now_ns();
  t.write_active_ns = active_ns_[0] + (active_[0] ? now - active_since_[0] : 0);
  t.read_active_ns = active_ns_[1] + (active_[1] ? now - active_since_[1] : 0);
  return t;
}

void engine_impl::corrupt(std::uint64_t handle, std::uint64_t offset, std::size_t bytes) {
  record_ptr rec = find(handle, "corrupt");
  rec->write_op->wait();
  SHARED_CUDA_EXPECT(offset + bytes <= rec->bytes, "ssdtrain: corrupt range outside the handle");
  // Read-modify-write whole pages through a buffered descriptor of the same file (works under O_DIRECT too).
  std::size_t k =
      std::upper_bound(rec->extent_start.begin(), rec->extent_start.end(), offset) - rec->extent_start.begin() - 1;
  const extent& e = rec->extents[k];
  const std::uint64_t at = e.offset + (offset - rec->extent_start[k]);
  const std::uint64_t page = at / 4096 * 4096;
  const std::size_t span = (at + bytes - page + 4095) / 4096 * 4096;
  shared_cuda::aligned_host_buffer buf(span, 4096);
  const int fd = store_->fd(e.file);
  SHARED_CUDA_SYSCALL(::pread(fd, buf.data(), span, static_cast<off_t>(page)));
  auto* p = static_cast<unsigned char*>(buf.data()) + (at - page);
  for (std::size_t i = 0; i < bytes; ++i) p[i] = static_cast<unsigned char>(~p[i]);
  SHARED_CUDA_SYSCALL(::pwrite(fd, buf.data(), span, static_cast<off_t>(page)));
}

// ---------------------------------------------------------------------------------------------- operation

operation::operation(bool write, std::uint64_t bytes, engine_impl* owner,
                     std::shared_ptr<std::atomic<std::uint64_t>> wait_counter)
    : write_(write), bytes_(bytes), owner_(owner), wait_counter_(std::move(wait_counter)), start_(clock_type::now()) {}

bool operation::wait(double timeout_seconds) {
  if (done()) return true;
  const auto t0 = clock_type::now();
  std::unique_lock<std::mutex> lock(mutex_);
  if (timeout_seconds < 0) {
    cv_.wait(lock, [&] { return done(); });
  } else {
    cv_.wait_for(lock, std::chrono::duration<double>(timeout_seconds), [&] { return done(); });
  }
  *wait_counter_ += std::chrono::duration_cast<std::chrono::nanoseconds>(clock_type::now() - t0).count();
  return done();
}

void operation::get() {
  wait();
  if (auto e = error()) std::rethrow_exception(e);
}

std::exception_ptr operation::error() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return error_;
}

double operation::seconds() const noexcept {
  if (!done()) return 0.0;
  return std::chrono::duration<double>(end_ - start_).count();
}

void operation::fail(std::exception_ptr e) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!error_) error_ = std::move(e);  // the first failure is the one reported
}

void operation::set_staged() { staged_.store(true, std::memory_order_release); }

void operation::finish() {
  engine_impl* owner = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    end_ = clock_type::now();
    owner = std::exchange(owner_, nullptr);
  }
  // Counted before waiters wake, so telemetry read right after wait() includes this operation.
  if (owner) owner->op_finished(*this);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    staged_.store(true, std::memory_order_release);
    done_.store(true, std::memory_order_release);
    cv_.notify_all();
  }
}

// ---------------------------------------------------------------------------------------------- engine

engine::engine(engine_config config) : impl_(std::make_shared<engine_impl>(std::move(config))) {}
engine::~engine() { impl_->drain(); }

std::pair<std::uint64_t, operation_ptr> engine::write(memory_view src, std::uintptr_t stream, int stage_host) {
  return impl_->write(src, stream, stage_host);
}
operation_ptr engine::read(std::uint64_t handle, memory_view dst, std::uintptr_t stream, int stage_host) {
  return impl_->read(handle, dst, stream, stage_host);
}
void engine::free(std::uint64_t handle) { impl_->free(handle); }
std::uint64_t engine::handle_bytes(std::uint64_t handle) const { return impl_->find(handle, "query")->bytes; }
std::size_t engine::live_handles() const { return impl_->live_count(); }
std::string engine::backend() const { return impl_->backend_->name(); }
std::string engine::backend_detail() const {
  std::string d = impl_->backend_->detail();
  d += impl_->staging_->pinned() ? "; staging pinned" : "; staging pageable";
  d += impl_->staging_->huge_pages_requested() ? " (huge pages requested)" : " (4 KiB pages)";
  if (impl_->config_.stage_host) d += "; host tensors staged";
  if (!impl_->staging_->pin_error().empty()) d += " (" + impl_->staging_->pin_error() + ")";
  if (!impl_->backend_note_.empty()) d += "; " + impl_->backend_note_;
  return d;
}
std::vector<directory_info> engine::directories() const { return impl_->store_->info(); }
telemetry engine::stats() const { return impl_->stats(); }
const engine_config& engine::config() const { return impl_->config_; }
void engine::drain() { impl_->drain(); }
void engine::corrupt_for_test(std::uint64_t handle, std::uint64_t offset, std::size_t bytes) {
  impl_->corrupt(handle, offset, bytes);
}

}  // namespace ssdtrain
