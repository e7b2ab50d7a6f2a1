// Host-side row movement: the multithreaded CPU gather/scatter, index checks, and the CPU-gather + pipelined
// DMA strategy ("staged"). Also the CPU-only stand-ins for the CUDA entry points.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
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

// Runs body(begin, end) over [0, count) on up to `threads` threads (<= 0: the whole pool), in blocks of `block`
// items that the threads take in turn from a shared counter (dynamic scheduling). Waking a pool thread takes tens
// of microseconds (more on a virtual machine), and a thread may share its core: with one fixed slice per thread
// a call waits for the latest thread, while here the threads that start first take over the late ones' blocks.
// At least `grain` items per thread: below that, waking a thread costs more than it copies.
void parallel(std::int64_t count, std::int64_t grain, std::int64_t block, int threads,
              const std::function<void(std::int64_t, std::int64_t)>& body) {
  if (count <= 0) return;
  auto& p = pool();
  const auto size = static_cast<std::int64_t>(p.size());
  const std::int64_t wanted = threads > 0 ? std::min<std::int64_t>(threads, size) : size;
  const std::int64_t workers = std::min(wanted, (count + grain - 1) / grain);
  if (workers <= 1) {
    body(0, count);
    return;
  }
  block = std::max<std::int64_t>(1, block);
  std::atomic<std::int64_t> next{0};
  // parallel_for runs at most size() chunks, the caller taking the first: one chunk per worker here.
  p.parallel_for(0, static_cast<std::size_t>(workers), 1, [&](std::size_t, std::size_t) {
    for (std::int64_t b = next.fetch_add(block, std::memory_order_relaxed); b < count;
         b = next.fetch_add(block, std::memory_order_relaxed)) {
      body(b, std::min(count, b + block));
    }
  });
}

void check_args(const rows_call& c) {
  SHARED_CUDA_EXPECT(c.index_bytes == 4 || c.index_bytes == 8, "index must be int32 or int64");
  SHARED_CUDA_EXPECT(c.row_bytes > 0 && c.rows >= 0 && c.count >= 0, "rows, row_bytes and count must be >= 0");
  SHARED_CUDA_EXPECT(c.count == 0 || (c.table != nullptr && c.index != nullptr && c.dense != nullptr),
                     "null table, index or dense pointer");
}

// Rows per thread at least: about 64 KiB of copying, enough to pay for waking the thread.
std::int64_t grain_for(std::int64_t row_bytes) { return std::max<std::int64_t>(1, (64 << 10) / row_bytes); }
// Rows per block of the dynamic schedule: about 64 KiB (at least 32 rows), so a 2 MiB chunk is ~32 blocks to
// share out and the per-block cost (a shared counter, a call) stays small next to the copying.
std::int64_t block_for(std::int64_t row_bytes) { return std::max<std::int64_t>(32, (64 << 10) / row_bytes); }

// Copies one row. Fixed widths up to 128 B compile to inline vector moves (a libc memcpy call with a run-time size
// costs about as much as a 64-byte row's copy when the row is in cache); wider rows call memcpy, which measured
// faster than the inline copy from 256 B on.
template <std::size_t Width>
struct row_copier {
  static void copy(void* to, const void* from, std::size_t) { std::memcpy(to, from, Width); }
};
template <>
struct row_copier<0> {
  static void copy(void* to, const void* from, std::size_t bytes) { std::memcpy(to, from, bytes); }
};

// Calls f(row_copier<W>{}) with W the row width when it is one of the specialised widths, else W = 0.
template <typename F>
auto with_row_copier(std::int64_t row_bytes, F&& f) {
  switch (row_bytes) {
    case 4:
      return f(row_copier<4>{});
    case 8:
      return f(row_copier<8>{});
    case 16:
      return f(row_copier<16>{});
    case 32:
      return f(row_copier<32>{});
    case 64:
      return f(row_copier<64>{});
    case 128:
      return f(row_copier<128>{});
    default:
      return f(row_copier<0>{});
  }
}

// Rows prefetched ahead: random rows miss the cache and the TLB, and a core overlaps only the misses it knows
// about (16 measured no better than 8 for 64-256 B rows on the 2-core CPU machine).
constexpr std::int64_t kPrefetchAhead = 8;

