#include "tools/bench/bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <numeric>
#include <optional>
#include <fstream>
#include <iomanip>
#include <sstream>
#include <thread>

#include <torch/torch.h>
#include <torch/version.h>

#include "dkfac/dkfac.h"
#include "dkfac/numbers.h"
#include "dkfac/math/gemm.h"
#include "dkfac/version.h"
#include "tools/models/models.h"

namespace dkfac::bench {
namespace {

// Milliseconds as the tables and messages here print them (dkfac/numbers.h).
constexpr auto ms = &milliseconds;

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Fashion-MNIST's shape for the mlp and the cnn, CIFAR-10's for the ResNet it was designed for.
std::vector<int64_t> input_shape(const std::string& model, int64_t batch) {
  if (model == "resnet20") return {batch, 3, 32, 32};
  return {batch, 1, 28, 28};
}

// The step, forward and backward, each K-FAC phase (dkfac/phase.h) and the optimizer.
std::vector<std::string> phase_names() {
  std::vector<std::string> names = {"step", "forward_backward"};
  for (const auto phase : kAllPhases) names.push_back(to_string(phase));
  names.push_back("optimizer");
  return names;
}
const std::vector<std::string> kPhases = phase_names();

// Runs `steps` measured steps (after `warmup`) of SGD, with K-FAC when `kfac_options` is given, on a fixed batch.
std::map<std::string, Stats> time_steps(const std::string& model_name, const BenchConfig& config,
                                        const std::optional<Options>& kfac_options, int64_t steps) {
  torch::manual_seed(config.seed);
  const auto shape = input_shape(model_name, config.batch_size);
  auto model = models::make_model(model_name, shape[1], shape[2], shape[3], 10);
  model->train();
  const auto x = torch::randn(shape);
  const auto y = torch::randint(10, {config.batch_size});
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9).weight_decay(5e-4));
  std::unique_ptr<Preconditioner> kfac;
  if (kfac_options) kfac = std::make_unique<Preconditioner>(model.ptr(), *kfac_options);

  std::map<std::string, std::vector<double>> samples;
  for (int64_t s = 0; s < config.warmup_steps + steps; ++s) {
    sgd.zero_grad();
    const auto t0 = Clock::now();
    auto loss = torch::nn::functional::cross_entropy(model->forward(x), y);
    loss.backward();
    PhaseTimes k;
    if (kfac) {
      kfac->step();
      k = kfac->last_step_times();
    }
    const double before_optimizer = seconds_since(t0);
    const auto t1 = Clock::now();
    sgd.step();
    const double optimizer = seconds_since(t1);
    TORCH_CHECK(std::isfinite(loss.item<double>()), "bench: ", model_name, " produced a non-finite loss at step ", s);
    if (s < config.warmup_steps) continue;
    samples["step"].push_back(before_optimizer + optimizer);
    samples["forward_backward"].push_back(before_optimizer - k.total());
    for (const auto phase : kAllPhases) samples[to_string(phase)].push_back(k[phase]);
    samples["optimizer"].push_back(optimizer);
  }
  std::map<std::string, Stats> out;
  for (auto& [phase, values] : samples) out[phase] = stats_of(std::move(values));
  return out;
}

// Median wall time of `fn` over `repeats` calls (fewer when one call takes long), after one warm-up call.
double median_seconds(int64_t repeats, const std::function<void()>& fn) {
  fn();
  std::vector<double> times;
  const auto start = Clock::now();
  for (int64_t r = 0; r < repeats; ++r) {
    const auto t = Clock::now();
    fn();
    times.push_back(seconds_since(t));
    if (seconds_since(start) > 20.0) break;  // dimension 4096 decompositions take seconds each
  }
  return stats_of(times).median;
}

std::string read_cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) return line.substr(colon + 2);
    }
  }
  return "unknown";
}

}  // namespace

Stats stats_of(std::vector<double> samples) {
  Stats s;
  if (samples.empty()) return s;
  std::sort(samples.begin(), samples.end());
  double sum = 0.0;
  for (double v : samples) sum += v;
  s.mean = sum / static_cast<double>(samples.size());
  const auto n = samples.size();
  s.median = median(samples);
  // Nearest-rank percentile.
  const auto rank = static_cast<size_t>(std::ceil(0.9 * static_cast<double>(n)));
  s.p90 = samples[std::max<size_t>(rank, 1) - 1];
  return s;
}

