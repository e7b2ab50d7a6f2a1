// Probe: how fast a large managed table (host-preferred, mapped into the GPU) can be made ready, against a parallel
// memset of the same bytes, and whether the way it is made changes how fast the GPU then reads random rows from it.
// pd.empty of 64 GiB took 1.75x the faster of two memsets on an H100 host (benchmarks/first_use.py): each CPU
// fault in a managed range goes through the UVM driver, which also maps the page on every GPU named accessed-by.
//
// Variants (each made, timed, read by a random-row gather, freed):
//   memset          malloc (page-aligned) + 16 threads memset: the reference (run first and last)
//   advise-touch    cudaMallocManaged, preferred location host + accessed-by GPU, then one write per 4 KiB page
//                   by 16 threads (what pytorch-direct does today)
//   touch-advise    the same with accessed-by set after the pages are in (one bulk mapping instead of per fault)
//   advise-populate preferred + accessed-by, then madvise(MADV_POPULATE_WRITE) per 64 MiB chunk by 16 threads
//   touch-populate  preferred location, MADV_POPULATE_WRITE, then accessed-by
//   advise-prefetch preferred + accessed-by, then one cudaMemPrefetchAsync of the whole range to the host (the
//                   driver populates the pages in bulk instead of one CPU fault per page)
//   prefetch-chunks the same in 64 MiB prefetches on 16 streams
//   advise-touch-N  advise-touch with N threads (the faults are spent in the driver: more threads than cores may
//                   hide their waits)
//
//   nvcc -O3 -std=c++17 -arch=sm_90 probe_managed_create.cu -o probe_managed_create && ./probe_managed_create 64
//   ./probe_managed_create 64 memset,advise-prefetch,memset   # chosen kinds, in order
#include <cuda_runtime.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14
#endif

#define CHECK(x)                                                                       \
  do {                                                                                 \
    cudaError_t e = (x);                                                               \
    if (e != cudaSuccess) {                                                            \
      std::printf("# %s failed: %s (line %d)\n", #x, cudaGetErrorString(e), __LINE__); \
      return false;                                                                    \
    }                                                                                  \
  } while (0)

__global__ void gather(const uint4* table, const std::int64_t* idx, uint4* out, std::int64_t n, int row_vecs) {
  const std::int64_t total = n * row_vecs;
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < total;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t r = i / row_vecs;
    out[i] = table[idx[r] * row_vecs + i % row_vecs];
  }
}

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

constexpr int kThreads = 16;
constexpr std::size_t kChunk = std::size_t(64) << 20;

// body(begin, end) over [0, bytes) in 64 MiB chunks claimed by `count` threads
template <class F>
static void parallel_chunks(std::size_t bytes, F body, int count = kThreads) {
  std::atomic<std::size_t> next{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < count; ++t)
    threads.emplace_back([&] {
      for (std::size_t a; (a = next.fetch_add(kChunk)) < bytes;) body(a, std::min(bytes, a + kChunk));
    });
  for (auto& th : threads) th.join();
}

static void touch(char* p, std::size_t bytes, int threads = kThreads) {
  parallel_chunks(
      bytes,
      [p = static_cast<volatile char*>(p)](std::size_t a, std::size_t b) {
        for (std::size_t at = a; at < b; at += 4096) p[at] = 0;
      },
      threads);
}

static bool prefetch_to_host(char* p, std::size_t bytes, int streams) {
  cudaMemLocation host{};
  host.type = cudaMemLocationTypeHost;
  std::vector<cudaStream_t> s(streams);
  for (auto& x : s) CHECK(cudaStreamCreateWithFlags(&x, cudaStreamNonBlocking));
  const std::size_t step = streams == 1 ? bytes : kChunk;
  int i = 0;
  for (std::size_t a = 0; a < bytes; a += step, ++i)
    CHECK(cudaMemPrefetchAsync(p + a, std::min(step, bytes - a), host, 0, s[i % streams]));
  for (auto& x : s) {
    CHECK(cudaStreamSynchronize(x));
    CHECK(cudaStreamDestroy(x));
  }
  return true;
}

static bool populate(char* p, std::size_t bytes) {
  std::atomic<int> failed{0};
  parallel_chunks(bytes, [&](std::size_t a, std::size_t b) {
    if (madvise(p + a, b - a, MADV_POPULATE_WRITE) != 0) failed = errno;
  });
  if (failed) std::printf("# madvise(MADV_POPULATE_WRITE) failed: %s\n", std::strerror(failed));
  return !failed;
}

static bool advise(void* p, std::size_t bytes, bool preferred, bool accessed) {
  if (preferred) {
    cudaMemLocation host{};
    host.type = cudaMemLocationTypeHost;
    CHECK(cudaMemAdvise(p, bytes, cudaMemAdviseSetPreferredLocation, host));
  }
  if (accessed) {
    cudaMemLocation gpu{};
    gpu.type = cudaMemLocationTypeDevice;
    gpu.id = 0;
    CHECK(cudaMemAdvise(p, bytes, cudaMemAdviseSetAccessedBy, gpu));
  }
  return true;
}

