// Move-only owners of CUDA streams and events, and a non-owning stream view.
//
// Handles are opaque void* here (cudaStream_t and cudaEvent_t are pointers), so CPU-only code includes this header
// without the CUDA toolkit. A stream_view wraps a handle owned elsewhere, e.g. PyTorch's current stream passed in as
// torch.cuda.current_stream().cuda_stream; nullptr is the legacy default stream.
#pragma once

#include <cstdint>

namespace shared_cuda {

struct stream_view {
  void* handle = nullptr;
  static stream_view from_address(std::uintptr_t address) { return {reinterpret_cast<void*>(address)}; }
  void synchronize() const;
};

// A non-blocking stream on the current device.
class stream {
 public:
  stream();
  ~stream();
  stream(stream&& other) noexcept;
  stream& operator=(stream&& other) noexcept;
  stream(const stream&) = delete;
  stream& operator=(const stream&) = delete;

  void* handle() const noexcept { return handle_; }
  stream_view view() const noexcept { return {handle_}; }
  void synchronize() const { view().synchronize(); }

 private:
  void reset() noexcept;
  void* handle_ = nullptr;
};

// An event; timing is off unless asked for, because timed events cost more to record.
class event {
 public:
  explicit event(bool enable_timing = false);
  ~event();
  event(event&& other) noexcept;
  event& operator=(event&& other) noexcept;
  event(const event&) = delete;
  event& operator=(const event&) = delete;

  void* handle() const noexcept { return handle_; }
  void record(stream_view on);
  // Makes `waiter` wait for this event's last record (device-side; the host does not block).
  void make_wait(stream_view waiter) const;
  void synchronize() const;
  // True when the work before the last record has finished.
  bool query() const;
  // Milliseconds between `start` and this event; both need enable_timing.
  float elapsed_since(const event& start) const;

 private:
  void reset() noexcept;
  void* handle_ = nullptr;
};

}  // namespace shared_cuda
