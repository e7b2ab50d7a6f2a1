#include "shared_cuda/jit.hpp"

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "shared_cuda/detail/sha256.hpp"
#include "shared_cuda/device.hpp"
#include "shared_cuda/error.hpp"

#if SHARED_CUDA_HAS_CUDA
#include <cuda.h>
#include <cuda_runtime_api.h>
#endif

namespace shared_cuda::jit {

// ================================================================================================ NVRTC via dlopen
namespace {

// NVRTC's C API, declared here so that compiling needs no CUDA headers (CPU-only builds can still compile kernels).
using nvrtc_result = int;  // nvrtcResult; 0 is NVRTC_SUCCESS
using nvrtc_program = struct nvrtc_program_opaque*;

struct nvrtc_api {
  void* handle = nullptr;
  std::string path;
  const char* (*get_error_string)(nvrtc_result) = nullptr;
  nvrtc_result (*version)(int*, int*) = nullptr;
  nvrtc_result (*get_num_supported_archs)(int*) = nullptr;
  nvrtc_result (*get_supported_archs)(int*) = nullptr;
  nvrtc_result (*create_program)(nvrtc_program*, const char*, const char*, int, const char* const*,
                                 const char* const*) = nullptr;
  nvrtc_result (*destroy_program)(nvrtc_program*) = nullptr;
  nvrtc_result (*compile_program)(nvrtc_program, int, const char* const*) = nullptr;
  nvrtc_result (*get_program_log_size)(nvrtc_program, std::size_t*) = nullptr;
  nvrtc_result (*get_program_log)(nvrtc_program, char*) = nullptr;
  nvrtc_result (*get_cubin_size)(nvrtc_program, std::size_t*) = nullptr;
  nvrtc_result (*get_cubin)(nvrtc_program, char*) = nullptr;
};

std::mutex nvrtc_mutex;
nvrtc_api nvrtc;  // guarded by nvrtc_mutex until `nvrtc_loaded` is set, then read-only
std::atomic<bool> nvrtc_loaded{false};

template <typename F>
bool bind_symbol(void* handle, const char* name, F& out) {
  out = reinterpret_cast<F>(dlsym(handle, name));
  return out != nullptr;
}

bool try_open(const std::string& candidate, nvrtc_api& api) {
  void* handle = dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) return false;
  api.handle = handle;
  const bool complete = bind_symbol(handle, "nvrtcGetErrorString", api.get_error_string) &&
                        bind_symbol(handle, "nvrtcVersion", api.version) &&
                        bind_symbol(handle, "nvrtcGetNumSupportedArchs", api.get_num_supported_archs) &&
                        bind_symbol(handle, "nvrtcGetSupportedArchs", api.get_supported_archs) &&
                        bind_symbol(handle, "nvrtcCreateProgram", api.create_program) &&
                        bind_symbol(handle, "nvrtcDestroyProgram", api.destroy_program) &&
                        bind_symbol(handle, "nvrtcCompileProgram", api.compile_program) &&
                        bind_symbol(handle, "nvrtcGetProgramLogSize", api.get_program_log_size) &&
                        bind_symbol(handle, "nvrtcGetProgramLog", api.get_program_log) &&
                        bind_symbol(handle, "nvrtcGetCUBINSize", api.get_cubin_size) &&
                        bind_symbol(handle, "nvrtcGetCUBIN", api.get_cubin);
  if (!complete) {
    dlclose(handle);
    api = nvrtc_api{};
    return false;
  }
  char resolved[4096] = {0};
  Dl_info info{};
  api.path = candidate;
  if (dladdr(reinterpret_cast<void*>(api.version), &info) != 0 && info.dli_fname != nullptr &&
      realpath(info.dli_fname, resolved) != nullptr)
    api.path = resolved;
  return true;
}

const nvrtc_api& require_nvrtc() {
  if (!nvrtc_loaded.load(std::memory_order_acquire)) load_nvrtc(default_nvrtc_candidates());
  if (!nvrtc_loaded.load(std::memory_order_acquire))
    throw unavailable_error(
        "NVRTC (libnvrtc) was not found: install the CUDA toolkit or the 'nvidia-cuda-nvrtc' wheel "
        "(pip install nvidia-cuda-nvrtc), or point SHARED_CUDA_NVRTC_PATH at libnvrtc.so");
  return nvrtc;
}

void check_nvrtc(nvrtc_result result, const char* call, const char* file, int line) {
  if (result != 0)
    throw std::runtime_error(
        detail::located(file, line, std::string(call) + " failed: " + nvrtc.get_error_string(result)));
}
#define NVRTC_TRY(call) check_nvrtc((call), #call, __FILE__, __LINE__)

}  // namespace

