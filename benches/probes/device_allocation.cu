// What a device allocation costs on the host, in the states a checkpoint load meets it:
// a process's first, right after freeing 8 GiB, and 250 ms after freeing 8 GiB; and whether
// an allocation on one thread stalls copies queued by another.
#include <cuda_runtime.h>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>
#include <atomic>
#include <algorithm>
#include <cstdlib>

#define CK(x) do { cudaError_t err_ = (x); if (err_ != cudaSuccess) { printf("%s: %s line %d\n", #x, cudaGetErrorString(err_), __LINE__); exit(1);} } while (0)
using clk = std::chrono::steady_clock;
static double ms(clk::time_point a, clk::time_point b) { return std::chrono::duration<double, std::milli>(b - a).count(); }
static const size_t GiB = 1ull << 30, MiB = 1ull << 20;

static void churn() {  // what a load leaves: 8 GiB allocated, written, freed
  void* p; CK(cudaMalloc(&p, 8 * GiB)); CK(cudaMemset(p, 1, 8 * GiB)); CK(cudaDeviceSynchronize()); CK(cudaFree(p));
}
static void pause_ms(int m) { std::this_thread::sleep_for(std::chrono::milliseconds(m)); }

int main() {
  CK(cudaSetDevice(0)); CK(cudaFree(0));
  {
    auto a = clk::now(); void* p; CK(cudaMalloc(&p, 8 * GiB)); auto b = clk::now();
    printf("first in process: cudaMalloc 8 GiB %.3f ms\n", ms(a, b)); CK(cudaFree(p));
  }
  cudaStream_t s; CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const char* names[] = {"malloc 8G", "malloc 64M then rest", "event sync then malloc 8G", "mallocAsync 8G (call)", "malloc 2M then 8G"};
  for (int variant = 0; variant < 5; variant++) {
    for (int state = 0; state < 2; state++) {
      std::vector<double> t1, t2;
      for (int rep = 0; rep < 5; rep++) {
        churn();
        if (state == 1) pause_ms(250);
        void *p = nullptr, *q = nullptr;
        auto a = clk::now(); double first = 0;
        if (variant == 0) { CK(cudaMalloc(&p, 8 * GiB)); }
        if (variant == 1) { CK(cudaMalloc(&p, 64 * MiB)); first = ms(a, clk::now()); CK(cudaMalloc(&q, 8 * GiB - 64 * MiB)); }
        if (variant == 2) { cudaEvent_t e; CK(cudaEventCreate(&e)); CK(cudaEventRecord(e, s)); CK(cudaEventSynchronize(e)); first = ms(a, clk::now()); CK(cudaMalloc(&p, 8 * GiB)); CK(cudaEventDestroy(e)); }
        if (variant == 3) { CK(cudaMallocAsync(&p, 8 * GiB, s)); first = ms(a, clk::now()); CK(cudaStreamSynchronize(s)); }
        if (variant == 4) { CK(cudaMalloc(&p, 2 * MiB)); first = ms(a, clk::now()); CK(cudaMalloc(&q, 8 * GiB)); }
        auto b = clk::now();
        t1.push_back(first); t2.push_back(ms(a, b));
        if (variant == 3) { CK(cudaFreeAsync(p, s)); CK(cudaStreamSynchronize(s)); } else { CK(cudaFree(p)); if (q) CK(cudaFree(q)); }
      }
      std::sort(t1.begin(), t1.end()); std::sort(t2.begin(), t2.end());
      printf("%-28s %-12s first step %.3f ms (min %.3f max %.3f), all %.3f ms (min %.3f max %.3f)\n", names[variant],
             state ? "after pause" : "after free", t1[2], t1[0], t1[4], t2[2], t2[0], t2[4]);
    }
  }
  // Does cudaMalloc on another thread stall copies? Thread A streams 64 x 16 MiB H2D copies
  // from pinned memory; thread B allocates 8 GiB at the start, after a free and a pause.
  void* host; CK(cudaMallocHost(&host, 256 * MiB));
  void* dev; CK(cudaMalloc(&dev, 256 * MiB));
  for (int with = 0; with < 2; with++) {
    for (int rep = 0; rep < 4; rep++) {
      churn(); pause_ms(250);
      std::atomic<bool> go{false}; double alloc_ms = 0; void* p = nullptr;
      std::thread b([&] { while (!go) {} auto a = clk::now(); if (with) CK(cudaMalloc(&p, 8 * GiB)); alloc_ms = ms(a, clk::now()); });
      auto a = clk::now(); go = true;
      double enq_max = 0;
      for (int i = 0; i < 64; i++) {
        auto e0 = clk::now();
        CK(cudaMemcpyAsync((char*)dev + (i % 16) * 16 * MiB, (char*)host + (i % 16) * 16 * MiB, 16 * MiB, cudaMemcpyHostToDevice, s));
        enq_max = std::max(enq_max, ms(e0, clk::now()));
      }
      CK(cudaStreamSynchronize(s));
      double total = ms(a, clk::now()); b.join();
      printf("copies 1 GiB %s: %.3f ms (%.1f GB/s), longest enqueue %.3f ms, alloc %.3f ms\n",
             with ? "with an 8 GiB cudaMalloc beside" : "alone                          ", total, 1.073741824e3 / total, enq_max, alloc_ms);
      if (p) CK(cudaFree(p));
    }
  }
  return 0;
}
