// Host-side row movement: the multithreaded CPU gather/scatter, index checks, and the CPU-gather + pipelined
// DMA strategy ("staged"). Also the CPU-only stand-ins for the CUDA entry points.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
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

// How long idle pool threads poll for work (set_host_spin_us), applied to the pool whenever it is fetched.
std::atomic<std::int64_t> host_spin_us{0};

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
  current->set_spin(std::chrono::microseconds(host_spin_us.load(std::memory_order_relaxed)));
  return *current;
}

std::int64_t index_at(const void* index, int index_bytes, std::int64_t i) {
  return index_bytes == 8 ? static_cast<const std::int64_t*>(index)[i]
                          : static_cast<std::int64_t>(static_cast<const std::int32_t*>(index)[i]);
}

// Runs body(begin, end) over [0, count) in chunks of `grain` on up to `threads` threads (<= 0: the whole pool),
// the calling thread included; threads claim chunks as they get to them (see thread_pool::parallel_for).
void parallel(std::int64_t count, std::int64_t grain, int threads,
              const std::function<void(std::int64_t, std::int64_t)>& body) {
  if (count <= 0) return;
  auto& p = pool();
  if (threads == 1 || p.size() <= 1 || count <= grain) {
    body(0, count);
    return;
  }
  p.parallel_for(
      0, static_cast<std::size_t>(count), static_cast<std::size_t>(grain),
      [&](std::size_t b, std::size_t e) { body(static_cast<std::int64_t>(b), static_cast<std::int64_t>(e)); },
      threads > 0 ? static_cast<std::size_t>(threads) : 0);
}

void check_args(const rows_call& c) {
  SHARED_CUDA_EXPECT(c.index_bytes == 4 || c.index_bytes == 8, "index must be int32 or int64");
  SHARED_CUDA_EXPECT(c.device_count == nullptr, "a device-side count is for CUDA gathers only");
  SHARED_CUDA_EXPECT(c.row_bytes > 0 && c.rows >= 0 && c.count >= 0, "rows, row_bytes and count must be >= 0");
  SHARED_CUDA_EXPECT(c.count == 0 || (c.table != nullptr && c.index != nullptr && c.dense != nullptr),
                     "null table, index or dense pointer");
}

// Rows per claimed chunk: about 64 KiB of copying, enough to amortise claiming one (an atomic increment) and small
// enough that a thread starting late leaves no long tail.
std::int64_t grain_for(std::int64_t row_bytes) { return std::max<std::int64_t>(1, (64 << 10) / row_bytes); }

// Rows [begin, end) of a call whose indices were checked: index width and direction are template parameters, so
// the loop has no per-row branch but the optional positions; rows 8 ahead are prefetched (random rows miss the
// cache and the TLB, and a core overlaps only the misses it knows about).
template <typename Index, bool Scatter>
void copy_rows_as(const rows_call& c, std::int64_t begin, std::int64_t end) {
  const auto* index = static_cast<const Index*>(c.index);
  auto* table = static_cast<unsigned char*>(c.table);
  auto* dense = static_cast<unsigned char*>(c.dense);
  const auto rb = static_cast<std::size_t>(c.row_bytes);
  constexpr std::int64_t kAhead = 8;
  for (std::int64_t i = begin; i < end; ++i) {
    if (i + kAhead < end) __builtin_prefetch(table + static_cast<std::int64_t>(index[i + kAhead]) * c.row_bytes);
    unsigned char* row = table + static_cast<std::int64_t>(index[i]) * c.row_bytes;
    unsigned char* out = dense + (c.positions != nullptr ? c.positions[i] : i) * c.row_bytes;
    if (Scatter) {
      std::memcpy(row, out, rb);
    } else {
      std::memcpy(out, row, rb);
    }
  }
}

void copy_rows(const rows_call& c, bool scatter, std::int64_t begin, std::int64_t end) {
  if (c.index_bytes == 8) {
    scatter ? copy_rows_as<std::int64_t, true>(c, begin, end) : copy_rows_as<std::int64_t, false>(c, begin, end);
  } else {
    scatter ? copy_rows_as<std::int32_t, true>(c, begin, end) : copy_rows_as<std::int32_t, false>(c, begin, end);
  }
}

}  // namespace

namespace {
struct tracked_ranges {
  std::mutex mutex;
  std::map<std::uintptr_t, std::pair<std::size_t, host_kind>> ranges;  // start -> (bytes, kind)
};
tracked_ranges& tracked() {
  static tracked_ranges* t = new tracked_ranges();  // never destroyed: owners may untrack during shutdown
  return *t;
}
}  // namespace