void load_nvrtc(const std::vector<std::string>& candidates) {
  std::lock_guard<std::mutex> lock(nvrtc_mutex);
  if (nvrtc_loaded.load(std::memory_order_acquire)) return;
  for (const auto& candidate : candidates) {
    nvrtc_api api;
    if (!candidate.empty() && try_open(candidate, api)) {
      nvrtc = api;
      nvrtc_loaded.store(true, std::memory_order_release);
      return;
    }
  }
}

std::vector<std::string> default_nvrtc_candidates() {
  std::vector<std::string> out;
  for (const char* var : {"CUDA_HOME", "CUDA_PATH"}) {
    if (const char* root = std::getenv(var); root != nullptr && *root != '\0') {
      out.push_back(std::string(root) + "/lib64/libnvrtc.so");
      out.push_back(std::string(root) + "/lib/libnvrtc.so");
    }
  }
  out.push_back("/usr/local/cuda/lib64/libnvrtc.so");
  for (const char* name : {"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"}) out.push_back(name);
  return out;
}

bool nvrtc_available() noexcept {
  try {
    require_nvrtc();
    return true;
  } catch (...) {
    return false;
  }
}

std::string nvrtc_path() { return nvrtc_available() ? nvrtc.path : std::string(); }

int nvrtc_version() noexcept {
  if (!nvrtc_available()) return 0;
  int major = 0, minor = 0;
  if (nvrtc.version(&major, &minor) != 0) return 0;
  return major * 1000 + minor * 10;
}

std::vector<int> nvrtc_supported_architectures() {
  const nvrtc_api& api = require_nvrtc();
  int count = 0;
  NVRTC_TRY(api.get_num_supported_archs(&count));
  std::vector<int> archs(static_cast<std::size_t>(count));
  if (count > 0) NVRTC_TRY(api.get_supported_archs(archs.data()));
  return archs;
}

// ================================================================================================ compile
namespace {

// "name(12): error: ..." -> the failing source lines, quoted, so the error shows the code and not only the log.
// Parsed by hand: std::regex instantiations are easily interposed by another library's (libtorch's) copies.
std::string quote_failing_lines(const std::string& source, const std::string& name, const std::string& log) {
  std::vector<std::string> lines;
  std::istringstream src(source);
  for (std::string line; std::getline(src, line);) lines.push_back(line);

  std::set<int> failing;
  std::istringstream diagnostics(log);
  for (std::string line; std::getline(diagnostics, line);) {
    const std::string prefix = name + "(";
    if (line.compare(0, prefix.size(), prefix) != 0) continue;
    const std::size_t close = line.find(')', prefix.size());
    if (close == std::string::npos || close == prefix.size()) continue;
    const std::string digits = line.substr(prefix.size(), close - prefix.size());
    if (digits.find_first_not_of("0123456789") != std::string::npos) continue;
    const std::string rest = line.substr(close + 1);
    if (rest.rfind(": error", 0) == 0 || rest.rfind(": catastrophic error", 0) == 0) failing.insert(std::stoi(digits));
  }

  std::string out;
  for (int number : failing) {
    if (number < 1 || number > static_cast<int>(lines.size())) continue;
    out += "  " + name + ":" + std::to_string(number) + ": " + lines[static_cast<std::size_t>(number - 1)] + "\n";
  }
  return out;
}

}  // namespace

