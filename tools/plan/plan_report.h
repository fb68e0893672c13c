#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "dkfac/options.h"

/// `dkfac plan`: every strategy's placement and predicted per-rank cost for a model (tools model or
/// paper-scale table), as JSON and as text. Nothing runs: shapes in, strategy::make_step_plan and
/// strategy::predict (the plan a job of those options would run) out.
namespace dkfac::plan {

/// What to plan. An empty `dataset` takes the model's own (fashion-mnist, imagenet or wikipedia);
/// `seq_len` 0 means not given (bert-large then uses 128).
struct PlanRequest {
  std::string model = "cnn";
  std::string dataset;
  int nproc = 4;
  int64_t batch_size = 128;
  ComputeMethod compute_method = ComputeMethod::kInverse;
  int64_t spd_redundant_dim = 0;
  int64_t seq_len = 0;
  bool symmetric_comm = false;
  /// Extra KAISA rows ("kaisa f=1/4", ...) besides f = 1, 1/2 and 1/P; each must give W dividing nproc.
  std::vector<double> grad_worker_fractions;
};

/// A plan: the JSON that `dkfac plan --json` prints, and each strategy's per-layer placement as text
/// (strategy::StepPlan::describe; too long for the JSON at 64 ranks).
struct PlanReport {
  nlohmann::json json;
  std::vector<std::string> placements;  ///< one per json["strategies"] entry
};

/// The plan: JSON with model, dataset, nproc, batch_size, compute_method, data_parallel_bytes_per_step,
/// parameters, kfac_parameters, model_state_bytes, layers[], strategies[] (strategy, system, grad_workers,
/// factor_reduction, factor_triangles, broadcast_gradients, ranks[] with the strategy::RankCost fields plus update_bytes / update_flops, summary{min, median, max,
/// sum} per field, update_ring_bytes). Throws c10::Error naming the flag (--model, --dataset, --seq-len)
/// for a bad request.
PlanReport plan_report(const PlanRequest& request);

/// The text tables of a plan_report(), in human units. `per_rank`: every rank's row and every layer's
/// placement; otherwise only when nproc <= 8 and the model has <= 32 K-FAC layers, else min / median /
/// max over ranks.
std::string plan_text(const PlanReport& report, bool per_rank);

}  // namespace dkfac::plan
