// hector: generated CUDA for program RGATConv (5 kernels, storage f32, accumulation f32)
typedef float acc_t;

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

// k0_param [param/param] out=['w_1'] in=['weight', 'q']
//     layout: weights only (once per call)
// %w_1 = einsum(%weight, %q) {by=('etype',), equation='rim,rmo->rio'} : param[3,8,2] by etype
extern "C" __global__ void k0_param(float* __restrict__ o_w_1, const float* __restrict__ p_weight, const float* __restrict__ p_q) {
  const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= 48) return;
  const i64 i_o = idx % 2;
  const i64 i_i = (idx / 2) % 8;
  const i64 i_r = ((idx / 2) / 8) % 3;
  acc_t t = 0;
  for (i64 i_m = 0; i_m < 8; ++i_m)
    t += ld(p_weight + i_m * 1 + i_i * 8 + i_r * 64) * ld(p_q + i_o * 1 + i_m * 2 + i_r * 16);
  st(o_w_1 + idx, t);
}
// k1_gemm [gemm/edge] out=['v_2'] in=['x', 'w_1']
//     layout: edge rows grouped by etype (segment GEMM, one weight per segment); A rows gathered via dst
//     a=x, a_via=dst, b=w_1, by=('etype',), op=linear, transpose=False, weight_core=(8, 2)
// %v3 = gather(%x) {via='dst'} : edge[8]
// %v_2 = linear(%v3, %w_1) {transpose=False} : edge[2]
extern "C" __global__ void __launch_bounds__(256) k1_gemm(const int* __restrict__ tiles, const int* __restrict__ perm, const int* __restrict__ g_dst, const float* __restrict__ p_x, const float* __restrict__ p_w_1, float* __restrict__ o_v_2) {
  constexpr int K = 8, N = 2, BM = 256, BN = 2, BK = 16, RM = 1, RN = 2, TX = 1, TY = 256;
  __shared__ acc_t As[BK][BM];  // A tile, k-major
  __shared__ acc_t Ws[BK][BN];  // weight tile of this tile's type
  __shared__ i64 a_off[BM];
  __shared__ int c_row[BM];
  const int tile = blockIdx.x;
  const int type = tiles[3 * tile], begin = tiles[3 * tile + 1], count = tiles[3 * tile + 2];
  if (count == 0) return;  // a spare slot of the schedule (DeviceGraph.tiles)
  const int n0 = blockIdx.y * BN;
  for (int i = threadIdx.x; i < BM; i += blockDim.x) {
    if (i < count) {
      const int r = perm[begin + i];
      c_row[i] = r;
      a_off[i] = (i64)(g_dst[r]) * K;  // A row read through the gather index
    }
  }
  __syncthreads();
  const int tx = threadIdx.x % TX, ty = threadIdx.x / TX;
  acc_t acc[RM][RN];
  #pragma unroll
  for (int q = 0; q < RM; ++q)
    #pragma unroll
    for (int u = 0; u < RN; ++u) acc[q][u] = 0;
  for (int k0 = 0; k0 < K; k0 += BK) {
    for (int idx = threadIdx.x; idx < BM * BK; idx += blockDim.x) {
      const int i = idx / BK, kk = idx % BK;
      As[kk][i] = (i < count && k0 + kk < K) ? ld(p_x + a_off[i] + k0 + kk) : (acc_t)0;
    }
    for (int idx = threadIdx.x; idx < BK * BN; idx += blockDim.x) {
      const int kk = idx / BN, cc = idx % BN, k = k0 + kk, c = n0 + cc;
      Ws[kk][cc] = (k < K && c < N && true) ? ld(p_w_1 + (i64)type * 16 + (k) * 2 + (c)) : (acc_t)0;
    }
    __syncthreads();
    #pragma unroll
    for (int kk = 0; kk < BK; ++kk) {
      acc_t a[RM], b[RN];
      #pragma unroll
      for (int q = 0; q < RM; ++q) a[q] = As[kk][ty + q * TY];
      #pragma unroll
      for (int u = 0; u < RN; ++u) b[u] = Ws[kk][tx * RN + u];
      #pragma unroll
      for (int q = 0; q < RM; ++q)
        #pragma unroll
        for (int u = 0; u < RN; ++u) acc[q][u] += a[q] * b[u];
    }
    __syncthreads();
  }
  #pragma unroll
  for (int q = 0; q < RM; ++q) {
    const int i = ty + q * TY;
    if (i >= count) continue;
    const int r = c_row[i];
    #pragma unroll
    for (int u = 0; u < RN; ++u) {
      const int c = n0 + tx * RN + u;
      if (c >= N) continue;
      acc_t v = acc[q][u];
      st(o_v_2 + (i64)r * N + c, v);
    }
  }
}
// k2_gemm [gemm/unique] out=['v_3'] in=['x', 'weight']
//     layout: unique rows grouped by etype (segment GEMM, one weight per segment); A rows gathered via unique_src
//     a=x, a_via=unique_src, b=weight, by=('etype',), op=linear, transpose=False, weight_core=(8, 8)
// %v_1 = gather(%x) {via='unique_src'} : unique[8]
// %v_3 = linear(%v_1, %weight) {transpose=False} : unique[8]
extern "C" __global__ void __launch_bounds__(256) k2_gemm(const int* __restrict__ tiles, const int* __restrict__ perm, const int* __restrict__ g_unique_src, const float* __restrict__ p_x, const float* __restrict__ p_weight, float* __restrict__ o_v_3) {
  constexpr int K = 8, N = 8, BM = 128, BN = 8, BK = 16, RM = 1, RN = 4, TX = 2, TY = 128;
  __shared__ acc_t As[BK][BM];  // A tile, k-major
  __shared__ acc_t Ws[BK][BN];  // weight tile of this tile's type
  __shared__ i64 a_off[BM];
  __shared__ int c_row[BM];
  const int tile = blockIdx.x;
  const int type = tiles[3 * tile], begin = tiles[3 * tile + 1], count = tiles[3 * tile + 2];
  if (count == 0) return;  // a spare slot of the schedule (DeviceGraph.tiles)
  const int n0 = blockIdx.y * BN;
  for (int i = threadIdx.x; i < BM; i += blockDim.x) {
    if (i < count) {
      const int r = perm[begin + i];
      c_row[i] = r;
      a_off[i] = (i64)(g_unique_src[r]) * K;  // A row read through the gather index
    }
  }
  __syncthreads();
  const int tx = threadIdx.x % TX, ty = threadIdx.x / TX;
  acc_t acc[RM][RN];
  #pragma unroll
  for (int q = 0; q < RM; ++q)
    #pragma unroll
    for (int u = 0; u < RN; ++u) acc[q][u] = 0;
  for (int k0 = 0; k0 < K; k0 += BK) {
    for (int idx = threadIdx.x; idx < BM * BK; idx += blockDim.x) {
      const int i = idx / BK, kk = idx % BK;
      As[kk][i] = (i < count && k0 + kk < K) ? ld(p_x + a_off[i] + k0 + kk) : (acc_t)0;
    }
    for (int idx = threadIdx.x; idx < BK * BN; idx += blockDim.x) {
      const int kk = idx / BN, cc = idx % BN, k = k0 + kk, c = n0 + cc;
      Ws[kk][cc] = (k < K && c < N && true) ? ld(p_weight + (i64)type * 64 + (k) * 8 + (c)) : (acc_t)0;
    }
    __syncthreads();
    #pragma unroll
    for (int kk = 0; kk < BK; ++kk) {
      acc_t a[RM], b[RN];
      #pragma unroll
      for (int q = 0; q < RM; ++q) a[q] = As[kk][ty + q * TY];
      #pragma unroll
      for (int u = 0; u < RN; ++u) b[u] = Ws[kk][tx * RN + u];
      #pragma unroll
      for (int q = 0; q < RM; ++q)
        #pragma unroll
        for (int u = 0; u < RN; ++u) acc[q][u] += a[q] * b[u];
    }
    __syncthreads();
  }
  #pragma unroll
  for (int q = 0; q < RM; ++q) {
    const int i = ty + q * TY;
    if (i >= count) continue;
    const int r = c_row[i];
    #pragma unroll
    for (int u = 0; u < RN; ++u) {
      const int c = n0 + tx * RN + u;
      if (c >= N) continue;
      acc_t v = acc[q][u];
      st(o_v_3 + (i64)r * N + c, v);
    }
  }
}
// k3_gemm [gemm/unique] out=['v_4'] in=['v_3', 'k']
//     layout: unique rows grouped by etype (segment GEMM, one weight per segment)
//     a=v_3, a_via=None, b=k, by=('etype',), op=linear, transpose=False, weight_core=(8, 2)
// %v_4 = linear(%v_3, %k) {transpose=False} : unique[2]
extern "C" __global__ void __launch_bounds__(256) k3_gemm(const int* __restrict__ tiles, const int* __restrict__ perm, const float* __restrict__ p_v_3, const float* __restrict__ p_k, float* __restrict__ o_v_4) {
  constexpr int K = 8, N = 2, BM = 256, BN = 2, BK = 16, RM = 1, RN = 2, TX = 1, TY = 256;
  __shared__ acc_t As[BK][BM];  // A tile, k-major
  __shared__ acc_t Ws[BK][BN];  // weight tile of this tile's type
  __shared__ i64 a_off[BM];
  __shared__ int c_row[BM];
  const int tile = blockIdx.x;
  const int type = tiles[3 * tile], begin = tiles[3 * tile + 1], count = tiles[3 * tile + 2];
  if (count == 0) return;  // a spare slot of the schedule (DeviceGraph.tiles)
  const int n0 = blockIdx.y * BN;
  for (int i = threadIdx.x; i < BM; i += blockDim.x) {
    if (i < count) {
      const int r = perm[begin + i];
      c_row[i] = r;
      a_off[i] = (i64)(r) * K;  // A row read through the gather index
    }
  }
  __syncthreads();
  const int tx = threadIdx.x % TX, ty = threadIdx.x / TX;
  acc_t acc[RM][RN];
  #pragma unroll
  for (int q = 0; q < RM; ++q)
    #pragma unroll
    for (int u = 0; u < RN; ++u) acc[q][u] = 0;
  for (int k0 = 0; k0 < K; k0 += BK) {
    for (int idx = threadIdx.x; idx < BM * BK; idx += blockDim.x) {
      const int i = idx / BK, kk = idx % BK;
      As[kk][i] = (i < count && k0 + kk < K) ? ld(p_v_3 + a_off[i] + k0 + kk) : (acc_t)0;
    }
    for (int idx = threadIdx.x; idx < BK * BN; idx += blockDim.x) {
      const int kk = idx / BN, cc = idx % BN, k = k0 + kk, c = n0 + cc;
      Ws[kk][cc] = (k < K && c < N && true) ? ld(p_k + (i64)type * 16 + (k) * 2 + (c)) : (acc_t)0;
    }
    __syncthreads();
    #pragma unroll
    for (int kk = 0; kk < BK; ++kk) {
      acc_t a[RM], b[RN];
      #pragma unroll
      for (int q = 0; q < RM; ++q) a[q] = As[kk][ty + q * TY];
      #pragma unroll
      for (int u = 0; u < RN; ++u) b[u] = Ws[kk][tx * RN + u];
      #pragma unroll
      for (int q = 0; q < RM; ++q)
        #pragma unroll
        for (int u = 0; u < RN; ++u) acc[q][u] += a[q] * b[u];
    }
    __syncthreads();
  }
  #pragma unroll
  for (int q = 0; q < RM; ++q) {
    const int i = ty + q * TY;
    if (i >= count) continue;
    const int r = c_row[i];
    #pragma unroll
    for (int u = 0; u < RN; ++u) {
      const int c = n0 + tx * RN + u;
      if (c >= N) continue;
      acc_t v = acc[q][u];
      st(o_v_4 + (i64)r * N + c, v);
    }
  }
}
// k4_traversal [traversal/edge] out=['v7', 'v9', 'v15'] in=['v_2', 'v_4', 'v_3', 'bias']
//     layout: edge-parallel, destination-centric (CSC: each block walks one destination's in-edges; softmax and sum by destination without atomics)
extern "C" __global__ void __launch_bounds__(256) k4_traversal(const float* __restrict__ p_v_2, const int* __restrict__ g_unique, const float* __restrict__ p_v_4, float* __restrict__ o_v7, float* __restrict__ o_v9, const float* __restrict__ p_v_3, const float* __restrict__ p_bias, float* __restrict__ o_v15, const int* __restrict__ dst_order, const int* __restrict__ csc_ptr, i64 n_work) {
  constexpr int G = 8;  // threads per row group
  const int lane = threadIdx.x % G;
  const unsigned gmask = G == 32 ? 0xffffffffu : ((1u << G) - 1u) << ((threadIdx.x & 31) / G * G);
  (void)gmask;
  __shared__ acc_t scratch[32][16];
  acc_t* scr = scratch[threadIdx.x / G];
  (void)scr;
  const i64 groups = (i64)gridDim.x * 32;
  constexpr int parts = 32;  // groups that share a split destination
  const int part = threadIdx.x / G;  // this group's share
  __shared__ acc_t split_buf[512];  // every group's partial state
  i64 c = blockIdx.x;  // chunk: destinations c * parts .. c * parts + parts - 1 of the order
  int walked = 0;  // destinations of chunk c already walked by the whole block
  while (c * parts < n_work) {
  const i64 w0 = c * parts;
  for (walked = 0; walked < parts && w0 + walked < n_work; ++walked) {
  const int d = dst_order[w0 + walked];  // destination node (heaviest first)
  const int e_begin = csc_ptr[d], e_end = csc_ptr[d + 1];
  if (e_end - e_begin <= 32) break;  // light: one group walks it
  const bool lead = part == 0;  // the group that writes the destination's node-wise outputs
  (void)lead;
    acc_t sm_v9_m[1], sm_v9_z[1];  // statistics of %v9
    #pragma unroll
    for (int s = 0; s < 1; ++s) { sm_v9_m[s] = HECTOR_NEG_INF; sm_v9_z[s] = 0; }
    // walk 1 of 2 over the in-edges of d, every group of the block on its share
    #pragma unroll 4
    for (int e = e_begin + part; e < e_end; e += parts) {
      // %v_2 = linear(%v3, %w_1) {transpose=False} : edge[2]
      const i64 row2 = (i64)(e) * 2;
      acc_t r_v_2_1[1];
      #pragma unroll
      for (int s = 0; s < 1; ++s) { const int j = s * G + lane; r_v_2_1[s] = j < 2 ? ld(p_v_2 + row2 + j) : (acc_t)0; }
      // %v_5 = gather(%v_4) {via='unique'} : edge[2]
      const i64 row4 = (i64)(g_unique[e]) * 2;
      acc_t r_v_5_3[1];
      #pragma unroll
      for (int s = 0; s < 1; ++s) { const int j = s * G + lane; r_v_5_3[s] = j < 2 ? ld(p_v_4 + row4 + j) : (acc_t)0; }
      // %v7 = add(%v_2, %v_5) : edge[2]
      acc_t r_v7_5[1];
      #pragma unroll
      for (int s = 0; s < 1; ++s) r_v7_5[s] = r_v_2_1[s] + r_v_5_3[s];
      #pragma unroll
      for (int s = 0; s < 1; ++s) { const int j = s * G + lane; (void)j; if (j < 2) st(o_v7 + (i64)(e) * 2 + j, r_v7_5[s]); }
      // %v8 = act(%v7) {fn='leaky_relu', slope=0.2} : edge[2]
      acc_t r_v8_6[1];
      #pragma unroll
      for (int s = 0; s < 1; ++s) r_v8_6[s] = (r_v7_5[s] > (acc_t)0 ? r_v7_5[s] : r_v7_5[s] * (acc_t)0.2);
      // online max and sum of exponentials for %v9
      #pragma unroll
      for (int s = 0; s < 1; ++s) { const acc_t v = r_v8_6[s]; const acc_t mx = hmax(sm_v9_m[s], v); sm_v9_z[s] = sm_v9_z[s] * hexp(sm_v9_m[s] - mx) + hexp(v - mx); sm_v9_m[s] = mx; }
    }
    __syncthreads();  // the previous combine's reads are done
    // walk 1: each group's partial state into the block's buffer
    #pragma unroll
    for (int s = 0; s < 1; ++s) split_buf[(0 + s) * 256 + threadIdx.x] = sm_v9_m[s];
    #pragma unroll
    for (int s = 0; s < 1; ++s) split_buf[(1 + s) * 256 + threadIdx.x] = sm_v9_z[s];
    __syncthreads();
    #pragma unroll
    for (int s = 0; s < 1; ++s) { acc_t mx = HECTOR_NEG_INF, z = 0;
      for (int p = 0; p < 32; ++p) mx = hmax(mx, split_buf[(0 + s) * 256 + p * G + lane]);
      for (int p = 0; p < 32; ++p) { const acc_t m = split_buf[(0 + s) * 256 + p * G + lane]; if (m != HECTOR_NEG_INF) z += split_buf[(1 + s) * 256 + p * G + lane] * hexp(m - mx); }
      sm_v9_m[s] = mx; sm_v9_z[s] = z; }
    acc_t acc_v12[1];  // %v12, summed over the in-edges
    #pragma unroll
    for (int s = 0; s < 1; ++s) acc_v12[s] = 0;
    // walk 2 of 2 over the in-edges of d, every group of the block on its share
    #pragma unroll 4
    for (int e = e_begin + part; e < e_end; e += parts) {
      // %v_2 = linear(%v3, %w_1) {transpose=False} : edge[2]
      const i64 row8 = (i64)(e) * 2;
      acc_t r_v_2_7[1];
      #pragma unroll
      for (int s = 0; s < 1; ++s) { const int j = s * G + lane; r_v_2_7[s] = j < 2 ? ld(p_v_2 + row8 + j) : (acc_t)0; }
      // %v_5 = gather(%v_4) {via='unique'} : edge[2]
      const i64 row10 = (i64)(g_unique[e]) * 2;
      acc_t r_v_5_9[1];
      #pragma unroll
      for (int s = 0; s < 1; ++s) { const int j = s * G + lane; r_v_5_9[s] = j < 2 ? ld(p_v_4 + row10 + j) : (acc_t)0; }
      // %v7 = add(%v_2, %v_5) : edge[2]
      acc_t r_v7_11[1];
      #pragma unroll
      for (int s = 0; s < 1; ++s) r_v7_11[s] = r_v_2_7[s] + r_v_5_9[s];
      // %v8 = act(%v7) {fn='leaky_relu', slope=0.2} : edge[2]
      acc_t r_v8_12[1];
      #pragma unroll
      for (int s = 0; s < 1; ++s) r_v8_12[s] = (r_v7_11[s] > (acc_t)0 ? r_v7_11[s] : r_v7_11[s] * (acc_t)0.2);
      // %v9 = edge_softmax(%v8) : edge[2]
      acc_t r_v9_13[1];
      #pragma unroll
      for (int s = 0; s < 1; ++s) r_v9_13[s] = hexp(r_v8_12[s] - sm_v9_m[s]) / sm_v9_z[s];
      #pragma unroll
      for (int s = 0; s < 1; ++s) { const int j = s * G + lane; (void)j; if (j < 2) st(o_v9 + (i64)(e) * 2 + j, r_v9_13[s]); }
      // %v_7 = gather(%v_6) {via='unique'} : edge[2,4]
      //   reading %v_6 = reshape(%v_3) {shape=(2, 4)} : unique[2,4]
      const i64 row15 = (i64)(g_unique[e]) * 8;
      acc_t r_v_7_14[1];
      #pragma unroll
      for (int s = 0; s < 1; ++s) { const int j = s * G + lane; r_v_7_14[s] = j < 8 ? ld(p_v_3 + row15 + j) : (acc_t)0; }
      acc_t bc16[1];
      #pragma unroll
      for (int s = 0; s < 1; ++s) bc16[s] = __shfl_sync(gmask, r_v9_13[0], min((s * G + lane) / 4, 1), G);
      // %v_8 = mul(%v9, %v_7) : edge[2,4]
      acc_t r_v_8_17[1];
      #pragma unroll
      for (int s = 0; s < 1; ++s) r_v_8_17[s] = bc16[s] * r_v_7_14[s];
      // sum into the destination: %v12 = scatter_add(%v_8) {via='dst'} : node[2,4]
      #pragma unroll
      for (int s = 0; s < 1; ++s) acc_v12[s] += r_v_8_17[s];
    }
    __syncthreads();  // the previous combine's reads are done
    // walk 2: each group's partial state into the block's buffer
    #pragma unroll
    for (int s = 0; s < 1; ++s) split_buf[(0 + s) * 256 + threadIdx.x] = acc_v12[s];
    __syncthreads();
    #pragma unroll
    for (int s = 0; s < 1; ++s) { acc_t t = 0; for (int p = 0; p < 32; ++p) t += split_buf[(0 + s) * 256 + p * G + lane]; acc_v12[s] = t; }
    // %v13 = reshape(%v12) {shape=(8,)} : node[8]  (same registers as %v12)
    // %v14 = select(%bias) {domain='node'} : node[8]
    const i64 row19 = (i64)(0) * 8;
    acc_t r_v14_18[1];
    #pragma unroll
    for (int s = 0; s < 1; ++s) { const int j = s * G + lane; r_v14_18[s] = j < 8 ? ld(p_bias + row19 + j) : (acc_t)0; }
    // %v15 = add(%v13, %v14) : node[8]
    acc_t r_v15_20[1];
    #pragma unroll
    for (int s = 0; s < 1; ++s) r_v15_20[s] = acc_v12[s] + r_v14_18[s];
    #pragma unroll
    for (int s = 0; s < 1; ++s) { const int j = s * G + lane; (void)j; if (j < 8 && lead) st(o_v15 + (i64)d * 8 + j, r_v15_20[s]); }
  }
  if (walked < parts && w0 + walked < n_work) break;  // the rest of the order: one group each
  c += gridDim.x;
  walked = 0;
  }
  for (i64 w = c * 32 + part + (part < walked ? groups : 0); w < n_work; w += groups) {
  const bool lead = true;
  (void)lead;
  const int d = dst_order[w];  // destination node (heaviest first)
  const int e_begin = csc_ptr[d], e_end = csc_ptr[d + 1];
  acc_t sm_v9_m[1], sm_v9_z[1];  // statistics of %v9
  #pragma unroll
  for (int s = 0; s < 1; ++s) { sm_v9_m[s] = HECTOR_NEG_INF; sm_v9_z[s] = 0; }
  // walk 1 of 2 over the in-edges of d
  #pragma unroll 4
  for (int e = e_begin; e < e_end; ++e) {
    // %v_2 = linear(%v3, %w_1) {transpose=False} : edge[2]
    const i64 row2 = (i64)(e) * 2;
    acc_t r_v_2_1[1];
    #pragma unroll
    for (int s = 0; s < 1; ++s) { const int j = s * G + lane; r_v_2_1[s] = j < 2 ? ld(p_v_2 + row2 + j) : (acc_t)0; }
    // %v_5 = gather(%v_4) {via='unique'} : edge[2]
    const i64 row4 = (i64)(g_unique[e]) * 2;
    acc_t r_v_5_3[1];
    #pragma unroll
    for (int s = 0; s < 1; ++s) { const int j = s * G + lane; r_v_5_3[s] = j < 2 ? ld(p_v_4 + row4 + j) : (acc_t)0; }
    // %v7 = add(%v_2, %v_5) : edge[2]
    acc_t r_v7_5[1];
    #pragma unroll
    for (int s = 0; s < 1; ++s) r_v7_5[s] = r_v_2_1[s] + r_v_5_3[s];
    #pragma unroll
    for (int s = 0; s < 1; ++s) { const int j = s * G + lane; (void)j; if (j < 2) st(o_v7 + (i64)(e) * 2 + j, r_v7_5[s]); }
    // %v8 = act(%v7) {fn='leaky_relu', slope=0.2} : edge[2]
    acc_t r_v8_6[1];
    #pragma unroll
    for (int s = 0; s < 1; ++s) r_v8_6[s] = (r_v7_5[s] > (acc_t)0 ? r_v7_5[s] : r_v7_5[s] * (acc_t)0.2);
    // online max and sum of exponentials for %v9
    #pragma unroll
    for (int s = 0; s < 1; ++s) { const acc_t v = r_v8_6[s]; const acc_t mx = hmax(sm_v9_m[s], v); sm_v9_z[s] = sm_v9_z[s] * hexp(sm_v9_m[s] - mx) + hexp(v - mx); sm_v9_m[s] = mx; }
  }
  acc_t acc_v12[1];  // %v12, summed over the in-edges
  #pragma unroll
  for (int s = 0; s < 1; ++s) acc_v12[s] = 0;
  // walk 2 of 2 over the in-edges of d
  #pragma unroll 4
  for (int e = e_begin; e < e_end; ++e) {
    // %v_2 = linear(%v3, %w_1) {transpose=False} : edge[2]
    const i64 row8 = (i64)(e) * 2;
    acc_t r_v_2_7[1];
    #pragma unroll
    for (int s = 0; s < 1; ++s) { const int j = s * G + lane; r_v_2_7[s] = j < 2 ? ld(p_v_2 + row8 + j) : (acc_t)0; }
    // %v_5 = gather(%v_4) {via='unique'} : edge[2]
    const i64 row10 = (i64)(g_unique[e]) * 2;
    acc_t r_v_5_9[1];
    #pragma unroll
    for (int s = 0; s < 1; ++s) { const int j = s * G + lane; r_v_5_9[s] = j < 2 ? ld(p_v_4 + row10 + j) : (acc_t)0; }
    // %v7 = add(%v_2, %v_5) : edge[2]
    acc_t r_v7_11[1];
    #pragma unroll
    for (int s = 0; s < 1; ++s) r_v7_11[s] = r_v_2_7[s] + r_v_5_9[s];
    // %v8 = act(%v7) {fn='leaky_relu', slope=0.2} : edge[2]
    acc_t r_v8_12[1];
    #pragma unroll
    for (int s = 0; s < 1; ++s) r_v8_12[s] = (r_v7_11[s] > (acc_t)0 ? r_v7_11[s] : r_v7_11[s] * (acc_t)0.2);
    // %v9 = edge_softmax(%v8) : edge[2]
    acc_t r_v9_13[1];
    #pragma unroll
    for (int s = 0; s < 1; ++s) r_v9_13[s] = hexp(r_v8_12[s] - sm_v9_m[s]) / sm_v9_z[s];
    #pragma unroll
    for (int s = 0; s < 1; ++s) { const int j = s * G + lane; (void)j; if (j < 2) st(o_v9 + (i64)(e) * 2 + j, r_v9_13[s]); }
    // %v_7 = gather(%v_6) {via='unique'} : edge[2,4]
    //   reading %v_6 = reshape(%v_3) {shape=(2, 4)} : unique[2,4]
    const i64 row15 = (i64)(g_unique[e]) * 8;
    acc_t r_v_7_14[1];
    #pragma unroll
    for (int s = 0; s < 1; ++s) { const int j = s * G + lane; r_v_7_14[s] = j < 8 ? ld(p_v_3 + row15 + j) : (acc_t)0; }
    acc_t bc16[1];
    #pragma unroll
    for (int s = 0; s < 1; ++s) bc16[s] = __shfl_sync(gmask, r_v9_13[0], min((s * G + lane) / 4, 1), G);
    // %v_8 = mul(%v9, %v_7) : edge[2,4]
    acc_t r_v_8_17[1];
    #pragma unroll
    for (int s = 0; s < 1; ++s) r_v_8_17[s] = bc16[s] * r_v_7_14[s];
    // sum into the destination: %v12 = scatter_add(%v_8) {via='dst'} : node[2,4]
    #pragma unroll
    for (int s = 0; s < 1; ++s) acc_v12[s] += r_v_8_17[s];
  }
  // %v13 = reshape(%v12) {shape=(8,)} : node[8]  (same registers as %v12)
  // %v14 = select(%bias) {domain='node'} : node[8]
  const i64 row19 = (i64)(0) * 8;
  acc_t r_v14_18[1];
  #pragma unroll
  for (int s = 0; s < 1; ++s) { const int j = s * G + lane; r_v14_18[s] = j < 8 ? ld(p_bias + row19 + j) : (acc_t)0; }
  // %v15 = add(%v13, %v14) : node[8]
  acc_t r_v15_20[1];
  #pragma unroll
  for (int s = 0; s < 1; ++s) r_v15_20[s] = acc_v12[s] + r_v14_18[s];
  #pragma unroll
  for (int s = 0; s < 1; ++s) { const int j = s * G + lane; (void)j; if (j < 8 && lead) st(o_v15 + (i64)d * 8 + j, r_v15_20[s]); }
  }
}
#ifdef HECTOR_EMULATE  // entry points for the CPU emulator used by the tests
extern "C" void hector_emu_k0_param(void** a) { k0_param(*(float**)a[0], *(const float**)a[1], *(const float**)a[2]); }
extern "C" void hector_emu_k1_gemm(void** a) { k1_gemm(*(const int**)a[0], *(const int**)a[1], *(const int**)a[2], *(const float**)a[3], *(const float**)a[4], *(float**)a[5]); }
extern "C" void hector_emu_k2_gemm(void** a) { k2_gemm(*(const int**)a[0], *(const int**)a[1], *(const int**)a[2], *(const float**)a[3], *(const float**)a[4], *(float**)a[5]); }
extern "C" void hector_emu_k3_gemm(void** a) { k3_gemm(*(const int**)a[0], *(const int**)a[1], *(const float**)a[2], *(const float**)a[3], *(float**)a[4]); }
extern "C" void hector_emu_k4_traversal(void** a) { k4_traversal(*(const float**)a[0], *(const int**)a[1], *(const float**)a[2], *(float**)a[3], *(float**)a[4], *(const float**)a[5], *(const float**)a[6], *(float**)a[7], *(const int**)a[8], *(const int**)a[9], *(i64*)a[10]); }
#endif