compiled_program compile(const std::string& source, const std::string& name, const compile_options& options) {
  SHARED_CUDA_EXPECT(options.architecture >= 50,
                     "compile_options.architecture must be a compute capability such as 90 (sm_90), got " +
                         std::to_string(options.architecture));
  const nvrtc_api& api = require_nvrtc();

  std::vector<std::string> flags = {"--gpu-architecture=sm_" + std::to_string(options.architecture), "--std=c++17"};
  flags.insert(flags.end(), options.flags.begin(), options.flags.end());
  std::vector<const char*> argv;
  for (const auto& f : flags) argv.push_back(f.c_str());

  nvrtc_program program = nullptr;
  NVRTC_TRY(api.create_program(&program, source.c_str(), name.c_str(), 0, nullptr, nullptr));
  struct program_guard {
    const nvrtc_api& api;
    nvrtc_program& program;
    ~program_guard() { api.destroy_program(&program); }
  } guard{api, program};

  const nvrtc_result status = api.compile_program(program, static_cast<int>(argv.size()), argv.data());
  std::size_t log_size = 0;
  NVRTC_TRY(api.get_program_log_size(program, &log_size));
  std::string log(log_size, '\0');
  if (log_size > 0) NVRTC_TRY(api.get_program_log(program, log.data()));
  while (!log.empty() && (log.back() == '\0' || log.back() == '\n')) log.pop_back();

  if (status != 0) {
    std::string message = "NVRTC could not compile '" + name + "' for sm_" + std::to_string(options.architecture) +
                          " (" + api.get_error_string(status) + ")";
    const std::string quoted = quote_failing_lines(source, name, log);
    if (!quoted.empty()) message += "\nfailing source lines:\n" + quoted;
    message += "\nNVRTC log:\n" + log;
    throw compile_error(message, log);
  }

  compiled_program out;
  out.log = log;
  std::size_t cubin_size = 0;
  NVRTC_TRY(api.get_cubin_size(program, &cubin_size));
  SHARED_CUDA_EXPECT_AS(cubin_size > 0, std::runtime_error, "NVRTC produced no cubin for '" + name + "'");
  out.cubin.resize(cubin_size);
  NVRTC_TRY(api.get_cubin(program, out.cubin.data()));
  return out;
}

// ================================================================================================ disk cache

std::string cache_key(const std::string& source, const compile_options& options) {
  detail::sha256 hash;
  // Each field is length-prefixed so that moving text between fields changes the key.
  auto field = [&hash](const std::string& text) {
    hash.update(std::to_string(text.size()) + ":");
    hash.update(text);
  };
  field("shared_cuda.jit.v2");  // v2: files carry a checksum header
  field(source);
  field(std::to_string(options.architecture));
  field(std::to_string(nvrtc_version()));
  for (const auto& flag : options.flags) field(flag);
  return hash.hex_digest();
}

disk_cache::disk_cache(std::string directory) : directory_(std::move(directory)) {}

namespace {
// Cache file layout: this tag, the SHA-256 (hex) of the binary, a newline, the binary.
constexpr char cache_tag[] = "shared_cuda.jit.cubin sha256=";
std::string checksum(const std::vector<char>& data) {
  detail::sha256 hash;
  hash.update(data.data(), data.size());
  return hash.hex_digest();
}
}  // namespace

bool disk_cache::load(const std::string& key, std::vector<char>& cubin, bool* corrupt) const {
  if (corrupt != nullptr) *corrupt = false;
  if (directory_.empty()) return false;
  std::ifstream in(directory_ + "/" + key + ".cubin", std::ios::binary);
  if (!in) return false;
  std::vector<char> file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) return false;
  const std::size_t tag = sizeof(cache_tag) - 1, header = tag + 64 + 1;
  const bool valid = file.size() > header && std::equal(cache_tag, cache_tag + tag, file.begin()) &&
                     file[header - 1] == '\n' &&
                     std::string(file.begin() + tag, file.begin() + tag + 64) ==
                         checksum(std::vector<char>(file.begin() + header, file.end()));
  if (!valid) {
    if (corrupt != nullptr) *corrupt = true;
    return false;
  }
  cubin.assign(file.begin() + header, file.end());
  return true;
}

