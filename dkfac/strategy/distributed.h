#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "dkfac/assign/assignment.h"
#include "dkfac/comm/communicator.h"
#include "dkfac/layers/kfac_layer.h"
#include "dkfac/options.h"
#include "dkfac/strategy/spd.h"

namespace dkfac::strategy {

/// Distributed K-FAC over a communicator, for the three systems of Options::strategy (docs/MATH.md
/// section 5). All share KAISA's W x (P/W) grid and differ in placement and in how factors move:
/// - KAISA (SC21; f = 1 is SC20's D-KFAC): factor allreduce over the world, from the capture hooks in
///   buckets (Options::update_factors_in_hook) or after backward,
///   second-order broadcast inside columns when W > 1, V broadcast along rows when W < P.
/// - SPD-KFAC: W = P; factor allreduce pipelined from capture time and fused (FactorPipeline); factors
///   below a measured size are decomposed by every rank, larger ones broadcast as upper triangles.
/// - DP-KFAC: W = 1; only a layer's owner captures and builds its factors (from its own batch), nothing
///   is reduced, the owner preconditions and broadcasts V to everyone.
/// It decides which rank does which piece of work (an assign::Assignment) and runs the collectives
/// between the preconditioner's phases. Groups are created in the constructor, in the same order on every rank.
class Distributed {
 public:
  /// Collective: every rank constructs it with the same layers and options. SPD-KFAC measures the
  /// transport and decomposition speed here unless Options fix its choices.
  Distributed(std::shared_ptr<comm::Communicator> communicator, std::vector<KfacLayer>& layers,
              const Options& options);

  Strategy strategy() const { return strategy_; }
  const assign::Assignment& assignment() const { return assignment_; }
  /// SPD-KFAC's factor pipeline, or nullptr.
  const FactorPipeline* pipeline() const { return pipeline_.get(); }
  /// Human-readable placement (and, for SPD-KFAC, the measurements and fusion grouping).
  std::string describe(const std::vector<KfacLayer>& layers) const;

  /// True when this rank captures activations and output gradients of `layer` and builds its factors
  /// (every rank, except under DP-KFAC where only the owner does).
  bool builds_factors(size_t layer) const;
  /// Called when capture is armed for a factor step of `micro_batches` passes.
  void arm_factor_step(int64_t micro_batches);
  /// Averages each defined factor batch over all ranks, in place (DP-KFAC: leaves them local).
  void reduce_factors(std::vector<std::pair<torch::Tensor, torch::Tensor>>& batches);

  /// True when this rank computes A's / G's second-order part of `layer`.
  bool computes_a(size_t layer) const;
  bool computes_g(size_t layer) const;
  /// True when this rank preconditions `layer` (it is in the layer's column and holds its second order).
  bool preconditions(size_t layer) const { return assignment_.is_grad_worker(layer, rank_); }

  /// Broadcasts second-order parts inside each layer's column from the ranks that computed them,
  /// then rebuilds eigen denominators with `damping`. Layers without factors yet are skipped.
  void share_second_order(std::vector<KfacLayer>& layers, ComputeMethod method, double damping);

  /// Broadcasts each layer's V [g, a] along rows from its grad worker; receivers pass buffers.
  void share_gradients(std::vector<torch::Tensor>& preconditioned);

 private:
  /// Starts `op` on `tensor`, or on its packed upper triangle when `symmetric` and symmetric_comm is
  /// on; in that case `finish` gets the step that unpacks the result back into `tensor`.
  comm::Handle start(torch::Tensor& tensor, bool symmetric, const std::function<comm::Handle(torch::Tensor)>& op,
                     std::vector<std::function<void()>>& finish);

  std::shared_ptr<comm::Communicator> communicator_;
  Strategy strategy_;
  assign::Assignment assignment_;
  int rank_;
  bool symmetric_comm_;
  std::string measurements_;                  // SPD-KFAC: what the placement was chosen from
  std::vector<comm::GroupId> column_groups_;  // per column; kWorld when the column is the world
  std::vector<comm::GroupId> row_groups_;     // per row
  std::unique_ptr<FactorPipeline> pipeline_;  // SPD-KFAC only
};

}  // namespace dkfac::strategy
