// A fixed-size pool of worker threads for CPU fallbacks (gathers, copies) and I/O completion work.
//
// submit() returns a std::future: an exception thrown by the task reaches whoever waits on it. parallel_for()
// runs a range in chunks on the calling thread and the pool, and rethrows the first exception. The destructor
// finishes every queued task, then joins.
//
// Spinning (set_spin, off by default): an idle worker polls for new work that long before it sleeps on the
// condition variable. A job queued within the window starts without a wake-up, which on a virtual machine costs
// tens of microseconds per thread, more than a short parallel gather runs; the price is that much busy CPU per
// worker after its last job.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

namespace shared_cuda {

class thread_pool {
 public:
  // threads == 0 means one per hardware thread.
  explicit thread_pool(std::size_t threads = 0);
  ~thread_pool();
  thread_pool(const thread_pool&) = delete;
  thread_pool& operator=(const thread_pool&) = delete;

  std::size_t size() const noexcept { return workers_.size(); }

  // How long an idle worker polls for work before sleeping (0: sleeps at once). Takes effect at its next idle spell.
  void set_spin(std::chrono::microseconds spin) noexcept { spin_us_.store(spin.count(), std::memory_order_relaxed); }
  std::chrono::microseconds spin() const noexcept {
    return std::chrono::microseconds(spin_us_.load(std::memory_order_relaxed));
  }

  template <typename F>
  auto submit(F&& task) -> std::future<std::invoke_result_t<std::decay_t<F>>> {
    using result = std::invoke_result_t<std::decay_t<F>>;
    auto packaged = std::make_shared<std::packaged_task<result()>>(std::forward<F>(task));
    std::future<result> future = packaged->get_future();
    enqueue([packaged] { (*packaged)(); });
    return future;
  }

  // Calls body(chunk_begin, chunk_end) for each chunk of `grain` items of [begin, end) (the last may be shorter),
  // and returns when every chunk has run. The calling thread and up to `max_threads` - 1 workers (0: as many as
  // the pool has, the caller included) claim chunks in ascending order, one at a time, from a shared counter: a
  // worker that wakes late finds its share done by the others instead of holding up the call. The first exception
  // a chunk throws is rethrown here (chunks not yet started are skipped). Do not call it from inside a task of the
  // same pool.
  void parallel_for(std::size_t begin, std::size_t end, std::size_t grain,
                    const std::function<void(std::size_t, std::size_t)>& body, std::size_t max_threads = 0);

  // A process-wide pool sized to the machine, created on first use.
  static thread_pool& shared();

 private:
  void enqueue(std::function<void()> job);
  void work();
  void poll_for_work(std::chrono::steady_clock::time_point until) const;  // until a job is queued, stop or `until`

  std::vector<std::thread> workers_;
  std::deque<std::function<void()>> queue_;
  std::mutex mutex_;
  std::condition_variable ready_;
  bool stopping_ = false;                  // guarded by mutex_
  std::atomic<std::size_t> queued_{0};     // queue_.size(), readable without the lock (for spinning workers)
  std::atomic<bool> stop_polling_{false};  // stopping_, readable without the lock
  std::atomic<std::int64_t> spin_us_{0};
};

}  // namespace shared_cuda
