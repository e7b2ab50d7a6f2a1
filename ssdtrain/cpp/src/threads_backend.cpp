// Portable backend: worker threads doing blocking pread/pwrite. Also the host-memory half of the gds backend.
#include "ssdtrain/detail/threads_backend.hpp"

#include <unistd.h>

#include <algorithm>
#include <cerrno>

namespace ssdtrain::detail {

long blocking_transfer(const io_request& r) {
  std::size_t done = 0;
  while (done < r.bytes) {
    char* p = static_cast<char*>(r.buffer) + done;
    const off_t at = static_cast<off_t>(r.offset + done);
    const ssize_t n = r.write ? ::pwrite(r.fd, p, r.bytes - done, at) : ::pread(r.fd, p, r.bytes - done, at);
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return -errno;
    }
    if (n == 0) return -EIO;  // files are preallocated: an early end means something is wrong
    done += static_cast<std::size_t>(n);
  }
  return static_cast<long>(done);
}

worker_backend::worker_backend(unsigned threads) {
  threads = std::max(1u, threads);
  for (unsigned i = 0; i < threads; ++i) workers_.emplace_back([this] { run(); });
}

worker_backend::~worker_backend() { stop(); }

void worker_backend::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) return;
    stopping_ = true;
  }
  ready_.notify_all();
  for (auto& w : workers_) w.join();
}

void worker_backend::submit(io_request request) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(std::move(request));
  }
  ready_.notify_one();
}

void worker_backend::run() {
  for (;;) {
    io_request r;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      ready_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      r = std::move(queue_.front());
      queue_.pop_front();
    }
    depth_changed(1);
    const long result = transfer(r);
    depth_changed(-1);
    r.done(result);
  }
}

namespace {
class threads_backend final : public worker_backend {
 public:
  explicit threads_backend(unsigned threads) : worker_backend(threads), threads_(threads) {}
  ~threads_backend() override { stop(); }
  std::string name() const override { return "threads"; }
  std::string detail() const override { return std::to_string(threads_) + " pread/pwrite threads"; }

 protected:
  long transfer(const io_request& r) override { return blocking_transfer(r); }

 private:
  unsigned threads_;
};
}  // namespace

std::unique_ptr<io_backend> make_threads_backend(unsigned threads) {
  return std::make_unique<threads_backend>(threads);
}

}  // namespace ssdtrain::detail
