// Error types and checking macros shared by every package.
//
// Each exception derives from a std type so that code catching std exceptions keeps working, and the Python
// bindings map each one to the matching Python exception (see bindings/shared_cuda_bindings.cpp):
//   cuda_error        -> RuntimeError subclass CudaError
//   compile_error     -> RuntimeError subclass CompileError (carries the NVRTC log)
//   io_error          -> OSError with errno
//   invalid_argument  -> ValueError
//   out_of_range      -> IndexError
//   unavailable_error -> RuntimeError subclass UnavailableError (a missing optional piece: GPU, NVRTC, liburing)
// Messages start with "file:line: " so a report points at the failing check.
#pragma once

#include <stdexcept>
#include <string>
#include <system_error>

namespace shared_cuda {

struct cuda_error : std::runtime_error {
  cuda_error(const std::string& what, int code) : std::runtime_error(what), code_(code) {}
  int code() const noexcept { return code_; }

 private:
  int code_;
};

struct compile_error : std::runtime_error {
  compile_error(const std::string& what, std::string log) : std::runtime_error(what), log_(std::move(log)) {}
  const std::string& log() const noexcept { return log_; }

 private:
  std::string log_;
};

struct io_error : std::system_error {
  io_error(int err, const std::string& what) : std::system_error(err, std::generic_category(), what) {}
  int err() const noexcept { return code().value(); }
};

struct invalid_argument : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

struct out_of_range : std::out_of_range {
  using std::out_of_range::out_of_range;
};

struct unavailable_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

namespace detail {

// "file:line: message", with the directory part of the file dropped to keep messages short.
std::string located(const char* file, int line, const std::string& message);

[[noreturn]] void throw_cuda_error(int code, const char* call, const char* file, int line);
[[noreturn]] void throw_io_error(int err, const std::string& what, const char* file, int line);

}  // namespace detail
}  // namespace shared_cuda

// Check a condition; throw invalid_argument with the message when it is false.
#define SHARED_CUDA_EXPECT(cond, msg)                                                                              \
  do {                                                                                                             \
    if (!(cond)) throw ::shared_cuda::invalid_argument(::shared_cuda::detail::located(__FILE__, __LINE__, (msg))); \
  } while (0)

// Check a condition; throw the given exception type (constructed from a string) when it is false.
#define SHARED_CUDA_EXPECT_AS(cond, exc, msg)                                          \
  do {                                                                                 \
    if (!(cond)) throw exc(::shared_cuda::detail::located(__FILE__, __LINE__, (msg))); \
  } while (0)

// Check a CUDA runtime call (cudaError_t) or driver call (CUresult); 0 means success for both.
#define SHARED_CUDA_TRY(call)                                                                  \
  do {                                                                                         \
    const int shared_cuda_status_ = static_cast<int>(call);                                    \
    if (shared_cuda_status_ != 0)                                                              \
      ::shared_cuda::detail::throw_cuda_error(shared_cuda_status_, #call, __FILE__, __LINE__); \
  } while (0)

// Check a POSIX call that returns -1 and sets errno.
#define SHARED_CUDA_SYSCALL(call)                                                              \
  do {                                                                                         \
    if ((call) == -1) ::shared_cuda::detail::throw_io_error(errno, #call, __FILE__, __LINE__); \
  } while (0)

// Check a call that returns a negative errno on failure (liburing's convention).
#define SHARED_CUDA_NEG_ERRNO(call)                                                                                \
  do {                                                                                                             \
    const int shared_cuda_ret_ = static_cast<int>(call);                                                           \
    if (shared_cuda_ret_ < 0) ::shared_cuda::detail::throw_io_error(-shared_cuda_ret_, #call, __FILE__, __LINE__); \
  } while (0)
