// Run-time compilation of CUDA C++ with NVRTC, an on-disk cache of the binaries, and loading and launching them
// through the CUDA driver API.
//
// libnvrtc is opened with dlopen from a list of candidate paths (the Python layer adds the nvidia-cuda-nvrtc
// wheel's folder; C++ knows only the toolkit's usual places), so nothing links against it and a machine without it
// still imports every package. Code is compiled to a cubin (machine code, SASS) for the exact architecture of the
// device, never to PTX: a newer NVRTC's PTX cannot be JIT-compiled by an older driver.
//
// Driver functions come from the CUDA runtime's cudaGetDriverEntryPointByVersion, so libcuda is not linked either.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "shared_cuda/stream.hpp"

namespace shared_cuda::jit {

// ------------------------------------------------------------------------------------------------ NVRTC library

// Tries each path in order (a full file path, or a bare name dlopen resolves); the first that loads wins.
// Safe to call again: once loaded, later calls change nothing. Without a call, the first use tries
// default_nvrtc_candidates().
void load_nvrtc(const std::vector<std::string>& candidates);
// The toolkit's usual places: $CUDA_HOME, $CUDA_PATH, /usr/local/cuda, then the bare names libnvrtc.so.13,
// libnvrtc.so.12 and libnvrtc.so that dlopen resolves through the loader's search path.
std::vector<std::string> default_nvrtc_candidates();
bool nvrtc_available() noexcept;
// Path of the loaded library, "" when none.
std::string nvrtc_path();
// NVRTC version as major * 1000 + minor * 10 (13000 for 13.0), 0 when not loaded.
int nvrtc_version() noexcept;
// The architectures this NVRTC can target, e.g. {75, 80, 86, 89, 90, 100, 120}.
std::vector<int> nvrtc_supported_architectures();

// ------------------------------------------------------------------------------------------------ compile

struct compile_options {
  int architecture = 0;            // compute capability as major*10+minor, e.g. 90 for sm_90; required
  std::vector<std::string> flags;  // extra NVRTC options, e.g. "-DBLOCK=128", "--use_fast_math"
};

struct compiled_program {
  std::vector<char> cubin;
  std::string log;  // NVRTC's warnings, "" when none
};

// Compiles `source` (file name `name` appears in diagnostics) to a cubin. No GPU is needed. Throws compile_error
// with the NVRTC log and the failing source lines, or unavailable_error when NVRTC is not loaded.
compiled_program compile(const std::string& source, const std::string& name, const compile_options& options);

// ------------------------------------------------------------------------------------------------ disk cache

// The cache key: a SHA-256 over the source, the options, the architecture and the NVRTC version.
std::string cache_key(const std::string& source, const compile_options& options);

// Binaries stored as <directory>/<key>.cubin, written to a temporary file and renamed, so concurrent processes
// never see half a file. Each file starts with a SHA-256 of its binary: a damaged entry (truncated, overwritten) is
// detected on load and reported as `corrupt` instead of being handed to the driver. An unreadable or unwritable
// directory only disables caching (counted in stats).
class disk_cache {
 public:
  explicit disk_cache(std::string directory);
  const std::string& directory() const noexcept { return directory_; }
  // True with the binary on a hit; false on a miss, with *corrupt (if given) set when the entry exists but fails
  // its checksum.
  bool load(const std::string& key, std::vector<char>& cubin, bool* corrupt = nullptr) const;
  bool store(const std::string& key, const std::vector<char>& cubin) const;

 private:
  std::string directory_;
};

// ------------------------------------------------------------------------------------------------ load & launch

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};

class module;

// A kernel inside a loaded module. Keeps its module alive.
class kernel {
 public:
  const std::string& name() const noexcept { return name_; }
  // Launches with arguments given as raw bytes, one entry per kernel parameter in order (the Python layer packs
  // them); the stream may be any stream_view, including PyTorch's current stream.
  void launch(dim3 grid, dim3 block, unsigned shared_memory_bytes, stream_view stream,
              const std::vector<std::string>& argument_bytes) const;
  // The same with the parameters given as cuLaunchKernel takes them: one pointer to each parameter's bytes.
  void launch_pointers(dim3 grid, dim3 block, unsigned shared_memory_bytes, stream_view stream,
                       void** parameters) const;
  void set_max_dynamic_shared_memory(int bytes) const;
  int max_threads_per_block() const;
  int registers_per_thread() const;

 private:
  friend class module;
  kernel(std::shared_ptr<const module> owner, void* function, std::string name)
      : owner_(std::move(owner)), function_(function), name_(std::move(name)) {}
  std::shared_ptr<const module> owner_;
  void* function_ = nullptr;  // CUfunction
  std::string name_;
};

