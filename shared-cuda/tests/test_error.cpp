#include <fcntl.h>

#include <cerrno>
#include <cstring>

#include "check.hpp"
#include "shared_cuda/error.hpp"

using namespace shared_cuda;

TEST(expect_throws_invalid_argument_with_location) {
  try {
    SHARED_CUDA_EXPECT(1 + 1 == 3, "arithmetic is broken");
    CHECK(false);
  } catch (const std::invalid_argument& e) {  // catchable as the std type
    const std::string what = e.what();
    CHECK(what.find("test_error.cpp:") == 0);
    CHECK(what.find("arithmetic is broken") != std::string::npos);
  }
}

TEST(syscall_check_carries_errno) {
  try {
    SHARED_CUDA_SYSCALL(open("/nonexistent/dir/file", O_RDONLY));
    CHECK(false);
  } catch (const std::system_error& e) {
    CHECK(e.code().value() == ENOENT);
    CHECK(std::string(e.what()).find("open(") != std::string::npos);
  }
}

TEST(negative_errno_check) {
  auto fails = [] { return -ENOSPC; };
  try {
    SHARED_CUDA_NEG_ERRNO(fails());
    CHECK(false);
  } catch (const io_error& e) {
    CHECK(e.err() == ENOSPC);
  }
}

TEST(cuda_try_reports_code_and_call) {
  auto failing_call = [] { return 2; };  // cudaErrorMemoryAllocation
  try {
    SHARED_CUDA_TRY(failing_call());
    CHECK(false);
  } catch (const cuda_error& e) {
    CHECK(e.code() == 2);
    CHECK(std::string(e.what()).find("failing_call()") != std::string::npos);
  }
  SHARED_CUDA_TRY(0);  // success does not throw
}

TEST(exception_types_derive_from_std) {
  CHECK_THROWS(std::runtime_error, throw cuda_error("x", 1));
  CHECK_THROWS(std::runtime_error, throw compile_error("x", "log"));
  CHECK_THROWS(std::system_error, throw io_error(EIO, "x"));
  CHECK_THROWS(std::out_of_range, throw out_of_range("x"));
  CHECK_THROWS(std::runtime_error, throw unavailable_error("x"));
}