bool disk_cache::store(const std::string& key, const std::vector<char>& cubin) const {
  if (directory_.empty()) return false;
  std::error_code ec;
  std::filesystem::create_directories(directory_, ec);
  if (ec) return false;
  const std::string final_path = directory_ + "/" + key + ".cubin";
  const std::string temp_path =
      final_path + ".tmp." + std::to_string(getpid()) + "." + std::to_string(reinterpret_cast<std::uintptr_t>(&cubin));
  {
    std::ofstream out(temp_path, std::ios::binary | std::ios::trunc);
    if (!out) return false;
    out << cache_tag << checksum(cubin) << '\n';
    out.write(cubin.data(), static_cast<std::streamsize>(cubin.size()));
    if (!out.flush()) {
      std::filesystem::remove(temp_path, ec);
      return false;
    }
  }
  std::filesystem::rename(temp_path, final_path, ec);  // atomic on POSIX: readers see the old file or the new one
  if (ec) std::filesystem::remove(temp_path, ec);
  return !ec;
}

// ================================================================================================ driver API
#if SHARED_CUDA_HAS_CUDA
namespace {

struct driver_api {
  CUresult (*module_load_data)(CUmodule*, const void*) = nullptr;
  CUresult (*module_unload)(CUmodule) = nullptr;
  CUresult (*module_get_function)(CUfunction*, CUmodule, const char*) = nullptr;
  CUresult (*launch_kernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                            void**, void**) = nullptr;
  CUresult (*func_set_attribute)(CUfunction, CUfunction_attribute, int) = nullptr;
  CUresult (*func_get_attribute)(int*, CUfunction_attribute, CUfunction) = nullptr;
  CUresult (*get_error_name)(CUresult, const char**) = nullptr;
  CUresult (*get_error_string)(CUresult, const char**) = nullptr;
};

template <typename F>
void entry_point(const char* symbol, F& out) {
  cudaDriverEntryPointQueryResult found{};
  void* fn = nullptr;
  SHARED_CUDA_TRY(cudaGetDriverEntryPointByVersion(symbol, &fn, 12000, cudaEnableDefault, &found));
  if (found != cudaDriverEntryPointSuccess || fn == nullptr)
    throw unavailable_error(std::string("the CUDA driver does not provide ") + symbol);
  out = reinterpret_cast<F>(fn);
}

const driver_api& driver() {
  static const driver_api api = [] {
    require_cuda("loading a JIT module");
    driver_api d;
    entry_point("cuModuleLoadData", d.module_load_data);
    entry_point("cuModuleUnload", d.module_unload);
    entry_point("cuModuleGetFunction", d.module_get_function);
    entry_point("cuLaunchKernel", d.launch_kernel);
    entry_point("cuFuncSetAttribute", d.func_set_attribute);
    entry_point("cuFuncGetAttribute", d.func_get_attribute);
    entry_point("cuGetErrorName", d.get_error_name);
    entry_point("cuGetErrorString", d.get_error_string);
    return d;
  }();
  return api;
}

void check_driver(CUresult result, const char* call, const char* file, int line) {
  if (result == CUDA_SUCCESS) return;
  const char* name = "unknown";
  const char* text = "";
  driver().get_error_name(result, &name);
  driver().get_error_string(result, &text);
  throw cuda_error(detail::located(file, line, std::string(call) + " failed: " + name + ": " + text),
                   static_cast<int>(result));
}
// Names the driver function (not the C++ expression) so messages read "cuLaunchKernel failed: ...".
#define DRIVER_TRY(name, call) check_driver((call), name, __FILE__, __LINE__)

// The driver calls below need the device's primary context current on this thread; the runtime makes it so.
void make_primary_context_current() {
  int device = 0;
  SHARED_CUDA_TRY(cudaGetDevice(&device));
  SHARED_CUDA_TRY(cudaSetDevice(device));
}

}  // namespace
#endif

