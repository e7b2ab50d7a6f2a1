// Move-only owners of memory, and the non-owning views passed around instead of raw pointers.
//
// Public headers hold no CUDA types, so CPU-only code includes them freely; every call that needs CUDA throws
// unavailable_error (built without CUDA) or cuda_error (the runtime call failed).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace shared_cuda {

// A non-owning byte range. `device` is -1 for host memory.
struct memory_view {
  void* data = nullptr;
  std::size_t bytes = 0;
  int device = -1;
};

// cudaMalloc'd device memory on the current device.
class device_buffer {
 public:
  device_buffer() = default;
  explicit device_buffer(std::size_t bytes);
  ~device_buffer();
  device_buffer(device_buffer&& other) noexcept;
  device_buffer& operator=(device_buffer&& other) noexcept;
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;

  void* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return bytes_; }
  int device() const noexcept { return device_; }
  memory_view view() const noexcept { return {data_, bytes_, device_}; }

 private:
  void reset() noexcept;
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  int device_ = -1;
};

// Page-locked host memory from cudaHostAlloc, mapped into every device's address space (portable + mapped), so
// kernels read it over PCIe with no copy. device_pointer() is the address kernels use.
class pinned_buffer {
 public:
  pinned_buffer() = default;
  explicit pinned_buffer(std::size_t bytes);
  ~pinned_buffer();
  pinned_buffer(pinned_buffer&& other) noexcept;
  pinned_buffer& operator=(pinned_buffer&& other) noexcept;
  pinned_buffer(const pinned_buffer&) = delete;
  pinned_buffer& operator=(const pinned_buffer&) = delete;

  void* data() const noexcept { return data_; }
  void* device_pointer() const;
  std::size_t size() const noexcept { return bytes_; }
  memory_view view() const noexcept { return {data_, bytes_, -1}; }

 private:
  void reset() noexcept;
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

// Managed memory that stays in host RAM (preferred location: the host) and is mapped into every device
// (accessed-by), so kernels read and write it over PCIe with no copy and no migration, like pinned_buffer. The
// difference is the GPU's mapping: the driver maps managed memory with large pages, so random reads from tables of
// many GiB do not miss the GPU's address translation on nearly every row as they do through cudaHostAlloc's 4 KiB
// mappings (measured on an H200: random 256 B rows of a 48 GiB table at 51 GB/s against 7.4; registered
// hugetlbfs pages read no faster than cudaHostAlloc's). The pages are touched by CPU threads here (one write per
// page; they arrive zeroed, and the memory reads as zeros), so it is resident, and mapped on every device, before a
// kernel reads it. data() is also the device pointer.
// cudaMallocManaged reserves no host memory: asking for more than the host has gets the process killed by Linux's
// OOM killer while touching, so callers check the available memory first (pytorch-direct's _memory does). A forked
// child process cannot read it (it dies with SIGSEGV).
//
// supported(): every visible device can access managed memory concurrently with the CPU (Linux, Pascal or newer).
class host_managed_buffer {
 public:
  host_managed_buffer() = default;
  explicit host_managed_buffer(std::size_t bytes);
  ~host_managed_buffer();
  host_managed_buffer(host_managed_buffer&& other) noexcept;
  host_managed_buffer& operator=(host_managed_buffer&& other) noexcept;
  host_managed_buffer(const host_managed_buffer&) = delete;
  host_managed_buffer& operator=(const host_managed_buffer&) = delete;

  static bool supported();
  void* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return bytes_; }
  memory_view view() const noexcept { return {data_, bytes_, -1}; }

 private:
  void reset() noexcept;
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

// Page-aligned pageable host memory (posix_memalign): the CPU fallback for staging buffers and O_DIRECT I/O.
class aligned_host_buffer {
 public:
  aligned_host_buffer() = default;
  aligned_host_buffer(std::size_t bytes, std::size_t alignment = 4096);
  ~aligned_host_buffer();
  aligned_host_buffer(aligned_host_buffer&& other) noexcept;
  aligned_host_buffer& operator=(aligned_host_buffer&& other) noexcept;
  aligned_host_buffer(const aligned_host_buffer&) = delete;
  aligned_host_buffer& operator=(const aligned_host_buffer&) = delete;

  void* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return bytes_; }
  memory_view view() const noexcept { return {data_, bytes_, -1}; }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

// Registration of existing host memory with CUDA (cudaHostRegister, portable + mapped), shared by everyone who
// asks for an overlapping range.
//
// CUDA refuses to register a page twice, so a process-wide registry keeps page-aligned registered extents with
// reference counts. A request reuses the extents it overlaps and registers only the pages not yet covered; each
// extent is unregistered exactly once, when the last registration using it is destroyed. A range that spans
// several extents needs the device to address registered memory by its host pointer (true on x86-64 with any
// GPU this toolkit supports); otherwise the request throws.
class host_registration {
 public:
  // read_only: the GPU only reads the memory (cudaHostRegisterReadOnly). Needed for read-only or file-backed
  // mappings: Linux >= 6.5 refuses long-term writable pins of file pages. A writable request that overlaps memory
  // registered read-only is refused.
  enum class access { read_write, read_only };

  host_registration() = default;
  host_registration(void* data, std::size_t bytes, access mode = access::read_write);
  ~host_registration();
  host_registration(host_registration&& other) noexcept;
  host_registration& operator=(host_registration&& other) noexcept;
  host_registration(const host_registration&) = delete;
  host_registration& operator=(const host_registration&) = delete;

  void* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return bytes_; }
  // The address kernels use for data(); equal to data() wherever host pointers work on the device.
  void* device_pointer() const noexcept { return device_pointer_; }
  bool registered() const noexcept { return !extents_.empty(); }
  access mode() const noexcept { return mode_; }

  // Pages of host memory currently registered through the registry, and the number of extents (for tests).
  static std::size_t registered_bytes();
  static std::size_t registered_extent_count();

 private:
  void release() noexcept;
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  void* device_pointer_ = nullptr;
  access mode_ = access::read_write;
  std::vector<std::uintptr_t> extents_;  // start addresses of the registry extents this registration holds
};

}  // namespace shared_cuda
