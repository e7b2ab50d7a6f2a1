// io_uring backend: one thread owns the ring, fills it from a queue up to the queue depth, and completes requests.
//
// Submitters push to a mutex-protected queue and poke an eventfd that the ring itself polls, so a thread blocked
// waiting for completions also wakes up for new work (the ring is only ever touched by its own thread).
#include "ssdtrain/detail/io_backend.hpp"

#include "shared_cuda/error.hpp"

#if SSDTRAIN_HAS_URING
#include <liburing.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

namespace ssdtrain::detail {
namespace {

constexpr std::uint64_t wake_tag = ~0ull;

class io_uring_backend final : public io_backend {
 public:
  io_uring_backend(const std::vector<int>& fds, unsigned queue_depth,
                   const std::vector<std::pair<void*, std::size_t>>& fixed_buffers)
      : depth_(std::max(1u, queue_depth)) {
    // One extra entry for the eventfd poll. COOP_TASKRUN (Linux 5.19): completions are run when the ring thread
    // enters the kernel anyway, instead of interrupting it; older kernels refuse the flag, so retry without.
    int ret = io_uring_queue_init(depth_ + 1, &ring_, IORING_SETUP_COOP_TASKRUN);
    if (ret == -EINVAL) ret = io_uring_queue_init(depth_ + 1, &ring_, 0);
    if (ret < 0)
      throw shared_cuda::unavailable_error(std::string("ssdtrain: the kernel refused an io_uring: ") +
                                           std::strerror(-ret) + "; use backend='threads'");
    wake_fd_ = ::eventfd(0, EFD_CLOEXEC);
    if (wake_fd_ < 0) {
      const int err = errno;
      io_uring_queue_exit(&ring_);
      throw shared_cuda::io_error(err, "ssdtrain: eventfd failed");
    }
    // Fixed files skip the per-request file table lookup and reference counting.
    fixed_files_ = io_uring_register_files(&ring_, fds.data(), static_cast<unsigned>(fds.size())) == 0;
    if (!fixed_buffers.empty()) {
      std::vector<iovec> iov;
      for (auto [p, n] : fixed_buffers) iov.push_back({p, n});
      // Registration pins pages and counts against RLIMIT_MEMLOCK without CAP_IPC_LOCK: fall back when refused.
      ret = io_uring_register_buffers(&ring_, iov.data(), static_cast<unsigned>(iov.size()));
      fixed_buffers_ = ret == 0;
      if (ret < 0) buffer_error_ = std::strerror(-ret);
    }
    arm_wake();
    io_uring_submit(&ring_);
    thread_ = std::thread([this] { run(); });
  }

  ~io_uring_backend() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    poke();
    thread_.join();
    io_uring_queue_exit(&ring_);
    ::close(wake_fd_);
  }

