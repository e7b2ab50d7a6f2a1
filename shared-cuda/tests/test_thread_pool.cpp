#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <numeric>
#include <set>
#include <thread>

#include "check.hpp"
#include "shared_cuda/thread_pool.hpp"

using namespace shared_cuda;

TEST(submit_returns_values) {
  thread_pool pool(3);
  CHECK(pool.size() == 3);
  std::vector<std::future<int>> results;
  for (int i = 0; i < 100; ++i) results.push_back(pool.submit([i] { return i * i; }));
  for (int i = 0; i < 100; ++i) CHECK(results[static_cast<std::size_t>(i)].get() == i * i);
}

TEST(exceptions_reach_the_waiter) {
  thread_pool pool(2);
  auto f = pool.submit([]() -> int { throw std::runtime_error("boom"); });
  CHECK_THROWS(std::runtime_error, f.get());
}

TEST(parallel_for_covers_range_once) {
  thread_pool pool(4);
  std::vector<std::atomic<int>> hits(10007);
  pool.parallel_for(0, hits.size(), 64, [&](std::size_t lo, std::size_t hi) {
    for (std::size_t i = lo; i < hi; ++i) hits[i].fetch_add(1);
  });
  for (auto& h : hits) CHECK(h.load() == 1);
  pool.parallel_for(5, 5, 1, [&](std::size_t, std::size_t) { CHECK(false); });  // empty range: no call
}

TEST(parallel_for_rethrows) {
  thread_pool pool(4);
  CHECK_THROWS(std::logic_error, pool.parallel_for(0, 1000, 1, [](std::size_t lo, std::size_t) {
    if (lo > 500) throw std::logic_error("chunk failed");
  }));
}

TEST(destructor_runs_queued_work) {
  std::atomic<int> done{0};
  {
    thread_pool pool(1);
    for (int i = 0; i < 50; ++i) pool.submit([&] { done.fetch_add(1); });
  }
  CHECK(done.load() == 50);
}

TEST(shared_pool_exists) { CHECK(thread_pool::shared().size() >= 1); }

// Spinning workers must still run every job, sleep once the window ends (jobs queued later wake them), and let
// the destructor join them while they poll.
TEST(spinning_pool_runs_jobs_and_stops) {
  std::atomic<int> done{0};
  {
    thread_pool pool(3);
    CHECK(pool.spin().count() == 0);
    pool.set_spin(std::chrono::microseconds(2000));
    CHECK(pool.spin().count() == 2000);
    for (int round = 0; round < 20; ++round) {
      pool.parallel_for(0, 300, 1, [&](std::size_t lo, std::size_t hi) { done.fetch_add(static_cast<int>(hi - lo)); });
    }
    CHECK(done.load() == 20 * 300);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));  // past the window: the workers sleep
    CHECK(pool.submit([] { return 7; }).get() == 7);
    pool.set_spin(std::chrono::microseconds(0));
    CHECK(pool.submit([] { return 8; }).get() == 8);
    pool.set_spin(std::chrono::microseconds(1000000));  // destroyed while polling: the destructor must not wait 1 s
  }
  CHECK(done.load() == 20 * 300);
}

TEST(parallel_for_runs_chunks_of_grain_within_max_threads) {
  thread_pool pool(4);
  std::mutex m;
  std::vector<std::pair<std::size_t, std::size_t>> seen;
  std::set<std::thread::id> threads;
  pool.parallel_for(10, 1000, 100, [&](std::size_t lo, std::size_t hi) {
    std::lock_guard<std::mutex> lock(m);
    seen.emplace_back(lo, hi);
    threads.insert(std::this_thread::get_id());
  });
  std::sort(seen.begin(), seen.end());
  CHECK(seen.size() == 10);
  for (std::size_t i = 0; i < seen.size(); ++i) CHECK(seen[i].first == 10 + 100 * i);
  CHECK(seen.back().second == 1000);
  CHECK(threads.size() <= 4);
  threads.clear();
  pool.parallel_for(
      0, 1000, 1,
      [&](std::size_t, std::size_t) {
        std::lock_guard<std::mutex> lock(m);
        threads.insert(std::this_thread::get_id());
      },
      1);  // max_threads 1: the caller alone
  CHECK(threads.size() == 1 && *threads.begin() == std::this_thread::get_id());
}

// Many short calls back to back: helpers of an earlier call may start after it returned, and must find nothing
// to do (and not touch the finished call's body).
TEST(parallel_for_many_short_calls) {
  thread_pool pool(4);
  pool.set_spin(std::chrono::microseconds(100));
  long total = 0;
  for (int call = 0; call < 2000; ++call) {
    std::atomic<long> sum{0};
    pool.parallel_for(0, 64, 4, [&](std::size_t lo, std::size_t hi) {
      for (std::size_t i = lo; i < hi; ++i) sum.fetch_add(static_cast<long>(i));
    });
    total += sum.load();
  }
  CHECK(total == 2000L * (63 * 64 / 2));
}
