// The NVRTC loader. Compiling needs only libnvrtc (the nox session points SHARED_CUDA_NVRTC_PATH at the wheel's);
// loading and launching need a GPU.
#include <unistd.h>
#include <cstdlib>

#include <filesystem>
#include <fstream>
#include <vector>

#include "check.hpp"
#include "shared_cuda/device.hpp"
#include "shared_cuda/error.hpp"
#include "shared_cuda/jit.hpp"
#include "shared_cuda/memory.hpp"
#include "shared_cuda/stream.hpp"

using namespace shared_cuda;

static const char* saxpy_source = R"(
extern "C" __global__ void saxpy(float a, const float* x, float* y, long long n) {
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}
)";

static void need_nvrtc() {
  std::vector<std::string> candidates;
  if (const char* path = std::getenv("SHARED_CUDA_NVRTC_PATH")) candidates.push_back(path);
  for (auto& c : jit::default_nvrtc_candidates()) candidates.push_back(c);
  jit::load_nvrtc(candidates);
  if (!jit::nvrtc_available()) SKIP("NVRTC not found (set SHARED_CUDA_NVRTC_PATH)");
}

static std::string temp_dir() {
  auto dir = std::filesystem::temp_directory_path() / ("shared_cuda_jit_test_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  return dir.string();
}

TEST(compile_for_sm90_without_gpu) {
  need_nvrtc();
  CHECK(jit::nvrtc_version() >= 12000);
  const auto program = jit::compile(saxpy_source, "saxpy.cu", {90, {}});
  CHECK(program.cubin.size() > 64);
  CHECK(std::string(program.cubin.data(), 4) ==
        "\x7f"
        "ELF");  // a cubin is an ELF file
}

TEST(compile_error_has_log_and_line) {
  need_nvrtc();
  const std::string bad = "extern \"C\" __global__ void k(float* x) {\n  x[0] = undefined_name;\n}\n";
  try {
    jit::compile(bad, "bad.cu", {90, {}});
    CHECK(false);
  } catch (const compile_error& e) {
    const std::string what = e.what();
    CHECK(what.find("undefined_name") != std::string::npos);                      // from the log
    CHECK(what.find("bad.cu:2:   x[0] = undefined_name;") != std::string::npos);  // the failing line, quoted
    CHECK(!e.log().empty());
  }
}

TEST(cache_key_changes_with_inputs) {
  need_nvrtc();
  const std::string k = jit::cache_key(saxpy_source, {90, {}});
  CHECK(k.size() == 64);
  CHECK(k == jit::cache_key(saxpy_source, {90, {}}));
  CHECK(k != jit::cache_key(saxpy_source, {80, {}}));
  CHECK(k != jit::cache_key(saxpy_source, {90, {"-DX=1"}}));
  CHECK(k != jit::cache_key(std::string(saxpy_source) + " ", {90, {}}));
}

TEST(loader_caches_on_disk) {
  need_nvrtc();
  const std::string dir = temp_dir();
  jit::loader first(dir);
  const auto cubin = first.get_cubin(saxpy_source, "saxpy.cu", {90, {}});
  CHECK(first.stats().compilations == 1);
  jit::loader second(dir);  // a new process would see the same directory
  CHECK(second.get_cubin(saxpy_source, "saxpy.cu", {90, {}}) == cubin);
  CHECK(second.stats().disk_hits == 1 && second.stats().compilations == 0);
  std::filesystem::remove_all(dir);
}

TEST(damaged_cache_entry_is_detected_and_rebuilt) {
  need_nvrtc();
  const std::string dir = temp_dir();
  jit::loader first(dir);
  const auto cubin = first.get_cubin(saxpy_source, "saxpy.cu", {90, {}});
  const std::string path = dir + "/" + jit::cache_key(saxpy_source, {90, {}}) + ".cubin";
  for (const bool truncate : {true, false}) {
    {  // damage the entry: cut it short, or flip a byte of the binary
      std::vector<char> bytes;
      {
        std::ifstream in(path, std::ios::binary);
        bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
      }
      if (truncate)
        bytes.resize(bytes.size() / 2);
      else
        bytes[bytes.size() - 100] ^= 0x5a;
      std::ofstream out(path, std::ios::binary | std::ios::trunc);
      out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    }
    jit::loader second(dir);
    CHECK(second.get_cubin(saxpy_source, "saxpy.cu", {90, {}}) == cubin);
    CHECK(second.stats().corrupt_entries == 1 && second.stats().compilations == 1);
    jit::loader third(dir);  // the rebuilt entry is good again
    CHECK(third.get_cubin(saxpy_source, "saxpy.cu", {90, {}}) == cubin);
    CHECK(third.stats().disk_hits == 1 && third.stats().corrupt_entries == 0);
  }
  std::filesystem::remove_all(dir);
}

TEST(compile_load_launch_on_gpu) {
  need_nvrtc();
  if (!cuda_available()) SKIP("no CUDA device");
  const std::string dir = temp_dir();
  jit::loader loader(dir);
  auto module = loader.get(saxpy_source, "saxpy.cu", {});
  CHECK(loader.get(saxpy_source, "saxpy.cu", {}) == module);  // in-memory hit
  CHECK(loader.stats().memory_hits == 1);
  jit::kernel saxpy = module->get_kernel("saxpy");
  CHECK_THROWS(std::invalid_argument, module->get_kernel("nope"));

  const long long n = 1 << 20;
  pinned_buffer x(n * sizeof(float)), y(n * sizeof(float));
  auto* xs = static_cast<float*>(x.data());
  auto* ys = static_cast<float*>(y.data());
  for (long long i = 0; i < n; ++i) {
    xs[i] = float(i % 97);
    ys[i] = 1.0F;
  }
  auto pack = [](auto value) { return std::string(reinterpret_cast<const char*>(&value), sizeof(value)); };
  stream s;
  saxpy.launch({unsigned((n + 255) / 256)}, {256}, 0, s.view(),
               {pack(2.0F), pack(x.device_pointer()), pack(y.device_pointer()), pack(n)});
  s.synchronize();
  for (long long i = 0; i < n; ++i) CHECK(ys[i] == 2.0F * float(i % 97) + 1.0F);
  std::filesystem::remove_all(dir);
}

TEST(launch_list_patches_pointers_on_gpu) {
  // Two saxpy launches packed once; y's pointer is patched from the base given to each launch() (with an offset for
  // the second half), so one list serves buffers it never saw.
  need_nvrtc();
  if (!cuda_available()) SKIP("no CUDA device");
  const std::string dir = temp_dir();
  jit::loader loader(dir);
  jit::kernel saxpy = loader.get(saxpy_source, "saxpy.cu", {})->get_kernel("saxpy");
  const long long n = 1 << 12, half = n / 2;
  pinned_buffer x(n * sizeof(float)), y1(n * sizeof(float)), y2(n * sizeof(float));
  auto* xs = static_cast<float*>(x.data());
  auto* a = static_cast<float*>(y1.data());
  auto* b = static_cast<float*>(y2.data());
  for (long long i = 0; i < n; ++i) xs[i] = float(i % 13), a[i] = b[i] = 1.0F;
  auto pack = [](auto value) { return std::string(reinterpret_cast<const char*>(&value), sizeof(value)); };
  jit::launch_list list;
  const unsigned grid = unsigned((half + 255) / 256);
  for (int part = 0; part < 2; ++part)
    list.add(
        saxpy, {grid}, {256}, 0,
        {pack(3.0F), pack(static_cast<float*>(x.device_pointer()) + part * half), pack(std::uint64_t(0)), pack(half)});
  list.patch(0, 2, 0, 0);
  list.patch(1, 2, 0, half * sizeof(float));
  CHECK_THROWS(std::invalid_argument, list.patch(2, 0, 0, 0));
  CHECK_THROWS(std::invalid_argument, list.launch(stream_view{}, {}, 0, 2));  // base 0 not given
  CHECK_THROWS(std::invalid_argument, list.add(saxpy, {1}, {1}, 0, {std::string(9, '\0')}));
  stream s;
  list.launch(s.view(), {reinterpret_cast<std::uint64_t>(y1.device_pointer())}, 0, 2);
  list.launch(s.view(), {reinterpret_cast<std::uint64_t>(y2.device_pointer())}, 0, 1);  // the first half only
  s.synchronize();
  for (long long i = 0; i < n; ++i) {
    CHECK(a[i] == 3.0F * float(i % 13) + 1.0F);
    CHECK(b[i] == (i < half ? 3.0F * float(i % 13) + 1.0F : 1.0F));
  }
  std::filesystem::remove_all(dir);
}

TEST(launch_list_instances_write_bound_values_on_gpu) {
  // One saxpy launch as a template: x's pointer, y's patch offset, n and the grid bound to values, so each instance
  // (one per graph in hector) runs on buffers and sizes the template never saw; the template itself stays unbound.
  need_nvrtc();
  if (!cuda_available()) SKIP("no CUDA device");
  const std::string dir = temp_dir();
  jit::loader loader(dir);
  jit::kernel saxpy = loader.get(saxpy_source, "saxpy.cu", {})->get_kernel("saxpy");
  const long long n = 1 << 12, half = n / 2;
  pinned_buffer x(n * sizeof(float)), y(n * sizeof(float));
  auto* xs = static_cast<float*>(x.data());
  auto* ys = static_cast<float*>(y.data());
  for (long long i = 0; i < n; ++i) xs[i] = float(i % 13), ys[i] = 1.0F;
  auto pack = [](auto value) { return std::string(reinterpret_cast<const char*>(&value), sizeof(value)); };
  using target = jit::launch_list::value_target;
  jit::launch_list list;
  list.add(saxpy, {1}, {256}, 0, {pack(3.0F), pack(std::uint64_t(0)), pack(std::uint64_t(0)), pack(0LL)});
  list.patch(0, 2, 0, 0);
  list.bind_value(0, target::parameter, 1, 0);     // x
  list.bind_value(0, target::patch_offset, 2, 1);  // y's offset from base 0
  list.bind_value(0, target::parameter, 3, 2);     // n
  list.bind_value(0, target::grid_x, 0, 3);
  CHECK_THROWS(std::invalid_argument, list.bind_value(1, target::parameter, 0, 0));     // no launch 1
  CHECK_THROWS(std::invalid_argument, list.bind_value(0, target::parameter, 4, 0));     // no parameter 4
  CHECK_THROWS(std::invalid_argument, list.bind_value(0, target::patch_offset, 1, 0));  // x is not patched
  CHECK_THROWS(std::invalid_argument, list.instantiate({1, 2, 3}));                     // 4 values needed
  const auto x_at = [&](long long i) { return reinterpret_cast<std::uint64_t>(x.device_pointer()) + i * 4; };
  const unsigned blocks = unsigned((half + 255) / 256);
  CHECK_THROWS(std::invalid_argument, list.instantiate({x_at(0), 0, std::uint64_t(half), 0}));  // an empty grid
  // the first half of y from x's first half; the second from x's second half, offset half elements from the base
  jit::launch_list first = list.instantiate({x_at(0), 0, std::uint64_t(half), blocks});
  jit::launch_list second = list.instantiate({x_at(half), std::uint64_t(half * 4), std::uint64_t(half), blocks});
  CHECK(first.size() == 1 && second.size() == 1);
  stream s;
  const std::uint64_t base = reinterpret_cast<std::uint64_t>(y.device_pointer());
  second.launch(s.view(), {base}, 0, 1);
  first.launch(s.view(), {base}, 0, 1);
  s.synchronize();
  for (long long i = 0; i < n; ++i) CHECK(ys[i] == 3.0F * float(i % 13) + 1.0F);
  std::filesystem::remove_all(dir);
}