void track_host_range(const void* data, std::size_t bytes, host_kind kind) {
  auto& t = tracked();
  std::lock_guard<std::mutex> lock(t.mutex);
  t.ranges[reinterpret_cast<std::uintptr_t>(data)] = {bytes, kind};
}

void untrack_host_range(const void* data) noexcept {
  auto& t = tracked();
  std::lock_guard<std::mutex> lock(t.mutex);
  t.ranges.erase(reinterpret_cast<std::uintptr_t>(data));
}

host_kind tracked_host_kind(const void* data, std::size_t bytes) {
  const auto begin = reinterpret_cast<std::uintptr_t>(data);
  auto& t = tracked();
  std::lock_guard<std::mutex> lock(t.mutex);
  auto it = t.ranges.upper_bound(begin);
  if (it == t.ranges.begin()) return host_kind::none;
  --it;  // the last range starting at or before `begin`
  return begin + bytes <= it->first + it->second.first ? it->second.second : host_kind::none;
}

void set_host_spin_us(std::int64_t microseconds) {
  SHARED_CUDA_EXPECT(microseconds >= 0, "the host threads' spin time must be >= 0 microseconds");
  host_spin_us.store(microseconds, std::memory_order_relaxed);
  pool();  // applies it now to this process's pool (created here if needed)
}

