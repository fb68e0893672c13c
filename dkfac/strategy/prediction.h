#pragma once

#include <cstdint>
#include <vector>

#include "dkfac/strategy/step_plan.h"

/// Predicted cost of a StepPlan per rank, summed over the plan itself (no tensors, no processes): what
/// `dkfac plan` prints and what tests check against the counters a run measures.
namespace dkfac::strategy {

/// One rank's predicted figures. Bytes count a collective's payload once per call on each
/// participating rank (as comm::Communicator counts them). As JSON: tools/common/report_json.h.
struct RankCost {
  int64_t factor_bytes = 0;        ///< per factor step
  int64_t second_order_bytes = 0;  ///< per second-order step
  int64_t gradient_bytes = 0;      ///< per step (preconditioned gradients)
  /// K-FAC factors and second-order state held, at most: with StepPlan::second_order_lag, the update in flight's
  /// states and the factors they are computed from included (in_flight_bytes)
  int64_t memory_bytes = 0;
  /// StepPlan::second_order_lag > 0: what the update in flight holds beside the state in use, at most (the
  /// Preconditioner's second_order_in_flight_bytes): of each layer this rank computes a part of, a second copy of the
  /// sides it computes (and of the denominator where it computes both), and that layer's factors as they were when
  /// it started (where a factor update comes before it is installed)
  int64_t in_flight_bytes = 0;
  /// StepPlan::pad_widths > 1: the pad of this rank's stacks (LayerGroups), beside the layers' own state in
  /// memory_bytes: per group, units x (a'^2 - a^2) and members x (g'^2 - g^2), and for eigen members x (g' a' - g a),
  /// where a' and g' are the padded widths
  int64_t stack_padding_bytes = 0;
  double factor_flops = 0;         ///< per factor step: 2 rows d^2 per factor built here
  double decomposition_flops = 0;  ///< per second-order step: 9 d^3 per eigh, d^3 per inverse
  /// per step: 2 g a (g + a), twice for eigen (rotate in and out); a stacked group's at its padded widths
  double precondition_flops = 0;
};

/// Per-rank figures of `plan` with K-FAC tensors of `element_bytes` and `batch_size` samples per rank per step.
/// Factor FLOPs read each shape's rows_per_sample: in a job's plan a conv layer that had not run when the
/// plan was made counts 1 (set it from `KfacLayer::capture().rows_per_sample()` once the layer has run).
std::vector<RankCost> predict(const StepPlan& plan, int64_t element_bytes, int64_t batch_size);

}  // namespace dkfac::strategy
