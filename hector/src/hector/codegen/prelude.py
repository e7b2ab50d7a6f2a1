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

# Tensor-core tiles through PTX wmma: fragments are loaded from and stored to shared memory by the hardware, so
# the code never depends on which lane holds which element. 16x16x16 for bf16/f16, 16x16x8 for tf32; fp32
# accumulation. The emulator (tests) implements the same functions with its own fragment layout.
WMMA = r"""
#ifdef HECTOR_EMULATE
static inline float hector_emu_elem_to_float(bf16_t v) { return __uint_as_float(((unsigned)v.bits) << 16); }
static inline float hector_emu_elem_to_float(f16_t v) { return hector_f16_to_f32(v.bits); }
__device__ __forceinline__ float hector_tf32(float x) { return hector_emu_tf32(x); }
#else
__device__ __forceinline__ float hector_tf32(float x) {
  unsigned u; asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(u) : "f"(x)); return __uint_as_float(u); }
#endif
"""

WMMA_CUDA = {
    "bf16": r"""
#ifndef HECTOR_EMULATE
struct hw_bf16 { static constexpr int KSTEP = 16; typedef bf16_t elem; };
__device__ __forceinline__ void hw_load_a(unsigned (&a)[8], const bf16_t* p, int ld) {
  asm volatile("wmma.load.a.sync.aligned.row.m16n16k16.bf16 {%0,%1,%2,%3}, [%4], %5;"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "l"(p), "r"(ld)); }
__device__ __forceinline__ void hw_load_b(unsigned (&b)[8], const bf16_t* p, int ld) {
  asm volatile("wmma.load.b.sync.aligned.row.m16n16k16.bf16 {%0,%1,%2,%3}, [%4], %5;"
               : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3]) : "l"(p), "r"(ld)); }
__device__ __forceinline__ void hw_mma(float (&d)[8], const unsigned (&a)[8], const unsigned (&b)[8]) {
  asm volatile("wmma.mma.sync.aligned.row.row.m16n16k16.f32.bf16.bf16.f32 {%0,%1,%2,%3,%4,%5,%6,%7}, "
               "{%8,%9,%10,%11}, {%12,%13,%14,%15}, {%0,%1,%2,%3,%4,%5,%6,%7};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(b[2]), "r"(b[3])); }
__device__ __forceinline__ void hw_store(float* p, const float (&d)[8], int ld) {
  asm volatile("wmma.store.d.sync.aligned.row.m16n16k16.f32 [%0], {%1,%2,%3,%4,%5,%6,%7,%8}, %9;"
               :: "l"(p), "f"(d[0]), "f"(d[1]), "f"(d[2]), "f"(d[3]), "f"(d[4]), "f"(d[5]), "f"(d[6]), "f"(d[7]),
                  "r"(ld) : "memory"); }
#endif
""",
    "f16": r"""
#ifndef HECTOR_EMULATE
struct hw_f16 { static constexpr int KSTEP = 16; typedef f16_t elem; };
__device__ __forceinline__ void hw_load_a(unsigned (&a)[8], const f16_t* p, int ld) {
  asm volatile("wmma.load.a.sync.aligned.row.m16n16k16.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, [%8], %9;"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]), "=r"(a[4]), "=r"(a[5]), "=r"(a[6]), "=r"(a[7])
               : "l"(p), "r"(ld)); }
__device__ __forceinline__ void hw_load_b(unsigned (&b)[8], const f16_t* p, int ld) {
  asm volatile("wmma.load.b.sync.aligned.row.m16n16k16.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, [%8], %9;"
               : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3]), "=r"(b[4]), "=r"(b[5]), "=r"(b[6]), "=r"(b[7])
               : "l"(p), "r"(ld)); }
__device__ __forceinline__ void hw_mma(float (&d)[8], const unsigned (&a)[8], const unsigned (&b)[8]) {
  asm volatile("wmma.mma.sync.aligned.row.row.m16n16k16.f32.f32 {%0,%1,%2,%3,%4,%5,%6,%7}, "
               "{%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19,%20,%21,%22,%23}, {%0,%1,%2,%3,%4,%5,%6,%7};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(a[4]), "r"(a[5]), "r"(a[6]), "r"(a[7]),
                 "r"(b[0]), "r"(b[1]), "r"(b[2]), "r"(b[3]), "r"(b[4]), "r"(b[5]), "r"(b[6]), "r"(b[7])); }
__device__ __forceinline__ void hw_store(float* p, const float (&d)[8], int ld) {
  asm volatile("wmma.store.d.sync.aligned.row.m16n16k16.f32 [%0], {%1,%2,%3,%4,%5,%6,%7,%8}, %9;"
               :: "l"(p), "f"(d[0]), "f"(d[1]), "f"(d[2]), "f"(d[3]), "f"(d[4]), "f"(d[5]), "f"(d[6]), "f"(d[7]),
                  "r"(ld) : "memory"); }
#endif
""",
    "tf32": r"""
#ifndef HECTOR_EMULATE
struct hw_tf32 { static constexpr int KSTEP = 8; typedef float elem; };
__device__ __forceinline__ void hw_load_a(unsigned (&a)[8], const float* p, int ld) {
  asm volatile("wmma.load.a.sync.aligned.row.m16n16k8.tf32 {%0,%1,%2,%3}, [%4], %5;"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "l"(p), "r"(ld)); }
__device__ __forceinline__ void hw_load_b(unsigned (&b)[8], const float* p, int ld) {
  asm volatile("wmma.load.b.sync.aligned.row.m16n16k8.tf32 {%0,%1,%2,%3}, [%4], %5;"
               : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3]) : "l"(p), "r"(ld)); }
__device__ __forceinline__ void hw_mma(float (&d)[8], const unsigned (&a)[8], const unsigned (&b)[8]) {
  asm volatile("wmma.mma.sync.aligned.row.row.m16n16k8.f32.tf32.tf32.f32 {%0,%1,%2,%3,%4,%5,%6,%7}, "
               "{%8,%9,%10,%11}, {%12,%13,%14,%15}, {%0,%1,%2,%3,%4,%5,%6,%7};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(b[2]), "r"(b[3])); }
__device__ __forceinline__ void hw_store(float* p, const float (&d)[8], int ld) {
  asm volatile("wmma.store.d.sync.aligned.row.m16n16k8.f32 [%0], {%1,%2,%3,%4,%5,%6,%7,%8}, %9;"
               :: "l"(p), "f"(d[0]), "f"(d[1]), "f"(d[2]), "f"(d[3]), "f"(d[4]), "f"(d[5]), "f"(d[6]), "f"(d[7]),
                  "r"(ld) : "memory"); }
#endif
""",
}
WMMA_EMULATED = r"""
#ifdef HECTOR_EMULATE
__device__ __forceinline__ void hw_load_a(unsigned (&a)[8], const HW_ELEM* p, int ld) {
  hector_emu_wmma_load(a, p, ld, 16, HW_KSTEP); }
__device__ __forceinline__ void hw_load_b(unsigned (&b)[8], const HW_ELEM* p, int ld) {
  hector_emu_wmma_load(b, p, ld, HW_KSTEP, 16); }
__device__ __forceinline__ void hw_mma(float (&d)[8], const unsigned (&a)[8], const unsigned (&b)[8]) {
  hector_emu_wmma_mma(d, a, b, (HW_ELEM*)0, HW_KSTEP); }
__device__ __forceinline__ void hw_store(float* p, const float (&d)[8], int ld) { hector_emu_wmma_store(p, d, ld); }
#endif
"""