std::vector<StepResult> run_steps(const BenchConfig& config, std::ostream& progress) {
  TORCH_CHECK(config.batch_size > 0, "bench: --batch-size must be positive, got ", config.batch_size);
  TORCH_CHECK(config.cycles > 0, "bench: --cycles must be positive, got ", config.cycles);
  TORCH_CHECK(config.warmup_steps >= 0, "bench: --warmup must be >= 0, got ", config.warmup_steps);
  std::vector<StepResult> results;
  for (const auto& model : config.models) {
    const int64_t sgd_steps = std::max<int64_t>(20, 10 * config.cycles);
    progress << "bench: " << model << " sgd, " << sgd_steps << " steps" << std::endl;
    StepResult sgd{model, "sgd", "", 0, 0, sgd_steps, time_steps(model, config, std::nullopt, sgd_steps), 1.0};
    const double sgd_mean = sgd.phases.at("step").mean;
    results.push_back(sgd);
    for (const auto& [factor_steps, inv_steps] : config.intervals) {
      for (const auto& method : config.methods) {
        TORCH_CHECK(method == "eigen" || method == "inverse", "bench: method must be eigen or inverse, got '",
                    method, "'");
        // Whole inverse periods, so that the mean is the amortised cost of a step.
        const int64_t steps = config.cycles * std::lcm(factor_steps, inv_steps);
        progress << "bench: " << model << " kfac " << method << " (" << factor_steps << "," << inv_steps << "), "
                 << steps << " steps" << std::endl;
        const auto options = Options()
                                 .lr(0.01)
                                 .damping(config.damping)
                                 .factor_decay(0.95)
                                 .kl_clip(0.001)
                                 .factor_update_steps(factor_steps)
                                 .inv_update_steps(inv_steps)
                                 .compute_method(method == "eigen" ? ComputeMethod::kEigen : ComputeMethod::kInverse);
        StepResult r{model, "kfac", method, factor_steps, inv_steps, steps,
                     time_steps(model, config, options, steps), 0.0};
        r.ratio_to_sgd = r.phases.at("step").mean / sgd_mean;
        results.push_back(r);
      }
    }
  }
  return results;
}

const char* kernel_flop_convention() {
  return "sgemm n x n x n: 2n^3 (torch::mm on LibTorch's threads); factor X^T X of "
         "X [rows, dim]: 2 rows dim^2, the work of the full GEMM (gram() multiplies only about half of it); "
         "eigh (syevd, with vectors): 4 dim^3; inverse (Cholesky + inverse from the factor): dim^3";
}

std::vector<KernelResult> run_kernels(const BenchConfig& config, std::ostream& progress) {
  torch::manual_seed(config.seed);
  std::vector<KernelResult> results;
  // The peak: LibTorch's own product, which its BLAS threads over LibTorch's threads.
  double peak = 0.0;
  for (int64_t n : {512, 1024, 2048}) {
    const auto a = torch::randn({n, n});
    const auto b = torch::randn({n, n});
    const double t = median_seconds(config.kernel_repeats, [&] { torch::mm(a, b); });
    const double gflops = 2.0 * n * n * n / t / 1e9;
    peak = std::max(peak, gflops);
    results.push_back({"sgemm", n, n, t, gflops, 0.0});
  }
  progress << "bench: sgemm peak " << std::fixed << std::setprecision(1) << peak << " GFLOP/s" << std::endl;
  for (int64_t dim : config.kernel_dims) {
    for (int64_t rows : config.kernel_rows) {
      const auto x = torch::randn({rows, dim});
      const double t = median_seconds(config.kernel_repeats, [&] { math::covariance(x); });
      results.push_back({"factor", dim, rows, t, 2.0 * rows * dim * dim / t / 1e9, 0.0});
    }
    // A well-conditioned symmetric positive definite factor like the ones training produces.
    auto factor = math::covariance(torch::randn({2 * dim, dim})) + torch::eye(dim);
    const double d3 = static_cast<double>(dim) * dim * dim;
    const double t_eigh = median_seconds(config.kernel_repeats, [&] { math::eigen_decompose(factor); });
    results.push_back({"eigh", dim, 0, t_eigh, 4.0 * d3 / t_eigh / 1e9, 0.0});
    const double t_inv = median_seconds(config.kernel_repeats, [&] { math::damped_inverse(factor, 0.003); });
    results.push_back({"inverse", dim, 0, t_inv, d3 / t_inv / 1e9, 0.0});
    progress << "bench: kernels at dim " << dim << " done" << std::endl;
  }
  for (auto& r : results) r.fraction_of_peak = r.gflops / peak;
  return results;
}

