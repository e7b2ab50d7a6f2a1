#include <cstdlib>
#include <cstring>

#include "check.hpp"
#include "shared_cuda/device.hpp"
#include "shared_cuda/error.hpp"
#include "shared_cuda/memory.hpp"

using namespace shared_cuda;

TEST(aligned_host_buffer_alignment_and_move) {
  aligned_host_buffer a(10000, 4096);
  CHECK(reinterpret_cast<std::uintptr_t>(a.data()) % 4096 == 0);
  CHECK(a.size() == 10000);
  std::memset(a.data(), 7, a.size());
  aligned_host_buffer b = std::move(a);
  CHECK(a.data() == nullptr && a.size() == 0);
  CHECK(static_cast<unsigned char*>(b.data())[9999] == 7);
  CHECK_THROWS(std::invalid_argument, aligned_host_buffer(16, 3000));
}

TEST(cuda_owners_refuse_without_gpu) {
  if (cuda_available()) SKIP("a GPU is present");
  CHECK_THROWS(unavailable_error, device_buffer(1024));
  CHECK_THROWS(unavailable_error, pinned_buffer(1024));
  CHECK_THROWS(unavailable_error, host_managed_buffer(1024));
  CHECK(!host_managed_buffer::supported());
  std::vector<char> host(4096);
  CHECK_THROWS(unavailable_error, host_registration(host.data(), host.size()));
}

TEST(empty_registration_is_rejected) { CHECK_THROWS(std::invalid_argument, host_registration(nullptr, 16)); }

TEST(device_and_pinned_buffers) {
  if (!cuda_available()) SKIP("no CUDA device");
  device_buffer d(1 << 20);
  CHECK(d.data() != nullptr && d.size() == (1u << 20));
  device_buffer moved = std::move(d);
  CHECK(d.data() == nullptr && moved.data() != nullptr);
  pinned_buffer p(1 << 20);
  CHECK(p.data() != nullptr && p.device_pointer() != nullptr);
}

TEST(host_managed_buffer_is_zeroed_host_memory) {
  if (!cuda_available()) SKIP("no CUDA device");
  if (!host_managed_buffer::supported()) SKIP("no concurrent managed access");
  const std::size_t bytes = (std::size_t(3) << 28) + 12345;  // several touching threads, a ragged last part
  host_managed_buffer m(bytes);
  CHECK(m.data() != nullptr && m.size() == bytes);
  const auto* p = static_cast<const unsigned char*>(m.data());
  for (std::size_t i = 0; i < bytes; i += 4093) CHECK(p[i] == 0);
  CHECK(p[bytes - 1] == 0);
  host_managed_buffer moved = std::move(m);
  CHECK(m.data() == nullptr && moved.data() == p);
}

TEST(registration_overlaps_and_releases_once) {
  if (!cuda_available()) SKIP("no CUDA device");
  const std::size_t page = 4096;
  const std::size_t before = host_registration::registered_extent_count();
  void* raw = nullptr;
  CHECK(posix_memalign(&raw, page, 64 * page) == 0);
  char* base = static_cast<char*>(raw);
  {
    host_registration whole(base + 8 * page, 16 * page);
    CHECK(host_registration::registered_extent_count() == before + 1);
    host_registration same(base + 8 * page, 16 * page);   // repeated request: reuses the extent
    host_registration inside(base + 10 * page + 3, 100);  // contained: reuses it
    CHECK(host_registration::registered_extent_count() == before + 1);
    host_registration spanning(base, 40 * page);  // overlaps: registers the gaps before and after
    CHECK(host_registration::registered_extent_count() == before + 3);
    CHECK(spanning.device_pointer() != nullptr);
    host_registration moved = std::move(same);
    CHECK(!same.registered() && moved.registered());
  }
  CHECK(host_registration::registered_extent_count() == before);  // every extent unregistered
  // Registering again after release works (CUDA would refuse a page still registered).
  {
    host_registration again(base, 64 * page);
  }
  std::free(raw);
}

TEST(read_only_registration) {
  if (!cuda_available()) SKIP("no CUDA device");
  const std::size_t page = 4096;
  void* raw = nullptr;
  CHECK(posix_memalign(&raw, page, 8 * page) == 0);
  char* base = static_cast<char*>(raw);
  {
    host_registration ro(base, 4 * page, host_registration::access::read_only);
    CHECK(ro.mode() == host_registration::access::read_only && ro.device_pointer() != nullptr);
    host_registration ro_again(base + page, page, host_registration::access::read_only);  // reuses the extent
    CHECK_THROWS(std::invalid_argument, host_registration(base, 8 * page));  // writable over read-only: refused
    host_registration rw_elsewhere(base + 4 * page, 4 * page);               // disjoint pages: fine
  }
  {
    host_registration rw(base, 8 * page);
  }  // everything was released: a writable registration now works
  std::free(raw);
}
