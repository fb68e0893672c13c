// `dkfac bench`: SGD against K-FAC per phase, and the kernels against the sgemm peak.
#include <fstream>
#include <iostream>

#include <nlohmann/json.hpp>

#include "tools/bench/bench.h"
#include "tools/cli/commands.h"
#include "tools/common/threads.h"

namespace dkfac::cli {
namespace {

struct BenchCli {
  dkfac::bench::BenchConfig config;
  std::vector<std::string> intervals = {"1,10", "10,100"};
  std::string json;
  bool no_steps = false;
  bool no_kernels = false;
  std::string allocator;
};

/// `dkfac bench`: SGD against K-FAC per phase, and the kernels against the sgemm peak, in one run.
int run_bench(BenchCli cli) {
  auto& c = cli.config;
  c.intervals.clear();
  for (const auto& text : cli.intervals) {
    const auto comma = text.find(',');
    TORCH_CHECK(comma != std::string::npos, "--intervals takes FACTOR,INVERSE pairs such as 10,100, got '", text, "'");
    int64_t f = 0, i = 0;
    try {
      f = std::stoll(text.substr(0, comma));
      i = std::stoll(text.substr(comma + 1));
    } catch (const std::exception&) {
      TORCH_CHECK(false, "--intervals takes FACTOR,INVERSE pairs such as 10,100, got '", text, "'");
    }
    TORCH_CHECK(f > 0 && i > 0, "--intervals must be positive, got '", text, "'");
    c.intervals.emplace_back(f, i);
  }
  for (const auto& m : c.models) {
    TORCH_CHECK(m == "mlp" || m == "cnn" || m == "resnet20", "--models takes mlp, cnn, resnet20, got '", m, "'");
  }
  // Every argument is checked before anything runs (a bad --methods used to stop the run after SGD's benchmark, an
  // unwritable --json after the whole run, and --kernel-repeats 0 printed inf and nan).
  for (const auto& m : c.methods) {
    TORCH_CHECK(m == "eigen" || m == "inverse", "--methods takes eigen, inverse, got '", m, "'");
  }
  TORCH_CHECK(c.batch_size >= 1, "--batch-size must be >= 1, got ", c.batch_size);
  TORCH_CHECK(c.cycles >= 1, "--cycles must be >= 1, got ", c.cycles);
  TORCH_CHECK(c.warmup_steps >= 0, "--warmup must be >= 0, got ", c.warmup_steps);
  TORCH_CHECK(c.kernel_repeats >= 1, "--kernel-repeats must be >= 1, got ", c.kernel_repeats);
  for (const auto d : c.kernel_dims) TORCH_CHECK(d >= 1, "--kernel-dims must be >= 1, got ", d);
  for (const auto r : c.kernel_rows) TORCH_CHECK(r >= 1, "--kernel-rows must be >= 1, got ", r);
  if (!cli.json.empty()) {
    std::ofstream probe(cli.json, std::ios::app);  // opened now, written at the end
    TORCH_CHECK(probe, "cannot write --json file '", cli.json, "'");
  }
  c.steps = !cli.no_steps;
  c.kernels = !cli.no_kernels;
  const auto threads = dkfac::tools::configure_threads(c.threads);
  auto env = dkfac::bench::environment(c);
  env["threads"] = threads;
  env["allocator"] = cli.allocator;
  std::cout << "bench: " << env.dump() << std::endl;
  nlohmann::json out = {{"environment", env}};
  std::string tables;
  if (c.steps) {
    const auto steps = dkfac::bench::run_steps(c, std::cerr);
    out["steps"] = dkfac::bench::to_json(steps);
    tables += dkfac::bench::format_steps(steps) + "\n";
  }
  if (c.kernels) {
    const auto kernels = dkfac::bench::run_kernels(c, std::cerr);
    out["kernels"] = dkfac::bench::to_json(kernels);
    tables += dkfac::bench::format_kernels(kernels);
  }
  std::cout << tables << std::flush;
  if (!cli.json.empty()) {
    std::ofstream file(cli.json);
    TORCH_CHECK(file, "cannot write --json file '", cli.json, "'");
    file << out.dump(2) << std::endl;
    std::cout << "bench: " << cli.json << std::endl;
  }
  return 0;
}

}  // namespace

Command add_bench_command(CLI::App& app) {
  auto cli = std::make_shared<BenchCli>();
  auto* bench = app.add_subcommand("bench", "time SGD and K-FAC steps per phase, and the K-FAC kernels against sgemm");
  bench->add_option("--models", cli->config.models, "mlp cnn resnet20")->capture_default_str();
  bench->add_option("--batch-size", cli->config.batch_size, "examples per step")->capture_default_str();
  bench->add_option("--intervals", cli->intervals, "FACTOR,INVERSE update intervals")->capture_default_str();
  bench->add_option("--methods", cli->config.methods, "eigen inverse")->capture_default_str();
  bench->add_option("--cycles", cli->config.cycles, "inverse periods measured per K-FAC configuration")
      ->capture_default_str();
  bench->add_option("--warmup", cli->config.warmup_steps, "unmeasured steps first")->capture_default_str();
  bench->add_option("--damping", cli->config.damping,
                    "K-FAC damping; 0.003 is kfac_pytorch's example-script default, the setting of the step-time "
                    "comparison with kfac_pytorch (docs/PERFORMANCE.md); a step's operations do not depend on it")
      ->capture_default_str();
  bench->add_option("--threads", cli->config.threads, "intra-op threads (0: every core)")->capture_default_str();
  bench->add_option("--kernel-dims", cli->config.kernel_dims, "factor dimensions of the kernel benchmark")
      ->capture_default_str();
  bench->add_option("--kernel-rows", cli->config.kernel_rows, "activation rows a factor is built from")
      ->capture_default_str();
  bench->add_option("--kernel-repeats", cli->config.kernel_repeats, "timed calls per kernel and size")
      ->capture_default_str();
  bench->add_flag("--no-steps", cli->no_steps, "skip the per-step benchmark");
  bench->add_flag("--no-kernels", cli->no_kernels, "skip the kernel benchmark");
  bench->add_option("--json", cli->json, "also write the results as JSON to this file");

  return {bench, [cli](const Invocation& invocation) {
    cli->allocator = invocation.allocator;
    return run_bench(*cli);
  }};
}

}  // namespace dkfac::cli
