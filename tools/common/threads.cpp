#include "tools/common/threads.h"

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

}  // namespace dkfac::tools
