#include "shared_cuda/thread_pool.hpp"

#include <algorithm>
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

void thread_pool::poll_for_work() const {
  const std::int64_t spin = spin_us_.load(std::memory_order_relaxed);
  if (spin <= 0) return;
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin);
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
    poll_for_work();
    {
      std::unique_lock<std::mutex> lock(mutex_);
      ready_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and everything queued has run
      job = std::move(queue_.front());
      queue_.pop_front();
      queued_.fetch_sub(1, std::memory_order_relaxed);
    }
    job();  // packaged_task stores any exception in its future
  }
}

void thread_pool::parallel_for(std::size_t begin, std::size_t end, std::size_t grain,
                               const std::function<void(std::size_t, std::size_t)>& body) {
  if (end <= begin) return;
  grain = std::max<std::size_t>(grain, 1);
  const std::size_t items = end - begin;
  const std::size_t max_chunks = (items + grain - 1) / grain;
  // One chunk per worker, the calling thread taking the first: size() runners in all, so with one worker per core
  // no core runs two chunks (which would make every call wait for the slowest core).
  const std::size_t chunks = std::min(max_chunks, size());
  const std::size_t per_chunk = (items + chunks - 1) / chunks;

  std::vector<std::future<void>> pending;
  pending.reserve(chunks);
  for (std::size_t c = 1; c < chunks; ++c) {
    const std::size_t lo = begin + c * per_chunk;
    const std::size_t hi = std::min(end, lo + per_chunk);
    if (lo >= hi) break;
    pending.push_back(submit([&body, lo, hi] { body(lo, hi); }));
  }
  std::exception_ptr first_error;
  try {
    body(begin, std::min(end, begin + per_chunk));
  } catch (...) {
    first_error = std::current_exception();
  }
  // Wait for every chunk before returning (they reference `body`), keeping the first error.
  for (auto& f : pending) {
    try {
      f.get();
    } catch (...) {
      if (!first_error) first_error = std::current_exception();
    }
  }
  if (first_error) std::rethrow_exception(first_error);
}

thread_pool& thread_pool::shared() {
  // Leaked on purpose: joining threads during static destruction can deadlock at interpreter exit.
  static auto* pool = new thread_pool();
  return *pool;
}

}  // namespace shared_cuda
