// Host-side row movement: the multithreaded CPU gather/scatter, index checks, and the CPU-gather + pipelined
// DMA strategy ("staged"). Also the CPU-only stand-ins for the CUDA entry points.
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "pytorch_direct/rows.hpp"
#include "shared_cuda/error.hpp"
#include "shared_cuda/memory.hpp"
#include "shared_cuda/thread_pool.hpp"

#if SHARED_CUDA_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

namespace pytorch_direct {
namespace {

// The worker pool of this process. A forked child (DataLoader worker) inherits the parent's pool object but not
// its threads, so each process id gets its own pool; the parent's is leaked in the child (its threads are gone
// and joining them would hang).
shared_cuda::thread_pool& pool() {
  static std::mutex mutex;
  static shared_cuda::thread_pool* current = nullptr;
  static pid_t owner = 0;
  std::lock_guard<std::mutex> lock(mutex);
  if (current == nullptr || owner != getpid()) {
    current = new shared_cuda::thread_pool(0);
    owner = getpid();
  }
  return *current;
}

std::int64_t index_at(const void* index, int index_bytes, std::int64_t i) {
  return index_bytes == 8 ? static_cast<const std::int64_t*>(index)[i]
                          : static_cast<std::int64_t>(static_cast<const std::int32_t*>(index)[i]);
}

// Runs body(begin, end) over [0, count) on up to `threads` threads (<= 0: the whole pool), in chunks of >= grain.
void parallel(std::int64_t count, std::int64_t grain, int threads,
              const std::function<void(std::int64_t, std::int64_t)>& body) {
  if (count <= 0) return;
  auto& p = pool();
  const std::int64_t workers = threads > 0 ? threads : static_cast<std::int64_t>(p.size()) + 1;
  if (workers <= 1 || count <= grain) {
    body(0, count);
    return;
  }
  const std::int64_t chunk = std::max(grain, (count + workers - 1) / workers);
  p.parallel_for(0, static_cast<std::size_t>(count), static_cast<std::size_t>(chunk),
                 [&](std::size_t b, std::size_t e) { body(static_cast<std::int64_t>(b), static_cast<std::int64_t>(e)); });
}

void check_args(const rows_call& c) {
  SHARED_CUDA_EXPECT(c.index_bytes == 4 || c.index_bytes == 8, "index must be int32 or int64");
  SHARED_CUDA_EXPECT(c.row_bytes > 0 && c.rows >= 0 && c.count >= 0, "rows, row_bytes and count must be >= 0");
  SHARED_CUDA_EXPECT(c.count == 0 || (c.table != nullptr && c.index != nullptr && c.dense != nullptr),
                     "null table, index or dense pointer");
}

// Rows per task: about 256 KiB of copying, enough to amortise scheduling.
std::int64_t grain_for(std::int64_t row_bytes) { return std::max<std::int64_t>(1, (256 << 10) / row_bytes); }

void copy_rows(const rows_call& c, bool scatter, std::int64_t begin, std::int64_t end, std::int64_t first) {
  auto* table = static_cast<unsigned char*>(c.table);
  auto* dense = static_cast<unsigned char*>(c.dense);
  for (std::int64_t i = begin; i < end; ++i) {
    const std::int64_t r = index_at(c.index, c.index_bytes, i);
    const std::int64_t p = (c.positions != nullptr ? c.positions[i] : i) - first;
    if (scatter) {
      std::memcpy(table + r * c.row_bytes, dense + p * c.row_bytes, static_cast<std::size_t>(c.row_bytes));
    } else {
      std::memcpy(dense + p * c.row_bytes, table + r * c.row_bytes, static_cast<std::size_t>(c.row_bytes));
    }
  }
}

}  // namespace

namespace {
struct tracked_ranges {
  std::mutex mutex;
  std::map<std::uintptr_t, std::size_t> ranges;  // start -> bytes
};
tracked_ranges& tracked() {
  static tracked_ranges* t = new tracked_ranges();  // never destroyed: owners may untrack during shutdown
  return *t;
}
}  // namespace

void track_host_range(const void* data, std::size_t bytes) {
  auto& t = tracked();
  std::lock_guard<std::mutex> lock(t.mutex);
  t.ranges[reinterpret_cast<std::uintptr_t>(data)] = bytes;
}

void untrack_host_range(const void* data) noexcept {
  auto& t = tracked();
  std::lock_guard<std::mutex> lock(t.mutex);
  t.ranges.erase(reinterpret_cast<std::uintptr_t>(data));
}

bool is_tracked_host_range(const void* data, std::size_t bytes) {
  const auto begin = reinterpret_cast<std::uintptr_t>(data);
  auto& t = tracked();
  std::lock_guard<std::mutex> lock(t.mutex);
  auto it = t.ranges.upper_bound(begin);
  if (it == t.ranges.begin()) return false;
  --it;  // the last range starting at or before `begin`
  return begin + bytes <= it->first + it->second;
}

void check_host_indices(const void* index, int index_bytes, std::int64_t count, std::int64_t rows, int threads) {
  SHARED_CUDA_EXPECT(index_bytes == 4 || index_bytes == 8, "index must be int32 or int64");
  std::mutex mutex;
  std::int64_t first_bad_position = -1;
  std::int64_t first_bad = 0;
  parallel(count, 1 << 16, threads, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t i = b; i < e; ++i) {
      const std::int64_t r = index_at(index, index_bytes, i);
      if (r < 0 || r >= rows) {
        std::lock_guard<std::mutex> lock(mutex);
        if (first_bad_position < 0 || i < first_bad_position) {
          first_bad_position = i;
          first_bad = r;
        }
        return;
      }
    }
  });
  if (first_bad_position >= 0) {
    throw shared_cuda::out_of_range("index " + std::to_string(first_bad) + " at position " +
                                    std::to_string(first_bad_position) + " is out of range for a table of " +
                                    std::to_string(rows) + " rows (valid: 0.." + std::to_string(rows - 1) + ")");
  }
}

