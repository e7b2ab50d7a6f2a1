#include "ssdtrain/detail/store.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "shared_cuda/error.hpp"

namespace ssdtrain::detail {

// ---------------------------------------------------------------------------------------------- extent_allocator

std::int64_t extent_allocator::allocate(std::uint64_t bytes) {
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < bytes) continue;
    const std::uint64_t offset = it->first;
    const std::uint64_t rest = it->second - bytes;
    free_.erase(it);
    if (rest > 0) free_.emplace(offset + bytes, rest);
    in_use_ += bytes;
    return static_cast<std::int64_t>(offset);
  }
  return -1;
}

void extent_allocator::release(std::uint64_t offset, std::uint64_t bytes) {
  in_use_ -= bytes;
  auto next = free_.lower_bound(offset);
  // Merge with the following and the preceding free range, so space does not fragment across steps.
  if (next != free_.end() && offset + bytes == next->first) {
    bytes += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      prev->second += bytes;
      return;
    }
  }
  free_.emplace(offset, bytes);
}

void extent_allocator::grow(std::uint64_t bytes) {
  const std::uint64_t old = size_;
  size_ += bytes;
  in_use_ += bytes;  // release() subtracts it again and merges with a free tail
  release(old, bytes);
}

std::uint64_t extent_allocator::free_tail() const {
  if (free_.empty()) return 0;
  const auto& last = *free_.rbegin();
  return last.first + last.second == size_ ? last.second : 0;
}

// ---------------------------------------------------------------------------------------------- store

namespace {

std::uint64_t round_up(std::uint64_t v, std::uint64_t a) { return (v + a - 1) / a * a; }

// Opens an anonymous file in `dir`: O_TMPFILE, or mkstemp + unlink where the file system lacks O_TMPFILE.
int open_anonymous(const std::string& dir, int extra_flags, bool* tmpfile) {
  int fd = ::open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC | extra_flags, 0600);
  if (fd >= 0) {
    *tmpfile = true;
    return fd;
  }
  const int err = errno;
  if (err != EOPNOTSUPP && err != EISDIR && err != EINVAL) {
    errno = err;
    return -1;
  }
  std::string path = dir + "/.ssdtrain-XXXXXX";
  fd = ::mkostemp(path.data(), O_CLOEXEC | extra_flags);
  if (fd < 0) return -1;
  ::unlink(path.c_str());  // the open descriptor keeps the data; the name is gone even if we crash
  *tmpfile = false;
  return fd;
}

// Writes one aligned block at offset 0: some file systems accept O_DIRECT at open and refuse it at I/O time.
bool direct_io_works(int fd) {
  void* block = nullptr;
  if (posix_memalign(&block, store::alignment, store::alignment) != 0) return false;
  std::memset(block, 0, store::alignment);
  const ssize_t n = ::pwrite(fd, block, store::alignment, 0);
  std::free(block);
  return n == static_cast<ssize_t>(store::alignment);
}

void grow_file(store_file& f, std::uint64_t bytes) {
  const std::uint64_t old = f.allocator.size();
  int ret = ::posix_fallocate(f.fd, static_cast<off_t>(old), static_cast<off_t>(bytes));
  if (ret == EOPNOTSUPP || ret == EINVAL) {
    // No fallocate here (some network file systems): size the file; space is then claimed at write time.
    ret = ::ftruncate(f.fd, static_cast<off_t>(old + bytes)) == 0 ? 0 : errno;
  }
  if (ret != 0) {
    throw shared_cuda::io_error(
        ret, "ssdtrain: could not reserve " + std::to_string(bytes) + " bytes in '" + f.directory + "' (file at " +
                 std::to_string(old) + " bytes)" +
                 (ret == ENOSPC ? ": free space there, lower capacity_per_directory, or add directories" : ""));
  }
  f.allocator.grow(bytes);
}

}  // namespace

store::store(const engine_config& config)
    : stripe_threshold_(config.stripe_threshold ? config.stripe_threshold : 4 * config.block_size),
      grow_step_(std::max<std::uint64_t>(round_up(config.grow_step, alignment), alignment)) {
  SHARED_CUDA_EXPECT(!config.directories.empty(), "ssdtrain: no directories given: pass at least one directory");
  SHARED_CUDA_EXPECT(config.capacity_per_directory >= alignment,
                     "ssdtrain: capacity_per_directory must be at least 4096 bytes");
  try {
    for (const auto& dir : config.directories) {
      struct stat st{};
      if (::stat(dir.c_str(), &st) != 0) {
        const int err = errno;
        throw shared_cuda::io_error(err, "ssdtrain: directory '" + dir + "'" +
                                             (err == ENOENT ? " (create it or pass an existing directory)" : ""));
      }
      if (!S_ISDIR(st.st_mode))
        throw shared_cuda::io_error(ENOTDIR, "ssdtrain: '" + dir + "' is not a directory; pass a directory");
      store_file f;
      f.directory = dir;
      f.capacity = config.capacity_per_directory / alignment * alignment;
      const bool want_direct = config.direct != direct_mode::off;
      // fault.op == "direct" simulates a file system that refuses O_DIRECT (tmpfs before Linux 6.6, some FUSE).
      const bool refuse_direct = config.fault.op == "direct";
      f.fd = want_direct && !refuse_direct ? open_anonymous(dir, O_DIRECT, &f.tmpfile) : -1;
      if (refuse_direct) errno = EINVAL;
      f.direct = f.fd >= 0;
      if (f.fd >= 0 && !direct_io_works(f.fd)) {
        ::close(f.fd);
        f.fd = -1;
        f.direct = false;
        errno = EINVAL;
      }
      if (f.fd < 0 && want_direct && (errno == EINVAL || errno == EOPNOTSUPP) && config.direct == direct_mode::on) {
        throw shared_cuda::io_error(EINVAL, "ssdtrain: the file system of '" + dir +
                                                "' does not support O_DIRECT (tmpfs?); use direct='auto' or 'off', "
                                                "or a directory on a disk");
      }
      if (f.fd < 0) {
        const int first_err = errno;
        if (want_direct && first_err != EINVAL && first_err != EOPNOTSUPP) {
          throw shared_cuda::io_error(first_err,
                                      "ssdtrain: cannot create a file in '" + dir + "' (pass a writable directory)");
        }
        f.fd = open_anonymous(dir, 0, &f.tmpfile);
        if (f.fd < 0) {
          const int err = errno;
          throw shared_cuda::io_error(err,
                                      "ssdtrain: cannot create a file in '" + dir + "' (pass a writable directory)");
        }
      }
      files_.push_back(std::move(f));
      const std::uint64_t initial =
          std::min(round_up(config.preallocate_per_directory, alignment), files_.back().capacity);
      if (initial > 0) grow_file(files_.back(), initial);
    }
  } catch (...) {
    for (auto& f : files_) ::close(f.fd);
    throw;
  }
}

