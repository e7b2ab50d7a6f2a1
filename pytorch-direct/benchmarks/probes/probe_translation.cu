// Probe P7 (benchmarks/RESULTS.md): how fast the GPU reads random rows from host memory of each kind, by table
// size. Run R and probe P6: zero-copy reads of random 256 B rows run at 27.9 GB/s from a 1 GiB table, 7.9 from
// 16 GiB and 7.1 from 48 GiB, and a table on transparent huge pages (registered) reads no faster. Does memory the
// GPU maps with larger pages (hugetlbfs 2 MiB / 1 GiB pages, registered; or managed memory kept on the host and
// mapped by the GPU) keep its reach? One kernel for all (16-byte loads, consecutive threads on one row).
//
// Also host memory from the virtual memory API (cuMemCreate at a host NUMA node, mapped for the GPU and the CPU):
// it can be shared with other processes as a file descriptor, which managed memory cannot.
//
//   nvcc -O3 -std=c++17 -arch=sm_90 probe_translation.cu -o probe_translation -lcuda && ./probe_translation 1 16 48
//   PROBE_KINDS=cudaHostAlloc,vmm-host-numa ./probe_translation 16   # some kinds only
#include <cuda.h>
#include <cuda_runtime.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

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

static void touch(char* p, std::size_t bytes) {  // fault every page in, 16 threads
  std::vector<std::thread> threads;
  const std::size_t part = (bytes / 16 + 4095) / 4096 * 4096;
  for (int t = 0; t < 16; ++t)
    threads.emplace_back([=] {
      const std::size_t a = std::min(bytes, t * part), b = std::min(bytes, a + part);
      if (b > a) std::memset(p + a, t + 1, b - a);
    });
  for (auto& th : threads) th.join();
}

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Table {
  char* host = nullptr;    // what the CPU sees
  void* device = nullptr;  // what kernels read
  std::string kind;
  CUmemGenericAllocationHandle vmm = 0;  // vmm-host-numa
  std::size_t mapped = 0;
};

