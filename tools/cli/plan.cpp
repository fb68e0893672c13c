// `dkfac plan`: every strategy's placement and predicted cost for a model, without training.
#include <algorithm>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

#include "tools/cli/commands.h"
#include "tools/cli/train_flags.h"
#include "tools/models/models.h"
#include "tools/models/paper_shapes.h"
#include "dkfac/strategy/time_model.h"
#include "tools/common/report_json.h"
#include "tools/plan/plan_report.h"

namespace dkfac::cli {
namespace {

struct PlanConfig {
  plan::PlanRequest request;
  bool json = false;
  bool per_rank = false;
  std::string strategy;       // "" or "auto"
  std::string rates_file;     // --rates
  std::string measure_file;   // --measure-rates
  double memory_budget_mb = 0;
  // Rates given as flags (override --rates); negative: not given.
  double allreduce_alpha_us = -1, allreduce_beta_ns = -1, broadcast_alpha_us = -1, broadcast_beta_ns = -1;
  double gflops = -1;
  double side_work_cost = -1;
  int rates_world_size = 0;
  std::vector<double> rate_scales;  // --rate-scales: factors, second order, preconditioning, communication
  bool fsdp = false;      // --fsdp
  int hsdp_replicas = 0;  // --hsdp R
};

bool any_rate_flag(const PlanConfig& c) {
  return c.allreduce_alpha_us >= 0 || c.allreduce_beta_ns >= 0 || c.broadcast_alpha_us >= 0 ||
         c.broadcast_beta_ns >= 0 || c.gflops > 0;
}

/// --measure-rates and --strategy auto.
int run_auto(const PlanConfig& c, plan::PlanRequest request) {
  strategy::Rates rates;
  bool have = false;
  if (!c.measure_file.empty()) {
    const int threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / request.nproc);
    rates = plan::measure_rates_in_process(request.nproc, threads, request.compute_method);
    std::ostringstream conditions;
    conditions << "dkfac plan --measure-rates, " << request.nproc << " in-process ranks on "
               << std::thread::hardware_concurrency() << " hardware threads";
    rates.conditions = conditions.str();
    std::ofstream out(c.measure_file);
    out << nlohmann::json(rates).dump(2) << "\n";
    out.close();
    TORCH_CHECK(out, "--measure-rates: could not write ", c.measure_file);
    if (c.strategy.empty()) {
      std::cerr << "rates written to " << c.measure_file << "\n";
      return 0;
    }
    have = true;
  } else if (!c.rates_file.empty()) {
    rates = read_rates(c.rates_file, "--rates");
    have = true;
  }
  TORCH_CHECK(have || any_rate_flag(c), "--strategy auto needs rates: --rates FILE (written by --measure-rates), "
              "--measure-rates FILE, or the rate flags (--gflops, --allreduce-alpha-us, ...)");
  TORCH_CHECK(have || c.gflops > 0, "--strategy auto without --rates needs at least --gflops (the link flags "
              "default to a free link)");
  if (!have) {
    rates.method = request.compute_method;
    rates.world_size = request.nproc;
    rates.ranks_per_node = 1;  // one rank per node: nothing shared
    rates.parallel_ranks = 1;
    rates.conditions = "given as flags";
  }
  if (c.rates_world_size > 0) rates.world_size = c.rates_world_size;
  if (c.allreduce_alpha_us >= 0) rates.allreduce.alpha = c.allreduce_alpha_us * 1e-6;
  if (c.allreduce_beta_ns >= 0) rates.allreduce.beta = c.allreduce_beta_ns * 1e-9;
  // A link given as flags has transport hardware of its own: it costs the same while the ranks compute.
  if (!have || c.allreduce_alpha_us >= 0 || c.allreduce_beta_ns >= 0) rates.allreduce_busy = rates.allreduce;
  if (c.broadcast_alpha_us >= 0) rates.broadcast.alpha = c.broadcast_alpha_us * 1e-6;
  if (c.broadcast_beta_ns >= 0) rates.broadcast.beta = c.broadcast_beta_ns * 1e-9;
  if (c.side_work_cost >= 0) {
    rates.side_work_cost = c.side_work_cost;
    rates.conditions += (rates.conditions.empty() ? "" : "; ") + std::string("--side-work-cost given");
  }
  if (c.gflops > 0) {
    const double per_flop = 1e-9 / c.gflops;
    for (const auto kernel : math::kFactorKernels) rates.for_kernel(kernel) = {0, 0, per_flop};
    rates.precondition = {0, per_flop};
    rates.decomposition = {};
    rates.decomposition.per_cubed_dim = (rates.method == ComputeMethod::kEigen ? 9.0 : 1.0) * per_flop;
  }
  if (any_rate_flag(c)) rates.conditions += (rates.conditions.empty() ? "" : "; ") + std::string("flags override");
  if (!c.rate_scales.empty()) {  // 4 numbers: CLI11 checks the count
    strategy::RateScales scales;
    for (size_t k = 0; k < strategy::kCalibratedPhases.size(); ++k) scales[strategy::kCalibratedPhases[k]] = c.rate_scales[k];
    rates = strategy::scaled(rates, scales);
    rates.conditions += (rates.conditions.empty() ? "" : "; ") + std::string("scaled: ") + scales.describe();
  }
  request.memory_budget_bytes = static_cast<int64_t>(c.memory_budget_mb * 1024 * 1024);
  const auto report = plan::auto_report(request, rates);
  std::cout << (c.json ? report.json.dump(2) : report.text) << std::endl;
  return 0;
}

}  // namespace