std::shared_ptr<module> module::load(const std::vector<char>& cubin) {
  require_cuda("loading a JIT module");
  std::shared_ptr<module> out(new module());
#if SHARED_CUDA_HAS_CUDA
  make_primary_context_current();
  CUmodule handle = nullptr;
  DRIVER_TRY("cuModuleLoadData", driver().module_load_data(&handle, cubin.data()));
  out->handle_ = handle;
#else
  (void)cubin;
#endif
  return out;
}

module::~module() {
#if SHARED_CUDA_HAS_CUDA
  if (handle_ != nullptr) driver().module_unload(static_cast<CUmodule>(handle_));
#endif
}

kernel module::get_kernel(const std::string& name) const {
#if SHARED_CUDA_HAS_CUDA
  CUfunction function = nullptr;
  const CUresult result = driver().module_get_function(&function, static_cast<CUmodule>(handle_), name.c_str());
  if (result == CUDA_ERROR_NOT_FOUND)
    throw invalid_argument("no kernel named '" + name + "' in the module; declare it extern \"C\" __global__");
  DRIVER_TRY("cuModuleGetFunction", result);
  return kernel(shared_from_this(), function, name);
#else
  (void)name;
  require_cuda("JIT kernels");
  return kernel(nullptr, nullptr, "");
#endif
}

void kernel::launch(dim3 grid, dim3 block, unsigned shared_memory_bytes, stream_view stream,
                    const std::vector<std::string>& argument_bytes) const {
#if SHARED_CUDA_HAS_CUDA
  std::vector<void*> params;
  params.reserve(argument_bytes.size());
  for (const auto& arg : argument_bytes) params.push_back(const_cast<char*>(arg.data()));
  launch_pointers(grid, block, shared_memory_bytes, stream, params.data());
#else
  (void)grid, (void)block, (void)shared_memory_bytes, (void)stream, (void)argument_bytes;
  require_cuda("JIT kernels");
#endif
}

void kernel::launch_pointers(dim3 grid, dim3 block, unsigned shared_memory_bytes, stream_view stream,
                             void** parameters) const {
#if SHARED_CUDA_HAS_CUDA
  make_primary_context_current();
  const CUresult result =
      driver().launch_kernel(static_cast<CUfunction>(function_), grid.x, grid.y, grid.z, block.x, block.y, block.z,
                             shared_memory_bytes, static_cast<CUstream>(stream.handle), parameters, nullptr);
  if (result != CUDA_SUCCESS) {
    // Name the kernel and its launch shape: most launch failures are a bad shape.
    const std::string what = "cuLaunchKernel(" + name_ + ", grid " + std::to_string(grid.x) + "x" +
                             std::to_string(grid.y) + "x" + std::to_string(grid.z) + ", block " +
                             std::to_string(block.x) + "x" + std::to_string(block.y) + "x" + std::to_string(block.z) +
                             ", " + std::to_string(shared_memory_bytes) + " B shared memory)";
    check_driver(result, what.c_str(), __FILE__, __LINE__);
  }
#else
  (void)grid, (void)block, (void)shared_memory_bytes, (void)stream, (void)parameters;
  require_cuda("JIT kernels");
#endif
}

std::size_t launch_list::add(const kernel& k, dim3 grid, dim3 block, unsigned shared_memory_bytes,
                             const std::vector<std::string>& argument_bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  const std::size_t first = parameters_.size();
  for (std::size_t i = 0; i < argument_bytes.size(); ++i) {
    const auto& arg = argument_bytes[i];
    if (arg.empty() || arg.size() > sizeof(std::uint64_t))
      throw invalid_argument("launch_list: parameter " + std::to_string(i) + " of " + k.name() + " has " +
                             std::to_string(arg.size()) + " bytes; parameters of 1 to 8 bytes are supported");
    std::uint64_t slot = 0;
    std::memcpy(&slot, arg.data(), arg.size());
    parameters_.push_back(slot);
  }
  entries_.push_back(entry{k, grid, block, shared_memory_bytes, first, argument_bytes.size()});
  return entries_.size() - 1;
}