#define CU_CHECK(x)                                                                \
  do {                                                                             \
    CUresult r = (x);                                                              \
    if (r != CUDA_SUCCESS) {                                                       \
      const char* what = nullptr;                                                  \
      cuGetErrorString(r, &what);                                                  \
      std::printf("# %s failed: %s (line %d)\n", #x, what ? what : "?", __LINE__); \
      return false;                                                                \
    }                                                                              \
  } while (0)

// cuMemCreate at host NUMA node 0, shareable as a POSIX file descriptor, mapped read-write for GPU 0 and the CPU.
static bool make_vmm_host(std::size_t bytes, Table& t) {
  cudaFree(nullptr);  // the runtime's context is the driver API's current context
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
  prop.location.id = 0;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  std::size_t granularity = 0;
  CU_CHECK(cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  const std::size_t size = (bytes + granularity - 1) / granularity * granularity;
  std::printf("# vmm-host-numa: granularity %zu KiB\n", granularity >> 10);
  CU_CHECK(cuMemCreate(&t.vmm, size, &prop, 0));
  CUdeviceptr ptr = 0;
  CU_CHECK(cuMemAddressReserve(&ptr, size, granularity, 0, 0));
  CU_CHECK(cuMemMap(ptr, size, 0, t.vmm, 0));
  t.mapped = size;
  t.host = reinterpret_cast<char*>(ptr);
  CUmemAccessDesc access[2]{};
  access[0].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access[0].location.id = 0;
  access[0].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  access[1].location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
  access[1].location.id = 0;
  access[1].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CU_CHECK(cuMemSetAccess(ptr, size, access, 2));
  int fd = -1;
  CU_CHECK(cuMemExportToShareableHandle(&fd, t.vmm, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  std::printf("# vmm-host-numa: exported as file descriptor %d\n", fd);
  close(fd);
  t.device = t.host;
  return true;
}

// Reserves (or with pages = 0 returns) huge pages of one size: hugetlbfs memory must be set aside first.
static long reserve(const char* size_dir, std::size_t pages) {
  const std::string path = std::string("/sys/kernel/mm/hugepages/") + size_dir + "/nr_hugepages";
  if (FILE* f = std::fopen(path.c_str(), "w")) {
    std::fprintf(f, "%zu\n", pages);
    std::fclose(f);
  }
  long got = -1;
  if (FILE* f = std::fopen(path.c_str(), "r")) {
    if (std::fscanf(f, "%ld", &got) != 1) got = -1;
    std::fclose(f);
  }
  return got;
}

static bool make(const std::string& kind, std::size_t bytes, Table& t, double& seconds) {
  const double t0 = now();
  if (kind == "hugetlb2M+register")
    std::printf("# reserved %ld of %zu 2 MiB pages\n", reserve("hugepages-2048kB", bytes >> 21), bytes >> 21);
  if (kind == "hugetlb1G+register")
    std::printf("# reserved %ld of %zu 1 GiB pages\n", reserve("hugepages-1048576kB", bytes >> 30), bytes >> 30);
  t.kind = kind;
  if (kind == "cudaHostAlloc") {
    CHECK(cudaHostAlloc(reinterpret_cast<void**>(&t.host), bytes, cudaHostAllocPortable | cudaHostAllocMapped));
    touch(t.host, bytes);
  } else if (kind == "thp+register" || kind == "hugetlb2M+register" || kind == "hugetlb1G+register") {
    int flags = MAP_PRIVATE | MAP_ANONYMOUS;
    if (kind == "hugetlb2M+register") flags |= MAP_HUGETLB | (21 << MAP_HUGE_SHIFT);
    if (kind == "hugetlb1G+register") flags |= MAP_HUGETLB | (30 << MAP_HUGE_SHIFT);
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, flags, -1, 0);
    if (p == MAP_FAILED) {
      t.host = nullptr;
      std::printf("# %s: mmap failed: %s\n", kind.c_str(), std::strerror(errno));
      return false;
    }
    if (kind == "thp+register") madvise(p, bytes, MADV_HUGEPAGE);
    t.host = static_cast<char*>(p);
    touch(t.host, bytes);
    CHECK(cudaHostRegister(p, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped));
  } else if (kind == "vmm-host-numa") {
    if (!make_vmm_host(bytes, t)) return false;
    touch(t.host, bytes);
  } else if (kind == "managed-host") {
    CHECK(cudaMallocManaged(reinterpret_cast<void**>(&t.host), bytes));
    cudaMemLocation host{cudaMemLocationTypeHost, 0}, gpu{cudaMemLocationTypeDevice, 0};
    CHECK(cudaMemAdvise(t.host, bytes, cudaMemAdviseSetPreferredLocation, host));
    CHECK(cudaMemAdvise(t.host, bytes, cudaMemAdviseSetAccessedBy, gpu));
    touch(t.host, bytes);
  }
  if (kind == "managed-host" || kind == "vmm-host-numa") {
    t.device = t.host;
  } else {
    CHECK(cudaHostGetDevicePointer(&t.device, t.host, 0));
  }
  seconds = now() - t0;
  return true;
}

static void release(Table& t, std::size_t bytes) {
  if (t.kind == "cudaHostAlloc") cudaFreeHost(t.host);
  if (t.kind == "managed-host") cudaFree(t.host);
  if (t.kind == "vmm-host-numa" && t.vmm != 0) {
    if (t.mapped) {
      cuMemUnmap(reinterpret_cast<CUdeviceptr>(t.host), t.mapped);
      cuMemAddressFree(reinterpret_cast<CUdeviceptr>(t.host), t.mapped);
    }
    cuMemRelease(t.vmm);
  }
  if (t.kind.find("register") != std::string::npos && t.host != nullptr) {  // never munmap(nullptr, ...)
    cudaHostUnregister(t.host);
    munmap(t.host, bytes);
  }
  if (t.kind == "hugetlb2M+register") reserve("hugepages-2048kB", 0);
  if (t.kind == "hugetlb1G+register") reserve("hugepages-1048576kB", 0);
  t = Table{};
}

// GB/s of the gather: (first call, best of 3 after it).
static std::pair<double, double> time_gather(const Table& t, std::size_t bytes, int row_bytes, bool sorted,
                                             std::int64_t n, std::uint64_t seed, void* out, std::int64_t* idx) {
  const std::int64_t rows = bytes / row_bytes;
  std::vector<std::int64_t> h(n);
  std::mt19937_64 rng(seed);
  for (auto& x : h) x = rng() % rows;
  if (sorted) std::sort(h.begin(), h.end());
  cudaMemcpy(idx, h.data(), n * 8, cudaMemcpyHostToDevice);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  double first = 0, best = 0;
  for (int rep = 0; rep < 4; ++rep) {
    cudaEventRecord(a);
    gather<<<132 * 16, 256>>>(static_cast<const uint4*>(t.device), idx, static_cast<uint4*>(out), n, row_bytes / 16);
    cudaEventRecord(b);
    if (cudaError_t e = cudaEventSynchronize(b); e != cudaSuccess) {
      std::printf("# gather failed: %s\n", cudaGetErrorString(e));
      std::exit(1);
    }
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    const double gbps = double(n) * row_bytes / (ms * 1e-3) / 1e9;
    if (rep == 0)
      first = gbps;
    else
      best = std::max(best, gbps);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return {first, best};
}

int main(int argc, char** argv) {
  std::vector<double> gibs;
  for (int i = 1; i < argc; ++i) gibs.push_back(std::atof(argv[i]));
  if (gibs.empty()) gibs = {1, 16, 48};
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  int pageable = 0, uses_host_pt = 0;
  cudaDeviceGetAttribute(&pageable, cudaDevAttrPageableMemoryAccess, 0);
  cudaDeviceGetAttribute(&uses_host_pt, cudaDevAttrPageableMemoryAccessUsesHostPageTables, 0);
  std::printf("# %s | pageableMemoryAccess %d usesHostPageTables %d\n", prop.name, pageable, uses_host_pt);
  const std::int64_t n = 1 << 20;
  void* out = nullptr;
  std::int64_t* idx = nullptr;
  cudaMalloc(&out, std::size_t(n) * 1024);
  cudaMalloc(reinterpret_cast<void**>(&idx), n * 8);
  std::printf("gib,kind,row_bytes,order,first_gbps,best_gbps\n");
  std::vector<std::string> kinds = {"cudaHostAlloc", "hugetlb2M+register", "hugetlb1G+register", "managed-host",
                                    "vmm-host-numa"};
  if (const char* only = std::getenv("PROBE_KINDS")) {
    kinds.clear();
    const std::string list = only;
    for (std::size_t at = 0; at <= list.size();) {
      const std::size_t comma = std::min(list.find(',', at), list.size());
      kinds.push_back(list.substr(at, comma - at));
      at = comma + 1;
    }
  }
  for (double gib : gibs) {
    const std::size_t bytes = std::size_t(gib * (1ull << 30));
    for (const std::string& kind : kinds) {
      Table t;
      double made = 0;
      if (!make(kind, bytes, t, made)) {
        release(t, bytes);
        continue;
      }
      std::printf("# %g GiB %s: made in %.1f s\n", gib, kind.c_str(), made);
      std::fflush(stdout);
      for (int rb : {64, 256, 1024}) {
        for (bool sorted : {false, true}) {
          time_gather(t, bytes, rb, sorted, n, 7, out, idx);  // warm-up on other indices
          auto [first, best] = time_gather(t, bytes, rb, sorted, n, 11 + rb, out, idx);
          std::printf("%g,%s,%d,%s,%.2f,%.2f\n", gib, kind.c_str(), rb, sorted ? "sorted" : "uniform", first, best);
          std::fflush(stdout);
        }
      }
      release(t, bytes);
    }
  }
  return 0;
}