// Rows [begin, end) of a call whose indices were checked: index width, direction and (common) row widths are
// template parameters, so the loop has no per-row branch but the optional positions.
template <typename Index, bool Scatter, typename Copier>
void copy_rows_as(const rows_call& c, std::int64_t begin, std::int64_t end, Copier) {
  const auto* index = static_cast<const Index*>(c.index);
  auto* table = static_cast<unsigned char*>(c.table);
  auto* dense = static_cast<unsigned char*>(c.dense);
  const auto rb = static_cast<std::size_t>(c.row_bytes);
  constexpr std::int64_t ahead = kPrefetchAhead;
  // The block's first rows too: a block of a few dozen rows would otherwise start with `ahead` unprefetched misses.
  for (std::int64_t i = begin; i < std::min(end, begin + ahead); ++i) {
    __builtin_prefetch(table + static_cast<std::int64_t>(index[i]) * c.row_bytes, Scatter ? 1 : 0);
  }
  for (std::int64_t i = begin; i < end; ++i) {
    if (i + ahead < end) {
      __builtin_prefetch(table + static_cast<std::int64_t>(index[i + ahead]) * c.row_bytes, Scatter ? 1 : 0);
    }
    unsigned char* row = table + static_cast<std::int64_t>(index[i]) * c.row_bytes;
    unsigned char* out = dense + (c.positions != nullptr ? c.positions[i] : i) * c.row_bytes;
    if (Scatter) {
      Copier::copy(row, out, rb);
    } else {
      Copier::copy(out, row, rb);
    }
  }
}

template <bool Scatter>
void copy_rows(const rows_call& c, std::int64_t begin, std::int64_t end) {
  with_row_copier(c.row_bytes, [&](auto copier) {
    if (c.index_bytes == 8) {
      copy_rows_as<std::int64_t, Scatter>(c, begin, end, copier);
    } else {
      copy_rows_as<std::int32_t, Scatter>(c, begin, end, copier);
    }
  });
}

