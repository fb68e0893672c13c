#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "dkfac/comm/communicator.h"
#include "dkfac/layers/kfac_layer.h"
#include "dkfac/options.h"
#include "dkfac/strategy/factor_pipeline.h"
#include "dkfac/strategy/measure.h"
#include "dkfac/strategy/step_plan.h"

namespace dkfac::strategy {

/// The layers as plans see them: name, dimensions and rows per sample (as last observed by their capture).
std::vector<assign::LayerShape> layer_shapes(const std::vector<KfacLayer>& layers);

/// Executes a job's StepPlan (step_plan.h; docs/MATH.md section 5): runs the collectives the plan names
/// between the preconditioner's phases, and answers for this rank which work the plan gives it. The
/// plan is computed once, in the constructor; in one process (no communicator, or a world of one) it is
/// StepPlan::single_process and every collective is a no-op. Groups are created in the constructor, in
/// the same order on every rank.
class StepExecutor {
 public:
  /// Collective when `communicator` spans more than one rank: every rank constructs it with the same
  /// layers and options. SPD-KFAC measures the transport and decomposition speed here unless
  /// Options::spd() fixes its choices.
  StepExecutor(std::shared_ptr<comm::Communicator> communicator, std::vector<KfacLayer>& layers,
              const Options& options);

  const StepPlan& plan() const { return plan_; }
  /// SPD-KFAC on several ranks: what it measured before planning (measure_spd); a default SpdMeasurement
  /// (redundant_dim -1) where Options::spd() fixed both choices and for every other strategy.
  const SpdMeasurement& spd_measurement() const { return spd_measurement_; }
  /// The factor pipeline (SPD-KFAC, or KAISA's buckets in hooks), or nullptr.
  const FactorPipeline* pipeline() const { return pipeline_.get(); }
  /// The plan in words (StepPlan::describe), with SPD-KFAC's measurements and the pipeline's grouping.
  std::string describe(bool per_layer = true) const;
  /// The factor pipeline's grouping in words (FactorPipeline::describe), once: after the step that chose it
  /// from the profiled steps (SPD-KFAC's measured fusion). "" before, after, and for every other plan.
  std::string take_plan_change();

  /// This rank, as the plan numbers it.
  int rank() const { return rank_; }
  /// This rank's share of the plan.
  bool builds_factors(size_t layer) const { return plan_.builds_factors(layer, rank_); }
  bool computes_a(size_t layer) const { return plan_.computes_a(layer, rank_); }
  bool computes_g(size_t layer) const { return plan_.computes_g(layer, rank_); }
  bool preconditions(size_t layer) const { return plan_.preconditions(layer, rank_); }
  bool keeps_factors(size_t layer) const { return plan_.keeps_factors(layer, rank_); }
  /// Owner placement (LayerFlow::owner_rows): V of `layer` stays with its owners; the front end moves the rows.
  bool owner_rows(size_t layer) const { return plan_.flows.at(layer).owner_rows; }
  /// How many ranks precondition `layer` (its owners under owner placement: one per row).
  size_t owners(size_t layer) const { return plan_.placement.layers.at(layer).grad_workers.size(); }
  /// Makes the guard's rows of owner-placed layers (Preconditioner::GuardReport: an owner's values, zeros on the
  /// other ranks) the same on every rank, in place: their mean over the layer's owners (one sum over the world),
  /// so that a flag is 1 only where every owner's is. `layers` names each row's layer; the other rows are left
  /// as they are. No collective without owner-placed rows or in one process.
  void agree_on_reports(torch::Tensor& rows, const std::vector<size_t>& layers);

  /// Called when capture is armed for a factor step of `micro_batches` passes.
  void arm_factor_step(int64_t micro_batches);
  /// Averages each defined factor batch over all ranks, in place, as the plan's reduction says.
  void reduce_factors(std::vector<std::pair<torch::Tensor, torch::Tensor>>& batches);
  /// Broadcasts second-order parts inside each layer's column from the ranks that computed them,
  /// then rebuilds eigen denominators with `damping`. Layers without factors yet are skipped.
  void share_second_order(std::vector<KfacLayer>& layers, double damping);
  /// Broadcasts each layer's V [g, a] along rows from its grad worker; receivers pass buffers. Layers under
  /// owner placement are left as they are (their V stays with the owner).
  void share_gradients(std::vector<torch::Tensor>& preconditioned);

  /// Every layer's whole K-FAC state (KfacLayer::state(): factors and second-order state), as the rank that
  /// holds it has it, on every rank: the form of a checkpoint that does not depend on the world size.
  /// Factors come from the layer's builder (DP-KFAC's owner; KAISA and SPD-KFAC: every rank already holds the
  /// same averaged factors), second-order state from the layer's grad worker in rank 0's row. Collective
  /// (every rank calls it, e.g. from Preconditioner::save); in one process it returns `layers`' own states.
  std::vector<std::map<std::string, torch::Tensor>> gather_states(const std::vector<KfacLayer>& layers) const;
  /// True when the plan gives this rank layer `layer`'s second-order state (it preconditions or decomposes it).
  bool holds_second_order(size_t layer) const { return preconditions(layer) || computes_a(layer) || computes_g(layer); }

 private:
  /// Starts `op` on `tensor`, or on its packed upper triangle when `triangle`; in that case `finish`
  /// gets the step that unpacks the result back into `tensor`.
  comm::Handle start(torch::Tensor& tensor, bool triangle, const std::function<comm::Handle(torch::Tensor)>& op,
                     std::vector<std::function<void()>>& finish);

  std::shared_ptr<comm::Communicator> communicator_;  // nullptr in one process
  int rank_ = 0;
  StepPlan plan_;
  SpdMeasurement spd_measurement_;            // SPD-KFAC: what the placement was chosen from
  std::vector<comm::GroupId> column_groups_;  // per column; kWorld when the column is the world
  std::vector<comm::GroupId> row_groups_;     // per row
  std::unique_ptr<FactorPipeline> pipeline_;
  bool grouping_announced_ = false;
};

}  // namespace dkfac::strategy
