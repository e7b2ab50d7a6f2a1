// Per-process files, one per directory, and an extent allocator over them.
//
// Each file is created with O_TMPFILE where the file system allows it (it has no name, so it vanishes when the
// process ends, crash included), otherwise created and unlinked at once (same effect). Files grow with fallocate in
// steps up to a hard per-directory cap; freed extents are merged and reused, so steady training reuses space.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "ssdtrain/engine.hpp"

namespace ssdtrain::detail {

struct extent {
  int file = 0;              // index into store::files
  std::uint64_t offset = 0;  // bytes, aligned to the store's alignment
  std::uint64_t bytes = 0;   // a multiple of the alignment
};

// First-fit allocator over one growable range [0, size).
class extent_allocator {
 public:
  // Returns the offset, or -1 when no free range is large enough.
  std::int64_t allocate(std::uint64_t bytes);
  void release(std::uint64_t offset, std::uint64_t bytes);
  // Adds [size, size + bytes) as free space (the file grew).
  void grow(std::uint64_t bytes);
  std::uint64_t size() const noexcept { return size_; }
  std::uint64_t in_use() const noexcept { return in_use_; }
  // Largest free range that ends at the current size (what growing can extend).
  std::uint64_t free_tail() const;
  std::size_t free_ranges() const noexcept { return free_.size(); }

 private:
  std::map<std::uint64_t, std::uint64_t> free_;  // offset -> length, non-adjacent
  std::uint64_t size_ = 0;
  std::uint64_t in_use_ = 0;
};

struct store_file {
  std::string directory;
  int fd = -1;
  bool tmpfile = false;
  bool direct = false;
  std::uint64_t capacity = 0;
  extent_allocator allocator;
};

class store {
 public:
  static constexpr std::uint64_t alignment = 4096;

  store(const engine_config& config);
  ~store();
  store(const store&) = delete;
  store& operator=(const store&) = delete;

  // Space for `bytes`, as one extent or, when striping, one per directory, each a multiple of `unit` except the
  // last. Throws io_error(ENOSPC) naming the directory and its cap when nothing fits.
  std::vector<extent> allocate(std::uint64_t bytes, std::uint64_t unit);
  void release(const std::vector<extent>& extents);

  int fd(int file) const { return files_[file].fd; }
  std::size_t file_count() const noexcept { return files_.size(); }
  std::vector<int> fds() const;
  std::vector<directory_info> info() const;
  std::uint64_t bytes_in_use() const;
  std::uint64_t file_bytes() const;
  bool all_direct() const;
  bool any_direct() const;

 private:
  std::int64_t allocate_in(int file, std::uint64_t bytes);  // caller holds mutex_
  std::vector<store_file> files_;
  std::uint64_t stripe_threshold_;
  std::uint64_t grow_step_;
  std::size_t next_ = 0;  // round-robin start for unstriped extents
  mutable std::mutex mutex_;
};

}  // namespace ssdtrain::detail
