#include "tools/common/threads.h"

#include <dlfcn.h>
#include <malloc.h>

#include <algorithm>
#include <thread>

#include <torch/torch.h>

namespace dkfac::tools {

std::string configure_threads(int threads, int blas_threads) {
  const int n = threads > 0 ? threads : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  torch::set_num_threads(n);
  std::string blas = "BLAS threads unchanged";
  // Looked up at run time so that the programs still run against a BLAS that is not OpenBLAS.
  using SetThreads = void (*)(int);
  if (auto* set = reinterpret_cast<SetThreads>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) {
    const int b = blas_threads > 0 ? blas_threads : n;
    set(b);
    blas = "OpenBLAS " + std::to_string(b) + (b == 1 ? " thread" : " threads");
  }
  return std::to_string(n) + " LibTorch threads, " + blas;
}

std::string configure_allocator() {
#ifdef __GLIBC__
  // Allocations up to 32 MiB (glibc's largest mmap threshold) come from the heap, and the heap's top is
  // returned to the system only beyond 1 GiB of free space.
  constexpr int kMmapThreshold = 32 << 20;
  constexpr int kTrimThreshold = 1 << 30;
  if (::mallopt(M_MMAP_THRESHOLD, kMmapThreshold) == 1 && ::mallopt(M_TRIM_THRESHOLD, kTrimThreshold) == 1) {
    return "glibc malloc: mmap threshold 32 MiB, trim threshold 1 GiB";
  }
  return "glibc malloc: defaults (mallopt refused)";
#else
  return "allocator unchanged";
#endif
}

}  // namespace dkfac::tools
