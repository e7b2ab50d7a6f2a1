// Which I/O backends this build has and this machine can use. Never throws.
#pragma once

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

}  // namespace ssdtrain
