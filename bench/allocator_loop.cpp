// A plain C++ training loop on the library, timed with and without dkfac::configure_allocator(): SGD on the
// tools' cnn, a fixed batch of 128 Fashion-MNIST-sized images, LibTorch's default threads. Prints the median
// and p90 step time. Built by tools/CMakeLists.txt as dkfac_allocator_loop:
//   build/bench/dkfac_allocator_loop [configure|default] [steps]
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "dkfac/dkfac.h"
#include "tools/bench/bench.h"
#include "tools/models/models.h"

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "default";
  const int steps = argc > 2 ? std::stoi(argv[2]) : 200;
  const std::string allocator = mode == "configure" ? dkfac::configure_allocator() : "glibc defaults";
  torch::manual_seed(0);
  auto model = dkfac::models::make_model("cnn", 1, 28, 28, 10);
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  const auto x = torch::randn({128, 1, 28, 28});
  const auto y = torch::randint(10, {128});
  std::vector<double> ms;
  for (int step = 0; step < steps + 10; ++step) {
    const auto start = std::chrono::steady_clock::now();
    sgd.zero_grad();
    torch::nn::functional::cross_entropy(model->forward(x), y).backward();
    sgd.step();
    const double t = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (step >= 10) ms.push_back(t);  // the first steps warm up
  }
  const auto stats = dkfac::bench::stats_of(ms);  // dkfac bench's median and nearest-rank p90
  std::printf("allocator_loop: %s (%s), torch %s, %d threads, cnn SGD batch 128, %d steps: median %.2f ms, p90 %.2f ms\n",
              mode.c_str(), allocator.c_str(), TORCH_VERSION, torch::get_num_threads(), steps, stats.median, stats.p90);
}
