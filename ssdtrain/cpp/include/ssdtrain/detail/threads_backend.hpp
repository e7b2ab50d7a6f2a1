// A backend made of worker threads that run each request to completion; subclasses say how one request moves.
#pragma once

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "ssdtrain/detail/io_backend.hpp"

namespace ssdtrain::detail {

// pread/pwrite until all bytes moved; returns the bytes or -errno.
long blocking_transfer(const io_request& r);

class worker_backend : public io_backend {
 public:
  explicit worker_backend(unsigned threads);
  ~worker_backend() override;
  void submit(io_request request) override;

 protected:
  virtual long transfer(const io_request& r) = 0;
  // Subclass destructors call this first, so no worker runs transfer() on a half-destroyed object.
  void stop();

 private:
  void run();
  std::vector<std::thread> workers_;
  std::deque<io_request> queue_;
  std::mutex mutex_;
  std::condition_variable ready_;
  bool stopping_ = false;
};

}  // namespace ssdtrain::detail