Command add_plan_command(CLI::App& app) {
  auto config = std::make_shared<PlanConfig>();
  auto& r = config->request;
  auto* plan = app.add_subcommand(
      "plan",
      "predicted per-rank bytes, memory and FLOPs of every strategy for a model (docs/PLANS.md). Text output in "
      "KiB/MiB/GiB and kFLOP/MFLOP/GFLOP/TFLOP; --json prints raw bytes and FLOPs");
  std::string models;
  for (const auto& n : dkfac::models::model_names()) models += n + " | ";
  const auto& paper = dkfac::models::paper_model_names();
  for (const auto& n : paper) models += n + (n == paper.back() ? "" : " | ");
  plan->add_option("--model", r.model,
                   models + " (the last seven are paper-scale layer tables on ImageNet, BERT and GPT inputs)")
      ->capture_default_str();
  plan->add_option("--dataset", r.dataset,
                   "input shape: fashion-mnist | mnist | cifar10 for the small models (default fashion-mnist); "
                   "imagenet for resnet50, resnet152, densenet201 (3x224x224) and inception-v4 (3x299x299); "
                   "wikipedia for bert-large; webtext for gpt-1.3b and gpt-6.7b (default: the model's own)");
  auto* seq = plan->add_option("--seq-len", r.seq_len,
                               "sequence models only: tokens per sample, bert-large 1..512 (default 128), gpt-1.3b "
                               "and gpt-6.7b 1..2048 (default 2048)");
  plan->add_option("--nproc", r.nproc, "ranks")->capture_default_str()->check(CLI::Range(1, 4096));
  plan->add_option("--batch-size", r.batch_size, "examples per rank per step")->capture_default_str()
      ->check(CLI::PositiveNumber);
  add_choice(*plan, "--compute-method", r.compute_method, "eigen | inverse");
  plan->add_option("--spd-redundant-dim", r.spd_redundant_dim,
                   "SPD-KFAC: factors up to this dimension are decomposed on every rank (a training job measures it)")
      ->capture_default_str();
  plan->add_option("--grad-worker-fraction", r.grad_worker_fractions,
                   "extra KAISA rows at these fractions (repeatable; W = nproc x f must divide nproc), besides "
                   "f = 1, 1/2 and 1/P");
  plan->add_option("--shared-input-layers", r.shared_input_layers,
                   "regular expressions with one capture group (repeatable): the layers that read one input share "
                   "one A factor (bert-large: '(query|key|value)$'; docs/MATH.md section 2.7)");
  plan->add_option("--tp", r.tp,
                   "tensor-parallel ranks per group (transformers): column-parallel layers keep 1/tp of G, "
                   "row-parallel layers 1/tp of A (block-diagonal factors; docs/STRATEGIES.md, \"Tensor and "
                   "pipeline parallel\")")
      ->capture_default_str()->check(CLI::PositiveNumber);
  plan->add_flag("--tp-exact-factors", r.tp_exact,
                 "with --tp: Python's tensor_parallel_factors='exact' (each tensor-parallel rank holds the split layers "
                 "whole and gathers their split side and gradients; docs/MATH.md section 9.2)");
  plan->add_option("--pp", r.pp,
                   "pipeline stages (transformers): each holds its blocks' layers; the fullest stage is shown")
      ->capture_default_str()->check(CLI::PositiveNumber);
  plan->add_flag("--symmetric-comm", r.symmetric_comm,
                 "KAISA rows: factors, and inverses, sent as upper triangles");
  auto* fsdp = plan->add_flag("--fsdp", config->fsdp,
                              "every layer sharded by FSDP2 over all ranks: each strategy in the replicated placement, "
                              "and the owner placements (docs/STRATEGIES.md, \"Sharded models\")");
  plan->add_option("--hsdp", config->hsdp_replicas,
                   "HSDP with this many replicas (dividing --nproc), each sharding every layer over nproc / replicas "
                   "ranks: as --fsdp")
      ->check(CLI::PositiveNumber)->excludes(fsdp);
  plan->add_flag("--per-rank", config->per_rank,
                 "text: every rank's row and every layer's placement (the default when --nproc <= 8 and the model "
                 "has <= 32 K-FAC layers; otherwise min / median / max over ranks)");
  plan->add_flag("--json", config->json, "print JSON (raw bytes and FLOPs, every rank) instead of tables");
  // --- strategy auto (docs/STRATEGIES.md, "Choosing automatically")
  const char* kAuto = "Strategy auto";
  plan->add_option("--strategy", config->strategy,
                   "auto: instead of every strategy's bytes, predict every candidate's step time (from --rates or the "
                   "rate flags) and memory, and print strategy auto's pick")
      ->check(CLI::IsMember({"auto"}))->group(kAuto);
  plan->add_option("--rates", config->rates_file, "rates JSON written by --measure-rates (strategy auto)")->group(kAuto);
  plan->add_option("--measure-rates", config->measure_file,
                   "measure this machine's rates on --nproc ranks that are threads of this process (Gloo on "
                   "loopback, cores / nproc intra-op threads each, CPU float32, --compute-method), write them to "
                   "this JSON file and stop (with --strategy auto: go on and plan with them)")
      ->group(kAuto);
  plan->add_option("--factor-update-steps", r.factor_update_steps, "strategy auto: steps between factor updates")
      ->capture_default_str()->check(CLI::PositiveNumber)->group(kAuto);
  plan->add_option("--second-order-lag", r.second_order_lag,
                   "steps between starting a second-order update and installing it (docs/MATH.md section 2.8): "
                   "memory holds the update in flight; strategy auto prices its decompositions beside the steps")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  plan->add_option("--pad-widths", r.pad_widths,
                   "the stacks of layers of one shape held padded to a multiple of this (docs/MATH.md section 2.9): "
                   "memory holds the pad, the products are priced at the padded widths")
      ->capture_default_str()->check(CLI::PositiveNumber);
  plan->add_option("--inv-update-steps", r.inv_update_steps, "strategy auto: steps between second-order updates")
      ->capture_default_str()->check(CLI::PositiveNumber)->group(kAuto);
  plan->add_option("--memory-budget-mb", config->memory_budget_mb,
                   "strategy auto: K-FAC memory a rank may hold, MiB (0: no budget)")
      ->capture_default_str()->check(CLI::NonNegativeNumber)->group(kAuto);
  plan->add_option("--allreduce-alpha-us", config->allreduce_alpha_us, "rate: allreduce start-up, microseconds (also while the ranks compute)")
      ->check(CLI::NonNegativeNumber)->group(kAuto);
  plan->add_option("--allreduce-beta-ns", config->allreduce_beta_ns, "rate: allreduce nanoseconds per byte")
      ->check(CLI::NonNegativeNumber)->group(kAuto);
  plan->add_option("--broadcast-alpha-us", config->broadcast_alpha_us, "rate: broadcast start-up, microseconds")
      ->check(CLI::NonNegativeNumber)->group(kAuto);
  plan->add_option("--broadcast-beta-ns", config->broadcast_beta_ns, "rate: broadcast nanoseconds per byte")
      ->check(CLI::NonNegativeNumber)->group(kAuto);
  plan->add_option("--gflops", config->gflops,
                   "rate: one FLOP rate for factors, decompositions (d^3 per inverse, 9 d^3 per eigh) and "
                   "preconditioning, replacing those of --rates")
      ->check(CLI::PositiveNumber)->group(kAuto);
  plan->add_option("--side-work-cost", config->side_work_cost,
                   "rate: the share of a decomposition's time that the steps it runs beside lose, 0 to 1 "
                   "(--second-order-lag; measured by --measure-rates; 1 where not given: priced as on the step)")
      ->check(CLI::Range(0.0, 1.0))->group(kAuto);
  plan->add_option("--rates-world-size", config->rates_world_size,
                   "rate flags: ranks the link rates hold for (default --nproc)")
      ->check(CLI::PositiveNumber)->group(kAuto);
  plan->add_option("--rate-scales", config->rate_scales,
                   "4 numbers: multiply the factor, second-order, preconditioning and communication rates by them, "
                   "as strategy auto's re-check does with what a job measured (its 'measured / predicted' line)")
      ->delimiter(',')->expected(4)->check(CLI::PositiveNumber)->group(kAuto);

  return {plan, [config, seq](const Invocation&) {
            plan::PlanRequest request = config->request;
            TORCH_CHECK(seq->count() == 0 || request.seq_len >= 1, "--seq-len must be >= 1, got ", request.seq_len);
            TORCH_CHECK(!request.tp_exact || request.tp > 1, "--tp-exact-factors goes with --tp T > 1 (the split "
                        "layers held whole on each tensor-parallel rank); without it there is no split to gather");
            // FSDP and HSDP shard over the data-parallel ranks: all of them under --tp 1 --pp 1.
            const int dp = request.nproc / std::max(1, request.tp * request.pp);
            if (config->fsdp) request.shard_ranks = dp;
            if (config->hsdp_replicas > 0) {
              TORCH_CHECK(dp % config->hsdp_replicas == 0, "--hsdp ", config->hsdp_replicas,
                          " replicas must divide the ", dp, " data-parallel ranks (--nproc / (--tp x --pp))");
              request.shard_ranks = dp / config->hsdp_replicas;
            }
            TORCH_CHECK(request.shard_ranks == 0 || (config->measure_file.empty() && config->strategy.empty()),
                        "--fsdp and --hsdp print the placements' bytes and memory; strategy auto does not choose among "
                        "sharded placements yet");
            TORCH_CHECK(request.tp * request.pp == 1 || (config->measure_file.empty() && config->strategy.empty()),
                        "--tp and --pp print each strategy's bytes and memory; strategy auto does not plan tensor or "
                        "pipeline parallel jobs yet");
            if (!config->measure_file.empty() || !config->strategy.empty()) return run_auto(*config, request);
            const auto report = plan::plan_report(request);
            std::cout << (config->json ? report.json.dump(2) : plan::plan_text(report, config->per_rank)) << std::endl;
            return 0;
          }};
}

}  // namespace dkfac::cli
