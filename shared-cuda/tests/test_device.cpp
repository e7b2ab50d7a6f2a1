#include "check.hpp"
#include "shared_cuda/device.hpp"
#include "shared_cuda/error.hpp"

using namespace shared_cuda;

TEST(queries_never_throw) {
  const int count = device_count();
  CHECK(count >= 0);
  CHECK(cuda_available() == (count > 0));
  CHECK(!get_device_properties(-1).has_value());
  CHECK(!get_device_properties(count).has_value());
  (void)driver_version();
  (void)current_device();
}

TEST(build_facts_agree) {
  CHECK(compiled_with_cuda() == (SHARED_CUDA_HAS_CUDA != 0));
  CHECK(compiled_with_cuda() == !compiled_architectures().empty());
  CHECK(compiled_with_cuda() == (compiled_runtime_version() > 0));
}

TEST(require_cuda_without_gpu) {
  if (cuda_available()) SKIP("a GPU is present");
  try {
    require_cuda("the frobnicator");
    CHECK(false);
  } catch (const unavailable_error& e) {
    CHECK(std::string(e.what()).find("the frobnicator") != std::string::npos);
  }
}

TEST(properties_of_each_device) {
  if (!cuda_available()) SKIP("no CUDA device");
  for (int d = 0; d < device_count(); ++d) {
    const auto props = get_device_properties(d);
    CHECK(props.has_value());
    CHECK(props->major >= 5);
    CHECK(props->multiprocessors > 0);
    CHECK(props->total_memory > 0);
    CHECK(!props->name.empty());
  }
}
