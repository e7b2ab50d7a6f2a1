#include "shared_cuda/error.hpp"

#include <cerrno>
#include <cstring>

#include "shared_cuda/device.hpp"

namespace shared_cuda::detail {

std::string located(const char* file, int line, const std::string& message) {
  const char* slash = std::strrchr(file, '/');
  return std::string(slash ? slash + 1 : file) + ":" + std::to_string(line) + ": " + message;
}

void throw_cuda_error(int code, const char* call, const char* file, int line) {
  throw cuda_error(located(file, line, std::string(call) + " failed: " + cuda_error_string(code)), code);
}

void throw_io_error(int err, const std::string& what, const char* file, int line) {
  throw io_error(err, located(file, line, what + " failed"));
}

}  // namespace shared_cuda::detail
