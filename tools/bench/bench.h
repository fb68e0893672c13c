#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

/// `dkfac bench`: where a training step's time goes, SGD against K-FAC, and how close the K-FAC
/// kernels run to the machine's matrix-multiply peak. Numbers are measured in the run that prints them.
namespace dkfac::bench {

/// What to measure.
struct BenchConfig {
  std::vector<std::string> models = {"mlp", "cnn", "resnet20"};
  int64_t batch_size = 128;
  /// (factor_update_steps, inv_update_steps) pairs.
  std::vector<std::pair<int64_t, int64_t>> intervals = {{1, 10}, {10, 100}};
  std::vector<std::string> methods = {"eigen", "inverse"};
  /// Inverse-update periods measured per configuration (after warm-up); SGD runs as many steps as the
  /// longest K-FAC configuration of its model.
  int64_t cycles = 3;
  int64_t warmup_steps = 3;
  double damping = 0.003;  // kfac_pytorch v0.4.2's default, for a like-for-like comparison
  int threads = 0;         // 0: every core
  bool steps = true;       // the per-step benchmark
  bool kernels = true;     // the kernel benchmark
  std::vector<int64_t> kernel_dims = {64, 128, 256, 512, 1024, 2048, 4096};
  std::vector<int64_t> kernel_rows = {128, 8192};  // rows of the activations a factor is built from
  int64_t kernel_repeats = 5;
  int64_t seed = 0;
};

/// Mean, median and 90th percentile of one phase over the measured steps, in seconds.
struct Stats {
  double mean = 0.0;
  double median = 0.0;
  double p90 = 0.0;
};
Stats stats_of(std::vector<double> samples);

/// One optimiser configuration on one model.
struct StepResult {
  std::string model;
  std::string optimizer;  // "sgd" or "kfac"
  std::string method;     // eigen | inverse; empty for sgd
  int64_t factor_steps = 0;
  int64_t inv_steps = 0;
  int64_t measured_steps = 0;
  /// Phase name -> stats: step, forward_backward, factors, second_order, precondition, apply (KL clip and
  /// write-back), communication, optimizer.
  std::map<std::string, Stats> phases;
  double ratio_to_sgd = 0.0;  // mean K-FAC step / mean SGD step of the same model (1 for sgd)
};

/// One kernel at one size.
struct KernelResult {
  std::string kernel;  // sgemm (torch::mm), factor, eigh, inverse
  int64_t dim = 0;
  int64_t rows = 0;    // factor: rows of the activation matrix; sgemm: the square size; else 0
  double seconds = 0.0;  // median
  double gflops = 0.0;   // achieved, counting the FLOPs stated in kernel_flop_convention()
  double fraction_of_peak = 0.0;  // gflops / the best sgemm GFLOP/s of the same run
};

/// How FLOPs are counted per kernel, printed with the table.
const char* kernel_flop_convention();

std::vector<StepResult> run_steps(const BenchConfig& config, std::ostream& progress);
std::vector<KernelResult> run_kernels(const BenchConfig& config, std::ostream& progress);

/// Machine, threads and library versions, for the header of every report.
nlohmann::json environment(const BenchConfig& config);

/// Human-readable tables.
std::string format_steps(const std::vector<StepResult>& results);
std::string format_kernels(const std::vector<KernelResult>& results);

nlohmann::json to_json(const std::vector<StepResult>& results);
nlohmann::json to_json(const std::vector<KernelResult>& results);

}  // namespace dkfac::bench
