// Which I/O backends this build has and this machine can use. Never throws.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace ssdtrain {

struct backend_status {
  bool compiled = false;  // the backend's code is in this build
  bool usable = false;    // it works on this machine right now
  std::string detail;     // version, or why it is not usable
};

// io_uring through liburing: compiled when liburing-dev was found; usable when the kernel lets us create a ring.
backend_status io_uring_status();
// GPUDirect Storage through cuFile: libcufile is opened with dlopen, so it is "compiled" whenever CUDA is.
// `library` is tried first (e.g. the nvidia-cufile wheel's copy), then the usual names.
backend_status cufile_status(const std::string& library = "");

// The disk's own rate, for benchmarks: moves [buffer, buffer + bytes) to (write) or from (read) `fd` at file offsets
// [0, bytes) with io_uring, `depth` requests of `block` bytes in flight and nothing else in the path (no staging,
// no engine). `fd` should be opened with O_DIRECT and `buffer` aligned to 4096 (bytes a multiple of 4096).
// Returns the seconds from the first submission to the last completion; throws io_error on a failed or short
// request, unavailable_error where io_uring is not built or usable.
double raw_transfer(int fd, void* buffer, std::uint64_t bytes, std::size_t block, unsigned depth, bool write);

}  // namespace ssdtrain
