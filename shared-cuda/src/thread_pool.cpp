#include "shared_cuda/thread_pool.hpp"

#include <algorithm>
#include <atomic>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>

#include "shared_cuda/error.hpp"

namespace shared_cuda {

thread_pool::thread_pool(std::size_t threads) {
  if (threads == 0) threads = std::max(1U, std::thread::hardware_concurrency());
  workers_.reserve(threads);
  for (std::size_t i = 0; i < threads; ++i) workers_.emplace_back([this] { work(); });
}

thread_pool::~thread_pool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    stop_polling_.store(true, std::memory_order_relaxed);
  }
  ready_.notify_all();
  for (auto& worker : workers_) worker.join();
}

void thread_pool::enqueue(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    SHARED_CUDA_EXPECT(!stopping_, "thread_pool: submit after shutdown began");
    queue_.push_back(std::move(job));
    queued_.fetch_add(1, std::memory_order_release);
  }
  ready_.notify_one();
}

void thread_pool::poll_for_work(std::chrono::steady_clock::time_point until) const {
  while (queued_.load(std::memory_order_acquire) == 0 && !stop_polling_.load(std::memory_order_relaxed)) {
    if (std::chrono::steady_clock::now() >= until) return;
    // Yield rather than pause: with more threads than cores (a caller and its workers, other processes) a busy
    // poll would hold a core a working thread needs for a whole scheduler slice.
    std::this_thread::yield();
  }
}

void thread_pool::work() {
  for (;;) {
    std::function<void()> job;
    {
      const auto until = std::chrono::steady_clock::now() + spin();
      std::unique_lock<std::mutex> lock(mutex_, std::defer_lock);
      for (;;) {
        poll_for_work(until);
        lock.lock();
        if (!queue_.empty() || stopping_ || std::chrono::steady_clock::now() >= until) break;
        lock.unlock();  // another worker took the job first: poll on while the window lasts
      }
      ready_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and everything queued has run
      job = std::move(queue_.front());
      queue_.pop_front();
      queued_.fetch_sub(1, std::memory_order_relaxed);
    }
    job();  // packaged_task stores any exception in its future
  }
}

namespace {

// One parallel_for call, shared with the workers that help: owned jointly, because a worker may dequeue its task
// after the call has returned (every chunk done by then); it then claims nothing and never touches `body`.
struct parallel_call {
  const std::function<void(std::size_t, std::size_t)>* body = nullptr;
  std::size_t begin = 0, end = 0, grain = 1, chunks = 0;
  std::atomic<std::size_t> next{0};      // the next chunk to claim
  std::atomic<std::size_t> finished{0};  // chunks run (or skipped after an error)
  std::atomic<bool> failed{false};
  std::mutex error_mutex;
  std::exception_ptr error;

  void drain() {
    for (;;) {
      const std::size_t c = next.fetch_add(1, std::memory_order_relaxed);
      if (c >= chunks) return;
      if (!failed.load(std::memory_order_relaxed)) {
        const std::size_t lo = begin + c * grain;
        try {
          (*body)(lo, std::min(end, lo + grain));
        } catch (...) {
          std::lock_guard<std::mutex> lock(error_mutex);
          if (!error) error = std::current_exception();
          failed.store(true, std::memory_order_relaxed);
        }
      }
      finished.fetch_add(1, std::memory_order_acq_rel);
    }
  }
};

}  // namespace

void thread_pool::parallel_for(std::size_t begin, std::size_t end, std::size_t grain,
                               const std::function<void(std::size_t, std::size_t)>& body, std::size_t max_threads) {
  if (end <= begin) return;
  auto call = std::make_shared<parallel_call>();
  call->body = &body;
  call->begin = begin;
  call->end = end;
  call->grain = std::max<std::size_t>(grain, 1);
  call->chunks = (end - begin + call->grain - 1) / call->grain;
  // Runners: the caller and helpers, at most one per pool thread in all (with one worker per core, a runner more
  // would share a core and finish its chunks last).
  std::size_t runners = std::min(call->chunks, std::max<std::size_t>(size(), 1));
  if (max_threads > 0) runners = std::min(runners, max_threads);
  for (std::size_t h = 1; h < runners; ++h) enqueue([call] { call->drain(); });
  call->drain();
  // Chunks other runners claimed may still run: wait for them (yielding the core to them if they share it).
  while (call->finished.load(std::memory_order_acquire) < call->chunks) std::this_thread::yield();
  if (call->error) std::rethrow_exception(call->error);
}

thread_pool& thread_pool::shared() {
  // Leaked on purpose: joining threads during static destruction can deadlock at interpreter exit.
  static auto* pool = new thread_pool();
  return *pool;
}

}  // namespace shared_cuda
