// C++ tests of the engine's parts: extent allocator, store, crc32c, and round trips through each CPU backend.
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "check.hpp"
#include "shared_cuda/error.hpp"
#include "shared_cuda/memory.hpp"
#include "ssdtrain/backends.hpp"
#include "ssdtrain/detail/store.hpp"
#include "ssdtrain/engine.hpp"

using ssdtrain::detail::extent_allocator;

namespace {

std::string temp_dir() {
  const char* base = std::getenv("TMPDIR");
  std::string templ = std::string(base ? base : "/tmp") + "/ssdtrain-cpp-XXXXXX";
  char* made = mkdtemp(templ.data());
  if (made == nullptr) throw std::runtime_error("mkdtemp failed");
  return made;
}

ssdtrain::engine_config config(const std::string& dir, const std::string& backend) {
  ssdtrain::engine_config c;
  c.directories = {dir};
  c.capacity_per_directory = 64ull << 20;
  c.backend = backend;
  c.block_size = 64 << 10;
  c.queue_depth = 8;
  c.staging_buffers = 4;
  c.checksum = true;
  return c;
}

std::vector<unsigned char> random_bytes(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<unsigned char> v(n);
  for (auto& b : v) b = static_cast<unsigned char>(rng());
  return v;
}

std::vector<std::string> cpu_backends() {
  std::vector<std::string> out{"threads"};
  if (ssdtrain::io_uring_status().usable) out.push_back("io_uring");
  return out;
}

}  // namespace

TEST(extent_allocator_first_fit_and_merge) {
  extent_allocator a;
  CHECK(a.allocate(4096) == -1);  // empty
  a.grow(16 * 4096);
  const auto x = a.allocate(4 * 4096), y = a.allocate(4 * 4096), z = a.allocate(4 * 4096);
  CHECK(x == 0 && y == 4 * 4096 && z == 8 * 4096);
  CHECK(a.in_use() == 12 * 4096);
  a.release(y, 4 * 4096);
  CHECK(a.allocate(5 * 4096) == -1);  // the hole (4 pages) and the tail (4 pages) are both too small
  CHECK(a.allocate(3 * 4096) == y);   // first fit: the hole
  a.release(x, 4 * 4096);             // merges with nothing: [x, x+4) then used [y, y+3)
  CHECK(a.free_ranges() == 3);        // [x,4) [y+3,1) [12,4)
  a.release(y, 3 * 4096);
  CHECK(a.free_ranges() == 2);  // [0, 8) merged, [12, 16)
  a.release(z, 4 * 4096);
  CHECK(a.free_ranges() == 1 && a.in_use() == 0);
}

TEST(extent_allocator_coalesces_to_one_range) {
  extent_allocator a;
  a.grow(10 * 4096);
  std::vector<std::int64_t> offs;
  for (int i = 0; i < 10; ++i) offs.push_back(a.allocate(4096));
  CHECK(a.allocate(4096) == -1);
  CHECK(a.free_tail() == 0);
  for (int i : {1, 3, 5, 7, 9, 0, 2, 4, 6, 8}) a.release(offs[i], 4096);
  CHECK(a.free_ranges() == 1);
  CHECK(a.in_use() == 0);
  CHECK(a.free_tail() == 10 * 4096);
  CHECK(a.allocate(10 * 4096) == 0);
}

TEST(extent_allocator_grow_extends_free_tail) {
  extent_allocator a;
  a.grow(4096);
  a.allocate(4096);
  a.grow(2 * 4096);
  CHECK(a.free_tail() == 2 * 4096);
  CHECK(a.allocate(2 * 4096) == 4096);
}

TEST(store_respects_cap_and_stripes) {
  const std::string d1 = temp_dir(), d2 = temp_dir();
  ssdtrain::engine_config c = config(d1, "threads");
  c.directories = {d1, d2};
  c.capacity_per_directory = 1 << 20;
  c.grow_step = 64 << 10;
  ssdtrain::detail::store s(c);
  CHECK(s.file_count() == 2);
  const auto striped = s.allocate(1 << 20, 64 << 10);  // >= 4 blocks: split over both directories
  CHECK(striped.size() == 2 && striped[0].file != striped[1].file);
  CHECK(striped[0].bytes == 512 << 10);
  const auto second = s.allocate(1 << 20, 64 << 10);  // fills both directories to their caps
  CHECK(s.bytes_in_use() == 2 << 20);
  CHECK_THROWS(shared_cuda::io_error, s.allocate(1 << 20, 64 << 10));
  try {
    s.allocate(4096, 64 << 10);
    CHECK(false);
  } catch (const shared_cuda::io_error& e) {
    CHECK(e.err() == ENOSPC);
  }
  s.release(striped);
  s.release(second);
  CHECK(s.bytes_in_use() == 0);
  CHECK(s.allocate(1 << 20, 64 << 10).size() == 2);
}

