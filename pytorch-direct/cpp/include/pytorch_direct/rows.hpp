// Row gather and scatter between a host table (pinned or registered, mapped into the GPU) and dense row buffers.
//
// A "table" is `rows` rows of `row_bytes` bytes each, contiguous. Indices are int32 or int64 (index_bytes 4 or 8).
// Every entry point checks every index before any row is touched: host paths throw out_of_range naming the first
// bad index; device paths never read or write a row for a bad index and record it in the error word instead
// (error_word()), which the caller reads after the stream finishes (sync mode) or at its next call (async mode).
//
// No CUDA types here, so CPU-only builds include this header; CUDA entry points throw unavailable_error there.
#pragma once

#include <cstddef>
#include <cstdint>

#include "shared_cuda/stream.hpp"

namespace pytorch_direct {

// Device kernels for one gather/scatter call.
enum class kernel_kind : int {
  vector = 0,  // widest aligned loads (<= 16 B), 128-byte-aligned warp windows, several rows per warp for small rows
  naive = 1,   // one warp per row, 4-byte loads (bytes where rows are not 4-byte aligned): the benchmark's baseline
};

struct rows_call {
  void* table = nullptr;  // host table; kernels use it directly (host pointer == device pointer under UVA)
  std::int64_t rows = 0;
  std::int64_t row_bytes = 0;
  const void* index = nullptr;  // device memory for *_cuda, host memory for *_host and gather_staged
  int index_bytes = 8;
  std::int64_t count = 0;
  // Optional int64 slot per index: row i goes to/from dense row positions[i] instead of row i (sorted strategy).
  const std::int64_t* positions = nullptr;
  void* dense = nullptr;  // count rows of row_bytes: the gather output or the scatter source
  // Optional device memory holding how many of the `count` indices to move (at most count): a count that an earlier
  // kernel computed (e.g. the distinct rows of a deduplicating gather) with no host round trip. Gather only.
  const std::int64_t* device_count = nullptr;
  // A GPU cache of hot rows (gather_cached_cuda): the cache slot of each table row (-1: not cached), and the cached
  // rows (device memory, row_bytes each, 16 bytes of slack after the last).
  const std::int32_t* slot_of_row = nullptr;
  void* cache = nullptr;
};

// True when this build has the CUDA kernels.
bool kernels_compiled() noexcept;

// Device-side error word: two int64 in mapped pinned memory, {bad index count flag, one bad index}. Created on
// first use (needs CUDA); stays for the life of the process.
std::int64_t* error_word();
// Reads and clears the word. Returns true and sets `bad` when a kernel saw a bad index since the last call.
bool take_device_error(std::int64_t& bad);

// Smallest and largest of `count` (> 0) device indices, for the sync-mode bounds check: one kernel on `stream`
// (after the work queued there), then the host waits for that stream and reads the pair from mapped pinned memory.
// Scratch buffers are per calling thread and device, so threads may check on their own streams at once.
void index_bounds_cuda(const void* index, int index_bytes, std::int64_t count, shared_cuda::stream_view stream,
                       std::int64_t& lo, std::int64_t& hi);
// The same in two halves, so that more work can be queued on the stream in between (the gather itself: the GPU then
// never waits for the host's round trip): start queues the kernel and an event after it; finish waits for that
// event only and reads the pair. One start at a time per calling thread and device, each followed by its finish.
void index_bounds_start(const void* index, int index_bytes, std::int64_t count, shared_cuda::stream_view stream);
void index_bounds_finish(std::int64_t& lo, std::int64_t& hi);

// Gather: dense[p] = table[index[i]] with p = positions ? positions[i] : i, for i < count (and < *device_count when
// set). Launched on `stream`, no host sync.
// max_sms > 0 caps the blocks so the gather occupies about that many SMs (to overlap with other work).
void gather_cuda(const rows_call& call, kernel_kind kind, int max_sms, shared_cuda::stream_view stream);
// Gather through a GPU cache of hot rows (call.slot_of_row, call.cache): dense[p] = the cached copy of row
// index[i] where it has one, else the table's row, in one kernel. With `refresh`, after writes to the table: the
// cached copy of each cached row index[i] is read again from the table (dense unused; rows not cached skipped).
void gather_cached_cuda(const rows_call& call, bool refresh, int max_sms, shared_cuda::stream_view stream);
// Scatter: table[index[i]] = dense[p]. Duplicate indices: one of the writers wins per element.
void scatter_cuda(const rows_call& call, kernel_kind kind, int max_sms, shared_cuda::stream_view stream);

// Host gather/scatter with the process's worker threads (threads <= 0: all of them). Index and dense on the host.
// How long an idle worker thread polls for the next call's work before it sleeps, in microseconds (0: at once);
// see shared_cuda::thread_pool::set_spin. Applies to this process's pool, and to a forked child's new one.
void set_host_spin_us(std::int64_t microseconds);
void gather_host(const rows_call& call, int threads);
void scatter_host(const rows_call& call, int threads);

// CPU gather into pinned staging buffers, each chunk copied to `dense` (device memory) with cudaMemcpyAsync on
// `stream` while the CPU gathers the next chunk. Returns once every copy has been queued; the staging buffers are
// reused by the next call only after its copies finished (events), so callers need no sync. The index is in host
// memory, or with index_on_device in device memory: then it is copied to the host on `stream` (after the work
// queued there) in growing groups of chunks, and each chunk is gathered as soon as its indices have arrived.
void gather_staged(const rows_call& call, int threads, shared_cuda::stream_view stream, bool index_on_device = false);
// Scatter counterpart: chunks of `dense` (device) copied into staging, then written to the table by the CPU.
// Synchronises with the copies (the CPU must see the data), so it returns when the table holds the rows.
void scatter_staged(const rows_call& call, int threads, shared_cuda::stream_view stream);

// Throws out_of_range unless every host index is in [0, rows). Parallel for large counts.
void check_host_indices(const void* index, int index_bytes, std::int64_t count, std::int64_t rows, int threads);

// Live host ranges this package allocated or registered for the GPU, and of which kind, so a call can check its
// table with no CUDA call (cheap, and allowed inside CUDA graph capture). Owners add their range when created and
// remove it before freeing it.
enum class host_kind : int { none = 0, pinned = 1, managed = 2 };  // pinned: cudaHostAlloc or registered
void track_host_range(const void* data, std::size_t bytes, host_kind kind);
void untrack_host_range(const void* data) noexcept;
// The kind of the tracked range [data, data + bytes) lies inside; none when it is not inside one.
host_kind tracked_host_kind(const void* data, std::size_t bytes);

// Whether the memory [data, data + bytes) is page-locked host memory the device can read (pinned or registered).
bool is_device_accessible_host(const void* data, std::size_t bytes);

}  // namespace pytorch_direct
