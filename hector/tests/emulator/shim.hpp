// Runs hector's generated CUDA kernels on the CPU, for tests on machines without a GPU.
//
// Every CUDA thread of a block is a fiber on one OS thread; blocks run one after another. A fiber runs until it
// reaches a barrier (__syncthreads, __syncwarp, a shuffle, an mma), where it yields to the scheduler, so barriers,
// warp shuffles and tensor-core fragments behave as on a GPU (including sub-warp masks), and `__shared__`
// variables (function statics here) are shared by the threads of one block. Atomics are plain read-modify-writes:
// only one fiber runs at a time. The generated source is compiled with -DHECTOR_EMULATE and -include this file,
// and linked against the scheduler (runtime.cpp, built once); each kernel gets a stub `hector_emu_<name>(void**
// args)` that the runtime's hector_emu_launch runs. This header stays small: it is compiled into every module.
#pragma once
#include <math.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

struct hector_dim3 {
  unsigned x = 1, y = 1, z = 1;
};
extern hector_dim3 threadIdx, blockIdx, blockDim, gridDim;  // the running fiber's, set by the scheduler

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __shared__ static
#define __align__(n) alignas(n)

namespace hector_emu {

inline unsigned linear_tid() { return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z); }
inline unsigned lane_id() { return linear_tid() & 31u; }
inline unsigned warp_id() { return linear_tid() >> 5; }

// in runtime.cpp
void sync_block();               // __syncthreads: all threads of the block
void sync_warp(unsigned mask);   // a warp barrier of the lanes in mask
std::uint64_t* warp_exchange();  // the shuffle slots of the calling thread's warp, one 8-byte slot per lane
float* warp_wmma_a();            // the tensor-core operands of the calling thread's warp (256 floats each)
float* warp_wmma_b();
unsigned char* dynamic_smem();  // the block's dynamic shared memory

template <typename T>
T shuffle(unsigned mask, T value, unsigned source_lane) {
  static_assert(sizeof(T) <= 8, "shuffle of a value wider than 8 bytes");
  const unsigned lane = lane_id();
  std::uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  std::uint64_t* slots = warp_exchange();
  slots[lane] = bits;
  sync_warp(mask);
  if (!(mask & (1u << source_lane))) {
    std::fprintf(stderr, "emulator: lane %u reads lane %u outside mask %08x\n", lane, source_lane, mask);
    std::abort();
  }
  std::uint64_t got = slots[source_lane];
  sync_warp(mask);
  T out;
  std::memcpy(&out, &got, sizeof(T));
  return out;
}

}  // namespace hector_emu

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
  float* A = hector_emu::warp_wmma_a();
  float* B = hector_emu::warp_wmma_b();
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
#define HECTOR_DYNAMIC_SMEM(name) unsigned char* name = hector_emu::dynamic_smem()
using std::erf;
using std::exp;
using std::fmax;
using std::max;
using std::min;
using std::tanh;
