// Runs hector's generated CUDA kernels on the CPU, for tests on machines without a GPU.
//
// Every CUDA thread of a block is a fiber (ucontext) on one OS thread; blocks run one after another. A fiber runs
// until it reaches a barrier (__syncthreads, __syncwarp, a shuffle, an mma), where it yields to the scheduler, so
// barriers, warp shuffles and tensor-core fragments behave as on a GPU (including sub-warp masks), and
// `__shared__` variables (function statics here) are shared by the threads of one block. Atomics are plain
// read-modify-writes: only one fiber runs at a time. The generated source is compiled with -DHECTOR_EMULATE and
// -include this file; each kernel gets a stub `hector_emu_<name>(void** args)` that hector_emu_launch runs.
#pragma once
#include <ucontext.h>

#include <math.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

struct hector_dim3 {
  unsigned x = 1, y = 1, z = 1;
};
inline hector_dim3 threadIdx, blockIdx, blockDim, gridDim;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __shared__ static
#define __align__(n) alignas(n)

namespace hector_emu {

struct fiber {
  ucontext_t context;
  bool done = false;
  hector_dim3 tid;
};

inline ucontext_t scheduler;
inline std::vector<fiber> fibers;
inline std::vector<std::vector<char>> stacks;
inline fiber* current = nullptr;
inline void (*stub)(void**) = nullptr;
inline void** stub_args = nullptr;
inline unsigned threads_in_block = 0;
inline std::vector<unsigned char> dynamic_smem;
inline long long barrier_waits = 0;

inline unsigned linear_tid() { return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z); }
inline unsigned lane_id() { return linear_tid() & 31u; }
inline unsigned warp_id() { return linear_tid() >> 5; }

inline void yield() {
  fiber* self = current;
  swapcontext(&self->context, &scheduler);
}

// __syncthreads: all threads of the block
inline unsigned block_arrived = 0;
inline unsigned long long block_generation = 0;
inline void sync_block() {
  const unsigned long long gen = block_generation;
  if (++block_arrived == threads_in_block) {
    block_arrived = 0;
    ++block_generation;
    return;
  }
  while (block_generation == gen) yield();
}

// warp barriers, one per (warp, mask) in use at a time
struct warp_barrier {
  unsigned mask = 0, arrived = 0;
  unsigned long long generation = 0;
};
inline std::vector<std::vector<warp_barrier>> warp_barriers;
inline void sync_warp(unsigned mask) {
  const unsigned lane = lane_id();
  if (!(mask & (1u << lane))) {
    std::fprintf(stderr, "emulator: lane %u calls a warp barrier with mask %08x that excludes it\n", lane, mask);
    std::abort();
  }
  auto& list = warp_barriers[warp_id()];
  warp_barrier* b = nullptr;
  for (auto& entry : list)
    if (entry.mask == mask) b = &entry;
  if (b == nullptr) {
    list.push_back(warp_barrier{mask, 0, 0});
    b = &list.back();
  }
  const unsigned long long gen = b->generation;
  b->arrived |= 1u << lane;
  if (b->arrived == mask) {
    b->arrived = 0;
    ++b->generation;
    return;
  }
  // the vector may grow while we wait: look the barrier up again after each yield
  for (;;) {
    yield();
    for (auto& entry : warp_barriers[warp_id()])
      if (entry.mask == mask && entry.generation != gen) return;
  }
}

// shuffle exchange: one 8-byte slot per lane of each warp
inline std::vector<std::vector<std::uint64_t>> exchange;
inline std::vector<std::vector<float>> wmma_a, wmma_b;  // tensor-core operands of each warp

template <typename T>
T shuffle(unsigned mask, T value, unsigned source_lane) {
  static_assert(sizeof(T) <= 8, "shuffle of a value wider than 8 bytes");
  const unsigned lane = lane_id();
  std::uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  exchange[warp_id()][lane] = bits;
  sync_warp(mask);
  if (!(mask & (1u << source_lane))) {
    std::fprintf(stderr, "emulator: lane %u reads lane %u outside mask %08x\n", lane, source_lane, mask);
    std::abort();
  }
  std::uint64_t got = exchange[warp_id()][source_lane];
  sync_warp(mask);
  T out;
  std::memcpy(&out, &got, sizeof(T));
  return out;
}

inline void fiber_main() {
  stub(stub_args);
  current->done = true;
  // uc_link returns to the scheduler
}

