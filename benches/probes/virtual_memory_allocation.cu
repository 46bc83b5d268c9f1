// Device memory through the virtual-memory API against cudaMalloc, in the states a load meets:
// right after 8 GiB were freed, and 250 ms after.
#include <cuda.h>
#include <cuda_runtime.h>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>
#include <algorithm>
#include <cstdlib>
#define CK(x) do { auto err_ = (x); if ((int)err_ != 0) { printf("%s: %d line %d\n", #x, (int)err_, __LINE__); exit(1);} } while (0)
using clk = std::chrono::steady_clock;
static double ms(clk::time_point a, clk::time_point b) { return std::chrono::duration<double, std::milli>(b - a).count(); }
static const size_t GiB = 1ull << 30;
struct Vmm { CUdeviceptr va; CUmemGenericAllocationHandle h; size_t bytes; };
static CUmemAllocationProp prop() { CUmemAllocationProp p = {}; p.type = CU_MEM_ALLOCATION_TYPE_PINNED; p.location.type = CU_MEM_LOCATION_TYPE_DEVICE; p.location.id = 0; return p; }
static Vmm vmm_alloc(size_t bytes) {
  Vmm v; v.bytes = bytes; auto p = prop();
  CK(cuMemAddressReserve(&v.va, bytes, 0, 0, 0));
  CK(cuMemCreate(&v.h, bytes, &p, 0));
  CK(cuMemMap(v.va, bytes, 0, v.h, 0));
  CUmemAccessDesc a = {}; a.location = p.location; a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CK(cuMemSetAccess(v.va, bytes, &a, 1));
  return v;
}
static void vmm_free(Vmm v) { CK(cuMemUnmap(v.va, v.bytes)); CK(cuMemRelease(v.h)); CK(cuMemAddressFree(v.va, v.bytes)); }
int main() {
  CK(cudaSetDevice(0)); CK(cudaFree(0));
  size_t gran = 0; auto p = prop(); CK(cuMemGetAllocationGranularity(&gran, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  printf("granularity %zu\n", gran);
  const char* names[] = {"cudaMalloc/cudaFree", "VMM create/map, unmap/release"};
  for (int kind = 0; kind < 2; kind++) {
    for (int pause : {0, 250, 250}) {
      std::vector<double> t;
      for (int rep = 0; rep < 5; rep++) {
        // the last load: 8 GiB, written, freed the same way
        void* q = nullptr; Vmm w{};
        if (kind == 0) { CK(cudaMalloc(&q, 8 * GiB)); CK(cudaMemset(q, 1, 8 * GiB)); CK(cudaDeviceSynchronize()); CK(cudaFree(q)); }
        else { w = vmm_alloc(8 * GiB); CK(cudaMemset((void*)w.va, 1, 8 * GiB)); CK(cudaDeviceSynchronize()); vmm_free(w); }
        std::this_thread::sleep_for(std::chrono::milliseconds(pause));
        auto a = clk::now();
        if (kind == 0) { CK(cudaMalloc(&q, 8 * GiB)); t.push_back(ms(a, clk::now())); CK(cudaFree(q)); }
        else { w = vmm_alloc(8 * GiB); t.push_back(ms(a, clk::now())); vmm_free(w); }
      }
      std::sort(t.begin(), t.end());
      printf("%-32s pause %3d ms: allocate 8 GiB %.3f ms (min %.3f max %.3f)\n", names[kind], pause, t[2], t[0], t[4]);
    }
  }
  // copies into VMM memory run at the link?
  void* h; CK(cudaMallocHost(&h, 1 * GiB)); Vmm v = vmm_alloc(1 * GiB); cudaStream_t s; CK(cudaStreamCreate(&s));
  for (int i = 0; i < 3; i++) { auto a = clk::now(); CK(cudaMemcpyAsync((void*)v.va, h, GiB, cudaMemcpyHostToDevice, s)); CK(cudaStreamSynchronize(s)); double m = ms(a, clk::now()); printf("H2D 1 GiB into VMM memory: %.1f GB/s\n", GiB / m / 1e6); }
}