void check_host_indices(const void* index, int index_bytes, std::int64_t count, std::int64_t rows, int threads) {
  SHARED_CUDA_EXPECT(index_bytes == 4 || index_bytes == 8, "index must be int32 or int64");
  std::mutex mutex;
  std::int64_t first_bad_position = -1;
  std::int64_t first_bad = 0;
  parallel(count, 1 << 14, threads, [&](std::int64_t b, std::int64_t e) {
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
           [&](std::int64_t b, std::int64_t e) { copy_rows(c, false, b, e); });
}

void scatter_host(const rows_call& c, int threads) {
  check_args(c);
  check_host_indices(c.index, c.index_bytes, c.count, c.rows, threads);
  parallel(c.count, grain_for(c.row_bytes), threads, [&](std::int64_t b, std::int64_t e) { copy_rows(c, true, b, e); });
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
  // Indices copied from the device (gather_staged with index_on_device): the buffer grows to the largest call, and
  // index_events[g] marks the end of copy group g (groups of 1, 1, 2, 4, ... chunks).
  shared_cuda::pinned_buffer index_buffer;
  std::vector<cudaEvent_t> index_events;

  // At least `bytes` of the index buffer (its contents are dead between calls).
  void* index_space(std::size_t bytes) {
    if (index_buffer.size() < bytes) {
      index_buffer = shared_cuda::pinned_buffer();  // free the old one first: the new one may be large
      index_buffer = shared_cuda::pinned_buffer(std::max<std::size_t>(bytes, 1 << 20));
    }
    return index_buffer.data();
  }

  cudaEvent_t index_event(std::size_t group) {
    while (index_events.size() <= group) {
      cudaEvent_t e = nullptr;
      SHARED_CUDA_TRY(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      index_events.push_back(e);
    }
    return index_events[group];
  }
};

// Copy group of chunk k when the indices come from the device: groups of 1, 1, 2, 4, 8, ... chunks, so the first
// chunk's indices arrive after one small copy and the number of copies grows with the log of the call's size.
std::int64_t index_group(std::int64_t k) {
  std::int64_t g = 0;
  for (std::int64_t first = 1, size = 1; k >= first; first += size, size *= 2) ++g;
  return g;
}
// First chunk of copy group g (the inverse of index_group).
std::int64_t index_group_start(std::int64_t g) { return g == 0 ? 0 : (std::int64_t{1} << (g - 1)); }

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
// pieces of ~32 KiB that the runners (the caller and pool threads) claim in ascending order; the runner finishing
// a chunk's last piece queues its copy. Claiming, not a fixed share per thread, so a thread that wakes late on a
// busy or virtual machine delays only the piece it took, not every chunk.
struct pipeline {
  static constexpr std::int64_t kPieceBytes = 32 << 10;

  pipeline(const rows_call& call, int threads) : c(call), max_threads(threads > 0 ? threads : 0) {
    rows_per_chunk = std::max<std::int64_t>(
        1, static_cast<std::int64_t>(std::max<std::size_t>(staging::kChunkBytes, c.row_bytes)) / c.row_bytes);
    chunks = (c.count + rows_per_chunk - 1) / rows_per_chunk;
    rows_per_piece = std::clamp<std::int64_t>(kPieceBytes / c.row_bytes, 1, rows_per_chunk);
    pieces_per_chunk = (rows_per_chunk + rows_per_piece - 1) / rows_per_piece;
    done.reset(new std::atomic<std::int64_t>[chunks]);
    ready.reset(new std::atomic<bool>[chunks]);
    slot_state.reset(new std::atomic<int>[chunks]);
    index_state.reset(new std::atomic<int>[chunks]);
    for (std::int64_t k = 0; k < chunks; ++k) {
      done[k].store(0, std::memory_order_relaxed);
      ready[k].store(false, std::memory_order_relaxed);
      slot_state[k].store(0, std::memory_order_relaxed);
      index_state[k].store(0, std::memory_order_relaxed);
    }
  }

  // Rows [begin, end) of piece p, which belongs to chunk p / pieces_per_chunk (the last chunk's last pieces may
  // be empty).
  std::pair<std::int64_t, std::int64_t> piece(std::int64_t p) const {
    const std::int64_t k = p / pieces_per_chunk;
    const std::int64_t chunk_end = std::min(c.count, (k + 1) * rows_per_chunk);
    const std::int64_t b = std::min(chunk_end, k * rows_per_chunk + (p % pieces_per_chunk) * rows_per_piece);
    return {b, std::min(chunk_end, b + rows_per_piece)};
  }

  // True when piece p completes its chunk (every piece of a chunk calls it once, after its rows are moved).
  bool finish_piece(std::int64_t k) { return done[k].fetch_add(1, std::memory_order_acq_rel) + 1 == pieces_per_chunk; }

  // Spins (yielding) until flag is set; false when another runner failed.
  bool wait_for(const std::atomic<bool>& flag) const {
    while (!flag.load(std::memory_order_acquire)) {
      if (abort.load(std::memory_order_relaxed)) return false;
      std::this_thread::yield();
    }
    return true;
  }

  // Waits until `event` has completed, once per `state` (0 not checked, 1 being synchronised, 2 done): the first
  // runner to get here synchronises, the others wait for it. False when another runner failed.
  bool wait_once(std::atomic<int>& state, cudaEvent_t event) {
    int expected = 0;
    if (state.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) {
      SHARED_CUDA_TRY(cudaEventSynchronize(event));
      state.store(2, std::memory_order_release);
      return true;
    }
    while (state.load(std::memory_order_acquire) != 2) {
      if (abort.load(std::memory_order_relaxed)) return false;
      std::this_thread::yield();
    }
    return true;
  }

  // Chunk k's slot is free of its last copy (`event`).
  bool wait_slot(std::int64_t k, cudaEvent_t event) { return wait_once(slot_state[k], event); }

  void fail(std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(error_mutex);
    if (!error) error = e;
    abort.store(true);
  }

  void bad_index(std::int64_t position, std::int64_t value) {
    bad.store(true, std::memory_order_relaxed);
    std::lock_guard<std::mutex> lock(error_mutex);
    if (bad_position < 0 || position < bad_position) {
      bad_position = position;
      bad_value = value;
    }
  }

  void rethrow() const {
    if (error) std::rethrow_exception(error);
    if (bad_position >= 0) {
      throw shared_cuda::out_of_range("index " + std::to_string(bad_value) + " at position " +
                                      std::to_string(bad_position) + " is out of range for a table of " +
                                      std::to_string(c.rows) + " rows (valid: 0.." + std::to_string(c.rows - 1) + ")");
    }
  }

  // Runs body(p) for every piece p, in ascending order of claiming, on the caller and the pool. Deadlock-free: a
  // piece waits only for chunks before its own, whose pieces were all claimed earlier by running threads.
  void run(const std::function<void(std::int64_t)>& body) {
    pool().parallel_for(
        0, static_cast<std::size_t>(chunks * pieces_per_chunk), 1,
        [&](std::size_t b, std::size_t e) {
          for (std::size_t p = b; p < e; ++p) {
            if (abort.load(std::memory_order_relaxed)) return;
            try {
              body(static_cast<std::int64_t>(p));
            } catch (...) {
              fail(std::current_exception());
            }
          }
        },
        max_threads);
  }

  const rows_call& c;
  std::size_t max_threads = 0;
  std::int64_t rows_per_chunk = 1;
  std::int64_t chunks = 0;
  std::int64_t rows_per_piece = 1;
  std::int64_t pieces_per_chunk = 1;
  std::unique_ptr<std::atomic<std::int64_t>[]> done;  // pieces of chunk k finished
  std::unique_ptr<std::atomic<bool>[]> ready;         // chunk k's copy is queued (its slot's event is recorded)
  std::unique_ptr<std::atomic<int>[]> slot_state;     // chunk k's slot: 0 not checked, 1 being synchronised, 2 free
  std::unique_ptr<std::atomic<int>[]> index_state;    // copy group k's indices (device indices): as slot_state
  std::atomic<bool> abort{false};
  std::atomic<bool> bad{false};  // an index was out of range
  std::mutex error_mutex;
  std::exception_ptr error;
  std::int64_t bad_position = -1;
  std::int64_t bad_value = 0;
};

// Copies rows [begin, end) between the table and `staged` (row p - first of the slot), checking each index.
// Returns false when an index is out of range (recorded; the row is not touched).
template <typename Index, bool Scatter>
bool move_slice_as(const rows_call& c, pipeline& pl, std::int64_t begin, std::int64_t end, std::int64_t first,
                   unsigned char* staged) {
  const auto* index = static_cast<const Index*>(c.index);
  auto* table = static_cast<unsigned char*>(c.table);
  const auto rb = static_cast<std::size_t>(c.row_bytes);
  constexpr std::int64_t kAhead = 8;  // rows prefetched ahead: random rows miss cache and TLB, so overlap them
  for (std::int64_t i = begin; i < end; ++i) {
    if (i + kAhead < end) {
      const auto ahead = static_cast<std::int64_t>(index[i + kAhead]);
      if (ahead >= 0 && ahead < c.rows) __builtin_prefetch(table + ahead * c.row_bytes, Scatter ? 1 : 0);
    }
    const auto r = static_cast<std::int64_t>(index[i]);
    if (r < 0 || r >= c.rows) {
      pl.bad_index(i, r);
      return false;
    }
    unsigned char* row = table + r * c.row_bytes;
    unsigned char* slot_row = staged + (i - first) * c.row_bytes;
    if (Scatter) {
      std::memcpy(row, slot_row, rb);
    } else {
      std::memcpy(slot_row, row, rb);
    }
  }
  return true;
}

template <bool Scatter>
bool move_slice(const rows_call& c, pipeline& pl, std::int64_t begin, std::int64_t end, std::int64_t first,
                unsigned char* staged) {
  return c.index_bytes == 8 ? move_slice_as<std::int64_t, Scatter>(c, pl, begin, end, first, staged)
                            : move_slice_as<std::int32_t, Scatter>(c, pl, begin, end, first, staged);
}

}  // namespace

void gather_staged(const rows_call& call, int threads, shared_cuda::stream_view stream, bool index_on_device) {
  check_args(call);
  SHARED_CUDA_EXPECT(call.positions == nullptr, "the staged strategy writes rows in index order (no positions)");
  SHARED_CUDA_EXPECT(static_cast<std::size_t>(call.row_bytes) <= staging::kSlotBytes,
                     "rows wider than 4 MiB are not supported by the staged strategy: use 'vector' or 'sorted'");
  if (call.count == 0) return;
  std::lock_guard<std::mutex> lock(staged_mutex());
  auto& st = staging_for_current_device();
  const auto s = static_cast<cudaStream_t>(stream.handle);
  rows_call c = call;
  pipeline pl(c, threads);
  if (index_on_device) {
    // The indices come over in copy groups of 1, 1, 2, 4, ... chunks, queued on `stream` (after whatever made
    // them); a chunk's rows are gathered as soon as its group has arrived, while the next groups still travel.
    const auto ib = static_cast<std::size_t>(c.index_bytes);
    void* host = st.index_space(static_cast<std::size_t>(c.count) * ib);
    const std::int64_t groups = index_group(pl.chunks - 1) + 1;
    for (std::int64_t g = 0; g < groups; ++g) {
      const std::int64_t first = index_group_start(g) * pl.rows_per_chunk;
      const std::int64_t end = std::min(c.count, index_group_start(g + 1) * pl.rows_per_chunk);
      SHARED_CUDA_TRY(cudaMemcpyAsync(static_cast<unsigned char*>(host) + first * ib,
                                      static_cast<const unsigned char*>(c.index) + first * ib,
                                      static_cast<std::size_t>(end - first) * ib, cudaMemcpyDeviceToHost, s));
      SHARED_CUDA_TRY(cudaEventRecord(st.index_event(static_cast<std::size_t>(g)), s));
    }
    c.index = host;
  }
  pl.run([&](std::int64_t p) {
    const std::int64_t k = p / pl.pieces_per_chunk;
    const int slot = static_cast<int>(k % staging::kSlots);
    if (index_on_device) {
      const std::int64_t g = index_group(k);
      if (!pl.wait_once(pl.index_state[g], st.index_events[static_cast<std::size_t>(g)])) return;
    }
    // The slot's previous chunk (of this call, or of an earlier call for the first kSlots chunks): its copy must
    // be queued, so that the slot's event is the right one, and finished.
    if (k >= staging::kSlots && !pl.wait_for(pl.ready[k - staging::kSlots])) return;
    if (!pl.wait_slot(k, st.events[slot])) return;
    const std::int64_t first = k * pl.rows_per_chunk;
    const auto [b, e] = pl.piece(p);
    auto* staged = static_cast<unsigned char*>(st.slots[slot].data());
    // A bad index: keep going through the chunk protocol (others wait on it) but copy nothing more.
    if (!pl.bad.load(std::memory_order_relaxed)) move_slice<false>(c, pl, b, e, first, staged);
    if (pl.finish_piece(k)) {
      const std::int64_t end = std::min(c.count, first + pl.rows_per_chunk);
      SHARED_CUDA_TRY(cudaMemcpyAsync(static_cast<unsigned char*>(c.dense) + first * c.row_bytes, staged,
                                      static_cast<std::size_t>((end - first) * c.row_bytes), cudaMemcpyHostToDevice,
                                      s));
      SHARED_CUDA_TRY(cudaEventRecord(st.events[slot], s));
      pl.ready[k].store(true, std::memory_order_release);
    }
  });
  // A failed call may leave index copies running into the buffer the next call reuses: let them finish.
  if (pl.error && index_on_device) SHARED_CUDA_TRY(cudaStreamSynchronize(s));
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
    const std::int64_t end = std::min(c.count, first + pl.rows_per_chunk);
    const int slot = static_cast<int>(k % staging::kSlots);
    // An earlier call's copy out of this slot may still run (possibly on another stream): order after it.
    SHARED_CUDA_TRY(cudaStreamWaitEvent(s, st.events[slot], 0));
    SHARED_CUDA_TRY(cudaMemcpyAsync(st.slots[slot].data(), static_cast<unsigned char*>(c.dense) + first * c.row_bytes,
                                    static_cast<std::size_t>((end - first) * c.row_bytes), cudaMemcpyDeviceToHost, s));
    SHARED_CUDA_TRY(cudaEventRecord(st.events[slot], s));
    pl.ready[k].store(true, std::memory_order_release);
  };
  for (std::int64_t k = 0; k < std::min<std::int64_t>(pl.chunks, staging::kSlots); ++k) queue(k);
  pl.run([&](std::int64_t p) {
    const std::int64_t k = p / pl.pieces_per_chunk;
    const int slot = static_cast<int>(k % staging::kSlots);
    if (!pl.wait_for(pl.ready[k])) return;
    if (!pl.wait_slot(k, st.events[slot])) return;  // the chunk's rows are in the slot
    const auto [b, e] = pl.piece(p);
    move_slice<true>(c, pl, b, e, k * pl.rows_per_chunk, static_cast<unsigned char*>(st.slots[slot].data()));
    // The runner finishing the chunk refills its slot with chunk k + kSlots.
    if (pl.finish_piece(k) && k + staging::kSlots < pl.chunks) queue(k + staging::kSlots);
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
void gather_cached_cuda(const rows_call&, bool, int, shared_cuda::stream_view) {
  throw shared_cuda::unavailable_error("pytorch_direct was built without CUDA: reinstall with nvcc on PATH");
}
void scatter_cuda(const rows_call&, kernel_kind, int, shared_cuda::stream_view) {
  throw shared_cuda::unavailable_error("pytorch_direct was built without CUDA: reinstall with nvcc on PATH");
}
void index_bounds_cuda(const void*, int, std::int64_t, shared_cuda::stream_view, std::int64_t&, std::int64_t&) {
  throw shared_cuda::unavailable_error("pytorch_direct was built without CUDA: reinstall with nvcc on PATH");
}
void index_bounds_start(const void*, int, std::int64_t, shared_cuda::stream_view) {
  throw shared_cuda::unavailable_error("pytorch_direct was built without CUDA: reinstall with nvcc on PATH");
}
void index_bounds_finish(std::int64_t&, std::int64_t&) {
  throw shared_cuda::unavailable_error("pytorch_direct was built without CUDA: reinstall with nvcc on PATH");
}
void gather_staged(const rows_call&, int, shared_cuda::stream_view, bool) {
  throw shared_cuda::unavailable_error("pytorch_direct was built without CUDA: reinstall with nvcc on PATH");
}
void scatter_staged(const rows_call&, int, shared_cuda::stream_view) {
  throw shared_cuda::unavailable_error("pytorch_direct was built without CUDA: reinstall with nvcc on PATH");
}
bool is_device_accessible_host(const void*, std::size_t) { return false; }

#endif

}  // namespace pytorch_direct
