#include "tools/common/memory.h"

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <iomanip>
#include <sstream>

#include <c10/util/Exception.h>

#include "tools/models/models.h"

namespace dkfac::tools {
namespace {

constexpr int64_t kMiB = 1024 * 1024;

std::string mib(int64_t bytes) {
  std::ostringstream out;
  out << (bytes + kMiB / 2) / kMiB << " MiB";
  return out.str();
}

// Examples and geometry of each dataset, as load_dataset() stores them.
struct DatasetSize {
  int64_t examples;  // train + test
  int64_t channels, height, width;
  int64_t bytes_per_pixel;
  int64_t largest_file;  // bytes of the largest file held while it is parsed (0: none)
};

DatasetSize dataset_size(train::Dataset dataset) {
  if (dataset == train::Dataset::kCifar10) return {60000, 3, 32, 32, 1, 10000 * 3073 * 2};
  if (dataset == train::Dataset::kSynthetic) return {8192 + 1024, 1, 28, 28, 4, 0};
  return {70000, 1, 28, 28, 1, 60000 * 784 * 2};  // fashion-mnist, mnist: file bytes + their tensor copy
}

}  // namespace

// Peak RSS of `dkfac train --dataset synthetic --model mlp --no-kfac --max-steps 20 --epochs 1 --batch-size 8`
// is 518 MiB on this project's machine with torch 2.11.0+cu130 from PyPI (`/usr/bin/time -v`, 2026-11-28), of
// which 28 MiB are the synthetic set and ~9 MiB the mlp's parameters and evaluation activations: LibTorch (a CUDA
// build, its libraries mapped even on the CPU), MKL, gloo and the program take ~480 MiB. (LibTorch 1.13.1 from
// Debian took ~170.) Checked against other peaks measured the same way (MiB, measured / estimated,
// `--max-steps 20 --epochs 1`): cnn fashion-mnist 912 / 1099, cnn fashion-mnist --no-kfac 865 / 997, cnn
// synthetic 915 / 984, autoencoder fashion-mnist 686 / 810, mlp synthetic (above) 518 / 545: the estimate is
// 5-20% above the peak.
const int64_t kRuntimeBytes = 500 * kMiB;

std::string WorkerMemory::describe() const {
  std::ostringstream out;
  out << mib(total()) << " (runtime " << mib(runtime) << ", dataset " << mib(dataset) << ", model and activations "
      << mib(model) << ", K-FAC " << mib(kfac) << ")";
  return out.str();
}

WorkerMemory estimate_worker_memory(const train::TrainConfig& config) {
  WorkerMemory m;
  m.runtime = kRuntimeBytes;
  const auto d = dataset_size(config.dataset);
  const int64_t pixels = d.channels * d.height * d.width;
  m.dataset = d.examples * (pixels * d.bytes_per_pixel + 8) + d.largest_file;
  torch::NoGradGuard no_grad;
  auto model = models::make_model(train::to_string(config.model), d.channels, d.height, d.width, 10);
  int64_t parameters = 0;
  for (const auto& p : model->parameters()) parameters += p.numel();
  // One example's activations, summed over the model's top-level modules; a batch saves them for backward
  // and holds their gradients (x 2); K-FAC captures layer inputs and output gradients too (x 2 more).
  int64_t activations = 0;
  auto x = torch::zeros({1, d.channels, d.height, d.width});
  for (auto& module : *model) {
    x = module.forward(x);
    activations += x.numel();
  }
  const int64_t activation_bytes = config.batch_size * activations * 4 * (config.kfac ? 4 : 2);
  // Evaluation runs batches of up to 1000 test examples (without gradients); the allocator keeps those pages.
  const int64_t test_examples = config.dataset == train::Dataset::kSynthetic ? 1024 : 10000;
  const int64_t eval_batch = std::min<int64_t>(1000, config.eval_examples > 0 ? config.eval_examples : test_examples);
  m.model = parameters * 4 * 4 + activation_bytes + eval_batch * activations * 4;
  if (config.kfac) {
    for (const auto& p : model->named_parameters()) {
      // A factor (inputs + bias) and G factor (outputs) of every Linear/Conv2d weight.
      if (p.key().find("weight") == std::string::npos || p.value().dim() < 2) continue;
      const int64_t g = p.value().size(0);
      const int64_t a = p.value().numel() / g + 1;
      m.kfac += (a * a + g * g) * 4 * 3;
    }
  }
  return m;
}

std::optional<int64_t> parse_mem_available(const std::string& meminfo) {
  std::istringstream in(meminfo);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("MemAvailable:", 0) != 0) continue;
    std::istringstream fields(line.substr(13));
    int64_t value = -1;
    std::string unit;
    if (!(fields >> value) || value < 0) return std::nullopt;
    fields >> unit;
    if (unit == "kB") return value * 1024;
    if (unit.empty()) return value;
    return std::nullopt;
  }
  return std::nullopt;
}

void check_workers_fit(int nproc, const WorkerMemory& per_worker, int64_t available) {
  const int64_t needed = static_cast<int64_t>(nproc) * per_worker.total();
  TORCH_CHECK(needed <= available, "--nproc ", nproc, " workers need about ", mib(needed), " (", nproc, " x ",
              per_worker.describe(), ") but the machine has ", mib(available),
              " available (MemAvailable in /proc/meminfo); use a smaller --nproc (at most ",
              std::max<int64_t>(1, available / std::max<int64_t>(1, per_worker.total())),
              " here), or set ", kSkipMemoryCheckVariable, "=1 to start them anyway");
}

void check_memory_for_workers(const train::TrainConfig& config, int nproc) {
  const char* skip = std::getenv(kSkipMemoryCheckVariable);
  if (skip != nullptr && std::string(skip) == "1") return;
  std::ifstream in("/proc/meminfo");
  if (!in) return;
  std::stringstream text;
  text << in.rdbuf();
  const auto available = parse_mem_available(text.str());
  if (!available) return;
  check_workers_fit(nproc, estimate_worker_memory(config), *available);
}

}  // namespace dkfac::tools
