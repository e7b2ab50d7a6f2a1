#include "shared_cuda/device.hpp"

#include "shared_cuda/error.hpp"

#if SHARED_CUDA_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

namespace shared_cuda {

bool compiled_with_cuda() noexcept { return SHARED_CUDA_HAS_CUDA != 0; }

std::string compiled_architectures() {
#if SHARED_CUDA_HAS_CUDA
  return SHARED_CUDA_ARCHITECTURES;
#else
  return "";
#endif
}

int compiled_runtime_version() noexcept {
#if SHARED_CUDA_HAS_CUDA
  return CUDART_VERSION;
#else
  return 0;
#endif
}

int driver_version() noexcept {
#if SHARED_CUDA_HAS_CUDA
  int version = 0;
  if (cudaDriverGetVersion(&version) != cudaSuccess) return 0;
  return version;
#else
  return 0;
#endif
}

int device_count() noexcept {
#if SHARED_CUDA_HAS_CUDA
  int count = 0;
  // With no driver or no GPU this fails (cudaErrorInsufficientDriver / cudaErrorNoDevice): that means 0 devices.
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return 0;
  }
  return count;
#else
  return 0;
#endif
}

bool cuda_available() noexcept { return device_count() > 0; }

std::optional<device_properties> get_device_properties(int device) noexcept {
#if SHARED_CUDA_HAS_CUDA
  if (device < 0 || device >= device_count()) return std::nullopt;
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    cudaGetLastError();
    return std::nullopt;
  }
  device_properties out;
  out.index = device;
  out.name = prop.name;
  out.major = prop.major;
  out.minor = prop.minor;
  out.multiprocessors = prop.multiProcessorCount;
  out.total_memory = prop.totalGlobalMem;
  out.l2_cache_bytes = prop.l2CacheSize;
  out.max_shared_memory_per_block_optin = static_cast<int>(prop.sharedMemPerBlockOptin);
  out.can_map_host_memory = prop.canMapHostMemory != 0;
  out.host_pointer_is_device_pointer = prop.canUseHostPointerForRegisteredMem != 0;
  char bus[32] = {0};
  if (cudaDeviceGetPCIBusId(bus, sizeof(bus), device) == cudaSuccess) out.pci_bus_id = bus;
  return out;
#else
  (void)device;
  return std::nullopt;
#endif
}

int current_device() noexcept {
#if SHARED_CUDA_HAS_CUDA
  if (!cuda_available()) return -1;
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return device;
#else
  return -1;
#endif
}

std::string cuda_error_string(int code) {
#if SHARED_CUDA_HAS_CUDA
  const auto err = static_cast<cudaError_t>(code);
  return std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
#else
  return "CUDA error " + std::to_string(code) + " (this build has no CUDA support)";
#endif
}

void require_cuda(const char* what) {
  if (!compiled_with_cuda())
    throw unavailable_error(std::string(what) +
                            " needs CUDA, but this package was built without it; reinstall it on a machine with the "
                            "CUDA toolkit (nvcc on PATH or CUDACXX set)");
  if (!cuda_available())
    throw unavailable_error(std::string(what) + " needs a CUDA GPU, and none is usable here (no driver or no device)");
}

}  // namespace shared_cuda
