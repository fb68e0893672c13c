#include "tools/common/threads.h"

#include <dlfcn.h>

#include <algorithm>
#include <thread>

#include <torch/torch.h>

namespace dkfac::tools {

std::string configure_threads(int threads) {
  const int n = threads > 0 ? threads : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  torch::set_num_threads(n);
  std::string blas = "BLAS threads unchanged";
  // Looked up at run time so that the programs still run against a BLAS that is not OpenBLAS.
  using SetThreads = void (*)(int);
  if (auto* set = reinterpret_cast<SetThreads>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) {
    set(1);
    blas = "OpenBLAS 1 thread";
  }
  return std::to_string(n) + " LibTorch threads, " + blas;
}

}  // namespace dkfac::tools
