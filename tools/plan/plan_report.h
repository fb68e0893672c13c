#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "dkfac/options.h"
#include "dkfac/strategy/rates.h"
#include "dkfac/strategy/time_model.h"

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
  /// `--strategy auto` (auto_report) only: the intervals its time is averaged over, and the K-FAC memory per
  /// rank a candidate may hold (0: no budget).
  int64_t factor_update_steps = 10;
  int64_t inv_update_steps = 100;
  int64_t memory_budget_bytes = 0;
  /// Options::second_order_lag: every plan's memory holds the update in flight (strategy::RankCost::in_flight_bytes),
  /// and strategy auto prices its decompositions beside the steps (Rates::side_work_cost).
  int64_t second_order_lag = 0;
  /// Options::pad_widths (its default, as a job has it): the stacks of each strategy's layers of one shape held
  /// padded to a multiple of this (strategy::RankCost::stack_padding_bytes), their products priced at the padded
  /// widths; 1: unpadded.
  int64_t pad_widths = Options().pad_widths();
  /// Sharded models (docs/STRATEGIES.md, "Sharded models"): 0 plans DDP; `shard_ranks` > 0 plans every layer
  /// sharded by rows over groups of that many ranks (FSDP: nproc; HSDP: nproc / replicas), each strategy in the
  /// replicated placement plus the owner placements (kaisa with one grad worker per replica; dp on a 1-D mesh).
  int shard_ranks = 0;
  /// Options::shared_input_layers: the layers whose names these group share one A factor (LayerShape::a_shared_with).
  std::vector<std::string> shared_input_layers;
  /// Tensor- and pipeline-parallel degrees (transformer tables only): the K-FAC strategies run over the
  /// nproc / (tp x pp) data-parallel ranks of each position, on the layers of each pipeline stage as tensor
  /// parallelism splits them for a group's first rank (block-diagonal factors); `shard_ranks` then counts
  /// data-parallel ranks.
  int tp = 1;
  int pp = 1;
  /// Python's tensor_parallel_factors='exact' (docs/MATH.md section 9.2): every tensor-parallel rank holds and
  /// preconditions the split layers whole, and all-gathers their split side and gradients over the tensor-parallel
  /// group (each stage's `tensor_parallel_bytes`); false: the block-diagonal default.
  bool tp_exact = false;
};

/// A plan: the JSON that `dkfac plan --json` prints, and each strategy's per-layer placement as text
/// (strategy::StepPlan::describe; too long for the JSON at 64 ranks).
struct PlanReport {
  nlohmann::json json;
  std::vector<std::string> placements;  ///< one per json["strategies"] entry
};

/// The plan: JSON with model, dataset, nproc, batch_size, compute_method, second_order_lag,
/// data_parallel_bytes_per_step, parameters, kfac_parameters, model_state_bytes, layers[], strategies[] (strategy, system, grad_workers,
/// factor_reduction, factor_triangles, broadcast_gradients, ranks[] with the strategy::RankCost fields plus update_bytes / update_flops, summary{min, median, max,
/// sum} per field, update_ring_bytes). Throws c10::Error naming the flag (--model, --dataset, --seq-len)
/// for a bad request.
PlanReport plan_report(const PlanRequest& request);

/// The text tables of a plan_report(), in human units. `per_rank`: every rank's row and every layer's
/// placement; otherwise only when nproc <= 8 and the model has <= 32 K-FAC layers, else min / median /
/// max over ranks.
std::string plan_text(const PlanReport& report, bool per_rank);

/// `dkfac plan --strategy auto`: strategy::choose_strategy over the model's layers with `rates`, as JSON
/// (model, nproc, batch_size, compute_method, intervals, memory_budget_bytes, rates, candidates[] with
/// name, strategy, grad_worker_fraction, symmetric_comm, step_seconds, the max over ranks of each phase's
/// seconds, memory_bytes, fits; chosen, fits, reason) and as text (the rates and their conditions, then
/// StrategyChoice::describe). Throws c10::Error when the rates were measured for another compute method.
struct AutoReport {
  nlohmann::json json;
  std::string text;
};
AutoReport auto_report(const PlanRequest& request, const strategy::Rates& rates);

/// `dkfac plan --measure-rates`: strategy::measure_rates on `nproc` ranks that are threads of this process
/// (Gloo over loopback, an in-process store), each with `threads` intra-op threads, CPU float32 kernels
/// of `method`. Returns rank 0's rates (every rank's are the same average).
strategy::Rates measure_rates_in_process(int nproc, int threads, ComputeMethod method);

}  // namespace dkfac::plan
