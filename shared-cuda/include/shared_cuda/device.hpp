// Build and run-time facts about CUDA. Nothing here throws and nothing needs a driver or a GPU: on a CPU-only
// machine (or a build without CUDA) the answers are "no CUDA", 0 devices, and empty properties.
#pragma once

#include <cstddef>
#include <optional>
#include <string>

namespace shared_cuda {

struct device_properties {
  int index = -1;
  std::string name;
  int major = 0;  // compute capability
  int minor = 0;
  int multiprocessors = 0;
  std::size_t total_memory = 0;  // bytes
  int l2_cache_bytes = 0;
  int max_shared_memory_per_block_optin = 0;  // bytes a block may use after raising its limit
  bool can_map_host_memory = false;
  bool host_pointer_is_device_pointer = false;  // cudaDevAttrCanUseHostPointerForRegisteredMem
  std::string pci_bus_id;
};

// True when the library was built with the CUDA parts (SHARED_CUDA_CUDA resolved to ON).
bool compiled_with_cuda() noexcept;
// The architectures CUDA code was compiled for, "80,90", or "" without CUDA.
std::string compiled_architectures();
// CUDA runtime version the library was built against (e.g. 13000), 0 without CUDA.
int compiled_runtime_version() noexcept;
// Version the installed driver supports (e.g. 13000), 0 when there is no driver.
int driver_version() noexcept;

// Number of usable CUDA devices; 0 when there is no driver, no GPU or no CUDA in the build.
int device_count() noexcept;
// device_count() > 0.
bool cuda_available() noexcept;
// Properties of one device, or nothing when it does not exist.
std::optional<device_properties> get_device_properties(int device) noexcept;
// The device current on the calling thread; -1 when there is none.
int current_device() noexcept;

// Readable name and description of a CUDA runtime error code.
std::string cuda_error_string(int code);

// Throws unavailable_error naming `what` unless a CUDA device is usable.
void require_cuda(const char* what);

}  // namespace shared_cuda
