// Runs the CUDA row kernels on the CPU: every thread of a grid, one after another, with stand-ins for the CUDA
// built-ins. The kernels use no shared memory and no barriers, so serial execution computes what the GPU computes,
// and this checks their index math (lane groups, 128-byte windows, unaligned words, 64-bit offsets, bad indices)
// on machines without a GPU. Built and run by tests/test_kernels_emulated.py.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

struct uint4 {
  unsigned x, y, z, w;
};
struct uint2 {
  unsigned x, y;
};
struct dim3_emulated {
  unsigned x = 1, y = 1, z = 1;
};
static dim3_emulated threadIdx, blockIdx, blockDim, gridDim;
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__
inline void __threadfence_system() {}
static long long misaligned = 0;
#define PD_CHECK_ALIGNED(pointer, bytes)                                        \
  do {                                                                          \
    if (reinterpret_cast<std::uintptr_t>(pointer) % (bytes) != 0) ++misaligned; \
  } while (0)

#include "../../cpp/src/rows_kernels.cuh"

using namespace pytorch_direct;
using namespace pytorch_direct::kernels;

namespace {

int failures = 0;

template <typename F>
void run_grid(unsigned grid, unsigned block, F&& kernel) {
  gridDim.x = grid;
  blockDim.x = block;
  for (unsigned b = 0; b < grid; ++b) {
    blockIdx.x = b;
    for (unsigned t = 0; t < block; ++t) {
      threadIdx.x = t;
      kernel();
    }
  }
}

long long bad_shapes = 0;

// The shape rows_cuda.cu launches this plan with on a GPU (132 SMs, with and without an SM cap), for this call's
// count and for huge counts, must be launchable: the emulated grid below is smaller, so check the real one here.
void check_gpu_shapes(const rows_call& c, const launch_plan& p) {
  for (const std::int64_t count : {c.count, static_cast<std::int64_t>(1) << 31, static_cast<std::int64_t>(1) << 40}) {
    for (const int max_sms : {0, 1, 7, 132, 100000}) {
      const launch_shape shape = shape_for(p, count, max_sms, 132, 1 + static_cast<int>(count % 4));
      const char* problem = launch_shape_problem(shape);
      if (problem[0] != '\0') {
        if (bad_shapes++ < 10)
          std::printf("FAIL launch shape: %s (row_bytes=%lld count=%lld max_sms=%d grid=%u block=%u)\n", problem,
                      static_cast<long long>(c.row_bytes), static_cast<long long>(count), max_sms, shape.grid_x,
                      shape.block);
      }
    }
  }
}

// Dispatches like rows_cuda.cu's launch<Scatter>(), on a small grid so grid-stride loops wrap.
template <bool Scatter>
void emulate(const rows_call& c, const launch_plan& p, unsigned grid, std::int64_t* err) {
  check_gpu_shapes(c, p);
  auto* table = static_cast<unsigned char*>(c.table);
  auto* dense = static_cast<unsigned char*>(c.dense);
  const unsigned block = 64;  // smaller than the GPU's 512: more blocks, same per-thread logic
  if (p.kernel == launch_plan::unaligned) {
    run_grid(grid, block, [&] {
      gather_rows_unaligned(table, c.rows, c.row_bytes, c.index, c.index_bytes, c.count, c.device_count, c.positions,
                            dense, err, p.group_shift);
    });
  } else if (p.kernel == launch_plan::naive) {
    run_grid(grid, block, [&] {
      if constexpr (Scatter) {
        if (p.width == 4) {
          scatter_rows_naive<4>(table, c.rows, p.row_words, c.index, c.index_bytes, c.count, c.device_count,
                                c.positions, dense, err);
        } else {
          scatter_rows_naive<1>(table, c.rows, p.row_words, c.index, c.index_bytes, c.count, c.device_count,
                                c.positions, dense, err);
        }
      } else {
        if (p.width == 4) {
          gather_rows_naive<4>(table, c.rows, p.row_words, c.index, c.index_bytes, c.count, c.device_count, c.positions,
                               dense, err);
        } else {
          gather_rows_naive<1>(table, c.rows, p.row_words, c.index, c.index_bytes, c.count, c.device_count, c.positions,
                               dense, err);
        }
      }
    });
  } else {
    run_grid(grid, block, [&] {
      switch (p.width) {
        case 16:
          (p.short_rows ? move_rows<16, Scatter, true>
                        : move_rows<16, Scatter>)(table, c.rows, p.row_words, c.index, c.index_bytes, c.count,
                                                  c.device_count, c.positions, dense, err, p.group_shift);
          break;
        case 8:
          (p.short_rows ? move_rows<8, Scatter, true> : move_rows<8, Scatter>)(table, c.rows, p.row_words, c.index,
                                                                               c.index_bytes, c.count, c.device_count,
                                                                               c.positions, dense, err, p.group_shift);
          break;
        case 4:
          (p.short_rows ? move_rows<4, Scatter, true> : move_rows<4, Scatter>)(table, c.rows, p.row_words, c.index,
                                                                               c.index_bytes, c.count, c.device_count,
                                                                               c.positions, dense, err, p.group_shift);
          break;
        case 2:
          (p.short_rows ? move_rows<2, Scatter, true> : move_rows<2, Scatter>)(table, c.rows, p.row_words, c.index,
                                                                               c.index_bytes, c.count, c.device_count,
                                                                               c.positions, dense, err, p.group_shift);
          break;
        default:
          (p.short_rows ? move_rows<1, Scatter, true> : move_rows<1, Scatter>)(table, c.rows, p.row_words, c.index,
                                                                               c.index_bytes, c.count, c.device_count,
                                                                               c.positions, dense, err, p.group_shift);
          break;
      }
    });
  }
}

void check(bool ok, const char* what, std::int64_t rb, int offset, int kind, int sorted, int index_bytes) {
  if (!ok) {
    ++failures;
    if (failures < 20)
      std::printf("FAIL %s: row_bytes=%lld offset=%d kind=%d positions=%d index_bytes=%d\n", what,
                  static_cast<long long>(rb), offset, kind, sorted, index_bytes);
  }
}

// One gather and one scatter case against a byte-by-byte reference; poisoned outputs; guard bytes around the
// table (page-granular in reality; here 64 bytes of slack on each side, which the unaligned kernel may read).
void run_case(std::mt19937_64& rng, std::int64_t rows, std::int64_t rb, int table_offset, int dense_offset,
              kernel_kind kind, bool use_positions, int index_bytes, std::int64_t count, unsigned grid) {
  const std::size_t slack = 64;
  std::vector<unsigned char> table_mem(rows * rb + 2 * slack + 16);
  for (auto& b : table_mem) b = static_cast<unsigned char>(rng());
  // Keep the slack 16-byte aligned relative to the allocation, then shift the table by table_offset.
  unsigned char* base = table_mem.data();
  base += (16 - reinterpret_cast<std::uintptr_t>(base) % 16) % 16;
  unsigned char* table = base + slack + table_offset;
  const std::vector<unsigned char> original(table, table + rows * rb);

  std::vector<std::int64_t> idx64(count);
  for (auto& i : idx64) i = static_cast<std::int64_t>(rng() % rows);
  std::vector<std::int32_t> idx32(idx64.begin(), idx64.end());
  std::vector<std::int64_t> positions(count);
  for (std::int64_t i = 0; i < count; ++i) positions[i] = i;
  std::vector<std::int64_t> order = idx64;  // the index as passed: sorted, with positions, or as drawn
  if (use_positions) {
    std::vector<std::pair<std::int64_t, std::int64_t>> pairs;
    for (std::int64_t i = 0; i < count; ++i) pairs.emplace_back(idx64[i], i);
    std::sort(pairs.begin(), pairs.end());
    for (std::int64_t i = 0; i < count; ++i) {
      order[i] = pairs[i].first;
      positions[i] = pairs[i].second;
    }
  }
  std::vector<std::int32_t> order32(order.begin(), order.end());

  std::vector<unsigned char> dense_mem(count * rb + 32, 0xAB);
  unsigned char* dbase = dense_mem.data();
  dbase += (16 - reinterpret_cast<std::uintptr_t>(dbase) % 16) % 16;
  unsigned char* dense = dbase + dense_offset;

  rows_call c;
  c.table = table;
  c.rows = rows;
  c.row_bytes = rb;
  c.index = index_bytes == 8 ? static_cast<const void*>(order.data()) : static_cast<const void*>(order32.data());
  c.index_bytes = index_bytes;
  c.count = count;
  c.positions = use_positions ? positions.data() : nullptr;
  c.dense = dense;
  std::int64_t err[2] = {0, 0};

  emulate<false>(c, plan_gather(c, kind), grid, err);
  bool ok = err[0] == 0;
  for (std::int64_t i = 0; i < count && ok; ++i) ok = std::memcmp(dense + i * rb, table + idx64[i] * rb, rb) == 0;
  check(ok, "gather", rb, table_offset, static_cast<int>(kind), use_positions, index_bytes);
  check(dense_mem.back() == 0xAB || dense_offset + count * rb >= static_cast<std::int64_t>(dense_mem.size()) - 16,
        "gather wrote past the output", rb, table_offset, static_cast<int>(kind), use_positions, index_bytes);

  // Scatter unique rows (a defined result), then compare the whole table, guard bytes included.
  std::vector<std::int64_t> perm(rows);
  for (std::int64_t i = 0; i < rows; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  const std::int64_t n = std::min(count, rows);
  std::vector<std::int64_t> sidx(perm.begin(), perm.begin() + n);
  std::vector<std::int64_t> spos(n);
  for (std::int64_t i = 0; i < n; ++i) spos[i] = i;
  if (use_positions) {
    std::vector<std::pair<std::int64_t, std::int64_t>> pairs;
    for (std::int64_t i = 0; i < n; ++i) pairs.emplace_back(sidx[i], i);
    std::sort(pairs.begin(), pairs.end());
    for (std::int64_t i = 0; i < n; ++i) {
      sidx[i] = pairs[i].first;
      spos[i] = pairs[i].second;
    }
  }
  std::vector<std::int32_t> sidx32(sidx.begin(), sidx.end());
  std::vector<unsigned char> src(n * rb + 32);
  for (auto& b : src) b = static_cast<unsigned char>(rng());
  unsigned char* s = src.data();
  s += (16 - reinterpret_cast<std::uintptr_t>(s) % 16) % 16;
  s += dense_offset;
  const std::vector<unsigned char> before(table_mem);
  c.index = index_bytes == 8 ? static_cast<const void*>(sidx.data()) : static_cast<const void*>(sidx32.data());
  c.count = n;
  c.positions = use_positions ? spos.data() : nullptr;
  c.dense = s;
  emulate<true>(c, plan_scatter(c, kind), grid, err);
  std::vector<unsigned char> expect(before);
  const std::ptrdiff_t table_at = table - table_mem.data();
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t p = use_positions ? spos[i] : i;
    std::memcpy(expect.data() + table_at + sidx[i] * rb, s + p * rb, rb);
  }
  check(err[0] == 0 && expect == table_mem, "scatter", rb, table_offset, static_cast<int>(kind), use_positions,
        index_bytes);
  (void)original;
}

void bad_index_case() {
  std::vector<float> table(10 * 4, 1.0f), out(3 * 4, -7.0f);
  const std::int64_t idx[3] = {2, 10, -1};
  rows_call c;
  c.table = table.data();
  c.rows = 10;
  c.row_bytes = 16;
  c.index = idx;
  c.index_bytes = 8;
  c.count = 3;
  c.dense = out.data();
  for (kernel_kind kind : {kernel_kind::vector, kernel_kind::naive}) {
    std::int64_t err[2] = {0, 0};
    std::fill(out.begin(), out.end(), -7.0f);
    emulate<false>(c, plan_gather(c, kind), 2, err);
    bool ok = err[0] == 1 && (err[1] == 10 || err[1] == -1) && out[0] == 1.0f;
    for (int k = 4; k < 12; ++k) ok = ok && out[k] == -7.0f;  // bad rows untouched
    check(ok, "bad index (gather)", 16, 0, static_cast<int>(kind), 0, 8);
    err[0] = 0;
    const std::vector<float> before(table);
    emulate<true>(c, plan_scatter(c, kind), 2, err);
    bool changed_only_row2 = err[0] == 1;
    for (int r = 0; r < 10; ++r)
      for (int k = 0; k < 4; ++k)
        if (r != 2) changed_only_row2 = changed_only_row2 && table[r * 4 + k] == before[r * 4 + k];
    check(changed_only_row2, "bad index (scatter)", 16, 0, static_cast<int>(kind), 0, 8);
  }
}

// Offsets past 2^31 bytes with int32 indices: the kernels must widen before multiplying. Uses a sparse mapping of
// 3 GiB reserved but touched only at the rows read.
void large_offset_case() {
  const std::int64_t rb = 64;
  const std::int64_t rows = (std::int64_t{3} << 30) / rb;
  std::vector<unsigned char>* none = nullptr;
  (void)none;
  auto* table = static_cast<unsigned char*>(std::calloc(static_cast<std::size_t>(rows * rb), 1));
  if (table == nullptr) return;  // no address space: skip
  const std::int32_t idx[2] = {static_cast<std::int32_t>(rows - 1),
                               static_cast<std::int32_t>((std::int64_t{1} << 31) / rb + 3)};
  for (int k = 0; k < 2; ++k)
    for (int b = 0; b < rb; ++b) table[idx[k] * rb + b] = static_cast<unsigned char>(k * 50 + b);
  alignas(16) unsigned char out[2 * 64];
  rows_call c;
  c.table = table;
  c.rows = rows;
  c.row_bytes = rb;
  c.index = idx;
  c.index_bytes = 4;
  c.count = 2;
  c.dense = out;
  for (kernel_kind kind : {kernel_kind::vector, kernel_kind::naive}) {
    std::int64_t err[2] = {0, 0};
    std::memset(out, 0xEE, sizeof(out));
    emulate<false>(c, plan_gather(c, kind), 1, err);
    bool ok = err[0] == 0;
    for (int k = 0; k < 2; ++k)
      for (int b = 0; b < rb; ++b) ok = ok && out[k * rb + b] == static_cast<unsigned char>(k * 50 + b);
    check(ok, "offsets past 2^31", rb, 0, static_cast<int>(kind), 0, 4);
  }
  std::free(table);
}

// A count in device memory (the deduplicating gather's distinct rows): only the first *device_count indices are
// moved, the rows past it stay untouched, and the host `count` still bounds it.
void device_count_case() {
  std::mt19937_64 rng(99);
  for (const std::int64_t rb : {47, 64, 400, 4096}) {
    const std::int64_t rows = 50, count = 40;
    std::vector<unsigned char> table(rows * rb + 64);
    for (auto& b : table) b = static_cast<unsigned char>(rng());
    std::vector<std::int64_t> idx(count);
    for (auto& i : idx) i = static_cast<std::int64_t>(rng() % rows);
    for (const std::int64_t limit : {std::int64_t{0}, std::int64_t{1}, std::int64_t{17}, count, count + 5}) {
      for (kernel_kind kind : {kernel_kind::vector, kernel_kind::naive}) {
        std::vector<unsigned char> out(count * rb + 16, 0xCD);
        rows_call c;
        c.table = table.data();
        c.rows = rows;
        c.row_bytes = rb;
        c.index = idx.data();
        c.index_bytes = 8;
        c.count = count;
        c.dense = out.data();
        c.device_count = &limit;
        std::int64_t err[2] = {0, 0};
        emulate<false>(c, plan_gather(c, kind), 2, err);
        const std::int64_t moved = std::min(limit, count);
        bool ok = err[0] == 0;
        for (std::int64_t i = 0; i < count && ok; ++i) {
          if (i < moved) {
            ok = std::memcmp(out.data() + i * rb, table.data() + idx[i] * rb, rb) == 0;
          } else {
            for (std::int64_t b = 0; b < rb; ++b) ok = ok && out[i * rb + b] == 0xCD;
          }
        }
        check(ok, "device-side count", rb, static_cast<int>(limit), static_cast<int>(kind), 0, 8);
      }
    }
  }
}

// The cached gather: hits from the cache buffer, misses from the table, for every width and misalignment; then a
// refresh after writes to the table updates exactly the cached rows named by the index, and skips bad indices
// without recording them (a gather records them).
template <bool Refresh>
void emulate_cached(const rows_call& c, const launch_plan& p, unsigned grid, std::int64_t* err) {
  check_gpu_shapes(c, p);
  const auto* table = static_cast<const unsigned char*>(c.table);
  auto* cache = static_cast<unsigned char*>(c.cache);
  auto* dense = static_cast<unsigned char*>(c.dense);
  run_grid(grid, 64, [&] {
    if (p.kernel == launch_plan::unaligned) {
      move_rows_cached_unaligned<Refresh>(table, c.rows, c.row_bytes, c.index, c.index_bytes, c.count, c.positions,
                                          c.slot_of_row, cache, dense, err, p.group_shift);
      return;
    }
    switch (p.width) {
      case 16:
        move_rows_cached<16, Refresh>(table, c.rows, p.row_words, c.index, c.index_bytes, c.count, c.positions,
                                      c.slot_of_row, cache, dense, err, p.group_shift);
        break;
      case 8:
        move_rows_cached<8, Refresh>(table, c.rows, p.row_words, c.index, c.index_bytes, c.count, c.positions,
                                     c.slot_of_row, cache, dense, err, p.group_shift);
        break;
      case 4:
        move_rows_cached<4, Refresh>(table, c.rows, p.row_words, c.index, c.index_bytes, c.count, c.positions,
                                     c.slot_of_row, cache, dense, err, p.group_shift);
        break;
      case 2:
        move_rows_cached<2, Refresh>(table, c.rows, p.row_words, c.index, c.index_bytes, c.count, c.positions,
                                     c.slot_of_row, cache, dense, err, p.group_shift);
        break;
      default:
        move_rows_cached<1, Refresh>(table, c.rows, p.row_words, c.index, c.index_bytes, c.count, c.positions,
                                     c.slot_of_row, cache, dense, err, p.group_shift);
        break;
    }
  });
}

void cached_case(std::mt19937_64& rng, std::int64_t rb, int table_offset, bool use_positions, int index_bytes) {
  const std::int64_t rows = rb >= 1000 ? 40 : 200;
  const std::int64_t count = rows + 13;
  std::vector<unsigned char> table_mem(rows * rb + 128);
  for (auto& b : table_mem) b = static_cast<unsigned char>(rng());
  unsigned char* base = table_mem.data();
  base += (16 - reinterpret_cast<std::uintptr_t>(base) % 16) % 16;
  unsigned char* table = base + 32 + table_offset;
  // Every third row cached, in a shuffled slot order; the cache holds different bytes than the table for a moment
  // (poison), then the true rows: a hit must come from the cache.
  std::vector<std::int32_t> slot_of_row(rows, -1);
  std::vector<std::int64_t> cached;
  for (std::int64_t r = 0; r < rows; r += 3) cached.push_back(r);
  std::shuffle(cached.begin(), cached.end(), rng);
  std::vector<unsigned char> cache_mem(cached.size() * rb + 16 + 16);
  unsigned char* cache = cache_mem.data() + (16 - reinterpret_cast<std::uintptr_t>(cache_mem.data()) % 16) % 16;
  for (std::size_t s = 0; s < cached.size(); ++s) {
    slot_of_row[cached[s]] = static_cast<std::int32_t>(s);
    for (std::int64_t b = 0; b < rb; ++b)
      cache[s * rb + b] = static_cast<unsigned char>(table[cached[s] * rb + b] ^ 0x5A);
  }
  std::vector<std::int64_t> idx64(count);
  for (auto& i : idx64) i = static_cast<std::int64_t>(rng() % rows);
  std::vector<std::int64_t> order = idx64, positions(count);
  for (std::int64_t i = 0; i < count; ++i) positions[i] = i;
  if (use_positions) {
    std::vector<std::pair<std::int64_t, std::int64_t>> pairs;
    for (std::int64_t i = 0; i < count; ++i) pairs.emplace_back(idx64[i], i);
    std::sort(pairs.begin(), pairs.end());
    for (std::int64_t i = 0; i < count; ++i) {
      order[i] = pairs[i].first;
      positions[i] = pairs[i].second;
    }
  }
  std::vector<std::int32_t> order32(order.begin(), order.end());
  std::vector<unsigned char> dense_mem(count * rb + 32, 0xAB);
  unsigned char* dense = dense_mem.data() + (16 - reinterpret_cast<std::uintptr_t>(dense_mem.data()) % 16) % 16;
  rows_call c;
  c.table = table;
  c.rows = rows;
  c.row_bytes = rb;
  c.index = index_bytes == 8 ? static_cast<const void*>(order.data()) : static_cast<const void*>(order32.data());
  c.index_bytes = index_bytes;
  c.count = count;
  c.positions = use_positions ? positions.data() : nullptr;
  c.dense = dense;
  c.slot_of_row = slot_of_row.data();
  c.cache = cache;
  std::int64_t err[2] = {0, 0};
  emulate_cached<false>(c, plan_cached(c), 3, err);
  bool ok = err[0] == 0;
  for (std::int64_t i = 0; i < count && ok; ++i) {
    const std::int64_t r = idx64[i];
    for (std::int64_t b = 0; b < rb && ok; ++b) {
      const unsigned char want =
          slot_of_row[r] >= 0 ? static_cast<unsigned char>(table[r * rb + b] ^ 0x5A) : table[r * rb + b];
      ok = dense[i * rb + b] == want;
    }
  }
  check(ok, "cached gather", rb, table_offset, 2, use_positions, index_bytes);

  // Refresh: the rows named by the index (plus a bad one) are read again into their slots; the other slots keep
  // their (poisoned) bytes, and no error is recorded.
  std::vector<std::int64_t> written = {0, 1, 3, rows - 1, rows + 5, -2};
  std::vector<std::int32_t> written32(written.begin(), written.end());
  rows_call r = c;
  r.index = index_bytes == 8 ? static_cast<const void*>(written.data()) : static_cast<const void*>(written32.data());
  r.count = static_cast<std::int64_t>(written.size());
  r.positions = nullptr;
  r.dense = nullptr;
  const std::vector<unsigned char> before(cache_mem);
  emulate_cached<true>(r, plan_cached(r), 2, err);
  ok = err[0] == 0;
  for (std::size_t s = 0; s < cached.size() && ok; ++s) {
    const std::int64_t row = cached[s];
    const bool named = std::find(written.begin(), written.end(), row) != written.end();
    for (std::int64_t b = 0; b < rb && ok; ++b)
      ok = cache[s * rb + b] == (named ? table[row * rb + b] : before[(cache - cache_mem.data()) + s * rb + b]);
  }
  check(ok, "cached refresh", rb, table_offset, 2, 0, index_bytes);
  // A bad index in a gather is recorded, its output row untouched.
  std::vector<std::int64_t> bad = {rows, 0};
  rows_call g = c;
  g.index = bad.data();
  g.index_bytes = 8;
  g.count = 2;
  g.positions = nullptr;
  std::memset(dense, 0xEE, static_cast<std::size_t>(rb));
  emulate_cached<false>(g, plan_cached(g), 1, err);
  ok = err[0] == 1 && err[1] == rows && dense[0] == 0xEE;
  check(ok, "cached gather bad index", rb, table_offset, 2, 0, 8);
}

}  // namespace

