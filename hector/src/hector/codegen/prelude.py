"""The fixed part of every generated module: storage types, loads/stores with conversion, math and warp helpers.

It includes no header (NVRTC has none to offer here): bfloat16 and float16 are 16-bit storage structs converted
with bit operations or one PTX instruction, and compute happens in ``acc_t`` (float, or double for float64
programs). Compiled with ``-DHECTOR_EMULATE`` and the test shim instead of NVRTC, the same source runs on a CPU.
"""

PRELUDE = r"""
typedef long long i64;
struct bf16_t { unsigned short bits; };  // bfloat16 storage
struct f16_t { unsigned short bits; };   // IEEE float16 storage

#ifdef HECTOR_EMULATE
#define HECTOR_DYNAMIC_SMEM_DECL(name) HECTOR_DYNAMIC_SMEM(name)
static inline float hector_f16_to_f32(unsigned short h) { _Float16 v; __builtin_memcpy(&v, &h, 2); return (float)v; }
static inline unsigned short hector_f32_to_f16(float f) { _Float16 v = (_Float16)f; unsigned short h;
  __builtin_memcpy(&h, &v, 2); return h; }
static inline float __int_as_float(int i) { float f; __builtin_memcpy(&f, &i, 4); return f; }
#else
#define HECTOR_DYNAMIC_SMEM_DECL(name) extern __shared__ __align__(16) unsigned char name[]
__device__ __forceinline__ float hector_f16_to_f32(unsigned short h) {
  float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ unsigned short hector_f32_to_f16(float f) {
  unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
#endif

__device__ __forceinline__ acc_t ld(const float* p) { return (acc_t)*p; }
__device__ __forceinline__ acc_t ld(const double* p) { return (acc_t)*p; }
__device__ __forceinline__ acc_t ld(const bf16_t* p) { return (acc_t)__uint_as_float(((unsigned)p->bits) << 16); }
__device__ __forceinline__ acc_t ld(const f16_t* p) { return (acc_t)hector_f16_to_f32(p->bits); }
__device__ __forceinline__ void st(float* p, acc_t v) { *p = (float)v; }
__device__ __forceinline__ void st(double* p, acc_t v) { *p = (double)v; }
__device__ __forceinline__ void st(bf16_t* p, acc_t v) {
  // round to nearest even; NaN stays NaN
  unsigned u = __float_as_uint((float)v);
  unsigned short b = ((u & 0x7fffffffu) > 0x7f800000u) ? (unsigned short)((u >> 16) | 0x40u)
                                                         : (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  p->bits = b;
}
__device__ __forceinline__ void st(f16_t* p, acc_t v) { p->bits = hector_f32_to_f16((float)v); }

__device__ __forceinline__ float hexp(float x) { return expf(x); }
__device__ __forceinline__ double hexp(double x) { return exp(x); }
__device__ __forceinline__ float htanh(float x) { return tanhf(x); }
__device__ __forceinline__ double htanh(double x) { return tanh(x); }
__device__ __forceinline__ float herf(float x) { return erff(x); }
__device__ __forceinline__ double herf(double x) { return erf(x); }
__device__ __forceinline__ float hmax(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double hmax(double a, double b) { return fmax(a, b); }
#define HECTOR_NEG_INF ((acc_t)(-__int_as_float(0x7f800000)))
"""