  void submit(io_request request) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(new io_request(std::move(request)));
    }
    poke();
  }

  std::string name() const override { return "io_uring"; }
  std::string detail() const override {
    std::string d = "queue depth " + std::to_string(depth_) + ", fixed files " + (fixed_files_ ? "yes" : "no") +
                    ", registered buffers ";
    d += fixed_buffers_ ? "yes" : ("no" + (buffer_error_.empty() ? std::string() : " (" + buffer_error_ + ")"));
    return d;
  }

 private:
  void poke() {
    const std::uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(wake_fd_, &one, sizeof(one));
  }

  void arm_wake() {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    io_uring_prep_poll_add(sqe, wake_fd_, POLLIN);
    io_uring_sqe_set_data64(sqe, wake_tag);
  }

  void prep(io_request* r) {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    const int fd = fixed_files_ ? r->file : r->fd;
    if (r->fixed_buffer >= 0 && fixed_buffers_) {
      if (r->write)
        io_uring_prep_write_fixed(sqe, fd, r->buffer, static_cast<unsigned>(r->bytes), r->offset, r->fixed_buffer);
      else
        io_uring_prep_read_fixed(sqe, fd, r->buffer, static_cast<unsigned>(r->bytes), r->offset, r->fixed_buffer);
    } else if (r->write) {
      io_uring_prep_write(sqe, fd, r->buffer, static_cast<unsigned>(r->bytes), r->offset);
    } else {
      io_uring_prep_read(sqe, fd, r->buffer, static_cast<unsigned>(r->bytes), r->offset);
    }
    if (fixed_files_) sqe->flags |= IOSQE_FIXED_FILE;
    io_uring_sqe_set_data(sqe, r);
  }

  void complete(io_request* r, int res) {
    if (res > 0 && static_cast<std::size_t>(res) < r->bytes) {
      // Short transfer: continue where it stopped (rare with O_DIRECT; possible with buffered I/O or signals).
      r->buffer = static_cast<char*>(r->buffer) + res;
      r->offset += res;
      r->bytes -= res;
      r->moved += res;
      retry_.push_back(r);
      return;
    }
    long result = res;
    if (res == 0 && !r->write) result = -EIO;  // a preallocated file never ends early: treat as an I/O error
    if (res == -EAGAIN || res == -EINTR) {
      retry_.push_back(r);
      return;
    }
    if (result >= 0) result += static_cast<long>(r->moved);
    auto done = std::move(r->done);
    delete r;
    done(result);
  }

  void run() {
    unsigned inflight = 0;
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (stopping_ && queue_.empty() && retry_.empty() && inflight == 0) return;
        const unsigned before = inflight;
        while (inflight < depth_ && !retry_.empty()) {
          prep(retry_.front());
          retry_.pop_front();
          ++inflight;
        }
        while (inflight < depth_ && !queue_.empty()) {
          prep(queue_.front());
          queue_.pop_front();
          ++inflight;
        }
        if (inflight != before) depth_changed(static_cast<long>(inflight - before));
      }
      // Block for at least one completion (an I/O or the eventfd poke).
      int ret = io_uring_submit_and_wait(&ring_, 1);
      if (ret < 0 && ret != -EINTR && ret != -EBUSY) {
        // Cannot happen with a healthy ring; fail everything queued rather than hang.
        std::lock_guard<std::mutex> lock(mutex_);
        for (auto* r : queue_) {
          auto done = std::move(r->done);
          delete r;
          done(ret);
        }
        queue_.clear();
      }
      io_uring_cqe* cqe = nullptr;
      unsigned head = 0, seen = 0;
      io_uring_for_each_cqe(&ring_, head, cqe) {
        ++seen;
        const std::uint64_t tag = io_uring_cqe_get_data64(cqe);
        const int res = cqe->res;
        if (tag == wake_tag) {
          std::uint64_t value = 0;
          [[maybe_unused]] ssize_t n = ::read(wake_fd_, &value, sizeof(value));
          arm_wake();
          continue;
        }
        --inflight;
        depth_changed(-1);
        complete(reinterpret_cast<io_request*>(tag), res);
      }
      io_uring_cq_advance(&ring_, seen);
    }
  }

  io_uring ring_{};
  unsigned depth_;
  int wake_fd_ = -1;
  bool fixed_files_ = false;
  bool fixed_buffers_ = false;
  std::string buffer_error_;
  std::mutex mutex_;
  std::deque<io_request*> queue_;
  std::deque<io_request*> retry_;  // ring thread only
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace

std::unique_ptr<io_backend> make_io_uring_backend(const std::vector<int>& fds, unsigned queue_depth,
                                                  const std::vector<std::pair<void*, std::size_t>>& fixed_buffers) {
  return std::make_unique<io_uring_backend>(fds, queue_depth, fixed_buffers);
}

}  // namespace ssdtrain::detail

#else

namespace ssdtrain::detail {
std::unique_ptr<io_backend> make_io_uring_backend(const std::vector<int>&, unsigned,
                                                  const std::vector<std::pair<void*, std::size_t>>&) {
  throw shared_cuda::unavailable_error(
      "ssdtrain: built without io_uring (liburing-dev was not found at build time); install liburing-dev and "
      "reinstall, or use backend='threads'");
}
}  // namespace ssdtrain::detail

#endif
