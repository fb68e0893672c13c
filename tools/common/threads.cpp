#include "tools/common/threads.h"

#include <malloc.h>

#include <algorithm>
#include <thread>

#include <torch/torch.h>

namespace dkfac::tools {

std::string configure_threads(int threads) {
  const int n = threads > 0 ? threads : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  torch::set_num_threads(n);
  return std::to_string(n) + (n == 1 ? " LibTorch thread" : " LibTorch threads") +
         (at::hasMKL() ? " (MKL's too)" : "");
}

std::string configure_allocator() {
#ifdef __GLIBC__
  // Every allocation comes from the heap (no mmap: glibc caps the mmap threshold at 32 MiB, and a 4096 x
  // 4096 float factor is 64 MiB), and the heap's top is returned to the system only beyond 1 GiB of free
  // space. Freed blocks are then reused without page faults: building a 4096-dimensional factor from 128
  // rows took 170 ms with a fresh mapping per call and 50 ms without (dkfac bench kernels).
  constexpr int kTrimThreshold = 1 << 30;
  if (::mallopt(M_MMAP_MAX, 0) == 1 && ::mallopt(M_TRIM_THRESHOLD, kTrimThreshold) == 1) {
    return "glibc malloc: no mmap, trim threshold 1 GiB";
  }
  return "glibc malloc: defaults (mallopt refused)";
#else
  return "allocator unchanged";
#endif
}

}  // namespace dkfac::tools