void launch_list::patch(std::size_t launch, std::size_t parameter, std::size_t base, std::uint64_t offset) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (launch >= entries_.size() || parameter >= entries_[launch].parameter_count)
    throw invalid_argument("launch_list::patch: no parameter " + std::to_string(parameter) + " in launch " +
                           std::to_string(launch) + " of " + std::to_string(entries_.size()));
  patches_.push_back(patch_entry{entries_[launch].first_parameter + parameter, base, offset});
  max_base_ = std::max(max_base_, base + 1);
}

launch_list::launch_list(launch_list&& other) noexcept {
  std::lock_guard<std::mutex> lock(other.mutex_);
  entries_ = std::move(other.entries_);
  parameters_ = std::move(other.parameters_);
  patches_ = std::move(other.patches_);
  values_ = std::move(other.values_);
  max_base_ = other.max_base_;
  max_value_ = other.max_value_;
}

void launch_list::bind_value(std::size_t launch, value_target target, std::size_t parameter, std::size_t value) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (launch >= entries_.size())
    throw invalid_argument("launch_list::bind_value: no launch " + std::to_string(launch) + " of " +
                           std::to_string(entries_.size()));
  const entry& e = entries_[launch];
  std::size_t index = launch;
  if (target == value_target::parameter || target == value_target::patch_offset) {
    if (parameter >= e.parameter_count)
      throw invalid_argument("launch_list::bind_value: no parameter " + std::to_string(parameter) + " in launch " +
                             std::to_string(launch) + " (" + e.k.name() + ")");
    index = e.first_parameter + parameter;
  }
  if (target == value_target::patch_offset) {
    const auto found =
        std::find_if(patches_.begin(), patches_.end(), [&](const patch_entry& p) { return p.parameter == index; });
    if (found == patches_.end())
      throw invalid_argument("launch_list::bind_value: parameter " + std::to_string(parameter) + " of launch " +
                             std::to_string(launch) + " is not patched");
    index = static_cast<std::size_t>(found - patches_.begin());
  } else if (target != value_target::parameter && target != value_target::grid_x) {
    throw invalid_argument("launch_list::bind_value: unknown target " + std::to_string(static_cast<int>(target)));
  }
  values_.push_back(value_entry{target, index, value});
  max_value_ = std::max(max_value_, value + 1);
}

launch_list launch_list::instantiate(const std::vector<std::uint64_t>& values) const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (values.size() < max_value_)
    throw invalid_argument("launch_list::instantiate: " + std::to_string(values.size()) + " values given, " +
                           std::to_string(max_value_) + " needed");
  launch_list out;
  out.entries_ = entries_;
  out.parameters_ = parameters_;
  out.patches_ = patches_;
  out.max_base_ = max_base_;
  for (const auto& v : values_) {
    const std::uint64_t value = values[v.value];
    switch (v.target) {
      case value_target::parameter:
        out.parameters_[v.index] = value;
        break;
      case value_target::patch_offset:
        out.patches_[v.index].offset = value;
        break;
      case value_target::grid_x:
        if (value == 0 || value > 0x7fffffffULL)
          throw invalid_argument("launch_list::instantiate: grid x " + std::to_string(value) + " for launch " +
                                 std::to_string(v.index) + " (" + entries_[v.index].k.name() +
                                 ") outside [1, 2^31 - 1]");
        out.entries_[v.index].grid.x = static_cast<unsigned>(value);
        break;
    }
  }
  return out;
}

