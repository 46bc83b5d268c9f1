// After the device sat idle for a while, how long do the first small copies take?
#include <cuda_runtime.h>
#include <chrono>
#include <cstdio>
#include <thread>
using clk = std::chrono::steady_clock;
static double ms(clk::time_point a, clk::time_point b) { return std::chrono::duration<double, std::milli>(b - a).count(); }
int main() {
  cudaSetDevice(0); cudaFree(0);
  const size_t MiB = 1 << 20;
  void *h, *d; cudaMallocHost(&h, 64 * MiB); cudaMalloc(&d, 64 * MiB);
  cudaStream_t s; cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  for (int pause : {0, 20, 50, 100, 250, 250, 1000}) {
    std::this_thread::sleep_for(std::chrono::milliseconds(pause));
    double t[6];
    for (int i = 0; i < 6; i++) {
      auto a = clk::now();
      cudaMemcpyAsync(d, h, 4 * MiB, cudaMemcpyHostToDevice, s); cudaStreamSynchronize(s);
      t[i] = ms(a, clk::now());
    }
    auto a = clk::now();
    cudaMemcpyAsync(d, h, 64 * MiB, cudaMemcpyHostToDevice, s); cudaStreamSynchronize(s);
    double big = ms(a, clk::now());
    printf("pause %4d ms: 4 MiB copies %.3f %.3f %.3f %.3f %.3f %.3f ms; then 64 MiB %.3f ms (%.1f GB/s)\n", pause, t[0], t[1], t[2], t[3], t[4], t[5], big, 64 * MiB / big / 1e6);
  }
}
