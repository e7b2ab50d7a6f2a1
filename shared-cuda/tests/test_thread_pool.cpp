#include <atomic>
#include <numeric>

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
