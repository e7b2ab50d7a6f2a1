#include "shared_cuda/stream.hpp"

#include <utility>

#include "shared_cuda/device.hpp"
#include "shared_cuda/error.hpp"

#if SHARED_CUDA_HAS_CUDA
#include <cuda_runtime_api.h>
#define STREAM(h) static_cast<cudaStream_t>(h)
#define EVENT(h) static_cast<cudaEvent_t>(h)
#endif

namespace shared_cuda {

void stream_view::synchronize() const {
  require_cuda("stream synchronize");
#if SHARED_CUDA_HAS_CUDA
  SHARED_CUDA_TRY(cudaStreamSynchronize(STREAM(handle)));
#endif
}

stream::stream() {
  require_cuda("stream");
#if SHARED_CUDA_HAS_CUDA
  cudaStream_t created = nullptr;
  SHARED_CUDA_TRY(cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking));
  handle_ = created;
#endif
}

stream::~stream() { reset(); }

stream::stream(stream&& other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}

stream& stream::operator=(stream&& other) noexcept {
  if (this != &other) {
    reset();
    handle_ = std::exchange(other.handle_, nullptr);
  }
  return *this;
}

void stream::reset() noexcept {
#if SHARED_CUDA_HAS_CUDA
  if (handle_ != nullptr) cudaStreamDestroy(STREAM(handle_));
#endif
  handle_ = nullptr;
}

event::event(bool enable_timing) {
  require_cuda("event");
#if SHARED_CUDA_HAS_CUDA
  cudaEvent_t created = nullptr;
  SHARED_CUDA_TRY(cudaEventCreateWithFlags(&created, enable_timing ? cudaEventDefault : cudaEventDisableTiming));
  handle_ = created;
#else
  (void)enable_timing;
#endif
}

event::~event() { reset(); }

event::event(event&& other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}

event& event::operator=(event&& other) noexcept {
  if (this != &other) {
    reset();
    handle_ = std::exchange(other.handle_, nullptr);
  }
  return *this;
}

void event::reset() noexcept {
#if SHARED_CUDA_HAS_CUDA
  if (handle_ != nullptr) cudaEventDestroy(EVENT(handle_));
#endif
  handle_ = nullptr;
}

#if SHARED_CUDA_HAS_CUDA
void event::record(stream_view on) { SHARED_CUDA_TRY(cudaEventRecord(EVENT(handle_), STREAM(on.handle))); }
void event::make_wait(stream_view waiter) const {
  SHARED_CUDA_TRY(cudaStreamWaitEvent(STREAM(waiter.handle), EVENT(handle_), 0));
}
void event::synchronize() const { SHARED_CUDA_TRY(cudaEventSynchronize(EVENT(handle_))); }
bool event::query() const {
  const cudaError_t status = cudaEventQuery(EVENT(handle_));
  if (status == cudaErrorNotReady) return false;
  SHARED_CUDA_TRY(status);
  return true;
}
float event::elapsed_since(const event& start) const {
  float ms = 0.0F;
  SHARED_CUDA_TRY(cudaEventElapsedTime(&ms, EVENT(start.handle_), EVENT(handle_)));
  return ms;
}
#else
// Unreachable without CUDA (the constructor throws), kept so the class links in CPU-only builds.
void event::record(stream_view) { require_cuda("event"); }
void event::make_wait(stream_view) const { require_cuda("event"); }
void event::synchronize() const { require_cuda("event"); }
bool event::query() const {
  require_cuda("event");
  return true;
}
float event::elapsed_since(const event&) const {
  require_cuda("event");
  return 0.0F;
}
#endif

}  // namespace shared_cuda