TEST(store_bad_directory) {
  ssdtrain::engine_config c = config("/nonexistent/ssdtrain", "threads");
  try {
    ssdtrain::detail::store s(c);
    CHECK(false);
  } catch (const shared_cuda::io_error& e) {
    CHECK(e.err() == ENOENT);
  }
}

TEST(crc32c_values) {
  CHECK(ssdtrain::crc32c("123456789", 9) == 0xE3069283u);
  const auto data = random_bytes(1 << 20, 1);
  const std::uint32_t whole = ssdtrain::crc32c(data.data(), data.size());
  for (std::size_t cut : {1ul, 4095ul, 24576ul, 500000ul}) {
    CHECK(ssdtrain::crc32c(data.data() + cut, data.size() - cut, ssdtrain::crc32c(data.data(), cut)) == whole);
  }
}

TEST(round_trip_every_cpu_backend) {
  for (const auto& backend : cpu_backends()) {
    const std::string dir = temp_dir();
    ssdtrain::engine e(config(dir, backend));
    CHECK(e.backend() == backend);
    for (std::size_t n : {1ul, 4096ul, 70000ul, (1ul << 20) + 5}) {
      auto src = random_bytes(n, static_cast<unsigned>(n));
      auto [handle, wop] = e.write({src.data(), n, -1});
      wop->get();
      CHECK(wop->done() && wop->staged());
      std::vector<unsigned char> dst(n, 0xAA);
      e.read(handle, {dst.data(), n, -1})->get();
      CHECK(dst == src);
      shared_cuda::aligned_host_buffer aligned(n, 4096);
      e.read(handle, {aligned.data(), n, -1})->get();
      CHECK(std::memcmp(aligned.data(), src.data(), n) == 0);
      e.free(handle);
      CHECK_THROWS(shared_cuda::invalid_argument, e.read(handle, {dst.data(), n, -1}));
    }
    const auto t = e.stats();
    CHECK(t.errors == 0 && t.write_ops == 4 && t.read_ops == 8 && t.bytes_in_use == 0);
  }
}

TEST(injected_faults_reach_the_waiter) {
  for (const auto& backend : cpu_backends()) {
    auto c = config(temp_dir(), backend);
    c.fault = {"write", EIO, 128 << 10};
    ssdtrain::engine e(c);
    auto src = random_bytes(1 << 20, 3);
    auto [handle, op] = e.write({src.data(), src.size(), -1});
    try {
      op->get();
      CHECK(false);
    } catch (const shared_cuda::io_error& err) {
      CHECK(err.err() == EIO);
    }
    std::vector<unsigned char> dst(src.size());
    auto r = e.read(handle, {dst.data(), dst.size(), -1});
    CHECK_THROWS(shared_cuda::io_error, r->get());
  }
}

TEST(checksum_detects_corruption) {
  for (const auto& backend : cpu_backends()) {
    ssdtrain::engine e(config(temp_dir(), backend));
    auto src = random_bytes(300000, 4);
    auto [handle, op] = e.write({src.data(), src.size(), -1});
    op->get();
    e.corrupt_for_test(handle, 123456, 1);
    std::vector<unsigned char> dst(src.size());
    try {
      e.read(handle, {dst.data(), dst.size(), -1})->get();
      CHECK(false);
    } catch (const shared_cuda::io_error& err) {
      CHECK(err.err() == EBADMSG);
    }
    CHECK(e.stats().checksum_failures == 1);
  }
}

TEST(stage_host_per_operation_and_staging_pool_layout) {
  for (const auto& backend : cpu_backends()) {
    ssdtrain::engine e(config(temp_dir(), backend));
    const bool direct = e.directories()[0].direct;
    const auto t0 = e.stats();
    CHECK(t0.staging_address % (2u << 20) == 0);  // huge-page aligned pool
    CHECK(t0.staging_bytes == 4u * (64u << 10));
    const std::size_t n = 256 << 10;  // 4 whole blocks
    auto src = random_bytes(n, 9);
    shared_cuda::aligned_host_buffer in(n, 4096), out(n, 4096);
    std::memcpy(in.data(), src.data(), n);
    // In place (0): no staging copies; staged (1): every block both ways.
    auto [h1, w1] = e.write({in.data(), n, -1}, 0, 0);
    w1->get();
    e.read(h1, {out.data(), n, -1}, 0, 0)->get();
    CHECK(std::memcmp(out.data(), src.data(), n) == 0);
    CHECK(e.stats().staged_copies == 0);
    std::memset(out.data(), 0x5A, n);
    auto [h2, w2] = e.write({in.data(), n, -1}, 0, 1);
    w2->get();
    e.read(h2, {out.data(), n, -1}, 0, 1)->get();
    CHECK(std::memcmp(out.data(), src.data(), n) == 0);
    CHECK(e.stats().staged_copies == (direct ? 8u : 0u));
  }
}
