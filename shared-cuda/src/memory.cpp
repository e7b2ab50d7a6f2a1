#include "shared_cuda/memory.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <thread>
#include <utility>

#include "shared_cuda/device.hpp"
#include "shared_cuda/error.hpp"
#include "shared_cuda/thread_pool.hpp"

#if SHARED_CUDA_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

namespace shared_cuda {

// ---------------------------------------------------------------------------------------------- device_buffer

device_buffer::device_buffer(std::size_t bytes) {
  require_cuda("device_buffer");
#if SHARED_CUDA_HAS_CUDA
  SHARED_CUDA_TRY(cudaGetDevice(&device_));
  if (bytes > 0) SHARED_CUDA_TRY(cudaMalloc(&data_, bytes));
  bytes_ = bytes;
#else
  (void)bytes;
#endif
}

device_buffer::~device_buffer() { reset(); }

device_buffer::device_buffer(device_buffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      device_(std::exchange(other.device_, -1)) {}

device_buffer& device_buffer::operator=(device_buffer&& other) noexcept {
  if (this != &other) {
    reset();
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    device_ = std::exchange(other.device_, -1);
  }
  return *this;
}

void device_buffer::reset() noexcept {
#if SHARED_CUDA_HAS_CUDA
  // Errors are ignored: at interpreter shutdown the runtime may already be gone, and destructors never throw.
  if (data_ != nullptr) cudaFree(data_);
#endif
  data_ = nullptr;
  bytes_ = 0;
}

// ---------------------------------------------------------------------------------------------- pinned_buffer

pinned_buffer::pinned_buffer(std::size_t bytes) {
  require_cuda("pinned_buffer");
#if SHARED_CUDA_HAS_CUDA
  if (bytes > 0) SHARED_CUDA_TRY(cudaHostAlloc(&data_, bytes, cudaHostAllocPortable | cudaHostAllocMapped));
  bytes_ = bytes;
#else
  (void)bytes;
#endif
}

pinned_buffer::~pinned_buffer() { reset(); }

pinned_buffer::pinned_buffer(pinned_buffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

pinned_buffer& pinned_buffer::operator=(pinned_buffer&& other) noexcept {
  if (this != &other) {
    reset();
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void* pinned_buffer::device_pointer() const {
  if (data_ == nullptr) return nullptr;
#if SHARED_CUDA_HAS_CUDA
  void* device_ptr = nullptr;
  SHARED_CUDA_TRY(cudaHostGetDevicePointer(&device_ptr, data_, 0));
  return device_ptr;
#else
  return nullptr;
#endif
}

void pinned_buffer::reset() noexcept {
#if SHARED_CUDA_HAS_CUDA
  if (data_ != nullptr) cudaFreeHost(data_);
#endif
  data_ = nullptr;
  bytes_ = 0;
}

// ---------------------------------------------------------------------------------------------- host_managed_buffer

bool host_managed_buffer::supported() {
#if SHARED_CUDA_HAS_CUDA
  if (!cuda_available()) return false;
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) return false;
  for (int d = 0; d < count; ++d) {
    int concurrent = 0;
    if (cudaDeviceGetAttribute(&concurrent, cudaDevAttrConcurrentManagedAccess, d) != cudaSuccess || !concurrent)
      return false;
  }
  return true;
#else
  return false;
#endif
}

host_managed_buffer::host_managed_buffer(std::size_t bytes) {
  require_cuda("host_managed_buffer");
#if SHARED_CUDA_HAS_CUDA
  SHARED_CUDA_EXPECT(supported(),
                     "managed host memory needs every GPU to access managed memory concurrently "
                     "(cudaDevAttrConcurrentManagedAccess); use pinned memory instead");
  if (bytes == 0) return;
  SHARED_CUDA_TRY(cudaMallocManaged(&data_, bytes, cudaMemAttachGlobal));
  bytes_ = bytes;
  try {
    int count = 0;
    SHARED_CUDA_TRY(cudaGetDeviceCount(&count));
#if CUDART_VERSION >= 13000
    cudaMemLocation host{};
    host.type = cudaMemLocationTypeHost;
    SHARED_CUDA_TRY(cudaMemAdvise(data_, bytes, cudaMemAdviseSetPreferredLocation, host));
    for (int d = 0; d < count; ++d) {
      cudaMemLocation gpu{};
      gpu.type = cudaMemLocationTypeDevice;
      gpu.id = d;
      SHARED_CUDA_TRY(cudaMemAdvise(data_, bytes, cudaMemAdviseSetAccessedBy, gpu));
    }
#else  // CUDA 12 and older: cudaMemAdvise takes a device ordinal (cudaCpuDeviceId for the host)
    SHARED_CUDA_TRY(cudaMemAdvise(data_, bytes, cudaMemAdviseSetPreferredLocation, cudaCpuDeviceId));
    for (int d = 0; d < count; ++d) SHARED_CUDA_TRY(cudaMemAdvise(data_, bytes, cudaMemAdviseSetAccessedBy, d));
#endif
  } catch (...) {
    reset();
    throw;
  }
  // Fault every page in on the host now, in parallel (one thread per 256 MiB, at most one per core), which also maps
  // it on the devices: one written byte per 4 KiB page. The pages arrive zeroed, so writing all of their bytes again
  // (as a memset would) only doubles the memory traffic. 48 GiB took 3.5-3.6 s with 16 threads (and a full
  // memset) in a stand-alone C++ program on an H200 host, 7.6-9.4 s inside a benchmark's Python process.
  const std::size_t threads =
      std::clamp<std::size_t>(bytes >> 28, 1, std::max(1u, std::thread::hardware_concurrency()));
  thread_pool touching(threads);
  touching.parallel_for(
      0, bytes, std::size_t(64) << 20,
      [p = static_cast<volatile char*>(data_)](std::size_t begin, std::size_t end) {
        for (std::size_t at = begin; at < end; at += 4096) p[at] = 0;
      },
      threads);
#else
  (void)bytes;
#endif
}

host_managed_buffer::~host_managed_buffer() { reset(); }

host_managed_buffer::host_managed_buffer(host_managed_buffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

host_managed_buffer& host_managed_buffer::operator=(host_managed_buffer&& other) noexcept {
  if (this != &other) {
    reset();
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void host_managed_buffer::reset() noexcept {
#if SHARED_CUDA_HAS_CUDA
  if (data_ != nullptr) cudaFree(data_);
#endif
  data_ = nullptr;
  bytes_ = 0;
}

// ---------------------------------------------------------------------------------------------- aligned_host_buffer

aligned_host_buffer::aligned_host_buffer(std::size_t bytes, std::size_t alignment) {
  SHARED_CUDA_EXPECT(alignment >= sizeof(void*) && (alignment & (alignment - 1)) == 0,
                     "alignment must be a power of two of at least " + std::to_string(sizeof(void*)));
  if (bytes == 0) return;
  // Round the size up so O_DIRECT transfers of whole blocks never run past the end.
  const std::size_t rounded = (bytes + alignment - 1) / alignment * alignment;
  if (posix_memalign(&data_, alignment, rounded) != 0) throw std::bad_alloc();
  bytes_ = bytes;
}

aligned_host_buffer::~aligned_host_buffer() { std::free(data_); }

aligned_host_buffer::aligned_host_buffer(aligned_host_buffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

aligned_host_buffer& aligned_host_buffer::operator=(aligned_host_buffer&& other) noexcept {
  if (this != &other) {
    std::free(data_);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

// ---------------------------------------------------------------------------------------------- host_registration

namespace {

struct extent {
  std::uintptr_t end = 0;
  std::size_t references = 0;
  bool read_only = false;
};

// Page-aligned registered extents keyed by start address; never overlapping. Leaked on purpose so that
// registrations destroyed during static destruction still find it.
struct registry {
  std::mutex mutex;
  std::map<std::uintptr_t, extent> extents;
};

registry& the_registry() {
  static auto* instance = new registry();
  return *instance;
}

#if SHARED_CUDA_HAS_CUDA
std::uintptr_t page_size() {
  static const auto size = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
  return size;
}

void cuda_register(std::uintptr_t start, std::uintptr_t end, bool read_only) {
  unsigned flags = cudaHostRegisterPortable | cudaHostRegisterMapped;
  if (read_only) flags |= cudaHostRegisterReadOnly;
  SHARED_CUDA_TRY(cudaHostRegister(reinterpret_cast<void*>(start), end - start, flags));
}
#endif

// Drops one reference to the extent starting at `start`; unregisters it when none remain. Caller holds the lock.
void release_extent(registry& reg, std::uintptr_t start) noexcept {
  auto it = reg.extents.find(start);
  if (it == reg.extents.end()) return;
  if (--it->second.references == 0) {
#if SHARED_CUDA_HAS_CUDA
    cudaHostUnregister(reinterpret_cast<void*>(start));
#endif
    reg.extents.erase(it);
  }
}

}  // namespace

host_registration::host_registration(void* data, std::size_t bytes, access mode) {
  SHARED_CUDA_EXPECT(data != nullptr && bytes > 0, "cannot register an empty or null host range");
  require_cuda("host_registration");
#if SHARED_CUDA_HAS_CUDA
  const std::uintptr_t page = page_size();
  const auto first = reinterpret_cast<std::uintptr_t>(data);
  const std::uintptr_t lo = first / page * page;
  const std::uintptr_t hi = (first + bytes + page - 1) / page * page;

  registry& reg = the_registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  try {
    // Walk the extents overlapping [lo, hi) in address order, registering each uncovered gap as a new extent.
    std::uintptr_t cursor = lo;
    auto it = reg.extents.upper_bound(lo);
    if (it != reg.extents.begin() && std::prev(it)->second.end > lo) --it;
    const bool read_only = mode == access::read_only;
    for (; it != reg.extents.end() && it->first < hi; ++it) {
      SHARED_CUDA_EXPECT(read_only || !it->second.read_only,
                         "part of this range is already registered read-only (e.g. by a read-only view of the same "
                         "memory); register it read-only too, or release the read-only registration first");
      if (it->first > cursor) {
        cuda_register(cursor, it->first, read_only);
        reg.extents.emplace(cursor, extent{it->first, 1, read_only});
        extents_.push_back(cursor);
      }
      ++it->second.references;
      extents_.push_back(it->first);
      cursor = it->second.end;
    }
    if (cursor < hi) {
      cuda_register(cursor, hi, read_only);
      reg.extents.emplace(cursor, extent{hi, 1, read_only});
      extents_.push_back(cursor);
    }
    SHARED_CUDA_TRY(cudaHostGetDevicePointer(&device_pointer_, data, 0));
    SHARED_CUDA_EXPECT(extents_.size() == 1 || device_pointer_ == data,
                       "this range overlaps memory registered separately, and this device cannot address "
                       "registered memory by its host pointer; register the whole allocation once instead");
  } catch (...) {
    for (std::uintptr_t start : extents_) release_extent(reg, start);
    extents_.clear();
    device_pointer_ = nullptr;
    throw;
  }
  data_ = data;
  bytes_ = bytes;
  mode_ = mode;
#else
  (void)data, (void)bytes, (void)mode;
#endif
}

host_registration::~host_registration() { release(); }

host_registration::host_registration(host_registration&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      device_pointer_(std::exchange(other.device_pointer_, nullptr)),
      mode_(other.mode_),
      extents_(std::move(other.extents_)) {
  other.extents_.clear();
}

host_registration& host_registration::operator=(host_registration&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    device_pointer_ = std::exchange(other.device_pointer_, nullptr);
    mode_ = other.mode_;
    extents_ = std::move(other.extents_);
    other.extents_.clear();
  }
  return *this;
}

void host_registration::release() noexcept {
  if (extents_.empty()) return;
  registry& reg = the_registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  for (std::uintptr_t start : extents_) release_extent(reg, start);
  extents_.clear();
  data_ = nullptr;
  bytes_ = 0;
  device_pointer_ = nullptr;
}

std::size_t host_registration::registered_bytes() {
  registry& reg = the_registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  std::size_t total = 0;
  for (const auto& [start, ext] : reg.extents) total += ext.end - start;
  return total;
}

std::size_t host_registration::registered_extent_count() {
  registry& reg = the_registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  return reg.extents.size();
}

}  // namespace shared_cuda
