#pragma once

#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "dkfac/assign/assignment.h"
#include "dkfac/comm/communicator.h"
#include "dkfac/layers/kfac_layer.h"
#include "dkfac/options.h"

namespace dkfac::strategy {

/// KAISA (Pauloski et al., SC21) over a communicator; with grad_worker_fraction 1 it is SC20's
/// D-KFAC (KFAC-opt). It decides which rank does which piece of second-order and preconditioning
/// work (an assign::Assignment) and runs the collectives between the preconditioner's phases:
/// factor allreduce (world), second-order broadcast (columns, when W > 1), preconditioned-gradient
/// broadcast (rows, when W < P). Groups are created in the constructor, in the same order on every rank.
class Kaisa {
 public:
  Kaisa(std::shared_ptr<comm::Communicator> communicator, const std::vector<KfacLayer>& layers, const Options& options);

  const assign::Assignment& assignment() const { return assignment_; }
  comm::Communicator& communicator() { return *communicator_; }

  /// Averages each defined factor batch over all ranks, in place; all collectives in flight together.
  void reduce_factors(std::vector<std::pair<torch::Tensor, torch::Tensor>>& batches);

  /// True when this rank computes A's / G's second-order part of `layer`.
  bool computes_a(size_t layer) const { return assignment_.layers[layer].a_worker == rank_; }
  bool computes_g(size_t layer) const { return assignment_.layers[layer].g_worker == rank_; }
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
  assign::Assignment assignment_;
  int rank_;
  bool symmetric_comm_;
  std::vector<comm::GroupId> column_groups_;  // per column; kWorld when the column is the world
  std::vector<comm::GroupId> row_groups_;     // per row
};

/// Packs the upper triangle (diagonal included) of a square matrix [n, n] -> [n (n + 1) / 2].
torch::Tensor pack_upper(const torch::Tensor& matrix);
/// Inverse of pack_upper: a symmetric [n, n] matrix.
torch::Tensor unpack_upper(const torch::Tensor& packed, int64_t n);

}  // namespace dkfac::strategy
