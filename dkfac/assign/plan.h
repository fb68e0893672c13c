#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dkfac/assign/assignment.h"

/// Predicted cost of a distributed K-FAC placement per rank, from layer shapes alone (no tensors, no
/// processes): what `dkfac plan` prints and what tests check against the measured counters.
namespace dkfac::assign {

/// How the work moves, as far as the prediction needs it.
struct PlanInputs {
  enum class Flow {
    kKaisa,  ///< factors allreduced after backward (triangles if symmetric_comm)
    kSpd,    ///< factors allreduced as triangles; second order broadcast unless decomposed everywhere
    kDp,     ///< no factor or second-order traffic; owners build factors from their own batch
  };
  Flow flow = Flow::kKaisa;
  bool eigen = true;            ///< eigen method (else inverse)
  bool symmetric_comm = false;  ///< KAISA: factors and inverses as upper triangles
  int64_t element_bytes = 4;    ///< bytes per K-FAC tensor element
  int64_t batch_size = 1;       ///< samples per rank per step
};

/// One rank's predicted figures. Bytes count a collective's payload once per call on each
/// participating rank (as comm::Communicator counts them).
struct RankPlan {
  int64_t factor_bytes = 0;        ///< per factor step
  int64_t second_order_bytes = 0;  ///< per second-order step
  int64_t gradient_bytes = 0;      ///< per step (preconditioned gradients)
  int64_t memory_bytes = 0;        ///< K-FAC factors and second-order state held
  double factor_flops = 0;         ///< per factor step: 2 rows d^2 per factor built here
  double decomposition_flops = 0;  ///< per second-order step: 9 d^3 per eigh, d^3 per inverse
  double precondition_flops = 0;   ///< per step: 2 g a (g + a), twice for eigen (rotate in and out)
};

/// Per-rank predictions for `assignment` of `layers`.
std::vector<RankPlan> predict(const Assignment& assignment, const std::vector<LayerShape>& layers,
                              const PlanInputs& inputs);

}  // namespace dkfac::assign