std::string out_of_range_message(std::int64_t value, std::int64_t position, std::int64_t rows) {
  return "index " + std::to_string(value) + " at position " + std::to_string(position) +
         " is out of range for a table of " + std::to_string(rows) + " rows (valid: 0.." + std::to_string(rows - 1) +
         ")";
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
  parallel(count, 1 << 16, 1 << 14, threads, [&](std::int64_t b, std::int64_t e) {
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
  if (first_bad_position >= 0)
    throw shared_cuda::out_of_range(out_of_range_message(first_bad, first_bad_position, rows));
}

void gather_host(const rows_call& c, int threads) {
  check_args(c);
  // A separate pass over the indices (sequential reads): checking inside the row loop measured ~20 % slower for
  // 256-512 B rows (the check sits between each index load and its row's copy).
  check_host_indices(c.index, c.index_bytes, c.count, c.rows, threads);
  parallel(c.count, grain_for(c.row_bytes), block_for(c.row_bytes), threads,
           [&](std::int64_t b, std::int64_t e) { copy_rows<false>(c, b, e); });
}

void scatter_host(const rows_call& c, int threads) {
  check_args(c);
  // Writes: nothing reaches the table when an index is bad.
  check_host_indices(c.index, c.index_bytes, c.count, c.rows, threads);
  parallel(c.count, grain_for(c.row_bytes), block_for(c.row_bytes), threads,
           [&](std::int64_t b, std::int64_t e) { copy_rows<true>(c, b, e); });
}

#if SHARED_CUDA_HAS_CUDA
namespace {

// Pinned staging slots shared by every staged call of the process; an event per slot says when its last copy
// finished. Slots are portable pinned memory, events belong to the device they were recorded on, so each device
// gets its own set.
struct staging {
  static constexpr int kSlots = 8;
  static constexpr std::size_t kSlotBytes = 4 << 20;   // also the widest row the staged strategy moves
  static constexpr std::size_t kChunkBytes = 2 << 20;  // a smaller chunk fills and drains the pipeline sooner
  std::vector<shared_cuda::pinned_buffer> slots;
  std::vector<cudaEvent_t> events;
};

// One staged call at a time per process: a call's workers wait for each other (below), so two calls sharing the
// pool could each hold threads the other waits for.
std::mutex& staged_mutex() {
  static std::mutex m;
  return m;
}

staging& staging_for_current_device() {
  static std::vector<std::unique_ptr<staging>> per_device;  // guarded by staged_mutex()
  int device = 0;
  SHARED_CUDA_TRY(cudaGetDevice(&device));
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

// The shared state of one staged call. Chunk k of the dense rows goes through slot k % kSlots. A chunk is cut into
// blocks of ~16 KiB that the workers take in order from a shared counter; the worker that completes a chunk's last
// rows queues its copy. One parallel region per call (a fork-join per chunk cost thread wake-ups comparable to the
// copying itself), and dynamic blocks: a thread that wakes late or shares its core delays nobody.
struct pipeline {
  pipeline(const rows_call& call, int threads) : c(call) {
    rows_per_chunk = std::max<std::int64_t>(
        1, static_cast<std::int64_t>(std::max<std::size_t>(staging::kChunkBytes, c.row_bytes)) / c.row_bytes);
    chunks = (c.count + rows_per_chunk - 1) / rows_per_chunk;
    block_rows = std::min(rows_per_chunk, block_for(c.row_bytes));
    blocks_per_chunk = (rows_per_chunk + block_rows - 1) / block_rows;
    const auto size = static_cast<std::int64_t>(pool().size());
    const std::int64_t available = threads > 0 ? std::min<std::int64_t>(threads, size) : size;
    // At least ~64 KiB per worker per call: below that, waking a thread costs more than it copies.
    const std::int64_t useful = std::max<std::int64_t>(1, c.count * c.row_bytes / (64 << 10));
    workers = static_cast<int>(std::max<std::int64_t>(1, std::min(available, useful)));
    done.reset(new std::atomic<std::int64_t>[chunks]);
    ready.reset(new std::atomic<bool>[chunks]);
    for (std::int64_t k = 0; k < chunks; ++k) {
      done[k].store(0, std::memory_order_relaxed);
      ready[k].store(false, std::memory_order_relaxed);
    }
  }

  std::int64_t chunk_rows(std::int64_t k) const {
    return std::min(c.count, (k + 1) * rows_per_chunk) - k * rows_per_chunk;
  }

  // The next block: its chunk and rows [begin, end); false when none is left.
  bool take(std::int64_t& k, std::int64_t& begin, std::int64_t& end) {
    for (;;) {
      const std::int64_t id = next_block.fetch_add(1, std::memory_order_relaxed);
      k = id / blocks_per_chunk;
      if (k >= chunks) return false;
      begin = k * rows_per_chunk + (id % blocks_per_chunk) * block_rows;
      end = std::min(k * rows_per_chunk + chunk_rows(k), begin + block_rows);
      if (begin < end) return true;  // the last chunk may have fewer blocks
    }
  }

  // Adds n finished rows to chunk k; true for the worker that finished the chunk.
  bool finish(std::int64_t k, std::int64_t n) {
    return done[k].fetch_add(n, std::memory_order_acq_rel) + n == chunk_rows(k);
  }

  // Spins (yielding) until flag is set; false when another worker failed.
  bool wait_for(const std::atomic<bool>& flag) const {
    while (!flag.load(std::memory_order_acquire)) {
      if (abort.load(std::memory_order_relaxed)) return false;
      std::this_thread::yield();
    }
    return true;
  }

  void fail(std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(error_mutex);
    if (!error) error = e;
    abort.store(true);
  }

  void rethrow() const {
    if (error) std::rethrow_exception(error);
  }

  // Runs body() on every worker, one per thread (the caller is one of them).
  void run(const std::function<void()>& body) {
    pool().parallel_for(0, static_cast<std::size_t>(workers), 1, [&](std::size_t, std::size_t) {
      try {
        body();
      } catch (...) {
        fail(std::current_exception());
      }
    });
  }

  const rows_call& c;
  std::int64_t rows_per_chunk = 1;
  std::int64_t chunks = 0;
  std::int64_t block_rows = 1;
  std::int64_t blocks_per_chunk = 1;
  int workers = 1;
  std::atomic<std::int64_t> next_block{0};
  std::unique_ptr<std::atomic<std::int64_t>[]> done;  // rows of chunk k finished
  std::unique_ptr<std::atomic<bool>[]> ready;         // chunk k's copy is queued (its slot's event is recorded)
  std::atomic<bool> abort{false};
  std::mutex error_mutex;
  std::exception_ptr error;
};

// Copies rows [begin, end) between the table and `staged` (row p - first of the slot); indices checked before.
template <bool Scatter>
void move_block(const rows_call& c, std::int64_t begin, std::int64_t end, std::int64_t first, unsigned char* staged) {
  rows_call part = c;
  part.dense = staged - first * c.row_bytes;  // row i of the call is row i - first of the slot
  part.positions = nullptr;
  copy_rows<Scatter>(part, begin, end);
}

}  // namespace

void gather_staged(const rows_call& c, int threads, shared_cuda::stream_view stream) {
  check_args(c);
  SHARED_CUDA_EXPECT(c.positions == nullptr, "the staged strategy writes rows in index order (no positions)");
  SHARED_CUDA_EXPECT(static_cast<std::size_t>(c.row_bytes) <= staging::kSlotBytes,
                     "rows wider than 4 MiB are not supported by the staged strategy: use 'vector' or 'sorted'");
  check_host_indices(c.index, c.index_bytes, c.count, c.rows, threads);
  if (c.count == 0) return;
  std::lock_guard<std::mutex> lock(staged_mutex());
  auto& st = staging_for_current_device();
  const auto s = static_cast<cudaStream_t>(stream.handle);
  pipeline pl(c, threads);
  pl.run([&] {
    std::int64_t free_through = -1;  // this worker has seen the slots of chunks <= free_through free
    std::int64_t k = 0, b = 0, e = 0;
    while (pl.take(k, b, e)) {
      const int slot = static_cast<int>(k % staging::kSlots);
      if (k > free_through) {
        // The slot's previous chunk (of this call, or of an earlier call for the first kSlots chunks): its copy
        // must be queued, so that the slot's event is the right one, and finished.
        if (k >= staging::kSlots && !pl.wait_for(pl.ready[k - staging::kSlots])) return;
        SHARED_CUDA_TRY(cudaEventSynchronize(st.events[slot]));
        free_through = k;
      }
      if (pl.abort.load(std::memory_order_relaxed)) return;
      const std::int64_t first = k * pl.rows_per_chunk;
      auto* staged = static_cast<unsigned char*>(st.slots[slot].data());
      move_block<false>(c, b, e, first, staged);
      if (pl.finish(k, e - b)) {
        SHARED_CUDA_TRY(cudaMemcpyAsync(static_cast<unsigned char*>(c.dense) + first * c.row_bytes, staged,
                                        static_cast<std::size_t>(pl.chunk_rows(k) * c.row_bytes),
                                        cudaMemcpyHostToDevice, s));
        SHARED_CUDA_TRY(cudaEventRecord(st.events[slot], s));
        pl.ready[k].store(true, std::memory_order_release);
      }
    }
  });
  pl.rethrow();
}

void scatter_staged(const rows_call& c, int threads, shared_cuda::stream_view stream) {
  check_args(c);
  SHARED_CUDA_EXPECT(c.positions == nullptr, "the staged strategy reads rows in index order (no positions)");
  SHARED_CUDA_EXPECT(static_cast<std::size_t>(c.row_bytes) <= staging::kSlotBytes,
                     "rows wider than 4 MiB are not supported by the staged strategy: use 'vector' or 'sorted'");
  // Writes: nothing reaches the table when an index is bad.
  check_host_indices(c.index, c.index_bytes, c.count, c.rows, threads);
  if (c.count == 0) return;
  std::lock_guard<std::mutex> lock(staged_mutex());
  auto& st = staging_for_current_device();
  const auto s = static_cast<cudaStream_t>(stream.handle);
  pipeline pl(c, threads);
  auto queue = [&](std::int64_t k) {
    const std::int64_t first = k * pl.rows_per_chunk;
    const int slot = static_cast<int>(k % staging::kSlots);
    // An earlier call's copy out of this slot may still run (possibly on another stream): order after it.
    SHARED_CUDA_TRY(cudaStreamWaitEvent(s, st.events[slot], 0));
    SHARED_CUDA_TRY(cudaMemcpyAsync(st.slots[slot].data(), static_cast<unsigned char*>(c.dense) + first * c.row_bytes,
                                    static_cast<std::size_t>(pl.chunk_rows(k) * c.row_bytes), cudaMemcpyDeviceToHost,
                                    s));
    SHARED_CUDA_TRY(cudaEventRecord(st.events[slot], s));
    pl.ready[k].store(true, std::memory_order_release);
  };
  for (std::int64_t k = 0; k < std::min<std::int64_t>(pl.chunks, staging::kSlots); ++k) queue(k);
  pl.run([&] {
    std::int64_t arrived_through = -1;  // this worker has seen the rows of chunks <= arrived_through in their slots
    std::int64_t k = 0, b = 0, e = 0;
    while (pl.take(k, b, e)) {
      const int slot = static_cast<int>(k % staging::kSlots);
      if (k > arrived_through) {
        if (!pl.wait_for(pl.ready[k])) return;
        SHARED_CUDA_TRY(cudaEventSynchronize(st.events[slot]));  // the chunk's rows are in the slot
        arrived_through = k;
      }
      const std::int64_t first = k * pl.rows_per_chunk;
      move_block<true>(c, b, e, first, static_cast<unsigned char*>(st.slots[slot].data()));
      // The worker that finishes the slot's rows refills it with chunk k + kSlots.
      if (pl.finish(k, e - b) && k + staging::kSlots < pl.chunks) queue(k + staging::kSlots);
    }
  });
  if (pl.error) SHARED_CUDA_TRY(cudaStreamSynchronize(s));  // no copy may still write a slot the next call uses
  pl.rethrow();
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