store::~store() {
  for (auto& f : files_)
    if (f.fd >= 0) ::close(f.fd);
}

std::int64_t store::allocate_in(int file, std::uint64_t bytes) {
  store_file& f = files_[file];
  std::int64_t offset = f.allocator.allocate(bytes);
  if (offset >= 0) return offset;
  // Grow by what the free tail lacks, at least one step, within the cap.
  const std::uint64_t need = bytes - f.allocator.free_tail();
  if (f.allocator.size() + need > f.capacity) return -1;
  const std::uint64_t step = std::min(std::max(need, grow_step_), f.capacity - f.allocator.size());
  try {
    grow_file(f, step);
  } catch (const shared_cuda::io_error& e) {
    if (e.err() != ENOSPC || step == need) throw;
    grow_file(f, need);  // a whole step does not fit; what this allocation needs might
  }
  return f.allocator.allocate(bytes);
}

std::vector<extent> store::allocate(std::uint64_t bytes, std::uint64_t unit) {
  SHARED_CUDA_EXPECT(bytes > 0, "ssdtrain: cannot allocate 0 bytes");
  std::lock_guard<std::mutex> lock(mutex_);
  const std::size_t n = files_.size();
  std::vector<extent> out;
  if (n > 1 && bytes >= stripe_threshold_) {
    // Equal parts (whole units) on every directory, so one large tensor reads from all devices at once.
    const std::uint64_t units = (bytes + unit - 1) / unit;
    const std::uint64_t per = (units + n - 1) / n * unit;
    std::uint64_t left = bytes;
    for (std::size_t i = 0; i < n && left > 0; ++i) {
      const std::uint64_t part = round_up(std::min(per, left), alignment);
      const std::int64_t off = allocate_in(static_cast<int>(i), part);
      if (off < 0) {
        for (const auto& e : out) files_[e.file].allocator.release(e.offset, e.bytes);
        out.clear();
        break;  // try unstriped below
      }
      out.push_back({static_cast<int>(i), static_cast<std::uint64_t>(off), part});
      left -= std::min(per, left);
    }
    if (!out.empty()) return out;
  }
  const std::uint64_t padded = round_up(bytes, alignment);
  for (std::size_t k = 0; k < n; ++k) {
    const int i = static_cast<int>((next_ + k) % n);
    const std::int64_t off = allocate_in(i, padded);
    if (off >= 0) {
      next_ = (i + 1) % n;
      return {{i, static_cast<std::uint64_t>(off), padded}};
    }
  }
  std::string where;
  for (const auto& f : files_) {
    where += (where.empty() ? "" : ", ") + f.directory + " (" + std::to_string(f.allocator.in_use()) + " of cap " +
             std::to_string(f.capacity) + " bytes in use)";
  }
  throw shared_cuda::io_error(ENOSPC, "ssdtrain: no room for " + std::to_string(bytes) + " bytes: " + where +
                                          "; free handles, raise capacity_per_directory, or add directories");
}

void store::release(const std::vector<extent>& extents) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& e : extents) files_[e.file].allocator.release(e.offset, e.bytes);
}

std::vector<int> store::fds() const {
  std::vector<int> out;
  for (const auto& f : files_) out.push_back(f.fd);
  return out;
}

std::vector<directory_info> store::info() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<directory_info> out;
  for (const auto& f : files_)
    out.push_back({f.directory, f.tmpfile, f.direct, f.allocator.size(), f.allocator.in_use(), f.capacity, f.fd});
  return out;
}

std::uint64_t store::bytes_in_use() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::uint64_t s = 0;
  for (const auto& f : files_) s += f.allocator.in_use();
  return s;
}

std::uint64_t store::file_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::uint64_t s = 0;
  for (const auto& f : files_) s += f.allocator.size();
  return s;
}

bool store::any_direct() const {
  for (const auto& f : files_)
    if (f.direct) return true;
  return false;
}

bool store::all_direct() const {
  for (const auto& f : files_)
    if (!f.direct) return false;
  return true;
}

}  // namespace ssdtrain::detail