nlohmann::json environment(const BenchConfig& config) {
  return {{"cpu", read_cpu_model()},
          {"cores", std::thread::hardware_concurrency()},
          {"torch_threads", torch::get_num_threads()},
          {"blas", at::hasMKL() ? "MKL" : "not MKL"},
          {"libtorch", TORCH_VERSION},
          {"dkfac", DKFAC_VERSION_STRING},
          {"compiler", __VERSION__},
          {"batch_size", config.batch_size},
          {"damping", config.damping},
          {"seed", config.seed}};
}

std::string format_steps(const std::vector<StepResult>& results) {
  std::ostringstream out;
  out << "Per step, ms: mean / median / p90 over the measured steps (mean = amortised over whole inverse periods)\n";
  out << std::left << std::setw(10) << "model" << std::setw(20) << "optimizer" << std::right << std::setw(7)
      << "steps";
  for (const auto& phase : kPhases) out << std::setw(phase == "step" ? 26 : 22) << phase;
  out << std::setw(10) << "x SGD" << "\n";
  for (const auto& r : results) {
    const std::string name = r.optimizer == "sgd" ? "sgd"
                                                  : "kfac " + r.method + " (" + std::to_string(r.factor_steps) +
                                                        "," + std::to_string(r.inv_steps) + ")";
    out << std::left << std::setw(10) << r.model << std::setw(20) << name << std::right << std::setw(7)
        << r.measured_steps;
    for (const auto& phase : kPhases) {
      const auto& s = r.phases.at(phase);
      out << std::setw(phase == "step" ? 26 : 22) << ms(s.mean) + " / " + ms(s.median) + " / " + ms(s.p90);
    }
    out << std::setw(10) << std::fixed << std::setprecision(2) << r.ratio_to_sgd << "\n";
    out.unsetf(std::ios::fixed);
  }
  return out.str();
}

std::string format_kernels(const std::vector<KernelResult>& results) {
  std::ostringstream out;
  out << "Kernels (median time; FLOPs: " << kernel_flop_convention() << ")\n";
  out << std::left << std::setw(9) << "kernel" << std::right << std::setw(7) << "dim" << std::setw(7) << "rows"
      << std::setw(12) << "ms" << std::setw(10) << "GFLOP/s" << std::setw(10) << "of peak" << "\n";
  for (const auto& r : results) {
    out << std::left << std::setw(9) << r.kernel << std::right << std::setw(7) << r.dim << std::setw(7)
        << (r.rows ? std::to_string(r.rows) : "-") << std::setw(12) << ms(r.seconds) << std::fixed
        << std::setprecision(1) << std::setw(10) << r.gflops << std::setw(9) << 100.0 * r.fraction_of_peak << "%\n";
    out.unsetf(std::ios::fixed);
  }
  return out.str();
}

nlohmann::json to_json(const std::vector<StepResult>& results) {
  auto out = nlohmann::json::array();
  for (const auto& r : results) {
    nlohmann::json phases;
    for (const auto& [name, s] : r.phases) phases[name] = {{"mean_s", s.mean}, {"median_s", s.median}, {"p90_s", s.p90}};
    out.push_back({{"model", r.model}, {"optimizer", r.optimizer}, {"method", r.method},
                   {"factor_update_steps", r.factor_steps}, {"inv_update_steps", r.inv_steps},
                   {"measured_steps", r.measured_steps}, {"phases", phases}, {"ratio_to_sgd", r.ratio_to_sgd}});
  }
  return out;
}

nlohmann::json to_json(const std::vector<KernelResult>& results) {
  auto out = nlohmann::json::array();
  for (const auto& r : results) {
    out.push_back({{"kernel", r.kernel}, {"dim", r.dim}, {"rows", r.rows}, {"median_s", r.seconds},
                   {"gflops", r.gflops}, {"fraction_of_peak", r.fraction_of_peak}});
  }
  return out;
}

}  // namespace dkfac::bench