// A fixed sequence of kernel launches whose parameters are packed once, for a caller that launches the same kernels
// with the same shapes many times and only some pointers changing (a training step on one graph): each launch()
// writes the changing pointer parameters (a base address given to that call plus a fixed offset) and issues every
// launch in order, one call instead of one per kernel with its parameters packed again. Parameters are at most 8
// bytes (pointers and scalars). launch() may be called from several threads (one at a time).
//
// A list can also be a template for many instances of the same launches (one per graph a layer runs on): some of its
// numbers bound to value indices (bind_value), and instantiate(values) makes a copy with those numbers written from
// one vector, one call per instance instead of packing every launch again.
class launch_list {
 public:
  // What a bound value replaces in an instance (see bind_value).
  enum class value_target : int {
    parameter = 0,     // a parameter (a pointer or an integer, written as its 8-byte slot)
    patch_offset = 1,  // the offset of the parameter's patch (see patch): bases[base] + values[value]
    grid_x = 2,        // the launch's grid x (the parameter index is not read)
  };

  launch_list() = default;
  // A new list with `other`'s launches, patches and bound values (and a mutex of its own).
  launch_list(launch_list&& other) noexcept;
  launch_list(const launch_list&) = delete;
  launch_list& operator=(const launch_list&) = delete;
  launch_list& operator=(launch_list&&) = delete;

  // Appends a launch; `argument_bytes` as for kernel::launch (one entry of 1 to 8 bytes per parameter). Returns its
  // index.
  std::size_t add(const kernel& k, dim3 grid, dim3 block, unsigned shared_memory_bytes,
                  const std::vector<std::string>& argument_bytes);
  // Parameter `parameter` of launch `launch` (a pointer) becomes bases[base] + offset at every launch().
  void patch(std::size_t launch, std::size_t parameter, std::size_t base, std::uint64_t offset);
  // In every instance (see instantiate), `target` of launch `launch` becomes values[value]: its parameter `parameter`,
  // the offset of its patch of parameter `parameter` (patched before), or its grid's x.
  void bind_value(std::size_t launch, value_target target, std::size_t parameter, std::size_t value);
  // A copy of this list with every bound number written from `values` (as many as the largest bound value index
  // + 1, or more); the copy binds no values of its own. A grid x bound to 0 is an error (a launch with no blocks).
  launch_list instantiate(const std::vector<std::uint64_t>& values) const;
  // Writes the patched parameters from `bases` and launches launches [first, last) in order on `stream`.
  void launch(stream_view stream, const std::vector<std::uint64_t>& bases, std::size_t first, std::size_t last);
  std::size_t size() const noexcept { return entries_.size(); }

 private:
  struct entry {
    kernel k;
    dim3 grid, block;
    unsigned shared_memory_bytes;
    std::size_t first_parameter, parameter_count;
  };
  struct patch_entry {
    std::size_t parameter, base;
    std::uint64_t offset;
  };
  struct value_entry {
    value_target target;
    std::size_t index;  // the parameter's slot, the patch's or the launch's index
    std::size_t value;
  };
  std::vector<entry> entries_;
  std::vector<std::uint64_t> parameters_;  // one 8-byte slot per parameter of every launch, in order
  std::vector<patch_entry> patches_;
  std::vector<value_entry> values_;
  std::size_t max_base_ = 0;   // the bases a launch() needs: one more than the largest patched base index
  std::size_t max_value_ = 0;  // the values an instantiate() needs: one more than the largest bound value index
  mutable std::mutex mutex_;
};

// A cubin loaded into the current device's primary context.
class module : public std::enable_shared_from_this<module> {
 public:
  static std::shared_ptr<module> load(const std::vector<char>& cubin);
  ~module();
  module(const module&) = delete;
  module& operator=(const module&) = delete;
  // The kernel named `name` (declare kernels extern "C" so names are not mangled).
  kernel get_kernel(const std::string& name) const;

 private:
  module() = default;
  void* handle_ = nullptr;  // CUmodule
};

struct cache_stats {
  std::size_t memory_hits = 0;
  std::size_t disk_hits = 0;
  std::size_t compilations = 0;
  std::size_t disk_errors = 0;
  std::size_t corrupt_entries = 0;  // damaged cache files found (and rebuilt)
};

// Compile-or-fetch, then load: the one entry point most callers need. Looks in memory, then on disk, then compiles
// with NVRTC and stores the result. Thread-safe.
class loader {
 public:
  explicit loader(std::string cache_directory);
  // Builds for the current device's architecture unless options.architecture is set.
  std::shared_ptr<module> get(const std::string& source, const std::string& name, compile_options options);
  // Compile only (or fetch from the caches): usable with no GPU; the architecture must be given.
  std::vector<char> get_cubin(const std::string& source, const std::string& name, const compile_options& options);
  cache_stats stats() const;
  const std::string& cache_directory() const noexcept { return cache_.directory(); }

 private:
  disk_cache cache_;
  mutable std::mutex mutex_;
  std::map<std::string, std::shared_ptr<module>> modules_;  // key -> loaded module (current process)
  cache_stats stats_;
};

// Architecture of the current device as major*10+minor; throws unavailable_error with no GPU.
int current_architecture();

}  // namespace shared_cuda::jit