void launch_list::launch(stream_view stream, const std::vector<std::uint64_t>& bases, std::size_t first,
                         std::size_t last) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (bases.size() < max_base_)
    throw invalid_argument("launch_list::launch: " + std::to_string(bases.size()) + " base addresses given, " +
                           std::to_string(max_base_) + " needed");
  if (first > last || last > entries_.size())
    throw invalid_argument("launch_list::launch: launches [" + std::to_string(first) + ", " + std::to_string(last) +
                           ") outside [0, " + std::to_string(entries_.size()) + ")");
  // Every patched pointer is written, also those of launches outside [first, last): a patch is a few bytes, and the
  // caller launches a list in consecutive ranges with the same bases.
  for (const auto& p : patches_) parameters_[p.parameter] = bases[p.base] + p.offset;
#if SHARED_CUDA_HAS_CUDA
  std::vector<void*> pointers(parameters_.size());
  for (std::size_t i = 0; i < parameters_.size(); ++i) pointers[i] = &parameters_[i];
  for (std::size_t i = first; i < last; ++i) {
    const entry& e = entries_[i];
    e.k.launch_pointers(e.grid, e.block, e.shared_memory_bytes, stream, pointers.data() + e.first_parameter);
  }
#else
  (void)stream;
  if (first < last) require_cuda("JIT kernels");
#endif
}

void kernel::set_max_dynamic_shared_memory(int bytes) const {
#if SHARED_CUDA_HAS_CUDA
  DRIVER_TRY("cuFuncSetAttribute", driver().func_set_attribute(static_cast<CUfunction>(function_),
                                                               CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes));
#else
  (void)bytes;
#endif
}

int kernel::max_threads_per_block() const {
  int value = 0;
#if SHARED_CUDA_HAS_CUDA
  DRIVER_TRY("cuFuncGetAttribute", driver().func_get_attribute(&value, CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK,
                                                               static_cast<CUfunction>(function_)));
#endif
  return value;
}

int kernel::registers_per_thread() const {
  int value = 0;
#if SHARED_CUDA_HAS_CUDA
  DRIVER_TRY("cuFuncGetAttribute",
             driver().func_get_attribute(&value, CU_FUNC_ATTRIBUTE_NUM_REGS, static_cast<CUfunction>(function_)));
#endif
  return value;
}

int current_architecture() {
  require_cuda("current_architecture");
  const auto props = get_device_properties(current_device());
  SHARED_CUDA_EXPECT_AS(props.has_value(), unavailable_error, "cannot read the current device's properties");
  return props->major * 10 + props->minor;
}

// ================================================================================================ loader

loader::loader(std::string cache_directory) : cache_(std::move(cache_directory)) {}

std::vector<char> loader::get_cubin(const std::string& source, const std::string& name,
                                    const compile_options& options) {
  const std::string key = cache_key(source, options);
  std::vector<char> cubin;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    bool corrupt = false;
    if (cache_.load(key, cubin, &corrupt)) {
      ++stats_.disk_hits;
      return cubin;
    }
    if (corrupt) ++stats_.corrupt_entries;  // compiled again below; the store replaces the damaged file
  }
  cubin = compile(source, name, options).cubin;  // outside the lock: compiles can take seconds
  std::lock_guard<std::mutex> lock(mutex_);
  ++stats_.compilations;
  if (!cache_.store(key, cubin)) ++stats_.disk_errors;
  return cubin;
}

std::shared_ptr<module> loader::get(const std::string& source, const std::string& name, compile_options options) {
  if (options.architecture == 0) options.architecture = current_architecture();
  const std::string memory_key = cache_key(source, options) + "@" + std::to_string(current_device());
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (auto it = modules_.find(memory_key); it != modules_.end()) {
      ++stats_.memory_hits;
      return it->second;
    }
  }
  std::shared_ptr<module> loaded = module::load(get_cubin(source, name, options));
  std::lock_guard<std::mutex> lock(mutex_);
  return modules_.emplace(memory_key, loaded).first->second;  // another thread may have won: keep its module
}

cache_stats loader::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

}  // namespace shared_cuda::jit