int main() {
  std::mt19937_64 rng(1234);
  const std::int64_t widths[] = {1,  2,   3,   4,   6,   8,   12,   16,   24,   47,  48,
                                 64, 100, 128, 200, 400, 512, 1000, 1024, 4096, 4100};
  int cases = 0;
  for (std::int64_t rb : widths) {
    for (int table_offset : {0, 1, 4, 8, 13}) {
      for (int dense_offset : {0, 4}) {
        for (kernel_kind kind : {kernel_kind::vector, kernel_kind::naive}) {
          for (bool positions : {false, true}) {
            for (int index_bytes : {4, 8}) {
              const std::int64_t rows = rb >= 1000 ? 40 : 300;
              run_case(rng, rows, rb, table_offset, dense_offset, kind, positions, index_bytes, rows + 17,
                       (rb + table_offset) % 2 ? 1 : 3);
              ++cases;
            }
          }
        }
      }
    }
  }
  for (std::int64_t rb : widths) {
    for (int table_offset : {0, 4, 13}) {
      for (bool positions : {false, true}) {
        for (int index_bytes : {4, 8}) {
          cached_case(rng, rb, table_offset, positions, index_bytes);
          ++cases;
        }
      }
    }
  }
  bad_index_case();
  large_offset_case();
  device_count_case();
  if (misaligned != 0) {
    std::printf("FAIL: %lld misaligned vector accesses\n", misaligned);
    ++failures;
  }
  if (bad_shapes != 0) {
    std::printf("FAIL: %lld unlaunchable kernel shapes\n", bad_shapes);
    ++failures;
  }
  std::printf("%d cases, %d failures\n", cases, failures);
  return failures == 0 ? 0 : 1;
}