inline int launch(void (*kernel_stub)(void**), unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                  unsigned bz, unsigned smem, void** args) {
  const unsigned n = bx * by * bz;
  if (n == 0 || n > 1024) return 1;
  stub = kernel_stub;
  stub_args = args;
  threads_in_block = n;
  gridDim = {gx, gy, gz};
  blockDim = {bx, by, bz};
  dynamic_smem.assign(smem + 16, 0xA5);  // poison: generated code must not read shared memory it did not write
  constexpr std::size_t stack_bytes = 256 * 1024;
  if (stacks.size() < n) stacks.resize(n, std::vector<char>(stack_bytes));
  const unsigned warps = (n + 31) / 32;
  for (unsigned z = 0; z < gz; ++z)
    for (unsigned y = 0; y < gy; ++y)
      for (unsigned x = 0; x < gx; ++x) {
        blockIdx = {x, y, z};
        fibers.assign(n, fiber{});
        warp_barriers.assign(warps, {});
        exchange.assign(warps, std::vector<std::uint64_t>(32, 0));
        wmma_a.assign(warps, std::vector<float>(256, 0.f));
        wmma_b.assign(warps, std::vector<float>(256, 0.f));
        block_arrived = 0;
        for (unsigned t = 0; t < n; ++t) {
          fiber& f = fibers[t];
          f.tid = {t % bx, (t / bx) % by, t / (bx * by)};
          getcontext(&f.context);
          f.context.uc_stack.ss_sp = stacks[t].data();
          f.context.uc_stack.ss_size = stack_bytes;
          f.context.uc_link = &scheduler;
          makecontext(&f.context, fiber_main, 0);
        }
        for (;;) {
          bool any = false;
          for (auto& f : fibers) {
            if (f.done) continue;
            any = true;
            current = &f;
            threadIdx = f.tid;
            swapcontext(&scheduler, &f.context);
          }
          if (!any) break;
          ++barrier_waits;
          if (barrier_waits > (1ll << 40)) return 2;
        }
        // a thread that finished while others wait at a block barrier is a deadlock on a GPU
        if (block_arrived != 0) {
          std::fprintf(stderr, "emulator: %u threads left waiting at __syncthreads\n", block_arrived);
          return 3;
        }
      }
  return 0;
}

}  // namespace hector_emu

extern "C" int hector_emu_launch(void (*kernel_stub)(void**), unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                 unsigned by, unsigned bz, unsigned smem, void** args) {
  return hector_emu::launch(kernel_stub, gx, gy, gz, bx, by, bz, smem, args);
}

inline void __syncthreads() { hector_emu::sync_block(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { hector_emu::sync_warp(mask); }
template <typename T>
T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  const unsigned lane = hector_emu::lane_id();
  const unsigned base = lane & ~static_cast<unsigned>(width - 1);
  return hector_emu::shuffle(mask, v, base + (static_cast<unsigned>(src) & static_cast<unsigned>(width - 1)));
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  const unsigned lane = hector_emu::lane_id();
  const unsigned base = lane & ~static_cast<unsigned>(width - 1);
  const unsigned src = base + ((lane ^ static_cast<unsigned>(lane_mask)) & static_cast<unsigned>(width - 1));
  return hector_emu::shuffle(mask, v, src);
}
inline float atomicAdd(float* p, float v) {
  float old = *p;
  *p = old + v;
  return old;
}
inline double atomicAdd(double* p, double v) {
  double old = *p;
  *p = old + v;
  return old;
}
inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}
template <typename T>
T __ldg(const T* p) {
  return *p;
}
// Tensor-core tiles (the generated code's hw_load_a / hw_load_b / hw_mma / hw_store under HECTOR_EMULATE). The
// emulator's own fragment layout: lane l holds elements l*n .. l*n+n-1 (row-major) as floats.
inline float hector_emu_elem_to_float(float v) { return v; }
inline float hector_emu_tf32(float x) {  // round to nearest, ties away, to a 10-bit mantissa (cvt.rna.tf32.f32)
  unsigned u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0x1000u) & 0xffffe000u;
  std::memcpy(&x, &u, 4);
  return x;
}
template <typename T>
void hector_emu_wmma_load(unsigned (&r)[8], const T* p, int ld, int rows, int cols) {
  const int per = rows * cols / 32;
  const int lane = static_cast<int>(hector_emu::lane_id());
  for (int q = 0; q < per; ++q) {
    const int e = lane * per + q;
    const float f = hector_emu_elem_to_float(p[(e / cols) * ld + e % cols]);
    std::memcpy(&r[q], &f, 4);
  }
}
template <typename T>
void hector_emu_wmma_mma(float (&d)[8], const unsigned (&a)[8], const unsigned (&b)[8], const T*, int kstep) {
  const int lane = static_cast<int>(hector_emu::lane_id());
  auto& A = hector_emu::wmma_a[hector_emu::warp_id()];
  auto& B = hector_emu::wmma_b[hector_emu::warp_id()];
  const int per = 16 * kstep / 32;
  for (int q = 0; q < per; ++q) {
    std::memcpy(&A[lane * per + q], &a[q], 4);
    std::memcpy(&B[lane * per + q], &b[q], 4);
  }
  hector_emu::sync_warp(0xffffffffu);
  for (int q = 0; q < 8; ++q) {
    const int e = lane * 8 + q, row = e / 16, col = e % 16;
    float sum = 0;
    for (int k = 0; k < kstep; ++k) sum += A[row * kstep + k] * B[k * 16 + col];
    d[q] += sum;
  }
  hector_emu::sync_warp(0xffffffffu);
}
inline void hector_emu_wmma_store(float* p, const float (&d)[8], int ld) {
  const int lane = static_cast<int>(hector_emu::lane_id());
  for (int q = 0; q < 8; ++q) {
    const int e = lane * 8 + q;
    p[(e / 16) * ld + e % 16] = d[q];
  }
}
#define HECTOR_DYNAMIC_SMEM(name) unsigned char* name = hector_emu::dynamic_smem.data()
using std::erf;
using std::exp;
using std::fmax;
using std::max;
using std::min;
using std::tanh;