// GB/s of random 256 B rows read by the GPU from `table` (1M rows, best of 3)
static double read_gbps(const void* table, std::size_t bytes) {
  const int row_vecs = 16;
  const std::int64_t rows = static_cast<std::int64_t>(bytes / 256), n = 1 << 20;
  std::vector<std::int64_t> idx(n);
  std::mt19937_64 rng(1);
  for (auto& i : idx) i = static_cast<std::int64_t>(rng() % rows);
  std::int64_t* d_idx = nullptr;
  uint4* out = nullptr;
  if (cudaMalloc(&d_idx, n * 8) != cudaSuccess || cudaMalloc(&out, n * 256) != cudaSuccess) return -1;
  cudaMemcpy(d_idx, idx.data(), n * 8, cudaMemcpyHostToDevice);
  double best = 1e30;
  for (int rep = 0; rep < 4; ++rep) {
    cudaDeviceSynchronize();
    const double t0 = now();
    gather<<<1024, 512>>>(static_cast<const uint4*>(table), d_idx, out, n, row_vecs);
    if (cudaDeviceSynchronize() != cudaSuccess) return -1;
    if (rep > 0) best = std::min(best, now() - t0);
  }
  cudaFree(d_idx);
  cudaFree(out);
  return n * 256.0 / best / 1e9;
}

static bool run(const std::string& kind, std::size_t bytes) {
  const double t0 = now();
  char* p = nullptr;
  bool managed = kind != "memset";
  if (!managed) {
    p = static_cast<char*>(std::aligned_alloc(std::size_t(2) << 20, bytes));
    if (p == nullptr) return false;
    parallel_chunks(bytes, [p](std::size_t a, std::size_t b) { std::memset(p + a, 0, b - a); });
  } else {
    void* v = nullptr;
    CHECK(cudaMallocManaged(&v, bytes, cudaMemAttachGlobal));
    p = static_cast<char*>(v);
    if (kind == "advise-touch") {
      if (!advise(p, bytes, true, true)) return false;
      touch(p, bytes);
    } else if (kind == "touch-advise") {
      if (!advise(p, bytes, true, false)) return false;
      touch(p, bytes);
      if (!advise(p, bytes, false, true)) return false;
    } else if (kind.rfind("advise-touch-", 0) == 0) {  // advise-touch-N: N threads
      if (!advise(p, bytes, true, true)) return false;
      touch(p, bytes, std::atoi(kind.c_str() + std::strlen("advise-touch-")));
    } else if (kind == "advise-prefetch") {
      if (!advise(p, bytes, true, true) || !prefetch_to_host(p, bytes, 1)) return false;
    } else if (kind == "prefetch-chunks") {
      if (!advise(p, bytes, true, true) || !prefetch_to_host(p, bytes, 16)) return false;
    } else if (kind == "advise-populate") {
      if (!advise(p, bytes, true, true) || !populate(p, bytes)) return false;
    } else if (kind == "touch-populate") {
      if (!advise(p, bytes, true, false) || !populate(p, bytes) || !advise(p, bytes, false, true)) return false;
    } else {
      std::printf("# unknown kind %s\n", kind.c_str());
      return false;
    }
  }
  const double made = now() - t0;
  double gbps = -1;
  if (managed) {
    gbps = read_gbps(p, bytes);
  }
  const double t1 = now();
  if (managed)
    cudaFree(p);
  else
    std::free(p);
  const double freed = now() - t1;
  std::printf("%-16s %6.1f GiB  made in %6.2f s (%6.2f GB/s)  freed in %5.2f s  random 256 B rows %7.2f GB/s\n",
              kind.c_str(), bytes / double(1 << 30), made, bytes / made / 1e9, freed, gbps);
  std::fflush(stdout);
  return true;
}

int main(int argc, char** argv) {
  const double gib = argc > 1 ? std::atof(argv[1]) : 16;
  const std::size_t bytes = static_cast<std::size_t>(gib * (1 << 30)) / (2 << 20) * (2 << 20);
  cudaFree(nullptr);  // the context, before any timing
  // argv[2]: a comma-separated list of kinds, in order (default: all, the memset first and again at the end)
  std::vector<std::string> kinds;
  if (argc > 2) {
    std::string list = argv[2];
    for (std::size_t at = 0; at <= list.size();) {
      const std::size_t comma = std::min(list.find(',', at), list.size());
      kinds.push_back(list.substr(at, comma - at));
      at = comma + 1;
    }
  } else {
    kinds = {"memset",          "advise-touch", "advise-prefetch", "prefetch-chunks", "advise-touch-32",
             "advise-populate", "memset",       "advise-touch",    "advise-prefetch"};
  }
  bool ok = true;
  for (const auto& k : kinds) ok = run(k, bytes) && ok;
  return ok ? 0 : 1;
}