void gather_host(const rows_call& c, int threads) {
  check_args(c);
  check_host_indices(c.index, c.index_bytes, c.count, c.rows, threads);
  parallel(c.count, grain_for(c.row_bytes), threads,
           [&](std::int64_t b, std::int64_t e) { copy_rows(c, false, b, e, 0); });
}

void scatter_host(const rows_call& c, int threads) {
  check_args(c);
  check_host_indices(c.index, c.index_bytes, c.count, c.rows, threads);
  parallel(c.count, grain_for(c.row_bytes), threads,
           [&](std::int64_t b, std::int64_t e) { copy_rows(c, true, b, e, 0); });
}

#if SHARED_CUDA_HAS_CUDA
namespace {

// Pinned staging slots shared by every staged call of the process; an event per slot says when its last copy
// finished. Slots are portable pinned memory, events belong to the device they were recorded on, so each device
// gets its own set.
struct staging {
  static constexpr int kSlots = 4;
  static constexpr std::size_t kSlotBytes = 4 << 20;
  std::mutex mutex;
  std::vector<shared_cuda::pinned_buffer> slots;
  std::vector<cudaEvent_t> events;
};

staging& staging_for_current_device() {
  static std::mutex mutex;
  static std::vector<std::unique_ptr<staging>> per_device;
  int device = 0;
  SHARED_CUDA_TRY(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  if (static_cast<int>(per_device.size()) <= device) per_device.resize(device + 1);
  if (!per_device[device]) {
    auto s = std::make_unique<staging>();
    for (int i = 0; i < staging::kSlots; ++i) {
      s->slots.emplace_back(staging::kSlotBytes);
      cudaEvent_t e = nullptr;
      SHARED_CUDA_TRY(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      s->events.push_back(e);
    }
    per_device[device] = std::move(s);
  }
  return *per_device[device];
}

}  // namespace

void gather_staged(const rows_call& c, int threads, shared_cuda::stream_view stream) {
  check_args(c);
  SHARED_CUDA_EXPECT(c.positions == nullptr, "the staged strategy writes rows in index order (no positions)");
  check_host_indices(c.index, c.index_bytes, c.count, c.rows, threads);
  if (c.count == 0) return;
  auto& st = staging_for_current_device();
  std::lock_guard<std::mutex> lock(st.mutex);
  const auto s = static_cast<cudaStream_t>(stream.handle);
  // A row wider than a slot still moves: it is copied in one piece through a temporary pinned buffer.
  const std::int64_t per_chunk = std::max<std::int64_t>(1, static_cast<std::int64_t>(staging::kSlotBytes) / c.row_bytes);
  std::int64_t chunk_index = 0;
  for (std::int64_t begin = 0; begin < c.count; begin += per_chunk, ++chunk_index) {
    const std::int64_t end = std::min(c.count, begin + per_chunk);
    const int slot = static_cast<int>(chunk_index % staging::kSlots);
    const std::size_t bytes = static_cast<std::size_t>((end - begin) * c.row_bytes);
    SHARED_CUDA_EXPECT(bytes <= staging::kSlotBytes, "rows wider than 4 MiB are not supported by the staged strategy");
    SHARED_CUDA_TRY(cudaEventSynchronize(st.events[slot]));  // the slot's previous copy has left the buffer
    rows_call part = c;
    part.dense = st.slots[slot].data();
    parallel(end - begin, grain_for(c.row_bytes), threads, [&](std::int64_t b, std::int64_t e) {
      copy_rows(part, false, begin + b, begin + e, begin);
    });
    SHARED_CUDA_TRY(cudaMemcpyAsync(static_cast<unsigned char*>(c.dense) + begin * c.row_bytes, st.slots[slot].data(),
                                    bytes, cudaMemcpyHostToDevice, s));
    SHARED_CUDA_TRY(cudaEventRecord(st.events[slot], s));
  }
}

void scatter_staged(const rows_call& c, int threads, shared_cuda::stream_view stream) {
  check_args(c);
  SHARED_CUDA_EXPECT(c.positions == nullptr, "the staged strategy reads rows in index order (no positions)");
  check_host_indices(c.index, c.index_bytes, c.count, c.rows, threads);
  if (c.count == 0) return;
  auto& st = staging_for_current_device();
  std::lock_guard<std::mutex> lock(st.mutex);
  const auto s = static_cast<cudaStream_t>(stream.handle);
  const std::int64_t per_chunk = std::max<std::int64_t>(1, static_cast<std::int64_t>(staging::kSlotBytes) / c.row_bytes);
  SHARED_CUDA_EXPECT(per_chunk * c.row_bytes <= static_cast<std::int64_t>(staging::kSlotBytes),
                     "rows wider than 4 MiB are not supported by the staged strategy");
  const std::int64_t chunks = (c.count + per_chunk - 1) / per_chunk;
  // Queue up to kSlots copies ahead, then scatter each chunk as soon as its copy is done.
  auto queue = [&](std::int64_t k) {
    const std::int64_t begin = k * per_chunk;
    const std::int64_t end = std::min(c.count, begin + per_chunk);
    const int slot = static_cast<int>(k % staging::kSlots);
    SHARED_CUDA_TRY(cudaMemcpyAsync(st.slots[slot].data(), static_cast<unsigned char*>(c.dense) + begin * c.row_bytes,
                                    static_cast<std::size_t>((end - begin) * c.row_bytes), cudaMemcpyDeviceToHost, s));
    SHARED_CUDA_TRY(cudaEventRecord(st.events[slot], s));
  };
  for (std::int64_t k = 0; k < std::min<std::int64_t>(chunks, staging::kSlots); ++k) queue(k);
  for (std::int64_t k = 0; k < chunks; ++k) {
    const int slot = static_cast<int>(k % staging::kSlots);
    SHARED_CUDA_TRY(cudaEventSynchronize(st.events[slot]));
    const std::int64_t begin = k * per_chunk;
    const std::int64_t end = std::min(c.count, begin + per_chunk);
    rows_call part = c;
    part.dense = st.slots[slot].data();
    parallel(end - begin, grain_for(c.row_bytes), threads, [&](std::int64_t b, std::int64_t e) {
      copy_rows(part, true, begin + b, begin + e, begin);
    });
    if (k + staging::kSlots < chunks) queue(k + staging::kSlots);
  }
}

#else  // no CUDA in this build

bool kernels_compiled() noexcept { return false; }
std::int64_t* error_word() { throw shared_cuda::unavailable_error("pytorch_direct was built without CUDA"); }
bool take_device_error(std::int64_t&) { return false; }
void gather_cuda(const rows_call&, kernel_kind, int, shared_cuda::stream_view) {
  throw shared_cuda::unavailable_error("pytorch_direct was built without CUDA: reinstall with nvcc on PATH");
}
void scatter_cuda(const rows_call&, kernel_kind, int, shared_cuda::stream_view) {
  throw shared_cuda::unavailable_error("pytorch_direct was built without CUDA: reinstall with nvcc on PATH");
}
void gather_staged(const rows_call&, int, shared_cuda::stream_view) {
  throw shared_cuda::unavailable_error("pytorch_direct was built without CUDA: reinstall with nvcc on PATH");
}
void scatter_staged(const rows_call&, int, shared_cuda::stream_view) {
  throw shared_cuda::unavailable_error("pytorch_direct was built without CUDA: reinstall with nvcc on PATH");
}
bool is_device_accessible_host(const void*, std::size_t) { return false; }

#endif

}  // namespace pytorch_direct
